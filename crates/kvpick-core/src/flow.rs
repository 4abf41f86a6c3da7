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
use std::collections::{BTreeMap, BTreeSet, BinaryHeap, HashMap};
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
    /// Most requests waiting in all queues of the process together (every band and partition);
    /// an arrival that would wait past it is refused at once.
    pub capacity: usize,
    /// Most queued requests one release pass tries (a pass runs under the partition's lock).
    pub max_scan: usize,
    pub saturation: SaturationLimits,
    /// A model with no ready rank queues its requests (up to `queue_timeout`) instead of
    /// refusing them at once, so a pool scaled to zero can scale back up under them.
    pub hold_when_no_endpoints: bool,
}

impl Default for FlowConfig {
    fn default() -> Self {
        FlowConfig {
            enabled: true,
            queue_timeout: Duration::from_secs(30),
            band_capacity: 10_000,
            capacity: 10_000,
            max_scan: 32,
            saturation: SaturationLimits::default(),
            hold_when_no_endpoints: false,
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

impl<T> KeyQueue<T> {
    fn head(&self) -> Option<OrderKey> {
        self.entries.keys().next().copied()
    }
}

/// Most finish tags of emptied keys one band keeps (a flood of one-off fairness keys would
/// otherwise keep one each until the virtual time passes them).
pub const MAX_IDLE_TAGS: usize = 1_024;

/// One priority band. Only keys with waiting requests are in `keys`; each is also in exactly one
/// of two ordered indexes, so the next keys to serve are found without visiting every key:
/// `behind` (finish tag at or below the virtual time: they start at the virtual time, so their
/// head request orders them) and `ahead` (by finish tag, then head). An emptied key whose finish
/// tag is still ahead of the virtual time keeps only that tag (`idle`), until the virtual time
/// passes it: then it carries no debt and is forgotten.
#[derive(Debug)]
struct Band<T> {
    keys: HashMap<Arc<str>, KeyQueue<T>>,
    behind: BTreeSet<(OrderKey, Arc<str>)>,
    ahead: BTreeSet<(u128, OrderKey, Arc<str>)>,
    idle: HashMap<Arc<str>, u128>,
    idle_by_finish: BTreeSet<(u128, Arc<str>)>,
    len: usize,
    /// Virtual start tag of the last request served from this band.
    virtual_time: u128,
}

impl<T> Default for Band<T> {
    fn default() -> Self {
        Band {
            keys: HashMap::new(),
            behind: BTreeSet::new(),
            ahead: BTreeSet::new(),
            idle: HashMap::new(),
            idle_by_finish: BTreeSet::new(),
            len: 0,
            virtual_time: 0,
        }
    }
}

impl<T> Band<T> {
    /// Takes `key` out of the order indexes (before its head or finish tag changes).
    fn unindex(&mut self, key: &Arc<str>) {
        let Some(queue) = self.keys.get(key) else {
            return;
        };
        let Some(head) = queue.head() else {
            return;
        };
        if queue.finish <= self.virtual_time {
            self.behind.remove(&(head, Arc::clone(key)));
        } else {
            self.ahead.remove(&(queue.finish, head, Arc::clone(key)));
        }
    }

    /// Puts `key` back into the order indexes, or forgets it when it has nothing waiting.
    fn index(&mut self, key: &Arc<str>) {
        let Some(queue) = self.keys.get(key) else {
            return;
        };
        let finish = queue.finish;
        let Some(head) = queue.head() else {
            self.keys.remove(key);
            if finish > self.virtual_time {
                self.idle.insert(Arc::clone(key), finish);
                self.idle_by_finish.insert((finish, Arc::clone(key)));
                // Bounded: past the cap the tag nearest the virtual time goes (the least debt; a
                // key that returns without it gains at most that much).
                if self.idle.len() > MAX_IDLE_TAGS {
                    if let Some((_, k)) = self.idle_by_finish.pop_first() {
                        self.idle.remove(&k);
                    }
                }
            }
            return;
        };
        if finish <= self.virtual_time {
            self.behind.insert((head, Arc::clone(key)));
        } else {
            self.ahead.insert((finish, head, Arc::clone(key)));
        }
    }

    /// The virtual time moved to `to`: keys it passed start at it now; idle tags it passed
    /// carry no debt.
    fn advance(&mut self, to: u128) {
        self.virtual_time = to;
        while let Some((finish, head, key)) = self.ahead.first().cloned() {
            if finish > to {
                break;
            }
            self.ahead.pop_first();
            self.behind.insert((head, key));
        }
        while let Some((finish, key)) = self.idle_by_finish.first().cloned() {
            if finish > to {
                break;
            }
            self.idle_by_finish.pop_first();
            self.idle.remove(&key);
        }
    }

    /// The keys that can be served within the next `limit` services, with their start tags: at
    /// most `limit` from each index (any key past them has `limit` keys before it).
    fn first_keys(&self, limit: usize) -> Vec<(u128, &KeyQueue<T>)> {
        let behind = self
            .behind
            .iter()
            .take(limit)
            .map(|(_, k)| (self.virtual_time, k));
        let ahead = self.ahead.iter().take(limit).map(|(f, _, k)| (*f, k));
        behind
            .chain(ahead)
            .filter_map(|(start, k)| self.keys.get(k).map(|q| (start, q)))
            .collect()
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
    /// Every waiting request by deadline: expiry visits only the expired.
    deadlines: BTreeSet<(Instant, u64)>,
    sequence: u64,
}

impl<T> Default for FlowQueue<T> {
    fn default() -> Self {
        FlowQueue {
            bands: BTreeMap::new(),
            located: HashMap::new(),
            deadlines: BTreeSet::new(),
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

    /// Bands with waiting requests.
    pub fn bands(&self) -> usize {
        self.bands.len()
    }

    /// Fairness keys a band keeps state for (waiting requests, or a finish tag still ahead).
    pub fn keys_kept(&self, priority: i32) -> usize {
        self.bands
            .get(&Reverse(priority))
            .map_or(0, |b| b.keys.len() + b.idle.len())
    }

    /// Adds a request; refused when its band already holds `capacity`.
    pub fn push(&mut self, waiting: Waiting<T>, capacity: usize) -> Result<(), (QueueFull, T)> {
        let band = self.bands.entry(Reverse(waiting.priority)).or_default();
        if band.len >= capacity {
            if band.len == 0 {
                self.bands.remove(&Reverse(waiting.priority));
            }
            return Err((QueueFull::Band, waiting.payload));
        }
        self.sequence = self.sequence.wrapping_add(1);
        let position = (waiting.deadline, self.sequence);
        let key = Arc::clone(&waiting.fairness_key);
        self.located.insert(
            waiting.ticket,
            (waiting.priority, Arc::clone(&key), position),
        );
        self.deadlines.insert((waiting.deadline, waiting.ticket));
        band.unindex(&key);
        if !band.keys.contains_key(&key) {
            // A key returning while its old finish tag is still ahead keeps that debt.
            let finish = band.idle.remove(&key).unwrap_or(0);
            band.idle_by_finish.remove(&(finish, Arc::clone(&key)));
            band.keys.insert(
                Arc::clone(&key),
                KeyQueue {
                    entries: BTreeMap::new(),
                    finish,
                },
            );
        }
        if let Some(queue) = band.keys.get_mut(&key) {
            queue.entries.insert(position, waiting);
        }
        band.index(&key);
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
        band.unindex(&key);
        let queue = band.keys.get_mut(&key)?;
        let waiting = queue.entries.remove(&position)?;
        self.deadlines.remove(&(waiting.deadline, ticket));
        let mut advanced = None;
        if served {
            let start = band.virtual_time.max(queue.finish);
            queue.finish = start.saturating_add(u128::from(waiting.cost.max(1)));
            advanced = Some(start);
        }
        band.index(&key);
        if let Some(start) = advanced {
            band.advance(start);
        }
        band.len = band.len.saturating_sub(1);
        if band.len == 0 {
            // Tags ahead of the virtual time matter only while the band is busy: an idle band
            // starts afresh.
            self.bands.remove(&Reverse(priority));
        }
        Some(waiting)
    }

    /// The order in which up to `limit` requests would be served if each were dispatched in
    /// turn: bands by priority, keys by start tag, entries by deadline. Visits at most `2 ×
    /// limit` keys per band, whatever the number of keys.
    pub fn release_order(&self, limit: usize) -> Vec<u64> {
        let mut order = Vec::with_capacity(limit.min(self.len()));
        for band in self.bands.values() {
            if order.len() >= limit {
                break;
            }
            let mut virtual_time = band.virtual_time;
            let keys = band.first_keys(limit.saturating_sub(order.len()));
            // (start tag, head position, key); one heap entry per key with waiting requests.
            let mut heads: BinaryHeap<Reverse<(u128, OrderKey, usize)>> = BinaryHeap::new();
            let mut cursors: Vec<std::collections::btree_map::Iter<'_, OrderKey, Waiting<T>>> =
                keys.iter().map(|(_, q)| q.entries.iter()).collect();
            let mut pending: Vec<Option<(&OrderKey, &Waiting<T>)>> =
                cursors.iter_mut().map(|c| c.next()).collect();
            for (i, ((start, _), head)) in keys.iter().zip(&pending).enumerate() {
                if let Some((position, _)) = head {
                    heads.push(Reverse((*start, **position, i)));
                }
            }
            while order.len() < limit {
                let Some(Reverse((start, _, i))) = heads.pop() else {
                    break;
                };
                let Some(Some((_, w))) = pending.get(i).copied() else {
                    continue;
                };
                order.push(w.ticket);
                virtual_time = virtual_time.max(start);
                let finish = start.saturating_add(u128::from(w.cost.max(1)));
                let next = cursors.get_mut(i).and_then(|c| c.next());
                if let Some(slot) = pending.get_mut(i) {
                    *slot = next;
                }
                if let Some((position, _)) = next {
                    heads.push(Reverse((virtual_time.max(finish), *position, i)));
                }
            }
        }
        order
    }

    #[cfg(test)]
    fn position(&self, w: &Waiting<T>) -> OrderKey {
        self.located.get(&w.ticket).map_or((w.deadline, 0), |l| l.2)
    }

    /// Tickets whose deadline is at or before `now`.
    pub fn expired(&self, now: Instant) -> Vec<u64> {
        self.deadlines
            .iter()
            .take_while(|(deadline, _)| *deadline <= now)
            .map(|(_, ticket)| *ticket)
            .collect()
    }

    /// The earliest deadline of any waiting request.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.deadlines.first().map(|(deadline, _)| *deadline)
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

    /// The release order visits only the first keys of each index; a reference that visits
    /// every key (the rule itself: start = max(virtual time, finish), then head) must agree on
    /// random queues with many keys, served, cancelled and refilled in random order.
    #[test]
    fn release_order_matches_the_every_key_reference() {
        use rand::{Rng, SeedableRng};
        fn reference<T>(q: &FlowQueue<T>, limit: usize) -> Vec<u64> {
            let mut order = Vec::new();
            for band in q.bands.values() {
                let mut v = band.virtual_time;
                let mut state: Vec<(u128, Vec<&Waiting<T>>)> = band
                    .keys
                    .values()
                    .map(|k| (k.finish, k.entries.values().collect()))
                    .collect();
                let mut starts: Vec<Option<(u128, OrderKey)>> = state
                    .iter()
                    .map(|(f, e)| e.first().map(|w| (v.max(*f), q.position(w))))
                    .collect();
                while order.len() < limit {
                    let Some(i) = (0..state.len())
                        .filter(|&i| starts[i].is_some())
                        .min_by_key(|&i| starts[i])
                    else {
                        break;
                    };
                    let (start, _) = starts[i].unwrap();
                    let w = state[i].1.remove(0);
                    order.push(w.ticket);
                    v = v.max(start);
                    let finish = start + u128::from(w.cost.max(1));
                    state[i].0 = finish;
                    starts[i] = state[i].1.first().map(|n| (v.max(finish), q.position(n)));
                }
            }
            order
        }
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        let mut f = Fixture::new();
        let mut live: Vec<u64> = Vec::new();
        for step in 0..3_000 {
            match rng.random_range(0..10) {
                0..=4 => {
                    let key = format!("k{}", rng.random_range(0..40));
                    let band = rng.random_range(-1..2);
                    let t = f.push(
                        band,
                        &key,
                        rng.random_range(1..500),
                        rng.random_range(1..60),
                    );
                    live.push(t);
                }
                5..=7 => {
                    if let Some(&t) = f.queue.release_order(1).first() {
                        f.queue.take(t, true).unwrap();
                        live.retain(|&x| x != t);
                    }
                }
                _ => {
                    if !live.is_empty() {
                        let t = live.swap_remove(rng.random_range(0..live.len()));
                        f.queue.take(t, false).unwrap();
                    }
                }
            }
            let limit = rng.random_range(1..40);
            assert_eq!(
                f.queue.release_order(limit),
                reference(&f.queue, limit),
                "step {step}"
            );
        }
    }

    /// A flood of one-off fairness keys (each served once) keeps at most [`MAX_IDLE_TAGS`] tags,
    /// none once the band's virtual time passes them, and no band once it drains.
    #[test]
    fn emptied_keys_are_pruned_and_deadlines_are_indexed() {
        let mut f = Fixture::new();
        f.push(0, "steady", 10, 30);
        for i in 0..MAX_IDLE_TAGS + 10 {
            f.push(0, &format!("one-off-{i}"), 10, 30);
            let t = *f.queue.release_order(2).last().unwrap();
            f.queue.take(t, true).unwrap();
        }
        assert_eq!(
            f.queue.keys_kept(0),
            MAX_IDLE_TAGS + 1,
            "capped, plus steady"
        );
        // A key served twice in a row starts its second request past every one-off tag: they
        // carry no debt now and go.
        f.push(0, "x", 10, 30);
        f.push(0, "x", 10, 30);
        for _ in 0..2 {
            let t = *f.queue.release_order(2).last().unwrap();
            f.queue.take(t, true).unwrap();
        }
        assert_eq!(f.queue.keys_kept(0), 2, "steady waiting, x's tag");
        f.drain(1);
        assert_eq!(f.queue.bands(), 0);
        assert_eq!(f.queue.next_deadline(), None);
        // Expiry sees exactly the expired, in deadline order.
        let late = f.push(0, "a", 1, 30);
        let soon = f.push(1, "b", 1, 3);
        let sooner = f.push(0, "c", 1, 2);
        assert_eq!(
            f.queue.expired(f.t0 + Duration::from_secs(3)),
            vec![sooner, soon]
        );
        assert_eq!(f.queue.next_deadline(), Some(f.t0 + Duration::from_secs(2)));
        f.queue.take(sooner, false);
        assert_eq!(
            f.queue.expired(f.t0 + Duration::from_secs(30)),
            vec![soon, late]
        );
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
