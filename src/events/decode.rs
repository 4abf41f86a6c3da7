//! Decoder for one KV-event message: ZeroMQ frames `[topic, seq, payload]` -> [`EventBatch`].
//!
//! Accepts every encoding ARCHITECTURE.md §7 lists (see `tests/fixtures/kv_events/README.md` for a
//! recorded sample of each):
//! - batch as an array `[ts, events, data_parallel_rank?]` (vLLM, SGLang, TensorRT-LLM; SGLang's
//!   original struct has no rank, newer SGLang names it `attn_dp_rank`) or as a map with those
//!   keys (current vLLM);
//! - each event as a tag-first array (`array_like` structs) or a map with the tag under `"type"`;
//!   trailing positional fields may be missing and unknown extra fields (trailing positions or
//!   unknown keys) are ignored;
//! - block hashes as uint64, int64 (SGLang's `hash_str_to_int64`; the bits are kept) or bin of
//!   8..=64 bytes (vLLM's sha256 / xxhash-128 `bytes` hashes; the last 8 bytes big-endian, the
//!   same value vLLM's `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES` would have sent).
//!
//! Decoding never panics and never trusts a declared length: the payload is capped at
//! [`MAX_PAYLOAD_BYTES`], nesting at [`MAX_DEPTH`] and every allocation is bounded by the bytes
//! actually present.
//!
//! Msgpack reader: `rmpv::decode::read_value_ref_with_max_depth` (the msgpack-rust project's value
//! reader, rather than a hand-written parser). It borrows strings and bins from the payload
//! (zero-copy), never preallocates from a declared array/map length (so a 4-byte header claiming
//! 4 G elements fails at end-of-input instead of allocating), reads bins only after checking the
//! bytes are there, and enforces a recursion limit. The schema walk below then works on the
//! value tree, which makes "array or map", "missing trailing field" and "skip unknown field"
//! trivial and keeps the field rules in one place per event type. The tree costs a few dozen
//! bytes per msgpack element, i.e. memory is linear in the (capped) payload.
//!
//! This module knows only the wire and the core's event types (`kvpick_core::event`), nothing
//! above them.

#![warn(clippy::arithmetic_side_effects)]

use rmpv::decode::read_value_ref_with_max_depth;
use rmpv::ValueRef;

pub use kvpick_core::event::{truncate, EngineHash, KvEvent, Medium, REPLAY_END_SEQ};

/// Largest payload frame decoded. One batch is one engine step, whose stores are bounded by the
/// tokens computed in that step (tens of thousands, a few hundred KiB of msgpack), so this leaves
/// over 10x headroom. It also caps the transient value tree (32 bytes per msgpack element): a
/// hostile 4 MiB frame of 1-byte elements peaks near 135 MiB (~540 MiB at 16 MiB).
pub const MAX_PAYLOAD_BYTES: usize = 4 << 20;

/// rmpv depth budget. rmpv spends ~2 units per container level and 3 per string/bin, so 64
/// admits ~30 nested containers; the deepest legitimate payload (a tuple inside `extra_keys`
/// inside an event inside the batch) needs under 20.
pub const MAX_DEPTH: usize = 64;

/// Longest untrusted string echoed back in an error or kept in [`Medium::Other`].
const MAX_ECHO: usize = 64;

/// One payload: the events of one engine step, in order.
#[derive(Debug, Clone, PartialEq)]
pub struct EventBatch {
    /// Engine wall-clock time (seconds since the epoch) when the batch was built.
    pub ts: f64,
    pub events: Vec<KvEvent>,
    /// Data-parallel rank of the publisher, when it says.
    pub data_parallel_rank: Option<u32>,
    /// Events with a tag this decoder does not know (a newer engine), skipped so the rest of the
    /// batch still applies.
    pub skipped_unknown: u32,
}

/// Why a message was rejected. Messages are short: they end up in logs and metrics labels.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("payload is {len} bytes, over the {max}-byte limit")]
    TooLarge { len: usize, max: usize },
    #[error("truncated msgpack")]
    Truncated,
    #[error("msgpack nested too deeply")]
    TooDeep,
    #[error("{0} trailing bytes after the batch")]
    TrailingBytes(usize),
    #[error("{field}: expected {expected}")]
    WrongType {
        field: &'static str,
        expected: &'static str,
    },
    #[error("{0} missing")]
    Missing(&'static str),
    #[error("unknown event type {0:?}")]
    UnknownEventType(String),
    #[error("token_ids has {tokens} tokens, expected {blocks} blocks x {block_size}")]
    TokenCount {
        tokens: usize,
        blocks: usize,
        block_size: u32,
    },
    #[error("cannot infer block_size: {tokens} tokens over {blocks} blocks")]
    BlockSize { tokens: usize, blocks: usize },
    #[error("event {index}: {source}")]
    Event {
        index: usize,
        source: Box<DecodeError>,
    },
    #[error("expected 2 or 3 frames, got {0}")]
    FrameCount(usize),
    #[error("seq frame is {0} bytes, expected 8")]
    SeqLength(usize),
}

fn wrong(field: &'static str, expected: &'static str) -> DecodeError {
    DecodeError::WrongType { field, expected }
}

const HASH: &str = "uint64, int64 or 8..=64-byte bin";

/// Decodes a multipart KV-event message: `[topic, seq (u64 big-endian), payload]`, or
/// `[seq, payload]` (empty topic). Returns the topic bytes, the sequence number and the batch.
pub fn decode_message(frames: &[&[u8]]) -> Result<(Vec<u8>, u64, EventBatch), DecodeError> {
    let (topic, seq, payload): (&[u8], &[u8], &[u8]) = match frames {
        [topic, seq, payload] => (topic, seq, payload),
        [seq, payload] => (&[], seq, payload),
        _ => return Err(DecodeError::FrameCount(frames.len())),
    };
    let seq = decode_seq(seq)?;
    let batch = decode_batch(payload)?;
    Ok((topic.to_vec(), seq, batch))
}

/// Decodes a sequence-number frame (8 bytes, big-endian). [`REPLAY_END_SEQ`] ends a replay.
pub fn decode_seq(frame: &[u8]) -> Result<u64, DecodeError> {
    <[u8; 8]>::try_from(frame)
        .map(u64::from_be_bytes)
        .map_err(|_| DecodeError::SeqLength(frame.len()))
}

/// Decodes one msgpack `EventBatch` payload.
pub fn decode_batch(payload: &[u8]) -> Result<EventBatch, DecodeError> {
    if payload.len() > MAX_PAYLOAD_BYTES {
        return Err(DecodeError::TooLarge {
            len: payload.len(),
            max: MAX_PAYLOAD_BYTES,
        });
    }
    let mut rd = payload;
    let root = read_value_ref_with_max_depth(&mut rd, MAX_DEPTH).map_err(|e| match e {
        rmpv::decode::Error::DepthLimitExceeded => DecodeError::TooDeep,
        _ => DecodeError::Truncated,
    })?;
    if !rd.is_empty() {
        return Err(DecodeError::TrailingBytes(rd.len()));
    }
    let fields = Fields::of(&root).ok_or(wrong("batch", "array or map"))?;
    let ts = fields.get(0, "ts").ok_or(DecodeError::Missing("ts"))?;
    let ts = as_f64(ts).ok_or(wrong("ts", "number"))?;
    let ValueRef::Array(list) = fields
        .get(1, "events")
        .ok_or(DecodeError::Missing("events"))?
    else {
        return Err(wrong("events", "array"));
    };
    let rank = fields
        .get(2, "data_parallel_rank")
        .or_else(|| fields.get(2, "attn_dp_rank"));
    let data_parallel_rank = rank.map(|v| as_u32(v, "data_parallel_rank")).transpose()?;
    let mut events = Vec::with_capacity(list.len());
    let mut skipped_unknown: u32 = 0;
    for (index, event) in list.iter().enumerate() {
        match decode_event(event) {
            Ok(event) => events.push(event),
            Err(DecodeError::UnknownEventType(_)) => {
                skipped_unknown = skipped_unknown.saturating_add(1)
            }
            Err(e) => {
                return Err(DecodeError::Event {
                    index,
                    source: Box::new(e),
                })
            }
        }
    }
    Ok(EventBatch {
        ts,
        events,
        data_parallel_rank,
        skipped_unknown,
    })
}

/// The fields of a batch or an event: positional (an `array_like` struct, tag already skipped)
/// or by name (a map).
enum Fields<'v, 'a> {
    Positional(&'v [ValueRef<'a>]),
    Named(&'v [(ValueRef<'a>, ValueRef<'a>)]),
}

impl<'v, 'a> Fields<'v, 'a> {
    fn of(v: &'v ValueRef<'a>) -> Option<Self> {
        match v {
            ValueRef::Array(items) => Some(Fields::Positional(items)),
            ValueRef::Map(entries) => Some(Fields::Named(entries)),
            _ => None,
        }
    }

    /// Field `pos` (positional) or `name` (map); `None` when absent or nil. Unknown extra
    /// positions and keys are never looked at.
    fn get(&self, pos: usize, name: &str) -> Option<&'v ValueRef<'a>> {
        let v = match self {
            Fields::Positional(items) => items.get(pos),
            Fields::Named(entries) => lookup(entries, name),
        };
        v.filter(|v| !matches!(v, ValueRef::Nil))
    }
}

fn lookup<'v, 'a>(
    entries: &'v [(ValueRef<'a>, ValueRef<'a>)],
    name: &str,
) -> Option<&'v ValueRef<'a>> {
    entries
        .iter()
        .find(|(k, _)| matches!(k, ValueRef::String(s) if s.as_str() == Some(name)))
        .map(|(_, v)| v)
}

fn decode_event(v: &ValueRef<'_>) -> Result<KvEvent, DecodeError> {
    let (tag, fields) = match v {
        ValueRef::Array(items) => {
            let (tag, rest) = items
                .split_first()
                .ok_or(DecodeError::Missing("event tag"))?;
            (tag, Fields::Positional(rest))
        }
        ValueRef::Map(entries) => {
            let tag = lookup(entries, "type").ok_or(DecodeError::Missing("type"))?;
            (tag, Fields::Named(entries))
        }
        _ => return Err(wrong("event", "array or map")),
    };
    let tag = as_str(tag).ok_or(wrong("event tag", "string"))?;
    match tag {
        "BlockStored" => decode_stored(&fields),
        "BlockRemoved" => Ok(KvEvent::BlockRemoved {
            block_hashes: hashes(&fields)?,
            medium: medium(fields.get(1, "medium"))?,
            group_idx: opt_u32(fields.get(2, "group_idx"), "group_idx")?,
        }),
        "AllBlocksCleared" => Ok(KvEvent::AllBlocksCleared),
        other => Err(DecodeError::UnknownEventType(
            truncate(other, MAX_ECHO).to_owned(),
        )),
    }
}

/// Positions (after the tag): block_hashes, parent_block_hash, token_ids, block_size, lora_id,
/// medium, lora_name, extra_keys (only the cache salt is read from it), group_idx,
/// kv_cache_spec_kind and kv_cache_spec_sliding_window (ignored), then anything newer (ignored).
fn decode_stored(fields: &Fields<'_, '_>) -> Result<KvEvent, DecodeError> {
    let block_hashes = hashes(fields)?;
    let parent_block_hash = match fields.get(1, "parent_block_hash") {
        Some(v) => Some(hash(v, "parent_block_hash")?).filter(|h| *h != 0),
        None => None,
    };
    let token_ids = match fields.get(2, "token_ids") {
        Some(v) => tokens(v)?,
        None => Vec::new(),
    };
    let block_size = match fields.get(3, "block_size") {
        Some(v) => as_u32(v, "block_size")?,
        None => infer_block_size(token_ids.len(), block_hashes.len())?,
    };
    if !token_ids.is_empty() {
        let expected = (block_hashes.len() as u64).checked_mul(u64::from(block_size));
        if expected != Some(token_ids.len() as u64) {
            return Err(DecodeError::TokenCount {
                tokens: token_ids.len(),
                blocks: block_hashes.len(),
                block_size,
            });
        }
    }
    let lora_id = match fields.get(4, "lora_id") {
        Some(ValueRef::Integer(i)) => Some(i.as_i64().ok_or(wrong("lora_id", "int64"))?),
        Some(_) => return Err(wrong("lora_id", "int64")),
        None => None,
    };
    let medium = medium(fields.get(5, "medium"))?;
    let mut sglang_salt = None;
    let lora_name = match fields.get(6, "lora_name") {
        Some(ValueRef::String(s)) => {
            Some(s.as_str().ok_or(wrong("lora_name", "UTF-8"))?.to_owned())
        }
        // Newer SGLang's BlockStoredWithMetadata puts a `{cache_salt}` map in this slot.
        Some(ValueRef::Map(entries)) if matches!(fields, Fields::Positional(_)) => {
            sglang_salt = entries.iter().find_map(|(k, v)| match (k, v) {
                (ValueRef::String(k), ValueRef::String(v)) if k.as_str() == Some("cache_salt") => {
                    v.as_str().map(|s| truncate(s, MAX_SALT).to_owned())
                }
                _ => None,
            });
            None
        }
        Some(_) => return Err(wrong("lora_name", "string")),
        None => None,
    };
    // The salt only salts a sequence's first block: a store that continues a chain has none.
    let cache_salt = match parent_block_hash {
        Some(_) => None,
        None => {
            sglang_salt.or_else(|| salt_of_first_block(fields.get(7, "extra_keys"), &lora_name))
        }
    };
    let group_idx = opt_u32(fields.get(8, "group_idx"), "group_idx")?;
    Ok(KvEvent::BlockStored {
        block_hashes,
        parent_block_hash,
        token_ids,
        block_size,
        lora_id,
        medium,
        lora_name,
        cache_salt,
        group_idx,
    })
}

/// Longest cache salt kept (longer ones are cut; a salt is an opaque tenant key).
const MAX_SALT: usize = 256;

/// vLLM's `extra_keys` is one entry per block (`tuple | None`); the first block's tuple is the
/// LoRA name, multimodal `(identifier, offset)` tuples, the cache salt, then prompt-embedding
/// keys, flattened. The salt is the last string after any multimodal tuple that is not the LoRA
/// name (a non-string key after it is skipped; a tuple before it ends the search). Anything else
/// in the field is ignored. (Old vLLM builds sent multimodal hashes as bare strings, which this
/// cannot tell from a salt.)
fn salt_of_first_block(
    extra_keys: Option<&ValueRef<'_>>,
    lora_name: &Option<String>,
) -> Option<String> {
    let ValueRef::Array(blocks) = extra_keys? else {
        return None;
    };
    let ValueRef::Array(first) = blocks.first()? else {
        return None;
    };
    for key in first.iter().rev() {
        match key {
            ValueRef::String(s) => {
                let s = s.as_str()?;
                return (lora_name.as_deref() != Some(s)).then(|| truncate(s, MAX_SALT).to_owned());
            }
            ValueRef::Array(_) | ValueRef::Map(_) => return None,
            _ => {}
        }
    }
    None
}

fn infer_block_size(tokens: usize, blocks: usize) -> Result<u32, DecodeError> {
    let err = DecodeError::BlockSize { tokens, blocks };
    if tokens == 0 {
        return Ok(0);
    }
    if blocks == 0 || !tokens.is_multiple_of(blocks) {
        return Err(err);
    }
    tokens
        .checked_div(blocks)
        .and_then(|size| u32::try_from(size).ok())
        .ok_or(err)
}

fn hashes(fields: &Fields<'_, '_>) -> Result<Vec<EngineHash>, DecodeError> {
    let v = fields
        .get(0, "block_hashes")
        .ok_or(DecodeError::Missing("block_hashes"))?;
    let ValueRef::Array(items) = v else {
        return Err(wrong("block_hashes", "array"));
    };
    items.iter().map(|h| hash(h, "block_hashes")).collect()
}

fn hash(v: &ValueRef<'_>, field: &'static str) -> Result<EngineHash, DecodeError> {
    match v {
        // uint64 as is; int64 (SGLang) keeps its two's-complement bits.
        ValueRef::Integer(i) => i
            .as_u64()
            .or_else(|| i.as_i64().map(|n| n as u64))
            .ok_or(wrong(field, HASH)),
        ValueRef::Binary(b) if (8..=64).contains(&b.len()) => b
            .last_chunk::<8>()
            .map(|tail| u64::from_be_bytes(*tail))
            .ok_or(wrong(field, HASH)),
        _ => Err(wrong(field, HASH)),
    }
}

fn tokens(v: &ValueRef<'_>) -> Result<Vec<u32>, DecodeError> {
    const EXPECTED: &str = "array of u32 token ids";
    let ValueRef::Array(items) = v else {
        return Err(wrong("token_ids", EXPECTED));
    };
    let mut out = Vec::with_capacity(items.len());
    for t in items {
        let id = match t {
            ValueRef::Integer(_) => as_u32(t, "token_ids")?,
            // SGLang EAGLE bigram pages send (t_j, t_j+1) pairs; the first is the token at j.
            ValueRef::Array(pair) if pair.len() == 2 => match pair.first() {
                Some(first) => as_u32(first, "token_ids")?,
                None => return Err(wrong("token_ids", EXPECTED)),
            },
            _ => return Err(wrong("token_ids", EXPECTED)),
        };
        out.push(id);
    }
    Ok(out)
}

fn medium(v: Option<&ValueRef<'_>>) -> Result<Medium, DecodeError> {
    match v {
        None => Ok(Medium::Gpu),
        Some(v) => as_str(v)
            .map(Medium::parse)
            .ok_or(wrong("medium", "string")),
    }
}

fn opt_u32(v: Option<&ValueRef<'_>>, field: &'static str) -> Result<Option<u32>, DecodeError> {
    v.map(|v| as_u32(v, field)).transpose()
}

fn as_u32(v: &ValueRef<'_>, field: &'static str) -> Result<u32, DecodeError> {
    match v {
        ValueRef::Integer(i) => i
            .as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .ok_or(wrong(field, "u32")),
        _ => Err(wrong(field, "u32")),
    }
}

fn as_f64(v: &ValueRef<'_>) -> Option<f64> {
    match v {
        ValueRef::F64(x) => Some(*x),
        ValueRef::F32(x) => Some(f64::from(*x)),
        ValueRef::Integer(i) => i.as_f64(),
        _ => None,
    }
}

fn as_str<'v>(v: &'v ValueRef<'_>) -> Option<&'v str> {
    match v {
        ValueRef::String(s) => s.as_str(),
        _ => None,
    }
}

/// `s` cut to at most `max` bytes on a char boundary.
#[cfg(test)]
#[allow(clippy::arithmetic_side_effects)]
mod tests {
    use super::*;
    use rmpv::Value;

    macro_rules! fixture {
        ($name:literal) => {
            include_bytes!(concat!("../../tests/fixtures/kv_events/", $name)).as_slice()
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
        }
    }

    fn decode(name: &str) -> EventBatch {
        let (_, bytes) = FIXTURES.iter().find(|(n, _)| *n == name).unwrap();
        decode_batch(bytes).unwrap_or_else(|e| panic!("{name}: {e}"))
    }

    #[test]
    fn vllm_array_layout() {
        let want = batch(
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
        let want = batch(
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
        let map =
            |kv: Vec<(&str, Value)>| Value::Map(kv.into_iter().map(|(k, v)| (s(k), v)).collect());
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
}
