//! The HTTP/2 front layer: between an accepted connection and the HTTP/2 server (h2, under
//! hyper/tonic). It bounds what a client can make kvpick decode, exactly as h2 would bound it
//! itself, makes `:authority` values h2 refuses acceptable, closes idle connections, and changes
//! nothing else.
//!
//! Why it exists: Istio's gateway calls the EPP with `:authority` = its cluster name,
//! `outbound|9002||epp.ns.svc.cluster.local`. h2 0.4 parses `:authority` as an
//! `http::uri::Authority`, which refuses `|`, and resets the stream as malformed before tonic
//! sees it (hyperium/h2 issue 619, still open). kvpick never reads the authority, so this layer
//! decodes each client header block (HEADERS + CONTINUATION) with HPACK, replaces an
//! `:authority` that `http` would refuse (Istio's `outbound|PORT|SUBSET|HOST` becomes
//! `HOST:PORT`; anything else is dropped, which h2 accepts), and re-encodes the block for h2.
//!
//! Because it decodes before h2 does, it must enforce h2's bounds first (`frames`, `hpack`,
//! `limits`): frames no larger than the advertised SETTINGS_MAX_FRAME_SIZE, a header list no
//! larger than `--max-header-list-bytes` (counted while decoding), a bounded block and number of
//! CONTINUATION frames, table size updates only where RFC 7541 allows them. A connection that
//! breaks one gets a GOAWAY with the matching error code, written by this layer between two of
//! h2's own frames (`streams::Outbound` follows h2's outbound frame boundaries), and is closed;
//! its unread input is drained for a moment first so the peer receives the GOAWAY rather than a
//! reset. Nothing else is affected.
//!
//! Floods: SETTINGS and WINDOW_UPDATE frames are rate-limited per connection (`floods`), the
//! WINDOW_UPDATE allowance credited per DATA frame h2 sent; over it is a violation like the
//! others. Every GOAWAY on the connection, the layer's and h2's own (read from h2's outbound
//! frames, `sent`), is reported with its error code and reason (`FrontConfig::on_goaway`).
//!
//! Idle connections: with an idle timeout, a connection with no open stream (`streams::Streams`,
//! from frame headers both ways) for that long gets GOAWAY(NO_ERROR) and is closed, like
//! gRPC's MAX_CONNECTION_IDLE. A stream waiting on a slow upstream keeps it open.
//!
//! Memory: the connection's ledger (`ledger`) charges unfinished gRPC messages and the DATA
//! bytes h2 holds to the process's memory account; a stream it cannot charge is reset (a
//! RST_STREAM to h2 between two inbound frames, one to the client between two of h2's).
//!
//! It never looks at what a request means.

pub mod floods;
pub mod frames;
pub mod hpack;
pub mod huffman;
pub mod ledger;
pub mod limits;
pub mod sent;
pub mod streams;

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Sleep;

pub use floods::FloodLimits;
pub use frames::FrameFilter;
pub use limits::{FrontLimits, Violation};
use streams::Outbound;

/// Replaces an `:authority` value that `http::uri::Authority` refuses. `None` = drop the header.
/// Istio's cluster names (`direction|port|subset|host`) become `host:port`.
pub fn acceptable_authority(value: &[u8]) -> Option<Vec<u8>> {
    if http::uri::Authority::try_from(value).is_ok() {
        return Some(value.to_vec());
    }
    let text = std::str::from_utf8(value).ok()?;
    let mut parts = text.split('|');
    let (_direction, port, _subset, host) =
        (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    if parts.next().is_some() || port.parse::<u16>().is_err() {
        return None;
    }
    let rewritten = format!("{host}:{port}");
    http::uri::Authority::try_from(rewritten.as_str())
        .ok()
        .map(|_| rewritten.into_bytes())
}

/// Why the layer closed a connection on its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CloseReason {
    Violation(Violation),
    /// No open stream for the idle timeout.
    Idle,
}

impl CloseReason {
    /// The GOAWAY's error code and its debug data (also its `reason` label).
    pub fn goaway(self) -> (u32, &'static str) {
        match self {
            CloseReason::Violation(v) => (v.error_code(), v.reason()),
            CloseReason::Idle => (limits::code::NO_ERROR, "idle"),
        }
    }
}

/// Called once per connection the layer closes (metrics).
pub type CloseObserver = Arc<dyn Fn(CloseReason) + Send + Sync>;

/// Called once per GOAWAY sent on a connection, the layer's or h2's: (error code, reason label;
/// a closed set: a [`Violation`]'s reason, `idle`, or `sent::h2_reason`'s).
pub type GoawayObserver = Arc<dyn Fn(u32, &'static str) + Send + Sync>;

/// What one connection's layer enforces.
#[derive(Clone, Default)]
pub struct FrontConfig {
    pub limits: FrontLimits,
    /// Close a connection with no open stream for this long; `None` = never.
    pub idle_timeout: Option<Duration>,
    pub on_close: Option<CloseObserver>,
    /// The memory account this connection charges; `None` = none.
    pub memory: Option<ledger::LedgerConfig>,
    /// SETTINGS and WINDOW_UPDATE rates (`floods`).
    pub floods: FloodLimits,
    pub on_goaway: Option<GoawayObserver>,
}

/// After its GOAWAY a closing connection's input is read and dropped for up to this long or
/// this many bytes (or until the peer closes), so closing does not reset the connection (a
/// socket closed with unread input sends RST, which can destroy the GOAWAY before the peer
/// reads it).
const LINGER: Duration = Duration::from_secs(1);
const LINGER_BYTES: usize = 1 << 20;

/// The steps of closing a connection.
enum Phase {
    /// The GOAWAY (and, if h2 wrote nothing yet, an empty SETTINGS before it) and bytes sent.
    Goaway {
        frame: Vec<u8>,
        sent: usize,
    },
    Flush,
    Shutdown,
    Linger {
        until: Pin<Box<Sleep>>,
        drained: usize,
    },
    Done,
}

struct Closing {
    reason: CloseReason,
    phase: Phase,
}

/// The idle timer, armed while no stream is open.
struct IdleTimer {
    sleep: Pin<Box<Sleep>>,
    /// `Streams::opened` when armed: any stream since restarts the timer.
    opened: u64,
}

/// An `AsyncRead + AsyncWrite` connection behind the front layer (see the module doc).
pub struct AuthorityFix<S> {
    inner: S,
    filter: FrameFilter,
    outbound: Outbound,
    idle_timeout: Option<Duration>,
    on_close: Option<CloseObserver>,
    floods: floods::FloodGuard,
    on_goaway: Option<GoawayObserver>,
    idle: Option<IdleTimer>,
    /// The reading task, woken when a write changes what reading waits for (a frame boundary
    /// for a pending GOAWAY, the last stream closing).
    read_waker: Option<Waker>,
    closing: Option<Closing>,
    eof: bool,
    rewrites_logged: bool,
    /// The ledger's frames for the client being written (between two of h2's frames), and how
    /// much of them is out.
    inject: Vec<u8>,
    inject_sent: usize,
    inject_unflushed: bool,
}

impl<S> AuthorityFix<S> {
    /// The layer with the default limits and no idle timeout.
    pub fn new(inner: S) -> Self {
        Self::with_config(inner, FrontConfig::default())
    }

    pub fn with_config(inner: S, config: FrontConfig) -> Self {
        let mut filter = FrameFilter::new(config.limits);
        if let Some(memory) = config.memory {
            filter.set_ledger(ledger::Ledger::new(memory));
        }
        AuthorityFix {
            inner,
            filter,
            outbound: Outbound::default(),
            idle_timeout: config.idle_timeout,
            on_close: config.on_close,
            floods: floods::FloodGuard::new(config.floods),
            on_goaway: config.on_goaway,
            idle: None,
            read_waker: None,
            closing: None,
            eof: false,
            rewrites_logged: false,
            inject: Vec::new(),
            inject_sent: 0,
            inject_unflushed: false,
        }
    }

    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    fn begin_close(&mut self, reason: CloseReason) {
        if let Some(observe) = &self.on_close {
            observe(reason);
        }
        match reason {
            CloseReason::Violation(v) => {
                tracing::debug!(reason = v.reason(), "closing an HTTP/2 connection: {v}")
            }
            CloseReason::Idle => tracing::debug!("closing an idle HTTP/2 connection"),
        }
        let (code, debug) = reason.goaway();
        let frame = frames::goaway_frame(self.filter.last_stream_id(), code, debug.as_bytes());
        self.closing = Some(Closing {
            reason,
            phase: Phase::Goaway { frame, sent: 0 },
        });
    }

    /// Polls the idle timer when no stream is open; true when it fired (closing has begun).
    fn poll_idle(&mut self, cx: &mut Context<'_>) -> bool {
        let Some(timeout) = self.idle_timeout else {
            return false;
        };
        let streams = self.filter.streams();
        if !streams.is_idle() {
            self.idle = None;
            return false;
        }
        let opened = streams.opened();
        let timer = match &mut self.idle {
            Some(t) if t.opened == opened => t,
            slot => slot.insert(IdleTimer {
                sleep: Box::pin(tokio::time::sleep(timeout)),
                opened,
            }),
        };
        if timer.sleep.as_mut().poll(cx).is_ready() {
            self.idle = None;
            self.begin_close(CloseReason::Idle);
            return true;
        }
        false
    }

    fn note_rewrites(&mut self) {
        if !self.rewrites_logged && self.filter.rewrites() > 0 {
            self.rewrites_logged = true;
            tracing::debug!("rewriting an :authority h2 would refuse (Istio cluster name?)");
        }
    }

    /// Processes the client's bytes read so far, then charges the flood limits with them.
    fn process(&mut self) -> Result<(), Violation> {
        self.filter.process()?;
        let data_frames = self.outbound.sent().data_frames();
        let now = tokio::time::Instant::now().into_std();
        self.floods.check(self.filter.counts(), data_frames, now)
    }

    /// Accounts for bytes of h2's that reached the connection.
    fn wrote(&mut self, bytes: &[u8]) {
        let was_idle = self.filter.streams().is_idle();
        self.outbound.advance(bytes, self.filter.streams_mut());
        self.filter.ledger_mut().server_bytes(bytes);
        let goaways = self.outbound.sent().take_goaways();
        if let Some(observe) = &self.on_goaway {
            for (code, reason) in goaways {
                observe(code, reason);
            }
        }
        let at_boundary = self.outbound.at_boundary();
        let boundary_for_goaway = self.closing.is_some() && at_boundary;
        let boundary_for_ledger = at_boundary && self.filter.ledger_mut().has_frames_for_client();
        if boundary_for_goaway
            || boundary_for_ledger
            || (!was_idle && self.filter.streams().is_idle())
        {
            if let Some(w) = self.read_waker.take() {
                w.wake();
            }
        }
    }

    /// While closing, h2's writes are dropped, except the rest of a frame it is in the middle
    /// of before the GOAWAY goes out. `Some(n)`: write at most `n` bytes; `None`: drop.
    fn write_room(&self, len: usize) -> Option<usize> {
        match &self.closing {
            None => Some(len),
            Some(Closing {
                phase: Phase::Goaway { sent: 0, .. },
                ..
            }) if !self.outbound.at_boundary() => Some(self.outbound.to_boundary().min(len)),
            Some(_) => None,
        }
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AuthorityFix<S> {
    /// Writes the ledger's frames for the client: the rest of those begun, then (when h2 is
    /// between frames) any new ones. Ready once none is half written.
    fn poll_inject(&mut self, cx: &mut Context<'_>, start_new: bool) -> Poll<io::Result<()>> {
        if self.inject_sent == self.inject.len() {
            self.inject.clear();
            self.inject_sent = 0;
            let pending = self.filter.ledger_mut().to_client();
            if !start_new || pending.is_empty() || !self.outbound.at_boundary() {
                return Poll::Ready(Ok(()));
            }
            std::mem::swap(&mut self.inject, pending);
        }
        while self.inject_sent < self.inject.len() {
            let n = std::task::ready!(
                Pin::new(&mut self.inner).poll_write(cx, &self.inject[self.inject_sent..])
            )?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.inject_sent += n;
            self.inject_unflushed = true;
        }
        Poll::Ready(Ok(()))
    }

    /// From the reading side: frames for the client go out even while h2 writes nothing.
    fn push_injected(&mut self, cx: &mut Context<'_>) -> io::Result<()> {
        if let Poll::Ready(r) = self.poll_inject(cx, true) {
            r?;
        }
        if self.inject_unflushed && self.inject_sent == self.inject.len() {
            if let Poll::Ready(r) = Pin::new(&mut self.inner).poll_flush(cx) {
                r?;
                self.inject_unflushed = false;
            }
        }
        Ok(())
    }

    /// Drives closing: GOAWAY at a frame boundary, flush, shutdown, linger; then EOF (idle) or
    /// an error (a violation) for h2.
    fn poll_close(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let AuthorityFix {
            inner,
            outbound,
            closing,
            read_waker,
            on_goaway,
            ..
        } = self;
        let Some(closing) = closing.as_mut() else {
            return Poll::Ready(Ok(()));
        };
        loop {
            let next = match &mut closing.phase {
                Phase::Goaway { frame, sent } => {
                    if *sent == 0 {
                        if !outbound.at_boundary() {
                            // h2 is mid-frame: its next write completes it and wakes us.
                            *read_waker = Some(cx.waker().clone());
                            return Poll::Pending;
                        }
                        if outbound.nothing_written() {
                            frame.splice(0..0, frames::EMPTY_SETTINGS);
                        }
                    }
                    match Pin::new(&mut *inner).poll_write(cx, &frame[*sent..]) {
                        Poll::Pending => return Poll::Pending,
                        Poll::Ready(Ok(n)) if n > 0 => {
                            *sent += n;
                            if *sent < frame.len() {
                                continue;
                            }
                            if let Some(observe) = on_goaway {
                                let (code, reason) = closing.reason.goaway();
                                observe(code, reason);
                            }
                            Phase::Flush
                        }
                        Poll::Ready(_) => Phase::Done,
                    }
                }
                Phase::Flush => match Pin::new(&mut *inner).poll_flush(cx) {
                    Poll::Pending => return Poll::Pending,
                    Poll::Ready(_) => Phase::Shutdown,
                },
                Phase::Shutdown => match Pin::new(&mut *inner).poll_shutdown(cx) {
                    Poll::Pending => return Poll::Pending,
                    Poll::Ready(_) => Phase::Linger {
                        until: Box::pin(tokio::time::sleep(LINGER)),
                        drained: 0,
                    },
                },
                Phase::Linger { until, drained } => {
                    if *drained >= LINGER_BYTES || until.as_mut().poll(cx).is_ready() {
                        Phase::Done
                    } else {
                        let mut scratch = [0u8; 8192];
                        let mut rb = ReadBuf::new(&mut scratch);
                        match Pin::new(&mut *inner).poll_read(cx, &mut rb) {
                            Poll::Pending => return Poll::Pending,
                            Poll::Ready(Ok(())) if !rb.filled().is_empty() => {
                                *drained += rb.filled().len();
                                continue;
                            }
                            Poll::Ready(_) => Phase::Done,
                        }
                    }
                }
                Phase::Done => {
                    return Poll::Ready(match closing.reason {
                        CloseReason::Idle => Ok(()),
                        CloseReason::Violation(v) => Err(io::Error::new(
                            io::ErrorKind::InvalidData,
                            format!("HTTP/2 connection closed: {v}"),
                        )),
                    });
                }
            };
            closing.phase = next;
        }
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncRead for AuthorityFix<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if buf.remaining() == 0 {
            return Poll::Ready(Ok(()));
        }
        loop {
            if this.closing.is_some() {
                // A frame of the layer's own half written is finished before the GOAWAY.
                std::task::ready!(this.poll_inject(cx, false))?;
                // Nothing more reaches h2; closing ends in EOF or an error for it.
                return this.poll_close(cx);
            }
            this.push_injected(cx)?;
            let out = this.filter.output();
            if !out.is_empty() {
                let n = out.len().min(buf.remaining());
                buf.put_slice(&out.split_to(n));
                return Poll::Ready(Ok(()));
            }
            // Inside a DATA (or other non-header) frame with nothing buffered: read its payload
            // straight into the caller's buffer, sparing a copy of request bodies.
            let room = this.filter.direct_read_room();
            if room > 0 {
                let limit = room.min(buf.remaining());
                let mut direct = ReadBuf::new(buf.initialize_unfilled_to(limit));
                match Pin::new(&mut this.inner).poll_read(cx, &mut direct) {
                    Poll::Pending => {
                        this.read_waker = Some(cx.waker().clone());
                        return Poll::Pending;
                    }
                    Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                    Poll::Ready(Ok(())) => {
                        let n = direct.filled().len();
                        let charged = this.filter.consumed_direct(direct.filled());
                        buf.advance(n);
                        if let Err(violation) = charged {
                            // These bytes reach h2; the GOAWAY follows them.
                            this.begin_close(CloseReason::Violation(violation));
                        }
                        return Poll::Ready(Ok(()));
                    }
                }
            }
            if this.eof {
                // Whatever partial frame is left goes to h2 as is; it reports the truncation.
                let raw = this.filter.input();
                let n = raw.len().min(buf.remaining());
                buf.put_slice(&raw.split_to(n));
                return Poll::Ready(Ok(()));
            }
            if let Err(violation) = this.process() {
                this.begin_close(CloseReason::Violation(violation));
                continue;
            }
            this.note_rewrites();
            if !this.filter.output().is_empty() {
                continue;
            }
            if this.poll_idle(cx) {
                continue;
            }
            let raw = this.filter.input();
            raw.reserve(16 * 1024);
            match tokio_util::io::poll_read_buf(Pin::new(&mut this.inner), cx, raw) {
                Poll::Pending => {
                    this.read_waker = Some(cx.waker().clone());
                    return Poll::Pending;
                }
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Ready(Ok(0)) => this.eof = true,
                Poll::Ready(Ok(_)) => {}
            }
        }
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncWrite for AuthorityFix<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let Some(room) = this.write_room(buf.len()) else {
            // Closing: the peer gets no more of h2's frames after the GOAWAY.
            return Poll::Ready(Ok(buf.len()));
        };
        std::task::ready!(this.poll_inject(cx, this.closing.is_none()))?;
        let n = std::task::ready!(Pin::new(&mut this.inner).poll_write(cx, &buf[..room]))?;
        this.wrote(&buf[..n]);
        Poll::Ready(Ok(n))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.write_room(1).is_none() {
            return Poll::Ready(Ok(()));
        }
        std::task::ready!(this.poll_inject(cx, this.closing.is_none()))?;
        std::task::ready!(Pin::new(&mut this.inner).poll_flush(cx))?;
        this.inject_unflushed = false;
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.closing.is_some() {
            // The layer shuts the connection down itself once its GOAWAY is out.
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut this.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.closing.is_some() {
            let first = bufs.iter().find(|b| !b.is_empty()).map_or(&[][..], |b| b);
            return Pin::new(this).poll_write(cx, first);
        }
        std::task::ready!(this.poll_inject(cx, true))?;
        let mut n = std::task::ready!(Pin::new(&mut this.inner).poll_write_vectored(cx, bufs))?;
        let written = n;
        for b in bufs {
            if n == 0 {
                break;
            }
            let take = n.min(b.len());
            this.wrote(&b[..take]);
            n -= take;
        }
        Poll::Ready(Ok(written))
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

#[cfg(test)]
#[path = "tests.rs"]
mod tests;

#[cfg(test)]
#[path = "memory_tests.rs"]
mod memory_tests;
