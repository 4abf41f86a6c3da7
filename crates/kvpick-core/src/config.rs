//! Settings of the core that are not per request: TTLs, weights, thresholds, bounds.

use std::time::Duration;

use crate::decide::CostParams;
use crate::disagg::PdConfig;
use crate::estimate::EstimatorConfig;
use crate::flow::FlowConfig;
use crate::session::SessionConfig;

/// Default bound on a prediction's life ([`CoreConfig::predicted_ttl`]): as long as an unfreed
/// API booking lives (`booking_ttl`), so no prediction outlives the booking that made it.
pub const DEFAULT_PREDICTED_TTL: Duration = Duration::from_secs(300);

/// Block size used by a partition whose workers do not declare one.
pub const DEFAULT_BLOCK_SIZE: u32 = 16;

/// Busy thresholds; a rank at or over either is not eligible.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BusyThresholds {
    pub active_decode_blocks: Option<u64>,
    pub active_prefill_tokens: Option<u64>,
    /// Sheddable requests (priority < 0) see the thresholds scaled by this (0..1], so they are
    /// refused with 429 before critical requests are.
    pub sheddable_fraction: f64,
}

impl Default for BusyThresholds {
    fn default() -> Self {
        BusyThresholds {
            active_decode_blocks: None,
            active_prefill_tokens: None,
            sheddable_fraction: 0.8,
        }
    }
}

/// How long a booking's load is believed without evidence that the engine is working on it
/// (ARCHITECTURE.md §3, "Bookings the engine is not working on"). A stream that routes a request
/// and never sends its response phase would otherwise hold its rank's capacity for as long as
/// it stays open.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BookingBounds {
    /// A booking's prefill stops counting toward its rank's load once this many times its
    /// predicted TTFT has passed since its pick without a first byte (at least 1).
    pub prefill_margin: f64,
    /// ... and never sooner than this after its pick, however short the prediction.
    pub prefill_floor: Duration,
    /// A rank whose fresh engine readings show fewer requests (running + waiting) than it has
    /// booked for this long has its booked load brought down to what the engine shows, oldest
    /// bookings first (only bookings at least this old); `None`: never.
    pub reconcile_after: Option<Duration>,
}

impl Default for BookingBounds {
    fn default() -> Self {
        BookingBounds {
            prefill_margin: 3.0,
            prefill_floor: Duration::from_secs(2),
            reconcile_after: Some(Duration::from_secs(15)),
        }
    }
}

/// The longest a prefill's expected time may be: a prediction beyond it (a line learnt from
/// nonsense) is cut here rather than overflowing an `Instant`.
const MAX_EXPECTED_PREFILL: Duration = Duration::from_secs(3600);

impl BookingBounds {
    /// How long after its pick a booking's prefill may run before it stops counting:
    /// `max(predicted × margin, floor)`, at most an hour.
    pub fn expected_prefill(&self, predicted_ttft_seconds: f64) -> Duration {
        let scaled = predicted_ttft_seconds * self.prefill_margin;
        let scaled = if scaled.is_finite() && scaled > 0.0 {
            Duration::try_from_secs_f64(scaled).unwrap_or(MAX_EXPECTED_PREFILL)
        } else {
            Duration::ZERO
        };
        scaled.max(self.prefill_floor).min(MAX_EXPECTED_PREFILL)
    }
}

/// Core settings that are not per request.
#[derive(Debug, Clone)]
pub struct CoreConfig {
    pub booking_ttl: Duration,
    /// Seed for sampling (temperature > 0); `None` seeds from the OS. Ties need none: they go
    /// to the rank picked least recently.
    pub seed: Option<u64>,
    pub cost: CostParams,
    pub busy: BusyThresholds,
    /// Whether explicit worker pins (`x-dynamo-worker-instance-id`) are honoured.
    pub allow_pins: bool,
    /// TTL of blocks inserted from our own routing decisions when a worker has no KV events.
    pub approx_ttl: Duration,
    /// Bound on a predicted block's life on a rank whose KV events flow. A pick's predicted
    /// entries live until the engine's events confirm them (permanent) or the request ends
    /// (the unconfirmed ones are dropped); this only bounds a booking whose end never comes.
    pub predicted_ttl: Duration,
    /// Whether KV events are consumed (off: every worker is in approximate mode).
    pub kv_events: bool,
    /// Bound on blocks per partition index.
    pub index_max_blocks: usize,
    /// Keep a trace of the last N decisions (differential tests, debugging); 0 = off.
    pub trace_decisions: usize,
    pub sessions: SessionConfig,
    /// Most live bookings the gRPC API may hold at once (each lives until `Free` or expiry).
    pub max_api_bookings: usize,
    /// Most live API bookings on one rank.
    pub max_api_bookings_per_rank: u32,
    /// Most leading blocks of one prompt hashed, matched and inserted (a prefix match needs only
    /// the prefix; a 32 MiB prompt must not flush the index or hold the lock).
    pub max_prompt_blocks: usize,
    /// The TTFT estimator behind the cost ([`crate::estimate`]).
    pub estimator: EstimatorConfig,
    /// An engine-metrics reading older than this is stale: ignored by the decision (the rank is
    /// costed on bookings alone), as if it had never been scraped.
    pub engine_metrics_max_age: Duration,
    /// Flow control: the EPP-side queue and saturation limits ([`crate::flow`]).
    pub flow: FlowConfig,
    /// The prefill/decode pair decision ([`crate::disagg`]); only partitions with role-split
    /// ranks use it.
    pub pd: PdConfig,
    /// Per-rank outlier detection ([`crate::outlier`]).
    pub outlier: crate::outlier::OutlierConfig,
    /// How long a booking's load is believed without evidence from the engine.
    pub bookings: BookingBounds,
    /// Shared KV stores per model: the shared tier ([`crate::SharedCacheConfig`]).
    pub shared_cache: crate::SharedCacheConfig,
    /// Name a holder of the prompt's prefix on a booked pick that is not one
    /// ([`crate::outcome::TransferHint`]); never on a query-only selection.
    pub kv_transfer_hints: bool,
}

impl Default for CoreConfig {
    fn default() -> Self {
        CoreConfig {
            booking_ttl: Duration::from_secs(300),
            seed: None,
            cost: CostParams::default(),
            busy: BusyThresholds::default(),
            allow_pins: false,
            approx_ttl: Duration::from_secs(120),
            predicted_ttl: DEFAULT_PREDICTED_TTL,
            kv_events: false,
            index_max_blocks: 1 << 20,
            trace_decisions: 0,
            sessions: SessionConfig::default(),
            max_api_bookings: 10_000,
            max_api_bookings_per_rank: 64,
            max_prompt_blocks: 16_384,
            estimator: EstimatorConfig::default(),
            engine_metrics_max_age: Duration::from_secs(1),
            flow: FlowConfig::default(),
            pd: PdConfig::default(),
            outlier: crate::outlier::OutlierConfig::default(),
            bookings: BookingBounds::default(),
            shared_cache: crate::SharedCacheConfig::default(),
            kv_transfer_hints: false,
        }
    }
}
