//! Listener plumbing shared by the gRPC ports: an accept loop that bounds open connections
//! (`--max-connections`, a connection past it is closed at once), sets TCP_NODELAY, optionally
//! terminates TLS (OpenSSL, handshakes off the accept path, at most
//! `--max-concurrent-tls-handshakes` at once, each within `--tls-handshake-timeout`), puts the
//! HTTP/2 front layer (`h2_authority`: h2's bounds, the `:authority` fix, the idle timeout) in
//! front of h2, and stops accepting at shutdown so a draining process refuses new connections
//! instead of leaving them hanging. The accept loop hands each connection on (`Handoff`): to this
//! runtime (`Admit`, which runs the handshake and the front layer where the connection will be
//! served) or to the ext_proc port's connection threads (`crate::transport::lanes`). Writes are gathered
//! under TLS (or under h2, plain) until h2 flushes, so a batch of frames leaves in one `send`.
//! Also the flags of these bounds (`ConnArgs`) and the HTTP/2 settings they give the tonic
//! servers, so the layer and h2 agree.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use anyhow::bail;
use prometheus::IntGauge;
use tokio::io::{AsyncRead, AsyncWrite, BufWriter, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch, OwnedSemaphorePermit, Semaphore};
use tokio_openssl::SslStream;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::server::{Connected, TcpConnectInfo};

use crate::observability::metrics::ConnMetrics;
use crate::transport::h2_authority::floods::{
    DEFAULT_SETTINGS_PER_SECOND, DEFAULT_WINDOW_UPDATES_PER_SECOND,
};
use crate::transport::h2_authority::limits::{
    DEFAULT_MAX_HEADER_LIST_BYTES, MAX_FRAME_SIZE, MAX_MAX_HEADER_LIST_BYTES,
    MIN_MAX_HEADER_LIST_BYTES,
};
use crate::transport::h2_authority::{
    AuthorityFix, CloseReason, FloodLimits, FrontConfig, FrontLimits,
};
use crate::transport::tls::TlsServer;

/// Bounds on the connections of the gRPC ports (flags of `kvpick serve`).
#[derive(Debug, Clone, clap::Args)]
#[command(next_help_heading = "Connections")]
pub struct ConnArgs {
    /// Most open connections per gRPC port (ext_proc, health), TLS handshakes included. A
    /// connection accepted past it is closed at once
    /// (`kvpick_connections_refused_total{reason="connection_limit"}`). Envoy keeps a handful of
    /// long-lived connections per gateway pod, so this only stops connection floods.
    #[arg(long, default_value_t = 1024, value_name = "N")]
    pub max_connections: usize,

    /// Most TLS handshakes in progress at once on the ext_proc port. Connections past it wait for
    /// a slot (within --tls-handshake-timeout) instead of being refused: a burst of gateway
    /// reconnects is served a little later, not turned away.
    #[arg(long, default_value_t = 64, value_name = "N")]
    pub max_concurrent_tls_handshakes: usize,

    /// Seconds from accept within which a TLS handshake must finish, waiting for a slot
    /// included; then the connection is closed (`kvpick_tls_handshakes_total{result="timeout"}`).
    #[arg(long, default_value_t = 10.0, value_name = "SECONDS")]
    pub tls_handshake_timeout: f64,

    /// Seconds between the HTTP/2 PINGs kvpick sends on each connection; 0 = none.
    #[arg(long, default_value_t = 30.0, value_name = "SECONDS")]
    pub http2_keepalive_interval: f64,

    /// Seconds a PING may go unanswered before its connection is closed (a peer that vanished).
    #[arg(long, default_value_t = 20.0, value_name = "SECONDS")]
    pub http2_keepalive_timeout: f64,

    /// Seconds a connection may go without an open stream (or never open one) before it gets
    /// GOAWAY (NO_ERROR) and is closed; a stream waiting on a slow upstream keeps it open. A
    /// gateway simply reconnects for its next request. 0 = never.
    #[arg(long, default_value_t = 300.0, value_name = "SECONDS")]
    pub http2_idle_timeout: f64,

    /// Largest decoded request header list (SETTINGS_MAX_HEADER_LIST_SIZE: name + value + 32
    /// bytes per header), counted while decoding; a client sending more gets GOAWAY
    /// (ENHANCE_YOUR_CALM) and its connection is closed. Header blocks are bounded at
    /// max(64 KiB, this), CONTINUATION frames at 8 per block (more for larger values), frames
    /// at 16,384 bytes (SETTINGS_MAX_FRAME_SIZE). 1024..=1048576.
    #[arg(long, default_value_t = DEFAULT_MAX_HEADER_LIST_BYTES, value_name = "BYTES")]
    pub max_header_list_bytes: usize,

    /// SETTINGS frames a client may send per second on one connection, after a burst of 32; a
    /// client over it gets GOAWAY (ENHANCE_YOUR_CALM) and its connection is closed
    /// (`kvpick_connections_refused_total{reason="settings_flood"}`). h2 applies each SETTINGS
    /// to every open stream, so a flood toggling INITIAL_WINDOW_SIZE on a connection with many
    /// streams costs CPU-seconds; real clients send one at connect (gRPC's BDP probing a few
    /// more over a connection's life, as its window grows). 0 = unlimited.
    #[arg(long = "http2-max-settings-per-second", default_value_t = DEFAULT_SETTINGS_PER_SECOND, value_name = "N")]
    pub http2_max_settings_per_second: u32,

    /// WINDOW_UPDATE frames a client may send per second on one connection, after a burst of
    /// 256, plus 2 for every DATA frame kvpick sent on it (a peer acknowledges received data
    /// per stream and per connection; at most 8,192 of that credit banked): busy connections
    /// never reach it. Over it: GOAWAY (ENHANCE_YOUR_CALM), connection closed
    /// (`kvpick_connections_refused_total{reason="window_update_flood"}`). 0 = unlimited.
    #[arg(long = "http2-max-window-updates-per-second", default_value_t = DEFAULT_WINDOW_UPDATES_PER_SECOND, value_name = "N")]
    pub http2_max_window_updates_per_second: u32,

    /// Threads serving the ext_proc port's connections, each with its own single-threaded
    /// runtime: a connection, its TLS and every stream on it stay on one thread (no cross-thread
    /// wake-ups per request), and new connections go to the thread holding the fewest. Default:
    /// one per CPU available to the process (a container's CPU limit counts). 0 serves them on
    /// the shared runtime instead. 0..=256. Each thread's open connections:
    /// `kvpick_connection_thread_connections{thread}`.
    #[arg(long, value_name = "N")]
    pub connection_threads: Option<usize>,
}

/// Most `--connection-threads`.
pub const MAX_CONNECTION_THREADS: usize = 256;

/// `--connection-threads`: unset means one per CPU this process may use; 0 serves the ext_proc
/// port's connections on the main runtime.
pub fn connection_threads(flag: Option<usize>) -> anyhow::Result<usize> {
    match flag {
        Some(n) if n > MAX_CONNECTION_THREADS => {
            anyhow::bail!("--connection-threads must be 0..={MAX_CONNECTION_THREADS}, got {n}")
        }
        Some(n) => Ok(n),
        None => Ok(std::thread::available_parallelism().map_or(1, |n| n.get())),
    }
}

/// The checked values of [`ConnArgs`].
#[derive(Debug, Clone)]
pub struct ConnLimits {
    pub max_connections: usize,
    pub max_concurrent_tls_handshakes: usize,
    pub tls_handshake_timeout: Duration,
    pub http2_keepalive_interval: Option<Duration>,
    pub http2_keepalive_timeout: Duration,
    pub http2_idle_timeout: Option<Duration>,
    pub front: FrontLimits,
    /// SETTINGS and WINDOW_UPDATE rates per connection.
    pub floods: FloodLimits,
    /// Connection lanes of the ext_proc port (`crate::transport::lanes`); 0 = none.
    pub connection_threads: usize,
    /// The memory account each connection charges (`h2_authority::ledger`); `None` = none.
    pub memory: Option<crate::transport::h2_authority::ledger::LedgerConfig>,
}

impl Default for ConnLimits {
    fn default() -> Self {
        ConnLimits {
            max_connections: 1024,
            max_concurrent_tls_handshakes: 64,
            tls_handshake_timeout: Duration::from_secs(10),
            http2_keepalive_interval: Some(Duration::from_secs(30)),
            http2_keepalive_timeout: Duration::from_secs(20),
            http2_idle_timeout: Some(Duration::from_secs(300)),
            front: FrontLimits::default(),
            floods: FloodLimits::default(),
            connection_threads: 0,
            memory: None,
        }
    }
}

/// `value` seconds as a duration: finite, >= 0, at most a day; 0 is `None` where allowed.
fn seconds(flag: &str, value: f64, zero_means_off: bool) -> anyhow::Result<Option<Duration>> {
    if !value.is_finite() || !(0.0..=86_400.0).contains(&value) {
        bail!("{flag} must be 0..=86400 seconds, got {value}");
    }
    if value == 0.0 {
        if zero_means_off {
            return Ok(None);
        }
        bail!("{flag} must be more than 0 seconds");
    }
    Ok(Some(Duration::from_secs_f64(value)))
}

impl ConnArgs {
    pub fn limits(&self) -> anyhow::Result<ConnLimits> {
        if self.max_connections == 0 {
            bail!("--max-connections must be at least 1");
        }
        if self.max_concurrent_tls_handshakes == 0 {
            bail!("--max-concurrent-tls-handshakes must be at least 1");
        }
        let list = self.max_header_list_bytes;
        if !(MIN_MAX_HEADER_LIST_BYTES..=MAX_MAX_HEADER_LIST_BYTES).contains(&list) {
            bail!(
                "--max-header-list-bytes must be {MIN_MAX_HEADER_LIST_BYTES}..={MAX_MAX_HEADER_LIST_BYTES}, got {list}"
            );
        }
        let handshake = seconds("--tls-handshake-timeout", self.tls_handshake_timeout, false)?;
        let keepalive = seconds(
            "--http2-keepalive-timeout",
            self.http2_keepalive_timeout,
            false,
        )?;
        Ok(ConnLimits {
            max_connections: self.max_connections,
            max_concurrent_tls_handshakes: self.max_concurrent_tls_handshakes,
            tls_handshake_timeout: handshake.unwrap_or_default(),
            http2_keepalive_interval: seconds(
                "--http2-keepalive-interval",
                self.http2_keepalive_interval,
                true,
            )?,
            http2_keepalive_timeout: keepalive.unwrap_or_default(),
            http2_idle_timeout: seconds("--http2-idle-timeout", self.http2_idle_timeout, true)?,
            front: FrontLimits::new(list),
            floods: FloodLimits {
                settings_per_second: self.http2_max_settings_per_second,
                window_updates_per_second: self.http2_max_window_updates_per_second,
            },
            connection_threads: connection_threads(self.connection_threads)?,
            memory: None,
        })
    }
}

impl ConnLimits {
    /// The HTTP/2 settings of a tonic server whose connections come from [`incoming`] with these
    /// limits: the frame size and header-list size h2 advertises are the ones the front layer
    /// enforces, and the keepalive PINGs.
    pub fn http2_settings<L>(
        &self,
        server: tonic::transport::Server<L>,
    ) -> tonic::transport::Server<L> {
        server
            .http2_keepalive_interval(self.http2_keepalive_interval)
            .http2_keepalive_timeout(Some(self.http2_keepalive_timeout))
            .http2_max_header_list_size(self.front.max_header_list_bytes as u32)
            .max_frame_size(MAX_FRAME_SIZE)
    }
}

/// One listener's settings for [`incoming`].
#[derive(Clone)]
pub struct Listening {
    /// The `listener` label of the connection metrics (`grpc`, `health`).
    pub name: &'static str,
    pub tls: Option<Arc<TlsServer>>,
    pub limits: ConnLimits,
    pub metrics: ConnMetrics,
}

/// Bytes written to a connection are gathered here and sent when h2 flushes (or the buffer
/// fills): h2 writes a DATA frame's header and its payload in two calls, and TLS turns every call
/// into its own record; without the buffer each became its own `send`.
pub const WRITE_BUFFER_BYTES: usize = 64 * 1024;

/// A connection's socket under TLS (or under h2, plain): writes gathered until a flush.
pub type Socket = BufWriter<TcpStream>;

fn socket(stream: TcpStream) -> Socket {
    BufWriter::with_capacity(WRITE_BUFFER_BYTES, stream)
}

/// Resolves once `exit` turns true: the shutdown signal of the servers on these listeners.
pub async fn closed(mut exit: watch::Receiver<bool>) {
    let _ = exit.wait_for(|s| *s).await;
}

/// The byte stream under HTTP/2: plain (h2c) or TLS.
pub enum Transport {
    Plain(Socket),
    Tls(Box<SslStream<Socket>>),
}

/// An accepted connection, as h2 sees it: the transport behind the `:authority` fix
/// (`h2_authority`), plus the addresses tonic reports.
pub struct Conn {
    io: AuthorityFix<Transport>,
    info: TcpConnectInfo,
    _slot: ConnSlot,
}

impl Conn {
    fn new(transport: Transport, info: TcpConnectInfo, slot: ConnSlot, front: FrontConfig) -> Self {
        Conn {
            io: AuthorityFix::with_config(transport, front),
            info,
            _slot: slot,
        }
    }
}

/// One of `--max-connections`, held from accept until the connection is dropped.
struct ConnSlot {
    _permit: OwnedSemaphorePermit,
    open: IntGauge,
    /// The open connections of the lane serving it (`crate::transport::lanes`), if any.
    lane: Option<IntGauge>,
}

impl ConnSlot {
    fn new(permit: OwnedSemaphorePermit, open: IntGauge) -> Self {
        open.inc();
        ConnSlot {
            _permit: permit,
            open,
            lane: None,
        }
    }
}

impl Drop for ConnSlot {
    fn drop(&mut self) {
        self.open.dec();
        if let Some(lane) = &self.lane {
            lane.dec();
        }
    }
}

/// Counts a connection in a gauge for as long as it lives (waiting for a handshake slot, or
/// holding one).
struct Counted(IntGauge);

impl Counted {
    fn new(gauge: &IntGauge) -> Self {
        gauge.inc();
        Counted(gauge.clone())
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.dec();
    }
}

impl Connected for Conn {
    type ConnectInfo = TcpConnectInfo;
    fn connect_info(&self) -> Self::ConnectInfo {
        self.info.clone()
    }
}

impl AsyncRead for Conn {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_read(cx, buf)
    }
}

impl AsyncWrite for Conn {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write(cx, buf)
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

impl AsyncRead for Transport {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Transport::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Transport::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Transport {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Transport::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Transport::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Transport::Plain(s) => Pin::new(s).poll_flush(cx),
            Transport::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Transport::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Transport::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Transport::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Transport::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        }
    }
    fn is_write_vectored(&self) -> bool {
        match self {
            Transport::Plain(s) => s.is_write_vectored(),
            Transport::Tls(s) => s.is_write_vectored(),
        }
    }
}

/// One TLS handshake on an accepted TCP connection.
async fn tls_handshake(tls: &TlsServer, stream: TcpStream) -> anyhow::Result<SslStream<Socket>> {
    let mut stream = SslStream::new(tls.ssl()?, socket(stream))?;
    if let Err(err) = Pin::new(&mut stream).accept().await {
        return Err(match tls.refusal(stream.ssl()) {
            Some(refusal) => anyhow::Error::new(refusal).context(err.to_string()),
            None => err.into(),
        });
    }
    Ok(stream)
}

/// The front layer's settings for a listener's connections, counting what it closes.
fn front_config(listening: &Listening) -> FrontConfig {
    let name = listening.name;
    let refused = listening.metrics.refused.clone();
    let idle = listening.metrics.idle_closed.clone();
    let goaways = listening.metrics.goaways.clone();
    FrontConfig {
        limits: listening.limits.front,
        idle_timeout: listening.limits.http2_idle_timeout,
        on_close: Some(Arc::new(move |reason| match reason {
            CloseReason::Violation(v) => refused.with_label_values(&[name, v.reason()]).inc(),
            CloseReason::Idle => idle.with_label_values(&[name]).inc(),
        })),
        memory: listening.limits.memory.clone(),
        floods: listening.limits.floods,
        on_goaway: Some(Arc::new(move |code, reason| {
            let code = crate::transport::h2_authority::limits::code::name(code);
            goaways.with_label_values(&[name, code, reason]).inc()
        })),
    }
}

/// Handshakes on one accepted connection (waiting for a slot first) and hands it on, all within
/// the handshake timeout counted from accept.
async fn handshake_and_send(
    tls: Arc<TlsServer>,
    stream: TcpStream,
    info: TcpConnectInfo,
    slot: ConnSlot,
    handshakes: Arc<Semaphore>,
    listening: Listening,
    tx: mpsc::Sender<io::Result<Conn>>,
) {
    let metrics = &listening.metrics;
    let peer = info.remote_addr();
    let handshake = async {
        let waiting = Counted::new(&metrics.tls_handshakes_waiting);
        let _permit = handshakes.acquire_owned().await?;
        drop(waiting);
        let _in_progress = Counted::new(&metrics.tls_handshakes_in_progress);
        tls_handshake(&tls, stream).await
    };
    let result = match tokio::time::timeout(listening.limits.tls_handshake_timeout, handshake).await
    {
        Ok(Ok(tls)) => Ok(tls),
        Ok(Err(err)) => {
            tracing::debug!(?peer, err = format!("{err:#}"), "TLS handshake failed");
            if let Some(refusal) = err.downcast_ref::<crate::transport::tls::Refusal>() {
                let reason = [refusal.as_str()];
                metrics
                    .tls_client_auth_refused
                    .with_label_values(&reason)
                    .inc();
            }
            Err("failed")
        }
        Err(_) => {
            tracing::debug!(?peer, "TLS handshake timed out");
            Err("timeout")
        }
    };
    let label = result.as_ref().map_or_else(|r| *r, |_| "ok");
    metrics.tls_handshakes.with_label_values(&[label]).inc();
    if let Ok(tls) = result {
        let conn = Conn::new(
            Transport::Tls(Box::new(tls)),
            info,
            slot,
            front_config(&listening),
        );
        let _ = tx.send(Ok(conn)).await;
    }
}

/// A TCP connection just accepted, holding its slot of `--max-connections`; TLS and the front
/// layer come later, on the runtime that serves it.
pub struct Accepted {
    stream: TcpStream,
    info: TcpConnectInfo,
    slot: ConnSlot,
}

impl Accepted {
    /// Counts this connection in `lane` too, until it is dropped.
    pub fn count_in(&mut self, lane: IntGauge) {
        lane.inc();
        self.slot.lane = Some(lane);
    }

    /// Moves the socket off this runtime's reactor so another runtime can take it
    /// ([`Accepted::from_std`] on that runtime).
    pub fn into_std(self) -> io::Result<(std::net::TcpStream, TcpConnectInfo, ConnSlotHandle)> {
        Ok((
            self.stream.into_std()?,
            self.info,
            ConnSlotHandle(self.slot),
        ))
    }

    /// The other half of [`Accepted::into_std`], on the runtime that will serve the connection.
    pub fn from_std(
        stream: std::net::TcpStream,
        info: TcpConnectInfo,
        slot: ConnSlotHandle,
    ) -> io::Result<Accepted> {
        Ok(Accepted {
            stream: TcpStream::from_std(stream)?,
            info,
            slot: slot.0,
        })
    }
}

/// A connection's slot while its socket moves between runtimes.
pub struct ConnSlotHandle(ConnSlot);

/// Turns accepted connections into ready ones on the current runtime: a plain connection goes
/// out at once, a TLS one after its handshake (spawned here, bounded by the listener's handshake
/// semaphore and timeout).
#[derive(Clone)]
pub struct Admit {
    listening: Listening,
    handshakes: Arc<Semaphore>,
    tx: mpsc::Sender<io::Result<Conn>>,
}

impl Admit {
    /// The bound on TLS handshakes in progress that all admitters of `listening` share.
    pub fn handshake_bound(listening: &Listening) -> Arc<Semaphore> {
        Arc::new(Semaphore::new(
            listening.limits.max_concurrent_tls_handshakes,
        ))
    }

    /// An admitter for `listening`'s connections, and the stream of ready ones a tonic server
    /// consumes.
    pub fn new(
        listening: Listening,
        handshakes: Arc<Semaphore>,
    ) -> (Admit, ReceiverStream<io::Result<Conn>>) {
        let (tx, rx) = mpsc::channel(128);
        let admit = Admit {
            listening,
            handshakes,
            tx,
        };
        (admit, ReceiverStream::new(rx))
    }

    /// Admits one connection; false once nothing consumes ready connections any more.
    pub async fn admit(&self, accepted: Accepted) -> bool {
        let Accepted { stream, info, slot } = accepted;
        match &self.listening.tls {
            None => {
                let front = front_config(&self.listening);
                let conn = Conn::new(Transport::Plain(socket(stream)), info, slot, front);
                self.tx.send(Ok(conn)).await.is_ok()
            }
            Some(tls) => {
                tokio::spawn(handshake_and_send(
                    Arc::clone(tls),
                    stream,
                    info,
                    slot,
                    Arc::clone(&self.handshakes),
                    self.listening.clone(),
                    self.tx.clone(),
                ));
                !self.tx.is_closed()
            }
        }
    }

    /// Resolves once nothing consumes ready connections any more.
    pub async fn closed(&self) {
        self.tx.closed().await
    }
}

/// Where the accept loop hands each accepted connection.
pub trait Handoff: Send + 'static {
    /// Hands one on; false stops the accept loop (nothing serves connections any more).
    fn hand(&mut self, accepted: Accepted) -> impl std::future::Future<Output = bool> + Send;
    /// Resolves once nothing serves connections any more.
    fn closed(&self) -> impl std::future::Future<Output = ()> + Send;
}

impl Handoff for Admit {
    async fn hand(&mut self, accepted: Accepted) -> bool {
        self.admit(accepted).await
    }
    async fn closed(&self) {
        Admit::closed(self).await
    }
}

/// Accepts on `listener` until `shutdown` turns true, yielding ready connections within the
/// bounds of `listening`, all served on this runtime.
pub fn incoming(
    listener: TcpListener,
    listening: Listening,
    shutdown: watch::Receiver<bool>,
) -> ReceiverStream<io::Result<Conn>> {
    let handshakes = Admit::handshake_bound(&listening);
    let (admit, ready) = Admit::new(listening.clone(), handshakes);
    tokio::spawn(accept_loop(listener, listening, shutdown, admit));
    ready
}

/// Accepts on `listener` until `shutdown` turns true or `handoff` stops taking connections:
/// refuses those past `--max-connections`, sets TCP_NODELAY, hands the rest on.
pub async fn accept_loop(
    listener: TcpListener,
    listening: Listening,
    mut shutdown: watch::Receiver<bool>,
    mut handoff: impl Handoff,
) {
    let slots = Arc::new(Semaphore::new(listening.limits.max_connections));
    let open = listening.metrics.open.with_label_values(&[listening.name]);
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = shutdown.wait_for(|s| *s) => return,
            _ = handoff.closed() => return,
        };
        let (stream, peer) = match accepted {
            Ok(pair) => pair,
            Err(err) => {
                // EMFILE and friends: back off instead of spinning.
                tracing::warn!(%err, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(permit) = Arc::clone(&slots).try_acquire_owned() else {
            // Over --max-connections: closed at once (dropping the socket).
            tracing::debug!(%peer, listener = listening.name, "connection limit reached");
            listening
                .metrics
                .refused
                .with_label_values(&[listening.name, "connection_limit"])
                .inc();
            continue;
        };
        let slot = ConnSlot::new(permit, open.clone());
        let _ = stream.set_nodelay(true);
        let info = stream.connect_info();
        if !handoff.hand(Accepted { stream, info, slot }).await {
            return;
        }
    }
}

#[cfg(test)]
#[path = "net_tests.rs"]
mod tests;

#[cfg(test)]
#[path = "net_flood_tests.rs"]
mod flood_tests;
