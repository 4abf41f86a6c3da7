//! Bookings the engine cannot be working on (ARCHITECTURE.md §3, "Held bookings"): a booking's
//! prefill that has run past its expected time without a first byte stops counting toward its
//! rank's load (its request slot and KV blocks stay), and bookings a rank's engine has not shown
//! for a sustained period are taken off the rank's load altogether (reconciled). Either way the
//! booking stays in the table for its stream (or the API's `Free`, or expiry) to free, and that
//! release takes off only what is still on the rank: releases stay idempotent, loads never go
//! negative. It must not choose ranks or free bookings.

use std::cmp::Reverse;

use super::*;

/// When each booked prefill stops counting: (deadline, generation, booking id), earliest first.
/// A booking freed or completed before its deadline leaves its entry behind; the entry is
/// skipped when it comes due (its generation no longer matches, or its prefill is done), so
/// the heap holds at most the bookings of the last expected-prefill window.
pub(super) type PrefillDeadlines = std::collections::BinaryHeap<Reverse<(Instant, u64, String)>>;

impl Booking {
    /// The booking's load is on its rank (not reconciled away).
    pub(super) fn loaded(&self) -> bool {
        !self.reconciled
    }
}

impl Partition {
    /// [`Partition::decay_due`] under the partition's lock.
    pub fn decay_bookings(&self, now: Instant, facts: &mut Facts) -> u64 {
        let mut guard = self.lock_state();
        let decayed = Self::decay_due(&mut guard, now, facts);
        guard.unlock(facts);
        decayed
    }

    /// Schedules the decay of a just-booked prefill: `max(predicted × margin, floor)` after its
    /// pick. A booking with nothing to prefill (fully cached, or a split pick's decode side
    /// without a leg to decay) needs none.
    pub(super) fn schedule_decay(
        state: &mut State,
        id: &str,
        booking: &Booking,
        config: &CoreConfig,
    ) {
        let leg_tokens = booking.prefill.map_or(0, |l| l.prefill_tokens);
        if booking.prefill_tokens == 0 && leg_tokens == 0 {
            return;
        }
        let expected = config.bookings.expected_prefill(booking.predicted_ttft);
        let Some(deadline) = booking.created.checked_add(expected) else {
            return;
        };
        state
            .prefill_deadlines
            .push(Reverse((deadline, booking.generation, id.to_string())));
    }

    /// Takes the prefill of every booking whose deadline has passed at `now` off its rank (and
    /// off a split pick's prefill rank); O(1) when none is due. Returns how many decayed.
    pub(super) fn decay_due(state: &mut State, now: Instant, facts: &mut Facts) -> u64 {
        let mut decayed = 0u64;
        while let Some(Reverse((deadline, generation, _))) = state.prefill_deadlines.peek() {
            if *deadline > now {
                break;
            }
            let generation = *generation;
            let Some(Reverse((_, _, id))) = state.prefill_deadlines.pop() else {
                break;
            };
            if Self::decay_one(state, &id, generation, facts) {
                decayed = decayed.saturating_add(1);
            }
        }
        if decayed > 0 {
            facts.push(Fact::BookingsDecayed(decayed));
        }
        decayed
    }

    /// One booking's prefill stops counting; false when it is gone or its prefill is over.
    fn decay_one(state: &mut State, id: &str, generation: u64, facts: &mut Facts) -> bool {
        let Some(booking) = state
            .bookings
            .get_mut(id)
            .filter(|b| b.generation == generation && !b.prefill_complete)
        else {
            return false;
        };
        // Zeroed, not flagged: the first byte, a move and the release all take off
        // `queued_prefill()`, which is then nothing.
        let tokens = std::mem::take(&mut booking.prefill_tokens);
        let loaded = booking.loaded();
        let rank = booking.rank;
        let leg = booking.prefill.as_mut().map(|leg| {
            let tokens = std::mem::take(&mut leg.prefill_tokens);
            (leg.rank, tokens)
        });
        if tokens == 0 && leg.is_none_or(|(_, t)| t == 0) {
            return false;
        }
        if loaded && tokens > 0 {
            if let Some(slot) = state.ranks.get_mut(&rank) {
                slot.remove_load(tokens, 0);
                // `remove_load` also takes a request: the booking keeps its slot.
                slot.load.active_requests = slot.load.active_requests.saturating_add(1);
                facts.push(load_fact(slot, rank));
            }
        }
        if let Some((leg_rank, leg_tokens)) = leg.filter(|(_, t)| *t > 0) {
            if let Some(slot) = state.ranks.get_mut(&leg_rank) {
                slot.load.active_prefill_tokens =
                    slot.load.active_prefill_tokens.saturating_sub(leg_tokens);
                facts.push(load_fact(slot, leg_rank));
            }
        }
        true
    }

    /// A fresh engine reading of `key`: when the rank has shown fewer requests (running +
    /// waiting) than it has booked on every reading for `reconcile_after`, its oldest bookings
    /// (each at least that old) are taken off its load until what is booked is what the engine
    /// shows. Returns how many were reconciled.
    pub(super) fn reconcile(
        state: &mut State,
        key: RankKey,
        reading: &crate::engine::EngineMetrics,
        config: &CoreConfig,
        facts: &mut Facts,
    ) -> u64 {
        let Some(after) = config.bookings.reconcile_after else {
            return 0;
        };
        let now = reading.at;
        let shown = reading.running.saturating_add(reading.waiting);
        let Some(slot) = state.ranks.get_mut(&key) else {
            return 0;
        };
        let booked = slot.total_load().active_requests;
        if booked <= shown {
            slot.engine_short_since = None;
            return 0;
        }
        let since = *slot.engine_short_since.get_or_insert(now);
        if now.saturating_duration_since(since) < after {
            return 0;
        }
        let excess = booked.saturating_sub(shown);
        // Only here, when a rank has been short for the whole window, are the bookings walked.
        let mut old: Vec<(Instant, String)> = state
            .bookings
            .iter()
            .filter(|(_, b)| {
                b.rank == key && b.loaded() && now.saturating_duration_since(b.created) >= after
            })
            .map(|(id, b)| (b.created, id.clone()))
            .collect();
        old.sort_unstable();
        let mut reconciled = 0u64;
        for (_, id) in old
            .into_iter()
            .take(usize::try_from(excess).unwrap_or(usize::MAX))
        {
            let Some(booking) = state.bookings.get_mut(&id) else {
                continue;
            };
            booking.reconciled = true;
            let (prefill, blocks) = (booking.queued_prefill(), booking.decode_blocks);
            booking.prefill_tokens = 0;
            if let Some(slot) = state.ranks.get_mut(&key) {
                slot.remove_load(prefill, blocks);
                facts.push(load_fact(slot, key));
            }
            facts.push(Fact::Inflight(-1));
            reconciled = reconciled.saturating_add(1);
        }
        if let Some(slot) = state.ranks.get_mut(&key) {
            // A new window starts: what is still booked must stay unseen as long again.
            slot.engine_short_since = None;
        }
        if reconciled > 0 {
            facts.push(Fact::BookingsReconciled(reconciled));
        }
        reconciled
    }
}
