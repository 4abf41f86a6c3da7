//! One partition, `(model, routing_group)`: its ranks as scheduled, their load (derived only from
//! bookings), its KV index, session table and bookings, all behind one lock so a decision and its
//! booking are atomic. The decision itself is the staged [`pipeline`]; this module runs it under
//! the lock and books the result. Every operation returns what it changed as [`Facts`].
//!
//! Layout: [`ranks`] (the rank table), [`pipeline`] (the selection stages), [`pair`] (the
//! prefill/decode pair stage and the prefill leg of a booking), [`events`] (KV events applied to
//! the index).

// Request fields and KV events come from the network: arithmetic on them says what happens at
// the edge (checked, saturating) instead of wrapping in release builds and panicking in debug.
#![warn(clippy::arithmetic_side_effects)]

mod admission;
mod events;
mod health;
mod pair;
mod pipeline;
mod ranks;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use rand::rngs::StdRng;
use rand::SeedableRng;

pub(crate) use admission::{Admitted, Claims, Refusal};
use events::EngineMap;
pub use events::EventStats;
use pipeline::{Affinity, Allowed, PromptBlocks};
use ranks::{RankTable, Slot};

use crate::catalog::WorkerRecord;
use crate::config::{CoreConfig, DEFAULT_BLOCK_SIZE};
use crate::error::SelectError;
use crate::estimate::TtftEstimator;
use crate::facts::{Fact, Facts};
use crate::hash;
use crate::index::{PrefixIndex, Tier, TierDepths};
use crate::request::{Holder, SelectionRequest};
use crate::session::{Bound, Invalidation, SessionOutcome, SessionTable};
use crate::types::{Lifecycle, PartitionKey, RankKey, RankLoad};
use crate::{PickedRank, Selection};

impl Booking {
    /// Prefill tokens this booking still adds to its rank's queue.
    fn queued_prefill(&self) -> u64 {
        if self.prefill_complete {
            0
        } else {
            self.prefill_tokens
        }
    }
}

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
    /// The first block the pick newly predicted on each rank it booked (the decode rank, then
    /// the prefill leg's), taken back from the index if the request fails ([`health`]).
    predicted: health::Predicted,
}

struct State {
    /// Block size once a worker declared one; until then [`DEFAULT_BLOCK_SIZE`].
    declared_block_size: Option<u32>,
    ranks: RankTable,
    index: PrefixIndex,
    bookings: HashMap<String, Booking>,
    sessions: SessionTable,
    /// Per rank: engine block hash -> our hash (KV events).
    engines: HashMap<RankKey, EngineMap>,
    estimator: TtftEstimator,
    /// Decode speed against batch size (TPOT SLOs).
    tpot: crate::estimate::TpotEstimator,
    rng: StdRng,
    /// Requests waiting for capacity (flow control), released by [`Partition::pump`].
    queue: crate::flow::FlowQueue<Arc<admission::Queued>>,
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
    state: Mutex<State>,
    /// Requests in `state.queue` (read without the lock: an empty queue costs nothing).
    queued: AtomicUsize,
}

/// Candidate costs, `worker:rank=cost` in rank order, for decision traces.
fn cost_trace(candidates: &[crate::decide::Candidate], costs: &[f64]) -> String {
    candidates
        .iter()
        .zip(costs)
        .map(|(c, cost)| format!("{}:{}={:.3}", c.key.worker_id, c.key.dp_rank, cost))
        .collect::<Vec<_>>()
        .join(",")
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
        Partition {
            key: Arc::new(key),
            schedulable: AtomicUsize::new(0),
            block_size: AtomicU32::new(DEFAULT_BLOCK_SIZE),
            state: Mutex::new(State {
                declared_block_size: None,
                ranks: RankTable::default(),
                index: PrefixIndex::new(config.index_max_blocks, now),
                bookings: HashMap::new(),
                sessions: SessionTable::default(),
                engines: HashMap::new(),
                estimator: TtftEstimator::new(config.estimator),
                tpot: crate::estimate::TpotEstimator::new(config.estimator),
                rng,
                queue: crate::flow::FlowQueue::default(),
            }),
            queued: AtomicUsize::new(0),
        }
    }

    pub fn schedulable_ranks(&self) -> usize {
        self.schedulable.load(Ordering::Relaxed)
    }

    pub fn routing_group_is(&self, group: &str) -> bool {
        self.key.routing_group == group
    }

    pub fn serves_adapter(&self, model: &str) -> bool {
        let state = self.state.lock();
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
        Fact::IndexSize {
            partition: Arc::clone(&self.key),
            blocks: state.index.len(),
            bytes,
        }
    }

    /// The index size, as a fact (after KV events).
    pub fn index_size(&self) -> Fact {
        let state = self.state.lock();
        self.index_fact(&state, None)
    }

    /// Applies one batch of catalog changes under one lock (one publish).
    pub fn apply_batch(
        &self,
        gone: &[WorkerRecord],
        upserts: &[WorkerRecord],
        now: Instant,
        facts: &mut Facts,
    ) -> BatchResult {
        let mut result = BatchResult {
            failed: Vec::new(),
            dropped_bookings: Vec::new(),
        };
        let mut state = self.state.lock();
        for record in gone {
            Self::drop_worker(
                &mut state,
                record.id,
                now,
                facts,
                &mut result.dropped_bookings,
            );
        }
        for record in upserts {
            if let Err(reason) = self.adopt_block_size(&mut state, record, now) {
                result.failed.push((record.id, reason));
                Self::drop_worker(
                    &mut state,
                    record.id,
                    now,
                    facts,
                    &mut result.dropped_bookings,
                );
                continue;
            }
            Self::upsert_ranks(&mut state, record, now, facts, &mut result.dropped_bookings);
        }
        state.ranks.finish();
        let n = state.ranks.values().filter(|s| s.schedulable).count();
        self.schedulable.store(n, Ordering::Relaxed);
        result
    }

    /// Takes a worker's declared block size, or refuses the worker when another one declared a
    /// different size. The first declaration (or the only worker changing it) starts the index
    /// afresh: hashes of another block size never match.
    fn adopt_block_size(
        &self,
        state: &mut State,
        record: &WorkerRecord,
        now: Instant,
    ) -> Result<(), String> {
        let Some(declared) = record.spec.block_size else {
            return Ok(());
        };
        let others_declare = state.ranks.keys().any(|k| k.worker_id != record.id);
        match state.declared_block_size {
            Some(current) if current != declared && others_declare => Err(format!(
                "block_size {declared} conflicts with block size {current} of partition {}",
                self.key.model
            )),
            Some(current) if current == declared => Ok(()),
            _ => {
                if state.declared_block_size.is_some() || declared != DEFAULT_BLOCK_SIZE {
                    // Engine hashes map to our hashes of the old size: both start afresh.
                    state.index = PrefixIndex::new(state.index.capacity(), now);
                    state.engines.clear();
                }
                state.declared_block_size = Some(declared);
                self.block_size.store(declared, Ordering::Relaxed);
                Ok(())
            }
        }
    }

    /// Makes the partition's ranks of `record` match it: ranks that moved or went are dropped
    /// (with their bookings), surviving ranks keep their load, new ones start idle.
    fn upsert_ranks(
        state: &mut State,
        record: &WorkerRecord,
        now: Instant,
        facts: &mut Facts,
        dropped: &mut Vec<BookingRef>,
    ) {
        let wanted: HashMap<u32, _> = record.ranks.iter().map(|r| (r.dp_rank, *r)).collect();
        let stale: Vec<RankKey> = state
            .ranks
            .iter()
            .filter(|(k, s)| {
                k.worker_id == record.id
                    && wanted
                        .get(&k.dp_rank)
                        .is_none_or(|r| s.endpoint != r.endpoint)
            })
            .map(|(k, _)| *k)
            .collect();
        for key in stale {
            Self::drop_rank(state, key, now, facts, dropped);
        }
        let lora: Arc<[String]> = record.spec.lora_adapters.clone().into();
        let name: Arc<str> = record.spec.name.as_str().into();
        for rank in &record.ranks {
            let key = RankKey {
                worker_id: record.id,
                dp_rank: rank.dp_rank,
            };
            let new_rank = state.ranks.get(&key).is_none();
            let slot = state.ranks.get_or_insert_with(key, || Slot {
                worker_name: Arc::clone(&name),
                endpoint: rank.endpoint,
                multiplexed: rank.multiplexed,
                lora_adapters: Arc::clone(&lora),
                role: rank.role,
                schedulable: false,
                kv_events: false,
                incarnation: record.spec.incarnation,
                events_seen: false,
                load: RankLoad::default(),
                remote_load: RankLoad::default(),
                engine: None,
                api_bookings: 0,
                health: Default::default(),
            });
            if slot.incarnation != record.spec.incarnation {
                // The engine restarted under the same worker: its KV cache is empty now.
                slot.incarnation = record.spec.incarnation;
                state.index.clear_rank(key);
                state.engines.remove(&key);
                slot.events_seen = false;
                slot.engine = None;
            }
            slot.worker_name = Arc::clone(&name);
            slot.multiplexed = rank.multiplexed;
            slot.lora_adapters = Arc::clone(&lora);
            slot.role = rank.role;
            slot.schedulable = record.lifecycle == Lifecycle::Schedulable;
            slot.kv_events = record.spec.kv_events.is_some();
            if new_rank {
                facts.push(Fact::RankPrecise {
                    worker: Arc::clone(&name),
                    dp_rank: key.dp_rank,
                    precise: false,
                });
            }
        }
    }

    /// Drops every rank of a worker (and their bookings).
    fn drop_worker(
        state: &mut State,
        worker_id: u64,
        now: Instant,
        facts: &mut Facts,
        dropped: &mut Vec<BookingRef>,
    ) {
        let keys: Vec<RankKey> = state
            .ranks
            .keys()
            .filter(|k| k.worker_id == worker_id)
            .copied()
            .collect();
        for key in keys {
            Self::drop_rank(state, key, now, facts, dropped);
        }
    }

    fn drop_rank(
        state: &mut State,
        key: RankKey,
        now: Instant,
        facts: &mut Facts,
        dropped: &mut Vec<BookingRef>,
    ) {
        let Some(slot) = state.ranks.remove(&key) else {
            return;
        };
        state.estimator.forget(&key);
        // The rank's engine is gone (deleted, moved, re-addressed): what it cached must not
        // attract requests if a worker of the same id comes back with a fresh engine.
        state.index.clear_rank(key);
        state.engines.remove(&key);
        let mut leases = Vec::new();
        let mut legs = Vec::new();
        state.bookings.retain(|id, b| {
            if b.prefill.as_ref().is_some_and(|leg| leg.rank == key) {
                // The prefill rank left: its load went with it; the decode side lives on, its
                // first token still settles the SLO and TPOT (but is no TTFT observation).
                b.prefill = None;
                b.prefill_rank_gone = true;
            }
            if b.rank == key {
                dropped.push((id.clone(), b.generation));
                leases.extend(b.session.take());
                legs.extend(b.prefill.take());
                false
            } else {
                true
            }
        });
        for sid in leases {
            state.sessions.release(&sid, now);
        }
        for leg in legs {
            pair::unbook_leg(state, Some(&leg), facts);
        }
        facts.push(Fact::Inflight(negative(slot.load.active_requests)));
        if slot.health.is_ejected() {
            facts.push(Fact::EjectedRanks(-1));
        }
        facts.push(Fact::RankGone {
            worker: slot.worker_name,
            dp_rank: key.dp_rank,
        });
    }

    /// The request's block seed (its LoRA adapter); the cache salt goes into the first block only.
    fn seed_for(&self, request: &SelectionRequest) -> u64 {
        let lora = request.model.as_deref().filter(|m| *m != self.key.model);
        hash::block_seed(lora, None)
    }

    /// The prompt's blocks as this partition hashes them (outside the lock).
    fn prompt_of(&self, request: &SelectionRequest, config: &CoreConfig) -> PromptBlocks {
        pipeline::prompt_blocks(
            &request.prompt,
            self.block_size(),
            self.seed_for(request),
            request.cache_salt.as_deref(),
            config.max_prompt_blocks,
        )
    }

    /// Runs the [`pipeline`] under the partition lock and, with `booking_id`, books the pick in
    /// the same critical section ([`Partition::book`]). Never queues: the API and dry runs.
    /// With `saturation_gate` (API bookings while flow control is on) saturated ranks take no
    /// booking and a request that finds every rank saturated is refused (RESOURCE_EXHAUSTED):
    /// API callers cannot push a rank past what stream requests would wait for.
    pub fn select(
        &self,
        request: &SelectionRequest,
        booking: Option<(&str, u64)>,
        saturation_gate: bool,
        config: &CoreConfig,
        now: Instant,
        facts: &mut Facts,
    ) -> Result<SelectOutcome, SelectError> {
        let prompt = self.prompt_of(request, config);
        let check = saturation_gate.then(|| admission::Check::new(request, now));
        let mut guard = self.state.lock();
        self.select_in(
            &mut guard,
            &prompt,
            request,
            booking,
            config,
            now,
            check.as_ref(),
            facts,
        )
        .map_err(Refusal::into_error)
    }

    /// The pipeline on locked state. With `admission` (flow control) saturated ranks are not
    /// candidates, a request that finds none is [`Refusal::Saturated`] (it may wait), and an SLO
    /// restricts the candidates to ranks predicted to meet it.
    #[allow(clippy::too_many_arguments)]
    fn select_in(
        &self,
        state: &mut State,
        prompt: &PromptBlocks,
        request: &SelectionRequest,
        booking: Option<(&str, u64)>,
        config: &CoreConfig,
        now: Instant,
        admission: Option<&admission::Check>,
        facts: &mut Facts,
    ) -> Result<SelectOutcome, Refusal> {
        let block_size = self.block_size();
        let allowed = Allowed {
            subset: request.subset.as_ref(),
            adapter: request.model.as_deref().filter(|m| *m != self.key.model),
        };
        let sessions = &config.sessions;
        let mut bound = request.session_id.as_deref().and_then(|sid| {
            Self::session_binding(
                state,
                sid,
                &allowed,
                booking.is_some(),
                sessions,
                now,
                facts,
            )
        });
        let slots = &state.ranks.slots;
        let eligible = match self.eligible_ranks(slots, request, &allowed, &mut bound, config, now)
        {
            Ok(e) => e,
            // Over a busy threshold is saturation: with flow control the request waits.
            Err(SelectError::Overloaded(_)) if admission.is_some() => {
                return Err(Refusal::Saturated)
            }
            Err(e) => return Err(Refusal::Error(e)),
        };
        let matches = if prompt.seq_hashes.is_empty() {
            Vec::new()
        } else {
            state.index.find_matches(&prompt.seq_hashes, now)
        };
        let engine_view = pipeline::EngineView {
            now,
            max_age: config.engine_metrics_max_age,
            adapter: allowed.adapter,
        };
        let candidates = pipeline::candidates(
            slots,
            &eligible,
            &matches,
            &state.estimator,
            block_size,
            &engine_view,
        );
        let (eligible, candidates) = match admission {
            Some(check) => check.meet_slo(
                eligible,
                candidates,
                &state.estimator,
                &state.tpot,
                prompt.tokens,
                block_size,
                &config.cost,
                now,
            )?,
            None => (eligible, candidates),
        };
        let (mut decision, roles) = if state.ranks.split_roles {
            let (decision, roles) = pair::decide_pair(
                slots,
                &eligible,
                &candidates,
                block_size,
                config,
                &mut bound,
                &mut state.rng,
            )?;
            (decision, Some(roles))
        } else {
            let decision = pipeline::rank(
                &candidates,
                prompt,
                block_size,
                request,
                config,
                &mut state.rng,
            );
            (decision, None)
        };
        let affinity = pipeline::apply_affinity(&mut decision, &candidates, bound, sessions);
        let saturation = admission.map(|_| pipeline::SaturationView {
            slots,
            eligible: &eligible,
            estimator: &state.estimator,
            limits: &config.flow.saturation,
            now,
            max_age: config.engine_metrics_max_age,
        });
        if let Some(view) = &saturation {
            pipeline::dispatch_or_wait(
                &mut decision,
                &candidates,
                view,
                affinity == Affinity::Kept && sessions.mode == crate::session::AffinityMode::Hard,
                prompt.tokens,
                block_size,
                &config.cost,
            )?;
        }
        let prefill = match roles.as_deref() {
            Some(roles) => pair::prefill_for(
                &candidates,
                roles,
                &decision,
                prompt,
                block_size,
                config,
                &mut state.rng,
                saturation.as_ref(),
            )?,
            None => None,
        };
        let (primary, fallbacks) =
            pipeline::picked_ranks(slots, &eligible, &decision.ranking, request.fallbacks)
                .ok_or_else(|| {
                    Refusal::Error(SelectError::Unavailable("no candidate left".into()))
                })?;
        let best = decision.ranking.first().copied().unwrap_or_default();
        let overlap = candidates.get(best).map(|c| c.overlap).unwrap_or_default();
        let cost = decision.costs.get(best).copied().unwrap_or_default();
        // The first token waits for the rank that prefills: the prefill rank when split.
        let prefilling = prefill.map_or(best, |p| p.position);
        let ttft_tokens = candidates.get(prefilling).map_or(0.0, |c| {
            crate::decide::ttft_blocks(c, prompt.tokens, block_size, &config.cost)
                * f64::from(block_size)
        });
        let prefill_pick = prefill.and_then(|p| {
            let candidate = candidates.get(p.position)?;
            let picked = pipeline::picked(slots, *eligible.get(p.position)?)?;
            Some((picked, candidate.overlap))
        });
        let predicted_ttft = state.estimator.predict(
            &prefill_pick.as_ref().map_or(primary.key, |(p, _)| p.key),
            ttft_tokens,
        );
        let trace = if config.trace_decisions > 0 {
            cost_trace(&candidates, &decision.costs)
        } else {
            String::new()
        };
        let session = match booking {
            Some((id, generation)) => {
                let pick = Pick {
                    booking_id: id,
                    generation,
                    rank: primary.key,
                    overlap,
                    prompt,
                    block_size,
                    ttft_tokens,
                    predicted_ttft,
                    prefill: prefill_pick.as_ref().map(|(p, overlap)| (p.key, *overlap)),
                };
                self.book(state, request, &pick, affinity, config, now, facts)
            }
            None => (affinity == Affinity::Kept).then_some(SessionOutcome::Reused),
        };
        let selection = Selection {
            booking_id: booking.map(|(id, _)| id).unwrap_or_default().to_string(),
            generation: booking.map_or(0, |(_, g)| g),
            partition: (*self.key).clone(),
            primary,
            fallbacks,
            prefill: prefill_pick.map(|(p, _)| p),
            overlap_blocks: overlap.gpu,
            prompt_blocks: prompt.seq_hashes.len() as u32,
            prompt_tokens: prompt.tokens,
            cost,
            session,
            candidates: candidates.len() as u32,
            predicted_ttft_seconds: predicted_ttft,
        };
        Ok(SelectOutcome { selection, trace })
    }

    /// The session's bound rank if it may serve this request. An invalid binding is dropped
    /// when the request will be booked (a dry-run `select` changes nothing).
    fn session_binding(
        state: &mut State,
        sid: &str,
        allowed: &Allowed,
        booking: bool,
        sessions: &crate::session::SessionConfig,
        now: Instant,
        facts: &mut Facts,
    ) -> Option<RankKey> {
        let lookup = state.sessions.bound_rank(sid, now, sessions.ttl);
        if lookup.expired {
            facts.push(Fact::SessionsLive(-1));
            facts.push(Fact::SessionsExpired(1));
        }
        let rank = lookup.rank?;
        match pipeline::check_binding(state.ranks.get(&rank), allowed) {
            Ok(()) => Some(rank),
            Err(reason) => {
                if booking {
                    Self::invalidate_session(state, sid, reason, facts);
                }
                None
            }
        }
    }

    /// The eligibility stages in order: allowed ranks, pin, adapter, busy thresholds.
    fn eligible_ranks(
        &self,
        slots: &[(RankKey, Slot)],
        request: &SelectionRequest,
        allowed: &Allowed,
        bound: &mut Option<RankKey>,
        config: &CoreConfig,
        now: Instant,
    ) -> Result<Vec<usize>, SelectError> {
        let mode = config.sessions.mode;
        let mut eligible = pipeline::allowed_ranks(slots, allowed, &self.key.model)?;
        let pin = request.pin.filter(|_| config.allow_pins);
        if let Some(pin) = pin {
            pipeline::apply_pin(slots, &mut eligible, pin, bound, mode)?;
        }
        pipeline::narrow_adapter(slots, &mut eligible, allowed)?;
        let may_probe = health::may_probe(request.holder);
        pipeline::drop_ejected(slots, &mut eligible, bound, now, may_probe);
        let hard_bound = bound.filter(|_| mode == crate::session::AffinityMode::Hard);
        pipeline::drop_busy(
            slots,
            &mut eligible,
            &config.busy,
            request.priority,
            hard_bound,
            pin.is_some(),
        )?;
        if request.holder == Holder::Api {
            pipeline::cap_api_bookings(slots, &mut eligible, config.max_api_bookings_per_rank)?;
        }
        Ok(eligible)
    }

    /// The last stage: binds or reuses the session, installs the booking and its load, and
    /// inserts the prompt's blocks as predicted (or approximate) entries for the picked rank.
    #[allow(clippy::too_many_arguments)]
    fn book(
        &self,
        state: &mut State,
        request: &SelectionRequest,
        pick: &Pick,
        affinity: Affinity,
        config: &CoreConfig,
        now: Instant,
        facts: &mut Facts,
    ) -> Option<SessionOutcome> {
        let (outcome, leased_session) = Self::bind_session(
            state,
            request,
            pick.prompt.present,
            pick.rank,
            affinity,
            config,
            now,
            facts,
        );
        let block_size = u64::from(pick.block_size.max(1));
        let tokens = pick.prompt.tokens;
        let cached_tokens = u64::from(pick.overlap.gpu)
            .saturating_mul(block_size)
            .min(tokens);
        let leg = pick.prefill.and_then(|(rank, overlap)| {
            pair::book_leg(state, rank, overlap, pick, config, now, facts)
        });
        let mut booking = Booking {
            generation: pick.generation,
            holder: request.holder,
            rank: pick.rank,
            // A split request's decode rank pulls the KV instead of prefilling it.
            prefill_tokens: if leg.is_some() {
                0
            } else {
                tokens.saturating_sub(cached_tokens)
            },
            decode_blocks: tokens.div_ceil(block_size),
            prefill_complete: false,
            created: now,
            ttft_tokens: pick.ttft_tokens,
            predicted_ttft: pick.predicted_ttft,
            session: leased_session,
            priority: request.priority,
            slo_ttft: request.slo_ttft_ms.map(|ms| ms as f64 / 1000.0),
            slo_tpot: request.slo_tpot_ms.map(|ms| ms as f64 / 1000.0),
            first_token: None,
            prefill: leg,
            prefill_rank_gone: false,
            failed: false,
            answered: false,
            probe: false,
            predicted: health::predicted(pick),
        };
        let Some(slot) = state.ranks.get_mut(&pick.rank) else {
            pair::unbook_leg(state, booking.prefill.as_ref(), facts);
            return outcome;
        };
        slot.add_load(booking.prefill_tokens, booking.decode_blocks);
        if booking.holder == Holder::Api {
            slot.api_bookings = slot.api_bookings.saturating_add(1);
        }
        let ttl = if config.kv_events && slot.kv_events && slot.events_seen {
            config.predicted_ttl
        } else {
            config.approx_ttl
        };
        facts.push(load_fact(slot, pick.rank));
        facts.push(Fact::Inflight(1));
        // Only a stream reports its answer: an API booking never takes a half-open rank's probe.
        booking.probe = health::may_probe(request.holder) && slot.health.on_booked(now);
        let hashes = &pick.prompt.seq_hashes;
        state.bookings.insert(pick.booking_id.to_string(), booking);
        if !hashes.is_empty() {
            state
                .index
                .insert(pick.rank, hashes, Tier::Gpu, now.checked_add(ttl));
            facts.push(self.index_fact(state, None));
            facts.push(Fact::PredictedOverlap(
                f64::from(pick.overlap.gpu) / hashes.len() as f64,
            ));
        }
        outcome
    }

    /// The session part of booking: reuse, bind (evicting the longest-idle binding when full) or
    /// route unpinned when the table is full of leased sessions; returns the outcome and the
    /// session whose lease the booking holds.
    #[allow(clippy::too_many_arguments)]
    fn bind_session(
        state: &mut State,
        request: &SelectionRequest,
        has_prompt: bool,
        rank: RankKey,
        affinity: Affinity,
        config: &CoreConfig,
        now: Instant,
        facts: &mut Facts,
    ) -> (Option<SessionOutcome>, Option<String>) {
        // A request without a prompt (`GET /v1/models`, header-only) holds no KV cache: it may
        // follow a binding but never creates one, so it cannot fill the table.
        let may_bind = affinity == Affinity::Kept || has_prompt;
        let Some(sid) = request.session_id.as_deref().filter(|_| may_bind) else {
            return (None, None);
        };
        if affinity == Affinity::Overridden {
            Self::invalidate_session(state, sid, Invalidation::SoftOverride, facts);
        }
        let result = if affinity == Affinity::Kept {
            SessionOutcome::Reused
        } else {
            match state
                .sessions
                .bind(sid, rank, now, config.sessions.max_entries)
            {
                Bound::Yes { created, evicted } => {
                    if evicted {
                        // One binding out, one in: the live count stays.
                        facts.push(Fact::SessionInvalidated(Invalidation::Evicted));
                    } else if created {
                        facts.push(Fact::SessionsLive(1));
                    }
                    SessionOutcome::Created
                }
                Bound::Full => SessionOutcome::TableFull,
            }
        };
        facts.push(Fact::Session(result));
        if result == SessionOutcome::TableFull {
            return (Some(result), None);
        }
        state.sessions.acquire(sid);
        (Some(result), Some(sid.to_string()))
    }

    fn invalidate_session(state: &mut State, sid: &str, reason: Invalidation, facts: &mut Facts) {
        if state.sessions.invalidate(sid).is_some() {
            facts.push(Fact::SessionsLive(-1));
            facts.push(Fact::SessionInvalidated(reason));
            // In-flight requests of the session keep their bookings; their leases were on the
            // old binding, which is gone, so the new binding starts without them.
            for booking in state.bookings.values_mut() {
                if booking.session.as_deref() == Some(sid) {
                    booking.session = None;
                }
            }
        }
    }

    /// Ends a booking: its session lease and its load.
    fn release(state: &mut State, booking: &Booking, now: Instant, facts: &mut Facts) {
        if let Some(sid) = &booking.session {
            state.sessions.release(sid, now);
        }
        if booking.probe && !booking.answered {
            if let Some(slot) = state.ranks.get_mut(&booking.rank) {
                slot.health.probe_abandoned(now);
            }
        }
        Self::unload(state, booking, facts);
        pair::unbook_leg(state, booking.prefill.as_ref(), facts);
    }

    /// Takes a booking's load off its rank (the booking itself lives on elsewhere or not).
    fn unload(state: &mut State, booking: &Booking, facts: &mut Facts) {
        if let Some(slot) = state.ranks.get_mut(&booking.rank) {
            slot.remove_load(booking.queued_prefill(), booking.decode_blocks);
            if booking.holder == Holder::Api {
                slot.api_bookings = slot.api_bookings.saturating_sub(1);
            }
            facts.push(load_fact(slot, booking.rank));
            facts.push(Fact::Inflight(-1));
        }
    }

    /// The booking's first token arrived at `now`: its prefill leaves the rank's queue, and the
    /// time since its pick is an observation for the TTFT estimator. `None` when the booking is
    /// not here; `Some(first)`: whether this was its first token (a repeat changes nothing).
    pub fn prefill_complete(
        &self,
        booking: &BookingRef,
        now: Instant,
        facts: &mut Facts,
    ) -> Option<bool> {
        let mut guard = self.state.lock();
        let state = &mut *guard;
        let id = &booking.0;
        let booking = state
            .bookings
            .get_mut(&booking.0)
            .filter(|b| b.generation == booking.1)?;
        let first = !booking.prefill_complete;
        // A failed response's first byte is no first token: no TTFT sample, SLO or TPOT start.
        let sample = !booking.failed;
        if first {
            booking.prefill_complete = true;
            let (created, slo_ttft, priority, rank) = (
                booking.created,
                booking.slo_ttft,
                booking.priority,
                booking.rank,
            );
            if let Some(leg) = booking.prefill.take() {
                let observed = now.saturating_duration_since(booking.created).as_secs_f64();
                let (ttft_tokens, predicted) = (booking.ttft_tokens, booking.predicted_ttft);
                pair::unbook_leg(state, Some(&leg), facts);
                if sample {
                    state.estimator.observe(leg.rank, ttft_tokens, observed);
                    facts.push(Fact::TtftObserved {
                        predicted_seconds: predicted,
                        observed_seconds: observed,
                    });
                }
            } else if let Some(slot) = state.ranks.get_mut(&booking.rank) {
                slot.load.active_prefill_tokens = slot
                    .load
                    .active_prefill_tokens
                    .saturating_sub(booking.prefill_tokens);
                facts.push(load_fact(slot, booking.rank));
                if sample && !booking.prefill_rank_gone {
                    let observed = now.saturating_duration_since(booking.created).as_secs_f64();
                    state
                        .estimator
                        .observe(booking.rank, booking.ttft_tokens, observed);
                    facts.push(Fact::TtftObserved {
                        predicted_seconds: booking.predicted_ttft,
                        observed_seconds: observed,
                    });
                }
            }
            if !sample {
                return Some(first);
            }
            let observed = now.saturating_duration_since(created).as_secs_f64();
            if let Some(slo) = slo_ttft {
                facts.push(Fact::SloTtft {
                    priority,
                    met: observed <= slo,
                });
            }
            let batch = state
                .ranks
                .get(&rank)
                .map_or(1, |s| s.total_load().active_requests);
            if let Some(b) = state.bookings.get_mut(id) {
                b.first_token = Some((now, batch));
            }
        }
        Some(first)
    }

    /// The booking's response ended after `output_tokens` tokens: its decode speed (first token
    /// to now) is an observation for the TPOT estimator, and its TPOT SLO is met or missed.
    pub fn decode_complete(
        &self,
        booking: &BookingRef,
        output_tokens: u64,
        now: Instant,
        facts: &mut Facts,
    ) -> bool {
        let mut guard = self.state.lock();
        let state = &mut *guard;
        let Some(b) = state
            .bookings
            .get(&booking.0)
            .filter(|b| b.generation == booking.1)
        else {
            return false;
        };
        let Some((first, batch)) = b.first_token.filter(|_| output_tokens >= 2) else {
            return false;
        };
        let tpot = now.saturating_duration_since(first).as_secs_f64()
            / output_tokens.saturating_sub(1) as f64;
        if let Some(slo) = b.slo_tpot {
            facts.push(Fact::SloTpot {
                priority: b.priority,
                met: tpot <= slo,
            });
        }
        state.tpot.observe(batch as f64, tpot);
        true
    }

    pub fn free(&self, booking: &BookingRef, now: Instant, facts: &mut Facts) -> bool {
        let mut state = self.state.lock();
        if state
            .bookings
            .get(&booking.0)
            .is_none_or(|b| b.generation != booking.1)
        {
            return false;
        }
        let Some(booking) = state.bookings.remove(&booking.0) else {
            return false;
        };
        Self::release(&mut state, &booking, now, facts);
        true
    }

    pub fn move_booking(
        &self,
        (booking_id, generation): &BookingRef,
        served: SocketAddr,
        facts: &mut Facts,
    ) -> bool {
        let mut guard = self.state.lock();
        let state = &mut *guard;
        let Some(current) = state
            .bookings
            .get(booking_id)
            .filter(|b| b.generation == *generation)
            .map(|b| b.rank)
        else {
            return false;
        };
        if state
            .ranks
            .get(&current)
            .is_some_and(|s| s.endpoint == served)
        {
            return false;
        }
        // Multiplexed ranks share an address: the request still carries the picked rank's
        // `X-data-parallel-rank`, so the same rank of the serving pod is the one that runs it.
        let serving = || state.ranks.iter().filter(|(_, s)| s.endpoint == served);
        let Some(target) = serving()
            .find(|(k, _)| k.dp_rank == current.dp_rank)
            .or_else(|| serving().min_by_key(|(_, s)| s.load.active_requests))
            .map(|(k, _)| *k)
        else {
            return false;
        };
        let Some(booking) = state.bookings.remove(booking_id) else {
            return false;
        };
        // The session lease moves with the booking; only the load changes rank.
        Self::unload(state, &booking, facts);
        let Some(slot) = state.ranks.get_mut(&target) else {
            return false;
        };
        slot.add_load(booking.queued_prefill(), booking.decode_blocks);
        if booking.holder == Holder::Api {
            slot.api_bookings = slot.api_bookings.saturating_add(1);
        }
        facts.push(load_fact(slot, target));
        facts.push(Fact::Inflight(1));
        state.bookings.insert(
            booking_id.clone(),
            Booking {
                rank: target,
                ..booking
            },
        );
        true
    }

    /// Reaps API bookings older than `ttl` (returned) and purges expired index entries and idle
    /// sessions. A stream's booking never expires: its stream's guard frees it when the stream
    /// ends, however long the response runs.
    pub fn reap(
        &self,
        now: Instant,
        ttl: Duration,
        ttl_sessions: Duration,
        facts: &mut Facts,
    ) -> Vec<BookingRef> {
        let mut guard = self.state.lock();
        let state = &mut *guard;
        let expired: Vec<BookingRef> = state
            .bookings
            .iter()
            .filter(|(_, b)| {
                b.holder == Holder::Api && now.saturating_duration_since(b.created) >= ttl
            })
            .map(|(id, b)| (id.clone(), b.generation))
            .collect();
        for (id, _) in &expired {
            if let Some(booking) = state.bookings.remove(id) {
                Self::release(state, &booking, now, facts);
            }
        }
        // One shard per reap: bounded work under the lock; expired entries already count as absent.
        state.index.purge_expired_step(now);
        let idle = state.sessions.reap(now, ttl_sessions);
        facts.push(Fact::SessionsLive(negative(idle as u64)));
        facts.push(Fact::SessionsExpired(idle as u64));
        let engine_bytes: usize = state
            .engines
            .values()
            .map(|m| engine_map_bytes(m.entries.capacity()))
            .fold(0usize, usize::saturating_add);
        let bytes = state.index.heap_bytes().saturating_add(engine_bytes);
        facts.push(self.index_fact(state, Some(bytes)));
        expired
    }

    /// Sets every rank's load booked by other replicas: `loads` names it, a rank it does not
    /// name has none.
    pub fn set_remote_loads(&self, loads: &HashMap<RankKey, RankLoad>) {
        let mut state = self.state.lock();
        for (key, slot) in state.ranks.slots.iter_mut() {
            slot.remote_load = loads.get(key).copied().unwrap_or_default();
        }
    }

    /// Appends this process's own load of every rank that has any.
    pub fn local_loads(&self, out: &mut Vec<(RankKey, RankLoad)>) {
        let state = self.state.lock();
        out.extend(
            state
                .ranks
                .iter()
                .filter(|(_, s)| s.load != RankLoad::default())
                .map(|(k, s)| (*k, s.load)),
        );
    }

    /// The session's live binding, if any (an expired one is dropped, as on a pick).
    pub fn bound_session(
        &self,
        sid: &str,
        now: Instant,
        ttl: Duration,
        facts: &mut Facts,
    ) -> Option<RankKey> {
        let lookup = self.state.lock().sessions.bound_rank(sid, now, ttl);
        if lookup.expired {
            facts.push(Fact::SessionsLive(-1));
            facts.push(Fact::SessionsExpired(1));
        }
        lookup.rank
    }

    /// Binds `sid` to `rank` as decided elsewhere (another replica); in-flight requests keep
    /// their leases. Not installed when the rank is not in this partition or the table is full
    /// of leased sessions.
    pub fn install_session(
        &self,
        sid: &str,
        rank: RankKey,
        now: Instant,
        max_entries: usize,
        facts: &mut Facts,
    ) -> crate::session::Installed {
        use crate::session::Installed;
        let mut state = self.state.lock();
        if state.ranks.get(&rank).is_none() {
            return Installed::UnknownRank;
        }
        match state.sessions.bind(sid, rank, now, max_entries) {
            Bound::Yes { created, evicted } => {
                if evicted {
                    facts.push(Fact::SessionInvalidated(Invalidation::Evicted));
                } else if created {
                    facts.push(Fact::SessionsLive(1));
                }
                Installed::Yes
            }
            Bound::Full => Installed::TableFull,
        }
    }

    /// Stores a rank's engine-metrics reading; false when the rank is not in the partition.
    pub fn record_engine_metrics(&self, key: RankKey, metrics: crate::EngineMetrics) -> bool {
        match self.state.lock().ranks.get_mut(&key) {
            Some(slot) => {
                slot.engine = Some(metrics);
                true
            }
            None => false,
        }
    }

    pub fn load_of(&self, key: RankKey) -> Option<RankLoad> {
        self.state.lock().ranks.get(&key).map(|s| s.load)
    }

    /// Per schedulable rank: the prompt's matched depths.
    pub fn overlaps(
        &self,
        request: &SelectionRequest,
        max_blocks: usize,
        now: Instant,
    ) -> (u32, Vec<(PickedRank, TierDepths)>) {
        let prompt = pipeline::prompt_blocks(
            &request.prompt,
            self.block_size(),
            self.seed_for(request),
            request.cache_salt.as_deref(),
            max_blocks,
        );
        let state = self.state.lock();
        let matches: HashMap<RankKey, TierDepths> = state
            .index
            .find_matches(&prompt.seq_hashes, now)
            .into_iter()
            .collect();
        let ranks = state
            .ranks
            .iter()
            .filter(|(_, s)| s.schedulable)
            .map(|(k, s)| {
                (
                    PickedRank {
                        key: *k,
                        worker_name: s.worker_name.to_string(),
                        endpoint: s.endpoint,
                        multiplexed: s.multiplexed,
                    },
                    matches.get(k).copied().unwrap_or_default(),
                )
            })
            .collect();
        (prompt.seq_hashes.len() as u32, ranks)
    }

    /// Inserts blocks for a rank (KV events, tests, warm-up).
    pub fn insert_blocks(
        &self,
        rank: RankKey,
        seq_hashes: &[u64],
        tier: Tier,
        expires: Option<Instant>,
    ) {
        self.state
            .lock()
            .index
            .insert(rank, seq_hashes, tier, expires);
    }
}

/// What the decision chose, as the booking stage needs it.
struct Pick<'a> {
    booking_id: &'a str,
    generation: u64,
    rank: RankKey,
    overlap: TierDepths,
    prompt: &'a PromptBlocks,
    block_size: u32,
    ttft_tokens: f64,
    predicted_ttft: f64,
    /// The prefill rank and the prompt's overlap there, when the pair decision split the request.
    prefill: Option<(RankKey, TierDepths)>,
}
