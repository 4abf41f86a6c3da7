//! The registry of live bookings: a booking id claimed before its pick (one generation per
//! use of an id), found again for each later event of the request, freed, moved and reaped. It
//! must not decide or touch a partition's state beyond asking the partition to free.

use super::*;

/// A live booking in the registry: where it lives and which generation of its id it is.
pub(super) struct Registered {
    pub(super) partition: Arc<Partition>,
    pub(super) generation: u64,
    pub(super) holder: Holder,
}

impl Registered {
    pub(super) fn answers(&self, claim: Claim) -> bool {
        match claim {
            Claim::Generation(g) => self.generation == g,
            Claim::HeldBy(h) => self.holder == h,
            Claim::Any => true,
        }
    }
}

impl Claims for Core {
    fn claim(
        &self,
        request: &SelectionRequest,
        partition: &Arc<Partition>,
    ) -> Result<(String, u64), SelectError> {
        Core::claim(self, request, partition)
    }

    fn unclaim(&self, id: &str, generation: u64) {
        self.unregister(id, Claim::Generation(generation));
    }

    fn waiting_total(&self) -> usize {
        self.waiting.len()
    }
}

impl Core {
    /// Claims the request id in the registry with a fresh generation. A live duplicate is
    /// refused (API) or suffixed (ext_proc): `#2` first, then the generation, which no live
    /// booking has, so a claim takes O(1) tries however often an id repeats.
    pub(super) fn claim(
        &self,
        request: &SelectionRequest,
        partition: &Arc<Partition>,
    ) -> Result<(String, u64), SelectError> {
        if request.holder == Holder::Api {
            let max = self.config().max_api_bookings;
            let taken = self
                .api_bookings
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                    (n < max).then(|| n.saturating_add(1))
                });
            if taken.is_err() {
                return Err(SelectError::Overloaded(format!(
                    "{max} API bookings are live; free some first"
                )));
            }
        }
        let mut id = request.request_id.clone();
        let mut duplicates: u32 = 0;
        loop {
            let generation = self
                .generations
                .fetch_add(1, Ordering::Relaxed)
                .saturating_add(1);
            match self.bookings.entry(id) {
                dashmap::Entry::Vacant(v) => {
                    let id = v.key().clone();
                    v.insert(Registered {
                        partition: Arc::clone(partition),
                        generation,
                        holder: request.holder,
                    });
                    return Ok((id, generation));
                }
                dashmap::Entry::Occupied(_) if request.on_duplicate == DuplicateId::Reject => {
                    if request.holder == Holder::Api {
                        self.api_bookings.fetch_sub(1, Ordering::AcqRel);
                    }
                    return Err(SelectError::Conflict(format!(
                        "request id {} already has a live booking",
                        clip(&request.request_id)
                    )));
                }
                dashmap::Entry::Occupied(_) => {
                    duplicates = duplicates.saturating_add(1);
                    id = if duplicates == 1 {
                        format!("{}#2", request.request_id)
                    } else {
                        format!("{}#{generation}", request.request_id)
                    };
                }
            }
        }
    }

    /// Removes a booking from the registry if `claim` names it; returns its generation and
    /// partition.
    pub(super) fn unregister(&self, id: &str, claim: Claim) -> Option<(u64, Arc<Partition>)> {
        let (_, entry) = self.bookings.remove_if(id, |_, r| r.answers(claim))?;
        if entry.holder == Holder::Api {
            self.api_bookings.fetch_sub(1, Ordering::AcqRel);
        }
        Some((entry.generation, entry.partition))
    }

    pub(super) fn booked(&self, id: &str, claim: Claim) -> Option<(u64, Arc<Partition>)> {
        let entry = self.bookings.get(id).filter(|r| r.answers(claim))?;
        Some((entry.generation, Arc::clone(&entry.partition)))
    }

    /// Frees a booking exactly once; unknown, repeated or foreign frees (a claim that does not
    /// name the id's current booking) are no-ops returning false.
    pub fn free(&self, booking_id: &str, claim: Claim, now: Instant) -> (bool, Facts) {
        let mut facts = Facts::default();
        let Some((generation, partition)) = self.unregister(booking_id, claim) else {
            return (false, facts);
        };
        let freed = partition.free(&(booking_id.to_string(), generation), now, &mut facts);
        if freed {
            self.pump_partition(&partition, now, &mut facts);
        }
        (freed, facts)
    }

    /// Moves a booking to the endpoint that actually served it (Envoy may fall back).
    pub fn move_booking(
        &self,
        booking_id: &str,
        claim: Claim,
        served: SocketAddr,
    ) -> (bool, Facts) {
        let mut facts = Facts::default();
        let Some((generation, p)) = self.booked(booking_id, claim) else {
            return (false, facts);
        };
        let moved = p.move_booking(&(booking_id.to_string(), generation), served, &mut facts);
        (moved, facts)
    }

    /// Reaps API bookings older than `booking_ttl` (streams free their own), expired index
    /// entries and idle sessions; returns the bookings reaped.
    pub fn reap_expired(&self, now: Instant) -> (usize, Facts) {
        let partitions: Vec<Arc<Partition>> = self.partitions.read().values().cloned().collect();
        let mut facts = Facts::default();
        let mut reaped: usize = 0;
        for p in partitions {
            let ids = p.reap(
                now,
                self.config().booking_ttl,
                self.config().sessions.ttl,
                &mut facts,
            );
            let freed_any = !ids.is_empty();
            for (id, generation) in ids {
                self.unregister(&id, Claim::Generation(generation));
                reaped = reaped.saturating_add(1);
            }
            // Only reaped bookings free capacity here; time-driven changes (expiry, engine
            // readings going stale) are the host's timer pass ([`Core::pump`]).
            if freed_any {
                self.pump_partition(&p, now, &mut facts);
            }
        }
        facts.push(Fact::BookingsExpired(reaped as u64));
        (reaped, facts)
    }

    /// One purge step on every partition whose index still lists cleared ranks' holders
    /// ([`crate::index::PrefixIndex::clear_ranks`]); returns the partitions swept. The host
    /// calls it often (a cleared id is reusable after one step per shard), while the
    /// expired-entry purge rides on [`Core::reap_expired`].
    pub fn sweep_cleared_ranks(&self, now: Instant) -> usize {
        let partitions: Vec<Arc<Partition>> = self.partitions.read().values().cloned().collect();
        partitions.iter().filter(|p| p.sweep_cleared(now)).count()
    }

    /// Number of live bookings.
    pub fn live_bookings(&self) -> usize {
        self.bookings.len()
    }
}
