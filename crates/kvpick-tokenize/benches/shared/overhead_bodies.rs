//! The request bodies of the overhead benchmark (`e2e/bench_overhead.py`'s `token_body` and
//! `chat_body`, with a fixed request number 7), for the Rust benches that time parts of the same
//! requests: `benches/body.rs` (the scanner and the hashes, included by path) and this crate's
//! `chat_body` bench (the tokenizer's read). One copy, so both time the same bytes.
#![allow(dead_code)] // each bench uses the bodies it needs

/// The overhead benchmark's token-id body of about `size` bytes.
pub fn token_body(size: usize) -> Vec<u8> {
    let mut ids = Vec::new();
    let mut len = r#"{"model":"m1","prompt":[7]}"#.len();
    let mut i = 0u64;
    while len < size {
        let id = (1000 + (i * 7919) % 120_000).to_string();
        len += id.len() + 1;
        ids.push(id);
        i += 1;
    }
    format!(r#"{{"model":"m1","prompt":[7,{}]}}"#, ids.join(",")).into_bytes()
}

/// The overhead benchmark's chat body of about `size` bytes.
pub fn chat_body(size: usize) -> Vec<u8> {
    let mut words = Vec::new();
    let mut len = 120;
    let mut i = 0u64;
    while len < size {
        let w = format!("word{}", (i * 7919) % 5000);
        len += w.len() + 1;
        words.push(w);
        i += 1;
    }
    format!(
        r#"{{"model": "m1", "messages": [{{"role": "system", "content": "You are a helpful assistant."}}, {{"role": "user", "content": "7 {}"}}]}}"#,
        words.join(" ")
    )
    .into_bytes()
}
