//! One rank's link to its engine, below the sequence logic: the SUB socket opened with a bounded
//! connect and a monitor (so a lost publisher is seen at once), the reconnect schedule, the
//! connect probe of the engine's HTTP endpoint, and the two marks a subscription holds while it
//! runs (the connected gauge, the rank held unreachable).
//!
//! Why kvpick retries itself: `zeromq`'s `SubSocket::connect` starts its own reconnect task (back
//! off to 30 s, a WARN per failed attempt), so `recv` never fails when the publisher dies. Here the
//! monitor's `Disconnected` ends the subscription, the socket is dropped (which stops that task)
//! and [`Backoff`] paces the next attempts.
//!
//! Owns sockets and schedules only; what a message means is [`super::ingest`]'s.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use futures::channel::mpsc;
use zeromq::{Socket, SocketEvent, SocketOptions, SubSocket};

use crate::selection::{RankKey, SelectionCore};

/// The first wait before resubscribing after a failed attempt.
pub const BACKOFF_START: Duration = Duration::from_millis(100);
/// The longest wait between two attempts (before jitter, which only shortens it). With one
/// attempt taking at most [`CONNECT_ATTEMPT`], a publisher that comes back is subscribed to within
/// 5 s: see docs/kv-events.md ("Losing the engine") for why that bound.
pub const BACKOFF_MAX: Duration = Duration::from_secs(4);
/// One subscription attempt: the TCP connect (refusals retried inside it by `zeromq`, silently)
/// and the ZMTP handshake.
pub const CONNECT_ATTEMPT: Duration = Duration::from_secs(1);
/// How often the engine's HTTP endpoint is probed while its subscription is down, or while the
/// rank is held unreachable.
pub const PROBE_INTERVAL: Duration = Duration::from_millis(250);
/// A probe's connect gets this long; past it the endpoint counts as not answering.
pub const PROBE_TIMEOUT: Duration = Duration::from_millis(500);

/// Capped exponential backoff with jitter: attempt `n` waits `min(START * 2^n, MAX)` scaled by a
/// factor in `[0.5, 1)`, so ranks that lost their engines together do not retry in lockstep.
#[derive(Debug, Default)]
pub struct Backoff {
    failures: u32,
}

impl Backoff {
    /// The wait before the next attempt; `unit` is a uniform draw in `[0, 1)`.
    pub fn next_wait_with(&mut self, unit: f64) -> Duration {
        let doubled = BACKOFF_START.saturating_mul(1u32 << self.failures.min(16));
        let base = doubled.min(BACKOFF_MAX);
        self.failures = self.failures.saturating_add(1);
        base.mul_f64(0.5 + 0.5 * unit.clamp(0.0, 1.0))
    }

    pub fn next_wait(&mut self) -> Duration {
        self.next_wait_with(rand::random::<f64>())
    }

    pub fn reset(&mut self) {
        self.failures = 0;
    }
}

/// Whether something accepts TCP connections at `addr` within [`PROBE_TIMEOUT`]. A refusal means
/// no process listens there: the engine is down (a host that is gone times out instead).
pub async fn answers(addr: SocketAddr) -> bool {
    within_probe_timeout(tokio::net::TcpStream::connect(addr)).await
}

/// Whether `connect` succeeds within [`PROBE_TIMEOUT`].
async fn within_probe_timeout<T>(
    connect: impl std::future::Future<Output = std::io::Result<T>>,
) -> bool {
    matches!(
        tokio::time::timeout(PROBE_TIMEOUT, connect).await,
        Ok(Ok(_))
    )
}

/// A connected SUB socket and its monitor.
pub struct Subscription {
    pub socket: SubSocket,
    pub monitor: mpsc::Receiver<SocketEvent>,
}

/// Subscribes to every topic at `endpoint`, in one attempt of at most [`CONNECT_ATTEMPT`].
pub async fn subscribe(endpoint: &str) -> Result<Subscription, String> {
    let mut options = SocketOptions::default();
    options.connect_timeout(CONNECT_ATTEMPT);
    let mut socket = SubSocket::with_options(options);
    let monitor = socket.monitor();
    let attempt = async {
        socket.connect(endpoint).await?;
        socket.subscribe("").await
    };
    match tokio::time::timeout(CONNECT_ATTEMPT, attempt).await {
        Ok(Ok(())) => Ok(Subscription { socket, monitor }),
        Ok(Err(err)) => Err(err.to_string()),
        Err(_) => Err("connect timed out".into()),
    }
}

/// Counts one connected subscription in `kvpick_kv_subscriptions` for as long as it lives (a
/// subscription stopped by a catalog change is uncounted too).
pub struct Connected(prometheus::IntGauge);

impl Connected {
    pub fn new(gauge: &prometheus::IntGauge) -> Connected {
        gauge.inc();
        Connected(gauge.clone())
    }
}

impl Drop for Connected {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// What one subscription task says about its rank's engine. Reports go to the core every time
/// (the core reports a change once), so a rank the catalog re-created meanwhile is judged again.
/// A task that ends (its rank left, its endpoints changed) withdraws its judgement: the rank is
/// reachable unless a new task finds otherwise.
pub struct Reach {
    core: Arc<SelectionCore>,
    rank: RankKey,
    reachable: bool,
}

impl Reach {
    pub fn new(core: Arc<SelectionCore>, rank: RankKey) -> Reach {
        Reach {
            core,
            rank,
            reachable: true,
        }
    }

    pub fn reachable(&self) -> bool {
        self.reachable
    }

    pub fn set(&mut self, reachable: bool) {
        self.reachable = reachable;
        self.core.set_rank_reachable(self.rank, reachable);
    }

    /// The rank's HTTP endpoint answers a connect now (`false` also when the rank has none in
    /// the catalog any more).
    pub async fn probe(&self) -> bool {
        match self.core.inner().rank_endpoint(self.rank) {
            Some(addr) => answers(addr).await,
            None => false,
        }
    }
}

impl Drop for Reach {
    fn drop(&mut self) {
        if !self.reachable {
            self.core.set_rank_reachable(self.rank, true);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_to_its_cap_with_jitter_below_the_bound() {
        let mut b = Backoff::default();
        let top: Vec<Duration> = (0..8).map(|_| b.next_wait_with(0.999_999)).collect();
        let ms = |d: &Duration| d.as_millis();
        assert_eq!(
            top.iter().map(ms).collect::<Vec<_>>(),
            [99, 199, 399, 799, 1599, 3199, 3999, 3999],
            "doubling, capped"
        );
        let mut b = Backoff::default();
        let low: Vec<Duration> = (0..8).map(|_| b.next_wait_with(0.0)).collect();
        assert_eq!(
            low.iter().map(ms).collect::<Vec<_>>(),
            [50, 100, 200, 400, 800, 1600, 2000, 2000],
            "jitter halves at most"
        );
        // Thousands of failures never overflow or pass the cap; a wait plus an attempt stays
        // within the documented 5 s.
        let mut b = Backoff::default();
        for _ in 0..10_000 {
            let wait = b.next_wait();
            assert!(wait >= BACKOFF_START / 2 && wait < BACKOFF_MAX, "{wait:?}");
        }
        assert!(BACKOFF_MAX + CONNECT_ATTEMPT <= Duration::from_secs(5));
        b.reset();
        assert!(
            b.next_wait_with(0.999) < Duration::from_millis(100),
            "reset starts over"
        );
    }

    #[test]
    fn jitter_spreads_ranks_that_failed_together() {
        let waits: std::collections::HashSet<u128> = (0..50)
            .map(|_| {
                let mut b = Backoff::default();
                for _ in 0..6 {
                    b.next_wait();
                }
                b.next_wait().as_micros()
            })
            .collect();
        assert!(waits.len() > 40, "{} distinct waits of 50", waits.len());
    }

    #[tokio::test(start_paused = true)]
    async fn a_probe_waits_its_timeout_and_no_longer() {
        let connect_in = |d: Duration| async move {
            tokio::time::sleep(d).await;
            Ok::<(), std::io::Error>(())
        };
        let just = Duration::from_millis(1);
        assert!(within_probe_timeout(connect_in(PROBE_TIMEOUT - just)).await);
        assert!(!within_probe_timeout(connect_in(PROBE_TIMEOUT + just)).await);
        let refused =
            async { Err::<(), _>(std::io::Error::from(std::io::ErrorKind::ConnectionRefused)) };
        assert!(!within_probe_timeout(refused).await);
    }

    /// A peer that accepts the connection but never speaks ZMTP: the attempt ends at its bound.
    #[tokio::test(start_paused = true)]
    async fn a_subscription_attempt_is_bounded() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let endpoint = format!("tcp://{}", listener.local_addr().unwrap());
        let mute = tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((stream, _)) = listener.accept().await {
                held.push(stream);
            }
        });
        let started = tokio::time::Instant::now();
        assert!(subscribe(&endpoint).await.is_err());
        let took = started.elapsed();
        assert!(
            took >= CONNECT_ATTEMPT - Duration::from_millis(1)
                && took <= CONNECT_ATTEMPT + Duration::from_millis(50),
            "{took:?}"
        );
        mute.abort();
    }

    #[tokio::test]
    async fn a_probe_tells_a_listener_from_a_refused_port() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        assert!(answers(addr).await);
        drop(listener);
        assert!(!answers(addr).await, "nothing listens: refused");
    }
}
