//! What the core answers, as values every layer above it shares: a pick ([`Selection`], its
//! [`PickedRank`]s and [`EndpointScore`]s) and a worker listing ([`WorkerView`], [`RankStatus`]).
//! The partition builds them under its lock and `Core` hands them to hosts; [`crate::facts`]
//! carries a pick's outcome. Plain data only: no decision, no lock, nothing that imports the
//! partition or `Core`.

use std::net::SocketAddr;

use crate::catalog::WorkerRecord;
use crate::decide;
use crate::session::SessionOutcome;
use crate::types::{PartitionKey, RankKey, RankLoad};

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
    /// With [`crate::request::SelectionRequest::scores`] > 0: the scored endpoints, one per address, at most that
    /// many — the destinations (primary, then fallbacks) first, then the other candidates best
    /// first. Empty otherwise.
    pub scores: Vec<EndpointScore>,
    /// Blocks beyond `overlap_blocks` the primary can load from the model's shared KV store
    /// (the shared tier, `--shared-cache-multiplier`); 0 without one.
    pub shared_blocks: u32,
    /// With `--kv-transfer-hints`, on a booked pick that holds less of the prompt than another
    /// rank: the holder the primary may pull the prefix from. Never on a query-only selection.
    pub transfer: Option<TransferHint>,
}

/// A holder of the prompt's longest cached prefix that the pick is not ([`Selection::transfer`]):
/// the least loaded of the ranks holding the longest prefix, so pulls spread over holders.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransferHint {
    pub source: PickedRank,
    /// Prompt blocks the source holds (GPU or host tier).
    pub blocks: u32,
    /// Of them, blocks the primary does not hold itself (what the pull saves).
    pub gain: u32,
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
    /// Not reported unreachable ([`crate::Core::set_rank_reachable`]).
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
