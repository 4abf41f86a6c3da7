//! Cleared ranks' ids on their way back to the free list. Clearing a rank (its pod restarted or
//! left, its engine sent `AllBlocksCleared`) only retires its id: the match walks skip holders
//! whose id is retired, and the purge steps drop them shard by shard. An id is reusable once a
//! full round of purge steps (one per shard) has run since it retired, so no holder of the old
//! rank can be mistaken for the id's next owner. Owns only that bookkeeping; the index decides
//! what a retired holder means ([`super`]).

use std::collections::VecDeque;

use super::PURGE_SHARDS;

#[derive(Debug, Default)]
pub(super) struct Retiring {
    /// Retired ids with the purge step count when they retired, oldest first.
    pending: VecDeque<(u32, u64)>,
    /// Purge steps run so far.
    steps: u64,
}

impl Retiring {
    pub fn retire(&mut self, id: u32) {
        self.pending.push_back((id, self.steps));
    }

    pub fn is_empty(&self) -> bool {
        self.pending.is_empty()
    }

    pub fn len(&self) -> usize {
        self.pending.len()
    }

    pub fn ids(&self) -> impl Iterator<Item = u32> + '_ {
        self.pending.iter().map(|(id, _)| *id)
    }

    /// Counts one purge step; returns the ids every shard has been purged of since.
    pub fn stepped(&mut self) -> Vec<u32> {
        self.steps = self.steps.wrapping_add(1);
        let mut ready = Vec::new();
        while let Some(&(id, at)) = self.pending.front() {
            if self.steps.wrapping_sub(at) < PURGE_SHARDS as u64 {
                break;
            }
            self.pending.pop_front();
            ready.push(id);
        }
        ready
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_id_is_free_after_one_step_per_shard_and_not_before() {
        let mut r = Retiring::default();
        r.retire(4);
        for _ in 0..PURGE_SHARDS - 1 {
            assert!(r.stepped().is_empty());
        }
        r.retire(5);
        assert_eq!(r.stepped(), vec![4]);
        assert_eq!(r.len(), 1);
        // 5 retired one step before 4 was freed.
        for _ in 0..PURGE_SHARDS - 2 {
            assert!(r.stepped().is_empty());
        }
        assert_eq!(r.stepped(), vec![5]);
        assert!(r.is_empty());
    }
}
