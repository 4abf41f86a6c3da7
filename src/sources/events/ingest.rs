//! KV-event ingestion: one subscription task per rank at the endpoint the catalog gives, decoded
//! batches applied to the selection core in sequence order, and the rank's engine watched:
//!
//! - A gap is filled from the engine's replay socket when one is configured; a sequence that
//!   goes backwards means the engine restarted and clears the rank.
//! - A lost subscription (the socket monitor's `Disconnected`) is seen at once: the socket is
//!   dropped, the engine's HTTP endpoint probed, and the subscription retried on kvpick's own
//!   schedule ([`super::link`]). A rank whose subscription is down and whose endpoint refuses
//!   connections is reported unreachable (no picks) until the endpoint answers again.
//! - When a subscription comes back, the engine is checked for a restart before its rank takes
//!   picks again: the replay from the last applied message must return that message byte for
//!   byte, or the rank is cleared and the new run replayed from 0 ([`RankStream::resume`]).
//!
//! A bad message is counted and skipped; nothing here can stop ingestion for good. This module
//! owns the sequence logic and the task's life; what an event means for the index is the
//! selection core's business.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use futures::StreamExt;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use zeromq::{SocketEvent, SocketRecv, ZmqMessage};

use super::decode::{decode_batch, decode_message, EventBatch};
use super::groups::{Mode, Outcome, RankGroups};
use super::link::{self, Backoff, Reach, PROBE_INTERVAL};
use super::replay::{replay, Ended, Visit};
use super::sequence::{fingerprint, SeqAction, SequenceTracker};
use crate::selection::{RankKey, SelectionCore};

pub use super::sequence::DUPLICATE_WINDOW;

/// A batch's lag further from the engine's clock than this is no lag but a timestamp in another
/// unit or epoch (or a clock far off): it is not observed.
pub const MAX_EVENT_LAG: Duration = Duration::from_secs(3600);

/// The longest a whole replay may take (each reply is bounded by [`super::replay::REPLY_TIMEOUT`]).
const REPLAY_TOTAL: Duration = Duration::from_secs(20);

/// Time from an engine's batch timestamp `ts` (seconds since the Unix epoch, as vLLM and SGLang
/// stamp batches) to `now`; a timestamp slightly ahead (clock skew) is lag 0. `None` when `ts` is
/// not a plausible wall-clock time (0, not finite, more than [`MAX_EVENT_LAG`] away).
pub fn event_lag(ts: f64, now: SystemTime) -> Option<Duration> {
    let now = now.duration_since(UNIX_EPOCH).ok()?.as_secs_f64();
    let lag = now - ts;
    if !ts.is_finite() || ts <= 0.0 || lag.abs() > MAX_EVENT_LAG.as_secs_f64() {
        return None;
    }
    Some(Duration::from_secs_f64(lag.max(0.0)))
}

/// Where a batch came from: the live stream (its lag is ingestion's) or a replay (its timestamp
/// is as old as the message, so it says nothing about ingestion and is not observed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Source {
    Live,
    Replay,
}

struct RankStream {
    core: Arc<SelectionCore>,
    rank: RankKey,
    endpoint: String,
    replay: Option<String>,
    seq: SequenceTracker,
    reach: Reach,
    /// Nothing of this rank was applied since it was last cleared: clearing again would change
    /// nothing (and count the same restart twice).
    fresh: bool,
    /// The engine run's KV-cache groups (hybrid models): which events may confirm a prefix.
    groups: RankGroups,
    /// The mode the groups decided last (logged when it changes) and the groups logged so far.
    mode: Mode,
    groups_logged: usize,
}

impl RankStream {
    fn new(
        core: Arc<SelectionCore>,
        rank: RankKey,
        endpoint: String,
        replay: Option<String>,
    ) -> Self {
        RankStream {
            reach: Reach::new(Arc::clone(&core), rank),
            core,
            rank,
            endpoint,
            replay,
            seq: SequenceTracker::default(),
            fresh: false,
            groups: RankGroups::default(),
            mode: Mode::Events,
            groups_logged: 0,
        }
    }

    fn apply(&mut self, seq: u64, print: u64, batch: &EventBatch, source: Source) {
        if batch.skipped_unknown > 0 {
            self.core
                .metrics()
                .events
                .kv_events
                .with_label_values(&["unknown_type"])
                .inc_by(batch.skipped_unknown as u64);
        }
        let filtered = self.groups.filter(batch);
        count_kinds(&self.core, &filtered.outcomes);
        // A replayed batch's timestamp is as old as the message: no lag for the end grace.
        let lag = match source {
            Source::Live => event_lag(batch.ts, SystemTime::now()),
            Source::Replay => None,
        };
        if !filtered.events.is_empty() || lag.is_some() {
            self.core.apply_kv_batch(self.rank, &filtered.events, lag);
        }
        if filtered.clear_rank {
            self.core.clear_rank(self.rank);
        }
        self.note_groups();
        self.seq.applied(seq, print);
        self.fresh = false;
        if source == Source::Live {
            if let Some(lag) = event_lag(batch.ts, SystemTime::now()) {
                self.core
                    .metrics()
                    .events
                    .event_lag
                    .observe(lag.as_secs_f64());
            }
        }
    }

    /// Logs the rank's KV-cache groups as they are learnt, and its mode when it changes.
    fn note_groups(&mut self) {
        let kinds = self.groups.kinds();
        if kinds.len() > self.groups_logged {
            self.groups_logged = kinds.len();
            let groups: Vec<String> = kinds
                .iter()
                .map(|(g, k)| format!("{g}:{}", k.as_str()))
                .collect();
            tracing::info!(endpoint = %self.endpoint, rank = ?self.rank, groups = %groups.join(","), "KV-cache groups announced; only full-attention groups' blocks count as prefix matches");
        }
        let mode = self.groups.mode();
        if mode == self.mode {
            return;
        }
        self.mode = mode;
        match mode {
            Mode::Approximate => {
                tracing::warn!(endpoint = %self.endpoint, rank = ?self.rank, "no full-attention KV-cache group on this rank (every layer sliding-window or state-space): its KV events cannot confirm a prefix, so the rank stays in approximate mode (kvpick's own picks predict its cache)")
            }
            Mode::Events => {
                tracing::info!(endpoint = %self.endpoint, rank = ?self.rank, "a full-attention KV-cache group announced: the rank's KV events apply again")
            }
        }
    }

    /// Forgets what the rank's engine held: a new engine run, or one that cannot be told from one.
    fn new_run(&mut self, why: &str) {
        // A new run may serve another model: its groups are learnt again from its stores.
        self.groups.reset();
        self.groups_logged = 0;
        self.seq.restarted();
        if self.fresh {
            return;
        }
        tracing::info!(endpoint = %self.endpoint, rank = ?self.rank, why, "KV-event publisher restarted; clearing rank");
        self.core.metrics().events.kv_resets.inc();
        self.core.clear_rank(self.rank);
        self.fresh = true;
    }

    /// Handles one live message.
    async fn handle(&mut self, seq: u64, print: u64, batch: EventBatch) {
        let metrics = self.core.metrics().clone();
        match self.seq.classify(seq, Instant::now()) {
            SeqAction::Apply => self.apply(seq, print, &batch, Source::Live),
            SeqAction::Duplicate => self.seq.duplicate(seq),
            SeqAction::Restart => {
                self.new_run("sequence went back");
                if seq > 0 && self.replay.is_some() {
                    // Messages of the new run that arrived while we reconnected.
                    self.replay_from(0).await;
                }
                if self.seq.classify(seq, Instant::now()) != SeqAction::Duplicate {
                    self.apply(seq, print, &batch, Source::Live);
                }
            }
            SeqAction::Gap { from } => {
                metrics.events.kv_event_gaps.inc();
                if self.replay.is_some() {
                    self.replay_from(from).await;
                } else {
                    tracing::warn!(endpoint = %self.endpoint, from, seq, "KV-event gap and no replay endpoint");
                }
                if self.seq.classify(seq, Instant::now()) != SeqAction::Duplicate {
                    self.apply(seq, print, &batch, Source::Live);
                }
            }
        }
    }

    /// Applies one replayed message past the last applied one; false when the replay skipped
    /// some sequence numbers or the message is undecodable (the replay is then incomplete).
    fn replayed(&mut self, seq: u64, payload: &[u8]) -> bool {
        let last = self.seq.last();
        if last.is_some_and(|last| seq <= last) {
            return true;
        }
        match decode_batch(payload) {
            Ok(batch) => {
                self.apply(seq, fingerprint(payload), &batch, Source::Replay);
                last.is_none_or(|last| seq == last.saturating_add(1))
            }
            Err(err) => {
                self.core
                    .metrics()
                    .events
                    .kv_events
                    .with_label_values(&["decode_error"])
                    .inc();
                tracing::debug!(%err, "undecodable replayed KV-event message");
                false
            }
        }
    }

    /// Asks the engine's replay socket for every message from `from` on and applies the new ones.
    /// Live messages queue in the SUB socket meanwhile and are deduplicated afterwards.
    async fn replay_from(&mut self, from: u64) {
        let Some(endpoint) = self.replay.clone() else {
            return;
        };
        let mut complete = true;
        let result = tokio::time::timeout(
            REPLAY_TOTAL,
            replay(&endpoint, from, |seq, payload| {
                complete &= self.replayed(seq, payload);
                Visit::Continue
            }),
        )
        .await;
        self.count_replay(&endpoint, result, complete);
        self.seq.replayed(from, Instant::now());
    }

    fn count_replay(
        &self,
        endpoint: &str,
        result: Result<Result<Ended, String>, tokio::time::error::Elapsed>,
        complete: bool,
    ) {
        let outcome = match result {
            Ok(Ok(_)) if complete => "ok",
            Ok(Ok(_)) | Err(_) => "incomplete",
            Ok(Err(err)) => {
                tracing::warn!(%endpoint, %err, "KV-event replay failed");
                "failed"
            }
        };
        self.core
            .metrics()
            .events
            .kv_replays
            .with_label_values(&[outcome])
            .inc();
    }

    /// After a lost subscription, before the rank takes picks again: is this the engine run the
    /// index follows? The replay from the last applied message must start with that very message
    /// (same number, same bytes); then the messages after it are applied and nothing is cleared
    /// (a network blip, a publisher that recovered). Anything else (another first message, none,
    /// a failed replay, no replay endpoint, nothing applied yet) is taken as a new run: the rank
    /// is cleared and the run replayed from 0.
    async fn resume(&mut self) {
        let (Some(endpoint), Some(last)) = (self.replay.clone(), self.seq.last()) else {
            self.new_run(if self.replay.is_none() {
                "resubscribed without a replay endpoint: a restart cannot be ruled out"
            } else {
                "resubscribed before any message applied"
            });
            self.replay_from(0).await;
            return;
        };
        let mut first = true;
        let mut same_run = false;
        let mut complete = true;
        let result = tokio::time::timeout(
            REPLAY_TOTAL,
            replay(&endpoint, last, |seq, payload| {
                if std::mem::take(&mut first) {
                    same_run = self.seq.continues(seq, fingerprint(payload));
                    return if same_run {
                        Visit::Continue
                    } else {
                        Visit::Stop
                    };
                }
                complete &= self.replayed(seq, payload);
                Visit::Continue
            }),
        )
        .await;
        if same_run {
            self.count_replay(&endpoint, result, complete);
            self.seq.replayed(last, Instant::now());
            tracing::debug!(endpoint = %self.endpoint, last, "resubscribed to the same engine run");
        } else {
            self.new_run("resubscribed to a new engine run");
            self.replay_from(0).await;
        }
    }

    async fn on_message(&mut self, message: &ZmqMessage) {
        let frames: Vec<&[u8]> = message.iter().map(|f| f.as_ref()).collect();
        match decode_message(&frames) {
            Ok((_, seq, batch)) => {
                let print = frames.last().map_or(0, |p| fingerprint(p));
                self.handle(seq, print, batch).await;
            }
            Err(err) => {
                self.core
                    .metrics()
                    .events
                    .kv_events
                    .with_label_values(&["decode_error"])
                    .inc();
                tracing::debug!(endpoint = %self.endpoint, %err, "undecodable KV-event message");
            }
        }
    }

    /// Applies messages until the subscription is lost (the monitor's `Disconnected`, or a
    /// receive error). While the rank is held unreachable its endpoint is probed meanwhile (a
    /// restarted vLLM publishes before its HTTP server listens).
    async fn stream(&mut self, sub: &mut link::Subscription) {
        let mut probe = tokio::time::interval(PROBE_INTERVAL);
        let link::Subscription { socket, monitor } = sub;
        loop {
            tokio::select! {
                event = monitor.next() => match event {
                    Some(SocketEvent::Disconnected(_)) | None => return,
                    Some(_) => {}
                },
                message = socket.recv() => match message {
                    Ok(message) => self.on_message(&message).await,
                    Err(_) => return,
                },
                _ = probe.tick(), if !self.reach.reachable() => {
                    if self.reach.probe().await {
                        self.reach.set(true);
                    }
                }
            }
        }
    }

    /// Waits `delay` before the next subscription attempt, probing the engine's endpoint every
    /// [`PROBE_INTERVAL`]: refusing, the rank is reported unreachable. Returns early (true) when
    /// an engine held unreachable answers again, so that its subscription is tried, and a
    /// restart cleared, before it takes picks.
    async fn wait_down(&mut self, delay: Duration) -> bool {
        let until = tokio::time::Instant::now() + delay;
        loop {
            if self.reach.probe().await {
                if !self.reach.reachable() {
                    return true;
                }
            } else {
                self.reach.set(false);
            }
            let now = tokio::time::Instant::now();
            if now >= until {
                return false;
            }
            tokio::time::sleep((until - now).min(PROBE_INTERVAL)).await;
        }
    }

    /// Subscribes, applies, and after a loss watches the engine and resubscribes, until
    /// cancelled.
    async fn run(mut self) {
        let metrics = self.core.metrics().clone();
        let mut backoff = Backoff::default();
        let mut lost = false;
        let mut answered = false;
        loop {
            match link::subscribe(&self.endpoint).await {
                Ok(mut sub) => {
                    backoff.reset();
                    let connected = link::Connected::new(&metrics.events.kv_subscriptions);
                    if lost {
                        self.resume().await;
                        tracing::info!(endpoint = %self.endpoint, rank = ?self.rank, "KV-event subscription restored");
                    } else {
                        tracing::info!(endpoint = %self.endpoint, rank = ?self.rank, "subscribed to KV events");
                        // Catch up on what the engine already holds.
                        self.replay_from(0).await;
                    }
                    if !self.reach.reachable() && (answered || self.reach.probe().await) {
                        self.reach.set(true);
                    }
                    self.stream(&mut sub).await;
                    drop(sub);
                    drop(connected);
                    lost = true;
                    tracing::warn!(endpoint = %self.endpoint, rank = ?self.rank, "KV-event subscription lost; probing the engine and resubscribing");
                }
                Err(err) => {
                    tracing::debug!(endpoint = %self.endpoint, %err, "KV-event subscribe failed; retrying");
                    if answered {
                        // The engine serves again but publishes nothing (yet). It refused
                        // connections (or was gone) meanwhile: a new process, whose cache is
                        // empty, cannot be ruled out. It takes picks again, cleared.
                        self.new_run("the engine answers again; its KV events are not back yet");
                        self.reach.set(true);
                    }
                }
            }
            answered = self.wait_down(backoff.next_wait()).await;
        }
    }
}

/// Counts a batch's stores and removes by group kind and outcome, one counter update per distinct
/// outcome (a batch holds hundreds of events of a few outcomes).
fn count_kinds(core: &SelectionCore, outcomes: &[Outcome]) {
    let mut counts: Vec<(Outcome, u64)> = Vec::new();
    for outcome in outcomes {
        match counts.iter_mut().find(|(o, _)| o == outcome) {
            Some((_, n)) => *n += 1,
            None => counts.push((*outcome, 1)),
        }
    }
    let counter = &core.metrics().events.kv_events_by_kind;
    for (o, n) in counts {
        let outcome = if o.admitted { "admitted" } else { "dropped" };
        counter
            .with_label_values(&[o.event, o.class.label(), outcome])
            .inc_by(n);
    }
}

/// Keeps one subscription per rank that declares a KV-event endpoint, following catalog changes
/// ([`super::Plan`]): new ranks are subscribed, removed or re-addressed ones stopped, unchanged
/// ones left alone.
pub async fn manage(core: Arc<SelectionCore>, mut catalog_changes: watch::Receiver<u64>) {
    let mut plan = super::Plan::default();
    let mut running: HashMap<RankKey, JoinHandle<()>> = HashMap::new();
    loop {
        let change = core.inner().with_records(|records| plan.update(records));
        for rank in change.stop {
            if let Some(task) = running.remove(&rank) {
                task.abort();
            }
        }
        for (rank, endpoint, replay) in change.start {
            let stream = RankStream::new(Arc::clone(&core), rank, endpoint, replay);
            if let Some(old) = running.insert(rank, tokio::spawn(stream.run())) {
                old.abort();
            }
        }
        if catalog_changes.changed().await.is_err() {
            for task in running.into_values() {
                task.abort();
            }
            return;
        }
    }
}

#[cfg(test)]
#[path = "ingest_tests.rs"]
mod tests;
