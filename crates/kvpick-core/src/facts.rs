//! What a core operation changed that an operator may want to see, returned as values. The core
//! records nothing itself (it has no metrics library); the host applies [`Facts`] to its metrics
//! after the core's locks are released.

use std::sync::Arc;

use crate::session::{Invalidation, SessionOutcome};
use crate::types::{Lifecycle, PartitionKey, RankLoad};

/// How a picked rank answered a request, as outlier detection and the estimators see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResponseClass {
    /// 1xx/2xx/3xx: the engine served it.
    Success,
    /// 4xx: the client's fault; no engine failure, but no TTFT sample either.
    ClientError,
    /// 5xx, including Envoy's own 503 (connect failure) and 504 (upstream timeout).
    ServerError,
    /// The stream ended before any response (the client or Envoy reset it).
    Reset,
}

impl ResponseClass {
    pub fn of_status(status: u16) -> ResponseClass {
        match status {
            400..=499 => ResponseClass::ClientError,
            500..=599 => ResponseClass::ServerError,
            _ => ResponseClass::Success,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            ResponseClass::Success => "2xx",
            ResponseClass::ClientError => "4xx",
            ResponseClass::ServerError => "5xx",
            ResponseClass::Reset => "reset",
        }
    }
}

/// One observable change.
#[derive(Debug, Clone, PartialEq)]
pub enum Fact {
    /// A rank's load is now `load`.
    Load {
        worker: Arc<str>,
        dp_rank: u32,
        load: RankLoad,
    },
    /// A rank left its partition: its per-rank series go.
    RankGone { worker: Arc<str>, dp_rank: u32 },
    /// Live bookings over all ranks changed by this much.
    Inflight(i64),
    /// A picked rank answered (the response's status class; `reset` = no response).
    UpstreamResponse {
        worker: Arc<str>,
        dp_rank: u32,
        class: ResponseClass,
    },
    /// Outlier detection changed a rank's standing.
    Outlier {
        worker: Arc<str>,
        dp_rank: u32,
        event: crate::outlier::HealthEvent,
    },
    /// Ranks out of picks (ejected or probing) changed by this much.
    EjectedRanks(i64),
    /// What session affinity did for one request.
    Session(SessionOutcome),
    /// A child session's first pick had a bound parent rank: what became of it.
    SessionParent(crate::session::ParentPick),
    /// A binding was dropped.
    SessionInvalidated(Invalidation),
    /// This many idle bindings expired.
    SessionsExpired(u64),
    /// Live bindings changed by this much.
    SessionsLive(i64),
    /// This many bookings' prefill stopped counting: no first byte within their expected
    /// prefill time ([`crate::BookingBounds`]); each keeps its request slot.
    BookingsDecayed(u64),
    /// This many bookings' load was taken off their rank: its engine did not show them for
    /// [`crate::BookingBounds::reconcile_after`]; each stays booked until its stream frees it.
    BookingsReconciled(u64),
    /// A partition's index now holds `blocks` blocks (and, when measured, `bytes` heap bytes).
    IndexSize {
        partition: Arc<PartitionKey>,
        blocks: usize,
        bytes: Option<usize>,
    },
    /// How long a partition's precise predictions outlive their request now (the end grace,
    /// adapted to its KV events' lag): after each live batch, and at each scrape.
    PredictionGrace {
        partition: Arc<PartitionKey>,
        seconds: f64,
    },
    /// A partition's shared tier now holds `blocks` blocks (`--shared-cache-multiplier`).
    SharedTierSize {
        partition: Arc<PartitionKey>,
        blocks: usize,
    },
    /// A booked pick some candidate of which could load prompt blocks from the shared tier:
    /// whether the shared tier changed the pick (the same decision without it picks another
    /// rank).
    SharedTierPick { changed: bool },
    /// A booked pick carried a KV transfer hint ([`crate::outcome::TransferHint`]).
    TransferHint,
    /// Share of a pick's prompt blocks already cached on the picked rank.
    PredictedOverlap(f64),
    /// KV events applied and dropped (of which `block_size_mismatches` for a block size other
    /// than the partition's).
    KvEvents {
        applied: u64,
        dropped: u64,
        block_size_mismatches: u64,
    },
    /// Whether a rank's index entries come from its engine's KV events (precise) or only from
    /// kvpick's own picks (approximate).
    RankPrecise {
        worker: Arc<str>,
        dp_rank: u32,
        precise: bool,
    },
    /// A rank's engine became reachable or unreachable ([`crate::Core::set_rank_reachable`]); a
    /// new rank starts reachable (no fact).
    RankReachable {
        worker: Arc<str>,
        dp_rank: u32,
        reachable: bool,
    },
    /// A rank's KV events carry a block size other than its partition's (`engine: Some(size)`:
    /// their stores are dropped), or match it again (`engine: None`). Once per change, not per
    /// event.
    BlockSizeMismatch {
        worker: Arc<str>,
        dp_rank: u32,
        partition: u32,
        engine: Option<u32>,
    },
    /// Workers in the catalog per lifecycle, in [`Lifecycle::ALL`] order.
    CatalogWorkers([usize; 4]),
    /// Bookings reaped because they outlived the booking TTL.
    BookingsExpired(u64),
    /// A booking's first token arrived: the TTFT its pick predicted and the one observed.
    TtftObserved {
        predicted_seconds: f64,
        observed_seconds: f64,
    },
    /// A request with a TTFT SLO got its first token, within the SLO or not.
    SloTtft { priority: i32, met: bool },
    /// A request with a TPOT SLO finished, its time per output token within the SLO or not.
    SloTpot { priority: i32, met: bool },
    /// Flow control: what happened to a request in a partition's queue. `fairness_key` is the
    /// client's value: a host must bound it before using it as a label.
    Queue {
        priority: i32,
        fairness_key: Arc<str>,
        event: QueueEvent,
    },
    /// A waiting request left the queue: booked (`Ok`, the booking is live and belongs to the
    /// ticket's holder, who must free it) or refused. The host hands it to the waiter.
    Dequeued {
        ticket: u64,
        result: Result<Box<crate::outcome::Selection>, crate::error::SelectError>,
    },
}

/// A queue event ([`Fact::Queue`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum QueueEvent {
    Enqueued,
    /// Released with a booking after waiting this long.
    Dispatched {
        waited_seconds: f64,
    },
    /// Left without a booking.
    Left {
        exit: QueueExit,
        waited_seconds: f64,
    },
}

/// Why a request left the queue without a booking (or never joined it: `Full`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QueueExit {
    /// The queue timeout passed.
    Timeout,
    /// Its TTFT SLO can no longer be met.
    SloMissed,
    /// Its band was full on arrival.
    Full,
    /// The client went away.
    Cancelled,
    /// The pick failed for another reason when it was tried (its pin went, ...).
    Refused,
}

impl QueueExit {
    pub fn label(&self) -> &'static str {
        match self {
            QueueExit::Timeout => "timeout",
            QueueExit::SloMissed => "slo",
            QueueExit::Full => "full",
            QueueExit::Cancelled => "cancelled",
            QueueExit::Refused => "refused",
        }
    }
}

/// The facts of one operation, in the order they happened.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Facts(pub Vec<Fact>);

impl Facts {
    pub fn push(&mut self, fact: Fact) {
        self.0.push(fact);
    }

    pub fn extend(&mut self, other: Facts) {
        self.0.extend(other.0);
    }

    pub fn iter(&self) -> impl Iterator<Item = &Fact> {
        self.0.iter()
    }

    /// Counts per lifecycle, for [`Fact::CatalogWorkers`].
    pub fn lifecycle_counts(lifecycles: impl Iterator<Item = Lifecycle>) -> [usize; 4] {
        let mut counts = [0usize; 4];
        for l in lifecycles {
            if let Some(i) = Lifecycle::ALL.iter().position(|x| *x == l) {
                counts[i] = counts[i].saturating_add(1);
            }
        }
        counts
    }
}
