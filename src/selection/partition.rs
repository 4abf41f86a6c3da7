//! One partition, `(model, routing_group)`: its ranks as scheduled, their load (derived only from
//! bookings), its KV index and its bookings, all behind one lock so a decision and its booking are
//! atomic. Owned by the core; hosts never see it.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use parking_lot::Mutex;
use rand::rngs::StdRng;
use rand::SeedableRng;

use super::session::{AffinityMode, Invalidation, SessionOutcome, SessionTable};
use super::{
    decide, BusyThresholds, Candidate, CoreConfig, Lifecycle, PickedRank, PromptInput, RankKey,
    RankLoad, SelectError, Selection, SelectionRequest, WorkerRecord, DEFAULT_BLOCK_SIZE,
};
use crate::events::decode::{KvEvent, Medium};
use crate::index::{hash, MixedMap, PrefixIndex, Tier, TierDepths};
use crate::metrics::Metrics;

#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PartitionKey {
    pub model: String,
    pub routing_group: String,
}

#[derive(Debug)]
struct Slot {
    worker_name: String,
    endpoint: SocketAddr,
    multiplexed: bool,
    lora_adapters: Arc<[String]>,
    schedulable: bool,
    kv_events: bool,
    load: RankLoad,
}

#[derive(Debug)]
struct Booking {
    rank: RankKey,
    prefill_tokens: u64,
    decode_blocks: u64,
    prefill_complete: bool,
    created: Instant,
    /// The session whose lease this booking holds.
    session: Option<String>,
}

/// The partition's ranks: a vector sorted by `RankKey` (the hot path walks it by index, in the
/// same order as index matches) plus a key -> position map. Mutations during a catalog batch may
/// leave it unsorted; [`RankTable::finish`] restores order once per batch.
#[derive(Debug, Default)]
struct RankTable {
    slots: Vec<(RankKey, Slot)>,
    positions: HashMap<RankKey, usize>,
}

impl RankTable {
    fn get(&self, key: &RankKey) -> Option<&Slot> {
        self.positions.get(key).map(|&i| &self.slots[i].1)
    }

    fn get_mut(&mut self, key: &RankKey) -> Option<&mut Slot> {
        self.positions.get(key).map(|&i| &mut self.slots[i].1)
    }

    fn keys(&self) -> impl Iterator<Item = &RankKey> {
        self.slots.iter().map(|(k, _)| k)
    }

    fn iter(&self) -> impl Iterator<Item = (&RankKey, &Slot)> {
        self.slots.iter().map(|(k, s)| (k, s))
    }

    fn values(&self) -> impl Iterator<Item = &Slot> {
        self.slots.iter().map(|(_, s)| s)
    }

    fn get_or_insert_with(&mut self, key: RankKey, make: impl FnOnce() -> Slot) -> &mut Slot {
        let i = match self.positions.get(&key) {
            Some(&i) => i,
            None => {
                self.slots.push((key, make()));
                self.positions.insert(key, self.slots.len() - 1);
                self.slots.len() - 1
            }
        };
        &mut self.slots[i].1
    }

    fn remove(&mut self, key: &RankKey) -> Option<Slot> {
        let i = self.positions.remove(key)?;
        let (_, slot) = self.slots.swap_remove(i);
        if i < self.slots.len() {
            self.positions.insert(self.slots[i].0, i);
        }
        Some(slot)
    }

    fn finish(&mut self) {
        self.slots.sort_unstable_by_key(|(k, _)| *k);
        self.positions = self
            .slots
            .iter()
            .enumerate()
            .map(|(i, (k, _))| (*k, i))
            .collect();
    }
}

impl std::ops::Index<&RankKey> for RankTable {
    type Output = Slot;
    fn index(&self, key: &RankKey) -> &Slot {
        self.get(key).expect("rank exists")
    }
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
    rng: StdRng,
}

pub(super) struct BatchResult {
    pub failed: Vec<(u64, String)>,
    pub dropped_bookings: Vec<String>,
}

pub(super) struct SelectOutcome {
    pub selection: Selection,
    /// Candidate costs, `worker:rank=cost` in rank order, for decision traces.
    pub trace: String,
}

pub(super) struct Partition {
    pub(super) key: PartitionKey,
    schedulable: AtomicUsize,
    block_size: AtomicU32,
    state: Mutex<State>,
}

/// The prompt reduced to what the index and cost function need.
struct PromptBlocks {
    tokens: u64,
    seq_hashes: Vec<u64>,
}

fn prompt_blocks(prompt: &PromptInput, block_size: u32, seed: u64) -> PromptBlocks {
    let bs = block_size as usize;
    match prompt {
        PromptInput::None => PromptBlocks {
            tokens: 0,
            seq_hashes: Vec::new(),
        },
        PromptInput::Tokens(tokens) => PromptBlocks {
            tokens: tokens.len() as u64,
            seq_hashes: hash::prompt_hashes(tokens, bs, seed),
        },
        PromptInput::BlockHashes {
            seq_hashes,
            prompt_tokens,
        } => PromptBlocks {
            tokens: *prompt_tokens,
            seq_hashes: seq_hashes.clone(),
        },
        PromptInput::Text(bytes) => {
            let words = bytes.chunks_exact(4);
            let tail = words.remainder();
            let mut pseudo: Vec<u32> = Vec::with_capacity(bytes.len().div_ceil(4));
            pseudo.extend(words.map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])));
            if !tail.is_empty() {
                let mut word = [0u8; 4];
                word[..tail.len()].copy_from_slice(tail);
                pseudo.push(u32::from_le_bytes(word));
            }
            PromptBlocks {
                tokens: pseudo.len() as u64,
                seq_hashes: hash::prompt_hashes(&pseudo, bs, seed),
            }
        }
    }
}

/// Whether a rank is at or over a busy threshold, each scaled by `fraction` (sheddable requests
/// see lower thresholds, so they are shed before critical ones).
fn is_busy(load: &RankLoad, busy: &BusyThresholds, fraction: f64) -> bool {
    let over = |value: u64, threshold: u64| value as f64 >= threshold as f64 * fraction;
    busy.active_decode_blocks
        .is_some_and(|t| over(load.active_decode_blocks, t))
        || busy
            .active_prefill_tokens
            .is_some_and(|t| over(load.active_prefill_tokens, t))
}

impl Partition {
    pub fn new(key: PartitionKey, config: &CoreConfig) -> Self {
        let rng = match config.seed {
            Some(seed) => {
                let salt =
                    hash::text_id(format!("{}\0{}", key.model, key.routing_group).as_bytes());
                StdRng::seed_from_u64(seed ^ salt)
            }
            None => StdRng::from_os_rng(),
        };
        Partition {
            key,
            schedulable: AtomicUsize::new(0),
            block_size: AtomicU32::new(DEFAULT_BLOCK_SIZE),
            state: Mutex::new(State {
                declared_block_size: None,
                ranks: RankTable::default(),
                index: PrefixIndex::new(config.index_max_blocks),
                bookings: HashMap::new(),
                sessions: SessionTable::default(),
                engines: HashMap::new(),
                rng,
            }),
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

    /// Applies one batch of catalog changes under one lock (one publish).
    pub fn apply_batch(
        &self,
        gone: &[WorkerRecord],
        upserts: &[WorkerRecord],
        metrics: &Metrics,
    ) -> BatchResult {
        let mut result = BatchResult {
            failed: Vec::new(),
            dropped_bookings: Vec::new(),
        };
        let mut state = self.state.lock();
        for record in gone {
            Self::drop_worker(&mut state, record.id, metrics, &mut result.dropped_bookings);
        }
        for record in upserts {
            let others_declare =
                |state: &State| state.ranks.keys().any(|k| k.worker_id != record.id);
            if let Some(declared) = record.spec.block_size {
                match state.declared_block_size {
                    Some(current) if current != declared && others_declare(&state) => {
                        result.failed.push((
                            record.id,
                            format!(
                                "block_size {declared} conflicts with block size {current} of partition {}",
                                self.key.model
                            ),
                        ));
                        Self::drop_worker(
                            &mut state,
                            record.id,
                            metrics,
                            &mut result.dropped_bookings,
                        );
                        continue;
                    }
                    Some(current) if current == declared => {}
                    _ => {
                        // First declaration (or the only worker changed it): hashes of another
                        // block size never match, so start the index afresh.
                        if state.declared_block_size.is_some() || declared != DEFAULT_BLOCK_SIZE {
                            state.index = PrefixIndex::new(state.index_capacity());
                        }
                        state.declared_block_size = Some(declared);
                        self.block_size.store(declared, Ordering::Relaxed);
                    }
                }
            }
            let wanted: HashMap<u32, _> = record.ranks.iter().map(|r| (r.dp_rank, *r)).collect();
            let existing: Vec<RankKey> = state
                .ranks
                .keys()
                .filter(|k| k.worker_id == record.id)
                .copied()
                .collect();
            for key in existing {
                let keep = wanted
                    .get(&key.dp_rank)
                    .is_some_and(|r| state.ranks[&key].endpoint == r.endpoint);
                if !keep {
                    Self::drop_rank(&mut state, key, metrics, &mut result.dropped_bookings);
                }
            }
            let lora: Arc<[String]> = record.spec.lora_adapters.clone().into();
            for rank in &record.ranks {
                let key = RankKey {
                    worker_id: record.id,
                    dp_rank: rank.dp_rank,
                };
                let slot = state.ranks.get_or_insert_with(key, || Slot {
                    worker_name: record.spec.name.clone(),
                    endpoint: rank.endpoint,
                    multiplexed: rank.multiplexed,
                    lora_adapters: Arc::clone(&lora),
                    schedulable: false,
                    kv_events: false,
                    load: RankLoad::default(),
                });
                slot.worker_name = record.spec.name.clone();
                slot.multiplexed = rank.multiplexed;
                slot.lora_adapters = Arc::clone(&lora);
                slot.schedulable = record.lifecycle == Lifecycle::Schedulable;
                slot.kv_events = record.spec.kv_events.is_some();
            }
        }
        state.ranks.finish();
        let n = state.ranks.values().filter(|s| s.schedulable).count();
        self.schedulable.store(n, Ordering::Relaxed);
        result
    }

    /// Drops every rank of a worker (and their bookings).
    fn drop_worker(
        state: &mut State,
        worker_id: u64,
        metrics: &Metrics,
        dropped: &mut Vec<String>,
    ) {
        let keys: Vec<RankKey> = state
            .ranks
            .keys()
            .filter(|k| k.worker_id == worker_id)
            .copied()
            .collect();
        for key in keys {
            Self::drop_rank(state, key, metrics, dropped);
        }
    }

    fn drop_rank(state: &mut State, key: RankKey, metrics: &Metrics, dropped: &mut Vec<String>) {
        let Some(slot) = state.ranks.remove(&key) else {
            return;
        };
        state.engines.remove(&key);
        let mut leases = Vec::new();
        state.bookings.retain(|id, b| {
            if b.rank == key {
                dropped.push(id.clone());
                leases.extend(b.session.take());
                false
            } else {
                true
            }
        });
        for sid in leases {
            state.sessions.release(&sid, Instant::now());
        }
        metrics.inflight_total.sub(slot.load.active_requests as i64);
        let labels = [slot.worker_name.as_str(), &key.dp_rank.to_string()];
        let _ = metrics.inflight.remove_label_values(&labels);
        let _ = metrics.active_prefill_tokens.remove_label_values(&labels);
        let _ = metrics.active_decode_blocks.remove_label_values(&labels);
    }

    fn publish_load(slot: &Slot, key: RankKey, metrics: &Metrics) {
        let labels = [slot.worker_name.as_str(), &key.dp_rank.to_string()];
        metrics
            .inflight
            .with_label_values(&labels)
            .set(slot.load.active_requests as i64);
        metrics
            .active_prefill_tokens
            .with_label_values(&labels)
            .set(slot.load.active_prefill_tokens as i64);
        metrics
            .active_decode_blocks
            .with_label_values(&labels)
            .set(slot.load.active_decode_blocks as i64);
    }

    fn seed_for(&self, request: &SelectionRequest) -> u64 {
        let lora = request.model.as_deref().filter(|m| *m != self.key.model);
        hash::block_seed(lora, request.cache_salt.as_deref())
    }

    /// Eligibility (DESIGN §5 order), overlap lookup, decision, and (with `booking_id`) the
    /// booking, all under the partition lock.
    pub fn select(
        &self,
        request: &SelectionRequest,
        booking_id: Option<&str>,
        config: &CoreConfig,
        metrics: &Metrics,
    ) -> Result<SelectOutcome, SelectError> {
        let block_size = self.block_size.load(Ordering::Relaxed);
        let prompt = prompt_blocks(&request.prompt, block_size, self.seed_for(request));
        let now = Instant::now();
        let mutating = booking_id.is_some();
        let mut guard = self.state.lock();
        let state = &mut *guard;
        let adapter = request.model.as_deref().filter(|m| *m != self.key.model);
        let in_subset = |s: &Slot| {
            request
                .subset
                .as_ref()
                .is_none_or(|f| f.matches(&s.endpoint))
        };
        let has_adapter = |s: &Slot| adapter.is_none_or(|a| s.lora_adapters.iter().any(|l| l == a));

        // 0. Session binding: still valid for this request?
        let sessions_cfg = &config.sessions;
        let session_id = request.session_id.as_deref();
        let mut bound: Option<RankKey> = None;
        if let Some(sid) = session_id {
            let lookup = state.sessions.bound_rank(sid, now, sessions_cfg.ttl);
            if lookup.expired {
                metrics.sessions_live.dec();
                metrics.session_events.with_label_values(&["expired"]).inc();
            }
            if let Some(rank) = lookup.rank {
                let invalid = match state.ranks.get(&rank) {
                    None => Some(Invalidation::Gone),
                    Some(s) if !s.schedulable => Some(Invalidation::Unschedulable),
                    Some(s) if !in_subset(s) => Some(Invalidation::OutsideSubset),
                    Some(s) if !has_adapter(s) => Some(Invalidation::Adapter),
                    Some(_) => None,
                };
                match invalid {
                    None => bound = Some(rank),
                    Some(reason) if mutating => {
                        Self::invalidate_session(state, sid, reason, metrics);
                    }
                    Some(_) => {}
                }
            }
        }
        let slots = &state.ranks.slots;

        // 1. Subset hint / allowed set. `eligible` holds positions in `slots`, in rank order.
        let mut eligible: Vec<usize> = (0..slots.len())
            .filter(|&i| slots[i].1.schedulable && in_subset(&slots[i].1))
            .collect();
        if eligible.is_empty() {
            return Err(SelectError::Unavailable(if request.subset.is_some() {
                "subset hint matches no eligible endpoint".into()
            } else {
                format!(
                    "no ready worker serves model {}",
                    super::clip(&self.key.model)
                )
            }));
        }
        // 2. Pin, which must be inside the allowed set and agree with a hard binding.
        let pin = request.pin.filter(|_| config.allow_pins);
        if let Some(pin) = pin {
            let ranks: Vec<RankKey> = slots
                .iter()
                .filter(|(k, s)| k.worker_id == pin.worker_id && s.schedulable)
                .map(|(k, _)| *k)
                .collect();
            if ranks.is_empty() {
                return Err(SelectError::Unavailable(format!(
                    "pinned worker {} is not available",
                    pin.worker_id
                )));
            }
            if let Some(rank) = pin.dp_rank {
                if !ranks.iter().any(|k| k.dp_rank == rank) {
                    return Err(SelectError::BadRequest(format!(
                        "dp rank {rank} is out of range for worker {}",
                        pin.worker_id
                    )));
                }
            }
            let pin_matches = |k: &RankKey| {
                k.worker_id == pin.worker_id && pin.dp_rank.is_none_or(|r| r == k.dp_rank)
            };
            if let Some(b) = bound.filter(|b| !pin_matches(b)) {
                if sessions_cfg.mode == AffinityMode::Hard {
                    return Err(SelectError::BadRequest(format!(
                        "pin to worker {} contradicts the session's binding to worker {} rank {}",
                        pin.worker_id, b.worker_id, b.dp_rank
                    )));
                }
                bound = None;
            }
            eligible.retain(|&i| pin_matches(&slots[i].0));
            if eligible.is_empty() {
                return Err(SelectError::Unavailable(
                    "pinned worker is outside the allowed endpoints".into(),
                ));
            }
        }
        // 3. LoRA narrowing: a request for an adapter goes where the adapter is loaded.
        if let Some(model) = adapter {
            eligible.retain(|&i| has_adapter(&slots[i].1));
            if eligible.is_empty() {
                return Err(SelectError::Unavailable(format!(
                    "no eligible worker has adapter {} loaded",
                    super::clip(model)
                )));
            }
        }
        // 4. Busy thresholds. A hard-bound rank keeps its session even when busy.
        let hard_bound = bound.filter(|_| sessions_cfg.mode == AffinityMode::Hard);
        let sheddable = request.priority < 0;
        let busy_fraction = if sheddable {
            config.busy.sheddable_fraction
        } else {
            1.0
        };
        eligible.retain(|&i| {
            !is_busy(&slots[i].1.load, &config.busy, busy_fraction)
                || Some(slots[i].0) == hard_bound
        });
        if eligible.is_empty() {
            return Err(SelectError::Overloaded(if pin.is_some() {
                "pinned worker is over its busy threshold".into()
            } else if sheddable {
                "sheddable request shed: every eligible worker is near its busy threshold".into()
            } else {
                "all eligible workers are over their busy thresholds".into()
            }));
        }

        let matches = if prompt.seq_hashes.is_empty() {
            Vec::new()
        } else {
            state.index.find_matches(&prompt.seq_hashes, now)
        };
        // Both `eligible` and `matches` are in rank order: merge them.
        let mut next_match = matches.iter().peekable();
        let candidates: Vec<Candidate> = eligible
            .iter()
            .map(|&i| {
                let (key, slot) = &slots[i];
                while next_match.peek().is_some_and(|(k, _)| k < key) {
                    next_match.next();
                }
                let overlap = match next_match.peek() {
                    Some((k, d)) if k == key => *d,
                    _ => TierDepths::default(),
                };
                Candidate {
                    key: *key,
                    active_prefill_tokens: slot.load.active_prefill_tokens,
                    active_decode_blocks: slot.load.active_decode_blocks,
                    active_requests: slot.load.active_requests,
                    overlap,
                }
            })
            .collect();
        let temperature = request
            .temperature
            .unwrap_or(config.cost.router_temperature);
        let mut decision = decide(
            &candidates,
            prompt.tokens,
            block_size,
            &config.cost,
            temperature,
            // Enough runners-up to find distinct fallback endpoints among multiplexed ranks.
            1 + request.fallbacks.saturating_mul(8),
            &mut state.rng,
        );
        // 5. Affinity: hard keeps the bound rank; soft keeps it while it is not busy and its cost
        // is within the margin of the best.
        let mut session_outcome = None;
        let mut overridden = false;
        if let Some(b) = bound {
            let position = candidates.iter().position(|c| c.key == b);
            let keep = match (sessions_cfg.mode, position) {
                (AffinityMode::Hard, Some(_)) => true,
                (AffinityMode::Soft, Some(p)) => {
                    decision.costs[p]
                        <= decision.costs[decision.ranking[0]] + sessions_cfg.soft_margin_blocks
                }
                (_, None) => false,
            };
            match (keep, position) {
                (true, Some(p)) => {
                    decision.ranking.retain(|&i| i != p);
                    decision.ranking.insert(0, p);
                    session_outcome = Some(SessionOutcome::Reused);
                }
                _ => overridden = true,
            }
        }
        let best = decision.ranking[0];
        let primary_key = candidates[best].key;
        let picked = |candidate: usize| {
            let (key, s) = &slots[eligible[candidate]];
            PickedRank {
                key: *key,
                worker_name: s.worker_name.clone(),
                endpoint: s.endpoint,
                multiplexed: s.multiplexed,
            }
        };
        let primary = picked(best);
        // Fallbacks are distinct endpoints: multiplexed ranks of one pod share an address.
        let mut fallbacks: Vec<PickedRank> = Vec::new();
        for &i in &decision.ranking[1..] {
            if fallbacks.len() == request.fallbacks {
                break;
            }
            let next = picked(i);
            if next.endpoint != primary.endpoint
                && fallbacks.iter().all(|f| f.endpoint != next.endpoint)
            {
                fallbacks.push(next);
            }
        }
        let overlap = candidates[best].overlap;
        let prompt_block_count = prompt.seq_hashes.len() as u32;
        let trace = if config.trace_decisions > 0 {
            candidates
                .iter()
                .zip(&decision.costs)
                .map(|(c, cost)| format!("{}:{}={:.3}", c.key.worker_id, c.key.dp_rank, cost))
                .collect::<Vec<_>>()
                .join(",")
        } else {
            String::new()
        };
        let cost = decision.costs[best];

        if let (Some(id), true) = (booking_id, mutating) {
            // Session bookkeeping happens with the booking, in the same critical section.
            let mut leased_session = None;
            if let Some(sid) = session_id {
                if overridden {
                    Self::invalidate_session(state, sid, Invalidation::SoftOverride, metrics);
                }
                let outcome = match session_outcome {
                    Some(reused) => reused,
                    None if state.sessions.bind(
                        sid,
                        primary_key,
                        now,
                        sessions_cfg.max_entries,
                    ) =>
                    {
                        metrics.sessions_live.inc();
                        SessionOutcome::Created
                    }
                    None => SessionOutcome::TableFull,
                };
                metrics
                    .session_events
                    .with_label_values(&[outcome.as_str()])
                    .inc();
                if outcome != SessionOutcome::TableFull {
                    state.sessions.acquire(sid);
                    leased_session = Some(sid.to_string());
                }
                session_outcome = Some(outcome);
            }
            let cached_tokens = (overlap.gpu as u64 * block_size as u64).min(prompt.tokens);
            let booking = Booking {
                rank: primary_key,
                prefill_tokens: prompt.tokens - cached_tokens,
                decode_blocks: prompt.tokens.div_ceil(block_size as u64),
                prefill_complete: false,
                created: now,
                session: leased_session,
            };
            let slot = state.ranks.get_mut(&primary_key).expect("candidate exists");
            slot.load.active_prefill_tokens += booking.prefill_tokens;
            slot.load.active_decode_blocks += booking.decode_blocks;
            slot.load.active_requests += 1;
            let ttl = if config.kv_events && slot.kv_events {
                config.predicted_ttl
            } else {
                config.approx_ttl
            };
            Self::publish_load(slot, primary_key, metrics);
            metrics.inflight_total.inc();
            state.bookings.insert(id.to_string(), booking);
            if !prompt.seq_hashes.is_empty() {
                state
                    .index
                    .insert(primary_key, &prompt.seq_hashes, Tier::Gpu, Some(now + ttl));
                metrics
                    .index_blocks
                    .with_label_values(&[&self.key.model, &self.key.routing_group])
                    .set(state.index.len() as i64);
            }
            if prompt_block_count > 0 {
                metrics
                    .predicted_overlap
                    .observe(overlap.gpu as f64 / prompt_block_count as f64);
            }
        }
        let selection = Selection {
            booking_id: booking_id.unwrap_or_default().to_string(),
            partition: self.key.clone(),
            primary,
            fallbacks,
            overlap_blocks: overlap.gpu,
            prompt_blocks: prompt_block_count,
            prompt_tokens: prompt.tokens,
            cost,
            session: session_outcome,
        };
        Ok(SelectOutcome { selection, trace })
    }

    fn invalidate_session(state: &mut State, sid: &str, reason: Invalidation, metrics: &Metrics) {
        if state.sessions.invalidate(sid).is_some() {
            metrics.sessions_live.dec();
            metrics
                .session_invalidated
                .with_label_values(&[reason.as_str()])
                .inc();
            // In-flight requests of the session keep their bookings; their leases were on the
            // old binding, which is gone, so the new binding starts without them.
            for booking in state.bookings.values_mut() {
                if booking.session.as_deref() == Some(sid) {
                    booking.session = None;
                }
            }
        }
    }

    fn release(state: &mut State, booking: &Booking, metrics: &Metrics) {
        if let Some(sid) = &booking.session {
            state.sessions.release(sid, Instant::now());
        }
        if let Some(slot) = state.ranks.get_mut(&booking.rank) {
            if !booking.prefill_complete {
                slot.load.active_prefill_tokens = slot
                    .load
                    .active_prefill_tokens
                    .saturating_sub(booking.prefill_tokens);
            }
            slot.load.active_decode_blocks = slot
                .load
                .active_decode_blocks
                .saturating_sub(booking.decode_blocks);
            slot.load.active_requests = slot.load.active_requests.saturating_sub(1);
            Self::publish_load(slot, booking.rank, metrics);
            metrics.inflight_total.dec();
        }
    }

    pub fn prefill_complete(&self, booking_id: &str, metrics: &Metrics) -> bool {
        let mut guard = self.state.lock();
        let state = &mut *guard;
        let Some(booking) = state.bookings.get_mut(booking_id) else {
            return false;
        };
        if !booking.prefill_complete {
            booking.prefill_complete = true;
            if let Some(slot) = state.ranks.get_mut(&booking.rank) {
                slot.load.active_prefill_tokens = slot
                    .load
                    .active_prefill_tokens
                    .saturating_sub(booking.prefill_tokens);
                Self::publish_load(slot, booking.rank, metrics);
            }
        }
        true
    }

    pub fn free(&self, booking_id: &str, metrics: &Metrics) -> bool {
        let mut state = self.state.lock();
        let Some(booking) = state.bookings.remove(booking_id) else {
            return false;
        };
        Self::release(&mut state, &booking, metrics);
        true
    }

    pub fn move_booking(&self, booking_id: &str, served: SocketAddr, metrics: &Metrics) -> bool {
        let mut guard = self.state.lock();
        let state = &mut *guard;
        let Some(current) = state.bookings.get(booking_id).map(|b| b.rank) else {
            return false;
        };
        if state
            .ranks
            .get(&current)
            .is_some_and(|s| s.endpoint == served)
        {
            return false;
        }
        let Some(target) = state
            .ranks
            .iter()
            .find(|(_, s)| s.endpoint == served)
            .map(|(k, _)| *k)
        else {
            return false;
        };
        let booking = state.bookings.remove(booking_id).expect("checked");
        Self::release(state, &booking, metrics);
        let slot = state.ranks.get_mut(&target).expect("found");
        if !booking.prefill_complete {
            slot.load.active_prefill_tokens += booking.prefill_tokens;
        }
        slot.load.active_decode_blocks += booking.decode_blocks;
        slot.load.active_requests += 1;
        Self::publish_load(slot, target, metrics);
        metrics.inflight_total.inc();
        state.bookings.insert(
            booking_id.to_string(),
            Booking {
                rank: target,
                ..booking
            },
        );
        true
    }

    /// Reaps bookings older than `ttl` (returned) and purges expired index entries.
    pub fn reap(
        &self,
        now: Instant,
        ttl: Duration,
        ttl_sessions: Duration,
        metrics: &Metrics,
    ) -> Vec<String> {
        let mut guard = self.state.lock();
        let state = &mut *guard;
        let expired: Vec<String> = state
            .bookings
            .iter()
            .filter(|(_, b)| now.saturating_duration_since(b.created) >= ttl)
            .map(|(id, _)| id.clone())
            .collect();
        for id in &expired {
            let booking = state.bookings.remove(id).expect("listed");
            Self::release(state, &booking, metrics);
        }
        state.index.purge_expired(now);
        let idle = state.sessions.reap(now, ttl_sessions);
        metrics.sessions_live.sub(idle as i64);
        metrics
            .session_events
            .with_label_values(&["expired"])
            .inc_by(idle as u64);
        metrics
            .index_blocks
            .with_label_values(&[&self.key.model, &self.key.routing_group])
            .set(state.index.len() as i64);
        let engine_bytes: usize = state
            .engines
            .values()
            .map(|m| m.entries.capacity() * 8 / 7 * (std::mem::size_of::<(u64, u64)>() + 1))
            .sum();
        metrics
            .index_bytes
            .with_label_values(&[&self.key.model, &self.key.routing_group])
            .set((state.index.heap_bytes() + engine_bytes) as i64);
        expired
    }

    pub fn load_of(&self, key: RankKey) -> Option<RankLoad> {
        self.state.lock().ranks.get(&key).map(|s| s.load)
    }

    /// Per schedulable rank: the prompt's matched depths.
    pub fn overlaps(&self, request: &SelectionRequest) -> (u32, Vec<(PickedRank, TierDepths)>) {
        let block_size = self.block_size.load(Ordering::Relaxed);
        let prompt = prompt_blocks(&request.prompt, block_size, self.seed_for(request));
        let state = self.state.lock();
        let matches: HashMap<RankKey, TierDepths> = state
            .index
            .find_matches(&prompt.seq_hashes, Instant::now())
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
                        worker_name: s.worker_name.clone(),
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

    pub fn block_size(&self) -> u32 {
        self.block_size.load(Ordering::Relaxed)
    }
}

impl State {
    fn index_capacity(&self) -> usize {
        self.index.capacity()
    }
}

/// What happened to a batch of KV events.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct EventStats {
    pub applied: u64,
    /// Events that could not be applied (unknown parent or block, block-size mismatch, unknown rank).
    pub dropped: u64,
}

/// Engine block hash -> our chained hash, for one rank. Reference counts per tier live in the
/// index's holders, so an entry is 16 bytes.
#[derive(Debug, Default)]
pub(super) struct EngineMap {
    entries: MixedMap<u64>,
}

fn tier_of(medium: &Medium) -> Tier {
    match medium {
        Medium::Gpu => Tier::Gpu,
        Medium::Cpu => Tier::Host,
        Medium::Disk | Medium::Other(_) => Tier::Disk,
    }
}

impl Partition {
    /// Applies one rank's KV events to the index. The router recomputes block hashes from the
    /// events' token ids (engine hashes are only keys for removal and tokenless stores).
    pub fn apply_events(&self, rank: RankKey, events: &[KvEvent]) -> EventStats {
        let block_size = self.block_size.load(Ordering::Relaxed) as usize;
        let mut stats = EventStats::default();
        let mut guard = self.state.lock();
        let state = &mut *guard;
        if state.ranks.get(&rank).is_none() {
            stats.dropped = events.len() as u64;
            return stats;
        }
        let map = state.engines.entry(rank).or_default();
        for event in events {
            let ok = match event {
                KvEvent::AllBlocksCleared => {
                    state.index.clear_rank(rank);
                    map.entries.clear();
                    true
                }
                KvEvent::BlockRemoved {
                    block_hashes,
                    medium,
                    ..
                } => {
                    let tier = tier_of(medium);
                    let mut all_known = true;
                    for h in block_hashes {
                        let Some(&seq) = map.entries.get(h) else {
                            all_known = false;
                            continue;
                        };
                        if !state.index.release(rank, seq, tier) {
                            map.entries.remove(h);
                        }
                    }
                    all_known
                }
                KvEvent::BlockStored {
                    block_hashes,
                    parent_block_hash,
                    token_ids,
                    block_size: event_block_size,
                    medium,
                    lora_name,
                    ..
                } => {
                    let tier = tier_of(medium);
                    let seed = hash::block_seed(lora_name.as_deref(), None);
                    let mut parent = match parent_block_hash {
                        None => None,
                        Some(h) => match map.entries.get(h) {
                            Some(&seq) => Some(seq),
                            None if token_ids.is_empty() => None,
                            // A chain we never saw the start of cannot be hashed like requests.
                            None => {
                                stats.dropped += 1;
                                continue;
                            }
                        },
                    };
                    if !token_ids.is_empty() && *event_block_size as usize != block_size {
                        stats.dropped += 1;
                        continue;
                    }
                    let mut ok = true;
                    for (i, engine_hash) in block_hashes.iter().enumerate() {
                        let seq = if token_ids.is_empty() {
                            match map.entries.get(engine_hash) {
                                Some(&seq) => seq,
                                None => {
                                    ok = false;
                                    continue;
                                }
                            }
                        } else {
                            let Some(block) = token_ids.get(i * block_size..(i + 1) * block_size)
                            else {
                                ok = false;
                                break;
                            };
                            let local = hash::block_hash(block, seed);
                            match parent {
                                None => local,
                                Some(p) => hash::chain(p, local),
                            }
                        };
                        map.entries.insert(*engine_hash, seq);
                        state.index.insert(rank, &[seq], tier, None);
                        parent = Some(seq);
                    }
                    ok
                }
            };
            if ok {
                stats.applied += 1;
            } else {
                stats.dropped += 1;
            }
        }
        stats
    }

    /// Forgets every block of a rank (engine restart).
    pub fn clear_rank(&self, rank: RankKey) {
        let mut state = self.state.lock();
        state.index.clear_rank(rank);
        state.engines.remove(&rank);
    }

    pub fn index_len(&self) -> usize {
        self.state.lock().index.len()
    }
}
