//! The process-wide cap on ext_proc streams (`--max-ext-proc-streams`) and who gives way at it
//! (`--ext-proc-evict-idle-after`, issue 45): a slab of `limit` places, one per open stream.
//! At the cap a new stream takes the place of one that has not been routed and has waited at
//! least the grace for its next request message: the most idle of a bounded sample of places
//! (all of them when the cap is small, else [`EVICTION_SAMPLES`] at random, as Redis
//! approximates LRU), so opening a stream costs O(1) however many are open. The stream evicted
//! is woken and ends RESOURCE_EXHAUSTED; with no such stream in the sample the new one is
//! refused, as without eviction.
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
use std::sync::atomic::{AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

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

/// Waits for a request message: evictable once it has waited the grace.
const WAITING: u8 = 0;
/// Routed, or its message is being worked on: never evicted.
const HELD: u8 = 1;
/// Its place went to a new stream: it must end.
const EVICTED: u8 = 2;

/// One open stream's eviction state, shared by its driver and the streams that may evict it.
#[derive(Debug)]
struct Occupant {
    /// When it began waiting for its next message, in millis since the cap's epoch.
    since: AtomicU64,
    state: AtomicU8,
    /// Wakes its driver when evicted (a permit is kept if the driver is not waiting yet).
    evicted: Notify,
}

/// The places of open ext_proc streams under `--max-ext-proc-streams`.
#[derive(Debug)]
pub struct StreamCap {
    places: Box<[Mutex<Option<Arc<Occupant>>>]>,
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
    pub fn try_open(self: &Arc<Self>) -> Option<StreamSlot> {
        let occupant = Arc::new(Occupant {
            since: AtomicU64::new(self.now_ms()),
            state: AtomicU8::new(WAITING),
            evicted: Notify::new(),
        });
        let free = self.free.lock().pop();
        let place = match free {
            Some(place) => {
                *self.places[place].lock() = Some(Arc::clone(&occupant));
                self.open.fetch_add(1, Ordering::AcqRel);
                self.gauge.inc();
                place
            }
            None => self.evict_for(&occupant)?,
        };
        Some(StreamSlot {
            cap: Arc::clone(self),
            place,
            occupant,
            held: false,
        })
    }

    /// Gives `newcomer` the place of the most idle waiting stream found, if any.
    fn evict_for(&self, newcomer: &Arc<Occupant>) -> Option<usize> {
        let grace = self.evict_after_ms?;
        for _ in 0..EVICTION_ROUNDS {
            let (place, victim) = self.most_idle(grace)?;
            let mut slot = self.places[place].lock();
            // Still there (not closed meanwhile), still waiting (no message, not evicted by
            // another new stream): the place changes hands under its lock, so the victim's
            // drop finds it gone and frees nothing.
            let same = slot.as_ref().is_some_and(|o| Arc::ptr_eq(o, &victim));
            let won = same
                && (victim.state)
                    .compare_exchange(WAITING, EVICTED, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok();
            if won {
                *slot = Some(Arc::clone(newcomer));
                drop(slot);
                victim.evicted.notify_one();
                return Some(place);
            }
        }
        None
    }

    /// The place and stream that has waited longest, past `grace`, among the sampled places.
    fn most_idle(&self, grace: u64) -> Option<(usize, Arc<Occupant>)> {
        let now = self.now_ms();
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
            let idle = now.saturating_sub(since) >= grace;
            if idle && best.as_ref().is_none_or(|(s, ..)| since < *s) {
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
    place: usize,
    occupant: Arc<Occupant>,
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
        (self.occupant.state)
            .compare_exchange(WAITING, HELD, Ordering::AcqRel, Ordering::Acquire)
            .map_err(|_| Evicted)?;
        self.held = true;
        Ok(())
    }
}

impl Drop for StreamSlot {
    fn drop(&mut self) {
        let mut slot = self.cap.places[self.place].lock();
        if !slot
            .as_ref()
            .is_some_and(|o| Arc::ptr_eq(o, &self.occupant))
        {
            return; // evicted: the place is the new stream's
        }
        *slot = None;
        drop(slot);
        self.cap.free.lock().push(self.place);
        self.cap.open.fetch_sub(1, Ordering::AcqRel);
        self.cap.gauge.dec();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GRACE: Duration = Duration::from_secs(1);

    #[test]
    fn the_cap_admits_up_to_its_limit_and_a_closed_stream_frees_its_place() {
        let cap = StreamCap::unmetered(2, None);
        let a = cap.try_open().unwrap();
        let _b = cap.try_open().unwrap();
        assert!(cap.try_open().is_none(), "one past the cap");
        assert_eq!(cap.open(), 2);
        drop(a);
        assert!(cap.try_open().is_some());
    }

    #[tokio::test(start_paused = true)]
    async fn at_the_cap_the_most_idle_waiting_stream_gives_way_once_past_the_grace() {
        let cap = StreamCap::unmetered(3, Some(GRACE));
        let mut old = cap.try_open().unwrap();
        tokio::time::advance(Duration::from_millis(10)).await;
        let mut streams: Vec<_> = (0..2).map(|_| cap.try_open().unwrap()).collect();
        tokio::time::advance(GRACE - Duration::from_millis(11)).await;
        assert!(cap.try_open().is_none(), "none has waited the grace yet");
        tokio::time::advance(Duration::from_millis(1)).await;
        let new = cap.try_open().expect("the oldest gives way");
        assert_eq!(cap.open(), 3, "the newcomer took its place");
        assert_eq!(old.hold(), Err(Evicted));
        let evicted = old.waiting().await; // already notified: resolves at once
        assert_eq!(evicted, Evicted);
        assert!(cap.try_open().is_none(), "the others are within the grace");
        // The evicted stream's end frees nothing: the place is the newcomer's.
        drop(old);
        assert_eq!(cap.open(), 3);
        assert!(cap.try_open().is_none());
        for s in &mut streams {
            s.hold().unwrap();
        }
        tokio::time::advance(GRACE * 100).await;
        let newer = cap.try_open().expect("the newcomer waited: it gives way");
        drop(new);
        assert!(cap.try_open().is_none(), "held streams never give way");
        drop(streams);
        drop(newer);
        assert_eq!(cap.open(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_stream_waiting_again_after_a_hold_is_evictable_and_without_eviction_none_is() {
        let cap = StreamCap::unmetered(1, Some(GRACE));
        let mut s = cap.try_open().unwrap();
        s.hold().unwrap();
        tokio::time::advance(GRACE * 2).await;
        assert!(cap.try_open().is_none());
        drop(s.waiting());
        tokio::time::advance(GRACE).await;
        assert!(cap.try_open().is_some());
        assert_eq!(s.hold(), Err(Evicted));

        let never = StreamCap::unmetered(1, None);
        let _s = never.try_open().unwrap();
        tokio::time::advance(GRACE * 1000).await;
        assert!(never.try_open().is_none());
    }

    #[test]
    fn a_large_cap_samples_a_bounded_number_of_places() {
        // 100k waiting streams, all past a zero grace: each new stream finds one at once.
        let cap = StreamCap::unmetered(100_000, Some(Duration::ZERO));
        let held: Vec<_> = (0..100_000).map(|_| cap.try_open().unwrap()).collect();
        let mut new = Vec::new();
        for _ in 0..1000 {
            new.push(cap.try_open().expect("a waiting stream gives way"));
        }
        assert_eq!(cap.open(), 100_000);
        drop(held);
        drop(new);
        assert_eq!(cap.open(), 0);
    }
}
