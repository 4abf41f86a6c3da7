//! How a picked rank answered, on the partition (ARCHITECTURE.md §3b): the response's class
//! feeds the rank's outlier detection ([`crate::outlier`]), marks a failed booking so its first
//! byte is no TTFT sample, SLO or TPOT start, and takes back the index entries the pick predicted
//! on ranks that never computed them: after any answer but a 2xx, and after a stream that ended
//! before its first response byte (a 2xx's headers included: the engine may have aborted the
//! prefill).
//!
//! The host's view of the engine itself comes in here too: a rank reported unreachable (its KV
//! events lost and its endpoint refusing connections, or a refused scrape) takes no picks until it
//! is reported reachable again; its index entries stay (whether they are still true is decided
//! when the engine is seen again, by the host, which clears the rank if it restarted).
//!
//! It owns no state of its own: the health is each rank's [`super::ranks::Slot`], the marks are
//! the booking's. It must not free bookings or touch the queue: the core does, as for any
//! operation.

use std::time::Instant;

use crate::config::CoreConfig;
use crate::facts::{Fact, Facts, ResponseClass};
use crate::index::Tier;
use crate::outlier::{HealthEvent, OutlierConfig, RankHealth};
use crate::request::Holder;
use crate::types::RankKey;

use super::{BookingRef, Partition, Pick, State};

/// Per booked rank (the decode rank, then a split pick's prefill rank), the first prompt block
/// its pick inserted as a new predicted entry; `None` when the rank already cached the whole
/// prompt. Taking that one entry back cuts the rank's predicted chain for every later match
/// (a match is the longest consecutive prefix of chained hashes); the unreachable blocks after
/// it expire with their TTL. So a booking keeps two hashes, never its prompt's.
pub(crate) type Predicted = [Option<(RankKey, u64)>; 2];

/// What `pick` newly predicted, per booked rank.
pub(crate) fn predicted(pick: &Pick) -> Predicted {
    let first_new = |rank: RankKey, cached: u32| {
        let at = usize::try_from(cached).ok()?;
        pick.prompt.seq_hashes.get(at).map(|&h| (rank, h))
    };
    [
        first_new(pick.rank, pick.overlap.gpu),
        pick.prefill
            .and_then(|(rank, overlap)| first_new(rank, overlap.gpu)),
    ]
}

/// Only a stream's booking may probe a half-open rank: its host reports the answer. The API
/// reports none, and a probe that never answers would hold the rank out until it expires.
pub(crate) fn may_probe(holder: Holder) -> bool {
    holder == Holder::Stream
}

/// Takes back a failed request's predicted entries; entries its engine's KV events confirmed
/// (permanent) stay.
fn withdraw(state: &mut State, predicted: &mut Predicted) -> bool {
    let mut dropped = false;
    for (rank, hash) in predicted.iter_mut().filter_map(Option::take) {
        dropped |= state.kv_write().index.drop_expiring(rank, hash, Tier::Gpu);
    }
    dropped
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
        let state = &mut *guard;
        let Some(b) = state.booking_mut(booking) else {
            return false;
        };
        let withdraws = class != ResponseClass::Success;
        if b.answered {
            if withdraws && !b.failed && b.first_token.is_none() {
                let mut predicted = std::mem::take(&mut b.predicted);
                if withdraw(state, &mut predicted) {
                    facts.push(self.index_fact(state, None));
                }
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
        if withdraw(state, &mut predicted) {
            facts.push(self.index_fact(state, None));
        }
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
