//! The front layer's flood limits and GOAWAY accounting over loopback, with raw client frames
//! against a real h2 server behind `incoming`: SETTINGS and WINDOW_UPDATE at their burst pass
//! and one more gets GOAWAY (ENHANCE_YOUR_CALM); a busy connection whose client acknowledges
//! every DATA frame per stream and per connection stays open far past the fixed burst; every
//! GOAWAY, the layer's and h2's own (a protocol error, rapid reset), is counted with its reason.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use bytes::Bytes;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_stream::StreamExt;

use super::*;
use crate::observability::metrics::Metrics;
use crate::transport::h2_authority::floods::{SETTINGS_BURST, WINDOW_UPDATE_BURST};
use crate::transport::h2_authority::limits::code;

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const DATA: u8 = 0x0;
const HEADERS: u8 = 0x1;
const RST_STREAM: u8 = 0x3;
const SETTINGS: u8 = 0x4;
const PING: u8 = 0x6;
const GOAWAY: u8 = 0x7;
const WINDOW_UPDATE: u8 = 0x8;
const END_STREAM: u8 = 0x1;
const ACK: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
/// DATA frames the test server sends per response (then an empty one ending it).
const DATA_PER_RESPONSE: usize = 3;

fn frame(kind: u8, flags: u8, stream_id: u32, payload: &[u8]) -> Vec<u8> {
    let mut out = (payload.len() as u32).to_be_bytes()[1..].to_vec();
    out.extend([kind, flags]);
    out.extend(stream_id.to_be_bytes());
    out.extend_from_slice(payload);
    out
}

fn window_update(stream_id: u32, increment: u32) -> Vec<u8> {
    frame(WINDOW_UPDATE, 0, stream_id, &increment.to_be_bytes())
}

/// SETTINGS_INITIAL_WINDOW_SIZE = `size`: what a SETTINGS flood toggles.
fn initial_window(size: u32) -> Vec<u8> {
    let mut p = 4u16.to_be_bytes().to_vec();
    p.extend(size.to_be_bytes());
    frame(SETTINGS, 0, 0, &p)
}

fn request(stream_id: u32, enc: &mut loona_hpack::Encoder<'_>) -> Vec<u8> {
    let headers: [(&[u8], &[u8]); 4] = [
        (b":method", b"GET"),
        (b":scheme", b"http"),
        (b":path", b"/"),
        (b":authority", b"kvpick"),
    ];
    let block = enc.encode(headers);
    frame(HEADERS, END_HEADERS | END_STREAM, stream_id, &block)
}

/// A listener behind `incoming` whose connections a real h2 server serves: each request gets
/// 200 and [`DATA_PER_RESPONSE`] DATA frames of 64 bytes, then an empty one ending the stream.
async fn h2_server(limits: ConnLimits) -> (std::net::SocketAddr, ConnMetrics, watch::Sender<bool>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let metrics = Metrics::new().conn;
    let (stop, shutdown) = watch::channel(false);
    let listening = Listening {
        name: "grpc",
        tls: None,
        limits,
        metrics: metrics.clone(),
    };
    let mut conns = incoming(listener, listening, shutdown);
    tokio::spawn(async move {
        while let Some(Ok(conn)) = conns.next().await {
            tokio::spawn(serve_h2(conn));
        }
    });
    (addr, metrics, stop)
}

async fn serve_h2(conn: Conn) {
    let Ok(mut h2) = h2::server::handshake(conn).await else {
        return;
    };
    while let Some(Ok((_, mut respond))) = h2.accept().await {
        let response = http::Response::builder().status(200).body(()).unwrap();
        let Ok(mut body) = respond.send_response(response, false) else {
            continue;
        };
        for _ in 0..DATA_PER_RESPONSE {
            let _ = body.send_data(Bytes::from_static(&[b'x'; 64]), false);
        }
        let _ = body.send_data(Bytes::new(), true);
    }
}

/// One frame the server sent.
#[derive(Debug)]
struct Seen {
    kind: u8,
    flags: u8,
    stream_id: u32,
    payload: Vec<u8>,
}

impl Seen {
    /// (error code, debug data) of a GOAWAY.
    fn goaway(&self) -> (u32, String) {
        assert_eq!(self.kind, GOAWAY, "{self:?}");
        let p = &self.payload;
        (
            u32::from_be_bytes([p[4], p[5], p[6], p[7]]),
            String::from_utf8_lossy(&p[8..]).into_owned(),
        )
    }
}

/// A raw HTTP/2 client.
struct Client {
    tcp: TcpStream,
    buf: Vec<u8>,
}

impl Client {
    async fn connect(addr: std::net::SocketAddr) -> Client {
        let mut tcp = TcpStream::connect(addr).await.unwrap();
        tcp.write_all(PREFACE).await.unwrap();
        Client {
            tcp,
            buf: Vec::new(),
        }
    }

    async fn send(&mut self, bytes: &[u8]) {
        // The server may have closed already: what it sent tells the test what happened.
        let _ = self.tcp.write_all(bytes).await;
    }

    /// The next frame, or `None` once the server closed (EOF or reset); bounded: 10 s.
    async fn next(&mut self) -> Option<Seen> {
        loop {
            if self.buf.len() >= 9 {
                let len = u32::from_be_bytes([0, self.buf[0], self.buf[1], self.buf[2]]) as usize;
                if self.buf.len() >= 9 + len {
                    let head: Vec<u8> = self.buf.drain(..9 + len).collect();
                    return Some(Seen {
                        kind: head[3],
                        flags: head[4],
                        stream_id: u32::from_be_bytes([head[5], head[6], head[7], head[8]]),
                        payload: head[9..].to_vec(),
                    });
                }
            }
            let mut chunk = [0u8; 16 * 1024];
            let read = tokio::time::timeout(Duration::from_secs(10), self.tcp.read(&mut chunk));
            match read.await.expect("the server answers or closes") {
                Ok(0) | Err(_) => return None,
                Ok(n) => self.buf.extend_from_slice(&chunk[..n]),
            }
        }
    }

    /// Frames until the ack of a PING sent now: the server handled everything sent before it.
    /// `None` if the connection closed first (with what it sent).
    async fn ping(&mut self) -> Result<Vec<Seen>, Vec<Seen>> {
        self.send(&frame(PING, 0, 0, b"kvpick!!")).await;
        let mut seen = Vec::new();
        while let Some(f) = self.next().await {
            if f.kind == PING && f.flags & ACK != 0 {
                return Ok(seen);
            }
            seen.push(f);
        }
        Err(seen)
    }

    /// Everything until the server closes.
    async fn until_closed(&mut self) -> Vec<Seen> {
        let mut seen = Vec::new();
        while let Some(f) = self.next().await {
            seen.push(f);
        }
        seen
    }
}

fn limits() -> ConnLimits {
    ConnLimits {
        http2_idle_timeout: None,
        ..ConnLimits::default()
    }
}

fn goaways(metrics: &ConnMetrics, code: u32, reason: &str) -> u64 {
    let code = crate::transport::h2_authority::limits::code::name(code);
    metrics
        .goaways
        .with_label_values(&["grpc", code, reason])
        .get()
}

fn the_goaway(seen: &[Seen]) -> (u32, String) {
    let goaways: Vec<_> = seen.iter().filter(|f| f.kind == GOAWAY).collect();
    assert_eq!(goaways.len(), 1, "{seen:?}");
    goaways[0].goaway()
}

#[tokio::test]
async fn settings_at_the_burst_pass_and_one_more_is_a_flood() {
    let (addr, metrics, _stop) = h2_server(limits()).await;
    // The preface's SETTINGS counts: it and 31 more in one write = the burst.
    let mut at = Client::connect(addr).await;
    let mut burst = Vec::new();
    for i in 0..SETTINGS_BURST {
        burst.extend(initial_window(65_535 + i % 2));
    }
    at.send(&burst).await;
    let seen = at.ping().await.expect("the burst is allowed");
    let acks = seen
        .iter()
        .filter(|f| f.kind == SETTINGS && f.flags & ACK != 0);
    assert_eq!(acks.count(), SETTINGS_BURST as usize);

    let mut over = Client::connect(addr).await;
    burst.extend(initial_window(65_535));
    over.send(&burst).await;
    let seen = over.until_closed().await;
    assert_eq!(
        the_goaway(&seen),
        (code::ENHANCE_YOUR_CALM, "settings_flood".into())
    );
    let refused = metrics
        .refused
        .with_label_values(&["grpc", "settings_flood"]);
    assert_eq!(refused.get(), 1);
    assert_eq!(
        goaways(&metrics, code::ENHANCE_YOUR_CALM, "settings_flood"),
        1
    );
}

#[tokio::test]
async fn window_updates_at_the_burst_pass_and_one_more_is_a_flood() {
    let (addr, metrics, _stop) = h2_server(limits()).await;
    let burst: Vec<u8> = (0..WINDOW_UPDATE_BURST)
        .flat_map(|_| window_update(0, 1))
        .collect();
    let mut at = Client::connect(addr).await;
    at.send(&frame(SETTINGS, 0, 0, &[])).await;
    at.send(&burst).await;
    at.ping().await.expect("the burst is allowed");

    let mut over = Client::connect(addr).await;
    over.send(&frame(SETTINGS, 0, 0, &[])).await;
    let mut flood = burst.clone();
    flood.extend(window_update(0, 1));
    over.send(&flood).await;
    let seen = over.until_closed().await;
    assert_eq!(
        the_goaway(&seen),
        (code::ENHANCE_YOUR_CALM, "window_update_flood".into())
    );
    let refused = metrics
        .refused
        .with_label_values(&["grpc", "window_update_flood"]);
    assert_eq!(refused.get(), 1);
    assert_eq!(
        goaways(&metrics, code::ENHANCE_YOUR_CALM, "window_update_flood"),
        1
    );
}

#[tokio::test]
async fn a_busy_connection_acknowledging_every_data_frame_stays_open() {
    let (addr, metrics, _stop) = h2_server(limits()).await;
    let mut c = Client::connect(addr).await;
    c.send(&frame(SETTINGS, 0, 0, &[])).await;
    let mut enc = loona_hpack::Encoder::new();
    // 4 rounds of 100 streams: 1,200 non-empty DATA frames, each acknowledged for its stream and
    // the connection (2,400 WINDOW_UPDATEs, nine times the fixed burst) as soon as it arrives.
    let (rounds, streams) = (4u32, 100u32);
    let mut window_updates = 0;
    for round in 0..rounds {
        let ids: Vec<u32> = (0..streams)
            .map(|i| 1 + 2 * (round * streams + i))
            .collect();
        let requests: Vec<u8> = ids.iter().flat_map(|&id| request(id, &mut enc)).collect();
        c.send(&requests).await;
        let mut ended = 0;
        while ended < streams {
            let f = c.next().await.expect("the connection stays open");
            assert_ne!(f.kind, GOAWAY, "{:?}", f.goaway());
            if f.kind != DATA {
                continue;
            }
            if f.flags & END_STREAM != 0 {
                ended += 1;
            } else {
                let n = f.payload.len() as u32;
                let mut acks = window_update(f.stream_id, n);
                acks.extend(window_update(0, n));
                c.send(&acks).await;
                window_updates += 2;
            }
        }
    }
    assert_eq!(
        window_updates,
        2 * DATA_PER_RESPONSE * (rounds * streams) as usize
    );
    c.ping()
        .await
        .expect("still open after every WINDOW_UPDATE");
    assert_eq!(
        metrics
            .refused
            .with_label_values(&["grpc", "window_update_flood"])
            .get(),
        0
    );
}

#[tokio::test]
async fn h2s_own_goaways_are_counted_with_their_reason() {
    let (addr, metrics, _stop) = h2_server(limits()).await;
    let mut enc = loona_hpack::Encoder::new();

    // A protocol error h2 answers itself: a client stream with an even id.
    let mut c = Client::connect(addr).await;
    c.send(&frame(SETTINGS, 0, 0, &[])).await;
    c.send(&request(2, &mut enc)).await;
    let seen = c.until_closed().await;
    assert_eq!(the_goaway(&seen).0, code::PROTOCOL_ERROR);
    assert_eq!(goaways(&metrics, code::PROTOCOL_ERROR, "h2"), 1);

    // Rapid reset: streams opened and reset before the server accepts them, past h2's bound.
    let mut enc = loona_hpack::Encoder::new();
    let mut c = Client::connect(addr).await;
    let mut bytes = frame(SETTINGS, 0, 0, &[]);
    for i in 0..200u32 {
        let id = 1 + 2 * i;
        bytes.extend(request(id, &mut enc));
        bytes.extend(frame(RST_STREAM, 0, id, &0x8u32.to_be_bytes()));
    }
    c.send(&bytes).await;
    let seen = c.until_closed().await;
    assert_eq!(
        the_goaway(&seen),
        (code::ENHANCE_YOUR_CALM, "too_many_resets".into())
    );
    assert_eq!(
        goaways(&metrics, code::ENHANCE_YOUR_CALM, "h2_too_many_resets"),
        1
    );
    // The layer's own GOAWAYs are not counted twice, h2's not as the layer's.
    use prometheus::core::Collector;
    let total: u64 = metrics
        .goaways
        .collect()
        .iter()
        .flat_map(|f| f.get_metric())
        .map(|m| m.get_counter().get_value() as u64)
        .sum();
    assert_eq!(total, 2);
}
