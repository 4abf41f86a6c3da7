//! The request body read while it arrives (`crate::tokenize::body::scan`): a body routes and echoes the
//! same however Envoy chunks it, a body the scanner leaves to serde is answered as serde reads
//! it, and tiny chunks are coalesced into pieces the stream owns.

use super::*;
use crate::hosts::extproc::BodyBudget;
use rand::{Rng, SeedableRng};

/// Sends `body` in the given pieces; returns the destination (or the immediate status and
/// message) and the echoed bytes.
fn route(pieces: &[&[u8]]) -> (String, Vec<u8>) {
    let (_core, mut m) = setup(default_pool(), ExtProcSettings::default());
    m.handle(post_headers()).unwrap();
    let mut last = Step::default();
    for (i, piece) in pieces.iter().enumerate() {
        last = m.handle(body(piece, i + 1 == pieces.len())).unwrap();
    }
    if last.finished {
        let (code, msg) = immediate_status(&last);
        return (format!("{code} {msg}"), Vec::new());
    }
    let dest = set_value(header_mutation(&last.responses[0]), DESTINATION_HEADER).unwrap();
    let echo = last.responses[1..]
        .iter()
        .flat_map(|r| streamed(r).0.to_vec())
        .collect();
    (dest, echo)
}

#[test]
fn a_body_routes_and_echoes_the_same_however_it_is_chunked() {
    let long: Vec<String> = (0..400)
        .map(|i| format!("{{\"role\":\"user\",\"content\":\"turn {i}\"}}"))
        .collect();
    let bodies = [
        CHAT.to_vec(),
        format!(
            r#"{{"model":"m","messages":[{}],"stream":true}}"#,
            long.join(",")
        )
        .into_bytes(),
        // Left to serde by the scanner (an escaped key), still a valid body.
        br#"{"mod\u0065l":"m","messages":[{"role":"user","content":"hi"}]}"#.to_vec(),
        // Client errors, worded by serde either way.
        b"{\"model\":\"m\",\"messages\":[}".to_vec(),
        br#"{"model":"m","model":"m"}"#.to_vec(),
        br#"{"model":""}"#.to_vec(),
    ];
    let mut rng = rand::rngs::StdRng::seed_from_u64(3);
    for body in bodies {
        let whole = route(&[&body]);
        let expected_error =
            crate::tokenize::body::parse_request_body(Some("application/json"), &body);
        if let Err(err) = expected_error {
            assert!(whole.0.starts_with("400 kvpick: 400: "), "{}", whole.0);
            assert!(whole.0.contains(&err.to_string()), "{} / {err}", whole.0);
        } else {
            assert_eq!(whole.1, body, "echoed byte for byte");
        }
        let bytes: Vec<&[u8]> = body.chunks(1).collect();
        assert_eq!(route(&bytes), whole, "byte by byte");
        for _ in 0..5 {
            let cut = rng.random_range(0..=body.len());
            assert_eq!(route(&[&body[..cut], &body[cut..]]), whole, "cut at {cut}");
        }
    }
}

#[test]
fn tiny_chunks_are_coalesced_into_pieces_the_stream_owns() {
    let mut buf = BodyBuf::new(BodyBudget::unmetered(1 << 20).lease());
    let big = Bytes::from(vec![b'a'; 2000]);
    buf.push(big.clone());
    for _ in 0..100 {
        buf.push(Bytes::from_static(b"b"));
    }
    buf.push(Bytes::new());
    buf.push(big.clone());
    assert_eq!(buf.len, 4100);
    assert_eq!(
        buf.chunks.len(),
        2,
        "the small ones joined the piece before them"
    );
    assert!(matches!(buf.chunks[0], wire::Piece::Coalesced(_)));
    assert!(
        matches!(&buf.chunks[1], wire::Piece::Received(b) if b.as_ptr() == big.as_ptr()),
        "a large chunk is kept as received"
    );
    let (chunks, _lease) = buf.take();
    let echoed: Vec<u8> = chunks.concat();
    assert_eq!(echoed.len(), 4100);
    assert_eq!(&echoed[2000..2100], &[b'b'; 100][..]);
}
