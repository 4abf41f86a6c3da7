//! How long a precise rank's unconfirmed predicted entries outlive their request (the end
//! grace, [`super::health::end`]), adapted to how late the partition's KV events arrive.
//!
//! A request's stores reach kvpick as KV events some time after the engine computed them; until
//! they do, the pick's predicted entries are all that says the rank holds the prefix. A fixed
//! second covers a healthy host, but a CPU-starved engine publishes its stores seconds late, and
//! in that gap a follower request would find no rank holding its prefix. So the grace follows
//! the lag the host measured on the partition's live batches (engine timestamp to applied,
//! handed in with each batch: the core reads no clock):
//!
//! `grace = clamp(K × peak, END_GRACE, MAX_GRACE)`, where `peak` is the largest lag seen,
//! halving every [`HALF_LIFE`] of later batches.
//!
//! Owns the peak (under the KV write lock, where batches apply) and the grace it implies,
//! published in an atomic that bookings read under the state lock without the KV lock. It must
//! not touch the index or bookings: it only says how long.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The grace with no lag observed, and its floor: vLLM publishes a prefill's stores at the end
/// of the engine step that computed them, a decode step or two before a short answer ends, so
/// they may still be in flight (the publisher's thread, the socket, kvpick's ingestion) when the
/// response's last byte reaches kvpick: seen on real vLLM, a same-prompt request sent 2 ms after
/// the response went cold. A second covers that transport on a busy host.
pub(crate) const END_GRACE: Duration = Duration::from_secs(1);

/// The longest grace, however late events come. An engine that never confirms a prediction
/// (its events lost, the blocks evicted before they were published) keeps the entry this long
/// after its request; past ten seconds of lag the stream is broken rather than slow (a gap is
/// replayed, a lost subscription probed), and a longer grace would only keep wrong entries.
pub(crate) const MAX_GRACE: Duration = Duration::from_secs(10);

/// The grace is this many times the peak lag: one batch's lag is a sample of a queue, and the
/// next request's stores may wait a step longer than the slowest batch seen (CPU starvation is
/// bursty). Twice the peak covers that jitter while a 3 s lag still gives only 6 s of grace.
pub(crate) const K: u32 = 2;

/// The peak lag halves every this much time of later batches: one slow batch lengthens the
/// grace at once, and fast batches bring it back over tens of seconds (from the cap to the
/// floor in log2(10) ≈ 3.3 half-lives, 33 s) rather than at the next fast batch, since a host
/// starved once is likely starved again soon. Decay is counted only at batches (the evidence
/// that events flow fast again): an idle partition keeps its grace until its next batch.
pub(crate) const HALF_LIFE: Duration = Duration::from_secs(10);

/// A partition's observed event lag: the decaying peak, and the grace it implies, published.
#[derive(Debug)]
pub(crate) struct EventGrace {
    /// Seconds, at most `MAX_GRACE / K` (a larger lag, clock skew or a stalled stream, would
    /// only keep the grace at the cap for longer).
    peak: f64,
    /// When `peak` was last brought up to date.
    at: Option<Instant>,
    /// The grace in nanoseconds, read without the KV lock ([`grace_of`]).
    published: Arc<AtomicU64>,
}

impl EventGrace {
    pub(crate) fn new() -> Self {
        EventGrace {
            peak: 0.0,
            at: None,
            published: Arc::new(AtomicU64::new(nanos(END_GRACE))),
        }
    }

    /// The published grace, for the partition's state ([`grace_of`]).
    pub(crate) fn shared(&self) -> Arc<AtomicU64> {
        Arc::clone(&self.published)
    }

    /// One live batch applied `lag` after its engine stamped it, at `now`: the peak decays by
    /// the time since the last batch, then takes the lag if larger. Returns the grace now.
    pub(crate) fn observe(&mut self, lag: Duration, now: Instant) -> Duration {
        let elapsed = self
            .at
            .map_or(0.0, |at| now.saturating_duration_since(at).as_secs_f64());
        let decayed = self.peak * 0.5f64.powf(elapsed / HALF_LIFE.as_secs_f64());
        let cap = MAX_GRACE.as_secs_f64() / f64::from(K);
        self.peak = decayed.max(lag.as_secs_f64().min(cap));
        self.at = Some(now);
        let grace = grace_for(self.peak);
        self.published.store(nanos(grace), Ordering::Relaxed);
        grace
    }

    /// The grace as of the last batch.
    pub(crate) fn grace(&self) -> Duration {
        grace_of(&self.published)
    }
}

/// The grace for a peak lag of `peak` seconds.
fn grace_for(peak: f64) -> Duration {
    let secs = (peak * f64::from(K)).clamp(END_GRACE.as_secs_f64(), MAX_GRACE.as_secs_f64());
    // Finite and within [1 s, 10 s]: the conversion cannot fail.
    Duration::try_from_secs_f64(secs).unwrap_or(END_GRACE)
}

/// A published grace.
pub(crate) fn grace_of(published: &AtomicU64) -> Duration {
    Duration::from_nanos(published.load(Ordering::Relaxed))
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn without_lag_the_grace_is_a_second() {
        let g = EventGrace::new();
        assert_eq!(g.grace(), END_GRACE);
        let mut g = EventGrace::new();
        let t0 = Instant::now();
        assert_eq!(g.observe(ms(2), t0), END_GRACE, "fast batches: the floor");
        assert_eq!(g.observe(Duration::ZERO, t0 + ms(10)), END_GRACE);
    }

    #[test]
    fn one_slow_batch_lengthens_it_at_once_and_fast_ones_bring_it_back() {
        let mut g = EventGrace::new();
        let t0 = Instant::now();
        g.observe(ms(5), t0);
        assert_eq!(g.observe(ms(3_000), t0 + ms(100)), ms(6_000));
        assert_eq!(g.grace(), ms(6_000));
        // Ten seconds of fast batches halve it; no batch, no decay.
        let mut t = t0 + ms(100);
        for _ in 0..10 {
            t += Duration::from_secs(1);
            g.observe(ms(5), t);
        }
        let half = g.grace();
        assert!(half.abs_diff(ms(3_000)) < ms(1), "{half:?}");
        // log2(6) half-lives after the slow batch, about 26 s, it is back to the floor.
        let back = t0 + ms(100) + Duration::from_secs_f64(10.0 * 6f64.log2()) + ms(10);
        assert_eq!(g.observe(ms(5), back), END_GRACE);
    }

    #[test]
    fn the_cap_holds_for_a_lag_just_over_it() {
        let cap_lag = MAX_GRACE / K;
        let t0 = Instant::now();
        let mut at = EventGrace::new();
        assert_eq!(at.observe(cap_lag, t0), MAX_GRACE, "at it");
        let mut over = EventGrace::new();
        assert_eq!(over.observe(cap_lag + ms(1), t0), MAX_GRACE);
        let mut absurd = EventGrace::new();
        assert_eq!(absurd.observe(Duration::from_secs(3_000), t0), MAX_GRACE);
        // An absurd lag counts as the cap's: it decays from the cap like any other.
        let later = t0 + HALF_LIFE;
        assert_eq!(absurd.observe(Duration::ZERO, later), MAX_GRACE / 2);
    }

    #[test]
    fn a_batch_out_of_order_in_time_does_not_decay_or_panic() {
        let mut g = EventGrace::new();
        let t0 = Instant::now() + Duration::from_secs(60);
        g.observe(ms(2_000), t0);
        assert_eq!(g.observe(Duration::ZERO, t0 - ms(500)), ms(4_000));
    }
}
