//! Flow control's queue discipline and saturation rule (ARCHITECTURE.md §12), as values.
//!
//! Owns: [`FlowConfig`] (is the queue on, its bounds, when a rank is saturated), [`FlowQueue`]
//! (priority bands, fair queuing across fairness keys within a band, earliest deadline first
//! within a key) and [`is_saturated`]. It must not touch partitions, bookings or the catalog: the
//! partition holds one `FlowQueue` under its lock and drives it (what to try, in which order,
//! what to charge), so this module is pure data structures, unit-tested with explicit instants.
//!
//! The discipline:
//! - **Bands**: strict priority, highest first. Priority is an integer; negative = sheddable.
//! - **Fairness within a band**: start-time fair queuing over fairness keys, the continuous form of
//!   deficit round robin. Each key has a virtual finish tag; the next key served is the one whose
//!   head would start earliest (`max(band virtual time, key finish)`), and serving it advances its
//!   finish by the request's cost (prompt tokens + one block), so backlogged keys get equal shares
//!   of the band's work whatever their arrival rates, and an idle key banks no credit.
//! - **Within a key**: earliest deadline first, where a request's deadline is its SLO deadline
//!   when it has one, else the end of its queue timeout: FCFS among requests without an SLO.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::engine::EngineMetrics;
use crate::types::RankLoad;

/// When a rank is saturated: at or over any limit set here. A saturated rank takes no new
/// request while flow control is on; when every eligible rank is saturated, the request waits.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SaturationLimits {
    /// Predicted wait for the prefill already booked on the rank (its queued prefill tokens at
    /// the partition's calibrated speed and the rank's scale), in seconds.
    pub max_wait_seconds: Option<f64>,
    /// Booked requests on the rank (decoding or waiting for their first token), this replica's
    /// and the others' (`--shared-state`).
    pub max_active_requests: Option<u64>,
    /// From a fresh engine-metrics reading: requests waiting in the engine's own queue.
    pub engine_waiting: Option<u64>,
    /// From a fresh engine-metrics reading: KV-cache usage (0..1).
    pub engine_kv_usage: Option<f64>,
}

impl Default for SaturationLimits {
    fn default() -> Self {
        SaturationLimits {
            max_wait_seconds: Some(0.5),
            max_active_requests: None,
            engine_waiting: Some(8),
            engine_kv_usage: Some(0.95),
        }
    }
}

/// Flow-control settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FlowConfig {
    /// Off: no queue; a request that finds every rank over a busy threshold is refused at once
    /// (the behaviour before flow control), and saturation limits are not applied.
    pub enabled: bool,
    /// Longest a request waits in the queue: then 429 (sheddable) or 503.
    pub queue_timeout: Duration,
    /// Most requests waiting per band; an arrival to a full band is refused at once.
    pub band_capacity: usize,
    /// Most queued requests one release pass tries (a pass runs under the partition's lock).
    pub max_scan: usize,
    pub saturation: SaturationLimits,
}

impl Default for FlowConfig {
    fn default() -> Self {
        FlowConfig {
            enabled: true,
            queue_timeout: Duration::from_secs(30),
            band_capacity: 10_000,
            max_scan: 32,
            saturation: SaturationLimits::default(),
        }
    }
}

/// Whether a rank with this booked load, predicted prefill wait and engine reading is saturated.
pub fn is_saturated(
    limits: &SaturationLimits,
    load: &RankLoad,
    wait_seconds: f64,
    engine: Option<&EngineMetrics>,
) -> bool {
    if limits.max_wait_seconds.is_some_and(|w| wait_seconds >= w) {
        return true;
    }
    if limits
        .max_active_requests
        .is_some_and(|n| load.active_requests >= n)
    {
        return true;
    }
    let Some(engine) = engine else {
        return false;
    };
    limits.engine_waiting.is_some_and(|n| engine.waiting >= n)
        || limits.engine_kv_usage.is_some_and(|u| engine.kv_usage >= u)
}

/// Where a queued request stands in its key: (deadline, arrival sequence).
type OrderKey = (Instant, u64);

/// One waiting request.
#[derive(Debug, Clone)]
pub struct Waiting<T> {
    pub ticket: u64,
    pub priority: i32,
    pub fairness_key: Arc<str>,
    /// Work it will take, for fairness (prompt tokens + one block).
    pub cost: u64,
    pub enqueued: Instant,
    /// When it leaves the queue unserved (queue timeout, or the latest start that can still
    /// meet its SLO).
    pub deadline: Instant,
    /// Whether `deadline` is an SLO's (429 when it passes) rather than the queue timeout's.
    pub slo_bound: bool,
    pub payload: T,
}

#[derive(Debug)]
struct KeyQueue<T> {
    entries: BTreeMap<OrderKey, Waiting<T>>,
    /// Virtual finish tag of the last request served from this key.
    finish: u128,
}

#[derive(Debug)]
struct Band<T> {
    keys: HashMap<Arc<str>, KeyQueue<T>>,
    len: usize,
    /// Virtual start tag of the last request served from this band.
    virtual_time: u128,
}

impl<T> Default for Band<T> {
    fn default() -> Self {
        Band {
            keys: HashMap::new(),
            len: 0,
            virtual_time: 0,
        }
    }
}

/// Why a request could not join the queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QueueFull {
    Band,
}

/// The priority bands of one partition.
#[derive(Debug)]
pub struct FlowQueue<T> {
    bands: BTreeMap<Reverse<i32>, Band<T>>,
    /// ticket -> (priority, key, position)
    located: HashMap<u64, (i32, Arc<str>, OrderKey)>,
    sequence: u64,
}

impl<T> Default for FlowQueue<T> {
    fn default() -> Self {
        FlowQueue {
            bands: BTreeMap::new(),
            located: HashMap::new(),
            sequence: 0,
        }
    }
}

impl<T> FlowQueue<T> {
    pub fn len(&self) -> usize {
        self.located.len()
    }

    pub fn is_empty(&self) -> bool {
        self.located.is_empty()
    }

    pub fn band_len(&self, priority: i32) -> usize {
        self.bands.get(&Reverse(priority)).map_or(0, |b| b.len)
    }

    /// Adds a request; refused when its band already holds `capacity`.
    pub fn push(&mut self, waiting: Waiting<T>, capacity: usize) -> Result<(), (QueueFull, T)> {
        let band = self.bands.entry(Reverse(waiting.priority)).or_default();
        if band.len >= capacity {
            return Err((QueueFull::Band, waiting.payload));
        }
        self.sequence = self.sequence.wrapping_add(1);
        let position = (waiting.deadline, self.sequence);
        let key = Arc::clone(&waiting.fairness_key);
        self.located.insert(
            waiting.ticket,
            (waiting.priority, Arc::clone(&key), position),
        );
        let queue = band.keys.entry(key).or_insert_with(|| KeyQueue {
            entries: BTreeMap::new(),
            finish: 0,
        });
        queue.entries.insert(position, waiting);
        band.len = band.len.saturating_add(1);
        Ok(())
    }

    pub fn get(&self, ticket: u64) -> Option<&Waiting<T>> {
        let (priority, key, position) = self.located.get(&ticket)?;
        self.bands
            .get(&Reverse(*priority))?
            .keys
            .get(key)?
            .entries
            .get(position)
    }

    /// Takes a request out; `served` charges its key (it was dispatched), otherwise it left
    /// unserved (cancelled, timed out, refused) and costs its key nothing.
    pub fn take(&mut self, ticket: u64, served: bool) -> Option<Waiting<T>> {
        let (priority, key, position) = self.located.remove(&ticket)?;
        let band = self.bands.get_mut(&Reverse(priority))?;
        let queue = band.keys.get_mut(&key)?;
        let waiting = queue.entries.remove(&position)?;
        if served {
            let start = band.virtual_time.max(queue.finish);
            queue.finish = start.saturating_add(u128::from(waiting.cost.max(1)));
            band.virtual_time = start;
        }
        // A key's finish tag below the band's virtual time carries no credit, so an emptied key
        // can go (it would restart at the virtual time anyway) unless it is ahead of it.
        if queue.entries.is_empty() && queue.finish <= band.virtual_time {
            band.keys.remove(&key);
        }
        band.len = band.len.saturating_sub(1);
        if band.len == 0 && band.keys.values().all(|q| q.entries.is_empty()) {
            // Keys ahead of the virtual time keep their tags only while the band is busy: an
            // idle band starts afresh.
            self.bands.remove(&Reverse(priority));
        }
        Some(waiting)
    }

    /// The order in which up to `limit` requests would be served if each were dispatched in
    /// turn: bands by priority, keys by start tag, entries by deadline.
    pub fn release_order(&self, limit: usize) -> Vec<u64> {
        let mut order = Vec::with_capacity(limit.min(self.len()));
        for band in self.bands.values() {
            if order.len() >= limit {
                break;
            }
            let mut virtual_time = band.virtual_time;
            // (start tag, head position, key); one heap entry per key with waiting requests.
            let mut heads: BinaryHeap<Reverse<(u128, OrderKey, usize)>> = BinaryHeap::new();
            let keys: Vec<&KeyQueue<T>> = band
                .keys
                .values()
                .filter(|q| !q.entries.is_empty())
                .collect();
            let mut cursors: Vec<std::collections::btree_map::Values<'_, OrderKey, Waiting<T>>> =
                keys.iter().map(|q| q.entries.values()).collect();
            let mut finishes: Vec<u128> = keys.iter().map(|q| q.finish).collect();
            let mut pending: Vec<Option<&Waiting<T>>> =
                cursors.iter_mut().map(|c| c.next()).collect();
            for (i, head) in pending.iter().enumerate() {
                if let (Some(w), Some(f)) = (head, finishes.get(i)) {
                    heads.push(Reverse((
                        virtual_time.max(*f),
                        (w.deadline, self.position_of(w.ticket)),
                        i,
                    )));
                }
            }
            while order.len() < limit {
                let Some(Reverse((start, _, i))) = heads.pop() else {
                    break;
                };
                let Some(Some(w)) = pending.get(i).copied() else {
                    continue;
                };
                order.push(w.ticket);
                virtual_time = virtual_time.max(start);
                let finish = start.saturating_add(u128::from(w.cost.max(1)));
                if let Some(f) = finishes.get_mut(i) {
                    *f = finish;
                }
                let next = cursors.get_mut(i).and_then(|c| c.next());
                if let Some(slot) = pending.get_mut(i) {
                    *slot = next;
                }
                if let Some(n) = next {
                    heads.push(Reverse((
                        virtual_time.max(finish),
                        (n.deadline, self.position_of(n.ticket)),
                        i,
                    )));
                }
            }
        }
        order
    }

    fn position_of(&self, ticket: u64) -> u64 {
        self.located.get(&ticket).map_or(u64::MAX, |(_, _, p)| p.1)
    }

    /// Tickets whose deadline is at or before `now`.
    pub fn expired(&self, now: Instant) -> Vec<u64> {
        self.bands
            .values()
            .flat_map(|b| b.keys.values())
            .flat_map(|q| q.entries.values())
            .filter(|w| w.deadline <= now)
            .map(|w| w.ticket)
            .collect()
    }

    /// The earliest deadline of any waiting request.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.bands
            .values()
            .flat_map(|b| b.keys.values())
            .filter_map(|q| q.entries.values().map(|w| w.deadline).min())
            .min()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Fixture {
        queue: FlowQueue<()>,
        t0: Instant,
        next: u64,
    }

    impl Fixture {
        fn new() -> Self {
            Fixture {
                queue: FlowQueue::default(),
                t0: Instant::now(),
                next: 0,
            }
        }

        fn push(&mut self, priority: i32, key: &str, cost: u64, deadline_s: u64) -> u64 {
            self.next += 1;
            let waiting = Waiting {
                ticket: self.next,
                priority,
                fairness_key: Arc::from(key),
                cost,
                enqueued: self.t0,
                deadline: self.t0 + Duration::from_secs(deadline_s),
                slo_bound: false,
                payload: (),
            };
            self.queue.push(waiting, 100).map_err(|_| ()).unwrap();
            self.next
        }

        /// Serves requests one at a time in release order, returning their keys.
        fn drain(&mut self, n: usize) -> Vec<Arc<str>> {
            let mut served = Vec::new();
            for _ in 0..n {
                let Some(&t) = self.queue.release_order(1).first() else {
                    break;
                };
                served.push(self.queue.take(t, true).unwrap().fairness_key);
            }
            served
        }
    }

    #[test]
    fn bands_are_strict_priority_and_fcfs_within_a_key() {
        let mut f = Fixture::new();
        let low = f.push(-1, "a", 10, 30);
        let normal1 = f.push(0, "a", 10, 30);
        let high = f.push(5, "a", 10, 30);
        let normal2 = f.push(0, "a", 10, 30);
        assert_eq!(f.queue.release_order(10), vec![high, normal1, normal2, low]);
        assert_eq!(f.queue.band_len(0), 2);
        assert_eq!(f.queue.len(), 4);
    }

    #[test]
    fn earliest_deadline_first_within_a_key() {
        let mut f = Fixture::new();
        let late = f.push(0, "a", 10, 30);
        let urgent = f.push(0, "a", 10, 2);
        assert_eq!(f.queue.release_order(10), vec![urgent, late]);
        assert_eq!(f.queue.next_deadline(), Some(f.t0 + Duration::from_secs(2)));
        assert_eq!(f.queue.expired(f.t0 + Duration::from_secs(2)), vec![urgent]);
        assert!(f.queue.expired(f.t0 + Duration::from_secs(1)).is_empty());
    }

    #[test]
    fn backlogged_keys_share_a_band_equally_whatever_their_rates() {
        let mut f = Fixture::new();
        // Tenant "big" has 4x the requests of "small", all queued at once.
        for _ in 0..40 {
            f.push(0, "big", 100, 30);
        }
        for _ in 0..10 {
            f.push(0, "small", 100, 30);
        }
        let served = f.drain(20);
        let small = served.iter().filter(|k| &***k == "small").count();
        assert_eq!(small, 10, "{served:?}");
        // The rest is the big tenant's alone.
        assert!(f.drain(100).iter().all(|k| &**k == "big"));
        assert!(f.queue.is_empty());
    }

    #[test]
    fn fairness_is_in_work_not_requests() {
        let mut f = Fixture::new();
        for _ in 0..20 {
            f.push(0, "long", 1000, 30);
            f.push(0, "short", 100, 30);
        }
        let served = f.drain(22);
        let short = served.iter().filter(|k| &***k == "short").count();
        // 1000 tokens of short work for every long request.
        assert_eq!(short, 20, "{served:?}");
    }

    #[test]
    fn an_idle_key_banks_no_credit() {
        let mut f = Fixture::new();
        for _ in 0..10 {
            f.push(0, "busy", 100, 30);
        }
        f.drain(8);
        // A key that was idle while "busy" was served does not get 8 requests in a row.
        for _ in 0..4 {
            f.push(0, "late", 100, 30);
        }
        let served = f.drain(4);
        let late = served.iter().filter(|k| &***k == "late").count();
        assert!((1..=3).contains(&late), "{served:?}");
    }

    #[test]
    fn unserved_removal_costs_nothing_and_cleans_up() {
        let mut f = Fixture::new();
        let a = f.push(0, "a", 100, 30);
        let b = f.push(0, "b", 100, 30);
        assert!(f.queue.take(a, false).is_some());
        assert!(f.queue.take(a, false).is_none(), "removed once");
        assert_eq!(f.queue.release_order(5), vec![b]);
        assert!(f.queue.take(b, false).is_some());
        assert!(f.queue.is_empty());
        assert_eq!(f.queue.next_deadline(), None);
        assert!(f.queue.bands.is_empty());
    }

    #[test]
    fn a_full_band_refuses_but_others_accept() {
        let mut queue: FlowQueue<u8> = FlowQueue::default();
        let t0 = Instant::now();
        let waiting = |ticket, priority| Waiting {
            ticket,
            priority,
            fairness_key: Arc::from("k"),
            cost: 1,
            enqueued: t0,
            deadline: t0,
            slo_bound: false,
            payload: 7u8,
        };
        assert!(queue.push(waiting(1, 0), 1).is_ok());
        assert_eq!(queue.push(waiting(2, 0), 1), Err((QueueFull::Band, 7)));
        assert!(queue.push(waiting(3, 1), 1).is_ok());
        assert_eq!(queue.len(), 2);
    }

    #[test]
    fn saturation_limits() {
        let limits = SaturationLimits::default();
        let load = RankLoad::default();
        assert!(!is_saturated(&limits, &load, 0.4, None));
        assert!(is_saturated(&limits, &load, 0.5, None));
        let capped = SaturationLimits {
            max_active_requests: Some(3),
            ..limits
        };
        let busy = RankLoad {
            active_requests: 3,
            ..RankLoad::default()
        };
        assert!(is_saturated(&capped, &busy, 0.0, None));
        assert!(!is_saturated(&limits, &busy, 0.0, None));
    }
}
