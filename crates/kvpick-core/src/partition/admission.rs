//! Flow control on one partition (ARCHITECTURE.md §12): a request's admission (book now, or
//! wait in the partition's [`crate::flow::FlowQueue`]), the release of waiting requests when
//! capacity frees ([`Partition::pump`]), cancellation and expiry, and the SLO stage of the
//! pipeline ([`Check::meet_slo`]).
//!
//! It owns no state: the queue is the partition's, under its lock, and the booking is made by
//! [`Partition::select_in`] in the same critical section as the decision. It must not touch the
//! booking registry: ids are claimed and released through the core's [`Claims`].

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::config::CoreConfig;
use crate::decide::{ttft_blocks, Candidate};
use crate::error::SelectError;
use crate::facts::{Fact, Facts, QueueEvent, QueueExit};
use crate::flow::Waiting;
use crate::request::SelectionRequest;

use super::stage::{Ask, Check, Field, PromptBlocks, Refusal};
use super::{Partition, SelectOutcome, State};

/// A waiting request: what the pipeline needs to try it again. Its prompt is kept only as block
/// hashes (bounded by `max_prompt_blocks`): the text or token ids stay with the host's body.
#[derive(Debug)]
pub(crate) struct Queued {
    /// The request without its prompt ([`SelectionRequest::without_prompt`]).
    pub request: SelectionRequest,
    pub prompt: PromptBlocks,
}

/// The booking registry, as admission needs it (the core implements it).
pub(crate) trait Claims {
    /// Claims the request's id for a booking in `partition`.
    fn claim(
        &self,
        request: &SelectionRequest,
        partition: &Arc<Partition>,
    ) -> Result<(String, u64), SelectError>;
    /// Gives back a claim whose pick booked nothing.
    fn unclaim(&self, id: &str, generation: u64);
    /// Requests waiting in every queue of the process, counting the one being admitted.
    fn waiting_total(&self) -> usize;
}

/// What admission did with an arriving request.
pub(crate) enum Admitted {
    Dispatched(Box<SelectOutcome>),
    /// Waiting; it leaves the queue by `deadline` at the latest.
    Queued {
        deadline: Instant,
    },
}

impl Check {
    /// Keeps only the candidates predicted to meet the request's SLOs: the first token within
    /// what is left of the TTFT SLO, and a time per output token (at the rank's batch with this
    /// request in it) within the TPOT SLO. None can now: [`Refusal::Saturated`] (wait) while an
    /// idle rank still could, [`Refusal::SloUnmeetable`] once even that cannot.
    pub(super) fn meet_slo(
        &self,
        state: &State,
        ask: &Ask,
        field: &mut Field,
    ) -> Result<(), Refusal> {
        if self.slo_ttft.is_none() && self.slo_tpot.is_none() {
            return Ok(());
        }
        let (estimator, tpot) = (&state.estimator, &state.tpot);
        let (prompt_tokens, block_size) = (ask.prompt.tokens, field.block_size);
        let (params, now) = (&ask.config.cost, ask.now);
        let remaining = self
            .slo_ttft
            .map(|slo| slo - now.saturating_duration_since(self.enqueued).as_secs_f64());
        let block = f64::from(block_size.max(1));
        let ttft = |c: &Candidate, queued: u64| {
            let c = Candidate {
                active_prefill_tokens: queued,
                ..*c
            };
            estimator.predict(
                &c.key,
                ttft_blocks(&c, prompt_tokens, block_size, params) * block,
            )
        };
        let meets = |c: &Candidate| {
            remaining.is_none_or(|r| ttft(c, c.active_prefill_tokens) <= r)
                && self
                    .slo_tpot
                    .is_none_or(|slo| tpot.predict(c.active_requests as f64 + 1.0) <= slo)
        };
        let (kept_eligible, kept): (Vec<usize>, Vec<Candidate>) = field
            .eligible
            .iter()
            .copied()
            .zip(field.candidates.iter().copied())
            .filter(|(_, c)| meets(c))
            .unzip();
        if !kept.is_empty() {
            field.eligible = kept_eligible;
            field.candidates = kept;
            return Ok(());
        }
        if let (Some(slo), Some(remaining)) = (self.slo_ttft, remaining) {
            let fastest_idle = field
                .candidates
                .iter()
                .map(|c| ttft(c, 0))
                .fold(f64::INFINITY, f64::min);
            if fastest_idle > remaining {
                return Err(Refusal::SloUnmeetable(format!(
                    "TTFT SLO of {:.0} ms cannot be met: the fastest worker needs {:.0} ms",
                    slo * 1000.0,
                    (fastest_idle + slo - remaining) * 1000.0
                )));
            }
        }
        if let Some(slo) = self.slo_tpot {
            let idle = tpot.predict(1.0);
            if idle > slo {
                return Err(Refusal::SloUnmeetable(format!(
                    "TPOT SLO of {:.0} ms cannot be met: an idle worker needs {:.1} ms per token",
                    slo * 1000.0,
                    idle * 1000.0
                )));
            }
        }
        Err(Refusal::Saturated)
    }
}

/// Whether a release pass can place anything: some schedulable rank that decodes (every
/// request needs one; a prefill-only rank with room places nothing) is below its saturation
/// limits, or none is schedulable at all (then every waiting request fails at once, 503).
/// With `--hold-when-no-endpoints`, a partition with no schedulable rank that decodes keeps its
/// requests waiting (for a rank to join, or their deadline) instead of failing them.
fn holds(state: &State, config: &CoreConfig) -> bool {
    config.flow.hold_when_no_endpoints
        && !state
            .ranks
            .slots
            .iter()
            .any(|(_, s)| s.schedulable && s.role.decodes())
}

fn has_room(state: &State, config: &CoreConfig, now: Instant) -> bool {
    let mut decoding = state
        .ranks
        .slots
        .iter()
        .filter(|(_, s)| s.schedulable && s.role.decodes() && s.health.available(now))
        .peekable();
    if decoding.peek().is_none() {
        return true;
    }
    decoding.any(|(key, slot)| {
        !super::pipeline::rank_saturated(
            key,
            slot,
            &state.estimator,
            &config.flow.saturation,
            now,
            config.engine_metrics_max_age,
        )
    })
}

fn queue_fact(w: &Waiting<Arc<Queued>>, event: QueueEvent) -> Fact {
    Fact::Queue {
        priority: w.priority,
        fairness_key: Arc::clone(&w.fairness_key),
        event,
    }
}

/// A request that left the queue the moment it arrived (full, or its SLO unmeetable).
fn left_at_once(priority: i32, fairness_key: Arc<str>, exit: QueueExit) -> Fact {
    Fact::Queue {
        priority,
        fairness_key,
        event: QueueEvent::Left {
            exit,
            waited_seconds: 0.0,
        },
    }
}

/// Where a release pass's outcomes go: `own`'s to the caller, every other one as a
/// [`Fact::Dequeued`] for the host to hand to its waiter.
struct Outcomes {
    own: Option<u64>,
    mine: Option<Result<SelectOutcome, SelectError>>,
}

impl Outcomes {
    fn deliver(
        &mut self,
        ticket: u64,
        result: Result<SelectOutcome, SelectError>,
        facts: &mut Facts,
    ) {
        if Some(ticket) == self.own {
            self.mine = Some(result);
        } else {
            facts.push(Fact::Dequeued {
                ticket,
                result: result.map(|o| Box::new(o.selection)),
            });
        }
    }
}

fn waited(w: &Waiting<Arc<Queued>>, now: Instant) -> f64 {
    now.saturating_duration_since(w.enqueued).as_secs_f64()
}

/// What a request whose deadline passed gets: 429 when it was sheddable or its SLO went, 503
/// otherwise (nothing could serve it in time).
fn expiry_error(w: &Waiting<Arc<Queued>>, timeout: Duration) -> SelectError {
    if w.slo_bound {
        let slo = w.payload.request.slo_ttft_ms.unwrap_or_default();
        SelectError::Overloaded(format!(
            "TTFT SLO of {slo} ms cannot be met: no worker had capacity in time"
        ))
    } else if w.priority < 0 {
        SelectError::Overloaded(format!(
            "sheddable request shed: no capacity within the queue timeout ({:.1}s)",
            timeout.as_secs_f64()
        ))
    } else {
        SelectError::Unavailable(format!(
            "no capacity within the queue timeout ({:.1}s)",
            timeout.as_secs_f64()
        ))
    }
}

/// A request taken out at its deadline: its exit fact, and the error its client gets.
fn expired(
    w: &Waiting<Arc<Queued>>,
    config: &CoreConfig,
    now: Instant,
    facts: &mut Facts,
) -> SelectError {
    let exit = if w.slo_bound {
        QueueExit::SloMissed
    } else {
        QueueExit::Timeout
    };
    facts.push(queue_fact(
        w,
        QueueEvent::Left {
            exit,
            waited_seconds: waited(w, now),
        },
    ));
    expiry_error(w, config.flow.queue_timeout)
}

fn full_error(priority: i32, which: &str, capacity: usize) -> SelectError {
    if priority < 0 {
        SelectError::Overloaded(format!(
            "sheddable request shed: {which} is full ({capacity} requests)"
        ))
    } else {
        SelectError::Unavailable(format!("{which} is full ({capacity} requests)"))
    }
}

impl Partition {
    /// Admits an arriving request: with an empty queue it is placed at once unless every
    /// eligible rank is saturated; otherwise it joins the queue and a release pass runs, so it
    /// may still be booked now if it is first in line and a rank has room.
    pub(crate) fn admit(
        self: &Arc<Self>,
        request: &SelectionRequest,
        ticket: u64,
        claims: &dyn Claims,
        config: &CoreConfig,
        now: Instant,
        facts: &mut Facts,
    ) -> Result<Admitted, SelectError> {
        let prompt = self.prompt_of(request, config);
        let early = self.early_matches(request, &prompt, config, now);
        let check = Check::new(request, now);
        let ask = Ask {
            prompt: &prompt,
            request,
            booking: None,
            config,
            now,
            admission: Some(&check),
            exhaustive: false,
            matches: early.as_ref(),
        };
        let mut guard = self.lock_state();
        let admitted = match self.admit_in(&mut guard, &ask, claims, facts) {
            Ok(answer) => answer,
            Err(pump) => {
                // The queue keeps the prompt's blocks: the ask that borrowed them is done.
                let waiting = self.waiting(request, ticket, prompt, &config.flow, now);
                self.enqueue_in(&mut guard, waiting, pump, claims, config, facts)
            }
        };
        guard.unlock(facts);
        admitted
    }

    /// [`Partition::admit`] on locked state up to the queue: the answer when the request was
    /// tried at once against an empty queue and placed or refused, else whether the release
    /// pass should run once it is queued (`Err(pump)`).
    fn admit_in(
        self: &Arc<Self>,
        state: &mut State,
        ask: &Ask,
        claims: &dyn Claims,
        facts: &mut Facts,
    ) -> Result<Result<Admitted, SelectError>, bool> {
        Self::decay_due(state, ask.now, facts);
        // Held (no rank to serve it yet), or tried just now against an empty queue and found
        // saturated: a release pass would only try it again.
        let holding = holds(state, ask.config);
        let tried = state.queue.is_empty() && !holding;
        if tried {
            if let Some(answer) = self.try_at_once(state, ask, claims, facts) {
                return Ok(answer);
            }
        }
        Err(!(tried || holding))
    }

    /// Queues an admitted request and, with `pump`, runs a release pass: it may still be
    /// booked now if it is first in line and a rank has room.
    fn enqueue_in(
        self: &Arc<Self>,
        state: &mut State,
        waiting: Waiting<Arc<Queued>>,
        pump: bool,
        claims: &dyn Claims,
        config: &CoreConfig,
        facts: &mut Facts,
    ) -> Result<Admitted, SelectError> {
        let (ticket, deadline, now) = (waiting.ticket, waiting.deadline, waiting.enqueued);
        Self::enqueue(state, waiting, claims, &config.flow, facts)?;
        if !pump {
            self.queued.store(state.queue.len(), Ordering::Release);
            return Ok(Admitted::Queued { deadline });
        }
        match self.pump_locked(state, claims, config, now, facts, Some(ticket)) {
            Some(Ok(outcome)) => Ok(Admitted::Dispatched(Box::new(outcome))),
            Some(Err(e)) => Err(e),
            None => Ok(Admitted::Queued { deadline }),
        }
    }

    /// Claims the request's booking id and runs the pipeline with it; the claim is given back
    /// when nothing is booked.
    fn claim_and_select(
        self: &Arc<Self>,
        state: &mut State,
        ask: &Ask,
        claims: &dyn Claims,
        facts: &mut Facts,
    ) -> Result<SelectOutcome, Refusal> {
        let (id, generation) = claims.claim(ask.request, self).map_err(Refusal::Error)?;
        let booked = Ask {
            booking: Some((id.as_str(), generation)),
            ..*ask
        };
        let result = self.select_in(state, &booked, facts);
        if result.is_err() {
            claims.unclaim(&id, generation);
        }
        result
    }

    /// An arriving request against an empty queue: the answer, or `None` when every eligible
    /// rank is saturated (it may wait).
    fn try_at_once(
        self: &Arc<Self>,
        state: &mut State,
        ask: &Ask,
        claims: &dyn Claims,
        facts: &mut Facts,
    ) -> Option<Result<Admitted, SelectError>> {
        let refusal = match self.claim_and_select(state, ask, claims, facts) {
            Ok(outcome) => return Some(Ok(Admitted::Dispatched(Box::new(outcome)))),
            Err(Refusal::Saturated) => return None,
            Err(refusal) => refusal,
        };
        if matches!(refusal, Refusal::SloUnmeetable(_)) {
            let request = ask.request;
            facts.push(left_at_once(
                request.priority,
                Arc::from(request.fairness_key.as_deref().unwrap_or("")),
                QueueExit::SloMissed,
            ));
        }
        Some(Err(refusal.into_error()))
    }

    /// The queue entry of an arriving request: its deadline is the queue timeout or, sooner,
    /// its TTFT SLO; its fairness cost its prompt tokens plus one block.
    fn waiting(
        &self,
        request: &SelectionRequest,
        ticket: u64,
        prompt: PromptBlocks,
        flow: &crate::flow::FlowConfig,
        now: Instant,
    ) -> Waiting<Arc<Queued>> {
        let timeout_at = now.checked_add(flow.queue_timeout).unwrap_or(now);
        let slo_at = request
            .slo_ttft_ms
            .and_then(|ms| now.checked_add(Duration::from_millis(ms)));
        let (deadline, slo_bound) = match slo_at {
            Some(at) if at < timeout_at => (at, true),
            _ => (timeout_at, false),
        };
        Waiting {
            ticket,
            priority: request.priority,
            fairness_key: Arc::from(request.fairness_key.as_deref().unwrap_or("")),
            cost: prompt
                .tokens
                .saturating_add(u64::from(self.block_size().max(1))),
            enqueued: now,
            deadline,
            slo_bound,
            payload: Arc::new(Queued {
                request: request.without_prompt(),
                prompt,
            }),
        }
    }

    /// Puts `waiting` in the queue, or refuses it when the whole queue (across partitions) or
    /// its priority band is full.
    fn enqueue(
        state: &mut State,
        waiting: Waiting<Arc<Queued>>,
        claims: &dyn Claims,
        flow: &crate::flow::FlowConfig,
        facts: &mut Facts,
    ) -> Result<(), SelectError> {
        let (priority, key) = (waiting.priority, Arc::clone(&waiting.fairness_key));
        let refused = if claims.waiting_total() > flow.capacity {
            Some(full_error(priority, "the queue", flow.capacity))
        } else if state.queue.push(waiting, flow.band_capacity).is_err() {
            let band = format!("the queue of priority {priority}");
            Some(full_error(priority, &band, flow.band_capacity))
        } else {
            None
        };
        if let Some(error) = refused {
            facts.push(left_at_once(priority, key, QueueExit::Full));
            return Err(error);
        }
        facts.push(Fact::Queue {
            priority,
            fairness_key: key,
            event: QueueEvent::Enqueued,
        });
        Ok(())
    }

    /// A release pass: capacity may have freed (a booking ended or finished its prefill, a rank
    /// joined, other replicas' load fell), so waiting requests are tried in queue order.
    pub(crate) fn pump(
        self: &Arc<Self>,
        claims: &dyn Claims,
        config: &CoreConfig,
        now: Instant,
        facts: &mut Facts,
    ) {
        if self.queued.load(Ordering::Acquire) == 0 {
            return;
        }
        let mut guard = self.lock_state();
        self.pump_locked(&mut guard, claims, config, now, facts, None);
        guard.unlock(facts);
    }

    /// Expires requests past their deadline, then tries up to `max_scan` requests in release
    /// order. Each outcome becomes a [`Fact::Dequeued`], except `own`'s, which is returned.
    fn pump_locked(
        self: &Arc<Self>,
        state: &mut State,
        claims: &dyn Claims,
        config: &CoreConfig,
        now: Instant,
        facts: &mut Facts,
        own: Option<u64>,
    ) -> Option<Result<SelectOutcome, SelectError>> {
        Self::decay_due(state, now, facts);
        let mut outcomes = Outcomes { own, mine: None };
        for ticket in state.queue.expired(now) {
            if let Some(w) = state.queue.take(ticket, false) {
                let error = expired(&w, config, now, facts);
                outcomes.deliver(ticket, Err(error), facts);
            }
        }
        // The band of a request that waits although a rank has room (for the rank it prefers):
        // lower bands must not take that room first (strict priority), its own band may.
        let mut waiting_band: Option<i32> = None;
        let release = if holds(state, config) {
            Vec::new()
        } else {
            state.queue.release_order(config.flow.max_scan)
        };
        for ticket in release {
            // Nothing is placed on a saturated rank: with none left with room, stop.
            if !has_room(state, config, now) {
                break;
            }
            let Some(w) = state.queue.get(ticket) else {
                continue;
            };
            if waiting_band.is_some_and(|band| w.priority < band) {
                break;
            }
            let (priority, queued, enqueued) = (w.priority, Arc::clone(&w.payload), w.enqueued);
            let ask = Ask {
                prompt: &queued.prompt,
                request: &queued.request,
                booking: None,
                config,
                now,
                admission: Some(&Check::new(&queued.request, enqueued)),
                exhaustive: false,
                matches: None,
            };
            match self.try_release(state, ticket, &ask, claims, facts) {
                Some(result) => outcomes.deliver(ticket, result, facts),
                None => {
                    waiting_band.get_or_insert(priority);
                }
            }
        }
        self.queued.store(state.queue.len(), Ordering::Release);
        outcomes.mine
    }

    /// Tries waiting request `ticket` (`ask`): booked (it leaves the queue, dispatched),
    /// refused (it leaves), or `None`: every rank it may use is saturated, it keeps waiting.
    fn try_release(
        self: &Arc<Self>,
        state: &mut State,
        ticket: u64,
        ask: &Ask,
        claims: &dyn Claims,
        facts: &mut Facts,
    ) -> Option<Result<SelectOutcome, SelectError>> {
        let now = ask.now;
        match self.claim_and_select(state, ask, claims, facts) {
            Ok(outcome) => {
                if let Some(w) = state.queue.take(ticket, true) {
                    let waited_seconds = waited(&w, now);
                    facts.push(queue_fact(&w, QueueEvent::Dispatched { waited_seconds }));
                }
                Some(Ok(outcome))
            }
            Err(Refusal::Saturated) => None,
            Err(refusal) => {
                if let Some(w) = state.queue.take(ticket, false) {
                    let exit = if matches!(refusal, Refusal::SloUnmeetable(_)) {
                        QueueExit::SloMissed
                    } else {
                        QueueExit::Refused
                    };
                    let waited_seconds = waited(&w, now);
                    facts.push(queue_fact(
                        &w,
                        QueueEvent::Left {
                            exit,
                            waited_seconds,
                        },
                    ));
                }
                Some(Err(refusal.into_error()))
            }
        }
    }

    /// Takes a waiting request out because its client went away; false when it is no longer
    /// waiting (already released: its outcome is, or will be, a [`Fact::Dequeued`]).
    pub(crate) fn cancel(&self, ticket: u64, now: Instant, facts: &mut Facts) -> bool {
        let mut state = self.lock_state();
        let Some(w) = state.queue.take(ticket, false) else {
            return false;
        };
        facts.push(queue_fact(
            &w,
            QueueEvent::Left {
                exit: QueueExit::Cancelled,
                waited_seconds: waited(&w, now),
            },
        ));
        self.queued.store(state.queue.len(), Ordering::Release);
        true
    }

    /// Takes a waiting request out at its deadline (the host's timer fired) with the error its
    /// client gets; `None` when it is no longer waiting.
    pub(crate) fn expire(
        &self,
        ticket: u64,
        config: &CoreConfig,
        now: Instant,
        facts: &mut Facts,
    ) -> Option<SelectError> {
        let mut state = self.lock_state();
        let w = state.queue.take(ticket, false)?;
        let error = expired(&w, config, now, facts);
        self.queued.store(state.queue.len(), Ordering::Release);
        Some(error)
    }

    /// What the queue keeps of a waiting request.
    #[cfg(test)]
    pub(crate) fn queued(&self, ticket: u64) -> Option<Arc<Queued>> {
        let state = self.lock_state();
        state.queue.get(ticket).map(|w| Arc::clone(&w.payload))
    }

    /// Requests waiting in this partition's queue.
    pub(crate) fn queue_len(&self) -> usize {
        self.queued.load(Ordering::Acquire)
    }

    /// The earliest deadline of a waiting request.
    pub(crate) fn next_queue_deadline(&self) -> Option<Instant> {
        if self.queue_len() == 0 {
            return None;
        }
        self.lock_state().queue.next_deadline()
    }
}
