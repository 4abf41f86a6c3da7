//! The warm state the decision benchmarks (`selection`, `pd`) share: an 8k-token prompt as block
//! hashes, and every rank holding its own 32-block history plus the prompt's first 8 blocks
//! (every 97th rank a deeper part of it). Included by each bench with `mod common;`.

use kvpick::selection::{PartitionKey, RankKey, SelectionCore};
use kvpick::sources::catalog::WorkerSpec;
use kvpick_core::hash::{prompt_hashes, BASE_SEED};
use kvpick_core::index::Tier;

pub const PROMPT_TOKENS: u32 = 8_192;
pub const BLOCK: usize = 16;

/// The prompt's token ids (fixed, distinct per position).
pub fn prompt_tokens() -> Vec<u32> {
    (0..PROMPT_TOKENS)
        .map(|t| t.wrapping_mul(2_654_435_761))
        .collect()
}

/// Applies the catalog `specs` (all serving model `m`) and fills every rank with the warm state;
/// returns the prompt's block hashes.
pub fn warm(core: &SelectionCore, specs: Vec<WorkerSpec>) -> Vec<u64> {
    core.apply_snapshot(specs).unwrap();
    let key = PartitionKey {
        model: "m".into(),
        routing_group: String::new(),
    };
    let prompt = prompt_hashes(&prompt_tokens(), BLOCK, BASE_SEED);
    let mut i = 0usize;
    for view in core.list_workers(None) {
        for r in &view.record.ranks {
            let rank = RankKey {
                worker_id: view.record.id,
                dp_rank: r.dp_rank,
            };
            let own: Vec<u32> = (0..32 * BLOCK as u32)
                .map(|t| t ^ (i as u32) << 16)
                .collect();
            core.insert_blocks(
                &key,
                rank,
                &prompt_hashes(&own, BLOCK, BASE_SEED),
                Tier::Gpu,
                None,
            );
            let depth = if i.is_multiple_of(97) {
                8 + (i * 31) % 504
            } else {
                8
            };
            core.insert_blocks(&key, rank, &prompt[..depth], Tier::Gpu, None);
            i += 1;
        }
    }
    prompt
}
