//! The front layer in front of a real h2 server over an in-memory duplex: authority rewrites
//! across a shared HPACK table, GOAWAY on a violation (between h2's frames, then closed), and
//! the idle timeout on paused time.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Mutex;

use super::frames::{
    FLAG_END_HEADERS, FLAG_END_STREAM, FLAG_PADDED, FLAG_PRIORITY, TYPE_CONTINUATION,
};
use super::limits::code;
use super::streams::TYPE_HEADERS;
use super::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const ISTIO: &[u8] = b"outbound|9002||kvpick.default.svc.cluster.local";
const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const TYPE_GOAWAY: u8 = 0x7;

#[test]
fn istio_cluster_names_become_host_port_and_valid_values_stay() {
    assert_eq!(
        acceptable_authority(ISTIO).unwrap(),
        b"kvpick.default.svc.cluster.local:9002"
    );
    assert_eq!(
        acceptable_authority(b"kvpick.default:9002").unwrap(),
        b"kvpick.default:9002"
    );
    // Not Istio's shape: dropped.
    assert_eq!(acceptable_authority(b"a|b"), None);
    assert_eq!(acceptable_authority(b"outbound|notaport||host"), None);
    assert_eq!(acceptable_authority(b"outbound|9002||bad host"), None);
    assert_eq!(acceptable_authority(b"outbound|1|2|host|extra"), None);
}

fn frame(kind: u8, flags: u8, stream_id: u32, payload: &[u8]) -> Vec<u8> {
    let mut out = (payload.len() as u32).to_be_bytes()[1..].to_vec();
    out.extend([kind, flags]);
    out.extend(stream_id.to_be_bytes());
    out.extend_from_slice(payload);
    out
}

/// The client's preface and an empty SETTINGS, then `frames`.
fn wire(frames: &[u8]) -> Vec<u8> {
    let mut w = PREFACE.to_vec();
    w.extend(frame(0x4, 0, 0, &[]));
    w.extend_from_slice(frames);
    w
}

fn request_headers(authority: &[u8], extra: &[(&[u8], &[u8])]) -> Vec<(Vec<u8>, Vec<u8>)> {
    let mut h: Vec<(Vec<u8>, Vec<u8>)> = vec![
        (b":method".to_vec(), b"POST".to_vec()),
        (b":scheme".to_vec(), b"http".to_vec()),
        (
            b":path".to_vec(),
            b"/envoy.service.ext_proc.v3.ExternalProcessor/Process".to_vec(),
        ),
        (b":authority".to_vec(), authority.to_vec()),
    ];
    h.extend(extra.iter().map(|(n, v)| (n.to_vec(), v.to_vec())));
    h
}

/// Sends `client_bytes` (after the preface and an empty SETTINGS) through the fix to a real h2
/// server and returns the authority and `x-test` header of each request it accepts.
async fn served(client_bytes: Vec<u8>, requests: usize) -> Vec<(Option<String>, String)> {
    let (mut client, server) = tokio::io::duplex(1 << 20);
    client.write_all(&wire(&client_bytes)).await.unwrap();
    let mut conn = h2::server::handshake(AuthorityFix::new(server))
        .await
        .unwrap();
    let mut seen = Vec::new();
    for _ in 0..requests {
        let (request, _respond) = conn.accept().await.unwrap().unwrap();
        let authority = request.uri().authority().map(|a| a.to_string());
        let marker = request.headers()["x-test"].to_str().unwrap().to_string();
        seen.push((authority, marker));
    }
    seen
}

fn encode(encoder: &mut loona_hpack::Encoder<'_>, headers: &[(Vec<u8>, Vec<u8>)]) -> Vec<u8> {
    encoder.encode(headers.iter().map(|(n, v)| (n.as_slice(), v.as_slice())))
}

#[tokio::test]
async fn istio_authority_reaches_h2_rewritten_across_a_shared_hpack_table() {
    let mut enc = loona_hpack::Encoder::new();
    let mut bytes = Vec::new();
    // The first block puts the invalid authority and x-test in the client's dynamic table;
    // the second refers to them by index, so the fix must track the client's table.
    for (stream, marker) in [(1u32, b"one".as_slice()), (3, b"one")] {
        let block = encode(&mut enc, &request_headers(ISTIO, &[(b"x-test", marker)]));
        bytes.extend(frame(
            TYPE_HEADERS,
            FLAG_END_HEADERS | FLAG_END_STREAM,
            stream,
            &block,
        ));
    }
    let seen = served(bytes, 2).await;
    let want = Some("kvpick.default.svc.cluster.local:9002".to_string());
    assert_eq!(
        seen,
        vec![(want.clone(), "one".into()), (want, "one".into())]
    );
}

#[tokio::test]
async fn padded_priority_and_continuation_blocks_are_reassembled() {
    let mut enc = loona_hpack::Encoder::new();
    let block = encode(&mut enc, &request_headers(ISTIO, &[(b"x-test", b"split")]));
    let (a, b) = block.split_at(block.len() / 2);
    // HEADERS with 3 bytes of padding and a priority, then the rest in a CONTINUATION.
    let mut payload = vec![3u8];
    payload.extend([0, 0, 0, 0, 16]);
    payload.extend_from_slice(a);
    payload.extend([0, 0, 0]);
    let mut bytes = frame(
        TYPE_HEADERS,
        FLAG_PADDED | FLAG_PRIORITY | FLAG_END_STREAM,
        1,
        &payload,
    );
    bytes.extend(frame(TYPE_CONTINUATION, FLAG_END_HEADERS, 1, b));
    // A valid authority on the next stream is kept as is.
    let block = encode(
        &mut enc,
        &request_headers(b"kvpick:9002", &[(b"x-test", b"plain")]),
    );
    bytes.extend(frame(
        TYPE_HEADERS,
        FLAG_END_HEADERS | FLAG_END_STREAM,
        3,
        &block,
    ));
    let seen = served(bytes, 2).await;
    assert_eq!(
        seen,
        vec![
            (
                Some("kvpick.default.svc.cluster.local:9002".into()),
                "split".into()
            ),
            (Some("kvpick:9002".into()), "plain".into()),
        ]
    );
}

#[tokio::test]
async fn an_unfixable_authority_is_dropped_and_a_big_block_is_split_into_frames() {
    let mut enc = loona_hpack::Encoder::new();
    let big = vec![b'v'; 40_000];
    let block = encode(
        &mut enc,
        &request_headers(b"not|istio", &[(b"x-test", b"big"), (b"x-big", &big)]),
    );
    // The client splits it at the frame size too; a raised header-list bound admits it.
    let chunks: Vec<&[u8]> = block.chunks(16_384).collect();
    let mut bytes = Vec::new();
    for (i, chunk) in chunks.iter().enumerate() {
        let kind = if i == 0 {
            TYPE_HEADERS
        } else {
            TYPE_CONTINUATION
        };
        let mut flags = if i + 1 == chunks.len() {
            FLAG_END_HEADERS
        } else {
            0
        };
        if i == 0 {
            flags |= FLAG_END_STREAM;
        }
        bytes.extend(frame(kind, flags, 1, chunk));
    }
    let (mut client, server) = tokio::io::duplex(1 << 20);
    client.write_all(&wire(&bytes)).await.unwrap();
    let config = FrontConfig {
        limits: FrontLimits::new(64 * 1024),
        ..Default::default()
    };
    let mut conn = h2::server::Builder::new()
        .max_header_list_size(1 << 20)
        .handshake::<_, bytes::Bytes>(AuthorityFix::with_config(server, config))
        .await
        .unwrap();
    let (request, _respond) = conn.accept().await.unwrap().unwrap();
    assert_eq!(request.uri().authority(), None);
    assert_eq!(request.headers()["x-big"].len(), big.len());
}

/// One frame as the client sees it.
#[derive(Debug)]
struct Seen {
    kind: u8,
    flags: u8,
    payload: Vec<u8>,
}

/// Splits what the server sent into frames; panics on a malformed sequence (a GOAWAY written
/// inside one of h2's frames would show up here).
fn parse_frames(bytes: &[u8]) -> Vec<Seen> {
    let mut seen = Vec::new();
    let mut rest = bytes;
    while !rest.is_empty() {
        assert!(rest.len() >= 9, "truncated frame header: {rest:?}");
        let len = u32::from_be_bytes([0, rest[0], rest[1], rest[2]]) as usize;
        assert!(rest.len() >= 9 + len, "truncated frame");
        seen.push(Seen {
            kind: rest[3],
            flags: rest[4],
            payload: rest[9..9 + len].to_vec(),
        });
        rest = &rest[9 + len..];
    }
    seen
}

/// (last stream id, error code, debug data) of a GOAWAY.
fn goaway(f: &Seen) -> (u32, u32, String) {
    assert_eq!(f.kind, TYPE_GOAWAY, "{f:?}");
    let p = &f.payload;
    (
        u32::from_be_bytes([p[0], p[1], p[2], p[3]]),
        u32::from_be_bytes([p[4], p[5], p[6], p[7]]),
        String::from_utf8(p[8..].to_vec()).unwrap(),
    )
}

/// Runs `client_frames` against h2 behind the layer over a duplex of `capacity` bytes (small =
/// h2's writes are split, so the GOAWAY has to wait for frame boundaries). Returns what the
/// client received, the reasons the layer reported, and h2's outcome.
async fn attack(
    client_frames: Vec<u8>,
    capacity: usize,
    config: FrontConfig,
) -> (Vec<Seen>, Vec<CloseReason>, Result<(), String>) {
    let reasons = Arc::new(Mutex::new(Vec::new()));
    let observed = Arc::clone(&reasons);
    let config = FrontConfig {
        on_close: Some(Arc::new(move |r| observed.lock().unwrap().push(r))),
        ..config
    };
    let (client, server) = tokio::io::duplex(capacity);
    let server = tokio::spawn(async move {
        let mut conn = h2::server::handshake(AuthorityFix::with_config(server, config))
            .await
            .map_err(|e| e.to_string())?;
        while let Some(request) = conn.accept().await {
            // Answer well-formed requests, so h2 has frames of its own in flight.
            let (_, mut respond) = request.map_err(|e| e.to_string())?;
            let response = http::Response::builder().status(200).body(()).unwrap();
            let _ = respond.send_response(response, true);
        }
        Ok::<(), String>(())
    });
    let (mut reader, mut writer) = tokio::io::split(client);
    let write = tokio::spawn(async move {
        // The server may stop reading (it closed): errors are expected.
        let _ = writer.write_all(&wire(&client_frames)).await;
        writer
    });
    let mut bytes = Vec::new();
    reader.read_to_end(&mut bytes).await.unwrap();
    let seen = parse_frames(&bytes);
    // Closing the client ends the server's linger at once.
    drop((reader, write.await.unwrap()));
    let outcome = server.await.unwrap();
    let reasons = reasons.lock().unwrap().clone();
    (seen, reasons, outcome)
}

fn small_request(stream_id: u32, enc: &mut loona_hpack::Encoder<'_>) -> Vec<u8> {
    let block = encode(enc, &request_headers(b"kvpick:9002", &[(b"x-test", b"ok")]));
    frame(
        TYPE_HEADERS,
        FLAG_END_HEADERS | FLAG_END_STREAM,
        stream_id,
        &block,
    )
}

#[tokio::test]
async fn a_header_bomb_gets_goaway_enhance_your_calm_between_h2s_frames_then_eof() {
    let mut enc = loona_hpack::Encoder::new();
    // A good request first (so h2 answers and GOAWAY names stream 1), then the bomb on stream 3.
    let mut bytes = small_request(1, &mut enc);
    let bomb = super::frames::tests::bomb_block(64 * 1024);
    for (i, chunk) in bomb.chunks(16_384).enumerate() {
        let kind = if i == 0 {
            TYPE_HEADERS
        } else {
            TYPE_CONTINUATION
        };
        let flags = if (i + 1) * 16_384 >= bomb.len() {
            FLAG_END_HEADERS
        } else {
            0
        };
        bytes.extend(frame(kind, flags, 3, chunk));
    }
    for capacity in [7, 1 << 20] {
        let (seen, reasons, outcome) =
            attack(bytes.clone(), capacity, FrontConfig::default()).await;
        assert_eq!(
            reasons,
            vec![CloseReason::Violation(Violation::HeaderListTooLarge)]
        );
        let last = seen.last().expect("frames before EOF");
        assert_eq!(
            goaway(last),
            (1, code::ENHANCE_YOUR_CALM, "header_list_too_large".into()),
            "capacity {capacity}"
        );
        assert_eq!(seen[0].kind, 0x4, "h2's SETTINGS come first");
        assert!(outcome.is_err(), "h2 sees the connection fail");
    }
}

#[tokio::test]
async fn a_violation_before_h2_wrote_anything_still_starts_with_settings() {
    // An oversized DATA frame header (length 16,385) right after the client's SETTINGS.
    let bytes = vec![0x00, 0x40, 0x01, 0x0, 0, 0, 0, 0, 1];
    let (seen, reasons, _) = attack(bytes, 3, FrontConfig::default()).await;
    assert_eq!(
        reasons,
        vec![CloseReason::Violation(Violation::FrameTooLarge)]
    );
    assert_eq!(seen[0].kind, 0x4);
    assert_eq!(
        goaway(seen.last().unwrap()),
        (0, code::FRAME_SIZE_ERROR, "frame_too_large".into())
    );
}

/// The client side of an idle-timeout test: the preface, and frames read as they come.
struct IdleClient {
    writer: tokio::io::WriteHalf<tokio::io::DuplexStream>,
    frames: tokio::sync::mpsc::UnboundedReceiver<Option<Seen>>,
}

fn idle_connection(idle: Duration) -> IdleClient {
    let (client, server) = tokio::io::duplex(1 << 16);
    let config = FrontConfig {
        idle_timeout: Some(idle),
        ..Default::default()
    };
    tokio::spawn(async move {
        let mut conn = h2::server::handshake(AuthorityFix::with_config(server, config))
            .await
            .unwrap();
        while let Some(Ok((request, mut respond))) = conn.accept().await {
            // Answered once the client's DATA frame has ended the request body.
            tokio::spawn(async move {
                let mut body = request.into_body();
                while let Some(Ok(_)) = body.data().await {}
                let response = http::Response::builder().status(200).body(()).unwrap();
                let _ = respond.send_response(response, true);
            });
        }
    });
    let (mut reader, writer) = tokio::io::split(client);
    let (tx, frames) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        loop {
            let mut head = [0u8; 9];
            if reader.read_exact(&mut head).await.is_err() {
                let _ = tx.send(None);
                return;
            }
            let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
            let mut payload = vec![0; len];
            reader.read_exact(&mut payload).await.unwrap();
            let _ = tx.send(Some(Seen {
                kind: head[3],
                flags: head[4],
                payload,
            }));
        }
    });
    IdleClient { writer, frames }
}

impl IdleClient {
    /// Frames up to and including the first GOAWAY; then the connection must end.
    async fn until_goaway(&mut self) -> Seen {
        loop {
            let f = self
                .frames
                .recv()
                .await
                .unwrap()
                .expect("GOAWAY before EOF");
            if f.kind == TYPE_GOAWAY {
                // Acknowledge by closing, as a client does; the server then ends too.
                let _ = self.writer.shutdown().await;
                assert!(
                    self.frames.recv().await.unwrap().is_none(),
                    "EOF after GOAWAY"
                );
                return f;
            }
        }
    }

    /// No GOAWAY among the frames received so far.
    fn no_goaway_yet(&mut self) {
        while let Ok(f) = self.frames.try_recv() {
            let f = f.expect("connection still open");
            assert_ne!(f.kind, TYPE_GOAWAY, "closed while a stream was open");
        }
    }
}

#[tokio::test(start_paused = true)]
async fn a_connection_without_streams_is_closed_after_the_idle_timeout() {
    let start = tokio::time::Instant::now();
    let mut client = idle_connection(Duration::from_secs(60));
    client.writer.write_all(&wire(&[])).await.unwrap();
    let g = client.until_goaway().await;
    assert_eq!(goaway(&g), (0, code::NO_ERROR, "idle".into()));
    let waited = start.elapsed();
    assert!(waited >= Duration::from_secs(60), "{waited:?}");
    assert!(waited < Duration::from_secs(62), "{waited:?}");
}

#[tokio::test(start_paused = true)]
async fn an_open_stream_keeps_the_connection_and_idleness_counts_from_its_end() {
    let mut enc = loona_hpack::Encoder::new();
    let mut client = idle_connection(Duration::from_secs(60));
    let block = encode(
        &mut enc,
        &request_headers(b"kvpick:9002", &[(b"x-test", b"1")]),
    );
    client
        .writer
        .write_all(&wire(&frame(TYPE_HEADERS, FLAG_END_HEADERS, 1, &block)))
        .await
        .unwrap();
    // Ten idle timeouts with the request open (waiting on its body): still open.
    tokio::time::sleep(Duration::from_secs(600)).await;
    client.no_goaway_yet();
    // The request ends; the response ends; idleness starts now.
    let ended = tokio::time::Instant::now();
    client
        .writer
        .write_all(&frame(0x0, FLAG_END_STREAM, 1, &[]))
        .await
        .unwrap();
    let g = client.until_goaway().await;
    assert_eq!(goaway(&g), (1, code::NO_ERROR, "idle".into()));
    assert!(ended.elapsed() >= Duration::from_secs(60));
    assert!(g.flags == 0);
}

#[tokio::test(start_paused = true)]
async fn a_short_request_restarts_the_idle_timer() {
    let mut enc = loona_hpack::Encoder::new();
    let mut client = idle_connection(Duration::from_secs(60));
    client.writer.write_all(&wire(&[])).await.unwrap();
    tokio::time::sleep(Duration::from_secs(50)).await;
    client.no_goaway_yet();
    // A whole request and its answer, 50 s into the idle period.
    let asked = tokio::time::Instant::now();
    client
        .writer
        .write_all(&small_request(1, &mut enc))
        .await
        .unwrap();
    let g = client.until_goaway().await;
    assert_eq!(goaway(&g), (1, code::NO_ERROR, "idle".into()));
    assert!(
        asked.elapsed() >= Duration::from_secs(60),
        "{:?}",
        asked.elapsed()
    );
}
