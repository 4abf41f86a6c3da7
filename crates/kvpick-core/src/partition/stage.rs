//! What one decision's stages hand each other, as values: the prompt as blocks
//! ([`PromptBlocks`]), the selection as the stages see it ([`Ask`], with flow control's
//! [`Check`]), what eligibility and the SLO gate left ([`Field`]), the decision ([`Decided`],
//! with what session affinity did to it, [`Affinity`]), why a stage refused ([`Refusal`]) and
//! the pick the booking installs ([`Pick`]).
//!
//! It is the bottom of the partition's stages: [`super::select`] runs them in order and
//! [`super::pipeline`], [`super::pair`], [`super::sparse`], [`super::admission`] and
//! [`super::booking`] read these values, so none of them reads another to learn a type. It owns
//! no rule: it must not decide, book or touch the queue (the SLO gate, [`Check::meet_slo`], is
//! `admission`'s).

#![warn(clippy::arithmetic_side_effects)]

use std::time::Instant;

use crate::config::CoreConfig;
use crate::decide::{Candidate, Decision};
use crate::error::SelectError;
use crate::index::TierDepths;
use crate::request::SelectionRequest;
use crate::types::{RankKey, Role};

use super::{Partition, State};

/// The prompt reduced to what the index and cost function need.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PromptBlocks {
    pub tokens: u64,
    /// Every complete block's chained hash (at most `max_prompt_blocks`): what a pick predicts
    /// its rank will hold once the prompt is prefilled.
    pub seq_hashes: Vec<u64>,
    /// Of `seq_hashes`, how many leading blocks an engine can reuse
    /// ([`super::pipeline::reusable_blocks`]): what a match is read over, so overlaps and the
    /// decision credit only those.
    pub reusable: usize,
    /// The request had a prompt (even an empty one): only such requests create session
    /// bindings. The queue keeps this, not the prompt.
    pub present: bool,
}

impl PromptBlocks {
    /// The blocks a match reads: the leading ones an engine can reuse.
    pub fn match_hashes(&self) -> &[u64] {
        &self.seq_hashes[..self.reusable.min(self.seq_hashes.len())]
    }
}

/// What session affinity did to the decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Affinity {
    /// No usable binding: the decision stands.
    Unbound,
    /// The bound rank was moved to the front of the ranking.
    Kept,
    /// Soft mode: the bound rank cost too much (or was not a candidate); the binding goes.
    Overridden,
}

/// One selection as the stages see it: the request and its blocks, its booking (id,
/// generation) when the pick is booked, and flow control's check when saturation may make it
/// wait.
pub(super) struct Ask<'a> {
    pub prompt: &'a PromptBlocks,
    pub request: &'a SelectionRequest,
    pub booking: Option<(&'a str, u64)>,
    pub config: &'a CoreConfig,
    pub now: Instant,
    pub admission: Option<&'a Check>,
    /// Cost every eligible rank (the full path), never the bounded search ([`super::sparse`]).
    pub exhaustive: bool,
    /// The prompt's matches, read before the state lock was taken (so concurrent picks read
    /// the index in parallel); `None` reads them under it.
    pub matches: Option<&'a crate::index::Matches>,
}

/// The prompt's matches, read once and only when a stage needs them.
pub(super) struct LazyMatches(pub(super) Option<crate::index::Matches>);

impl LazyMatches {
    pub fn get(&mut self, state: &State, ask: &Ask) -> &crate::index::Matches {
        self.0.get_or_insert_with(|| Partition::matches(state, ask))
    }

    pub fn take(self, state: &State, ask: &Ask) -> crate::index::Matches {
        self.0.unwrap_or_else(|| Partition::matches(state, ask))
    }

    /// One rank's depths: from the matches when read, else from the index for that rank only.
    pub fn depths_of(&self, state: &State, ask: &Ask, rank: &RankKey) -> TierDepths {
        match (&self.0, ask.matches) {
            (Some(m), _) | (None, Some(m)) => m.depths_of(rank),
            (None, None) => match &ask.request.remote_overlap {
                Some(remote) => Partition::remote_matches(state, remote, ask).depths_of(rank),
                None => state
                    .kv_read()
                    .index
                    .rank_depths(rank, ask.prompt.match_hashes(), ask.now),
            },
        }
    }
}

/// What eligibility and the SLO gate left: candidate `i` is rank `eligible[i]` of the table.
pub(super) struct Field {
    pub(super) block_size: u32,
    pub eligible: Vec<usize>,
    pub candidates: Vec<Candidate>,
    /// The session's bound rank, while it may still serve the request.
    pub(super) bound: Option<RankKey>,
    /// A child session without a binding of its own: its parent's bound rank (a soft
    /// preference, [`super::pipeline::prefer_parent`]).
    pub(super) parent: Option<RankKey>,
}

/// The decision: the ranking, each candidate's role when the partition splits prefill and
/// decode, and whether session affinity kept the bound rank.
pub(super) struct Decided {
    pub decision: Decision,
    pub(super) roles: Option<Vec<Role>>,
    pub affinity: Affinity,
    /// A child session's parent rank, when it had one: taken or declined.
    pub(super) parent: Option<crate::session::ParentPick>,
}

/// Why the pipeline did not book a request.
#[derive(Debug)]
pub(crate) enum Refusal {
    /// Every eligible rank is saturated (or the hard-bound one is): the request may wait.
    Saturated,
    /// No rank can give the request its first token within its SLO, even idle.
    SloUnmeetable(String),
    Error(SelectError),
}

impl Refusal {
    pub fn into_error(self) -> SelectError {
        match self {
            Refusal::Saturated => {
                SelectError::Overloaded("every eligible worker is saturated".into())
            }
            Refusal::SloUnmeetable(message) => SelectError::Overloaded(message),
            Refusal::Error(e) => e,
        }
    }
}

impl From<SelectError> for Refusal {
    fn from(e: SelectError) -> Self {
        Refusal::Error(e)
    }
}

/// The flow-control checks of one attempt to place a request.
pub(crate) struct Check {
    pub enqueued: Instant,
    /// TTFT objective in seconds, counted from `enqueued`.
    pub slo_ttft: Option<f64>,
    /// TPOT objective, seconds per output token.
    pub slo_tpot: Option<f64>,
}

impl Check {
    pub fn new(request: &SelectionRequest, enqueued: Instant) -> Self {
        Check {
            enqueued,
            slo_ttft: request.slo_ttft_ms.map(|ms| ms as f64 / 1000.0),
            slo_tpot: request.slo_tpot_ms.map(|ms| ms as f64 / 1000.0),
        }
    }
}

/// What the decision chose, as the booking stage needs it.
pub(super) struct Pick<'a> {
    pub(super) booking_id: &'a str,
    pub(super) generation: u64,
    pub(super) rank: RankKey,
    pub(super) overlap: TierDepths,
    pub(super) prompt: &'a PromptBlocks,
    pub(super) block_size: u32,
    pub(super) ttft_tokens: f64,
    pub(super) predicted_ttft: f64,
    /// The prefill rank and the prompt's overlap there, when the pair decision split the request.
    pub(super) prefill: Option<(RankKey, TierDepths)>,
}

/// What a pick reads of the shared tier: the prompt's runs and the multiplier.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct SharedView<'a> {
    pub runs: &'a [u32],
    pub weight: f64,
}

impl<'a> SharedView<'a> {
    /// The view of `Partition::shared_runs`' answer (none: no shared blocks).
    pub fn of(runs: Option<&'a (Vec<u32>, f64)>) -> Self {
        runs.map_or_else(Default::default, |(runs, weight)| SharedView {
            runs,
            weight: *weight,
        })
    }

    /// Blocks a rank whose own overlap ends at `depth` can load from the shared tier.
    pub fn beyond(&self, depth: u32) -> u32 {
        self.runs.get(depth as usize).copied().unwrap_or(0)
    }
}
