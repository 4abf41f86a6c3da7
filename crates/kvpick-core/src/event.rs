//! Block events: what a model server says about its KV cache, as values. The wire decoder
//! (`kvpick::sources::events::decode`) turns ZeroMQ/msgpack bytes into these; the partition applies them to
//! the index. Nothing here knows a byte format, a socket or a clock.

// Request fields and KV events come from the network: arithmetic on them says what happens at
// the edge (checked, saturating) instead of wrapping in release builds and panicking in debug.
#![warn(clippy::arithmetic_side_effects)]

/// Longest untrusted tier name kept in [`Medium::Other`].
const MAX_TIER_NAME: usize = 64;

/// An engine's block hash, normalised to 64 bits (see the module docs). Only a key for removals
/// and tokenless stores: kvpick recomputes its own block hashes from `token_ids`.
pub type EngineHash = u64;

/// Sequence number of the end-of-replay marker frame (`-1` as a big-endian i64).
pub const REPLAY_END_SEQ: u64 = u64::MAX;

/// Storage tier a block lives in.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub enum Medium {
    /// Accelerator memory. Also what a missing, nil or empty medium means.
    #[default]
    Gpu,
    /// Host memory (vLLM `"CPU"`, SGLang `"CPU_PINNED"`).
    Cpu,
    /// Local disk / SSD.
    Disk,
    /// Any other tier name, as sent (truncated to 64 bytes), e.g. SGLang's `"EXTERNAL"`.
    Other(String),
}

impl Medium {
    /// Case-insensitive; a `:N` device suffix is ignored (`"cuda:0"` is [`Medium::Gpu`]).
    pub fn parse(s: &str) -> Medium {
        let base = s.split(':').next().unwrap_or_default().trim();
        match base.to_ascii_lowercase().as_str() {
            "" | "gpu" | "cuda" | "rocm" | "hbm" | "device" | "xpu" | "hpu" | "npu" | "tpu" => {
                Medium::Gpu
            }
            "cpu" | "cpu_pinned" | "pinned" | "host" | "dram" | "ram" => Medium::Cpu,
            "disk" | "ssd" | "nvme" | "local_disk" | "localdisk" | "file" => Medium::Disk,
            _ => Medium::Other(truncate(s, MAX_TIER_NAME).to_owned()),
        }
    }

    /// A cluster-wide store any rank of the model can load from (SGLang's `"EXTERNAL"`): the
    /// partition's shared tier when one is configured, else the storing rank's disk tier.
    pub fn is_shared(&self) -> bool {
        matches!(self, Medium::Other(name) if name.trim().eq_ignore_ascii_case("external"))
    }
}

/// One decoded KV event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// `block_hashes.len()` consecutive blocks were stored. `token_ids` holds
    /// `block_hashes.len() * block_size` tokens, or is empty for a tokenless store (offload tiers
    /// announce blocks by hash only).
    BlockStored {
        block_hashes: Vec<EngineHash>,
        /// The block before the first one here; `None` at a sequence start (nil or 0 on the wire).
        parent_block_hash: Option<EngineHash>,
        token_ids: Vec<u32>,
        /// Tokens per block; 0 only for a tokenless store that did not say.
        block_size: u32,
        /// Deprecated vLLM field, kept for completeness.
        lora_id: Option<i64>,
        medium: Medium,
        lora_name: Option<String>,
        /// The request's `cache_salt`, which the engine mixed into the first block of the prompt
        /// (vLLM: the first block's `extra_keys`; SGLang: its metadata); only on a store that starts
        /// a sequence.
        cache_salt: Option<String>,
        /// KV-cache group (hybrid models); `None` when not sent.
        group_idx: Option<u32>,
        /// Multimodal keys of the stored blocks (vLLM's `extra_keys` `(identifier, offset)`
        /// pairs), in block order and, within a block, in the engine's order; empty for a
        /// text-only store. Folded into the block's key like a request's (`hash::fold_media`).
        media: Vec<BlockMedia>,
    },
    /// These blocks were evicted from `medium`.
    BlockRemoved {
        block_hashes: Vec<EngineHash>,
        medium: Medium,
        group_idx: Option<u32>,
    },
    /// Every block of the rank is gone.
    AllBlocksCleared,
}

/// One multimodal key of a stored block: the block's index within its event and the key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockMedia {
    pub block: u32,
    pub key: crate::hash::MediaKey,
}

/// The longest prefix of `s` of at most `max` bytes that ends on a char boundary.
pub fn truncate(s: &str, max: usize) -> &str {
    let end = (0..=max.min(s.len()))
        .rev()
        .find(|&i| s.is_char_boundary(i))
        .unwrap_or(0);
    s.get(..end).unwrap_or_default()
}
