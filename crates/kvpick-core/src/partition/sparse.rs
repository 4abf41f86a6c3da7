//! The decision's candidates without visiting every rank (ARCHITECTURE.md §4, "decisions that
//! grow with matches"). The cost of a rank the prompt matches no deeper than every rank does
//! (the `base` of [`crate::index::Matches`]) grows with its booked requests and its queued
//! prefill, and never falls below what the rank's load gives at the partition's smallest speed
//! factor ([`crate::estimate::TtftEstimator::min_scale`]). So the ranks matching deeper and the
//! session's bound rank are costed outright, and the others are taken from the [`LoadOrder`]
//! cheapest bound first, until no rank left can enter the ranking: first to settle the best
//! predicted TTFT (the TTFT bound), then to fill the top of the ranking.
//!
//! The candidates it returns give the same decision as costing every eligible rank (the
//! ranking's key is a total order independent of the candidates' order, [`crate::decide`]);
//! `sparse_tests` checks this against the full path over random states. It owns only the
//! search; eligibility, costs and the decision are the pipeline's and `decide`'s. When it
//! cannot prove its answer (SLOs, pins, prefill/decode, sampling temperature, decision traces,
//! negative weights, no eligible rank found) it returns `None` and the full path runs.

#![warn(clippy::arithmetic_side_effects)]

use std::cmp::{Ordering, Reverse};
use std::collections::{BinaryHeap, HashSet};

use super::load_order::{LoadOrder, Place};
use super::pipeline::{self, EngineView};
use super::stage::{Ask, LazyMatches};
use super::*;
use crate::decide::{cached_blocks, overlap_score, terms, Candidate, CostParams, Terms, TtftBound};
use crate::error::SelectError;
use crate::session::AffinityMode;

/// What the search hands the rest of the pipeline: slot positions and their candidates (in no
/// particular order), and the session's binding as eligibility left it.
pub(super) struct SparseField {
    pub eligible: Vec<usize>,
    pub candidates: Vec<Candidate>,
    pub bound: Option<RankKey>,
}

/// The request-independent part of every bound: the prompt, the base overlap and the cost
/// weights. `lb_*` mirror [`crate::decide::terms`] operation by operation with the smallest
/// scale and no engine or decode terms, so IEEE rounding (monotone) keeps them true bounds.
struct Bounds<'a> {
    params: &'a CostParams,
    prompt_tokens: u64,
    block: f64,
    cached: f64,
    own: f64,
    fixed: f64,
    min_scale: f64,
}

impl<'a> Bounds<'a> {
    /// The bounds of a prompt of `prompt_tokens` whose every rank matches `base`, with no
    /// fixed blocks and unit scale (the caller sets both).
    fn new(params: &'a CostParams, prompt_tokens: u64, block_size: u32, base: TierDepths) -> Self {
        let block = f64::from(block_size.max(1));
        let cached = params.overlap_score_credit * overlap_score(base, params);
        Bounds {
            params,
            prompt_tokens,
            block,
            cached,
            own: (prompt_tokens as f64 / block - cached).max(0.0),
            fixed: 0.0,
            min_scale: 1.0,
        }
    }
}

impl Bounds<'_> {
    /// The cached blocks of a base rank, shared tier included.
    fn set_cached(&mut self, cached: f64) {
        self.cached = cached;
        self.own = (self.prompt_tokens as f64 / self.block - cached).max(0.0);
    }

    fn waited(&self, prefill: u64) -> f64 {
        (prefill.saturating_add(self.prompt_tokens) as f64 / self.block - self.cached).max(0.0)
    }

    fn ttft(&self, prefill: u64) -> f64 {
        self.min_scale * (self.fixed + self.params.prefill_load_scale * self.waited(prefill))
    }

    fn cost(&self, requests: u64, prefill: u64) -> f64 {
        let ttft = self.fixed + self.params.prefill_load_scale * self.waited(prefill);
        let stall = self.params.stall_weight * requests as f64 * self.own;
        self.min_scale * (ttft + stall)
    }
}

/// Whether the search can prove its answer equal to the full path's: not with an SLO (it
/// narrows the candidates before the ranking; flow control's gate alone reads only the
/// ranking's top, kept equal), split roles, a pin, a sampling temperature or decision traces.
fn provable(state: &State, ask: &Ask) -> bool {
    let (config, request) = (ask.config, ask.request);
    let temperature = request
        .temperature
        .unwrap_or(config.cost.router_temperature);
    let pinned = request.pin.is_some() && config.allow_pins;
    let slo = ask
        .admission
        .is_some_and(|c| c.slo_ttft.is_some() || c.slo_tpot.is_some());
    !(slo || state.ranks.split_roles || pinned || temperature != 0.0 || config.trace_decisions > 0)
}

/// Every weight the bounds leave out must only add cost, and tiers must count a faster one at
/// least as much, else a skipped rank could undercut its bound.
fn bounds_hold(p: &CostParams, fixed: f64, min_scale: f64) -> bool {
    let nonneg = [
        p.overlap_score_credit,
        p.prefill_load_scale,
        p.decode_block_weight,
        p.decode_active_request_weight,
        p.stall_weight,
        p.engine_waiting_weight,
        p.engine_kv_usage_weight,
        p.adapter_load_weight,
        p.adapter_full_weight,
        p.disk_tier_weight,
        fixed,
        min_scale,
    ];
    nonneg.iter().all(|w| *w >= 0.0 && w.is_finite())
        && p.disk_tier_weight <= p.host_tier_weight
        && p.host_tier_weight <= 1.0
}

/// The per-rank form of the eligibility stages ([`Partition::eligible_ranks`]): equal to them
/// whenever at least one rank passes, which the search guarantees before it answers.
struct Eligibility<'a> {
    allowed: &'a Allowed<'a>,
    busy: &'a crate::config::BusyThresholds,
    fraction: f64,
    may_probe: bool,
    api_cap: Option<u32>,
    now: Instant,
}

impl Eligibility<'_> {
    fn available(&self, s: &Slot) -> bool {
        if self.may_probe {
            s.health.available(self.now)
        } else {
            s.health.in_service()
        }
    }

    fn busy(&self, s: &Slot) -> bool {
        pipeline::is_busy(&s.total_load(), self.busy, self.fraction)
    }

    fn passes(&self, s: &Slot) -> bool {
        s.schedulable
            && self.allowed.in_subset(s)
            && self.allowed.has_adapter(s)
            && self.available(s)
            && !self.busy(s)
            && self.api_cap.is_none_or(|cap| s.api_bookings < cap)
    }
}

/// The candidates found so far and the `top` best keys among those within the TTFT bound.
struct Found<'a> {
    table: &'a RankTable,
    estimator: &'a crate::estimate::TtftEstimator,
    view: EngineView<'a>,
    bounds: &'a Bounds<'a>,
    eligibility: Eligibility<'a>,
    base: TierDepths,
    block_size: u32,
    eligible: Vec<usize>,
    candidates: Vec<Candidate>,
    terms: Vec<Terms>,
    seen: HashSet<RankKey>,
    top: usize,
    /// Max-heap of the best `top` (cost, tie, rank) within the bound (phase two).
    best: BinaryHeap<(TotalF64, u64, RankKey)>,
}

/// `f64` ordered by `total_cmp`, for heaps.
#[derive(Debug, Clone, Copy, PartialEq)]
struct TotalF64(f64);
impl Eq for TotalF64 {}
impl PartialOrd for TotalF64 {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for TotalF64 {
    fn cmp(&self, other: &Self) -> Ordering {
        self.0.total_cmp(&other.0)
    }
}

impl<'a> Found<'a> {
    /// Nothing found yet: the search's view of the locked state and the request.
    fn new(
        state: &'a State,
        ask: &Ask<'a>,
        allowed: &'a Allowed<'a>,
        bounds: &'a Bounds<'a>,
        base: TierDepths,
        block_size: u32,
        shared: super::shared_tier::SharedView<'a>,
    ) -> Self {
        let (config, request) = (ask.config, ask.request);
        Found {
            table: &state.ranks,
            estimator: &state.estimator,
            view: EngineView {
                now: ask.now,
                max_age: config.engine_metrics_max_age,
                adapter: allowed.adapter,
                shared,
            },
            bounds,
            eligibility: Eligibility {
                allowed,
                busy: &config.busy,
                fraction: if request.priority < 0 {
                    config.busy.sheddable_fraction
                } else {
                    1.0
                },
                may_probe: health::may_probe(request.holder),
                api_cap: (request.holder == Holder::Api)
                    .then_some(config.max_api_bookings_per_rank),
                now: ask.now,
            },
            base,
            block_size,
            eligible: Vec::new(),
            candidates: Vec::new(),
            terms: Vec::new(),
            seen: HashSet::new(),
            // The ranks the answer must rank exactly: the fallbacks' margin, or as many as the
            // request wants scored (`SelectionRequest::scores`: the best N are then costed).
            top: request
                .fallbacks
                .saturating_mul(8)
                .saturating_add(1)
                .max(request.scores),
            best: BinaryHeap::new(),
        }
    }

    /// The search proper: the deeper matches, the bound and parent ranks, then the base ranks
    /// by load until none left can enter the ranking. `None` when it found no eligible rank.
    fn search(
        mut self,
        order: &LoadOrder,
        matches: &crate::index::Matches,
        bound: Option<RankKey>,
        parent: Option<RankKey>,
    ) -> Option<SparseField> {
        for (key, depths) in &matches.ranks {
            self.visit(*key, *depths);
        }
        // The bound rank and a child session's parent rank are costed outright: affinity
        // compares them with the best, wherever the search would have stopped.
        for b in bound.into_iter().chain(parent) {
            self.visit(b, matches.depths_of(&b));
        }
        self.settle_best_ttft(order);
        let ttft_bound = TtftBound::of(&self.terms, self.bounds.params);
        self.fill_top(order, &ttft_bound);
        if self.candidates.is_empty() {
            return None;
        }
        #[cfg(test)]
        SEARCHES.with(|c| c.set((c.get().0, c.get().1.saturating_add(1))));
        Some(self.into_field(bound))
    }
}

impl Found<'_> {
    fn into_field(self, bound: Option<RankKey>) -> SparseField {
        SparseField {
            eligible: self.eligible,
            candidates: self.candidates,
            bound,
        }
    }

    /// Costs `key` once if it is eligible; returns its terms.
    fn visit(&mut self, key: RankKey, overlap: TierDepths) -> Option<Terms> {
        if !self.seen.insert(key) {
            return None;
        }
        let position = self.table.position(&key)?;
        let (_, slot) = self.table.slots.get(position)?;
        if !self.eligibility.passes(slot) {
            return None;
        }
        let fixed = self.bounds.fixed;
        let c = pipeline::candidate(key, slot, overlap, self.estimator, fixed, &self.view);
        let t = terms(
            &c,
            self.bounds.prompt_tokens,
            self.block_size,
            self.bounds.params,
        );
        self.eligible.push(position);
        self.candidates.push(c);
        self.terms.push(t);
        Some(t)
    }

    fn best_ttft(&self) -> f64 {
        self.terms
            .iter()
            .map(|t| t.ttft)
            .fold(f64::INFINITY, f64::min)
    }

    /// Phase one: base ranks by queued prefill until none left can be faster than the best.
    fn settle_best_ttft(&mut self, order: &LoadOrder) {
        let mut best = self.best_ttft();
        for &(prefill, _, key) in order.by_prefill() {
            if self.bounds.ttft(prefill) >= best {
                break;
            }
            if let Some(t) = self.visit(key, self.base) {
                best = best.min(t.ttft);
            }
        }
    }

    /// Offers a candidate's key to the best `top` within the TTFT bound.
    fn offer(&mut self, bound: &TtftBound, i: usize) {
        let (Some(t), Some(c)) = (self.terms.get(i), self.candidates.get(i)) else {
            return;
        };
        let (beyond, cost, tie, key) = bound.key(t, c);
        if beyond {
            return;
        }
        self.best.push((TotalF64(cost), tie, key));
        if self.best.len() > self.top {
            self.best.pop();
        }
    }

    /// The `top`-th best key within the bound, once there are `top` of them.
    fn cutoff(&self) -> Option<(f64, u64, RankKey)> {
        (self.best.len() >= self.top)
            .then(|| self.best.peek().map(|&(c, tie, key)| (c.0, tie, key)))
            .flatten()
    }

    /// Phase two: base ranks by their cost bound, merged over the request-count buckets, until
    /// no rank left can enter the best `top`.
    fn fill_top(&mut self, order: &LoadOrder, bound: &TtftBound) {
        for i in 0..self.candidates.len() {
            self.offer(bound, i);
        }
        let mut heap: BinaryHeap<Reverse<(TotalF64, u64, Place)>> = BinaryHeap::new();
        let mut buckets = order.request_counts().peekable();
        loop {
            while let Some(&n) = buckets.peek() {
                let floor = self.bounds.cost(n, 0);
                if heap.peek().is_some_and(|Reverse(h)| h.0 .0 < floor) {
                    break;
                }
                buckets.next();
                if let Some(p) = order.next_with(n, None) {
                    heap.push(Reverse((TotalF64(self.bounds.cost(n, p.0)), n, *p)));
                }
            }
            let Some(Reverse((lb, n, place))) = heap.pop() else {
                return;
            };
            let cutoff = self.cutoff();
            if cutoff.is_some_and(|(cost, _, _)| lb.0 > cost) {
                return;
            }
            // A run of equal queued prefill shares one bound: once it sits at the cutoff's cost
            // and past the cutoff's tie, the rest of the run ranks after the cutoff.
            let past = cutoff
                .is_some_and(|(cost, tie, key)| lb.0 == cost && (place.1, place.2) > (tie, key));
            let next = if past {
                order.next_prefill_above(n, place.0)
            } else {
                if self.visit(place.2, self.base).is_some() {
                    let i = self.candidates.len().saturating_sub(1);
                    self.offer(bound, i);
                }
                order.next_with(n, Some(&place))
            };
            if let Some(p) = next {
                heap.push(Reverse((TotalF64(self.bounds.cost(n, p.0)), n, *p)));
            }
        }
    }
}

impl Partition {
    /// The candidates of a plain decision found by the bounded search, or `None` when the full
    /// path must run (see the module doc). `Err` is the hard-bound rank's busy refusal, as the
    /// full path gives it.
    pub(super) fn sparse_field(
        &self,
        state: &State,
        ask: &Ask,
        allowed: &Allowed,
        bound: Option<RankKey>,
        parent: Option<RankKey>,
        lazy: &mut LazyMatches,
    ) -> Result<Option<SparseField>, SelectError> {
        #[cfg(test)]
        SEARCHES.with(|c| c.set((c.get().0.saturating_add(1), c.get().1)));
        if !provable(state, ask) {
            return Ok(None);
        }
        let (config, request) = (ask.config, ask.request);
        let block_size = self.block_size();
        let fixed = pipeline::fixed_blocks(&state.estimator, block_size);
        let min_scale = state.estimator.min_scale();
        if !bounds_hold(&config.cost, fixed, min_scale) {
            return Ok(None);
        }
        // Hard affinity keeps an eligible bound rank whatever the others cost: with no
        // fallbacks to rank, it is the whole field, and only its own overlap is read.
        let hard_bound =
            bound.filter(|_| config.sessions.mode == AffinityMode::Hard && request.fallbacks == 0);
        let bound_depths = hard_bound.map(|b| lazy.depths_of(state, ask, &b));
        let matches: &crate::index::Matches = match bound_depths {
            Some(_) => &crate::index::Matches::default(),
            None => lazy.get(state, ask),
        };
        let base = TierDepths {
            gpu: matches.base,
            host: matches.base,
            disk: matches.base,
        };
        let runs = self.shared_runs(state, ask);
        let shared = super::shared_tier::SharedView::of(runs.as_ref());
        let mut bounds = Bounds {
            fixed,
            min_scale,
            ..Bounds::new(&config.cost, ask.prompt.tokens, block_size, base)
        };
        // Every base rank loads the same shared-tier blocks beyond the base: its bound counts
        // them exactly as `terms` does.
        if shared.weight > 0.0 {
            let key = RankKey {
                worker_id: 0,
                dp_rank: 0,
            };
            let candidate = Candidate {
                shared_blocks: shared.beyond(base.disk),
                shared_weight: shared.weight,
                ..Candidate::new(key, RankLoad::default(), base)
            };
            let credit = config.cost.overlap_score_credit;
            bounds.set_cached(credit * cached_blocks(&candidate, &config.cost));
        }
        let mut found = Found::new(state, ask, allowed, &bounds, base, block_size, shared);
        let sheddable = request.priority < 0;
        let bound = Self::sparse_bound(&found, bound, config, sheddable)?;
        if let Some(depths) = bound_depths {
            // Ejected or not eligible after all: the full path, with the prompt's matches.
            return Ok(bound
                .filter(|b| found.visit(*b, depths).is_some())
                .map(|b| found.into_field(Some(b))));
        }
        Ok(found.search(state.ranks.order(), matches, bound, parent))
    }

    /// The session's bound rank as the eligibility stages leave it: dropped when ejected (a
    /// rank that is not lets the others stay, and the search answers only when it found one),
    /// refused when hard-bound and busy.
    fn sparse_bound(
        found: &Found,
        bound: Option<RankKey>,
        config: &CoreConfig,
        sheddable: bool,
    ) -> Result<Option<RankKey>, SelectError> {
        let Some(b) = bound else {
            return Ok(None);
        };
        let Some(slot) = found.table.get(&b) else {
            return Ok(None);
        };
        if !found.eligibility.available(slot) {
            return Ok(None);
        }
        if config.sessions.mode == AffinityMode::Hard && found.eligibility.busy(slot) {
            return Err(SelectError::Overloaded(if sheddable {
                "sheddable request shed: the session's worker is near its busy threshold".into()
            } else {
                "the session's worker is over its busy threshold".into()
            }));
        }
        Ok(Some(b))
    }
}

/// The two paths' answers to one dry-run request on the same state, for the equality test:
/// the ranking (rank, cost) and the affinity outcome, or the refusal.
#[cfg(test)]
pub(crate) type PathAnswer = Result<(Vec<(RankKey, u64)>, String), String>;

#[cfg(test)]
impl Partition {
    /// Runs the field and decision stages twice on the same locked state, first the bounded
    /// search, then the full path, and returns both answers (nothing is booked or touched).
    pub(crate) fn decision_paths(
        &self,
        request: &SelectionRequest,
        config: &CoreConfig,
        now: Instant,
        flow: bool,
    ) -> [PathAnswer; 2] {
        let check = super::stage::Check::new(request, now);
        let prompt = self.prompt_of(request, config);
        // The search gets the matches as `select` reads them, before the lock.
        let early = self.early_matches(request, &prompt, config, now);
        let mut guard = self.lock_state();
        let allowed = Allowed {
            subset: request.subset.as_ref(),
            adapter: request.model.as_deref().filter(|m| *m != self.key.model),
        };
        [false, true].map(|exhaustive| {
            let ask = Ask {
                prompt: &prompt,
                request,
                booking: None,
                config,
                now,
                admission: flow.then_some(&check),
                exhaustive,
                matches: if exhaustive { None } else { early.as_ref() },
            };
            let mut facts = Facts::default();
            let mut field = self
                .field(&mut guard, &ask, &allowed, &mut facts)
                .map_err(|e| format!("{:?}", e.into_error()))?;
            let decided = Self::decide(&mut guard, &ask, &mut field)
                .map_err(|e| format!("{:?}", e.into_error()))?;
            // What the answer shows: the primary and its cost, the fallbacks, the affinity.
            let ranking = &decided.decision.ranking;
            let slots = &guard.ranks.slots;
            let (primary, fallbacks) =
                pipeline::picked_ranks(slots, &field.eligible, ranking, request.fallbacks)
                    .ok_or("no pick")?;
            let cost = ranking
                .first()
                .and_then(|&i| decided.decision.costs.get(i))
                .map_or(0, |c| c.to_bits());
            let ranking = std::iter::once((primary.key, cost))
                .chain(fallbacks.iter().map(|f| (f.key, 0)))
                .collect();
            Ok((ranking, format!("{:?}", decided.affinity)))
        })
    }
}

#[cfg(test)]
thread_local! {
    /// (decisions that asked the search, decisions it answered) on this thread: the equality
    /// test checks that it compared the search, not only the fallback.
    pub(crate) static SEARCHES: std::cell::Cell<(usize, usize)> = const { std::cell::Cell::new((0, 0)) };
}
