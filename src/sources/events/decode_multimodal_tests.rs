//! The decoder on multimodal `extra_keys`: `tests/fixtures/kv_events/multimodal/stored.msgpack` and
//! `layout.json`, written by vLLM's own `extra_keys` code path
//! (`tests/fixtures/kv_events/multimodal/make_fixtures.py`), and malformed variants.

#![allow(clippy::arithmetic_side_effects)]

use super::*;
use rmpv::Value;

const STORED: &[u8] = include_bytes!("../../../tests/fixtures/kv_events/multimodal/stored.msgpack");

fn layout() -> serde_json::Value {
    let text = include_str!("../../../tests/fixtures/kv_events/multimodal/layout.json");
    serde_json::from_str(text).unwrap()
}

#[test]
fn vllm_extra_keys_decode_to_each_blocks_media_keys_and_the_salt() {
    let batch = decode_batch(STORED).unwrap();
    let layout = layout();
    let red = layout["features"][0]["identifier"].as_str().unwrap();
    let uuid = layout["features"][1]["identifier"].as_str().unwrap();
    let key = |block: u32, id: &str, offset: i64| BlockMedia {
        block,
        key: MediaKey {
            id: media_id(id),
            offset,
        },
    };
    let [KvEvent::BlockStored {
        media: first,
        cache_salt,
        ..
    }, KvEvent::BlockStored {
        media: second,
        cache_salt: no_salt,
        ..
    }] = &batch.events[..]
    else {
        panic!("{:?}", batch.events)
    };
    // Block 0: the red image from token 5, then the salt; blocks 1-2 inside it; block 3 the
    // uuid image at +7. The continuing store (blocks 4-5) holds no image.
    assert_eq!(
        first,
        &vec![
            key(0, red, 5),
            key(1, red, -11),
            key(2, red, -27),
            key(3, uuid, 7)
        ]
    );
    assert_eq!(cache_salt.as_deref(), Some("tenant-a"));
    assert!(second.is_empty());
    assert_eq!(no_salt, &None);
}

#[test]
fn malformed_extra_keys_add_no_media_keys_and_never_fail_the_store() {
    let stored = |extra: Value| {
        let event = Value::Array(vec![
            Value::from("BlockStored"),
            Value::Array(vec![Value::from(1u64), Value::from(2u64)]),
            Value::Nil,
            Value::Array((0..4).map(Value::from).collect()),
            Value::from(2u32),
            Value::Nil,
            Value::Nil,
            Value::Nil,
            extra,
        ]);
        let batch = Value::Array(vec![Value::F64(0.0), Value::Array(vec![event])]);
        let mut buf = Vec::new();
        rmpv::encode::write_value(&mut buf, &batch).unwrap();
        decode_batch(&buf).unwrap()
    };
    let pair = |id: Value, off: Value| Value::Array(vec![id, off]);
    let cases = [
        Value::from("not a list"),
        Value::Array(vec![Value::from(3)]),
        Value::Array(vec![Value::Array(vec![pair(
            Value::from(1),
            Value::from(2),
        )])]),
        Value::Array(vec![Value::Array(vec![pair(
            Value::from("id"),
            Value::from("x"),
        )])]),
        Value::Array(vec![Value::Array(vec![Value::Array(vec![Value::from(
            "id",
        )])])]),
        Value::Array(vec![Value::Array(vec![Value::Array(vec![
            Value::from("id"),
            Value::from(1),
            Value::from(2),
        ])])]),
    ];
    for extra in cases {
        let batch = stored(extra.clone());
        let KvEvent::BlockStored { media, .. } = &batch.events[0] else {
            panic!()
        };
        assert!(media.is_empty(), "{extra}");
    }
    // More entries than blocks: only the stored blocks' are read.
    let entry = Value::Array(vec![pair(Value::from("id"), Value::from(0))]);
    let batch = stored(Value::Array(vec![entry.clone(), entry.clone(), entry]));
    let KvEvent::BlockStored { media, .. } = &batch.events[0] else {
        panic!()
    };
    assert_eq!(media.len(), 2);
    // A negative offset (an image begun in an earlier block) is kept.
    let batch = stored(Value::Array(vec![
        Value::Nil,
        Value::Array(vec![pair(Value::from("id"), Value::from(-9))]),
    ]));
    let KvEvent::BlockStored { media, .. } = &batch.events[0] else {
        panic!()
    };
    assert_eq!(media[0].block, 1);
    assert_eq!(media[0].key.offset, -9);
}
