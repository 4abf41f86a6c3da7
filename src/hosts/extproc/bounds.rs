//! Bounds on the ext_proc streams themselves (issue 45): how many may be open in the whole
//! process (`--max-ext-proc-streams`, kept by [`super::cap`]: one past it takes the place of a
//! stream idle before routing for `--ext-proc-evict-idle-after`, else is refused
//! RESOURCE_EXHAUSTED before anything is built for it) and how long a stream that has not been
//! routed may go without a message from its client (`--ext-proc-idle-timeout`; then it ends
//! with DEADLINE_EXCEEDED and its driver, and with it the body lease and everything else it
//! holds, is dropped).
//!
//! Per connection, h2 bounds streams at SETTINGS_MAX_CONCURRENT_STREAMS
//! (`--max-concurrent-streams`, 1,024); with `--max-connections` (1,024) that allows ~1M streams,
//! so the process-wide cap here is what bounds their memory: 16,384 streams by default (the
//! memory account sizes per-stream state against this number, not the product).
//!
//! It owns no stream state and never looks at a message; the host (`super::Driver`) asks it.

use std::sync::Arc;
use std::time::Duration;

use prometheus::IntGauge;
use tonic::transport::server::TcpConnectInfo;
use tonic::{Request, Status, Streaming};

pub use super::cap::{ConnId, Evicted, StreamCap, StreamSlot};
use super::codec::Inbound;

/// Default `--max-concurrent-streams` (per connection).
pub const DEFAULT_MAX_CONCURRENT_STREAMS: u32 = 1024;
/// Default `--max-ext-proc-streams`.
pub const DEFAULT_MAX_STREAMS: usize = 16_384;
/// Largest `--max-ext-proc-streams`: the product of the per-connection and connection caps'
/// defaults. The cap's places are allocated at start (24 bytes each: 24 MiB at this).
pub const MAX_STREAMS: usize = 1 << 20;
/// Default `--ext-proc-idle-timeout`, in seconds.
pub const DEFAULT_IDLE_TIMEOUT_SECS: f64 = 60.0;
/// Default `--ext-proc-evict-idle-after`, in seconds.
pub const DEFAULT_EVICT_IDLE_AFTER_SECS: f64 = 1.0;

/// Flags of the stream bounds (`kvpick serve`).
#[derive(Debug, Clone, clap::Args)]
pub struct StreamArgs {
    /// Most concurrent HTTP/2 streams per connection on the ext_proc port
    /// (SETTINGS_MAX_CONCURRENT_STREAMS); Envoy opens more connections past it. h2 refuses a
    /// stream past it (RST_STREAM REFUSED_STREAM). The process-wide bound is
    /// --max-ext-proc-streams.
    #[arg(long, default_value_t = DEFAULT_MAX_CONCURRENT_STREAMS, value_name = "N")]
    pub max_concurrent_streams: u32,

    /// Most ext_proc streams open at once in the whole process, over all connections (each
    /// connection also holds at most --max-concurrent-streams; with --max-connections that
    /// product, ~1M by default, is far past what memory allows, so this cap is the bound). A
    /// new stream past it takes the place of an idle unrouted one
    /// (--ext-proc-evict-idle-after), or, with none, is answered RESOURCE_EXHAUSTED at once,
    /// before kvpick reads or keeps anything of it; Envoy fails that request (or fails open,
    /// with `failure_mode_allow`). Open streams: `kvpick_extproc_streams_open`. At most
    /// 1048576 (its places are allocated at start, 24 bytes each).
    #[arg(long, default_value_t = DEFAULT_MAX_STREAMS, value_name = "N")]
    pub max_ext_proc_streams: usize,

    /// Seconds an ext_proc stream that has not been routed yet may go without a message from
    /// Envoy; then it ends with DEADLINE_EXCEEDED and releases its buffered body
    /// (`kvpick_extproc_streams_total{end="idle_timeout"}`). Envoy sends the request headers at
    /// once and, in the FULL_DUPLEX_STREAMED body mode kvpick requires (as in STREAMED), each
    /// body chunk as it arrives from the client: this bounds a slow client's pause before or
    /// between chunks, never the length of its upload. (In BUFFERED mode, which kvpick refuses,
    /// Envoy would send the body only once uploaded, and this would bound the whole upload: 60 s
    /// is 32 MiB at ~4.5 Mbit/s.) Once routed, a stream is bound by its booking, not by this.
    /// 0 = never.
    #[arg(long, default_value_t = DEFAULT_IDLE_TIMEOUT_SECS, value_name = "SECONDS")]
    pub ext_proc_idle_timeout: f64,

    /// At --max-ext-proc-streams, a new stream takes the place of a stream that has not been
    /// routed and has waited at least this many seconds for its next request message (the most
    /// idle of a sample of up to 32 open streams); that one ends RESOURCE_EXHAUSTED
    /// (`kvpick_extproc_streams_total{end="evicted"}`) and releases all it holds. So streams an
    /// attacker opens and leaves silent cannot refuse Envoy's. Only a stream whose connection
    /// holds more such waiting streams than the new stream's connection would, counting it,
    /// gives way: places move from connections hoarding unrouted streams to those that don't
    /// (Envoy's), and hoarding connections cannot churn each other's. A connection holding more
    /// than 4 times the new stream's connection's waiting streams gets proportionally less than
    /// this (200 against 1: 1/50 of it), so a cap an attacker has just filled is not lost to
    /// Envoy for this long. Envoy's never qualify: it sends
    /// the request headers message at once and, in FULL_DUPLEX_STREAMED, each body chunk as it
    /// arrives from the client (only a client pausing this long mid-upload, while the cap is
    /// full, would lose its request). A routed stream, or one being tokenized or queued, is
    /// never evicted. 0 = never: a stream past the cap is refused.
    #[arg(long, default_value_t = DEFAULT_EVICT_IDLE_AFTER_SECS, value_name = "SECONDS")]
    pub ext_proc_evict_idle_after: f64,
}

impl StreamArgs {
    /// The checked bounds, counting open streams on `gauge`.
    pub fn bounds(&self, gauge: IntGauge) -> anyhow::Result<StreamBounds> {
        if self.max_concurrent_streams == 0 {
            anyhow::bail!("--max-concurrent-streams must be at least 1");
        }
        if !(1..=MAX_STREAMS).contains(&self.max_ext_proc_streams) {
            anyhow::bail!("--max-ext-proc-streams must be 1..={MAX_STREAMS}");
        }
        let t = self.ext_proc_idle_timeout;
        if !t.is_finite() || !(0.0..=86_400.0).contains(&t) {
            anyhow::bail!("--ext-proc-idle-timeout must be 0..=86400 seconds, got {t}");
        }
        let e = self.ext_proc_evict_idle_after;
        if !e.is_finite() || !(0.0..=86_400.0).contains(&e) {
            anyhow::bail!("--ext-proc-evict-idle-after must be 0..=86400 seconds, got {e}");
        }
        let evict_after = (e > 0.0).then(|| Duration::from_secs_f64(e));
        Ok(StreamBounds {
            cap: StreamCap::new(self.max_ext_proc_streams, evict_after, gauge),
            idle_timeout: (t > 0.0).then(|| Duration::from_secs_f64(t)),
        })
    }
}

/// The process's bounds on ext_proc streams.
#[derive(Debug, Clone)]
pub struct StreamBounds {
    pub cap: Arc<StreamCap>,
    /// `None` = never.
    pub idle_timeout: Option<Duration>,
}

impl Default for StreamBounds {
    fn default() -> Self {
        StreamBounds {
            cap: StreamCap::unmetered(
                DEFAULT_MAX_STREAMS,
                Some(Duration::from_secs_f64(DEFAULT_EVICT_IDLE_AFTER_SECS)),
            ),
            idle_timeout: Some(Duration::from_secs_f64(DEFAULT_IDLE_TIMEOUT_SECS)),
        }
    }
}

/// The connection `request` came on, for fairness at the cap: tonic puts the connection's
/// addresses in each request's extensions (`crate::transport::net::Conn` and plain TCP alike).
pub fn conn_id<T>(request: &Request<T>) -> ConnId {
    let info = request.extensions().get::<TcpConnectInfo>()?;
    Some((info.local_addr(), info.remote_addr()?))
}

/// The answer to a stream past the cap.
pub fn over_cap() -> Status {
    Status::resource_exhausted("kvpick: too many ext_proc streams open (--max-ext-proc-streams)")
}

/// How a stream ended while kvpick waited for its next message: the label of
/// `kvpick_extproc_streams_total{end}` and the status it is answered.
#[derive(Debug)]
pub struct Ended {
    pub end: &'static str,
    pub status: Status,
}

/// The next message of `inbound`. Before routing (`before_routing`) the stream is evictable
/// while it waits and the wait is bounded by `idle` (`None`: as long as it takes); after, its
/// slot is held first. `Err` when the stream must end without one.
pub async fn read(
    inbound: &mut Streaming<Inbound>,
    slot: &mut StreamSlot,
    before_routing: bool,
    idle: Option<Duration>,
) -> Result<Result<Option<Inbound>, Status>, Ended> {
    if !before_routing {
        slot.hold().map_err(|Evicted| evicted())?;
        return Ok(inbound.message().await);
    }
    let message = async {
        match idle {
            None => Ok(inbound.message().await),
            Some(idle) => {
                (tokio::time::timeout(idle, inbound.message()).await).map_err(|_| Ended {
                    end: "idle_timeout",
                    status: idle_status(idle),
                })
            }
        }
    };
    tokio::select! {
        biased;
        Evicted = slot.waiting() => Err(evicted()),
        read = message => read,
    }
}

/// Holds `slot` before the host works on what a message started (tokenizing, a lookup, a wait
/// in the queue) or once the stream is routed: from then on it is never evicted. `Err` if it
/// was evicted meanwhile.
pub fn hold(slot: &mut StreamSlot) -> Result<(), Ended> {
    slot.hold().map_err(|Evicted| evicted())
}

fn evicted() -> Ended {
    Ended {
        end: "evicted",
        status: Status::resource_exhausted("kvpick: stream evicted at the stream cap"),
    }
}

/// The end of a stream that sent nothing for `idle` before routing.
pub fn idle_status(idle: Duration) -> Status {
    Status::deadline_exceeded(format!(
        "kvpick: no ext_proc message for {:.1}s before routing (--ext-proc-idle-timeout)",
        idle.as_secs_f64()
    ))
}

#[cfg(test)]
#[path = "bounds_tests.rs"]
mod host_tests;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_are_checked() {
        let args = |n, t| StreamArgs {
            max_concurrent_streams: DEFAULT_MAX_CONCURRENT_STREAMS,
            max_ext_proc_streams: n,
            ext_proc_idle_timeout: t,
            ext_proc_evict_idle_after: DEFAULT_EVICT_IDLE_AFTER_SECS,
        };
        let gauge = || IntGauge::new("g", "g").unwrap();
        assert!(args(0, 60.0).bounds(gauge()).is_err());
        assert!(args(MAX_STREAMS, 60.0).bounds(gauge()).is_ok());
        assert!(args(MAX_STREAMS + 1, 60.0).bounds(gauge()).is_err());
        assert!(args(1, -1.0).bounds(gauge()).is_err());
        assert!(args(1, f64::NAN).bounds(gauge()).is_err());
        assert_eq!(args(1, 0.0).bounds(gauge()).unwrap().idle_timeout, None);
        let b = args(7, 1.5).bounds(gauge()).unwrap();
        assert_eq!(b.idle_timeout, Some(Duration::from_millis(1500)));
        let evict = |e| StreamArgs {
            ext_proc_evict_idle_after: e,
            ..args(1, 60.0)
        };
        assert!(evict(-0.5).bounds(gauge()).is_err());
        assert!(evict(f64::INFINITY).bounds(gauge()).is_err());
        assert!(evict(86_400.5).bounds(gauge()).is_err());
        assert!(evict(0.0).bounds(gauge()).is_ok());
        assert!(evict(86_400.0).bounds(gauge()).is_ok());
    }
}
