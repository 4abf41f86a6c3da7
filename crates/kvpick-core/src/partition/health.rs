//! How a picked rank answered, on the partition (ARCHITECTURE.md §3b): the response's class
//! feeds the rank's outlier detection ([`crate::outlier`]), marks a failed booking so its first
//! byte is no TTFT sample, SLO or TPOT start, and drops the index entries the pick predicted on a
//! rank that never computed them.
//!
//! It owns no state of its own: the health is each rank's [`super::ranks::Slot`], the marks are
//! the booking's. It must not free bookings or touch the queue: the core does, as for any
//! operation.

use std::time::Instant;

use crate::config::CoreConfig;
use crate::facts::{Fact, Facts, ResponseClass};
use crate::index::Tier;
use crate::outlier::HealthEvent;

use super::{BookingRef, Partition};

impl Partition {
    /// Records the first answer for a booking; false when the booking is not here or was
    /// answered already (only the first answer counts).
    pub(crate) fn record_response(
        &self,
        booking: &BookingRef,
        class: ResponseClass,
        config: &CoreConfig,
        now: Instant,
        facts: &mut Facts,
    ) -> bool {
        let mut guard = self.state.lock();
        let state = &mut *guard;
        let Some(b) = state
            .bookings
            .get_mut(&booking.0)
            .filter(|b| b.generation == booking.1 && !b.answered)
        else {
            return false;
        };
        b.answered = true;
        b.failed = class != ResponseClass::Success;
        let (rank, probe) = (b.rank, b.probe);
        let failed_engine = matches!(class, ResponseClass::ServerError | ResponseClass::Reset);
        if let Some(blocks) = b.new_blocks.take().filter(|_| failed_engine) {
            for hash in blocks.iter() {
                state.index.remove(rank, *hash, Tier::Gpu);
            }
            facts.push(self.index_fact(state, None));
        }
        let ejected = state
            .ranks
            .slots
            .iter()
            .filter(|(_, s)| s.health.is_ejected())
            .count();
        let schedulable = state
            .ranks
            .slots
            .iter()
            .filter(|(_, s)| s.schedulable)
            .count();
        let may_eject = ejected < config.outlier.max_ejected(schedulable);
        let Some(slot) = state.ranks.get_mut(&rank) else {
            return true;
        };
        facts.push(Fact::UpstreamResponse {
            worker: slot.worker_name.clone(),
            dp_rank: rank.dp_rank,
            class,
        });
        let outlier = &config.outlier;
        let event = match class {
            ResponseClass::Success | ResponseClass::ClientError => {
                slot.health.on_success(now, outlier)
            }
            ResponseClass::ServerError => slot.health.on_failure(now, outlier, may_eject),
            ResponseClass::Reset => {
                // No answer is no verdict on the engine (the client may have gone), but a probe
                // without one must not hold the rank out forever.
                if probe {
                    slot.health.probe_abandoned(now);
                }
                None
            }
        };
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
