//! Flow control as the process runs it (ARCHITECTURE.md §12): [`SelectionCore::admit`] and the
//! [`Waiter`] a queued request holds. The core decides who waits and who is released; this
//! module only delivers: every [`Fact::Dequeued`] the core returns (from whichever operation freed
//! the capacity) is handed to its waiter as a [`Reservation`], so a booking made for a client
//! that has gone is freed by that reservation's drop, never lost.
//!
//! It must not decide anything: no ordering, no saturation, no timeouts of its own beyond
//! waking at the deadline the core gave.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::oneshot;

use kvpick_core::core::Admission;

use super::sharing::SessionBefore;
use super::{now, Fact, Facts, Reservation, SelectError, SelectionCore, SelectionRequest};

type Outcome = Result<Reservation, SelectError>;

/// Where a released request's outcome goes.
enum Mailbox {
    /// Its waiter is listening.
    Waiting(oneshot::Sender<Outcome>),
    /// Released before its waiter registered (the admission call had not returned yet).
    Ready(Box<Outcome>),
}

/// The waiters of this process's queued requests, by ticket. Each operation is one critical
/// section, so a release racing the registration of its waiter is seen by exactly one side.
#[derive(Default)]
pub(super) struct Mailboxes(Mutex<HashMap<u64, Mailbox>>);

/// What registering a waiter found.
enum Registered {
    /// Released already: the outcome.
    Ready(Box<Outcome>),
    Waiting(oneshot::Receiver<Outcome>),
}

impl Mailboxes {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Mailbox>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The waiter of `ticket` starts listening, or takes the outcome delivered before it came.
    fn register(&self, ticket: u64) -> Registered {
        let mut boxes = self.lock();
        if let Some(Mailbox::Ready(outcome)) = boxes.remove(&ticket) {
            return Registered::Ready(outcome);
        }
        let (tx, rx) = oneshot::channel();
        boxes.insert(ticket, Mailbox::Waiting(tx));
        Registered::Waiting(rx)
    }

    /// Hands `ticket`'s outcome to its waiter, or keeps it for the waiter about to register.
    /// An outcome nobody receives (the waiter has gone) is dropped after the lock is released:
    /// dropping a reservation frees its booking, which delivers again.
    fn deliver(&self, ticket: u64, outcome: Outcome) {
        let undelivered = {
            let mut boxes = self.lock();
            match boxes.remove(&ticket) {
                Some(Mailbox::Waiting(tx)) => tx.send(outcome).err(),
                Some(Mailbox::Ready(_)) | None => {
                    boxes.insert(ticket, Mailbox::Ready(Box::new(outcome)));
                    None
                }
            }
        };
        drop(undelivered);
    }

    fn forget(&self, ticket: u64) {
        let gone = self.lock().remove(&ticket);
        drop(gone);
    }

    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.lock().len()
    }
}

/// What [`SelectionCore::admit`] did.
pub enum Admitted {
    /// Booked now.
    Now(Box<Reservation>),
    /// Waiting for capacity: await [`Waiter::wait`]; dropping the waiter leaves the queue.
    Queued(Waiter),
}

/// A request waiting in the core's queue.
pub struct Waiter {
    core: Arc<SelectionCore>,
    ticket: u64,
    deadline: tokio::time::Instant,
    rx: Option<oneshot::Receiver<Outcome>>,
    /// The outcome was taken: nothing to cancel on drop.
    settled: bool,
    /// `--shared-state`: the session and its binding before the pick (published on release).
    session: Option<SessionBefore>,
}

impl std::fmt::Debug for Waiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Waiter")
            .field("ticket", &self.ticket)
            .field("deadline", &self.deadline)
            .finish_non_exhaustive()
    }
}

impl Waiter {
    pub fn ticket(&self) -> u64 {
        self.ticket
    }

    /// Waits until the core releases the request (booked, or refused) or its deadline passes
    /// (then the core says which error it gets: 503, or 429 for sheddable and SLO requests).
    pub async fn wait(mut self) -> Outcome {
        let Some(mut rx) = self.rx.take() else {
            self.settled = true;
            return Err(SelectError::Unavailable(
                "queued request lost its waiter".into(),
            ));
        };
        let outcome = tokio::select! {
            outcome = &mut rx => outcome,
            () = tokio::time::sleep_until(self.deadline) => {
                let (error, facts) = self.core.inner().expire_waiting(self.ticket, now());
                self.core.record(facts);
                match error {
                    Some(e) => Ok(Err(e)),
                    // Released just as the deadline passed: its outcome is on the way.
                    None => rx.await,
                }
            }
        };
        self.settled = true;
        let outcome = outcome
            .unwrap_or_else(|_| Err(SelectError::Unavailable("kvpick is shutting down".into())));
        if let Ok(reservation) = &outcome {
            self.core
                .after_pick(reservation.selection(), self.session.as_ref());
        }
        outcome
    }
}

impl Drop for Waiter {
    fn drop(&mut self) {
        self.core.metrics.pool.dequeued(self.ticket);
        if self.settled {
            return;
        }
        let (cancelled, facts) = self.core.inner().cancel_waiting(self.ticket, now());
        self.core.record(facts);
        if cancelled {
            self.core.mailboxes.forget(self.ticket);
        }
        // Not cancelled: it was released. Its outcome was sent into `rx` (dropped with it, so
        // the reservation inside frees its booking) or will be: the send then fails and the
        // reservation is dropped the same way.
    }
}

impl SelectionCore {
    /// Flow control's entry point for a stream request: a reservation now, or a [`Waiter`].
    pub fn admit(self: &Arc<Self>, request: &SelectionRequest) -> Result<Admitted, SelectError> {
        let session = self.session_before(request);
        let (result, facts) = self.core.admit(request, now());
        self.record(facts);
        match result? {
            Admission::Dispatched(selection) => {
                self.after_pick(&selection, session.as_ref());
                Ok(Admitted::Now(Box::new(self.reservation(*selection))))
            }
            Admission::Queued { ticket, deadline } => match self.mailboxes.register(ticket) {
                Registered::Ready(outcome) => {
                    let reservation = (*outcome)?;
                    self.after_pick(reservation.selection(), session.as_ref());
                    Ok(Admitted::Now(Box::new(reservation)))
                }
                Registered::Waiting(rx) => {
                    self.metrics.pool.enqueued(ticket, now());
                    Ok(Admitted::Queued(Waiter {
                        core: Arc::clone(self),
                        ticket,
                        deadline: tokio::time::Instant::from_std(deadline),
                        rx: Some(rx),
                        settled: false,
                        session,
                    }))
                }
            },
        }
    }

    /// A release pass over every queue (the reaper's tick: engine readings going stale, other
    /// replicas' load falling).
    pub fn pump_queues(&self) {
        let facts = self.core.pump(now());
        self.record(facts);
    }

    /// Decays booked prefills past their expected time (`--booking-prefill-margin`), releasing
    /// what that frees to waiting requests.
    pub fn decay_bookings(&self) {
        let facts = self.core.decay_bookings(now());
        self.record(facts);
    }

    /// Requests waiting in this process's queues.
    pub fn waiting_requests(&self) -> usize {
        self.core.waiting_requests()
    }

    /// Hands every released request in `facts` to its waiter.
    pub(super) fn deliver(&self, facts: &Facts) {
        for fact in facts.iter() {
            let Fact::Dequeued { ticket, result } = fact else {
                continue;
            };
            let outcome = match (result, self.this.upgrade()) {
                (Ok(selection), Some(this)) => Ok(this.reservation((**selection).clone())),
                (Ok(selection), None) => {
                    // The process is going away: free the booking at once.
                    let claim = kvpick_core::Claim::Generation(selection.generation);
                    let (_, facts) = self.core.free(&selection.booking_id, claim, now());
                    self.metrics.apply(&facts);
                    continue;
                }
                (Err(e), _) => Err(e.clone()),
            };
            self.mailboxes.deliver(*ticket, outcome);
        }
    }
}

#[cfg(test)]
#[path = "admission_tests.rs"]
mod tests;
