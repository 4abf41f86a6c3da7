//! The accept loop's bounds over loopback, each with input just over it: the connection past
//! `--max-connections` is closed while those under it are served; a TLS handshake past
//! `--max-concurrent-tls-handshakes` waits for a slot; a silent handshake is closed at
//! `--tls-handshake-timeout`; TLS records read ahead together all arrive; writes leave at the
//! flush, plain and over TLS; the flags refuse values out of range (`--connection-threads` one
//! past its bound too).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Instant;

use clap::Parser;
use tokio::io::AsyncReadExt;
use tokio_stream::StreamExt;

use super::*;
use crate::observability::metrics::Metrics;

async fn listen(
    tls: Option<Arc<TlsServer>>,
    limits: ConnLimits,
) -> (
    std::net::SocketAddr,
    ReceiverStream<io::Result<Conn>>,
    ConnMetrics,
    watch::Sender<bool>,
) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let metrics = Metrics::new().conn;
    let (stop, shutdown) = watch::channel(false);
    let listening = Listening {
        name: "grpc",
        tls,
        limits,
        metrics: metrics.clone(),
    };
    (addr, incoming(listener, listening, shutdown), metrics, stop)
}

/// Waits (bounded: 10 s) until `done` holds.
async fn wait_for(what: &str, done: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !done() {
        assert!(Instant::now() < deadline, "never: {what}");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// Reads until the server closes the connection (EOF or reset), bounded: 10 s.
async fn closed_by_server(mut s: TcpStream) {
    let mut buf = [0u8; 64];
    let read = tokio::time::timeout(Duration::from_secs(10), s.read(&mut buf)).await;
    match read.expect("the server closes the connection") {
        Ok(0) | Err(_) => {}
        Ok(n) => panic!("server sent {n} bytes instead of closing"),
    }
}

#[tokio::test]
async fn the_connection_past_the_cap_is_closed_and_a_freed_slot_is_reused() {
    let limits = ConnLimits {
        max_connections: 2,
        ..ConnLimits::default()
    };
    let (addr, mut conns, metrics, _stop) = listen(None, limits).await;
    let _c1 = TcpStream::connect(addr).await.unwrap();
    let first = conns.next().await.unwrap().unwrap();
    let _c2 = TcpStream::connect(addr).await.unwrap();
    let _second = conns.next().await.unwrap().unwrap();
    assert_eq!(metrics.open.with_label_values(&["grpc"]).get(), 2);
    // The third is accepted and closed at once, and counted.
    closed_by_server(TcpStream::connect(addr).await.unwrap()).await;
    let refused = metrics
        .refused
        .with_label_values(&["grpc", "connection_limit"]);
    assert_eq!(refused.get(), 1);
    // Once one ends, a new connection is served again.
    drop(first);
    assert_eq!(metrics.open.with_label_values(&["grpc"]).get(), 1);
    let _c4 = TcpStream::connect(addr).await.unwrap();
    let _fourth = conns.next().await.unwrap().unwrap();
    assert_eq!(refused.get(), 1);
}

/// A TLS client handshake (no certificate check: the server's is self-signed).
async fn tls_client(addr: std::net::SocketAddr) -> anyhow::Result<SslStream<TcpStream>> {
    use openssl::ssl::{SslConnector, SslMethod, SslVerifyMode};
    let mut builder = SslConnector::builder(SslMethod::tls())?;
    builder.set_verify(SslVerifyMode::NONE);
    builder.set_alpn_protos(b"\x02h2")?;
    let ssl = builder.build().configure()?.into_ssl("kvpick")?;
    let tcp = TcpStream::connect(addr).await?;
    let mut stream = SslStream::new(ssl, tcp)?;
    Pin::new(&mut stream).connect().await?;
    Ok(stream)
}

#[tokio::test]
async fn a_handshake_past_the_concurrency_bound_waits_for_a_slot() {
    let limits = ConnLimits {
        max_concurrent_tls_handshakes: 1,
        tls_handshake_timeout: Duration::from_secs(60),
        ..ConnLimits::default()
    };
    let tls = crate::transport::tls::server(None).unwrap();
    let (addr, mut conns, metrics, _stop) = listen(Some(tls), limits).await;
    // A holds the only slot: connected, never says hello.
    let silent = TcpStream::connect(addr).await.unwrap();
    wait_for("A holds the handshake slot", || {
        metrics.tls_handshakes_in_progress.get() == 1
    })
    .await;
    // B's handshake waits for it instead of being refused.
    let b = tokio::spawn(tls_client(addr));
    wait_for("B waits for a slot", || {
        metrics.tls_handshakes_waiting.get() == 1
    })
    .await;
    assert!(!b.is_finished());
    assert_eq!(metrics.tls_handshakes_in_progress.get(), 1);
    // A goes away: its handshake fails, B gets the slot and completes.
    drop(silent);
    let _b = b.await.unwrap().expect("B's handshake completes");
    let _conn = conns.next().await.unwrap().unwrap();
    let results = |r: &str| metrics.tls_handshakes.with_label_values(&[r]).get();
    assert_eq!((results("failed"), results("ok")), (1, 1));
    assert_eq!(metrics.tls_handshakes_waiting.get(), 0);
    assert_eq!(metrics.tls_handshakes_in_progress.get(), 0);
}

#[tokio::test]
async fn a_silent_handshake_is_closed_at_the_timeout() {
    let limits = ConnLimits {
        tls_handshake_timeout: Duration::from_millis(200),
        ..ConnLimits::default()
    };
    let tls = crate::transport::tls::server(None).unwrap();
    let (addr, _conns, metrics, _stop) = listen(Some(tls), limits).await;
    let started = Instant::now();
    closed_by_server(TcpStream::connect(addr).await.unwrap()).await;
    assert!(started.elapsed() >= Duration::from_millis(200));
    wait_for("the timeout is counted", || {
        metrics.tls_handshakes.with_label_values(&["timeout"]).get() == 1
    })
    .await;
    assert_eq!(metrics.open.with_label_values(&["grpc"]).get(), 0);
}

/// With OpenSSL's read-ahead (`tls::acceptor`) one socket read can take several records; the
/// ones beyond the first wait in OpenSSL's buffer, not in the socket. A reader that then waited
/// on the socket would hang: here the client sends three records before the server reads any
/// and then stays silent, and all three must still arrive.
#[tokio::test]
async fn records_read_ahead_together_are_all_delivered() {
    use tokio::io::AsyncWriteExt;
    let tls = crate::transport::tls::server(None).unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (sent_tx, sent_rx) = tokio::sync::oneshot::channel();
    let client = tokio::spawn(async move {
        let mut c = tls_client(addr).await.unwrap();
        for record in 1..=3u8 {
            c.write_all(&[record; 100]).await.unwrap();
        }
        c.flush().await.unwrap();
        sent_tx.send(()).unwrap();
        c
    });
    let (tcp, _) = listener.accept().await.unwrap();
    let mut server = tls_handshake(&tls, tcp).await.unwrap();
    sent_rx.await.unwrap();
    let mut got = vec![0u8; 300];
    tokio::time::timeout(Duration::from_secs(10), server.read_exact(&mut got))
        .await
        .expect("every record arrives although the socket has nothing more")
        .unwrap();
    let want: Vec<u8> = (1..=3u8).flat_map(|r| [r; 100]).collect();
    assert_eq!(got, want);
    drop(client.await.unwrap());
}

/// Bytes waiting in `stream`'s socket, peeked with a syscall now (tokio's `try_read` answers from
/// its readiness cache, which may not have seen them yet).
fn unread_bytes(stream: &TcpStream) -> usize {
    use std::os::fd::AsFd;
    let fd = stream.as_fd().try_clone_to_owned().unwrap();
    let peer = std::net::TcpStream::from(fd);
    let mut buf = [0u8; 65_536];
    match peer.peek(&mut buf) {
        Ok(n) => n,
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => 0,
        Err(e) => panic!("peek: {e}"),
    }
}

/// Writes are gathered until a flush (h2 flushes once per batch of frames), then all leave:
/// over TLS too, where the records of several writes leave together.
#[tokio::test]
async fn writes_leave_at_the_flush_plain_and_over_tls() {
    use tokio::io::AsyncWriteExt;
    // Plain.
    let (addr, mut conns, _, _stop) = listen(None, ConnLimits::default()).await;
    let mut client = TcpStream::connect(addr).await.unwrap();
    let mut conn = conns.next().await.unwrap().unwrap();
    conn.write_all(b"frame header ").await.unwrap();
    conn.write_all(b"and payload").await.unwrap();
    let mut buf = [0u8; 64];
    assert_eq!(unread_bytes(&client), 0, "nothing is sent before the flush");
    conn.flush().await.unwrap();
    let mut got = vec![0u8; 24];
    client.read_exact(&mut got).await.unwrap();
    assert_eq!(got, b"frame header and payload");

    // TLS: the handshake still completes (OpenSSL flushes its flights); data waits for the flush.
    let tls = crate::transport::tls::server(None).unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let client = tokio::spawn(async move { tls_client(addr).await.unwrap() });
    let (tcp, _) = listener.accept().await.unwrap();
    let mut server = tls_handshake(&tls, tcp).await.unwrap();
    let mut client = client.await.unwrap();
    // One flushed byte first, so what the handshake left behind (TLS 1.3 session tickets) has
    // been read before the check below.
    server.write_all(b"x").await.unwrap();
    server.flush().await.unwrap();
    client.read_exact(&mut buf[..1]).await.unwrap();
    server.write_all(&[7u8; 100]).await.unwrap();
    server.write_all(&[8u8; 20_000]).await.unwrap();
    assert_eq!(
        unread_bytes(client.get_ref()),
        0,
        "no record is sent before the flush"
    );
    server.flush().await.unwrap();
    let mut got = vec![0u8; 20_100];
    tokio::time::timeout(Duration::from_secs(10), client.read_exact(&mut got))
        .await
        .expect("every record arrives at the flush")
        .unwrap();
    assert!(got[..100].iter().all(|&b| b == 7) && got[100..].iter().all(|&b| b == 8));
}

#[derive(Parser)]
struct Flags {
    #[command(flatten)]
    conn: ConnArgs,
}

fn limits_of(args: &[&str]) -> anyhow::Result<ConnLimits> {
    let mut argv = vec!["kvpick"];
    argv.extend_from_slice(args);
    Flags::try_parse_from(argv).unwrap().conn.limits()
}

#[test]
fn connection_flags_have_their_defaults_and_refuse_values_out_of_range() {
    let l = limits_of(&[]).unwrap();
    assert_eq!(l.max_connections, 1024);
    assert_eq!(l.max_concurrent_tls_handshakes, 64);
    assert_eq!(l.tls_handshake_timeout, Duration::from_secs(10));
    assert_eq!(l.http2_keepalive_interval, Some(Duration::from_secs(30)));
    assert_eq!(l.http2_keepalive_timeout, Duration::from_secs(20));
    assert_eq!(l.http2_idle_timeout, Some(Duration::from_secs(300)));
    assert_eq!(l.front, FrontLimits::default());
    // 0 turns keepalive and the idle timeout off.
    let off = limits_of(&[
        "--http2-keepalive-interval",
        "0",
        "--http2-idle-timeout",
        "0",
    ])
    .unwrap();
    assert_eq!(
        (off.http2_keepalive_interval, off.http2_idle_timeout),
        (None, None)
    );
    for bad in [
        &["--max-connections", "0"][..],
        &["--max-concurrent-tls-handshakes", "0"],
        &["--tls-handshake-timeout", "0"],
        &["--tls-handshake-timeout", "inf"],
        &["--http2-keepalive-timeout=-1"],
        &["--max-header-list-bytes", "1023"],
        &["--max-header-list-bytes", "1048577"],
    ] {
        assert!(limits_of(bad).is_err(), "{bad:?}");
    }
    assert!(limits_of(&["--max-header-list-bytes", "1024"]).is_ok());
    assert!(limits_of(&["--max-header-list-bytes", "1048576"]).is_ok());
}

#[test]
fn connection_threads_take_up_to_their_bound_and_default_to_the_cpus() {
    assert_eq!(connection_threads(Some(0)).unwrap(), 0);
    assert_eq!(
        connection_threads(Some(MAX_CONNECTION_THREADS)).unwrap(),
        MAX_CONNECTION_THREADS
    );
    let err = connection_threads(Some(MAX_CONNECTION_THREADS + 1)).unwrap_err();
    assert!(err.to_string().contains("--connection-threads"), "{err}");
    assert!(connection_threads(None).unwrap() >= 1);
}
