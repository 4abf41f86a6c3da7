//! Fixtures the core's tests share: a request for a token prompt, and the KV event an engine
//! sends once it has stored a prompt's complete blocks. Test-only; it reads nothing but the
//! core's request and event types.

use crate::event::{KvEvent, Medium};
use crate::request::{PromptInput, SelectionRequest};

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
