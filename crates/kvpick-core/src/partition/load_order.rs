//! The partition's schedulable ranks ordered by the two load figures a rank's cost grows with
//! (ARCHITECTURE.md §4, "decisions that grow with matches"): its booked requests (every one is
//! stalled by a new prefill) and its queued prefill tokens. [`super::sparse`] walks these orders
//! cheapest first and stops once no rank left can beat the candidates it has, so a decision
//! costs what the prompt's matches cost, not what the partition's size costs.
//!
//! It owns only the orders and each rank's tie key; the rank table tells it what changed
//! ([`LoadOrder::upsert`], [`LoadOrder::remove`]). It never reads the index, bookings or costs.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::ops::Bound::{Excluded, Unbounded};

use crate::types::RankKey;

/// One rank's place in the orders: queued prefill tokens, then its tie key, then the rank.
pub(crate) type Place = (u64, u64, RankKey);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Indexed {
    requests: u64,
    prefill: u64,
    tie: u64,
}

#[derive(Debug, Default)]
pub(crate) struct LoadOrder {
    /// Booked requests -> the ranks with that many, by queued prefill (then tie key, rank).
    by_requests: BTreeMap<u64, BTreeSet<Place>>,
    /// Every indexed rank by queued prefill (then tie key, rank).
    by_prefill: BTreeSet<Place>,
    indexed: HashMap<RankKey, Indexed>,
}

impl LoadOrder {
    /// Places `key` with this load; returns whether it moved (a new rank or a changed load).
    pub fn upsert(&mut self, key: RankKey, requests: u64, prefill: u64) -> bool {
        if let Some(now) = self.indexed.get(&key) {
            if now.requests == requests && now.prefill == prefill {
                return false;
            }
        }
        let tie = self.remove(&key).unwrap_or(0);
        self.insert(key, requests, prefill, tie);
        true
    }

    /// The rank's tie key (it keeps its place in the load order, its position among equals moves).
    pub fn set_tie(&mut self, key: RankKey, tie: u64) {
        let Some(&Indexed {
            requests, prefill, ..
        }) = self.indexed.get(&key)
        else {
            return;
        };
        self.remove(&key);
        self.insert(key, requests, prefill, tie);
    }

    fn insert(&mut self, key: RankKey, requests: u64, prefill: u64, tie: u64) {
        let place = (prefill, tie, key);
        self.by_requests.entry(requests).or_default().insert(place);
        self.by_prefill.insert(place);
        self.indexed.insert(
            key,
            Indexed {
                requests,
                prefill,
                tie,
            },
        );
    }

    /// Takes `key` out of the orders; returns its tie key.
    pub fn remove(&mut self, key: &RankKey) -> Option<u64> {
        let at = self.indexed.remove(key)?;
        let place = (at.prefill, at.tie, *key);
        self.by_prefill.remove(&place);
        if let Some(set) = self.by_requests.get_mut(&at.requests) {
            set.remove(&place);
            if set.is_empty() {
                self.by_requests.remove(&at.requests);
            }
        }
        Some(at.tie)
    }

    pub fn contains(&self, key: &RankKey) -> bool {
        self.indexed.contains_key(key)
    }

    /// Ranks by queued prefill tokens, fewest first.
    pub fn by_prefill(&self) -> impl Iterator<Item = &Place> {
        self.by_prefill.iter()
    }

    /// The request counts present, fewest first.
    pub fn request_counts(&self) -> impl Iterator<Item = u64> + '_ {
        self.by_requests.keys().copied()
    }

    /// The first rank with `requests` booked requests after `after` (from the start when
    /// `None`) in that bucket's order.
    pub fn next_with(&self, requests: u64, after: Option<&Place>) -> Option<&Place> {
        let set = self.by_requests.get(&requests)?;
        match after {
            None => set.iter().next(),
            Some(p) => set.range((Excluded(*p), Unbounded)).next(),
        }
    }

    /// The first rank with `requests` booked requests and more than `prefill` queued tokens.
    pub fn next_prefill_above(&self, requests: u64, prefill: u64) -> Option<&Place> {
        let set = self.by_requests.get(&requests)?;
        let start = (
            prefill.checked_add(1)?,
            0,
            RankKey {
                worker_id: 0,
                dp_rank: 0,
            },
        );
        set.range(start..).next()
    }

    /// Whether the orders hold exactly these ranks with these loads (tests and debug checks).
    #[cfg(test)]
    pub fn agrees_with<'a>(&self, ranks: impl Iterator<Item = (RankKey, u64, u64)> + 'a) -> bool {
        let mut n = 0usize;
        for (key, requests, prefill) in ranks {
            n = n.saturating_add(1);
            match self.indexed.get(&key) {
                Some(i) if i.requests == requests && i.prefill == prefill => {}
                _ => return false,
            }
        }
        let in_buckets: usize = self.by_requests.values().map(BTreeSet::len).sum();
        n == self.indexed.len() && n == self.by_prefill.len() && n == in_buckets
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(w: u64) -> RankKey {
        RankKey {
            worker_id: w,
            dp_rank: 0,
        }
    }

    #[test]
    fn moves_follow_loads_and_ties() {
        let mut order = LoadOrder::default();
        assert!(order.upsert(key(1), 2, 100));
        assert!(order.upsert(key(2), 0, 0));
        assert!(order.upsert(key(3), 2, 50));
        assert!(!order.upsert(key(3), 2, 50), "same load: no move");
        order.set_tie(key(3), 9);
        assert_eq!(order.request_counts().collect::<Vec<_>>(), vec![0, 2]);
        let first = *order.next_with(2, None).unwrap();
        assert_eq!(first, (50, 9, key(3)));
        assert_eq!(order.next_with(2, Some(&first)).unwrap().2, key(1));
        assert_eq!(order.next_prefill_above(2, 50).unwrap().2, key(1));
        assert!(order.next_prefill_above(2, 100).is_none());
        assert!(order.next_prefill_above(2, u64::MAX).is_none());
        let by_prefill: Vec<RankKey> = order.by_prefill().map(|p| p.2).collect();
        assert_eq!(by_prefill, vec![key(2), key(3), key(1)]);
        assert_eq!(order.remove(&key(3)), Some(9));
        assert!(order.upsert(key(1), 0, 0));
        assert_eq!(order.request_counts().collect::<Vec<_>>(), vec![0]);
        assert!(order.agrees_with([(key(1), 0, 0), (key(2), 0, 0)].into_iter()));
        assert!(!order.agrees_with([(key(1), 0, 0)].into_iter()));
    }
}
