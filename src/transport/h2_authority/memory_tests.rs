//! The memory ledger in front of a real h2 server: a stream whose gRPC message the account
//! cannot hold is reset (RST_STREAM ENHANCE_YOUR_CALM to the client, the stream gone for h2 at
//! once), its later DATA is credited back to the client, and the connection keeps serving.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::frames::{FLAG_END_HEADERS, FLAG_END_STREAM};
use super::ledger::{rst_stream_frame, window_update_frame, LedgerConfig};
use super::limits::code;
use super::streams::{TYPE_DATA, TYPE_HEADERS};
use super::*;
use crate::transport::memory_account::{Kind, MemoryAccount};

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

fn frame(kind: u8, flags: u8, stream_id: u32, payload: &[u8]) -> Vec<u8> {
    let mut out = (payload.len() as u32).to_be_bytes()[1..].to_vec();
    out.extend([kind, flags]);
    out.extend(stream_id.to_be_bytes());
    out.extend_from_slice(payload);
    out
}

fn headers(enc: &mut loona_hpack::Encoder<'_>, stream: u32, flags: u8, marker: &[u8]) -> Vec<u8> {
    let list: [(&[u8], &[u8]); 5] = [
        (b":method", b"POST"),
        (b":scheme", b"http"),
        (
            b":path",
            b"/envoy.service.ext_proc.v3.ExternalProcessor/Process",
        ),
        (b":authority", b"kvpick:9002"),
        (b"x-test", marker),
    ];
    let block = enc.encode(list.iter().map(|(n, v)| (*n, *v)));
    frame(TYPE_HEADERS, FLAG_END_HEADERS | flags, stream, &block)
}

fn grpc_prefix(len: u32) -> Vec<u8> {
    let mut p = vec![0];
    p.extend(len.to_be_bytes());
    p
}

/// (type, flags, stream id, payload) of each frame in `bytes`.
fn frames_of(mut bytes: &[u8]) -> Vec<(u8, u8, u32, Vec<u8>)> {
    let mut seen = Vec::new();
    while bytes.len() >= 9 {
        let len = u32::from_be_bytes([0, bytes[0], bytes[1], bytes[2]]) as usize;
        let id = u32::from_be_bytes([bytes[5], bytes[6], bytes[7], bytes[8]]) & 0x7fff_ffff;
        seen.push((bytes[3], bytes[4], id, bytes[9..9 + len].to_vec()));
        bytes = &bytes[9 + len..];
    }
    assert!(bytes.is_empty(), "frames split inside one another");
    seen
}

#[tokio::test]
async fn a_stream_over_the_account_is_reset_for_both_sides_and_the_connection_serves_on() {
    let account = MemoryAccount::unmetered(1 << 20);
    let config = FrontConfig {
        memory: Some(LedgerConfig {
            account: Arc::clone(&account),
            connection_bytes: 1 << 30,
            max_message_bytes: 4 << 20,
        }),
        ..Default::default()
    };
    let (client, server) = tokio::io::duplex(1 << 20);
    let server = tokio::spawn(async move {
        let mut conn = h2::server::handshake(AuthorityFix::with_config(server, config))
            .await
            .unwrap();
        let mut big = None;
        while let Some(Ok((request, mut respond))) = conn.accept().await {
            if request.headers()["x-test"] == "big" {
                big = Some(tokio::spawn(async move {
                    let mut body = request.into_body();
                    loop {
                        match body.data().await {
                            Some(Ok(_)) => {}
                            Some(Err(e)) => return e.reason(),
                            None => return None,
                        }
                    }
                }));
                continue;
            }
            let response = http::Response::builder().status(200).body(()).unwrap();
            respond.send_response(response, true).unwrap();
        }
        big.unwrap().await.unwrap()
    });
    let mut enc = loona_hpack::Encoder::new();
    let mut wire = PREFACE.to_vec();
    wire.extend(frame(0x4, 0, 0, &[]));
    wire.extend(headers(&mut enc, 1, 0, b"big"));
    // A prefix claiming 2 MiB, more than the 1 MiB account: the stream is reset.
    wire.extend(frame(TYPE_DATA, 0, 1, &grpc_prefix(2 << 20)));
    // The client goes on sending on it: dropped, its 100 bytes credited back.
    wire.extend(frame(TYPE_DATA, 0, 1, &[0; 100]));
    wire.extend(headers(&mut enc, 3, FLAG_END_STREAM, b"good"));
    let (mut reader, mut writer) = tokio::io::split(client);
    writer.write_all(&wire).await.unwrap();
    // Read until the good stream's response (h2 never closes a connection on its own).
    let mut received = Vec::new();
    let served = |bytes: &[u8]| {
        let mut rest = bytes;
        while rest.len() >= 9 {
            let len = u32::from_be_bytes([0, rest[0], rest[1], rest[2]]) as usize;
            if rest.len() < 9 + len {
                return false;
            }
            if rest[3] == TYPE_HEADERS && rest[8] == 3 {
                return true;
            }
            rest = &rest[9 + len..];
        }
        false
    };
    while !served(&received) {
        let mut chunk = [0u8; 4096];
        let n = reader.read(&mut chunk).await.unwrap();
        assert!(n > 0, "closed before serving the good stream");
        received.extend_from_slice(&chunk[..n]);
    }
    drop((reader, writer));

    assert_eq!(
        server.await.unwrap(),
        Some(h2::Reason::CANCEL),
        "h2 saw the stream reset"
    );
    let seen = frames_of(&received);
    let rst = rst_stream_frame(1, code::ENHANCE_YOUR_CALM);
    assert!(
        seen.iter()
            .any(|(k, _, id, p)| *k == 0x3 && *id == 1 && p[..] == rst[9..]),
        "RST_STREAM(ENHANCE_YOUR_CALM) for the client: {seen:?}"
    );
    let credit = window_update_frame(0, 100);
    assert!(
        seen.iter()
            .any(|(k, _, id, p)| *k == 0x8 && *id == 0 && p[..] == credit[9..]),
        "the dropped DATA credited: {seen:?}"
    );
    assert!(
        seen.iter()
            .any(|(k, _, id, _)| *k == TYPE_HEADERS && *id == 3),
        "the next stream was served: {seen:?}"
    );
    assert!(!seen.iter().any(|f| f.0 == 0x7), "no GOAWAY: {seen:?}");
    assert_eq!(account.used_by(Kind::PartialMessage), 0);
}
