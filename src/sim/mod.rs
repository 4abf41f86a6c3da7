//! The vLLM-like simulator (DESIGN §12): [`engine`] is the pure, clock-agnostic model of one
//! rank (paged prefix cache, continuous batching, latency model, KV events as values); the
//! real-time HTTP/ZeroMQ fleet that serves it lives in `server`. Nothing here routes requests or
//! touches the selection core.

pub mod engine;
