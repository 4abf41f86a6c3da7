//! Fixtures the core's tests share: a one-rank worker whose KV events flow, a request for a
//! token prompt, a prompt of whole blocks, and the KV event an engine sends once it has stored a
//! prompt's complete blocks. Test-only; it reads nothing but the core's catalog, request and
//! event types.

use crate::catalog::{RankLayout, WorkerSpec};
use crate::event::{KvEvent, Medium};
use crate::request::{PromptInput, SelectionRequest};
use crate::types::RankKey;

/// The block size of [`evented_worker`].
pub(crate) const BS: u32 = 16;

/// A worker of model `m` with one rank on `port`, blocks of [`BS`] tokens and a KV-event
/// endpoint, so its rank is precise once an event arrives.
pub(crate) fn evented_worker(name: &str, port: u16) -> WorkerSpec {
    WorkerSpec {
        block_size: Some(BS),
        kv_events: Some(format!("tcp://127.0.0.1:{}", 5557 + port)),
        ..WorkerSpec::for_test(name, "m", RankLayout::PerPort(vec![port]))
    }
}

/// The only rank of a one-rank worker.
pub(crate) fn rank_of(spec: &WorkerSpec) -> RankKey {
    RankKey {
        worker_id: spec.worker_id(),
        dp_rank: 0,
    }
}

/// `blocks` blocks of [`BS`] tokens numbered from `first`, and one token more so every block is
/// reusable (an engine never reuses the block holding a prompt's last token).
pub(crate) fn whole_blocks(first: u32, blocks: u32) -> Vec<u32> {
    (first..first + blocks * BS + 1).collect()
}

/// A request for model `m` with `tokens` as its prompt.
pub(crate) fn token_request(id: &str, tokens: Vec<u32>) -> SelectionRequest {
    SelectionRequest {
        request_id: id.into(),
        model: Some("m".into()),
        prompt: PromptInput::Tokens(tokens),
        ..Default::default()
    }
}

/// The engine announces `tokens`' complete blocks of `block_size` on its GPU (as vLLM does after
/// the prefill), its own hashes numbered from `first_hash`.
pub(crate) fn gpu_store(tokens: &[u32], block_size: u32, first_hash: u64) -> KvEvent {
    let blocks = tokens.len() / block_size as usize;
    KvEvent::BlockStored {
        block_hashes: (0..blocks as u64).map(|i| first_hash + i).collect(),
        parent_block_hash: None,
        token_ids: tokens[..blocks * block_size as usize].to_vec(),
        block_size,
        lora_id: None,
        medium: Medium::Gpu,
        lora_name: None,
        cache_salt: None,
        group_idx: None,
        media: Vec::new(),
    }
}
