//! Bounds on the ext_proc streams themselves (issue 45): how many may be open in the whole
//! process (`--max-ext-proc-streams`; one past it is refused RESOURCE_EXHAUSTED before anything
//! is built for it) and how long a stream that has not been routed may go without a message from
//! its client (`--ext-proc-idle-timeout`; then it ends with DEADLINE_EXCEEDED and its driver, and
//! with it the body lease and everything else it holds, is dropped).
//!
//! Per connection, h2 bounds streams at SETTINGS_MAX_CONCURRENT_STREAMS
//! (`--max-concurrent-streams`, 1,024); with `--max-connections` (1,024) that allows ~1M streams,
//! so the process-wide cap here is what bounds their memory: 16,384 streams by default (the
//! memory account sizes per-stream state against this number, not the product).
//!
//! It owns no stream state and never looks at a message; the host (`super::Driver`) asks it.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use prometheus::IntGauge;
use tonic::{Status, Streaming};

use super::codec::Inbound;

/// Default `--max-concurrent-streams` (per connection).
pub const DEFAULT_MAX_CONCURRENT_STREAMS: u32 = 1024;
/// Default `--max-ext-proc-streams`.
pub const DEFAULT_MAX_STREAMS: usize = 16_384;
/// Default `--ext-proc-idle-timeout`, in seconds.
pub const DEFAULT_IDLE_TIMEOUT_SECS: f64 = 60.0;

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
    /// stream past it is answered RESOURCE_EXHAUSTED at once, before kvpick reads or keeps
    /// anything of it; Envoy fails that request (or fails open, with `failure_mode_allow`).
    /// Open streams: `kvpick_extproc_streams_open`.
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
}

impl StreamArgs {
    /// The checked bounds, counting open streams on `gauge`.
    pub fn bounds(&self, gauge: IntGauge) -> anyhow::Result<StreamBounds> {
        if self.max_concurrent_streams == 0 {
            anyhow::bail!("--max-concurrent-streams must be at least 1");
        }
        if self.max_ext_proc_streams == 0 {
            anyhow::bail!("--max-ext-proc-streams must be at least 1");
        }
        let t = self.ext_proc_idle_timeout;
        if !t.is_finite() || !(0.0..=86_400.0).contains(&t) {
            anyhow::bail!("--ext-proc-idle-timeout must be 0..=86400 seconds, got {t}");
        }
        Ok(StreamBounds {
            cap: StreamCap::new(self.max_ext_proc_streams, gauge),
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
            cap: StreamCap::unmetered(DEFAULT_MAX_STREAMS),
            idle_timeout: Some(Duration::from_secs_f64(DEFAULT_IDLE_TIMEOUT_SECS)),
        }
    }
}

/// The count of open ext_proc streams against `--max-ext-proc-streams`.
#[derive(Debug)]
pub struct StreamCap {
    limit: usize,
    open: AtomicUsize,
    /// Mirrors `open` (`kvpick_extproc_streams_open`).
    gauge: IntGauge,
}

impl StreamCap {
    pub fn new(limit: usize, gauge: IntGauge) -> Arc<Self> {
        Arc::new(StreamCap {
            limit,
            open: AtomicUsize::new(0),
            gauge,
        })
    }

    /// A cap reporting to a gauge nobody exports (tests).
    // A constant, valid metric name: `new` cannot fail here.
    #[allow(clippy::expect_used)]
    pub fn unmetered(limit: usize) -> Arc<Self> {
        Self::new(
            limit,
            IntGauge::new("kvpick_extproc_streams_open", "unexported").expect("valid name"),
        )
    }

    pub fn open(&self) -> usize {
        self.open.load(Ordering::Acquire)
    }

    /// A place for one more stream, held until dropped; `None` at the cap.
    pub fn try_open(self: &Arc<Self>) -> Option<StreamSlot> {
        self.open
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.limit).then_some(n + 1)
            })
            .ok()?;
        self.gauge.inc();
        Some(StreamSlot(Arc::clone(self)))
    }
}

/// One open stream's place under the cap.
#[derive(Debug)]
pub struct StreamSlot(Arc<StreamCap>);

impl Drop for StreamSlot {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::AcqRel);
        self.0.gauge.dec();
    }
}

/// The answer to a stream past the cap.
pub fn over_cap() -> Status {
    Status::resource_exhausted("kvpick: too many ext_proc streams open (--max-ext-proc-streams)")
}

/// The next message of `inbound`, waiting at most `idle` (`None`: as long as it takes);
/// `None` when nothing came for `idle`.
pub async fn read(
    inbound: &mut Streaming<Inbound>,
    idle: Option<Duration>,
) -> Option<Result<Option<Inbound>, Status>> {
    let Some(idle) = idle else {
        return Some(inbound.message().await);
    };
    tokio::time::timeout(idle, inbound.message()).await.ok()
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
    fn the_cap_admits_up_to_its_limit_and_a_closed_stream_frees_its_place() {
        let cap = StreamCap::unmetered(2);
        let a = cap.try_open().unwrap();
        let _b = cap.try_open().unwrap();
        assert!(cap.try_open().is_none(), "one past the cap");
        assert_eq!(cap.open(), 2);
        drop(a);
        assert!(cap.try_open().is_some());
    }

    #[test]
    fn flags_are_checked() {
        let args = |n, t| StreamArgs {
            max_concurrent_streams: DEFAULT_MAX_CONCURRENT_STREAMS,
            max_ext_proc_streams: n,
            ext_proc_idle_timeout: t,
        };
        let gauge = || IntGauge::new("g", "g").unwrap();
        assert!(args(0, 60.0).bounds(gauge()).is_err());
        assert!(args(1, -1.0).bounds(gauge()).is_err());
        assert!(args(1, f64::NAN).bounds(gauge()).is_err());
        assert_eq!(args(1, 0.0).bounds(gauge()).unwrap().idle_timeout, None);
        let b = args(7, 1.5).bounds(gauge()).unwrap();
        assert_eq!(b.idle_timeout, Some(Duration::from_millis(1500)));
    }
}
