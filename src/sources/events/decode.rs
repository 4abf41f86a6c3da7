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
//! - `extra_keys` (vLLM): the first block's cache salt, and every block's multimodal
//!   `(identifier, offset)` pairs (ARCHITECTURE.md §7, docs/kv-events.md "Multimodal");
//! - block hashes as uint64, int64 (SGLang's `hash_str_to_int64`; the bits are kept) or bin of
//!   8..=64 bytes (vLLM's sha256 / xxhash-128 `bytes` hashes; the last 8 bytes big-endian, the
//!   same value vLLM's `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES` would have sent);
//! - vLLM 0.32's KV-cache group kinds (`kv_cache_spec_kind`, `kv_cache_spec_sliding_window`),
//!   returned beside the events ([`EventBatch::group_specs`]); a store announcing a kind whose
//!   `token_ids` do not split into its blocks (vLLM leaves null blocks out of `block_hashes` only)
//!   is kept tokenless instead of failing the batch.
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

pub use kvpick_core::event::{truncate, BlockMedia, EngineHash, KvEvent, Medium, REPLAY_END_SEQ};
use kvpick_core::hash::{media_id, MediaKey};

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
    /// The KV-cache group kinds the batch's stores announce (vLLM 0.32+: `kv_cache_spec_kind`,
    /// `kv_cache_spec_sliding_window`), one entry per store that carries a kind, in event order.
    /// Kept beside `events` rather than in them: what a kind means for the index is decided above
    /// the decoder (`events::groups`), and the core's events stay engine-neutral.
    pub group_specs: Vec<GroupSpec>,
}

/// A `BlockStored`'s KV-cache group kind, as the engine announced it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupSpec {
    /// Position of the store in [`EventBatch::events`].
    pub event: usize,
    pub kind: SpecKind,
    /// Tokens of the group's window (sliding-window kinds), when sent.
    pub sliding_window: Option<u32>,
}

/// vLLM's `KVCacheSpecKind` (`vllm/v1/kv_cache_interface.py`, `get_kv_cache_spec_kind`): what
/// kind of layers a KV-cache group holds. A name this decoder does not know is [`SpecKind::Unknown`]
/// (as vLLM's own `"unknown"`), so a newer engine's kind is bounded in logs and metric labels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum SpecKind {
    FullAttention,
    MlaAttention,
    SinkFullAttention,
    SlidingWindow,
    SlidingWindowMla,
    ChunkedLocalAttention,
    Mamba,
    EncoderOnlyAttention,
    CrossAttention,
    Unknown,
}

impl SpecKind {
    pub const ALL: [SpecKind; 10] = [
        SpecKind::FullAttention,
        SpecKind::MlaAttention,
        SpecKind::SinkFullAttention,
        SpecKind::SlidingWindow,
        SpecKind::SlidingWindowMla,
        SpecKind::ChunkedLocalAttention,
        SpecKind::Mamba,
        SpecKind::EncoderOnlyAttention,
        SpecKind::CrossAttention,
        SpecKind::Unknown,
    ];

    /// The wire name (vLLM's enum value), also the metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            SpecKind::FullAttention => "full_attention",
            SpecKind::MlaAttention => "mla_attention",
            SpecKind::SinkFullAttention => "sink_full_attention",
            SpecKind::SlidingWindow => "sliding_window",
            SpecKind::SlidingWindowMla => "sliding_window_mla",
            SpecKind::ChunkedLocalAttention => "chunked_local_attention",
            SpecKind::Mamba => "mamba",
            SpecKind::EncoderOnlyAttention => "encoder_only_attention",
            SpecKind::CrossAttention => "cross_attention",
            SpecKind::Unknown => "unknown",
        }
    }

    /// Exact, as vLLM writes them; anything else is [`SpecKind::Unknown`].
    pub fn parse(s: &str) -> SpecKind {
        SpecKind::ALL
            .into_iter()
            .find(|k| k.as_str() == s)
            .unwrap_or(SpecKind::Unknown)
    }
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
    let mut group_specs = Vec::new();
    let mut skipped_unknown: u32 = 0;
    for (index, event) in list.iter().enumerate() {
        match decode_event(event) {
            Ok((event, spec)) => {
                if let Some((kind, sliding_window)) = spec {
                    group_specs.push(GroupSpec {
                        event: events.len(),
                        kind,
                        sliding_window,
                    });
                }
                events.push(event)
            }
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
        group_specs,
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

/// A store's announced group kind and window.
type Spec = Option<(SpecKind, Option<u32>)>;

fn decode_event(v: &ValueRef<'_>) -> Result<(KvEvent, Spec), DecodeError> {
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
        "BlockRemoved" => Ok((
            KvEvent::BlockRemoved {
                block_hashes: hashes(&fields)?,
                medium: medium(fields.get(1, "medium"))?,
                group_idx: opt_u32(fields.get(2, "group_idx"), "group_idx")?,
            },
            None,
        )),
        "AllBlocksCleared" => Ok((KvEvent::AllBlocksCleared, None)),
        other => Err(DecodeError::UnknownEventType(
            truncate(other, MAX_ECHO).to_owned(),
        )),
    }
}

/// Positions (after the tag): block_hashes, parent_block_hash, token_ids, block_size, lora_id,
/// medium, lora_name, extra_keys (the cache salt and the multimodal pairs are read from it),
/// group_idx, kv_cache_spec_kind and kv_cache_spec_sliding_window (returned beside the event),
/// then anything newer (ignored: vLLM 0.32's locality, ownership, session_id).
fn decode_stored(fields: &Fields<'_, '_>) -> Result<(KvEvent, Spec), DecodeError> {
    let block_hashes = hashes(fields)?;
    let parent_block_hash = match fields.get(1, "parent_block_hash") {
        Some(v) => Some(hash(v, "parent_block_hash")?).filter(|h| *h != 0),
        None => None,
    };
    let mut token_ids = match fields.get(2, "token_ids") {
        Some(v) => tokens(v)?,
        None => Vec::new(),
    };
    let spec = group_spec(fields)?;
    let block_size = match fields.get(3, "block_size") {
        Some(v) => as_u32(v, "block_size")?,
        None => infer_block_size(token_ids.len(), block_hashes.len())?,
    };
    if !token_ids.is_empty() {
        let expected = (block_hashes.len() as u64).checked_mul(u64::from(block_size));
        if expected != Some(token_ids.len() as u64) {
            if spec.is_none() {
                return Err(DecodeError::TokenCount {
                    tokens: token_ids.len(),
                    blocks: block_hashes.len(),
                    block_size,
                });
            }
            // vLLM (0.32) leaves a group's null blocks (outside a sliding window, Mamba blocks
            // between its aligned states) out of block_hashes but not out of token_ids, which
            // then cannot be split into the blocks: the store is kept tokenless (only blocks
            // already known by hash can apply) and its group decides the rest (events::groups).
            token_ids = Vec::new();
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
    let media = media_keys(fields.get(7, "extra_keys"), block_hashes.len());
    let event = KvEvent::BlockStored {
        block_hashes,
        parent_block_hash,
        token_ids,
        block_size,
        lora_id,
        medium,
        lora_name,
        cache_salt,
        group_idx,
        media,
    };
    Ok((event, spec))
}

/// A store's `kv_cache_spec_kind` and `kv_cache_spec_sliding_window` (vLLM 0.32+), when sent.
fn group_spec(fields: &Fields<'_, '_>) -> Result<Spec, DecodeError> {
    let Some(v) = fields.get(9, "kv_cache_spec_kind") else {
        return Ok(None);
    };
    let kind = as_str(v).ok_or(wrong("kv_cache_spec_kind", "string"))?;
    let window = opt_u32(
        fields.get(10, "kv_cache_spec_sliding_window"),
        "kv_cache_spec_sliding_window",
    )?;
    Ok(Some((SpecKind::parse(kind), window)))
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

/// The multimodal `(identifier, offset)` pairs of each block's `extra_keys` entry (vLLM's
/// `to_event_extra_keys`: the `("mm", identifier, offset)` keys of `_gen_mm_extra_hash_keys` with
/// their tag dropped), as [`BlockMedia`] in block order. A two-item array of a string and an
/// integer is a pair; every other key (LoRA name, salt, prompt-embedding digest) is not. At most
/// one entry per stored block is read; a malformed field adds no keys (the block then hashes as
/// text, as before this field was read).
fn media_keys(extra_keys: Option<&ValueRef<'_>>, blocks: usize) -> Vec<BlockMedia> {
    let Some(ValueRef::Array(entries)) = extra_keys else {
        return Vec::new();
    };
    let mut media = Vec::new();
    for (block, entry) in entries.iter().take(blocks).enumerate() {
        let ValueRef::Array(keys) = entry else {
            continue;
        };
        for key in keys {
            let ValueRef::Array(pair) = key else {
                continue;
            };
            let [ValueRef::String(id), ValueRef::Integer(offset)] = pair.as_slice() else {
                continue;
            };
            let (Some(id), Some(offset), Ok(block)) =
                (id.as_str(), offset.as_i64(), u32::try_from(block))
            else {
                continue;
            };
            media.push(BlockMedia {
                block,
                key: MediaKey {
                    id: media_id(id),
                    offset,
                },
            });
        }
    }
    media
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

#[cfg(test)]
#[path = "decode_tests.rs"]
mod tests;

#[cfg(test)]
#[path = "decode_multimodal_tests.rs"]
mod multimodal_tests;
