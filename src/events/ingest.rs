//! KV-event ingestion: one ZeroMQ SUB per rank at the endpoint the catalog gives, decoded batches
//! applied to the selection core in sequence order. Tracks the publisher's sequence: a gap is
//! filled from the engine's replay (DEALER -> ROUTER) socket when one is configured, a sequence
//! that goes backwards means the engine restarted and clears the rank. A bad message is counted
//! and skipped; nothing here can stop ingestion for good.
//!
//! This module owns sockets and sequence bookkeeping only; what an event means for the index is
//! the selection core's business.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tokio::sync::watch;
use tokio::task::JoinHandle;
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

use super::decode::{decode_batch, decode_message, decode_seq, EventBatch, REPLAY_END_SEQ};
use crate::selection::{RankKey, SelectionCore};

const BACKOFF_START: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(5);
/// How long a replay may go without a reply before it is abandoned as incomplete.
const REPLAY_TIMEOUT: Duration = Duration::from_secs(5);

/// How long after a replay queued live messages may still arrive as duplicates of it. They sat
/// in the socket while the replay ran and are read right after it, so anything later that goes
/// backwards is a new engine run, not a duplicate.
pub const DUPLICATE_WINDOW: Duration = Duration::from_secs(2);

/// A batch's lag further from the engine's clock than this is no lag but a timestamp in another
/// unit or epoch (or a clock far off): it is not observed.
pub const MAX_EVENT_LAG: Duration = Duration::from_secs(3600);

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

/// Sequence bookkeeping of one publisher, separate from sockets so it is unit-testable.
#[derive(Debug, Default)]
pub struct SequenceTracker {
    last: Option<u64>,
    /// Right after a replay from `n`, queued live messages with `n <= seq <= last` are
    /// duplicates: `(lowest duplicate still expected, window end)`. Duplicates arrive in order,
    /// so the low end follows them; the window closes at the next applied message or at its end.
    duplicates: Option<(u64, Instant)>,
}

/// What to do with a message of sequence `seq`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeqAction {
    Apply,
    /// Already applied (seen live and in a replay).
    Duplicate,
    /// Messages `from ..< seq` were lost: replay them if possible, then apply.
    Gap {
        from: u64,
    },
    /// The publisher restarted: clear the rank, then apply.
    Restart,
}

impl SequenceTracker {
    pub fn classify(&self, seq: u64, now: Instant) -> SeqAction {
        let queued_copy = self
            .duplicates
            .is_some_and(|(from, until)| seq >= from && now < until);
        match self.last {
            None => SeqAction::Apply,
            Some(last) if seq == last.saturating_add(1) => SeqAction::Apply,
            Some(last) if seq > last => SeqAction::Gap {
                from: last.saturating_add(1),
            },
            Some(_) if queued_copy => SeqAction::Duplicate,
            Some(last) if seq == last => SeqAction::Duplicate,
            Some(_) => SeqAction::Restart,
        }
    }

    /// A message was applied. A live message past the replayed range closes the window in
    /// which older sequence numbers count as duplicates (after it, going backwards is a restart).
    pub fn applied(&mut self, seq: u64) {
        self.last = Some(seq);
        self.duplicates = None;
    }

    /// A queued copy of a replayed message was dropped: the next copy comes after it.
    pub fn duplicate(&mut self, seq: u64) {
        if let Some((from, _)) = &mut self.duplicates {
            *from = (*from).max(seq.saturating_add(1));
        }
    }

    pub fn restarted(&mut self) {
        self.last = None;
        self.duplicates = None;
    }

    pub fn replayed(&mut self, from: u64, now: Instant) {
        self.duplicates = Some((from, now + DUPLICATE_WINDOW));
    }

    pub fn last(&self) -> Option<u64> {
        self.last
    }
}

struct RankStream {
    core: Arc<SelectionCore>,
    rank: RankKey,
    endpoint: String,
    replay: Option<String>,
    seq: SequenceTracker,
}

impl RankStream {
    fn apply(&mut self, seq: u64, batch: &EventBatch) {
        if batch.skipped_unknown > 0 {
            self.core
                .metrics()
                .events
                .kv_events
                .with_label_values(&["unknown_type"])
                .inc_by(batch.skipped_unknown as u64);
        }
        self.core.apply_kv_events(self.rank, &batch.events);
        self.seq.applied(seq);
        if let Some(lag) = event_lag(batch.ts, SystemTime::now()) {
            self.core
                .metrics()
                .events
                .event_lag
                .observe(lag.as_secs_f64());
        }
    }

    /// Handles one live message.
    async fn handle(&mut self, seq: u64, batch: EventBatch) {
        let metrics = self.core.metrics().clone();
        match self.seq.classify(seq, Instant::now()) {
            SeqAction::Apply => self.apply(seq, &batch),
            SeqAction::Duplicate => self.seq.duplicate(seq),
            SeqAction::Restart => {
                tracing::info!(endpoint = %self.endpoint, seq, "KV-event publisher restarted; clearing rank");
                metrics.events.kv_resets.inc();
                self.core.clear_rank(self.rank);
                self.seq.restarted();
                if seq > 0 && self.replay.is_some() {
                    // Messages of the new run that arrived while we reconnected.
                    self.replay_from(0).await;
                }
                if self.seq.classify(seq, Instant::now()) != SeqAction::Duplicate {
                    self.apply(seq, &batch);
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
                    self.apply(seq, &batch);
                }
            }
        }
    }

    /// Asks the engine's replay socket for every message from `from` on and applies the new ones.
    /// Live messages queue in the SUB socket meanwhile and are deduplicated afterwards.
    async fn replay_from(&mut self, from: u64) {
        let Some(endpoint) = self.replay.clone() else {
            return;
        };
        let metrics = self.core.metrics().clone();
        let result =
            tokio::time::timeout(REPLAY_TIMEOUT * 4, self.replay_inner(&endpoint, from)).await;
        let outcome = match result {
            Ok(Ok(true)) => "ok",
            Ok(Ok(false)) => "incomplete",
            Ok(Err(err)) => {
                tracing::warn!(%endpoint, %err, "KV-event replay failed");
                "failed"
            }
            Err(_) => "incomplete",
        };
        metrics
            .events
            .kv_replays
            .with_label_values(&[outcome])
            .inc();
        self.seq.replayed(from, Instant::now());
    }

    /// Returns whether the replay reached its end marker with no missing sequence numbers.
    async fn replay_inner(&mut self, endpoint: &str, from: u64) -> Result<bool, String> {
        let mut dealer = DealerSocket::new();
        dealer.connect(endpoint).await.map_err(|e| e.to_string())?;
        let mut request = ZmqMessage::from(Vec::<u8>::new());
        request.push_back(from.to_be_bytes().to_vec().into());
        dealer.send(request).await.map_err(|e| e.to_string())?;
        let mut complete = true;
        loop {
            let reply = tokio::time::timeout(REPLAY_TIMEOUT, dealer.recv())
                .await
                .map_err(|_| "replay timed out".to_string())?
                .map_err(|e| e.to_string())?;
            let mut frames: Vec<&[u8]> = reply.iter().map(|f| f.as_ref()).collect();
            // Replies are [b"", (topic,) seq, payload]; drop the delimiter and any topic.
            if frames.first().is_some_and(|f| f.is_empty()) {
                frames.remove(0);
            }
            if frames.len() > 2 {
                frames.drain(..frames.len() - 2);
            }
            let [seq_frame, payload] = frames[..] else {
                return Err(format!("replay reply with {} frames", frames.len()));
            };
            let seq = decode_seq(seq_frame).map_err(|e| e.to_string())?;
            if seq == REPLAY_END_SEQ {
                return Ok(complete);
            }
            match decode_batch(payload) {
                Ok(batch) => {
                    if let Some(last) = self.seq.last() {
                        if seq <= last {
                            continue;
                        }
                        if seq > last + 1 {
                            complete = false;
                        }
                    }
                    self.apply(seq, &batch);
                }
                Err(err) => {
                    self.core
                        .metrics()
                        .events
                        .kv_events
                        .with_label_values(&["decode_error"])
                        .inc();
                    tracing::debug!(%err, "undecodable replayed KV-event message");
                    complete = false;
                }
            }
        }
    }

    /// Subscribes (retrying with backoff) and applies messages until cancelled.
    async fn run(mut self) {
        let metrics = self.core.metrics().clone();
        let mut backoff = BACKOFF_START;
        let mut first = true;
        loop {
            let mut sub = SubSocket::new();
            let connected = async {
                sub.connect(&self.endpoint).await?;
                sub.subscribe("").await
            }
            .await;
            if let Err(err) = connected {
                tracing::debug!(endpoint = %self.endpoint, %err, "KV-event subscribe failed; retrying");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(BACKOFF_MAX);
                continue;
            }
            backoff = BACKOFF_START;
            metrics.events.kv_subscriptions.inc();
            tracing::info!(endpoint = %self.endpoint, rank = ?self.rank, "subscribed to KV events");
            if first && self.replay.is_some() {
                // Catch up on what the engine already holds.
                self.replay_from(self.seq.last().map_or(0, |l| l + 1)).await;
            }
            first = false;
            loop {
                let message = match sub.recv().await {
                    Ok(m) => m,
                    Err(err) => {
                        tracing::warn!(endpoint = %self.endpoint, %err, "KV-event stream broke; resubscribing");
                        break;
                    }
                };
                let frames: Vec<&[u8]> = message.iter().map(|f| f.as_ref()).collect();
                match decode_message(&frames) {
                    Ok((_, seq, batch)) => self.handle(seq, batch).await,
                    Err(err) => {
                        metrics
                            .events
                            .kv_events
                            .with_label_values(&["decode_error"])
                            .inc();
                        tracing::debug!(endpoint = %self.endpoint, %err, "undecodable KV-event message");
                    }
                }
            }
            metrics.events.kv_subscriptions.dec();
        }
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
            let stream = RankStream {
                core: Arc::clone(&core),
                rank,
                endpoint,
                replay,
                seq: SequenceTracker::default(),
            };
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
mod tests {
    use super::*;

    #[test]
    fn sequence_rules() {
        let now = Instant::now();
        let mut t = SequenceTracker::default();
        assert_eq!(
            t.classify(5, now),
            SeqAction::Apply,
            "first message at any seq"
        );
        t.applied(5);
        assert_eq!(t.classify(6, now), SeqAction::Apply);
        assert_eq!(t.classify(5, now), SeqAction::Duplicate);
        assert_eq!(t.classify(9, now), SeqAction::Gap { from: 6 });
        assert_eq!(t.classify(0, now), SeqAction::Restart);
        assert_eq!(t.classify(3, now), SeqAction::Restart);
        // A replay from 3 applied 3..=8; live copies of 3..=8 still queued are duplicates.
        t.applied(8);
        t.replayed(3, now);
        assert_eq!(
            t.classify(4, now),
            SeqAction::Duplicate,
            "queued live copy of a replayed message"
        );
        assert_eq!(t.classify(2, now), SeqAction::Restart);
        // Once the live stream moves past the replay, going backwards means a restart again.
        t.applied(9);
        assert_eq!(t.classify(4, now), SeqAction::Restart);
        t.restarted();
        assert_eq!(t.classify(0, now), SeqAction::Apply);
    }

    #[test]
    fn event_lag_is_wall_clock_since_the_batch_timestamp_and_implausible_stamps_are_none() {
        let now = UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        let ts = 1_700_000_000.0 - 0.25;
        assert_eq!(event_lag(ts, now), Some(Duration::from_millis(250)));
        assert_eq!(
            event_lag(1_700_000_000.5, now),
            Some(Duration::ZERO),
            "a stamp ahead of our clock (skew) is no lag"
        );
        let just_over = 1_700_000_000.0 - MAX_EVENT_LAG.as_secs_f64() - 1.0;
        assert_eq!(event_lag(just_over, now), None, "an hour and a second");
        assert_eq!(event_lag(0.0, now), None);
        assert_eq!(event_lag(f64::NAN, now), None);
        assert_eq!(event_lag(1.7e12, now), None, "milliseconds, not seconds");
    }

    /// A replay at subscribe time covers 0..=last. A much later engine restart whose sequence
    /// starts again at 0 must not be taken for queued copies of that replay.
    #[test]
    fn the_duplicate_window_after_a_replay_is_short_and_follows_the_copies() {
        let t0 = Instant::now();
        let mut t = SequenceTracker::default();
        t.applied(10);
        t.replayed(0, t0);
        assert_eq!(t.classify(4, t0), SeqAction::Duplicate, "a queued copy");
        t.duplicate(4);
        assert_eq!(t.classify(5, t0), SeqAction::Duplicate, "the next copy");
        t.duplicate(5);
        assert_eq!(
            t.classify(0, t0),
            SeqAction::Restart,
            "copies arrive in order: going back below them is a new run"
        );
        let later = t0 + DUPLICATE_WINDOW;
        assert_eq!(
            t.classify(6, later),
            SeqAction::Restart,
            "past the window nothing old is a queued copy"
        );
    }
}
