//! KV transfer hints (ARCHITECTURE.md §4, "Transfer hints"): when a booked pick holds less of
//! the prompt's prefix than another rank (the holder is saturated, or the cost preferred an idle
//! rank), name a holder the picked engine may pull the prefix from instead of recomputing it —
//! llm-d's `x-kv-cache-source-host-port`, vLLM's `kv_transfer_params.remote_kv_source`. The
//! holder is the least loaded of the schedulable ranks holding the longest prefix (GPU or host
//! tier: what a P2P connector serves), so pulls spread over holders by load. Read-only: it never
//! changes the decision, the booking or the index, and never answers a query-only selection.

#![warn(clippy::arithmetic_side_effects)]

use super::stage::Ask;
use super::{pipeline, Partition, State};
use crate::outcome::{PickedRank, TransferHint};
use crate::types::RankKey;

/// The least a holder must lead the pick by, in blocks, to be worth a pull.
pub const MIN_TRANSFER_GAIN_BLOCKS: u32 = 1;

impl Partition {
    /// The hint for a booked pick of `primary`, with `--kv-transfer-hints`; `None` when the
    /// pick holds the longest prefix itself (or within [`MIN_TRANSFER_GAIN_BLOCKS`]), nothing
    /// else holds more, or the selection is query-only.
    pub(super) fn transfer_hint(
        &self,
        state: &State,
        ask: &Ask,
        primary: &PickedRank,
    ) -> Option<TransferHint> {
        if !ask.config.kv_transfer_hints
            || ask.booking.is_none()
            || ask.prompt.match_hashes().is_empty()
        {
            return None;
        }
        // Checked against the ranks the index knows (a base read before the lock may speak
        // for ranks it never interned).
        let matches = Self::matches(state, ask);
        let own = matches.depths_of(&primary.key).host;
        let serves = |key: &RankKey| {
            *key != primary.key
                && state
                    .ranks
                    .get(key)
                    .is_some_and(|s| s.schedulable && s.reachable)
        };
        let best = matches
            .ranks
            .iter()
            .filter(|(k, _)| serves(k))
            .map(|(_, d)| d.host)
            .max()?;
        let gain = best.checked_sub(own)?;
        if gain < MIN_TRANSFER_GAIN_BLOCKS {
            return None;
        }
        let source = matches
            .ranks
            .iter()
            .filter(|(k, d)| d.host == best && serves(k))
            .filter_map(|(k, _)| Some((*k, state.ranks.get(k)?)))
            .min_by_key(|(k, s)| {
                let load = s.total_load();
                (load.active_requests, load.active_prefill_tokens, s.tie, *k)
            })?;
        let position = state.ranks.position(&source.0)?;
        Some(TransferHint {
            source: pipeline::picked(&state.ranks.slots, position)?,
            blocks: best,
            gain,
        })
    }
}
