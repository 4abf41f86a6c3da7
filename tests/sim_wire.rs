//! The simulator's KV-event encoder (`kvpick_sim::sim::wire`) against kvpick's wire decoder
//! (`kvpick::sources::events::decode`): what the sim publishes decodes back to the same events.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test/bench harness: a panic is a failure report

use kvpick::sources::events::decode::decode_batch;
use kvpick_core::event::{KvEvent, Medium};
use kvpick_sim::sim::wire::*;

fn sample() -> Vec<KvEvent> {
    vec![
        KvEvent::BlockStored {
            block_hashes: vec![u64::MAX - 3, 7],
            parent_block_hash: None,
            token_ids: (0..32).collect(),
            block_size: 16,
            lora_id: None,
            medium: Medium::Gpu,
            lora_name: None,
            cache_salt: None,
            group_idx: None,
            media: Vec::new(),
        },
        KvEvent::BlockStored {
            block_hashes: vec![9],
            parent_block_hash: Some(7),
            token_ids: (32..48).collect(),
            block_size: 16,
            lora_id: None,
            medium: Medium::Gpu,
            lora_name: None,
            cache_salt: None,
            group_idx: None,
            media: Vec::new(),
        },
        KvEvent::BlockRemoved {
            block_hashes: vec![9, 7],
            medium: Medium::Gpu,
            group_idx: None,
        },
        KvEvent::AllBlocksCleared,
    ]
}

#[test]
fn both_encodings_decode_back_to_the_same_events() {
    for enc in [Encoding::Array, Encoding::Map] {
        let bytes = encode_batch(1.5, &sample(), Some(3), enc);
        let batch = decode_batch(&bytes).unwrap();
        assert_eq!(batch.events, sample(), "{enc:?}");
        assert_eq!(batch.data_parallel_rank, Some(3));
        assert_eq!(batch.ts, 1.5);
        assert_eq!(batch.skipped_unknown, 0);
    }
}

#[test]
fn array_encoding_has_vllms_shape() {
    let bytes = encode_batch(0.0, &sample()[..1], None, Encoding::Array);
    let v = rmpv::decode::read_value(&mut &bytes[..]).unwrap();
    let batch = v.as_array().unwrap();
    assert_eq!(batch.len(), 3);
    assert!(batch[2].is_nil());
    let ev = batch[1].as_array().unwrap()[0].as_array().unwrap();
    assert_eq!(ev.len(), 12);
    assert_eq!(ev[0].as_str(), Some("BlockStored"));
    let bytes = encode_batch(0.0, &sample()[..1], None, Encoding::Map);
    let v = rmpv::decode::read_value(&mut &bytes[..]).unwrap();
    let ev = &v.as_map().unwrap()[1].1.as_array().unwrap()[0];
    let keys: Vec<&str> = ev
        .as_map()
        .unwrap()
        .iter()
        .map(|(k, _)| k.as_str().unwrap())
        .collect();
    assert_eq!(
        keys,
        [
            "type",
            "block_hashes",
            "parent_block_hash",
            "token_ids",
            "block_size",
            "lora_id",
            "medium",
            "lora_name"
        ]
    );
}

#[test]
fn a_salted_store_round_trips_through_both_encodings() {
    let salted = vec![KvEvent::BlockStored {
        block_hashes: vec![1, 2],
        parent_block_hash: None,
        token_ids: (0..32).collect(),
        block_size: 16,
        lora_id: None,
        medium: Medium::Gpu,
        lora_name: None,
        cache_salt: Some("tenant-1".into()),
        group_idx: None,
        media: Vec::new(),
    }];
    for enc in [Encoding::Array, Encoding::Map] {
        let batch = decode_batch(&encode_batch(0.0, &salted, None, enc)).unwrap();
        assert_eq!(batch.events, salted, "{enc:?}");
    }
}
