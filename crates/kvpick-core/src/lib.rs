//! kvpick-core: the selection core of kvpick, with no I/O. It owns the KV index and block
//! hashing, the partitions (ranks, load, bookings, session affinity), the staged decision and the
//! catalog as data. Time is an argument (`now: Instant`), and what an operation changed comes back
//! as [`facts::Facts`] for the host to record: this crate depends on no async runtime, network,
//! Kubernetes or metrics crate, so every decision is unit-testable and replayable.
//!
//! # Layout (bottom to top; a module imports only from those above it in this list)
//! - [`types`]: `RankKey`, `Lifecycle`, tiers, `PartitionKey`, `RankLoad` — the shared vocabulary.
//! - [`event`]: KV block events as values (the wire decoder in the `kvpick` crate makes them).
//! - [`hash`]: block hashes (`xxh3`, chained per prefix).
//! - [`index`]: which ranks hold which blocks, per tier; longest-prefix matches.
//! - [`estimate`]: the TTFT estimator the cost is calibrated by (learnt from observations).
//! - [`error`], [`facts`], [`request`], [`config`]: what goes in and comes out of the core.
//! - [`catalog`]: worker specs and records, the union of sources, the reconcile diff.
//! - [`engine`]: one scrape of a rank's engine metrics, as a value (the host scrapes).
//! - [`decide`]: the pure cost function and choice.
//! - [`disagg`]: the pure prefill/decode pair decision (decode rank, whether to split, prefill
//!   rank), for partitions whose ranks declare roles.
//! - [`session`]: the session-affinity table.
//! - `spin`: the partition's locks, which spin briefly before they park.
//! - [`flow`]: flow control's queue discipline (bands, fair queuing, EDF) and saturation rule.
//! - `partition`: one `(model, routing_group)` behind one lock; its `pipeline` runs the selection
//!   stages (eligibility, pin, adapter, busy, candidates, decide, affinity, fallbacks), then books.
//! - [`core`]: [`Core`], the catalog, partitions and booking registry every host drives.

#![forbid(unsafe_code)]

pub mod catalog;
pub mod config;
pub mod core;
pub mod decide;
pub mod disagg;
pub mod engine;
pub mod error;
pub mod estimate;
pub mod event;
pub mod facts;
pub mod flow;
pub mod hash;
pub mod index;
pub mod live;
#[cfg(test)]
mod live_tests;
pub mod outlier;
mod partition;
pub mod request;
pub mod session;
mod spin;
pub mod types;

use std::net::SocketAddr;

pub use crate::catalog::{ApplyReport, SourceName, WorkerRecord, WorkerSpec};
pub use crate::config::{
    BookingBounds, BusyThresholds, CoreConfig, DEFAULT_BLOCK_SIZE, DEFAULT_PREDICTED_TTL,
};
pub use crate::core::Core;
pub use crate::decide::{
    cost, decide, engine_metrics_cost, overlap_score, Candidate, CostParams, Decision,
};
pub use crate::disagg::PdConfig;
pub use crate::engine::{AdapterFit, EngineLoad, EngineMetrics};
pub use crate::error::{CatalogError, ConfigError, SelectError};
pub use crate::estimate::{Coefficients, EstimatorConfig, TpotEstimator, TtftEstimator};
pub use crate::facts::{Fact, Facts, QueueEvent, QueueExit, ResponseClass};
pub use crate::flow::{FlowConfig, SaturationLimits};
pub use crate::live::{LiveConfig, LiveConfigError};
pub use crate::partition::EventStats;
pub use crate::request::{
    clip, Claim, DuplicateId, EndpointFilter, Holder, Pin, PromptInput, SelectionRequest,
};
pub use crate::session::{AffinityMode, Installed, SessionConfig, SessionOutcome};
pub use crate::types::{Lifecycle, PartitionKey, RankKey, RankLoad, Role};

/// One picked rank, with everything a host needs to route to it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PickedRank {
    pub key: RankKey,
    pub worker_name: String,
    pub endpoint: SocketAddr,
    pub multiplexed: bool,
}

/// The outcome of a successful pick.
#[derive(Debug, Clone, PartialEq)]
pub struct Selection {
    pub booking_id: String,
    /// Tells this booking apart from any other that ever had the same id; 0 when nothing was
    /// booked.
    pub generation: u64,
    pub partition: PartitionKey,
    pub primary: PickedRank,
    pub fallbacks: Vec<PickedRank>,
    /// Prefill/decode disaggregation: the rank that prefills for `primary` (the decode rank),
    /// booked with it; `None` = the primary prefills itself (always, without role-split ranks).
    pub prefill: Option<PickedRank>,
    /// Blocks of the prompt already cached on the primary (GPU tier), as many as an engine can
    /// reuse (never the last token's block of a block-aligned prompt).
    pub overlap_blocks: u32,
    /// The prompt tokens predicted served from the primary's cache: `overlap_blocks` times the
    /// block size (what the engine should report as `cached_tokens`).
    pub predicted_cached_tokens: u64,
    /// Complete blocks in the prompt.
    pub prompt_blocks: u32,
    pub prompt_tokens: u64,
    pub cost: f64,
    /// What session affinity did, when the request had a session id.
    pub session: Option<SessionOutcome>,
    /// Ranks whose cost the decision computed: every eligible rank on the full path, the deeper
    /// matches and the cheapest few by load on the bounded search.
    pub candidates: u32,
    /// The first-token time the estimator predicted for this pick, in seconds.
    pub predicted_ttft_seconds: f64,
    /// With [`SelectionRequest::scores`] > 0: the scored endpoints, one per address, at most that
    /// many — the destinations (primary, then fallbacks) first, then the other candidates best
    /// first. Empty otherwise.
    pub scores: Vec<EndpointScore>,
}

/// One endpoint's score in the decision that picked ([`Selection::scores`]): what a gateway
/// weighing fallbacks reads (llm-d-router's `x-gateway-destination-endpoint-scores`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EndpointScore {
    /// The address (`ip:port`). Ranks of a multiplexed data-parallel engine share one: it carries
    /// the picked rank's score when it is a destination, else its best rank's.
    pub endpoint: SocketAddr,
    /// The rank the score is for.
    pub rank: RankKey,
    /// The decision's cost of the rank ([`decide::cost`]: uncached prefill blocks at the
    /// partition's speed; lower is better).
    pub cost: f64,
}

impl EndpointScore {
    /// The score: [`decide::gateway_score`] of the cost, in (0, 1], higher is better.
    pub fn score(&self) -> f64 {
        decide::gateway_score(self.cost)
    }
}

/// A read-only view of one worker and its per-rank load, for listing.
#[derive(Debug, Clone)]
pub struct WorkerView {
    pub record: WorkerRecord,
    pub loads: Vec<RankLoad>,
    /// Per rank, in `record.ranks` order: how the engine stands.
    pub status: Vec<RankStatus>,
    /// The block size the worker's partition uses once known: declared by a worker, or learned
    /// from the first stored KV block. `None` until then.
    pub block_size: Option<u32>,
}

/// How one rank's engine stands, for listing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RankStatus {
    /// Not reported unreachable ([`Core::set_rank_reachable`]).
    pub reachable: bool,
    /// The block size its KV events carry when it is not the partition's (their stores are
    /// dropped).
    pub mismatched_block_size: Option<u32>,
}

impl Default for RankStatus {
    fn default() -> Self {
        RankStatus {
            reachable: true,
            mismatched_block_size: None,
        }
    }
}
