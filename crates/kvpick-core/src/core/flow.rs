//! Flow control across partitions: admitting a request (dispatched now, queued, or refused),
//! release passes, cancellation and expiry of waiting requests, and the queue's totals. The
//! queue discipline is [`crate::flow`]; each partition's part is `partition::admission`.

use super::*;

impl Core {
    /// Flow control's entry point for stream requests: books now unless every eligible rank is
    /// saturated (or requests wait ahead of it), else queues the request ([`Admission::Queued`]).
    /// With flow control off, and for API requests, it is [`Core::select_and_reserve`]. The
    /// facts come back even on an error: the release pass may have placed other requests.
    pub fn admit(
        &self,
        request: &SelectionRequest,
        now: Instant,
    ) -> (Result<Admission, SelectError>, Facts) {
        let config = self.config();
        if !config.flow.enabled || request.holder == Holder::Api {
            return match self.select_and_reserve(request, now) {
                Ok((s, f)) => (Ok(Admission::Dispatched(Box::new(s))), f),
                Err(e) => (Err(e), Facts::default()),
            };
        }
        let partition = match self.ensure_ready(request) {
            Ok(p) => p,
            Err(SelectError::Unavailable(_)) if config.flow.hold_when_no_endpoints => {
                match self.held_partition(request, now) {
                    Ok(p) => p,
                    Err(e) => return (Err(e), Facts::default()),
                }
            }
            Err(e) => return (Err(e), Facts::default()),
        };
        let ticket = self
            .tickets
            .fetch_add(1, Ordering::Relaxed)
            .saturating_add(1);
        self.waiting.insert(ticket, Arc::clone(&partition));
        let mut facts = Facts::default();
        let admitted = partition.admit(request, ticket, self, &config, now, &mut facts);
        self.forget_dequeued(&facts, 0);
        let result = match admitted {
            Ok(Admitted::Dispatched(outcome)) => {
                self.waiting.remove(&ticket);
                self.record_trace(request, &outcome);
                Ok(Admission::Dispatched(Box::new(outcome.selection)))
            }
            Ok(Admitted::Queued { deadline }) => Ok(Admission::Queued { ticket, deadline }),
            Err(e) => {
                self.waiting.remove(&ticket);
                Err(e)
            }
        };
        (result, facts)
    }

    /// A release pass over one partition's queue.
    pub(super) fn pump_partition(
        &self,
        partition: &Arc<Partition>,
        now: Instant,
        facts: &mut Facts,
    ) {
        if partition.queue_len() == 0 {
            return;
        }
        let start = facts.0.len();
        self.release_passes.fetch_add(1, Ordering::Relaxed);
        partition.pump(self, &self.config(), now, facts);
        self.forget_dequeued(facts, start);
    }

    pub(super) fn forget_dequeued(&self, facts: &Facts, start: usize) {
        for fact in facts.0.iter().skip(start) {
            if let Fact::Dequeued { ticket, .. } = fact {
                self.waiting.remove(ticket);
            }
        }
    }

    /// A release pass over every queue (hosts call it on a timer: an engine reading going stale
    /// frees capacity without any operation; the replay calls it as its clock advances).
    pub fn pump(&self, now: Instant) -> Facts {
        let partitions: Vec<Arc<Partition>> = self.partitions.read().values().cloned().collect();
        let mut facts = Facts::default();
        for p in &partitions {
            self.pump_partition(p, now, &mut facts);
        }
        facts
    }

    /// Decays every booked prefill past its expected time at `now` ([`crate::BookingBounds`]),
    /// and runs a release pass over each partition where one did. Picks and release passes
    /// decay what is due first anyway; hosts call this on a timer so that the load gauges and
    /// the cost of a rank follow when nothing else happens.
    pub fn decay_bookings(&self, now: Instant) -> Facts {
        let partitions: Vec<Arc<Partition>> = self.partitions.read().values().cloned().collect();
        let mut facts = Facts::default();
        for p in &partitions {
            if p.decay_bookings(now, &mut facts) > 0 {
                self.pump_partition(p, now, &mut facts);
            }
        }
        facts
    }

    /// The waiting request's client went away: it leaves the queue. False when it is no longer
    /// waiting (its outcome is, or is about to be, a [`Fact::Dequeued`]).
    pub fn cancel_waiting(&self, ticket: u64, now: Instant) -> (bool, Facts) {
        let mut facts = Facts::default();
        let cancelled = self
            .waiting
            .remove(&ticket)
            .is_some_and(|(_, p)| p.cancel(ticket, now, &mut facts));
        (cancelled, facts)
    }

    /// The waiting request's deadline passed: it leaves the queue with the error its client gets
    /// (429 sheddable or SLO, 503 otherwise); `None` when it is no longer waiting.
    pub fn expire_waiting(&self, ticket: u64, now: Instant) -> (Option<SelectError>, Facts) {
        let mut facts = Facts::default();
        let error = self
            .waiting
            .remove(&ticket)
            .and_then(|(_, p)| p.expire(ticket, &self.config(), now, &mut facts));
        (error, facts)
    }

    /// Requests waiting in every queue.
    pub fn waiting_requests(&self) -> usize {
        self.waiting.len()
    }

    /// The earliest deadline of any waiting request.
    pub fn next_queue_deadline(&self) -> Option<Instant> {
        let partitions: Vec<Arc<Partition>> = self.partitions.read().values().cloned().collect();
        partitions
            .iter()
            .filter_map(|p| p.next_queue_deadline())
            .min()
    }

    /// Release passes run so far over a non-empty queue.
    pub fn release_passes(&self) -> u64 {
        self.release_passes.load(Ordering::Relaxed)
    }
}
