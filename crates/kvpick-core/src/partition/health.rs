//! How a picked rank answered, on the partition (ARCHITECTURE.md §3b): the response's class
//! feeds the rank's outlier detection ([`crate::outlier`]), marks a failed booking so its first
//! byte is no TTFT sample, SLO or TPOT start, and takes back the index entries the pick predicted
//! on ranks that never computed them: after any answer but a 2xx, and after a stream that ended
//! before its first response byte (a 2xx's headers included: the engine may have aborted the
//! prefill). It also owns what a booking predicted ([`Predicted`]), how long a pick's predictions live
//! ([`prediction_life`]) and how they end.
//!
//! The host's view of the engine itself comes in here too: a rank reported unreachable (its KV
//! events lost and its endpoint refusing connections, or a refused scrape) takes no picks until it
//! is reported reachable again; its index entries stay (whether they are still true is decided
//! when the engine is seen again, by the host, which clears the rank if it restarted).
//!
//! It owns no state of its own: the health is each rank's [`super::ranks::Slot`], the marks are
//! the booking's. It must not free bookings or touch the queue: the core does, as for any
//! operation.

use std::sync::Arc;
use std::time::Instant;

use crate::config::CoreConfig;
use crate::facts::{Fact, Facts, ResponseClass};
use crate::outlier::{HealthEvent, OutlierConfig, RankHealth};
use crate::request::Holder;
use crate::types::RankKey;

use super::ranks::Slot;
use super::{BookingRef, Partition, State};

/// What a pick predicted on one rank it booked: the prompt's chained hashes (shared with the
/// deferred insert, not copied) from the first block the rank was not credited with. A precise
/// rank's predicted entries live until its engine's KV events confirm them (they turn permanent)
/// or the request ends ([`end`]: the unconfirmed ones go); an approximate rank's live
/// `approx_ttl` (nothing confirms them) and only a failure takes them back ([`withdraw`]).
#[derive(Debug, Clone)]
pub(crate) struct PredictedChain {
    pub rank: RankKey,
    pub hashes: Arc<[u64]>,
    pub from: usize,
    pub precise: bool,
}

/// Per booked rank (the decode rank, then a split pick's prefill rank), what its pick predicted
/// there; `None` when the rank was already credited with the whole prompt. A booking keeps its
/// prompt's hashes until it ends (8 bytes a block, shared with the pick's insert).
pub(crate) type Predicted = [Option<PredictedChain>; 2];

/// What a pick predicted on `rank`, credited with `cached` blocks of `hashes`.
pub(crate) fn predicted_on(
    rank: RankKey,
    hashes: &Arc<[u64]>,
    cached: u32,
    precise: bool,
) -> Option<PredictedChain> {
    let from = usize::try_from(cached).ok()?;
    (from < hashes.len()).then(|| PredictedChain {
        rank,
        hashes: Arc::clone(hashes),
        from,
        precise,
    })
}

/// Whether a pick's entries on `slot`'s rank are precise (its engine's KV events apply: they
/// live until the events confirm them or the request ends, [`end`]) or approximate
/// (they live `approx_ttl`), and when the index lets them expire. A precise prediction's expiry
/// is only a bound (`predicted_ttl`, by default as long as an unfreed API booking lives) for a
/// booking whose end never comes: the request's own life is what ends it, so a 4 s prefill or a
/// minute of decode keeps it and an engine that never confirms it loses it at the request's end.
pub(crate) fn prediction_life(
    slot: &Slot,
    config: &CoreConfig,
    now: Instant,
) -> (bool, Option<Instant>) {
    let precise = config.kv_events && slot.kv_events && slot.events_seen;
    let ttl = if precise {
        config.predicted_ttl
    } else {
        config.approx_ttl
    };
    (precise, now.checked_add(ttl))
}

/// Only a stream's booking may probe a half-open rank: its host reports the answer. The API
/// reports none, and a probe that never answers would hold the rank out until it expires.
pub(crate) fn may_probe(holder: Holder) -> bool {
    holder == Holder::Stream
}

/// Takes back a failed request's predicted entries, precise or approximate; entries its
/// engine's KV events confirmed (permanent) stay. Written with the deferred predictions.
fn withdraw(state: &State, predicted: &mut Predicted) {
    for chain in predicted.iter_mut().filter_map(Option::take) {
        state.unpredict(chain);
    }
}

/// Ends what a request predicted on one rank (the request ended, or its prefill leg did): a
/// precise rank's entries its engine has not confirmed expire the partition's end grace later
/// ([`super::grace`]: a second, longer while its KV events arrive late), since a finished
/// prefill stored the blocks and their events say so; an approximate rank's stay for
/// `approx_ttl`, the only knowledge of that rank's cache.
pub(crate) fn end(state: &State, chain: Option<PredictedChain>, now: Instant) {
    if let Some(chain) = chain.filter(|c| c.precise) {
        let at = now.checked_add(state.end_grace()).unwrap_or(now);
        state.end_prediction(chain, at);
    }
}

impl Partition {
    /// Records the first answer for a booking; false when the booking is not here or was
    /// answered already (only the first answer counts; a reset after a 2xx's headers and before
    /// its first byte still takes back the prediction).
    pub(crate) fn record_response(
        &self,
        booking: &BookingRef,
        class: ResponseClass,
        config: &CoreConfig,
        now: Instant,
        facts: &mut Facts,
    ) -> bool {
        let mut guard = self.lock_state();
        let answered = Self::answer(&mut guard, booking, class, config, now, facts);
        // The withdrawn entries are written at the release, which reports the index's size.
        guard.unlock(facts);
        answered
    }

    fn answer(
        state: &mut State,
        booking: &BookingRef,
        class: ResponseClass,
        config: &CoreConfig,
        now: Instant,
        facts: &mut Facts,
    ) -> bool {
        let Some(b) = state.booking_mut(booking) else {
            return false;
        };
        let withdraws = class != ResponseClass::Success;
        if b.answered {
            if withdraws && !b.failed && b.first_token.is_none() {
                let mut predicted = std::mem::take(&mut b.predicted);
                withdraw(state, &mut predicted);
            }
            return false;
        }
        b.answered = true;
        b.failed = withdraws;
        let (rank, probe) = (b.rank, b.probe);
        let mut predicted = if withdraws {
            std::mem::take(&mut b.predicted)
        } else {
            Predicted::default()
        };
        withdraw(state, &mut predicted);
        // Only a failure can eject, and counting the ejected ranks walks the whole table: a
        // success (nearly every answer) must not pay for it at thousands of ranks.
        let may_eject = class == ResponseClass::ServerError && may_eject(state, &config.outlier);
        let Some(slot) = state.ranks.get_mut(&rank) else {
            return true;
        };
        facts.push(Fact::UpstreamResponse {
            worker: slot.worker_name.clone(),
            dp_rank: rank.dp_rank,
            class,
        });
        let event = judge(
            &mut slot.health,
            class,
            probe,
            may_eject,
            &config.outlier,
            now,
        );
        if let Some(event) = event {
            facts.push(Fact::Outlier {
                worker: slot.worker_name.clone(),
                dp_rank: rank.dp_rank,
                event,
            });
            match event {
                HealthEvent::Ejected => facts.push(Fact::EjectedRanks(1)),
                HealthEvent::Returned => facts.push(Fact::EjectedRanks(-1)),
                HealthEvent::Reejected => {}
            }
        }
        true
    }
}

impl Partition {
    /// Marks a rank's engine reachable or not; true when that changed. An unreachable rank is not
    /// schedulable (every stage reads `schedulable`); its bookings, sessions (they move at their
    /// next request) and index entries stay.
    pub(crate) fn set_reachable(&self, rank: RankKey, reachable: bool, facts: &mut Facts) -> bool {
        let mut guard = self.lock_state();
        let state = &mut *guard;
        let Some(slot) = state.ranks.get_mut(&rank) else {
            return false;
        };
        if slot.reachable == reachable {
            return false;
        }
        slot.reachable = reachable;
        slot.refresh_schedulable();
        facts.push(Fact::RankReachable {
            worker: slot.worker_name.clone(),
            dp_rank: rank.dp_rank,
            reachable,
        });
        let n = state.ranks.values().filter(|s| s.schedulable).count();
        self.schedulable
            .store(n, std::sync::atomic::Ordering::Relaxed);
        true
    }
}

/// Whether one more rank may be ejected: under the cap of the partition's schedulable ranks.
fn may_eject(state: &State, outlier: &OutlierConfig) -> bool {
    let slots = &state.ranks.slots;
    let ejected = slots.iter().filter(|(_, s)| s.health.is_ejected()).count();
    let schedulable = slots.iter().filter(|(_, s)| s.schedulable).count();
    ejected < outlier.max_ejected(schedulable)
}

/// The answer's verdict on the rank's health: a 2xx or 4xx counts as a success, a 5xx as a
/// failure, a reset as none (but an unanswered probe lets another one go).
fn judge(
    health: &mut RankHealth,
    class: ResponseClass,
    probe: bool,
    may_eject: bool,
    outlier: &OutlierConfig,
    now: Instant,
) -> Option<HealthEvent> {
    match class {
        ResponseClass::Success | ResponseClass::ClientError => {
            health.on_success(now, outlier, probe)
        }
        ResponseClass::ServerError => health.on_failure(now, outlier, may_eject, probe),
        ResponseClass::Reset => {
            // No answer is no verdict on the engine (the client may have gone), but a probe
            // without one must not hold the rank out forever.
            if probe {
                health.probe_abandoned(now);
            }
            None
        }
    }
}
