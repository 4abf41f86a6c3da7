//! One decision under the partition lock: the request's blocks, then the named stages of the
//! [`super::pipeline`] in order (eligibility → candidates → SLO gate → decision, single or pair →
//! session affinity → flow gate and prefill side → pick → book), and the read-only overlap query.
//! It owns the order of the stages, not their rules (those are `pipeline`, `pair`, `admission`)
//! and not the booking itself ([`super::booking`]).

#![warn(clippy::arithmetic_side_effects)]

use super::*;
use crate::disagg::PrefillChoice;

use super::stage::{Check, Decided, Field, LazyMatches};

/// The picked ranks and what the booking and the answer say of them.
struct Picked {
    primary: PickedRank,
    fallbacks: Vec<PickedRank>,
    overlap: TierDepths,
    cost: f64,
    ttft_tokens: f64,
    predicted_ttft: f64,
    prefill: Option<(PickedRank, TierDepths)>,
}

impl Partition {
    /// The request's block seed (its LoRA adapter); the cache salt goes into the first block only.
    pub(super) fn seed_for(&self, request: &SelectionRequest) -> u64 {
        let lora = request.model.as_deref().filter(|m| *m != self.key.model);
        hash::block_seed(lora, None)
    }

    /// The prompt's blocks as this partition hashes them (outside the lock).
    pub(crate) fn prompt_of(
        &self,
        request: &SelectionRequest,
        config: &CoreConfig,
    ) -> PromptBlocks {
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
        let early = self.early_matches(request, &prompt, config, now);
        let check = saturation_gate.then(|| Check::new(request, now));
        let ask = Ask {
            prompt: &prompt,
            request,
            booking,
            config,
            now,
            admission: check.as_ref(),
            exhaustive: false,
            matches: early.as_ref(),
        };
        let mut guard = self.lock_state();
        Self::decay_due(&mut guard, now, facts);
        let outcome = self.select_in(&mut guard, &ask, facts);
        guard.unlock(facts);
        outcome.map_err(Refusal::into_error)
    }

    /// The pipeline on locked state, stage by stage. With `ask.admission` (flow control)
    /// saturated ranks are not candidates, a request that finds none is [`Refusal::Saturated`]
    /// (it may wait), and an SLO restricts the candidates to ranks predicted to meet it.
    pub(super) fn select_in(
        &self,
        state: &mut State,
        ask: &Ask,
        facts: &mut Facts,
    ) -> Result<SelectOutcome, Refusal> {
        let allowed = Allowed {
            subset: ask.request.subset.as_ref(),
            adapter: ask
                .request
                .model
                .as_deref()
                .filter(|m| *m != self.key.model),
        };
        let mut field = self.field(state, ask, &allowed, facts)?;
        let mut decided = Self::decide(state, ask, &mut field)?;
        let shared_changed = self
            .has_shared_tier
            .then(|| Self::shared_tier_changed(state, ask, &field, &decided.decision))
            .flatten();
        let prefill = Self::flow_gate(state, ask, &field, &mut decided)?;
        let picked = Self::pick(state, ask, &field, &decided, prefill)?;
        let trace = if ask.config.trace_decisions > 0 {
            cost_trace(&field.candidates, &decided.decision.costs)
        } else {
            String::new()
        };
        // The gateway's scores (opt-in): the decision's own costs, before the pick is booked.
        let destinations: Vec<&crate::outcome::PickedRank> = if ask.request.scores > 0 {
            std::iter::once(&picked.primary)
                .chain(&picked.fallbacks)
                .collect()
        } else {
            Vec::new()
        };
        let scores = pipeline::endpoint_scores(
            &state.ranks.slots,
            &field.eligible,
            &field.candidates,
            &decided.decision,
            &destinations,
            ask.request.scores,
        );
        state.ranks.touch(&picked.primary.key);
        if let Some(parent) = decided.parent.filter(|_| ask.booking.is_some()) {
            facts.push(Fact::SessionParent(parent));
        }
        // A split pick's prefill rank computes the prompt: no hint for its decode rank.
        let transfer = picked
            .prefill
            .is_none()
            .then(|| self.transfer_hint(state, ask, &picked.primary))
            .flatten();
        if transfer.is_some() {
            facts.push(Fact::TransferHint);
        }
        let session = self.book_pick(state, ask, &field, &picked, decided.affinity, facts);
        if let Some(changed) = shared_changed {
            facts.push(Fact::SharedTierPick { changed });
        }
        let mut selection = self.selection(ask, &field, picked, session);
        selection.scores = scores;
        selection.transfer = transfer;
        Ok(SelectOutcome { selection, trace })
    }

    /// Stages 1–3: the session's binding, the eligible ranks (allowed, pin, adapter, ejected,
    /// busy), their candidates with the prompt's matches, and the SLO gate.
    pub(super) fn field(
        &self,
        state: &mut State,
        ask: &Ask,
        allowed: &Allowed,
        facts: &mut Facts,
    ) -> Result<Field, Refusal> {
        let (config, now) = (ask.config, ask.now);
        let block_size = self.block_size();
        state.ranks.sync_order();
        let booked = ask.booking.is_some();
        let mut bound = ask.request.session_id.as_deref().and_then(|sid| {
            Self::session_binding(state, sid, allowed, booked, &config.sessions, now, facts)
        });
        let parent = Self::parent_binding(state, ask, allowed, bound, facts);
        let mut matches = LazyMatches(None);
        if !ask.exhaustive {
            let sparse = self.sparse_field(state, ask, allowed, bound, parent, &mut matches);
            if let Some(sparse) = sparse.map_err(|e| match e {
                // Over a busy threshold is saturation: with flow control the request waits.
                SelectError::Overloaded(_) if ask.admission.is_some() => Refusal::Saturated,
                e => Refusal::Error(e),
            })? {
                return Ok(Field {
                    block_size,
                    eligible: sparse.eligible,
                    candidates: sparse.candidates,
                    bound: sparse.bound,
                    parent,
                });
            }
        }
        let slots = &state.ranks.slots;
        let eligible =
            match self.eligible_ranks(slots, ask.request, allowed, &mut bound, config, now) {
                Ok(e) => e,
                // Over a busy threshold is saturation: with flow control the request waits.
                Err(SelectError::Overloaded(_)) if ask.admission.is_some() => {
                    return Err(Refusal::Saturated)
                }
                Err(e) => return Err(Refusal::Error(e)),
            };
        let matches = Self::expand(slots, matches.take(state, ask));
        let runs = self.shared_runs(state, ask);
        let shared = shared_tier::SharedView::of(runs.as_ref());
        let engine_view = pipeline::EngineView {
            now,
            max_age: config.engine_metrics_max_age,
            adapter: allowed.adapter,
            shared,
        };
        let candidates = pipeline::candidates(
            slots,
            &eligible,
            &matches,
            &state.estimator,
            block_size,
            &engine_view,
        );
        let mut field = Field {
            block_size,
            eligible,
            candidates,
            bound,
            parent,
        };
        if let Some(check) = ask.admission {
            check.meet_slo(state, ask, &mut field)?;
        }
        Ok(field)
    }

    /// A child session with no binding of its own (its first request, or its binding was
    /// dropped): the parent session's bound rank, when the parent has one that may serve this
    /// request. Read only: the parent's binding is never changed by a child's pick.
    fn parent_binding(
        state: &mut State,
        ask: &Ask,
        allowed: &Allowed,
        bound: Option<RankKey>,
        facts: &mut Facts,
    ) -> Option<RankKey> {
        if bound.is_some() {
            return None;
        }
        let request = ask.request;
        let parent = request
            .parent_session_id
            .as_deref()
            .filter(|p| request.session_id.as_deref().is_some_and(|s| s != *p))?;
        Self::session_binding(
            state,
            parent,
            allowed,
            false,
            &ask.config.sessions,
            ask.now,
            facts,
        )
    }

    /// The prompt's matches: the prefix every rank holds once, when the index can tell
    /// (every rank of the table is interned), and the ranks matching deeper.
    pub(super) fn matches(state: &State, ask: &Ask) -> crate::index::Matches {
        if ask.prompt.match_hashes().is_empty() {
            return crate::index::Matches::default();
        }
        if let (None, Some(remote)) = (ask.matches, &ask.request.remote_overlap) {
            return Self::remote_matches(state, remote, ask);
        }
        let all_interned = state.all_interned();
        if let Some(early) = ask.matches {
            // Read before the lock: good when it needs no rank the index did not know then
            // (told without the KV lock, which an insert or event may hold meanwhile).
            if early.base == 0 || (all_interned && early.epoch == state.index_epoch()) {
                return early.clone();
            }
        }
        let kv = state.kv_read();
        if all_interned {
            kv.index
                .find_matches_over(ask.prompt.match_hashes(), ask.now)
        } else {
            crate::index::Matches {
                base: 0,
                ranks: kv.index.find_matches(ask.prompt.match_hashes(), ask.now),
                epoch: kv.index.rank_epoch(),
            }
        }
    }

    /// A remote index's overlap (`SelectionRequest::remote_overlap`) in the local matches'
    /// form: the remote's depths, or this process's own predictions where deeper. The remote
    /// answer is one more source of the same input; the stages read it as they read the index.
    pub(super) fn remote_matches(
        state: &State,
        remote: &crate::request::RemoteOverlap,
        ask: &Ask,
    ) -> crate::index::Matches {
        let kv = state.kv_read();
        crate::index::Matches {
            base: 0,
            ranks: remote.merged_with(&kv.index.find_matches(ask.prompt.match_hashes(), ask.now)),
            epoch: kv.index.rank_epoch(),
        }
    }

    /// The prompt's matches read without the state lock (see [`Ask::matches`]); none for a
    /// request a hard-bound session will most likely keep on its rank (only that rank's
    /// overlap is needed then, [`super::sparse`]). Read inside the state lock instead, a pick
    /// waiting for an event's KV write lock would hold every other pick up: the scale benchmark
    /// collapsed that way in 3 of 10 runs (docs/benchmarks.md, concurrency).
    pub(super) fn early_matches(
        &self,
        request: &SelectionRequest,
        prompt: &PromptBlocks,
        config: &CoreConfig,
        now: Instant,
    ) -> Option<crate::index::Matches> {
        if let Some(remote) = &request.remote_overlap {
            // Every stage reads the remote's answer, so it is always handed over (base 0: it
            // needs no rank interned here).
            let kv = self.kv.read();
            return Some(crate::index::Matches {
                base: 0,
                ranks: remote.merged_with(&kv.index.find_matches(prompt.match_hashes(), now)),
                epoch: kv.index.rank_epoch(),
            });
        }
        let hard_session = request.session_id.is_some()
            && request.fallbacks == 0
            && config.sessions.mode == crate::session::AffinityMode::Hard;
        (!prompt.match_hashes().is_empty() && !hard_session).then(|| {
            self.kv
                .read()
                .index
                .find_matches_over(prompt.match_hashes(), now)
        })
    }

    /// Every rank's matched depths in rank order (the full path's form): the listed ranks, and
    /// the shared prefix for every other rank.
    fn expand(
        slots: &[(RankKey, Slot)],
        matches: crate::index::Matches,
    ) -> Vec<(RankKey, TierDepths)> {
        if matches.base == 0 {
            return matches.ranks;
        }
        let base = TierDepths {
            gpu: matches.base,
            host: matches.base,
            disk: matches.base,
        };
        let mut deeper = matches.ranks.into_iter().peekable();
        slots
            .iter()
            .map(|(key, _)| {
                while deeper.peek().is_some_and(|(k, _)| k < key) {
                    deeper.next();
                }
                match deeper.peek() {
                    Some((k, d)) if k == key => (*key, *d),
                    _ => (*key, base),
                }
            })
            .collect()
    }

    /// Stage 4: the decision, one rank ([`pipeline::rank`]) or a prefill/decode pair's decode
    /// side ([`pair::decide_pair`]), then session affinity on it.
    pub(super) fn decide(
        state: &mut State,
        ask: &Ask,
        field: &mut Field,
    ) -> Result<Decided, Refusal> {
        let slots = &state.ranks.slots;
        let (mut decision, roles) = if state.ranks.split_roles {
            let (decision, roles) = pair::decide_pair(
                slots,
                &field.eligible,
                &field.candidates,
                field.block_size,
                ask.config,
                &mut field.bound,
                &mut state.rng,
            )?;
            (decision, Some(roles))
        } else {
            let decision = pipeline::rank(
                &field.candidates,
                ask.prompt,
                field.block_size,
                ask.request,
                ask.config,
                &mut state.rng,
            );
            (decision, None)
        };
        let affinity = pipeline::apply_affinity(
            &mut decision,
            &field.candidates,
            field.bound,
            &ask.config.sessions,
        );
        let parent = field
            .parent
            .filter(|_| affinity == Affinity::Unbound)
            .map(|p| {
                pipeline::prefer_parent(&mut decision, &field.candidates, p, &ask.config.sessions)
            });
        Ok(Decided {
            decision,
            roles,
            affinity,
            parent,
        })
    }

    /// Stage 5: with flow control, dispatch now or wait ([`pipeline::dispatch_or_wait`]); then
    /// the prefill side of a split decision, never a saturated prefill rank under flow control.
    pub(super) fn flow_gate(
        state: &mut State,
        ask: &Ask,
        field: &Field,
        decided: &mut Decided,
    ) -> Result<Option<PrefillChoice>, Refusal> {
        let config = ask.config;
        let saturation = ask.admission.map(|_| pipeline::SaturationView {
            slots: &state.ranks.slots,
            eligible: &field.eligible,
            estimator: &state.estimator,
            limits: &config.flow.saturation,
            now: ask.now,
            max_age: config.engine_metrics_max_age,
        });
        if let Some(view) = &saturation {
            pipeline::dispatch_or_wait(ask, field, decided, view)?;
        }
        pair::prefill_for(ask, field, decided, &mut state.rng, saturation.as_ref())
    }

    /// Stage 6: the picked ranks (primary, fallbacks, prefill) and what the booking needs of
    /// them: overlap, cost, the tokens the first token waits for and the predicted TTFT.
    fn pick(
        state: &State,
        ask: &Ask,
        field: &Field,
        decided: &Decided,
        prefill: Option<PrefillChoice>,
    ) -> Result<Picked, Refusal> {
        let (slots, block_size) = (&state.ranks.slots, field.block_size);
        let (eligible, candidates) = (&field.eligible, &field.candidates);
        let ranking = &decided.decision.ranking;
        let (primary, fallbacks) =
            pipeline::picked_ranks(slots, eligible, ranking, ask.request.fallbacks).ok_or_else(
                || Refusal::Error(SelectError::Unavailable("no candidate left".into())),
            )?;
        let best = ranking.first().copied().unwrap_or_default();
        // The first token waits for the rank that prefills: the prefill rank when split.
        let prefilling = prefill.map_or(best, |p| p.position);
        let ttft_tokens = candidates.get(prefilling).map_or(0.0, |c| {
            crate::decide::ttft_blocks(c, ask.prompt.tokens, block_size, &ask.config.cost)
                * f64::from(block_size)
        });
        let prefill = prefill.and_then(|p| {
            let candidate = candidates.get(p.position)?;
            let picked = pipeline::picked(slots, *eligible.get(p.position)?)?;
            Some((picked, candidate.overlap))
        });
        let predicted_ttft = state.estimator.predict(
            &prefill.as_ref().map_or(primary.key, |(p, _)| p.key),
            ttft_tokens,
        );
        Ok(Picked {
            overlap: candidates.get(best).map(|c| c.overlap).unwrap_or_default(),
            cost: decided
                .decision
                .costs
                .get(best)
                .copied()
                .unwrap_or_default(),
            primary,
            fallbacks,
            ttft_tokens,
            predicted_ttft,
            prefill,
        })
    }

    /// Stage 7: books the pick when the request is booked ([`Partition::book`]); a dry run only
    /// reports whether the session's binding was kept.
    fn book_pick(
        &self,
        state: &mut State,
        ask: &Ask,
        field: &Field,
        picked: &Picked,
        affinity: Affinity,
        facts: &mut Facts,
    ) -> Option<SessionOutcome> {
        let Some((booking_id, generation)) = ask.booking else {
            return (affinity == Affinity::Kept).then_some(SessionOutcome::Reused);
        };
        let pick = Pick {
            booking_id,
            generation,
            rank: picked.primary.key,
            overlap: picked.overlap,
            prompt: ask.prompt,
            block_size: field.block_size,
            ttft_tokens: picked.ttft_tokens,
            predicted_ttft: picked.predicted_ttft,
            prefill: picked
                .prefill
                .as_ref()
                .map(|(p, overlap)| (p.key, *overlap)),
        };
        self.book(state, ask, &pick, affinity, facts)
    }

    /// The answer: the picked ranks, the prompt's overlap and the session's outcome.
    fn selection(
        &self,
        ask: &Ask,
        field: &Field,
        picked: Picked,
        session: Option<SessionOutcome>,
    ) -> Selection {
        let shared_blocks = field
            .candidates
            .iter()
            .find(|c| c.key == picked.primary.key)
            .map_or(0, |c| c.shared_blocks);
        Selection {
            booking_id: ask
                .booking
                .map(|(id, _)| id)
                .unwrap_or_default()
                .to_string(),
            generation: ask.booking.map_or(0, |(_, g)| g),
            partition: (*self.key).clone(),
            primary: picked.primary,
            fallbacks: picked.fallbacks,
            prefill: picked.prefill.map(|(p, _)| p),
            overlap_blocks: picked.overlap.gpu,
            predicted_cached_tokens: u64::from(picked.overlap.gpu)
                .saturating_mul(u64::from(field.block_size))
                .min(ask.prompt.tokens),
            prompt_blocks: ask.prompt.seq_hashes.len() as u32,
            prompt_tokens: ask.prompt.tokens,
            cost: picked.cost,
            session,
            candidates: field.candidates.len() as u32,
            predicted_ttft_seconds: picked.predicted_ttft,
            scores: Vec::new(),
            shared_blocks,
            transfer: None,
        }
    }

    /// The session's bound rank if it may serve this request. An invalid binding is dropped
    /// when the request will be booked (a dry-run `select` changes nothing).
    pub(super) fn session_binding(
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
    pub(super) fn eligible_ranks(
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

    /// Per schedulable rank: the prompt's matched depths, over the blocks an engine can reuse
    /// ([`pipeline::reusable_blocks`]); the count returned is every complete block.
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
        let matches: HashMap<RankKey, TierDepths> = self
            .kv
            .read()
            .index
            .find_matches(prompt.match_hashes(), now)
            .into_iter()
            .collect();
        let state = self.lock_state();
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
