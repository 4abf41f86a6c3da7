//! KV events from the engines (vLLM, SGLang, TensorRT-LLM) over ZeroMQ.
//!
//! `decode` owns the wire format (DESIGN.md §8): the `[topic, seq, payload]` frames and every
//! msgpack encoding of an `EventBatch`. `ingest` owns the sockets: one SUB per rank, sequence
//! tracking, replay over DEALER, restarts. Neither touches the KV index directly: decoded events
//! go to the selection core, which owns the index.

pub mod decode;
pub mod ingest;
