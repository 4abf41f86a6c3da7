//! Fuzzes the KV-event wire decoder (`src/sources/events/decode.rs`): arbitrary bytes as a payload, and
//! the same bytes split into 1..=4 ZeroMQ frames. Decoding must never panic, and whatever decodes
//! must satisfy the decoder's documented invariants.
//!
//! Input layout for the frame split (the seed corpus has `seed_framed_*` files in this form):
//! `[topic_len: u8][topic][seq: 8 bytes][payload...]`.

#![no_main]

use libfuzzer_sys::fuzz_target;

use kvpick::sources::events::decode::{decode_batch, decode_message, EventBatch, KvEvent, MAX_PAYLOAD_BYTES};

fn check(batch: &EventBatch) {
    for event in &batch.events {
        if let KvEvent::BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            media,
            ..
        } = event
        {
            assert!(
                media.iter().all(|m| (m.block as usize) < block_hashes.len()),
                "a multimodal key names a block the store does not hold"
            );
            assert!(
                token_ids.is_empty()
                    || token_ids.len() as u64 == block_hashes.len() as u64 * u64::from(*block_size),
                "token_ids length breaks the N x block_size invariant"
            );
            assert_ne!(*parent_block_hash, Some(0), "parent 0 must decode as None");
        }
    }
}

fuzz_target!(|data: &[u8]| {
    if data.len() > MAX_PAYLOAD_BYTES {
        return;
    }
    if let Ok(batch) = decode_batch(data) {
        check(&batch);
    }

    let Some((&topic_len, rest)) = data.split_first() else {
        return;
    };
    let (topic, rest) = rest.split_at(usize::from(topic_len).min(rest.len()));
    let (seq, payload) = rest.split_at(8.min(rest.len()));
    match decode_message(&[topic, seq, payload]) {
        Ok((t, s, batch)) => {
            assert_eq!(t, topic);
            assert_eq!(s.to_be_bytes().as_slice(), seq);
            check(&batch);
        }
        Err(e) => {
            let _ = e.to_string();
        }
    }
    if let Ok((t, _, batch)) = decode_message(&[seq, payload]) {
        assert!(t.is_empty());
        check(&batch);
    }
    assert!(decode_message(&[data]).is_err());
    assert!(decode_message(&[topic, topic, seq, payload]).is_err());
});
