//! Sequence bookkeeping of one KV-event publisher, separate from sockets so it is unit-testable:
//! what a message's sequence number means (next, duplicate, gap, restart), and the fingerprint of
//! the last applied message, which tells a reconnect to the same engine run from a new run (see
//! [`SequenceTracker::continues`]).
//!
//! It owns numbers only; sockets and the index are [`super::ingest`]'s and the core's.

use std::time::Instant;

/// How long after a replay queued live messages may still arrive as duplicates of it. They sat
/// in the socket while the replay ran and are read right after it, so anything later that goes
/// backwards is a new engine run, not a duplicate.
pub const DUPLICATE_WINDOW: std::time::Duration = std::time::Duration::from_secs(2);

/// The fingerprint of a message's payload: an engine's replay sends the very bytes it published
/// live, and a new engine run's message of the same number carries other bytes (its own
/// timestamp, its own blocks).
pub fn fingerprint(payload: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(payload)
}

#[derive(Debug, Default)]
pub struct SequenceTracker {
    last: Option<u64>,
    /// The fingerprint of message `last`.
    fingerprint: Option<u64>,
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

    /// Message `seq` (payload fingerprint `fingerprint`) was applied. A live message past the
    /// replayed range closes the window in which older sequence numbers count as duplicates
    /// (after it, going backwards is a restart).
    pub fn applied(&mut self, seq: u64, fingerprint: u64) {
        self.last = Some(seq);
        self.fingerprint = Some(fingerprint);
        self.duplicates = None;
    }

    /// A queued copy of a replayed message was dropped: the next copy comes after it.
    pub fn duplicate(&mut self, seq: u64) {
        if let Some((from, _)) = &mut self.duplicates {
            *from = (*from).max(seq.saturating_add(1));
        }
    }

    /// A new engine run: the next message applies whatever its number.
    pub fn restarted(&mut self) {
        *self = SequenceTracker::default();
    }

    pub fn replayed(&mut self, from: u64, now: Instant) {
        self.duplicates = Some((from, now + DUPLICATE_WINDOW));
    }

    pub fn last(&self) -> Option<u64> {
        self.last
    }

    /// Whether the engine's replay from [`Self::last`], whose first message is `(seq,
    /// fingerprint)`, continues the run this tracker followed: it still holds the last message
    /// applied, byte for byte. A new run numbers from 0 again, so its message of that number (if
    /// it has one yet) carries other bytes; a replay that starts elsewhere (the message fell out
    /// of the engine's buffer) cannot prove continuity either.
    pub fn continues(&self, seq: u64, fingerprint: u64) -> bool {
        self.last == Some(seq) && self.fingerprint == Some(fingerprint)
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
        t.applied(5, 0);
        assert_eq!(t.classify(6, now), SeqAction::Apply);
        assert_eq!(t.classify(5, now), SeqAction::Duplicate);
        assert_eq!(t.classify(9, now), SeqAction::Gap { from: 6 });
        assert_eq!(t.classify(0, now), SeqAction::Restart);
        assert_eq!(t.classify(3, now), SeqAction::Restart);
        // A replay from 3 applied 3..=8; live copies of 3..=8 still queued are duplicates.
        t.applied(8, 0);
        t.replayed(3, now);
        assert_eq!(
            t.classify(4, now),
            SeqAction::Duplicate,
            "queued live copy of a replayed message"
        );
        assert_eq!(t.classify(2, now), SeqAction::Restart);
        // Once the live stream moves past the replay, going backwards means a restart again.
        t.applied(9, 0);
        assert_eq!(t.classify(4, now), SeqAction::Restart);
        t.restarted();
        assert_eq!(t.classify(0, now), SeqAction::Apply);
    }

    /// A replay at subscribe time covers 0..=last. A much later engine restart whose sequence
    /// starts again at 0 must not be taken for queued copies of that replay.
    #[test]
    fn the_duplicate_window_after_a_replay_is_short_and_follows_the_copies() {
        let t0 = Instant::now();
        let mut t = SequenceTracker::default();
        t.applied(10, 0);
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

    #[test]
    fn only_the_last_message_byte_for_byte_continues_a_run() {
        let mut t = SequenceTracker::default();
        assert!(
            !t.continues(0, fingerprint(b"x")),
            "nothing applied: nothing to prove"
        );
        t.applied(7, fingerprint(b"batch seven"));
        assert!(t.continues(7, fingerprint(b"batch seven")));
        assert!(
            !t.continues(7, fingerprint(b"another run's seven")),
            "a new run that reached the same number"
        );
        assert!(
            !t.continues(8, fingerprint(b"batch seven")),
            "the buffer lost 7"
        );
        t.restarted();
        assert!(!t.continues(7, fingerprint(b"batch seven")));
    }
}
