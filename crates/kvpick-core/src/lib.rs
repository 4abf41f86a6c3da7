//! kvpick-core: the selection core of kvpick, with no I/O. It owns the KV index and block
//! hashing, the partitions (ranks, load, bookings, session affinity), the staged decision and the
//! catalog as data. Time is an argument (`now: Instant`), and what an operation changed comes back
//! as [`facts::Facts`] for the host to record: this crate depends on no async runtime, network,
//! Kubernetes or metrics crate, so every decision is unit-testable and replayable.
//!
//! # Layout (bottom to top; a module imports only from those above it in this list)
//! - [`types`]: `RankKey`, `Lifecycle`, tiers, `PartitionKey`, `RankLoad` — the shared vocabulary.
//! - [`hash`]: block hashes (`xxh3`, chained per prefix).
//! - [`event`]: KV block events as values (the wire decoder in the `kvpick` crate makes them).
//! - [`index`]: which ranks hold which blocks, per tier; longest-prefix matches.
//! - [`estimate`]: the TTFT estimator the cost is calibrated by (learnt from observations).
//! - [`error`], [`request`]: typed errors; the request and its validation.
//! - [`catalog`]: worker specs and records, the union of sources, the reconcile diff.
//! - [`engine`]: one scrape of a rank's engine metrics, as a value (the host scrapes).
//! - [`decide`]: the pure cost function and choice.
//! - [`disagg`]: the pure prefill/decode pair decision (decode rank, whether to split, prefill
//!   rank), for partitions whose ranks declare roles.
//! - [`session`]: the session-affinity table.
//! - [`outlier`]: per-rank outlier detection as values.
//! - [`flow`]: flow control's queue discipline (bands, fair queuing, EDF) and saturation rule.
//! - [`outcome`]: what the core answers — a pick ([`Selection`]) and a worker listing
//!   ([`WorkerView`]) — as plain values.
//! - [`facts`], [`config`], [`live`]: what an operation changed; settings and the part of them a
//!   running core may swap.
//! - `spin`: the partition's locks, which spin briefly before they park.
//! - `partition`: one `(model, routing_group)` behind one lock; its `pipeline` runs the selection
//!   stages (eligibility, pin, adapter, busy, candidates, decide, affinity, fallbacks), then books.
//! - [`core`]: [`Core`], the catalog, partitions and booking registry every host drives.
//!
//! The crate root only declares modules and re-exports: nothing below imports from it.

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
pub mod outcome;
pub mod outlier;
mod partition;
pub mod request;
pub mod session;
mod spin;
pub mod types;

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
pub use crate::outcome::{
    EndpointScore, PickedRank, RankStatus, Selection, TransferHint, WorkerView,
};
pub use crate::partition::shared_tier::SharedCacheConfig;
pub use crate::partition::EventStats;
pub use crate::request::{
    clip, Claim, DuplicateId, EndpointFilter, Holder, Pin, PromptInput, RemoteOverlap,
    SelectionRequest,
};
pub use crate::session::{AffinityMode, Installed, SessionConfig, SessionOutcome};
pub use crate::types::{Lifecycle, PartitionKey, RankKey, RankLoad, Role};
