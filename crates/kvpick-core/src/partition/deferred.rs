//! A pick's predicted index entries, and the end of them when its request ends or fails,
//! written after the partition's state lock is released instead of inside it. Owns the state
//! guard ([`StateGuard`]) that writes them on unlock and the state's access to the KV side
//! ([`State::kv_read`], [`State::kv_write`]), which writes them first; what an entry means stays
//! with the index, when one is predicted or ended with the booking ([`super::health`]).
//!
//! Why: a booked pick inserts every prompt block for its rank (hundreds of hash-table writes),
//! and while that ran under the state lock every other pick of the partition waited for it.
//! Deferred, the state lock covers only the decision and the booking, and the insert waits
//! only for the KV write lock.
//!
//! No decision changes in any sequential order of operations (the index-size fact now comes at
//! the release, not at the booking): a deferred insert is
//! written before anything under the state lock reads or writes the KV side again, and, once
//! the lock is released, before the releasing call returns. So the next pick's walk, a KV event
//! applied under the state lock, a failed request's withdrawal or a clear all see it as if it
//! had been written at booking time. Only an operation racing the releasing thread on another
//! core can find it not yet written — as it could find the pick not yet made. One such race is
//! closed: a rank cleared (left, restarted, `AllBlocksCleared`, new block size) between the
//! booking and the write gets no predicted entries from before its clear ([`ClearLog`]).

use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use parking_lot::{MutexGuard, RwLockReadGuard, RwLockWriteGuard};

use super::{health, Kv, Partition, State};
use crate::facts::Facts;
use crate::index::Tier;
use crate::types::RankKey;

/// One pick's predicted (or approximate) entries for one rank, or the end of them, not yet
/// written to the index.
#[derive(Debug)]
pub(super) struct Prediction {
    rank: RankKey,
    /// The prompt's chain (shared with its booking); the entries from `from` on.
    hashes: Arc<[u64]>,
    from: usize,
    op: Op,
    /// The latest clear's number ([`ClearLog`]) when it was made: a clear of its rank since
    /// then drops it.
    clears: u64,
}

#[derive(Debug, Clone, Copy)]
enum Op {
    /// Insert (or refresh) the entries, expiring at the instant (`None`: never).
    Insert(Option<Instant>),
    /// Drop the rank's expiring entries (its engine's confirmed ones stay).
    Drop,
    /// Bring the rank's expiring entries to expire by the instant at the latest.
    ExpireBy(Instant),
}

/// Clears remembered by number, so a deferred prediction can tell whether its own rank was
/// cleared since it was made: past this many, an older prediction is dropped unchecked.
pub(super) const CLEARS_KEPT: usize = 64;

/// The KV side's recent clears, numbered by a counter the state reads without the KV lock: the
/// ranks each cleared, or `None` for a reset (every rank).
#[derive(Debug)]
pub(super) struct ClearLog {
    /// The number of the latest clear (0: none yet); shared with [`State`].
    counter: Arc<AtomicU64>,
    entries: std::collections::VecDeque<(u64, Option<Vec<RankKey>>)>,
}

impl ClearLog {
    pub(super) fn new(counter: Arc<AtomicU64>) -> Self {
        ClearLog {
            counter,
            entries: Default::default(),
        }
    }

    /// The number of the latest clear.
    pub(super) fn latest(&self) -> u64 {
        self.counter.load(Ordering::Acquire)
    }

    /// Numbers and remembers a clear of `ranks` (`None`: all of them).
    pub(super) fn record(&mut self, ranks: Option<&[RankKey]>) {
        let number = self.counter.fetch_add(1, Ordering::AcqRel).wrapping_add(1);
        if self.entries.len() == CLEARS_KEPT {
            self.entries.pop_front();
        }
        self.entries
            .push_back((number, ranks.map(<[RankKey]>::to_vec)));
    }

    /// Whether `rank` may have been cleared after clear number `since` (true when the clears
    /// since are no longer all remembered).
    fn cleared_since(&self, since: u64, rank: RankKey) -> bool {
        if since == self.latest() {
            return false;
        }
        let oldest = self.entries.front().map_or(u64::MAX, |e| e.0);
        if oldest > since.wrapping_add(1) {
            return true;
        }
        self.entries
            .iter()
            .filter(|(number, _)| *number > since)
            .any(|(_, ranks)| ranks.as_ref().is_none_or(|r| r.contains(&rank)))
    }
}

/// Writes the predictions (and ends of predictions) into the index in the order they were
/// made, except those whose rank was cleared since; true when any was written.
fn write(kv: &mut Kv, pending: Vec<Prediction>) -> bool {
    let mut wrote = false;
    for p in pending {
        if kv.clear_log.cleared_since(p.clears, p.rank) {
            continue;
        }
        let hashes = p.hashes.get(p.from..).unwrap_or_default();
        match p.op {
            Op::Insert(expires) => kv.index.insert(p.rank, hashes, Tier::Gpu, expires),
            Op::Drop => {
                for &h in hashes {
                    kv.index.drop_expiring(p.rank, h, Tier::Gpu);
                }
            }
            Op::ExpireBy(at) => {
                for &h in hashes {
                    kv.index.expire_by(p.rank, h, Tier::Gpu, at);
                }
            }
        }
        wrote = true;
    }
    wrote
}

impl State {
    /// Records that `rank` will hold the prompt `hashes` (predicted entries, or approximate
    /// ones with the longer TTL): written when the KV side is next touched or the lock released.
    pub(super) fn predict(&self, rank: RankKey, hashes: &Arc<[u64]>, expires: Option<Instant>) {
        self.defer(rank, Arc::clone(hashes), 0, Op::Insert(expires));
    }

    /// Ends what a pick predicted ([`health::PredictedChain`]): the rank's expiring entries of
    /// the chain go, written like a prediction (in order after it).
    pub(super) fn unpredict(&self, chain: health::PredictedChain) {
        self.defer(chain.rank, chain.hashes, chain.from, Op::Drop);
    }

    /// Ends what a pick predicted at its request's end: the rank's expiring entries of the
    /// chain expire by `at` (the engine's events for them may still be on their way).
    pub(super) fn end_prediction(&self, chain: health::PredictedChain, at: Instant) {
        self.defer(chain.rank, chain.hashes, chain.from, Op::ExpireBy(at));
    }

    fn defer(&self, rank: RankKey, hashes: Arc<[u64]>, from: usize, op: Op) {
        if hashes.len() <= from {
            return;
        }
        self.deferred.borrow_mut().push(Prediction {
            rank,
            hashes,
            from,
            op,
            clears: self.clears.load(Ordering::Acquire),
        });
    }

    /// The index's rank epoch as the KV side would read it (deferred predictions may intern
    /// ranks), without its lock when nothing is deferred.
    pub(super) fn index_epoch(&self) -> u64 {
        if self.deferred.borrow().is_empty() {
            self.rank_epoch.load(Ordering::Acquire)
        } else {
            self.kv_read().index.rank_epoch()
        }
    }

    /// The KV side for reading, with every deferred prediction written first.
    pub(super) fn kv_read(&self) -> RwLockReadGuard<'_, Kv> {
        if self.deferred.borrow().is_empty() {
            return self.kv_lock.read();
        }
        RwLockWriteGuard::downgrade(self.kv_write())
    }

    /// The KV side for writing, with every deferred prediction written first.
    pub(super) fn kv_write(&self) -> RwLockWriteGuard<'_, Kv> {
        let mut kv = self.kv_lock.write();
        let pending = self.deferred.take();
        if !pending.is_empty() && write(&mut kv, pending) {
            self.index_grew.set(true);
        }
        kv
    }
}

/// The partition's state, locked; on release it lets the state lock go, then writes the
/// predictions made under it under the KV write lock.
pub(super) struct StateGuard<'a> {
    state: Option<MutexGuard<'a, State>>,
    partition: &'a Partition,
}

impl Partition {
    /// Locks the partition's state ([`StateGuard`]).
    pub(super) fn lock_state(&self) -> StateGuard<'_> {
        StateGuard {
            state: Some(self.state.lock()),
            partition: self,
        }
    }
}

impl StateGuard<'_> {
    /// Releases the lock, writes the deferred predictions and, when any prediction made under
    /// the lock was written (now or earlier, before a KV access), reports the index's new size.
    pub(super) fn unlock(mut self, facts: &mut Facts) {
        if self.release() {
            facts.push(
                self.partition
                    .index_size_of(&self.partition.kv.read(), None),
            );
        }
    }

    fn release(&mut self) -> bool {
        let Some(state) = self.state.take() else {
            return false;
        };
        let pending = state.deferred.take();
        let grew = state.index_grew.replace(false);
        drop(state);
        let wrote = !pending.is_empty() && write(&mut self.partition.kv.write(), pending);
        grew || wrote
    }
}

impl Drop for StateGuard<'_> {
    fn drop(&mut self) {
        self.release();
    }
}

// The guard holds the state from construction until `release`, which only `unlock` and `drop`
// call, each consuming the guard: a dereference never finds it empty.
#[allow(clippy::expect_used)]
impl Deref for StateGuard<'_> {
    type Target = State;
    fn deref(&self) -> &State {
        self.state.as_deref().expect("state guard in use")
    }
}

#[allow(clippy::expect_used)]
impl DerefMut for StateGuard<'_> {
    fn deref_mut(&mut self) -> &mut State {
        self.state.as_deref_mut().expect("state guard in use")
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use crate::catalog::RankLayout;
    use crate::facts::{Fact, Facts};
    use crate::request::{PromptInput, SelectionRequest};
    use crate::types::RankKey;
    use crate::{Core, CoreConfig, WorkerSpec};

    /// One worker with two ranks; the partition, both rank keys and a request for it.
    fn partition() -> (std::sync::Arc<super::Partition>, RankKey, RankKey) {
        let core = Core::new(CoreConfig::default());
        let spec = WorkerSpec::for_test("w", "m", RankLayout::PerPort(vec![1, 2]));
        core.apply_source_snapshot("catalog", vec![spec], Instant::now())
            .unwrap();
        let request = SelectionRequest {
            model: Some("m".into()),
            prompt: PromptInput::Tokens(Vec::new()),
            ..Default::default()
        };
        let partition = core.partition_for_test(&request);
        let mut ranks: Vec<RankKey> = partition.lock_state().ranks.keys().copied().collect();
        ranks.sort();
        (partition, ranks[0], ranks[1])
    }

    const HASHES: [u64; 3] = [11, 12, 13];

    fn chain() -> std::sync::Arc<[u64]> {
        std::sync::Arc::from(&HASHES[..])
    }

    fn depth(partition: &super::Partition, rank: RankKey) -> u32 {
        let kv = partition.kv.read();
        kv.index
            .find_matches(&HASHES, Instant::now())
            .into_iter()
            .find(|(r, _)| *r == rank)
            .map_or(0, |(_, d)| d.gpu)
    }

    #[test]
    fn a_prediction_is_written_when_the_state_lock_is_released_and_its_size_reported() {
        let (partition, rank, _) = partition();
        let guard = partition.lock_state();
        guard.predict(rank, &chain(), None);
        // Not yet: the insert waits for the state lock's release.
        assert_eq!(partition.kv.read().index.len(), 0);
        let mut facts = Facts::default();
        guard.unlock(&mut facts);
        assert_eq!(depth(&partition, rank), 3);
        assert!(facts
            .iter()
            .any(|f| matches!(f, Fact::IndexSize { blocks: 3, .. })));
    }

    #[test]
    fn the_kv_side_read_under_the_lock_sees_the_prediction_first() {
        let (partition, rank, _) = partition();
        let guard = partition.lock_state();
        guard.predict(rank, &chain(), None);
        let matched = guard.kv_read().index.find_matches(&HASHES, Instant::now());
        assert_eq!(matched.len(), 1);
        assert_eq!(matched[0].1.gpu, 3);
        drop(guard);
        // Written once, not again at the release.
        assert_eq!(partition.kv.read().index.len(), 3);
    }

    #[test]
    fn a_drop_without_unlock_still_writes_the_prediction() {
        let (partition, rank, _) = partition();
        {
            let guard = partition.lock_state();
            guard.predict(rank, &chain(), None);
        }
        assert_eq!(depth(&partition, rank), 3);
    }

    // The window these tests stand for: the predicting thread has let the state lock go and not
    // yet taken the KV write lock when another thread clears (a pod change under the state lock,
    // an engine's AllBlocksCleared on the KV-only path). A clear taken while the guard is held
    // reaches the same check.

    #[test]
    fn a_clear_of_the_rank_between_the_booking_and_the_write_drops_its_prediction() {
        let (partition, rank, other) = partition();
        let guard = partition.lock_state();
        guard.predict(rank, &chain(), None);
        guard.predict(other, &chain(), None);
        partition.kv.write().clear_ranks(&[rank]);
        drop(guard);
        assert_eq!(depth(&partition, rank), 0);
        // Another rank's prediction is not the cleared rank's: it stays.
        assert_eq!(depth(&partition, other), 3);
        // Predictions made after the clear are written as usual.
        let guard = partition.lock_state();
        guard.predict(rank, &chain(), None);
        drop(guard);
        assert_eq!(depth(&partition, rank), 3);
    }

    #[test]
    fn an_engines_all_blocks_cleared_drops_the_ranks_pending_prediction() {
        let (partition, rank, _) = partition();
        let guard = partition.lock_state();
        guard.predict(rank, &chain(), None);
        let (stats, _) = partition.apply_to(
            &mut partition.kv.write(),
            rank,
            &[crate::event::KvEvent::AllBlocksCleared],
        );
        assert_eq!(stats.applied, 1);
        drop(guard);
        assert_eq!(depth(&partition, rank), 0);
    }

    #[test]
    fn clearing_no_rank_is_no_clear() {
        let (partition, rank, _) = partition();
        let guard = partition.lock_state();
        guard.predict(rank, &chain(), None);
        let before = partition.kv.read().clear_log.latest();
        partition.kv.write().clear_ranks(&[]);
        assert_eq!(partition.kv.read().clear_log.latest(), before);
        drop(guard);
        assert_eq!(depth(&partition, rank), 3);
    }

    /// `n` clears of other ranks while `rank`'s prediction waits.
    fn prediction_after_clears_of_others(n: usize) -> u32 {
        let (partition, rank, other) = partition();
        let guard = partition.lock_state();
        guard.predict(rank, &chain(), None);
        for _ in 0..n {
            partition.kv.write().clear_ranks(&[other]);
        }
        drop(guard);
        depth(&partition, rank)
    }

    #[test]
    fn clears_of_other_ranks_keep_the_prediction_while_remembered_and_drop_it_past_that() {
        assert_eq!(prediction_after_clears_of_others(super::CLEARS_KEPT), 3);
        // One more than the log keeps: whether `rank` was among them is no longer known.
        assert_eq!(prediction_after_clears_of_others(super::CLEARS_KEPT + 1), 0);
    }

    #[test]
    fn a_prediction_written_before_a_kv_access_is_still_reported_at_unlock() {
        let (partition, rank, _) = partition();
        let guard = partition.lock_state();
        guard.predict(rank, &chain(), None);
        drop(guard.kv_read());
        let mut facts = Facts::default();
        guard.unlock(&mut facts);
        assert!(facts
            .iter()
            .any(|f| matches!(f, Fact::IndexSize { blocks: 3, .. })));
    }
}
