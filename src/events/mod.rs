//! KV events: decoding the engines' ZeroMQ KV-event messages (vLLM, SGLang, TensorRT-LLM) into
//! typed events.
//!
//! This module owns the wire format only (DESIGN.md §8): the `[topic, seq, payload]` frames and
//! every msgpack encoding of an `EventBatch` the engines send. It must not touch the KV index or
//! the network: subscribing, replay, gap handling and applying events live elsewhere and consume
//! [`decode::EventBatch`].

pub mod decode;
