//! Each bound of the frame filter with input just under it (passed on) and just over it
//! (refused with its violation).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use super::*;
use crate::transport::h2_authority::limits::code;

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

pub(crate) fn frame(kind: u8, flags: u8, stream_id: u32, payload: &[u8]) -> Vec<u8> {
    let mut out = (payload.len() as u32).to_be_bytes()[1..].to_vec();
    out.extend([kind, flags]);
    out.extend(stream_id.to_be_bytes());
    out.extend_from_slice(payload);
    out
}

/// Runs `frames` (after the preface) through a filter with `limits`; the bytes for h2 after the
/// preface, or the violation.
fn run(limits: FrontLimits, frames: &[u8]) -> Result<Vec<u8>, Violation> {
    let mut f = FrameFilter::new(limits);
    f.input().extend_from_slice(PREFACE);
    f.input().extend_from_slice(frames);
    f.process()?;
    let out = f.output().split().to_vec();
    assert_eq!(&out[..PREFACE_LEN], PREFACE);
    Ok(out[PREFACE_LEN..].to_vec())
}

/// A header block split into HEADERS + CONTINUATION frames of at most `size` bytes.
fn block_frames(block: &[u8], size: usize, stream_id: u32) -> Vec<u8> {
    let chunks: Vec<&[u8]> = block.chunks(size).collect();
    let mut out = Vec::new();
    for (i, chunk) in chunks.iter().enumerate() {
        let kind = if i == 0 {
            TYPE_HEADERS
        } else {
            TYPE_CONTINUATION
        };
        let last = i + 1 == chunks.len();
        let flags =
            if last { FLAG_END_HEADERS } else { 0 } | if i == 0 { FLAG_END_STREAM } else { 0 };
        out.extend(frame(kind, flags, stream_id, chunk));
    }
    out
}

fn string(s: &[u8]) -> Vec<u8> {
    let mut out = loona_hpack::encoder::encode_integer(s.len(), 7);
    out.extend_from_slice(s);
    out
}

/// `:method POST`, `:scheme http`, `:path /`, then one literal `x-pad` of `value_len` bytes.
fn request_block(value_len: usize) -> Vec<u8> {
    let mut b = vec![0x83, 0x86, 0x84, 0x00];
    b.extend(string(b"x-pad"));
    b.extend(string(&vec![b'p'; value_len]));
    b
}

/// RFC 7541 size of `request_block(value_len)`.
fn request_size(value_len: usize) -> usize {
    (7 + 4 + 32) + (7 + 4 + 32) + (5 + 1 + 32) + (5 + value_len + 32)
}

#[test]
fn frames_up_to_the_advertised_size_pass_and_one_byte_more_is_refused() {
    let l = FrontLimits::default();
    let data = frame(0x0, 0, 1, &vec![0u8; 16_384]);
    assert_eq!(run(l, &data).unwrap(), data);
    let over = frame(0x0, 0, 1, &vec![0u8; 16_385]);
    assert_eq!(run(l, &over), Err(Violation::FrameTooLarge));
    // Refused on the 9-byte header alone, before any payload is buffered.
    assert_eq!(run(l, &over[..9]), Err(Violation::FrameTooLarge));
    let headers = frame(TYPE_HEADERS, FLAG_END_HEADERS, 1, &vec![0u8; 16_385]);
    assert_eq!(run(l, &headers[..9]), Err(Violation::FrameTooLarge));
}

#[test]
fn a_header_list_at_the_limit_passes_and_one_byte_over_is_refused() {
    let l = FrontLimits::default();
    let value = l.max_header_list_bytes - request_size(0);
    assert_eq!(request_size(value), l.max_header_list_bytes);
    let at = block_frames(&request_block(value), 16_384, 1);
    let out = run(l, &at).unwrap();
    // What h2 gets decodes to the same list.
    let mut d = loona_hpack::Decoder::new();
    let mut payload = Vec::new();
    let mut rest = &out[..];
    while !rest.is_empty() {
        let len = u32::from_be_bytes([0, rest[0], rest[1], rest[2]]) as usize;
        payload.extend_from_slice(&rest[9..9 + len]);
        rest = &rest[9 + len..];
    }
    let list = d.decode(&payload).unwrap();
    assert_eq!(list.len(), 4);
    assert_eq!(list[3].1.len(), value);
    let over = block_frames(&request_block(value + 1), 16_384, 1);
    assert_eq!(run(l, &over), Err(Violation::HeaderListTooLarge));
}

/// The attack of issue 24: one 4 KB entry inserted, then referenced until the block is full.
pub(crate) fn bomb_block(block_len: usize) -> Vec<u8> {
    let mut b = vec![0x40];
    b.extend(string(b"x-bomb"));
    b.extend(string(&[b'b'; 4000]));
    b.resize(block_len, 0x80 | 62);
    b
}

#[test]
fn the_header_bomb_is_refused_at_64_and_256_kib() {
    let l = FrontLimits::default();
    let bomb = block_frames(&bomb_block(64 * 1024), 16_384, 1);
    assert_eq!(run(l, &bomb), Err(Violation::HeaderListTooLarge));
    // 256 KiB never gets decoded: refused once its fragments pass 64 KiB.
    let bomb = block_frames(&bomb_block(256 * 1024), 16_384, 1);
    assert_eq!(run(l, &bomb), Err(Violation::HeaderBlockTooLarge));
}

#[test]
fn a_64_kib_block_passes_and_one_byte_more_is_refused() {
    let l = FrontLimits::default();
    // Leading table size updates (to 0, one byte each) fill the block; the list stays small.
    let request = request_block(10);
    let mut block = vec![0x20; l.max_header_block_bytes - request.len()];
    block.extend(&request);
    assert!(run(l, &block_frames(&block, 16_384, 1)).is_ok());
    block.insert(0, 0x20);
    assert_eq!(
        run(l, &block_frames(&block, 16_384, 1)),
        Err(Violation::HeaderBlockTooLarge)
    );
}

fn continuation_flood(continuations: usize) -> Vec<u8> {
    let mut out = frame(TYPE_HEADERS, FLAG_END_STREAM, 1, &request_block(1));
    for i in 0..continuations {
        let flags = if i + 1 == continuations {
            FLAG_END_HEADERS
        } else {
            0
        };
        out.extend(frame(TYPE_CONTINUATION, flags, 1, &[]));
    }
    out
}

#[test]
fn eight_continuation_frames_pass_and_the_ninth_is_refused() {
    let l = FrontLimits::default();
    assert_eq!(l.max_continuation_frames, 8);
    assert!(run(l, &continuation_flood(8)).is_ok());
    assert_eq!(
        run(l, &continuation_flood(9)),
        Err(Violation::TooManyContinuations)
    );
}

#[test]
fn table_size_updates_above_the_advertised_size_or_after_a_field_are_refused() {
    let l = FrontLimits::default();
    let with = |prefix: &[u8], suffix: &[u8]| {
        let mut b = prefix.to_vec();
        b.extend(request_block(1));
        b.extend_from_slice(suffix);
        frame(TYPE_HEADERS, FLAG_END_HEADERS | FLAG_END_STREAM, 1, &b)
    };
    // 4096 (= SETTINGS_HEADER_TABLE_SIZE) at the start passes; 4097 does not.
    assert!(run(l, &with(&[0x3f, 0xe1, 0x1f], &[])).is_ok());
    assert_eq!(
        run(l, &with(&[0x3f, 0xe2, 0x1f], &[])),
        Err(Violation::TableSizeUpdate)
    );
    assert_eq!(run(l, &with(&[], &[0x20])), Err(Violation::TableSizeUpdate));
    assert_eq!(
        Violation::TableSizeUpdate.error_code(),
        code::COMPRESSION_ERROR
    );
}

#[test]
fn framing_the_layer_cannot_pass_on_is_a_protocol_violation() {
    let l = FrontLimits::default();
    // A block interrupted by DATA.
    let mut bytes = frame(TYPE_HEADERS, 0, 1, &[0x82]);
    bytes.extend(frame(0x0, 0, 1, b"data"));
    assert_eq!(run(l, &bytes), Err(Violation::Protocol));
    // CONTINUATION without HEADERS, or for another stream.
    assert_eq!(
        run(l, &frame(TYPE_CONTINUATION, FLAG_END_HEADERS, 1, &[0x82])),
        Err(Violation::Protocol)
    );
    let mut bytes = frame(TYPE_HEADERS, 0, 1, &[0x82]);
    bytes.extend(frame(TYPE_CONTINUATION, FLAG_END_HEADERS, 3, &[0x84]));
    assert_eq!(run(l, &bytes), Err(Violation::Protocol));
    // Padding longer than the frame; a client PUSH_PROMISE.
    assert_eq!(
        run(
            l,
            &frame(TYPE_HEADERS, FLAG_PADDED | FLAG_END_HEADERS, 1, &[9, 0x82])
        ),
        Err(Violation::Protocol)
    );
    assert_eq!(
        run(
            l,
            &frame(TYPE_PUSH_PROMISE, FLAG_END_HEADERS, 1, &[0, 0, 0, 2, 0x82])
        ),
        Err(Violation::Protocol)
    );
}

#[test]
fn goaway_frames_carry_the_last_stream_and_the_code() {
    let g = goaway_frame(7, code::ENHANCE_YOUR_CALM, b"x");
    assert_eq!(
        g,
        [0, 0, 9, 7, 0, 0, 0, 0, 0, 0, 0, 0, 7, 0, 0, 0, 0xb, b'x']
    );
}
