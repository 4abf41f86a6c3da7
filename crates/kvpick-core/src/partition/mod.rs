//! One partition, `(model, routing_group)`: its ranks as scheduled, their load (derived only from
//! bookings), its KV index, session table and bookings, all behind one lock so a decision and its
//! booking are atomic. The decision itself is the staged [`pipeline`]; this module runs it under
//! the lock and books the result. Every operation returns what it changed as [`Facts`].
//!
//! Layout: [`ranks`] (the rank table), [`membership`] (rank changes from the catalog),
//! [`select`] (one decision: the stages in order), [`pipeline`] (the selection stages' rules),
//! [`stage`] (the values the stages hand each other),
//! [`pair`] (the prefill/decode pair stage and the prefill leg of a booking), [`admission`] (flow
//! control: SLO gate, queue, release passes), [`booking`] (a pick's booking and its life),
//! [`health`] (engine answers and outlier ejection), [`events`] (KV events applied to the
//! index), [`grace`] (how long predictions outlive their request, from the events' lag),
//! [`replicas`] (what other replicas and engines report).

// Request fields and KV events come from the network: arithmetic on them says what happens at
// the edge (checked, saturating) instead of wrapping in release builds and panicking in debug.
#![warn(clippy::arithmetic_side_effects)]

mod admission;
mod booking;
mod decay;
mod deferred;
mod events;
mod grace;
mod health;
mod load_order;
mod membership;
mod pair;
mod pipeline;
mod ranks;
mod replicas;
mod select;
pub(crate) mod shared_tier;
pub(crate) mod sparse;
mod stage;
mod transfer;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::SeedableRng;

pub(crate) use admission::{Admitted, Claims};
use events::EngineMap;
pub use events::EventStats;
#[cfg(test)]
pub(crate) use grace::END_GRACE;
use pipeline::Allowed;
use ranks::{RankTable, Slot};
#[cfg(test)]
pub(crate) use sparse::PathAnswer;
pub(crate) use stage::Refusal;
use stage::{Affinity, Ask, Pick, PromptBlocks};

use crate::catalog::WorkerRecord;
use crate::config::{CoreConfig, DEFAULT_BLOCK_SIZE};
use crate::error::SelectError;
use crate::estimate::TtftEstimator;
use crate::facts::{Fact, Facts};
use crate::hash;
use crate::index::{PrefixIndex, Tier, TierDepths};
use crate::outcome::{PickedRank, Selection};
use crate::request::{Holder, SelectionRequest};
use crate::session::{Bound, Invalidation, SessionOutcome, SessionTable};
use crate::spin::{SpinMutex, SpinRwLock};
use crate::types::{Lifecycle, PartitionKey, RankKey, RankLoad};

#[derive(Debug)]
struct Booking {
    /// Unique per booking: a request id reused later (a retry, a reaped stream) is a new
    /// generation, so freeing one never frees the other.
    generation: u64,
    holder: Holder,
    rank: RankKey,
    prefill_tokens: u64,
    decode_blocks: u64,
    prefill_complete: bool,
    created: Instant,
    /// Prefill tokens the request waited for at its pick (queue + own uncached), the estimator's
    /// input, and the TTFT it predicted (seconds): checked against the first token.
    ttft_tokens: f64,
    predicted_ttft: f64,
    /// The session whose lease this booking holds.
    session: Option<String>,
    /// The request's priority and TTFT SLO (seconds), for SLO attainment at its first token.
    priority: i32,
    slo_ttft: Option<f64>,
    /// TPOT SLO (seconds), and the first token's time and the rank's batch then (for TPOT).
    slo_tpot: Option<f64>,
    first_token: Option<(Instant, u64)>,
    /// Prefill/decode disaggregation: the prefill rank's part of the booking, until the first
    /// token arrives ([`pair::PrefillLeg`]); `rank` is then the decode rank.
    prefill: Option<pair::PrefillLeg>,
    /// The prefill rank left before the first token: the first token still settles the SLO and
    /// starts the TPOT clock, but is no TTFT observation (no known rank prefilled it).
    prefill_rank_gone: bool,
    /// The rank answered other than 2xx: its first byte is no TTFT sample, SLO or TPOT start.
    failed: bool,
    /// The rank's answer (or the stream's reset) was recorded.
    answered: bool,
    /// This booking is the half-open probe of an ejected rank ([`crate::outlier`]).
    probe: bool,
    /// What the pick predicted on each rank it booked (the decode rank, then the prefill
    /// leg's): taken back from the index if the request fails, ended (the unconfirmed entries of
    /// a precise rank go) when the request or its prefill leg ends ([`health`]).
    predicted: health::Predicted,
    /// Its load was taken off its rank: the rank's engine did not show it ([`decay`]); its
    /// release then takes nothing off the rank.
    reconciled: bool,
}

struct State {
    /// Block size once a worker declared one; until then [`DEFAULT_BLOCK_SIZE`].
    declared_block_size: Option<u32>,
    ranks: RankTable,
    /// The index side, shared with [`Partition::kv`]: taken after this state's lock, never
    /// before it, and only through [`State::kv_read`] / [`State::kv_write`] (which write the
    /// deferred predictions first).
    kv_lock: Arc<SpinRwLock<Kv>>,
    /// Predictions booked under this lock, not yet written ([`deferred`]).
    deferred: std::cell::RefCell<Vec<deferred::Prediction>>,
    /// Some were written under this lock (before a KV access): the release reports the size.
    index_grew: std::cell::Cell<bool>,
    /// The latest clear's number ([`Kv::clear_log`]) and [`Kv::rank_epoch`], readable without
    /// the KV lock.
    clears: Arc<AtomicU64>,
    rank_epoch: Arc<AtomicU64>,
    /// The end grace [`Kv::grace`] publishes, readable without the KV lock.
    grace: Arc<AtomicU64>,
    bookings: HashMap<String, Booking>,
    /// When booked prefills stop counting ([`decay`]).
    prefill_deadlines: decay::PrefillDeadlines,
    sessions: SessionTable,
    estimator: TtftEstimator,
    /// Decode speed against batch size (TPOT SLOs).
    tpot: crate::estimate::TpotEstimator,
    rng: StdRng,
    /// Requests waiting for capacity (flow control), released by [`Partition::pump`].
    queue: crate::flow::FlowQueue<Arc<admission::Queued>>,
    /// Whether every rank of the table is interned in the index, as of (index rank epoch,
    /// table epoch): only then may a decision take the index's shared prefix as every rank's.
    interned: std::cell::Cell<(u64, u64, bool)>,
}

impl State {
    /// Every rank in the table is interned in the index (checked again only after a rank was
    /// interned, cleared, added or removed).
    fn all_interned(&self) -> bool {
        let (index_epoch, table_epoch, all) = self.interned.get();
        if (index_epoch, table_epoch) == (self.index_epoch(), self.ranks.epoch()) {
            return all;
        }
        let kv = self.kv_read();
        let all = self.ranks.keys().all(|k| kv.index.holds_rank(k));
        self.interned
            .set((kv.index.rank_epoch(), self.ranks.epoch(), all));
        all
    }
}

/// A partition's KV side: the index and the engines' hash maps, with what KV events need to
/// apply without the partition's state lock (ARCHITECTURE.md §7): which ranks are members,
/// which already count as precise, and whether the block size is settled. Picks read it
/// (matches) outside the state lock; bookings write their predicted entries under it.
pub(crate) struct Kv {
    index: PrefixIndex,
    /// Per rank: engine block hash -> our hash (KV events).
    engines: HashMap<RankKey, EngineMap>,
    /// The rank table's keys (kept by [`membership`]).
    members: std::collections::HashSet<RankKey>,
    /// Ranks whose `Slot::events_seen` is set.
    precise: std::collections::HashSet<RankKey>,
    /// `State::declared_block_size` is set: events can no longer change the block size.
    block_size_known: bool,
    /// Ranks whose latest sized stores carried another block size than the partition's, and that
    /// size ([`events`]). Outlives clears and resets (it describes the engine, not the index);
    /// a rank leaving takes its entry along.
    size_mismatch: HashMap<RankKey, u32>,
    /// Resets and rank clears, numbered (under the KV write lock), the recent ones remembered: a
    /// deferred prediction of a rank cleared since it was made is not written ([`deferred`]).
    clear_log: deferred::ClearLog,
    /// The index's rank epoch, published ([`PrefixIndex::publish_rank_epoch`]).
    rank_epoch: Arc<AtomicU64>,
    /// The partition's KV-event lag and the end grace it implies ([`grace`]).
    grace: grace::EventGrace,
    /// The model's shared KV store, when one is configured ([`shared_tier`]).
    shared: Option<shared_tier::SharedTier>,
}

impl Kv {
    /// Starts the index afresh (a new block size).
    fn reset(&mut self, now: Instant) {
        self.clear_log.record(None);
        self.index = PrefixIndex::new(self.index.capacity(), now);
        self.index.publish_rank_epoch(Arc::clone(&self.rank_epoch));
        self.engines.clear();
        if let Some(shared) = &mut self.shared {
            shared.clear();
        }
    }

    /// Forgets a rank's blocks and engine map.
    fn clear_rank(&mut self, rank: RankKey) {
        self.clear_ranks(&[rank]);
    }

    /// Forgets the blocks and engine maps of several ranks in one pass over the index.
    fn clear_ranks(&mut self, ranks: &[RankKey]) {
        if ranks.is_empty() {
            return;
        }
        self.clear_log.record(Some(ranks));
        self.index.clear_ranks(ranks);
        for rank in ranks {
            self.engines.remove(rank);
            if let Some(shared) = &mut self.shared {
                shared.forget_rank(*rank);
            }
        }
    }
}

impl State {
    /// How long a precise rank's unconfirmed predictions outlive their request ([`grace`]).
    fn end_grace(&self) -> Duration {
        grace::grace_of(&self.grace)
    }

    /// The live booking of this id and generation (a stale reference finds nothing).
    fn booking(&self, (id, generation): &BookingRef) -> Option<&Booking> {
        self.bookings
            .get(id)
            .filter(|b| b.generation == *generation)
    }

    fn booking_mut(&mut self, (id, generation): &BookingRef) -> Option<&mut Booking> {
        self.bookings
            .get_mut(id)
            .filter(|b| b.generation == *generation)
    }
}

/// The facts of a new session binding: an eviction made room (the live count stays), or one
/// more binding is live.
fn binding_facts(created: bool, evicted: bool, facts: &mut Facts) {
    if evicted {
        facts.push(Fact::SessionInvalidated(Invalidation::Evicted));
    } else if created {
        facts.push(Fact::SessionsLive(1));
    }
}

/// A booking's identity: its id and generation.
pub(crate) type BookingRef = (String, u64);

pub(crate) struct BatchResult {
    pub failed: Vec<(u64, String)>,
    pub dropped_bookings: Vec<BookingRef>,
}

pub(crate) struct SelectOutcome {
    pub selection: Selection,
    /// Candidate costs, `worker:rank=cost` in rank order, for decision traces.
    pub trace: String,
}

pub(crate) struct Partition {
    pub(crate) key: Arc<PartitionKey>,
    schedulable: AtomicUsize,
    block_size: AtomicU32,
    state: SpinMutex<State>,
    /// The KV side ([`Kv`]); the same lock `State::kv_lock` holds.
    kv: Arc<SpinRwLock<Kv>>,
    /// Requests in `state.queue` (read without the lock: an empty queue costs nothing).
    queued: AtomicUsize,
    /// The model has a shared KV store ([`Kv::shared`]): a pick reads it only then.
    has_shared_tier: bool,
}

/// `-n` as a gauge delta, saturating.
fn negative(n: u64) -> i64 {
    i64::try_from(n).map_or(i64::MIN, |n| 0i64.saturating_sub(n))
}

/// Heap bytes of a hash map of `(u64, u64)` entries with this capacity (7/8 load, 1 control byte).
#[allow(clippy::arithmetic_side_effects)] // capacities are small and never from the network
fn engine_map_bytes(capacity: usize) -> usize {
    capacity * 8 / 7 * (std::mem::size_of::<(u64, u64)>() + 1)
}

fn load_fact(slot: &Slot, key: RankKey) -> Fact {
    Fact::Load {
        worker: Arc::clone(&slot.worker_name),
        dp_rank: key.dp_rank,
        load: slot.load,
    }
}

impl Partition {
    pub fn new(key: PartitionKey, config: &CoreConfig, now: Instant) -> Self {
        let rng = match config.seed {
            Some(seed) => {
                let salt =
                    hash::text_id(format!("{}\0{}", key.model, key.routing_group).as_bytes());
                StdRng::seed_from_u64(seed ^ salt)
            }
            None => StdRng::from_os_rng(),
        };
        let clears = Arc::new(AtomicU64::new(0));
        let rank_epoch = Arc::new(AtomicU64::new(0));
        let mut index = PrefixIndex::new(config.index_max_blocks, now);
        index.publish_rank_epoch(Arc::clone(&rank_epoch));
        let event_grace = grace::EventGrace::new();
        let grace = event_grace.shared();
        let shared_weight = config.shared_cache.weight_for(&key.model);
        let kv = Arc::new(SpinRwLock::new(Kv {
            index,
            engines: HashMap::new(),
            members: Default::default(),
            precise: Default::default(),
            block_size_known: false,
            size_mismatch: HashMap::new(),
            clear_log: deferred::ClearLog::new(Arc::clone(&clears)),
            rank_epoch: Arc::clone(&rank_epoch),
            grace: event_grace,
            shared: shared_weight.map(|w| shared_tier::SharedTier::new(w, config.index_max_blocks)),
        }));
        Partition {
            key: Arc::new(key),
            kv: Arc::clone(&kv),
            schedulable: AtomicUsize::new(0),
            block_size: AtomicU32::new(DEFAULT_BLOCK_SIZE),
            state: SpinMutex::new(State {
                declared_block_size: None,
                ranks: RankTable::default(),
                kv_lock: kv,
                deferred: Default::default(),
                index_grew: Default::default(),
                clears,
                rank_epoch,
                grace,
                bookings: HashMap::new(),
                prefill_deadlines: Default::default(),
                sessions: SessionTable::default(),
                estimator: TtftEstimator::new(config.estimator),
                tpot: crate::estimate::TpotEstimator::new(config.estimator),
                rng,
                queue: crate::flow::FlowQueue::default(),
                interned: std::cell::Cell::new((u64::MAX, u64::MAX, false)),
            }),
            queued: AtomicUsize::new(0),
            has_shared_tier: shared_weight.is_some(),
        }
    }

    pub fn schedulable_ranks(&self) -> usize {
        self.schedulable.load(Ordering::Relaxed)
    }

    pub fn routing_group_is(&self, group: &str) -> bool {
        self.key.routing_group == group
    }

    pub fn serves_adapter(&self, model: &str) -> bool {
        let state = self.lock_state();
        let serves = state
            .ranks
            .values()
            .any(|s| s.schedulable && s.lora_adapters.iter().any(|a| a == model));
        serves
    }

    pub fn block_size(&self) -> u32 {
        self.block_size.load(Ordering::Relaxed)
    }

    fn index_fact(&self, state: &State, bytes: Option<usize>) -> Fact {
        self.index_size_of(&state.kv_read(), bytes)
    }

    /// The index size of a locked KV side (and its heap bytes when measured), as a fact.
    fn index_size_of(&self, kv: &Kv, bytes: Option<usize>) -> Fact {
        Fact::IndexSize {
            partition: Arc::clone(&self.key),
            blocks: kv.index.len(),
            bytes,
        }
    }

    /// The index size, as a fact (after KV events).
    pub fn index_size(&self) -> Fact {
        let state = self.lock_state();
        self.index_fact(&state, None)
    }

    /// The index size as the KV side holds it now, without the state lock (what a metrics
    /// scrape reports; predictions a pick has not yet written are not in it).
    pub fn index_size_now(&self) -> Fact {
        self.index_size_of(&self.kv.read(), None)
    }

    /// The end grace as of the partition's last live KV-event batch, as a fact.
    pub fn grace_now(&self) -> Fact {
        let grace = self.kv.read().grace.grace();
        self.grace_fact(grace)
    }
}
