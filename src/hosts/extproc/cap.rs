//! The process-wide cap on ext_proc streams (`--max-ext-proc-streams`) and who gives way at it
//! (`--ext-proc-evict-idle-after`, issue 45): a slab of `limit` places, one per open stream.
//! At the cap a new stream takes the place of one that has not been routed and has waited at
//! least the grace for its next request message: the most idle of a bounded sample of places
//! (all of them when the cap is small, else [`EVICTION_SAMPLES`] at random, as Redis
//! approximates LRU), so opening a stream costs O(1) however many are open. The stream evicted
//! is woken and ends RESOURCE_EXHAUSTED; with no such stream in the sample the new one is
//! refused, as without eviction.
//!
//! Fair between connections: a newcomer takes only the place of a stream whose connection holds
//! more waiting streams than the newcomer's own connection would with it (by at least one
//! after the move), so places move from connections hoarding unrouted streams to connections
//! that don't, and never back and forth. Without it an attacker's many connections, reopening
//! fast, evicted each other's streams as soon as they aged, so every place stayed younger than
//! the grace and Envoy's streams (whose connection holds ~0 waiting: each routes within
//! milliseconds) found none to take. Equal hoards cannot churn each other; their places age
//! past the grace and stay evictable by Envoy's. (A connection holding a single waiting stream
//! never gives way to one holding none: filling the cap that way takes as many connections as
//! the cap, past `--max-connections` by default.) Connections are told apart by their
//! addresses ([`ConnId`]); each has one counter of its waiting streams, shared by its streams'
//! places.
//!
//! Patience shrinks with the hoard: a waiting stream gives way after the grace scaled by
//! [`HOARD_RATIO`] × (the newcomer's connection's waiting streams) / (its own connection's),
//! never more than the grace. A connection holding up to 4× what the newcomer's does keeps the
//! whole grace; one holding 200 against Envoy's 1 keeps 20 ms. Without it the second after an
//! attacker filled the cap was lost to Envoy: every place was younger than the grace, and the
//! requests arriving then were refused (5 of 200 in the soak). An attacker can shorten the
//! patience of Envoy's own waiting streams only by opening fresh connections, and only down to
//! grace × 4 / (Envoy's waiting streams): Envoy's streams stay protected while they make
//! progress faster than that.
//!
//! Why only those: headers-only streams left silent (an attacker's) would otherwise fill the cap
//! and refuse Envoy's own until `--ext-proc-idle-timeout`. Envoy's never qualify: it sends the
//! request headers message at once and each body chunk as it arrives; a routed stream, or one
//! whose message is being worked on (tokenizing, queued), is held and never evicted.
//!
//! It owns the places and each stream's eviction state; it never looks at a message or a
//! booking. The host says when its stream waits for a request message
//! ([`StreamSlot::waiting`], one relaxed store of the time per message) and when it stops
//! being evictable ([`StreamSlot::hold`], once per request).

use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use dashmap::DashMap;
use parking_lot::Mutex;
use prometheus::IntGauge;
use rand::Rng;
use tokio::sync::Notify;
use tokio::time::Instant;

/// Most places looked at for a stream to evict, per round: all of them up to this many.
pub const EVICTION_SAMPLES: usize = 32;
/// Rounds of sampling before a new stream is refused, when another new stream took the victim
/// first.
const EVICTION_ROUNDS: usize = 3;
/// A connection holding up to this many times the newcomer's connection's waiting streams keeps
/// the whole grace; past it, the grace shrinks in proportion.
pub const HOARD_RATIO: u64 = 4;

/// How long a stream of a connection holding `theirs` waiting streams must have waited before it
/// gives way to a newcomer whose connection holds `own` (counting it): `grace` scaled by
/// [`HOARD_RATIO`] × `own` / `theirs`, at most `grace`.
fn patience(grace: u64, own: usize, theirs: usize) -> u64 {
    let wide = |n: usize| u128::try_from(n.max(1)).unwrap_or(u128::MAX);
    let scaled =
        (u128::from(grace) * u128::from(HOARD_RATIO)).saturating_mul(wide(own)) / wide(theirs);
    u64::try_from(scaled).unwrap_or(u64::MAX).min(grace)
}

/// Waits for a request message: evictable once it has waited the grace.
const WAITING: u8 = 0;
/// Routed, or its message is being worked on: never evicted.
const HELD: u8 = 1;
/// Its place went to a new stream: it must end.
const EVICTED: u8 = 2;

/// Which connection a stream came on: its (local, remote) addresses. `None` (no addresses
/// known) counts the stream as a connection of its own.
pub type ConnId = Option<(Option<SocketAddr>, SocketAddr)>;

/// One connection's standing under the cap, shared by its streams' places.
#[derive(Debug, Default)]
struct Conn {
    /// Its streams in state WAITING: each entry to WAITING adds one, each way out (hold,
    /// eviction, end) takes one, exactly once (every way out is a CAS from WAITING).
    waiting: AtomicUsize,
    /// Its streams holding a place (or trying to): the entry in `StreamCap::conns` goes with
    /// the last. Changed only under the entry's shard lock.
    streams: AtomicUsize,
}

/// One open stream's eviction state, shared by its driver and the streams that may evict it.
#[derive(Debug)]
struct Occupant {
    /// When it began waiting for its next message, in millis since the cap's epoch.
    since: AtomicU64,
    state: AtomicU8,
    /// Wakes its driver when evicted (a permit is kept if the driver is not waiting yet).
    evicted: Notify,
    conn: Arc<Conn>,
}

impl Occupant {
    /// Leaves WAITING for `to`, taking it off its connection's count; `false` if it was not
    /// waiting (held, or evicted already).
    fn leave_waiting(&self, to: u8) -> bool {
        let left = (self.state)
            .compare_exchange(WAITING, to, Ordering::AcqRel, Ordering::Acquire)
            .is_ok();
        if left {
            self.conn.waiting.fetch_sub(1, Ordering::AcqRel);
        }
        left
    }
}

/// The places of open ext_proc streams under `--max-ext-proc-streams`.
#[derive(Debug)]
pub struct StreamCap {
    places: Box<[Mutex<Option<Arc<Occupant>>>]>,
    /// The connections with a stream open, by [`ConnId`] (kept only when streams may be
    /// evicted).
    conns: DashMap<(Option<SocketAddr>, SocketAddr), Arc<Conn>>,
    free: Mutex<Vec<usize>>,
    open: AtomicUsize,
    /// `None`: never evict, refuse at the cap.
    evict_after_ms: Option<u64>,
    epoch: Instant,
    /// Mirrors `open` (`kvpick_extproc_streams_open`).
    gauge: IntGauge,
}

impl StreamCap {
    /// `evict_after`: the grace after which a waiting, unrouted stream may give way (`None` =
    /// never).
    pub fn new(limit: usize, evict_after: Option<Duration>, gauge: IntGauge) -> Arc<Self> {
        Arc::new(StreamCap {
            places: (0..limit).map(|_| Mutex::new(None)).collect(),
            conns: DashMap::new(),
            free: Mutex::new((0..limit).rev().collect()),
            open: AtomicUsize::new(0),
            evict_after_ms: evict_after.map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
            epoch: Instant::now(),
            gauge,
        })
    }

    /// A cap reporting to a gauge nobody exports (tests).
    // A constant, valid metric name: `new` cannot fail here.
    #[allow(clippy::expect_used)]
    pub fn unmetered(limit: usize, evict_after: Option<Duration>) -> Arc<Self> {
        Self::new(
            limit,
            evict_after,
            IntGauge::new("kvpick_extproc_streams_open", "unexported").expect("valid name"),
        )
    }

    pub fn open(&self) -> usize {
        self.open.load(Ordering::Acquire)
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// A place for one more stream, held until dropped: a free one, else the place of a stream
    /// that gives way (woken to end RESOURCE_EXHAUSTED); `None` when there is neither.
    /// `conn`: the connection it came on.
    pub fn try_open(self: &Arc<Self>, conn: ConnId) -> Option<StreamSlot> {
        let conn = self.enter(conn);
        // Counted waiting from the start, before it takes a place: a newcomer compares its
        // connection's count with itself in it.
        conn.1.waiting.fetch_add(1, Ordering::AcqRel);
        let occupant = Arc::new(Occupant {
            since: AtomicU64::new(self.now_ms()),
            state: AtomicU8::new(WAITING),
            evicted: Notify::new(),
            conn: Arc::clone(&conn.1),
        });
        let mut slot = StreamSlot {
            cap: Arc::clone(self),
            place: None,
            occupant,
            conn: conn.0,
            held: false,
        };
        let free = self.free.lock().pop();
        let place = match free {
            Some(place) => {
                *self.places[place].lock() = Some(Arc::clone(&slot.occupant));
                self.open.fetch_add(1, Ordering::AcqRel);
                self.gauge.inc();
                place
            }
            // Refused: dropping the slot takes it off its connection's counts.
            None => self.evict_for(&slot.occupant)?,
        };
        slot.place = Some(place);
        Some(slot)
    }

    /// The counter of `conn`, with one more stream on it.
    fn enter(&self, conn: ConnId) -> (ConnId, Arc<Conn>) {
        let Some(key) = conn.filter(|_| self.evict_after_ms.is_some()) else {
            return (None, Arc::new(Conn::default()));
        };
        let entry = self.conns.entry(key).or_default();
        entry.streams.fetch_add(1, Ordering::AcqRel);
        (conn, Arc::clone(&entry))
    }

    /// Gives `newcomer` the place of the most idle waiting stream found, if any.
    fn evict_for(&self, newcomer: &Arc<Occupant>) -> Option<usize> {
        let grace = self.evict_after_ms?;
        for _ in 0..EVICTION_ROUNDS {
            let (place, victim) = self.most_idle(grace, newcomer)?;
            let mut slot = self.places[place].lock();
            // Still there (not closed meanwhile), still waiting (no message, not evicted by
            // another new stream): the place changes hands under its lock, so the victim's
            // drop finds it gone and frees nothing.
            let same = slot.as_ref().is_some_and(|o| Arc::ptr_eq(o, &victim));
            let won = same && victim.leave_waiting(EVICTED);
            if won {
                *slot = Some(Arc::clone(newcomer));
                drop(slot);
                victim.evicted.notify_one();
                return Some(place);
            }
        }
        None
    }

    /// The place and stream that has waited longest, past `grace`, among the sampled places
    /// whose connection holds more waiting streams than `newcomer`'s (counting it).
    fn most_idle(&self, grace: u64, newcomer: &Occupant) -> Option<(usize, Arc<Occupant>)> {
        let now = self.now_ms();
        let own = newcomer.conn.waiting.load(Ordering::Relaxed);
        let n = self.places.len();
        let mut best: Option<(u64, usize, Arc<Occupant>)> = None;
        let mut rng = rand::rng();
        for i in 0..n.min(EVICTION_SAMPLES) {
            let place = if n <= EVICTION_SAMPLES {
                i
            } else {
                rng.random_range(0..n)
            };
            // A place busy opening or closing is skipped, not waited for.
            let Some(slot) = self.places[place].try_lock() else {
                continue;
            };
            let Some(o) = slot.as_ref() else { continue };
            if o.state.load(Ordering::Acquire) != WAITING {
                continue;
            }
            let since = o.since.load(Ordering::Relaxed);
            let theirs = o.conn.waiting.load(Ordering::Relaxed);
            let idle = now.saturating_sub(since) >= patience(grace, own, theirs);
            // More by two before the move is at least as many after: the move never turns
            // the difference around, so connections never trade a place back and forth.
            let hoards = theirs > own;
            if idle && hoards && best.as_ref().is_none_or(|(s, ..)| since < *s) {
                best = Some((since, place, Arc::clone(o)));
            }
        }
        best.map(|(_, place, o)| (place, o))
    }
}

/// One open stream's place under the cap, and its standing with the streams that may evict it.
#[derive(Debug)]
pub struct StreamSlot {
    cap: Arc<StreamCap>,
    /// `None` while it is looking for one (then its drop only leaves its connection).
    place: Option<usize>,
    occupant: Arc<Occupant>,
    /// Its key in `StreamCap::conns`, if it has one.
    conn: ConnId,
    /// Said [`Self::hold`] since it last waited (a local copy: waiting costs no atomic read).
    held: bool,
}

/// The stream's place went to a new stream at the cap.
#[derive(Debug, PartialEq, Eq)]
pub struct Evicted;

impl StreamSlot {
    /// The stream begins waiting for a request message: evictable once it has waited the
    /// grace. Resolves if it is evicted (at once if it was already).
    pub fn waiting(&mut self) -> impl Future<Output = Evicted> + '_ {
        (self.occupant.since).store(self.cap.now_ms(), Ordering::Relaxed);
        if self.held {
            // Only this stream leaves HELD (nobody evicts a held stream): a store will do.
            self.occupant.conn.waiting.fetch_add(1, Ordering::AcqRel);
            self.occupant.state.store(WAITING, Ordering::Release);
            self.held = false;
        }
        async move {
            self.occupant.evicted.notified().await;
            Evicted
        }
    }

    /// The stream is routed, or works on a message: no longer evictable. `Err` if it was
    /// evicted before (it must end: its place is another stream's).
    pub fn hold(&mut self) -> Result<(), Evicted> {
        if self.held {
            return Ok(());
        }
        if !self.occupant.leave_waiting(HELD) {
            return Err(Evicted);
        }
        self.held = true;
        Ok(())
    }

    /// Takes the stream off its connection's counts, and the connection off the cap's map with
    /// its last stream.
    fn leave_conn(&self) {
        // Still waiting: it ends now (a no-op if held or evicted, already taken off).
        self.occupant.leave_waiting(EVICTED);
        if let Some(key) = self.conn {
            // Under the shard lock, as `enter` adds: no stream joins an entry being removed.
            (self.cap.conns).remove_if(&key, |_, c| c.streams.fetch_sub(1, Ordering::AcqRel) == 1);
        }
    }
}

impl Drop for StreamSlot {
    fn drop(&mut self) {
        self.leave_conn();
        let Some(place) = self.place else { return };
        let mut slot = self.cap.places[place].lock();
        if !slot
            .as_ref()
            .is_some_and(|o| Arc::ptr_eq(o, &self.occupant))
        {
            return; // evicted: the place is the new stream's
        }
        *slot = None;
        drop(slot);
        self.cap.free.lock().push(place);
        self.cap.open.fetch_sub(1, Ordering::AcqRel);
        self.cap.gauge.dec();
    }
}

#[cfg(test)]
impl StreamCap {
    /// Waiting streams counted on `conn`, and connections known (tests).
    pub fn waiting_on(&self, conn: ConnId) -> (usize, usize) {
        let waiting = conn
            .and_then(|key| {
                self.conns
                    .get(&key)
                    .map(|c| c.waiting.load(Ordering::Acquire))
            })
            .unwrap_or(0);
        (waiting, self.conns.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GRACE: Duration = Duration::from_secs(1);

    /// The `n`th test connection.
    fn conn(n: u16) -> ConnId {
        Some((None, SocketAddr::from(([127, 0, 0, 1], n))))
    }

    #[test]
    fn the_cap_admits_up_to_its_limit_and_a_closed_stream_frees_its_place() {
        let cap = StreamCap::unmetered(2, None);
        let a = cap.try_open(None).unwrap();
        let _b = cap.try_open(None).unwrap();
        assert!(cap.try_open(None).is_none(), "one past the cap");
        assert_eq!(cap.open(), 2);
        drop(a);
        assert!(cap.try_open(None).is_some());
    }

    #[tokio::test(start_paused = true)]
    async fn at_the_cap_the_most_idle_waiting_stream_gives_way_once_past_the_grace() {
        let cap = StreamCap::unmetered(3, Some(GRACE));
        let mut old = cap.try_open(conn(1)).unwrap();
        tokio::time::advance(Duration::from_millis(10)).await;
        let mut streams: Vec<_> = (0..2).map(|_| cap.try_open(conn(1)).unwrap()).collect();
        tokio::time::advance(GRACE - Duration::from_millis(11)).await;
        assert!(
            cap.try_open(conn(2)).is_none(),
            "none has waited the grace yet"
        );
        tokio::time::advance(Duration::from_millis(1)).await;
        let new = cap.try_open(conn(2)).expect("the oldest gives way");
        assert_eq!(cap.open(), 3, "the newcomer took its place");
        assert_eq!(old.hold(), Err(Evicted));
        let evicted = old.waiting().await; // already notified: resolves at once
        assert_eq!(evicted, Evicted);
        assert!(
            cap.try_open(conn(3)).is_none(),
            "the others are within the grace"
        );
        // The evicted stream's end frees nothing: the place is the newcomer's.
        drop(old);
        assert_eq!(cap.open(), 3);
        assert!(cap.try_open(conn(3)).is_none());
        for s in &mut streams {
            s.hold().unwrap();
        }
        tokio::time::advance(GRACE * 100).await;
        assert!(
            cap.try_open(conn(3)).is_none(),
            "held streams never give way"
        );
        drop(streams);
        drop(new);
        assert_eq!(cap.open(), 0);
        assert_eq!(cap.waiting_on(conn(1)), (0, 0), "every count went back");
    }

    #[tokio::test(start_paused = true)]
    async fn a_stream_waiting_again_after_a_hold_is_evictable_and_without_eviction_none_is() {
        let cap = StreamCap::unmetered(3, Some(GRACE));
        let mut s = cap.try_open(conn(1)).unwrap();
        s.hold().unwrap();
        tokio::time::advance(GRACE * 2).await;
        let mut young: Vec<_> = (0..2).map(|_| cap.try_open(conn(1)).unwrap()).collect();
        assert_eq!(cap.waiting_on(conn(1)).0, 2, "a held stream is not counted");
        assert!(cap.try_open(conn(2)).is_none());
        drop(s.waiting());
        assert_eq!(cap.waiting_on(conn(1)).0, 3);
        tokio::time::advance(GRACE).await;
        for y in &mut young {
            drop(y.waiting()); // a message: not idle
        }
        assert!(cap.try_open(conn(2)).is_some());
        assert_eq!(s.hold(), Err(Evicted));
        assert_eq!(
            cap.waiting_on(conn(1)).0,
            2,
            "the evicted one was taken off once"
        );
        drop(s);
        assert_eq!(cap.waiting_on(conn(1)).0, 2);

        let never = StreamCap::unmetered(1, None);
        let _s = never.try_open(conn(1)).unwrap();
        tokio::time::advance(GRACE * 1000).await;
        assert!(never.try_open(conn(2)).is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn a_newcomer_evicts_only_from_a_connection_hoarding_more_waiting_streams_than_its_own() {
        // Connection 1 holds 3 waiting streams, connection 2 one; all past the grace.
        let cap = StreamCap::unmetered(4, Some(GRACE));
        let mut one: Vec<_> = (0..3).map(|_| cap.try_open(conn(1)).unwrap()).collect();
        let mut two = vec![cap.try_open(conn(2)).unwrap()];
        tokio::time::advance(GRACE).await;
        // At the limit: from connection 1 itself (3 against its own 3 + 1), refused.
        assert!(
            cap.try_open(conn(1)).is_none(),
            "never from its own connection"
        );
        // Just over it: connection 2 would hold 2 with the newcomer, fewer than 3.
        two.push(cap.try_open(conn(2)).expect("from the hoarder"));
        assert_eq!(cap.waiting_on(conn(1)).0, 2);
        assert_eq!(cap.waiting_on(conn(2)).0, 2);
        let evicted = one.iter_mut().filter_map(|s| s.hold().err()).count();
        assert_eq!(evicted, 1, "connection 1 gave way");
        for s in &mut one {
            drop(s.waiting());
        }
        tokio::time::advance(GRACE).await;
        // Equal hoards (2 and 2) do not churn each other.
        assert!(cap.try_open(conn(1)).is_none());
        assert!(cap.try_open(conn(2)).is_none());
        assert_eq!(
            cap.waiting_on(conn(1)).0,
            2,
            "refused newcomers were taken off"
        );
        // A connection holding none (Envoy's, whose streams route at once) takes a place.
        let mut envoy = cap.try_open(conn(3)).expect("a hoard of two gives way");
        envoy.hold().unwrap();
        assert_eq!(cap.waiting_on(conn(3)).0, 0);
        assert_eq!(cap.open(), 4);
        drop((one, two, envoy));
        assert_eq!(cap.open(), 0);
        assert_eq!(cap.waiting_on(conn(3)), (0, 0), "every count went back");
    }

    #[test]
    fn patience_is_the_grace_up_to_four_times_the_newcomers_hoard_and_shrinks_past_it() {
        assert_eq!(patience(1000, 1, 4), 1000, "at the ratio: the whole grace");
        assert_eq!(patience(1000, 1, 5), 800, "just over it");
        assert_eq!(patience(1000, 1, 200), 20);
        assert_eq!(patience(1000, 3, 2), 1000, "never more than the grace");
        assert_eq!(patience(u64::MAX, usize::MAX, 1), u64::MAX, "no overflow");
    }

    #[tokio::test(start_paused = true)]
    async fn a_connection_hoarding_past_four_times_the_newcomers_gives_way_sooner() {
        // Connection 1 holds 8 waiting streams; a newcomer on connection 2 (1 with it) waits
        // 1 s × 4 × 1 / 8 = 500 ms for one of them.
        let cap = StreamCap::unmetered(8, Some(GRACE));
        let hoard: Vec<_> = (0..8).map(|_| cap.try_open(conn(1)).unwrap()).collect();
        tokio::time::advance(Duration::from_millis(499)).await;
        assert!(cap.try_open(conn(2)).is_none(), "a millisecond short");
        tokio::time::advance(Duration::from_millis(1)).await;
        let _newcomer = cap
            .try_open(conn(2))
            .expect("the hoard's patience is 500 ms");
        assert_eq!(cap.waiting_on(conn(1)).0, 7, "one of the hoard gave way");
        // 7 against 2 (a second newcomer counted): under the ratio, the whole grace again.
        assert!(cap.try_open(conn(2)).is_none(), "1 s × 4 × 2 / 7 > 1 s");
        tokio::time::advance(GRACE).await;
        assert!(cap.try_open(conn(2)).is_some());
        drop(hoard);
    }

    #[test]
    fn a_large_cap_samples_a_bounded_number_of_places() {
        // 100k waiting streams, all past a zero grace: each new stream finds one at once.
        let cap = StreamCap::unmetered(100_000, Some(Duration::ZERO));
        let held: Vec<_> = (0..100_000)
            .map(|_| cap.try_open(conn(1)).unwrap())
            .collect();
        let mut new = Vec::new();
        for _ in 0..1000 {
            new.push(cap.try_open(conn(2)).expect("a waiting stream gives way"));
        }
        assert_eq!(cap.open(), 100_000);
        drop(held);
        drop(new);
        assert_eq!(cap.open(), 0);
        assert_eq!(cap.waiting_on(conn(1)), (0, 0));
    }
}
