//! Bookings: installing a pick (its load, session lease, predicted blocks and prefill leg), the
//! request's life after the pick (prefill complete, first token, decode complete, free, move,
//! expiry) and what each gives back. It must not choose ranks ([`super::select`]) or apply KV
//! events ([`super::events`]).

#![warn(clippy::arithmetic_side_effects)]

use super::*;

impl Booking {
    /// Prefill tokens this booking still adds to its rank's queue.
    pub(super) fn queued_prefill(&self) -> u64 {
        if self.prefill_complete {
            0
        } else {
            self.prefill_tokens
        }
    }
}

impl Booking {
    /// The booking of a pick: its load on the rank (uncached prefill tokens, unless a prefill
    /// leg prefills them, and its decode blocks) and what its first token is checked against.
    fn for_pick(
        request: &SelectionRequest,
        pick: &Pick,
        leg: Option<pair::PrefillLeg>,
        session: Option<String>,
        now: Instant,
    ) -> Booking {
        let block_size = u64::from(pick.block_size.max(1));
        let tokens = pick.prompt.tokens;
        let cached_tokens = u64::from(pick.overlap.gpu)
            .saturating_mul(block_size)
            .min(tokens);
        Booking {
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
            session,
            priority: request.priority,
            slo_ttft: request.slo_ttft_ms.map(|ms| ms as f64 / 1000.0),
            slo_tpot: request.slo_tpot_ms.map(|ms| ms as f64 / 1000.0),
            first_token: None,
            prefill: leg,
            prefill_rank_gone: false,
            failed: false,
            answered: false,
            probe: false,
            predicted: Default::default(),
            reconciled: false,
        }
    }
}

impl Partition {
    /// The last stage: binds or reuses the session, installs the booking and its load, and
    /// predicts the prompt's blocks (predicted or approximate entries) for the picked rank,
    /// written to the index once the state lock is released ([`super::deferred`]).
    pub(super) fn book(
        &self,
        state: &mut State,
        ask: &Ask,
        pick: &Pick,
        affinity: Affinity,
        facts: &mut Facts,
    ) -> Option<SessionOutcome> {
        let (request, config, now) = (ask.request, ask.config, ask.now);
        let (outcome, leased_session) = Self::bind_session(state, ask, pick, affinity, facts);
        // One copy of the prompt's hashes, shared by the deferred inserts and the booking.
        let chain: Arc<[u64]> = Arc::from(pick.prompt.seq_hashes.as_slice());
        let leg = pair::book_leg(state, ask, pick, &chain, facts);
        let (leg, leg_predicted) = leg.map_or((None, None), |(l, p)| (Some(l), p));
        let mut booking = Booking::for_pick(request, pick, leg, leased_session, now);
        booking.predicted[1] = leg_predicted;
        let Some(slot) = state.ranks.get_mut(&pick.rank) else {
            pair::unbook_leg(state, booking.prefill.as_ref(), facts);
            // Never booked: the leg's prediction goes, approximate or not.
            if let Some(chain) = booking.predicted[1].take() {
                state.unpredict(chain);
            }
            return outcome;
        };
        slot.add_load(booking.prefill_tokens, booking.decode_blocks);
        if booking.holder == Holder::Api {
            slot.api_bookings = slot.api_bookings.saturating_add(1);
        }
        let (precise, expires) = health::prediction_life(slot, config, now);
        facts.push(load_fact(slot, pick.rank));
        facts.push(Fact::Inflight(1));
        // Only a stream reports its answer: an API booking never takes a half-open rank's probe.
        booking.probe = health::may_probe(request.holder) && slot.health.on_booked(now);
        booking.predicted[0] = health::predicted_on(pick.rank, &chain, pick.overlap.gpu, precise);
        Self::schedule_decay(state, pick.booking_id, &booking, config);
        state.bookings.insert(pick.booking_id.to_string(), booking);
        if !chain.is_empty() {
            // Written once the state lock is released ([`super::deferred`]).
            state.predict(pick.rank, &chain, expires);
            facts.push(Fact::PredictedOverlap(
                f64::from(pick.overlap.gpu) / chain.len() as f64,
            ));
        }
        outcome
    }

    /// The session part of booking: reuse, bind (evicting the longest-idle binding when full) or
    /// route unpinned when the table is full of leased sessions; returns the outcome and the
    /// session whose lease the booking holds.
    pub(super) fn bind_session(
        state: &mut State,
        ask: &Ask,
        pick: &Pick,
        affinity: Affinity,
        facts: &mut Facts,
    ) -> (Option<SessionOutcome>, Option<String>) {
        let (request, rank) = (ask.request, pick.rank);
        // A request without a prompt (`GET /v1/models`, header-only) holds no KV cache: it may
        // follow a binding but never creates one, so it cannot fill the table.
        let may_bind = affinity == Affinity::Kept || pick.prompt.present;
        if let Some(sid) = request
            .session_id
            .as_deref()
            .filter(|_| request.session_final)
        {
            // The session's last request (Dynamo's `x-dynamo-session-final`): it was routed on
            // the binding (when it had one); the binding goes now rather than idling out, and
            // this request holds no lease on it.
            Self::invalidate_session(state, sid, Invalidation::Final, facts);
            facts.push(Fact::Session(SessionOutcome::Released));
            return (Some(SessionOutcome::Released), None);
        }
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
                .bind(sid, rank, ask.now, ask.config.sessions.max_entries)
            {
                Bound::Yes { created, evicted } => {
                    binding_facts(created, evicted, facts);
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

    pub(super) fn invalidate_session(
        state: &mut State,
        sid: &str,
        reason: Invalidation,
        facts: &mut Facts,
    ) {
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

    /// Ends a booking: its session lease, its load and its precise predictions.
    pub(super) fn release(state: &mut State, booking: &Booking, now: Instant, facts: &mut Facts) {
        for chain in &booking.predicted {
            health::end(state, chain.clone(), now);
        }
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
    pub(super) fn unload(state: &mut State, booking: &Booking, facts: &mut Facts) {
        if let Some(slot) = state.ranks.get_mut(&booking.rank) {
            if booking.holder == Holder::Api {
                slot.api_bookings = slot.api_bookings.saturating_sub(1);
            }
            // A reconciled booking's load already left the rank (and the in-flight count).
            if booking.loaded() {
                slot.remove_load(booking.queued_prefill(), booking.decode_blocks);
                facts.push(load_fact(slot, booking.rank));
                facts.push(Fact::Inflight(-1));
            }
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
        let mut guard = self.lock_state();
        let state = &mut *guard;
        let id = &booking.0;
        // The field, not `State::booking_mut`: the rank table and estimator are borrowed too.
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
                // The prefill rank's part is over: what it computed is stored (and announced).
                let leg_chain = booking.predicted[1].take();
                pair::unbook_leg(state, Some(&leg), facts);
                health::end(state, leg_chain, now);
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
        let mut guard = self.lock_state();
        let state = &mut *guard;
        let Some(b) = state.booking(booking) else {
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
        let mut state = self.lock_state();
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
        let mut guard = self.lock_state();
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
        // The session lease moves with the booking; only the load changes rank. What the pick
        // predicted on the rank that did not serve it goes, approximate or precise.
        Self::unload(state, &booking, facts);
        let mut booking = booking;
        if let Some(chain) = booking.predicted[0].take() {
            state.unpredict(chain);
        }
        let Some(slot) = state.ranks.get_mut(&target) else {
            return false;
        };
        if booking.loaded() {
            slot.add_load(booking.queued_prefill(), booking.decode_blocks);
            facts.push(load_fact(slot, target));
            facts.push(Fact::Inflight(1));
        }
        if booking.holder == Holder::Api {
            slot.api_bookings = slot.api_bookings.saturating_add(1);
        }
        state.bookings.insert(
            booking_id.clone(),
            Booking {
                rank: target,
                ..booking
            },
        );
        true
    }

    /// One purge step while the index still lists cleared ranks' holders (KV side only: picks
    /// and the state lock are not held up); false when there is nothing to sweep.
    pub fn sweep_cleared(&self, now: Instant) -> bool {
        if self.kv.read().index.retiring_ranks() == 0 {
            return false;
        }
        self.kv.write().index.purge_expired_step(now);
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
        let mut guard = self.lock_state();
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
        state.kv_write().index.purge_expired_step(now);
        let idle = state.sessions.reap(now, ttl_sessions);
        facts.push(Fact::SessionsLive(negative(idle as u64)));
        facts.push(Fact::SessionsExpired(idle as u64));
        let bytes = {
            let kv = state.kv_read();
            let engine_bytes: usize = kv
                .engines
                .values()
                .map(|m| engine_map_bytes(m.entries.capacity()))
                .fold(0usize, usize::saturating_add);
            kv.index.heap_bytes().saturating_add(engine_bytes)
        };
        facts.push(self.index_fact(state, Some(bytes)));
        expired
    }
}
