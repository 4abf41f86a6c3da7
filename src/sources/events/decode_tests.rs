#![allow(clippy::arithmetic_side_effects)]

use super::*;
use rmpv::Value;

macro_rules! fixture {
    ($name:literal) => {
        include_bytes!(concat!("../../../tests/fixtures/kv_events/", $name)).as_slice()
    };
}

const FIXTURES: &[(&str, &[u8])] = &[
    ("vllm_array", fixture!("vllm_array.msgpack")),
    ("vllm_map", fixture!("vllm_map.msgpack")),
    ("vllm_mixed", fixture!("vllm_mixed.msgpack")),
    ("vllm_bin_hashes", fixture!("vllm_bin_hashes.msgpack")),
    ("sglang", fixture!("sglang.msgpack")),
    ("sglang_v2", fixture!("sglang_v2.msgpack")),
    ("all_blocks_cleared", fixture!("all_blocks_cleared.msgpack")),
    ("cpu_medium", fixture!("cpu_medium.msgpack")),
    ("tokenless_store", fixture!("tokenless_store.msgpack")),
    (
        "unknown_fields_array",
        fixture!("unknown_fields_array.msgpack"),
    ),
    ("unknown_fields_map", fixture!("unknown_fields_map.msgpack")),
];

fn toks(start: u32, n: u32) -> Vec<u32> {
    (start..start + n).collect()
}

#[allow(clippy::too_many_arguments)]
fn stored(
    block_hashes: &[u64],
    parent_block_hash: Option<u64>,
    token_ids: Vec<u32>,
    block_size: u32,
    lora_id: Option<i64>,
    medium: Medium,
    lora_name: Option<&str>,
    group_idx: Option<u32>,
) -> KvEvent {
    KvEvent::BlockStored {
        block_hashes: block_hashes.to_vec(),
        parent_block_hash,
        token_ids,
        block_size,
        lora_id,
        medium,
        lora_name: lora_name.map(str::to_owned),
        cache_salt: None,
        group_idx,
        media: Vec::new(),
    }
}

/// A plain GPU store without LoRA or group.
fn gpu(hashes: &[u64], parent: Option<u64>, tokens: Vec<u32>, bs: u32) -> KvEvent {
    stored(hashes, parent, tokens, bs, None, Medium::Gpu, None, None)
}

fn removed(hashes: &[u64], medium: Medium, group_idx: Option<u32>) -> KvEvent {
    KvEvent::BlockRemoved {
        block_hashes: hashes.to_vec(),
        medium,
        group_idx,
    }
}

fn batch(ts: f64, events: Vec<KvEvent>, rank: Option<u32>) -> EventBatch {
    EventBatch {
        ts,
        events,
        data_parallel_rank: rank,
        skipped_unknown: 0,
        group_specs: Vec::new(),
    }
}

fn decode(name: &str) -> EventBatch {
    let (_, bytes) = FIXTURES.iter().find(|(n, _)| *n == name).unwrap();
    decode_batch(bytes).unwrap_or_else(|e| panic!("{name}: {e}"))
}

#[test]
fn vllm_array_layout() {
    let mut want = batch(
        1718000000.5,
        vec![
            gpu(
                &[0x1111111111111111, 0xF222222222222222],
                None,
                toks(1000, 32),
                16,
            ),
            stored(
                &[0x3333333333333333],
                Some(0xF222222222222222),
                toks(1032, 16),
                16,
                Some(7),
                Medium::Gpu,
                Some("adapter-a"),
                Some(1),
            ),
            removed(&[0x1111111111111111], Medium::Gpu, None),
            removed(&[0x3333333333333333], Medium::Gpu, Some(1)),
        ],
        Some(0),
    );
    want.group_specs = vec![GroupSpec {
        event: 1,
        kind: SpecKind::FullAttention,
        sliding_window: Some(4096),
    }];
    assert_eq!(decode("vllm_array"), want);
}

#[test]
fn vllm_map_layout() {
    let want = batch(
        1718000001.25,
        vec![
            // parent 0 = sequence start; nil medium = GPU.
            gpu(
                &[0x0102030405060708, 0x1112131415161718, 0x2122232425262728],
                None,
                toks(2000, 24),
                8,
            ),
            stored(
                &[0x3132333435363738],
                Some(0x2122232425262728),
                toks(2024, 8),
                8,
                None,
                Medium::Gpu,
                Some("adapter-b"),
                Some(0),
            ),
            removed(&[0x2122232425262728, 0x3132333435363738], Medium::Gpu, None),
            KvEvent::AllBlocksCleared,
        ],
        Some(3),
    );
    assert_eq!(decode("vllm_map"), want);
}

#[test]
fn vllm_mixed_layout() {
    let want = batch(
        1718000002.0,
        vec![
            gpu(&[0x4142434445464748], None, toks(3000, 16), 16),
            removed(&[0x4142434445464748], Medium::Gpu, Some(2)),
        ],
        Some(1),
    );
    assert_eq!(decode("vllm_mixed"), want);
}

#[test]
fn vllm_bin_hashes_take_last_8_bytes_big_endian() {
    let (a, b) = (0x18191a1b1c1d1e1f, 0x38393a3b3c3d3e3f);
    let want = batch(
        1718000003.75,
        vec![
            gpu(&[a, b], Some(0x0102030405060708), toks(4000, 32), 16),
            gpu(&[0xf8f9fafbfcfdfeff], Some(b), toks(4032, 16), 16),
            removed(&[a], Medium::Gpu, None),
        ],
        Some(0),
    );
    assert_eq!(decode("vllm_bin_hashes"), want);
}

const SG: [u64; 3] = [0xfedcba9876543210, 0x8000000000000001, 0x0123456789abcdef];

#[test]
fn sglang_short_tuples_one_event_per_page() {
    let want = batch(
        1718000004.5,
        vec![
            gpu(&[SG[0]], None, toks(500, 4), 4),
            gpu(&[SG[1]], Some(SG[0]), toks(504, 4), 4),
            gpu(&[SG[2]], Some(SG[1]), toks(508, 2), 2),
            removed(&[SG[2]], Medium::Gpu, None),
            KvEvent::AllBlocksCleared,
        ],
        None,
    );
    assert_eq!(decode("sglang"), want);
}

#[test]
fn sglang_v2_medium_metadata_and_bigrams() {
    let cpu = |h: &[u64], p, t, bs| stored(h, p, t, bs, None, Medium::Cpu, None, None);
    let want = batch(
        1718000005.25,
        vec![
            gpu(&[SG[0]], None, toks(600, 4), 4),
            // The {cache_salt} map in the lora_name slot is skipped.
            gpu(&[SG[1]], Some(SG[0]), toks(604, 4), 4),
            cpu(&[SG[0]], None, toks(600, 4), 4),
            // Bigram pairs (608,609),(609,610),... decode to their first elements.
            gpu(&[SG[2]], Some(SG[1]), toks(608, 4), 4),
            removed(&[SG[0]], Medium::Cpu, None),
            removed(&[SG[2]], Medium::Gpu, None),
        ],
        Some(2),
    );
    assert_eq!(decode("sglang_v2"), want);
}

#[test]
fn all_blocks_cleared_batch() {
    let want = batch(1718000006.0, vec![KvEvent::AllBlocksCleared], None);
    assert_eq!(decode("all_blocks_cleared"), want);
}

#[test]
fn cpu_and_other_media() {
    let h = [0x5151515151515151, 0x5252525252525252, 0x5353535353535353];
    let want = batch(
        1718000007.5,
        vec![
            stored(
                &[h[0]],
                None,
                toks(7000, 16),
                16,
                None,
                Medium::Cpu,
                None,
                None,
            ),
            stored(
                &[h[1]],
                Some(h[0]),
                toks(7016, 16),
                16,
                None,
                Medium::Cpu,
                None,
                None,
            ),
            removed(&[h[0]], Medium::Cpu, None),
            removed(&[h[1]], Medium::Disk, None),
            removed(&[h[2]], Medium::Other("EXTERNAL".into()), None),
        ],
        Some(0),
    );
    assert_eq!(decode("cpu_medium"), want);
}

#[test]
fn tokenless_store() {
    let want = batch(
        1718000008.0,
        vec![stored(
            &[0x6161616161616161, 0x6262626262626262, 0x6363636363636363],
            Some(0x6060606060606060),
            vec![],
            16,
            None,
            Medium::Cpu,
            None,
            None,
        )],
        Some(0),
    );
    assert_eq!(decode("tokenless_store"), want);
}

#[test]
fn unknown_fields_are_ignored() {
    let mut want = batch(
        1718000009.5,
        vec![
            stored(
                &[0x7171717171717171],
                None,
                toks(9000, 16),
                16,
                None,
                Medium::Gpu,
                None,
                Some(0),
            ),
            removed(&[0x7171717171717171], Medium::Gpu, Some(0)),
            KvEvent::AllBlocksCleared,
        ],
        Some(5),
    );
    want.group_specs = vec![GroupSpec {
        event: 0,
        kind: SpecKind::SlidingWindow,
        sliding_window: Some(1024),
    }];
    assert_eq!(decode("unknown_fields_array"), want);

    let want = batch(
        1718000010.25,
        vec![
            gpu(&[0x7272727272727272], None, toks(9100, 8), 8),
            removed(&[0x7272727272727272], Medium::Disk, None),
            KvEvent::AllBlocksCleared,
        ],
        Some(4),
    );
    assert_eq!(decode("unknown_fields_map"), want);
}

#[test]
fn every_fixture_decodes_and_keeps_the_token_invariant() {
    for (name, bytes) in FIXTURES {
        let b = decode_batch(bytes).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(!b.events.is_empty(), "{name}");
        for e in &b.events {
            if let KvEvent::BlockStored {
                block_hashes,
                token_ids,
                block_size,
                ..
            } = e
            {
                assert!(
                    token_ids.is_empty()
                        || token_ids.len() == block_hashes.len() * *block_size as usize,
                    "{name}"
                );
            }
        }
    }
}

// ---- messages -------------------------------------------------------------------------

#[test]
fn message_frames() {
    let payload = fixture!("vllm_mixed.msgpack");
    let seq = 41u64.to_be_bytes();
    let (topic, s, b) = decode_message(&[b"kv@rank0", &seq, payload]).unwrap();
    assert_eq!((topic.as_slice(), s), (&b"kv@rank0"[..], 41));
    assert_eq!(b, decode("vllm_mixed"));

    let (topic, s, _) = decode_message(&[&seq, payload]).unwrap();
    assert_eq!((topic.len(), s), (0, 41));
    // A vLLM replay reply, seen by a DEALER, is [b"", seq, payload]: empty topic.
    let (topic, s, _) = decode_message(&[b"", &u64::MAX.to_be_bytes(), payload]).unwrap();
    assert_eq!((topic.len(), s), (0, REPLAY_END_SEQ));
}

#[test]
fn message_shape_errors() {
    let payload = fixture!("vllm_mixed.msgpack");
    let seq = 1u64.to_be_bytes();
    assert_eq!(decode_message(&[]), Err(DecodeError::FrameCount(0)));
    assert_eq!(decode_message(&[payload]), Err(DecodeError::FrameCount(1)));
    assert_eq!(
        decode_message(&[b"", b"t", &seq, payload]),
        Err(DecodeError::FrameCount(4))
    );
    assert_eq!(
        decode_message(&[b"t", &seq[..7], payload]),
        Err(DecodeError::SeqLength(7))
    );
    assert_eq!(
        decode_message(&[b"t", &seq, b""]),
        Err(DecodeError::Truncated)
    );
    assert_eq!(decode_seq(&[0, 0, 0, 0, 0, 0, 1, 0]), Ok(256));
}

// ---- malformed payloads ---------------------------------------------------------------

fn enc(v: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, v).unwrap();
    out
}

fn s(x: &str) -> Value {
    Value::from(x)
}

fn arr(items: Vec<Value>) -> Value {
    Value::Array(items)
}

/// A batch `[1.0, [event]]` around one array-encoded event.
fn one(event: Value) -> Result<EventBatch, DecodeError> {
    decode_batch(&enc(&arr(vec![Value::F64(1.0), arr(vec![event])])))
}

fn event_err(index: usize, e: DecodeError) -> DecodeError {
    DecodeError::Event {
        index,
        source: Box::new(e),
    }
}

/// `["BlockStored", [1, 2], nil, tokens, block_size]`.
fn store_ev(tokens: Vec<Value>, block_size: Value) -> Value {
    arr(vec![
        s("BlockStored"),
        arr(vec![Value::from(1), Value::from(2)]),
        Value::Nil,
        arr(tokens),
        block_size,
    ])
}

fn int_tokens(n: u32) -> Vec<Value> {
    (0..n).map(Value::from).collect()
}

#[test]
fn every_truncation_is_an_error() {
    for (name, bytes) in FIXTURES {
        for cut in 0..bytes.len() {
            assert!(
                decode_batch(&bytes[..cut]).is_err(),
                "{name} cut at {cut} decoded"
            );
        }
    }
    assert_eq!(decode_batch(b""), Err(DecodeError::Truncated));
}

#[test]
fn trailing_bytes_are_an_error() {
    let mut bytes = fixture!("vllm_array.msgpack").to_vec();
    bytes.push(0xc0);
    assert_eq!(decode_batch(&bytes), Err(DecodeError::TrailingBytes(1)));
}

#[test]
fn huge_declared_lengths_fail_without_allocating() {
    let cases: &[&[u8]] = &[
        &[0xdd, 0xff, 0xff, 0xff, 0xff],             // array32, 4 G elements
        &[0xdf, 0xff, 0xff, 0xff, 0xff, 0xc0],       // map32
        &[0xc6, 0xff, 0xff, 0xff, 0xff, 0x00],       // bin32, 4 GiB
        &[0xdb, 0xff, 0xff, 0xff, 0xff, b'a'],       // str32
        &[0xc9, 0xff, 0xff, 0xff, 0xff, 0x01, 0x00], // ext32
        // [1.0, array32(4 G)]
        &[
            0x92, 0xcb, 0x3f, 0xf0, 0, 0, 0, 0, 0, 0, 0xdd, 0xff, 0xff, 0xff, 0xff,
        ],
    ];
    for c in cases {
        assert_eq!(decode_batch(c), Err(DecodeError::Truncated), "{c:x?}");
    }
}

#[test]
fn deep_nesting_is_rejected_without_overflowing_the_stack() {
    for open in [0x91u8, 0x81] {
        let mut bytes = vec![open; 100_000];
        if open == 0x81 {
            // fixmap(1) needs a key before each nested value.
            bytes = std::iter::repeat_n([0x81, 0xa1, b'k'], 50_000)
                .flatten()
                .collect();
        }
        bytes.push(0xc0);
        assert_eq!(decode_batch(&bytes), Err(DecodeError::TooDeep));
    }
    // Legitimate nesting (extra_keys tuples) is well inside the budget.
    assert!(decode_batch(fixture!("unknown_fields_array.msgpack")).is_ok());
}

#[test]
fn oversized_payload_is_rejected_up_front() {
    let big = vec![0u8; MAX_PAYLOAD_BYTES + 1];
    assert_eq!(
        decode_batch(&big),
        Err(DecodeError::TooLarge {
            len: MAX_PAYLOAD_BYTES + 1,
            max: MAX_PAYLOAD_BYTES
        })
    );
}

#[test]
fn batch_shape_errors() {
    let w = |field, expected| Err(wrong(field, expected));
    assert_eq!(
        decode_batch(&enc(&Value::from(5))),
        w("batch", "array or map")
    );
    assert_eq!(
        decode_batch(&enc(&arr(vec![]))),
        Err(DecodeError::Missing("ts"))
    );
    assert_eq!(
        decode_batch(&enc(&arr(vec![Value::F64(1.0)]))),
        Err(DecodeError::Missing("events"))
    );
    assert_eq!(
        decode_batch(&enc(&arr(vec![s("x"), arr(vec![])]))),
        w("ts", "number")
    );
    assert_eq!(
        decode_batch(&enc(&arr(vec![Value::F64(1.0), Value::from(3)]))),
        w("events", "array")
    );
    assert_eq!(
        decode_batch(&enc(&arr(vec![
            Value::F64(1.0),
            arr(vec![]),
            Value::from(-1)
        ]))),
        w("data_parallel_rank", "u32")
    );
    // Map batch: missing keys; SGLang's rank name; integer ts.
    let map = |kv: Vec<(&str, Value)>| Value::Map(kv.into_iter().map(|(k, v)| (s(k), v)).collect());
    assert_eq!(
        decode_batch(&enc(&map(vec![("events", arr(vec![]))]))),
        Err(DecodeError::Missing("ts"))
    );
    let b = decode_batch(&enc(&map(vec![
        ("ts", Value::from(7)),
        ("events", arr(vec![])),
        ("attn_dp_rank", Value::from(9)),
    ])))
    .unwrap();
    assert_eq!(b, batch(7.0, vec![], Some(9)));
    // f32 timestamps are accepted.
    let b = decode_batch(&enc(&arr(vec![Value::F32(2.5), arr(vec![])]))).unwrap();
    assert_eq!(b.ts, 2.5);
}

#[test]
fn event_shape_errors() {
    let e0 = |e| Err(event_err(0, e));
    let w = |field, expected| e0(wrong(field, expected));
    assert_eq!(one(Value::from(1)), w("event", "array or map"));
    assert_eq!(one(arr(vec![])), e0(DecodeError::Missing("event tag")));
    assert_eq!(one(arr(vec![Value::from(1)])), w("event tag", "string"));
    // An unknown tag (a newer engine) skips that event only.
    let skipped = one(arr(vec![s("BlockUpdated")])).unwrap();
    assert_eq!((skipped.events.len(), skipped.skipped_unknown), (0, 1));
    assert_eq!(
        one(Value::Map(vec![(s("block_hashes"), arr(vec![]))])),
        e0(DecodeError::Missing("type"))
    );
    assert_eq!(
        one(arr(vec![s("BlockRemoved")])),
        e0(DecodeError::Missing("block_hashes"))
    );
    assert_eq!(
        one(arr(vec![s("BlockRemoved"), Value::from(1)])),
        w("block_hashes", "array")
    );
    assert_eq!(
        one(arr(vec![s("BlockRemoved"), arr(vec![]), Value::from(3)])),
        w("medium", "string")
    );
    assert_eq!(
        one(arr(vec![
            s("BlockRemoved"),
            arr(vec![]),
            Value::Nil,
            s("x")
        ])),
        w("group_idx", "u32")
    );
    // The error names the failing event's index; unknown tags around it are skipped.
    let bad = decode_batch(&enc(&arr(vec![
        Value::F64(1.0),
        arr(vec![
            arr(vec![s("AllBlocksCleared")]),
            arr(vec![s("Nope")]),
            arr(vec![s("BlockRemoved")]),
        ]),
    ])));
    assert_eq!(
        bad.unwrap_err().to_string(),
        "event 2: block_hashes missing"
    );
    let mixed = decode_batch(&enc(&arr(vec![
        Value::F64(1.0),
        arr(vec![arr(vec![s("Nope")]), arr(vec![s("AllBlocksCleared")])]),
    ])))
    .unwrap();
    assert_eq!(mixed.events, vec![KvEvent::AllBlocksCleared]);
    assert_eq!(mixed.skipped_unknown, 1);
}

#[test]
fn hash_types() {
    let rm = |h: Value| one(arr(vec![s("BlockRemoved"), arr(vec![h])]));
    let ok = |h: u64| Ok(batch(1.0, vec![removed(&[h], Medium::Gpu, None)], None));
    assert_eq!(rm(Value::from(u64::MAX)), ok(u64::MAX));
    assert_eq!(rm(Value::from(-1i64)), ok(u64::MAX));
    assert_eq!(rm(Value::from(i64::MIN)), ok(1 << 63));
    assert_eq!(rm(Value::Binary((0..8).collect())), ok(0x0001020304050607));
    assert_eq!(rm(Value::Binary(vec![0xee; 64])), ok(0xeeeeeeeeeeeeeeee));
    let bad = Err(event_err(0, wrong("block_hashes", HASH)));
    assert_eq!(rm(Value::Binary(vec![1; 7])), bad);
    assert_eq!(rm(Value::Binary(vec![1; 65])), bad);
    assert_eq!(rm(Value::Binary(vec![])), bad);
    assert_eq!(rm(s("0x1234")), bad);
    assert_eq!(rm(Value::F64(1.0)), bad);
    assert_eq!(rm(Value::Nil), bad);
    assert_eq!(rm(Value::Boolean(true)), bad);
    let parent = one(arr(vec![
        s("BlockStored"),
        arr(vec![Value::from(1)]),
        s("p"),
    ]));
    assert_eq!(parent, Err(event_err(0, wrong("parent_block_hash", HASH))));
}

#[test]
fn token_and_block_size_rules() {
    let e0 = |e| Err(event_err(0, e));
    // N blocks in one event.
    assert!(one(store_ev(int_tokens(8), Value::from(4))).is_ok());
    // Length mismatch.
    assert_eq!(
        one(store_ev(int_tokens(7), Value::from(4))),
        e0(DecodeError::TokenCount {
            tokens: 7,
            blocks: 2,
            block_size: 4
        })
    );
    // block_size 0 with tokens is a mismatch too.
    assert_eq!(
        one(store_ev(int_tokens(8), Value::from(0))),
        e0(DecodeError::TokenCount {
            tokens: 8,
            blocks: 2,
            block_size: 0
        })
    );
    // Missing block_size is inferred when divisible...
    let short = |tokens: Vec<Value>| {
        one(arr(vec![
            s("BlockStored"),
            arr(vec![Value::from(1), Value::from(2)]),
            Value::Nil,
            arr(tokens),
        ]))
    };
    assert_eq!(
        short(int_tokens(6)),
        Ok(batch(1.0, vec![gpu(&[1, 2], None, toks(0, 6), 3)], None))
    );
    // ...and an error otherwise.
    assert_eq!(
        short(int_tokens(5)),
        e0(DecodeError::BlockSize {
            tokens: 5,
            blocks: 2
        })
    );
    // Tokenless without block_size: 0. A nil block_size is "missing".
    assert_eq!(
        short(vec![]),
        Ok(batch(1.0, vec![gpu(&[1, 2], None, vec![], 0)], None))
    );
    assert_eq!(
        one(store_ev(int_tokens(4), Value::Nil)),
        Ok(batch(1.0, vec![gpu(&[1, 2], None, toks(0, 4), 2)], None))
    );
    // Missing token_ids entirely = tokenless.
    assert!(one(arr(vec![s("BlockStored"), arr(vec![Value::from(1)])])).is_ok());
    // Wrong token types.
    let bad = e0(wrong("token_ids", "array of u32 token ids"));
    assert_eq!(one(store_ev(vec![s("a"), s("b")], Value::from(1))), bad);
    assert_eq!(
        one(store_ev(
            vec![arr(vec![Value::from(1)]), arr(vec![Value::from(2)])],
            Value::from(1)
        )),
        bad
    );
    assert_eq!(
        one(arr(vec![
            s("BlockStored"),
            arr(vec![]),
            Value::Nil,
            s("tok")
        ])),
        bad
    );
    let range = e0(wrong("token_ids", "u32"));
    assert_eq!(
        one(store_ev(
            vec![Value::from(-1), Value::from(1)],
            Value::from(1)
        )),
        range
    );
    assert_eq!(
        one(store_ev(
            vec![Value::from(1u64 << 32), Value::from(1)],
            Value::from(1)
        )),
        range
    );
    assert_eq!(
        one(store_ev(int_tokens(2), Value::from(-1))),
        e0(wrong("block_size", "u32"))
    );
    assert_eq!(
        one(store_ev(int_tokens(2), s("1"))),
        e0(wrong("block_size", "u32"))
    );
}

#[test]
fn optional_field_types() {
    let e0 = |e| Err(event_err(0, e));
    let with = |pos: usize, v: Value| {
        let mut ev = vec![
            s("BlockStored"),
            arr(vec![Value::from(1)]),
            Value::Nil,
            arr(vec![]),
            Value::from(16),
            Value::Nil,
            Value::Nil,
            Value::Nil,
            Value::Nil,
            Value::Nil,
        ];
        ev[pos] = v;
        one(arr(ev))
    };
    assert_eq!(with(5, s("7")), e0(wrong("lora_id", "int64")));
    assert_eq!(
        with(5, Value::from(u64::MAX)),
        e0(wrong("lora_id", "int64"))
    );
    assert_eq!(with(6, Value::from(1)), e0(wrong("medium", "string")));
    assert_eq!(with(7, Value::from(1)), e0(wrong("lora_name", "string")));
    assert_eq!(with(9, Value::from(-3)), e0(wrong("group_idx", "u32")));
    // extra_keys (position 8) may hold anything.
    assert!(with(8, Value::Map(vec![(Value::from(1), Value::F32(1.0))])).is_ok());
    // Invalid UTF-8 strings are rejected where read.
    let mut lora = vec![0x92, 0xcb, 0x3f, 0xf0, 0, 0, 0, 0, 0, 0, 0x91, 0x98, 0xab];
    lora.extend_from_slice(b"BlockStored");
    // [], nil, [], 16, nil, nil, <invalid utf-8 lora_name>
    lora.extend_from_slice(&[0x90, 0xc0, 0x90, 0x10, 0xc0, 0xc0, 0xa1, 0xff]);
    assert_eq!(
        decode_batch(&lora),
        Err(event_err(0, wrong("lora_name", "UTF-8")))
    );
    let raw = [
        0x92, 0xcb, 0x3f, 0xf0, 0, 0, 0, 0, 0, 0, // [1.0,
        0x91, 0x92, 0xa1, 0xff, 0x90, // [[<invalid utf-8 tag>, []]]]
    ];
    assert_eq!(
        decode_batch(&raw),
        Err(event_err(0, wrong("event tag", "string")))
    );
    // A {cache_salt} map in the lora_name slot is SGLang metadata only when positional.
    assert!(with(7, Value::Map(vec![(s("cache_salt"), s("t"))])).is_ok());
    let map_ev = Value::Map(vec![
        (s("type"), s("BlockStored")),
        (s("block_hashes"), arr(vec![])),
        (s("lora_name"), Value::Map(vec![])),
    ]);
    assert_eq!(one(map_ev), e0(wrong("lora_name", "string")));
}

#[test]
fn medium_names() {
    for (name, want) in [
        ("GPU", Medium::Gpu),
        ("gpu", Medium::Gpu),
        ("cuda", Medium::Gpu),
        ("cuda:1", Medium::Gpu),
        ("", Medium::Gpu),
        ("CPU", Medium::Cpu),
        ("cpu", Medium::Cpu),
        ("CPU_PINNED", Medium::Cpu),
        ("DISK", Medium::Disk),
        ("ssd", Medium::Disk),
        ("EXTERNAL", Medium::Other("EXTERNAL".into())),
    ] {
        assert_eq!(Medium::parse(name), want, "{name}");
    }
    // SGLang's cluster-wide store: the shared tier's medium, whatever its case.
    for shared in ["EXTERNAL", "external", " External "] {
        assert!(Medium::parse(shared).is_shared(), "{shared:?}");
    }
    for local in ["GPU", "CPU", "DISK", "EXTERNALS", "LMCACHE"] {
        assert!(!Medium::parse(local).is_shared(), "{local:?}");
    }
    assert_eq!(
        Medium::parse(&"é".repeat(100)),
        Medium::Other("é".repeat(MAX_ECHO / 2))
    );
}

/// A cheap in-test fuzz: every single-byte mutation of every fixture decodes or errors.
#[test]
fn byte_mutations_never_panic() {
    for (_, bytes) in FIXTURES {
        let mut buf = bytes.to_vec();
        for i in 0..buf.len() {
            let orig = buf[i];
            for v in [
                0x00,
                0x7f,
                0x80,
                0xc0,
                0xc1,
                0xcf,
                0xd3,
                0xdd,
                0xff,
                orig ^ 1,
            ] {
                buf[i] = v;
                let _ = decode_batch(&buf);
            }
            buf[i] = orig;
        }
    }
}

fn salted_store(extra_keys: rmpv::Value, parent: Option<u64>, lora: Option<&str>) -> Vec<u8> {
    use rmpv::Value;
    let event = Value::Array(vec![
        Value::from("BlockStored"),
        Value::Array(vec![Value::from(7u64), Value::from(8u64)]),
        parent.map_or(Value::Nil, Value::from),
        Value::Array((0..32u32).map(Value::from).collect()),
        Value::from(16u32),
        Value::Nil,
        Value::from("GPU"),
        lora.map_or(Value::Nil, Value::from),
        extra_keys,
    ]);
    let batch = Value::Array(vec![
        Value::from(1.0),
        Value::Array(vec![event]),
        Value::Nil,
    ]);
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, &batch).unwrap();
    out
}

fn salt_of(bytes: &[u8]) -> Option<String> {
    match &decode_batch(bytes).unwrap().events[0] {
        KvEvent::BlockStored { cache_salt, .. } => cache_salt.clone(),
        other => panic!("{other:?}"),
    }
}

#[test]
fn the_cache_salt_is_read_from_the_first_blocks_extra_keys() {
    use rmpv::Value;
    let keys = |first: Vec<Value>| Value::Array(vec![Value::Array(first), Value::Nil]);
    let salt = Value::from("tenant-1");
    assert_eq!(
        salt_of(&salted_store(keys(vec![salt.clone()]), None, None)),
        Some("tenant-1".into())
    );
    // LoRA name first, then the salt (vLLM's order).
    let with_lora = keys(vec![Value::from("lora-x"), salt.clone()]);
    assert_eq!(
        salt_of(&salted_store(with_lora, None, Some("lora-x"))),
        Some("tenant-1".into())
    );
    let lora_only = keys(vec![Value::from("lora-x")]);
    assert_eq!(
        salt_of(&salted_store(lora_only, None, Some("lora-x"))),
        None
    );
    // A multimodal tuple last: no salt.
    let mm = keys(vec![Value::Array(vec![Value::from("img"), Value::from(0)])]);
    assert_eq!(salt_of(&salted_store(mm, None, None)), None);
    // A store continuing a chain never carries the salt of the sequence start.
    assert_eq!(
        salt_of(&salted_store(keys(vec![salt.clone()]), Some(99), None)),
        None
    );
    assert_eq!(salt_of(&salted_store(Value::Nil, None, None)), None);
    // SGLang's metadata map in the lora_name slot.
    let sglang = salted_store(Value::Nil, None, None);
    let mut v = rmpv::decode::read_value(&mut &sglang[..]).unwrap();
    if let Value::Array(batch) = &mut v {
        if let Value::Array(events) = &mut batch[1] {
            if let Value::Array(ev) = &mut events[0] {
                ev[7] = Value::Map(vec![(Value::from("cache_salt"), Value::from("s9"))]);
            }
        }
    }
    let mut bytes = Vec::new();
    rmpv::encode::write_value(&mut bytes, &v).unwrap();
    assert_eq!(salt_of(&bytes), Some("s9".into()));
}
