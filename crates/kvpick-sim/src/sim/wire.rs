//! Encoder for the simulator's KV events: vLLM's msgpack `KVEventBatch` exactly as its msgspec
//! structs produce it (ARCHITECTURE.md §7), in either encoding:
//! - `array` (`array_like=True`): batch `[ts, events, data_parallel_rank]`, each event tag-first
//!   with every field present (`BlockStored` has 11 fields after the tag, defaults as nil);
//! - `map` (current vLLM main): maps at both levels, the tag under `"type"`, fields with defaults
//!   omitted when unset (`omit_defaults=True`).
//!
//! Block hashes go out as uint64 (vLLM with `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`). Only
//! encoding lives here; decoding is `kvpick::sources::events::decode`
//! (its round trip is tested there, in `tests/sim_wire.rs`).

use rmpv::Value;

use kvpick_core::event::{KvEvent, Medium};

/// The two payload encodings vLLM has shipped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Default)]
pub enum Encoding {
    #[default]
    Array,
    Map,
}

fn medium(m: &Medium) -> Value {
    Value::from(match m {
        Medium::Gpu => "GPU",
        Medium::Cpu => "CPU",
        Medium::Disk => "DISK",
        Medium::Other(s) => s.as_str(),
    })
}

fn hashes(h: &[u64]) -> Value {
    Value::Array(h.iter().map(|&x| Value::from(x)).collect())
}

fn opt<T: Into<Value>>(v: Option<T>) -> Value {
    v.map_or(Value::Nil, Into::into)
}

fn map(entries: Vec<(&str, Value)>) -> Value {
    Value::Map(
        entries
            .into_iter()
            .map(|(k, v)| (Value::from(k), v))
            .collect(),
    )
}

fn event(e: &KvEvent, encoding: Encoding) -> Value {
    match (e, encoding) {
        (
            KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                lora_id,
                medium: m,
                lora_name,
                cache_salt,
                group_idx,
                media: _,
            },
            _,
        ) => {
            let tokens = Value::Array(token_ids.iter().map(|&t| Value::from(t)).collect());
            // vLLM: one entry per block; the salt is in the first block's tuple.
            let extra_keys = match cache_salt {
                Some(salt) => Value::Array(
                    std::iter::once(Value::Array(vec![Value::from(salt.as_str())]))
                        .chain(std::iter::repeat_n(
                            Value::Nil,
                            block_hashes.len().saturating_sub(1),
                        ))
                        .collect(),
                ),
                None => Value::Nil,
            };
            match encoding {
                Encoding::Array => Value::Array(vec![
                    Value::from("BlockStored"),
                    hashes(block_hashes),
                    opt(*parent_block_hash),
                    tokens,
                    Value::from(*block_size),
                    opt(*lora_id),
                    medium(m),
                    opt(lora_name.clone()),
                    extra_keys,
                    opt(*group_idx),
                    Value::Nil, // kv_cache_spec_kind
                    Value::Nil, // kv_cache_spec_sliding_window
                ]),
                Encoding::Map => {
                    let mut fields = vec![
                        ("type", Value::from("BlockStored")),
                        ("block_hashes", hashes(block_hashes)),
                        ("parent_block_hash", opt(*parent_block_hash)),
                        ("token_ids", tokens),
                        ("block_size", Value::from(*block_size)),
                        ("lora_id", opt(*lora_id)),
                        ("medium", medium(m)),
                        ("lora_name", opt(lora_name.clone())),
                    ];
                    if cache_salt.is_some() {
                        fields.push(("extra_keys", extra_keys));
                    }
                    if let Some(g) = group_idx {
                        fields.push(("group_idx", Value::from(*g)));
                    }
                    map(fields)
                }
            }
        }
        (
            KvEvent::BlockRemoved {
                block_hashes,
                medium: m,
                group_idx,
            },
            Encoding::Array,
        ) => Value::Array(vec![
            Value::from("BlockRemoved"),
            hashes(block_hashes),
            medium(m),
            opt(*group_idx),
        ]),
        (
            KvEvent::BlockRemoved {
                block_hashes,
                medium: m,
                group_idx,
            },
            Encoding::Map,
        ) => {
            let mut fields = vec![
                ("type", Value::from("BlockRemoved")),
                ("block_hashes", hashes(block_hashes)),
                ("medium", medium(m)),
            ];
            if let Some(g) = group_idx {
                fields.push(("group_idx", Value::from(*g)));
            }
            map(fields)
        }
        (KvEvent::AllBlocksCleared, Encoding::Array) => {
            Value::Array(vec![Value::from("AllBlocksCleared")])
        }
        (KvEvent::AllBlocksCleared, Encoding::Map) => {
            map(vec![("type", Value::from("AllBlocksCleared"))])
        }
    }
}

/// One msgpack `KVEventBatch` payload.
pub fn encode_batch(
    ts: f64,
    events: &[KvEvent],
    data_parallel_rank: Option<u32>,
    encoding: Encoding,
) -> Vec<u8> {
    let evs = Value::Array(events.iter().map(|e| event(e, encoding)).collect());
    let batch = match encoding {
        Encoding::Array => Value::Array(vec![Value::F64(ts), evs, opt(data_parallel_rank)]),
        Encoding::Map => {
            let mut fields = vec![("ts", Value::F64(ts)), ("events", evs)];
            if let Some(r) = data_parallel_rank {
                fields.push(("data_parallel_rank", Value::from(r)));
            }
            map(fields)
        }
    };
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, &batch).expect("writing to a Vec cannot fail");
    out
}
