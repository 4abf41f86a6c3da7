//! Differential fuzzing of the HTTP/2 front layer's inbound half (`src/transport/h2_authority/frames.rs`,
//! `FrameFilter`): for any client byte stream, what the layer hands h2 must decode to the same
//! header lists an independent HPACK decoder gets from the original (`:authority` rewritten as
//! the layer documents), with every other frame byte for byte and every bound held; or the layer
//! refuses the connection. It must never panic.
//!
//! The independent decoder is `httlib-hpack` (written from scratch), not the layer's
//! `loona-hpack` (a fork of hpack-rs): a bug both share would go unseen.
//!
//! Input: `[mode: u8][bytes...]`. The low 7 bits of `mode` are the size of the reads the layer
//! is fed in (0: all at once). High bit clear: `bytes` are the client's bytes after the
//! connection preface, as they are. High bit set: `bytes` are ops (`structured`) that build
//! well-formed HPACK with an encoder (literals with and without indexing, never indexed, Huffman
//! or not, indexed references, table size updates, Istio authorities, large values), framed with
//! padding, priority and CONTINUATION splits, plus DATA frames and raw corruption, so mutations
//! reach the decoding paths that random bytes rarely form.

#![no_main]

use kvpick::transport::h2_authority::{acceptable_authority, FrameFilter, FrontLimits, Violation};
use libfuzzer_sys::fuzz_target;

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const HEADERS: u8 = 0x1;
const PUSH_PROMISE: u8 = 0x5;
const CONTINUATION: u8 = 0x9;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;

type List = Vec<(Vec<u8>, Vec<u8>)>;

/// A frame, or a whole header block, as the reference parser reads it.
#[derive(Debug, PartialEq)]
enum Item {
    Block {
        stream_id: u32,
        end_stream: bool,
        priority: Option<[u8; 5]>,
        fragments: Vec<u8>,
    },
    /// A non-header frame; `payload` may be a prefix when the stream ends inside it.
    Other {
        head: [u8; 9],
        payload: Vec<u8>,
    },
}

/// Splits `bytes` into items. `strict`: what the layer emitted (must be complete frames except
/// a trailing pass-through payload, within the frame size, blocks never interrupted). Stops at
/// the first thing it cannot read (the layer refuses those too, or they are incomplete).
fn items(bytes: &[u8], strict: bool) -> Vec<Item> {
    let mut out = Vec::new();
    let mut rest = bytes;
    let mut block: Option<(u32, bool, Option<[u8; 5]>, Vec<u8>)> = None;
    while rest.len() >= 9 {
        let len = u32::from_be_bytes([0, rest[0], rest[1], rest[2]]) as usize;
        let (kind, flags) = (rest[3], rest[4]);
        let id = u32::from_be_bytes([rest[5], rest[6], rest[7], rest[8]]) & 0x7fff_ffff;
        if strict {
            assert!(len <= 16_384, "the layer emitted a {len}-byte frame");
        }
        let head: [u8; 9] = rest[..9].try_into().unwrap();
        let available = &rest[9..];
        if kind != HEADERS && kind != CONTINUATION && kind != PUSH_PROMISE {
            if strict {
                assert!(block.is_none(), "the layer interrupted a header block");
            } else if block.is_some() {
                break;
            }
            let payload = available[..len.min(available.len())].to_vec();
            let complete = payload.len() == len;
            out.push(Item::Other { head, payload });
            if !complete {
                break;
            }
            rest = &available[len..];
            continue;
        }
        if available.len() < len {
            assert!(!strict, "the layer emitted a partial header frame");
            break;
        }
        let payload = &available[..len];
        rest = &available[len..];
        match kind {
            HEADERS if block.is_none() => {
                let mut body = payload;
                if flags & PADDED != 0 {
                    let Some((&pad, tail)) = body.split_first() else { break };
                    let Some(keep) = tail.len().checked_sub(pad as usize) else { break };
                    body = &tail[..keep];
                }
                let priority = if flags & PRIORITY != 0 {
                    let Some((p, tail)) = body.split_first_chunk::<5>() else { break };
                    body = tail;
                    Some(*p)
                } else {
                    None
                };
                block = Some((id, flags & END_STREAM != 0, priority, body.to_vec()));
            }
            CONTINUATION if block.as_ref().is_some_and(|b| b.0 == id) => {
                if let Some(b) = block.as_mut() {
                    b.3.extend_from_slice(payload);
                }
            }
            _ => {
                assert!(!strict, "the layer emitted a stray header frame");
                break;
            }
        }
        if flags & END_HEADERS != 0 {
            if let Some((stream_id, end_stream, priority, fragments)) = block.take() {
                out.push(Item::Block {
                    stream_id,
                    end_stream,
                    priority,
                    fragments,
                });
            }
        }
    }
    if strict {
        assert!(block.is_none(), "the layer left a header block open");
    }
    out
}

/// Where the field representation (or size update) starting at `buf[0]` ends: RFC 7541 §5.1,
/// §6 read directly (its own code, not the layer's), so httlib can be fed one field at a time
/// (it drains its input from the front: whole blocks of tiny fields would be quadratic).
fn field_end(buf: &[u8]) -> Option<usize> {
    fn int(buf: &[u8], at: usize, prefix: u32) -> Option<(usize, usize)> {
        let max = (1usize << prefix) - 1;
        let first = usize::from(*buf.get(at)?) & max;
        if first < max {
            return Some((first, at + 1));
        }
        let mut value = first;
        for k in 1..5 {
            let b = *buf.get(at + k)?;
            value += usize::from(b & 0x7f) << (7 * (k - 1));
            if b & 0x80 == 0 {
                return Some((value, at + k + 1));
            }
        }
        None
    }
    fn string(buf: &[u8], at: usize) -> Option<usize> {
        let (len, start) = int(buf, at, 7)?;
        let end = start.checked_add(len)?;
        (end <= buf.len()).then_some(end)
    }
    let first = *buf.first()?;
    let (prefix, literal) = match first {
        b if b & 0x80 != 0 => (7, false),
        b if b & 0x40 != 0 => (6, true),
        b if b & 0x20 != 0 => (5, false),
        _ => (4, true),
    };
    let (index, at) = int(buf, 0, prefix)?;
    if !literal {
        return Some(at);
    }
    let at = if index == 0 { string(buf, at)? } else { at };
    string(buf, at)
}

/// Decodes a block with the independent decoder, field by field, stopping once the RFC 7541
/// size passes `cap` (the table is then out of step, so this must be the last block decoded).
/// `Err` = the independent decoder refuses the block.
fn reference_decode(
    decoder: &mut httlib_hpack::Decoder<'static>,
    block: &[u8],
    cap: usize,
) -> Result<(List, usize), ()> {
    let mut list = List::new();
    let mut size = 0usize;
    let mut pos = 0;
    while pos < block.len() {
        let end = pos + field_end(&block[pos..]).ok_or(())?;
        let mut field = block[pos..end].to_vec();
        let mut one = Vec::with_capacity(1);
        decoder.decode_exact(&mut field, &mut one).map_err(|_| ())?;
        // httlib consumed exactly the representation the boundary reader found.
        assert!(field.is_empty(), "field boundaries disagree at {pos}");
        pos = end;
        for (name, value, _) in one {
            size += name.len() + value.len() + 32;
            list.push((name, value));
        }
        if size > cap {
            break;
        }
    }
    Ok((list, size))
}

/// The layer's documented rewrite: an unacceptable `:authority` becomes `host:port` or goes.
fn rewritten(list: List) -> List {
    list.into_iter()
        .filter_map(|(name, value)| {
            if name == b":authority" {
                acceptable_authority(&value).map(|v| (name, v))
            } else {
                Some((name, value))
            }
        })
        .collect()
}

/// Header names the structured mode draws from (pseudo headers, the ones kvpick reads, h2's
/// connection-specific ones).
const NAMES: [&[u8]; 12] = [
    b":authority",
    b":method",
    b":path",
    b":scheme",
    b"content-type",
    b"te",
    b"x-session-id",
    b"x-dynamo-session-id",
    b"x-request-id",
    b"grpc-timeout",
    b"connection",
    b"X-Upper",
];

/// Builds client frames from ops (see the module doc). Every op reads a few bytes; missing
/// bytes read as 0.
fn structured(ops: &[u8]) -> Vec<u8> {
    let mut enc = httlib_hpack::Encoder::with_dynamic_size(4096);
    let mut block = Vec::new();
    let mut out = Vec::new();
    let mut stream_id = 1u32;
    let mut ops = ops.iter().copied();
    // Every op reads at least one byte, so this ends; past 128 KiB (twice the block bound) more
    // bytes only cost time.
    while let Some(op) = ops.next() {
        if out.len() + block.len() > 128 * 1024 {
            break;
        }
        let mut next = || ops.next().unwrap_or(0);
        match op % 8 {
            0..=2 => {
                let which = next();
                let name = NAMES[usize::from(which) % NAMES.len()].to_vec();
                let (len, fill, flags) = (next(), next(), next());
                let value = if which & 0x80 != 0 && name == b":authority" {
                    format!("outbound|{}||svc{}.ns.svc.cluster.local", 9000 + u16::from(fill), len)
                        .into_bytes()
                } else {
                    // Up to 255 x 32 bytes: past the list limit in a few fields.
                    vec![b'a' + fill % 26; usize::from(len) * (1 + usize::from(flags >> 5))]
                };
                let _ = enc.encode((name, value, flags & 0x1f), &mut block);
            }
            3 => {
                let index = 1 + u32::from(next()) % 70;
                let _ = enc.encode(index, &mut block);
            }
            4 => {
                let size = u32::from(u16::from_be_bytes([next(), next()])) % 4200;
                let _ = enc.update_max_dynamic_size(size, &mut block);
            }
            5 => {
                let (flags, split) = (next(), 1 + usize::from(next()) * 64);
                let mut fragments = std::mem::take(&mut block);
                let mut first = Vec::new();
                if flags & PADDED != 0 {
                    first.push(flags & 0x7);
                }
                if flags & PRIORITY != 0 {
                    first.extend([0, 0, 0, 0, 16]);
                }
                let cut = split.min(fragments.len());
                let rest = fragments.split_off(cut);
                first.extend(fragments);
                if flags & PADDED != 0 {
                    first.extend(std::iter::repeat_n(0, usize::from(flags & 0x7)));
                }
                let chunks: Vec<&[u8]> = rest.chunks(split).collect();
                let head_flags = flags & (PADDED | PRIORITY | END_STREAM);
                let end = if chunks.is_empty() { END_HEADERS } else { 0 };
                out.extend(raw_frame(HEADERS, head_flags | end, stream_id, &first));
                for (i, c) in chunks.iter().enumerate() {
                    let end = if i + 1 == chunks.len() { END_HEADERS } else { 0 };
                    out.extend(raw_frame(CONTINUATION, end, stream_id, c));
                    if i == 12 {
                        // The layer refuses at the 9th; the rest would only cost time.
                        return out;
                    }
                }
                // Trailers stay on the stream; otherwise the next request opens a new one.
                if flags & 0x40 == 0 {
                    stream_id += 2;
                }
            }
            6 => {
                let (len, flags) = (usize::from(next()), next() & END_STREAM);
                out.extend(raw_frame(0x0, flags, stream_id, &vec![0x55; len]));
            }
            _ => block.push(next()),
        }
    }
    out
}

fn raw_frame(kind: u8, flags: u8, stream_id: u32, payload: &[u8]) -> Vec<u8> {
    let mut out = (payload.len() as u32).to_be_bytes()[1..].to_vec();
    out.extend([kind, flags]);
    out.extend(stream_id.to_be_bytes());
    out.extend_from_slice(payload);
    out
}

fuzz_target!(|data: &[u8]| {
    let [mode, bytes @ ..] = data else { return };
    let built;
    let client = if mode & 0x80 != 0 {
        built = structured(bytes);
        &built[..]
    } else {
        bytes
    };
    let chunking = &(mode & 0x7f);
    let limits = FrontLimits::default();
    let mut wire = PREFACE.to_vec();
    wire.extend_from_slice(client);

    // The layer, fed in reads of `chunking` bytes (0: all at once).
    let mut filter = FrameFilter::new(limits);
    let mut refusal = None;
    let step = if *chunking == 0 { wire.len() } else { usize::from(*chunking) };
    for chunk in wire.chunks(step) {
        filter.input().extend_from_slice(chunk);
        if let Err(v) = filter.process() {
            refusal = Some(v);
            break;
        }
    }
    let emitted = filter.output().split().to_vec();
    assert!(emitted.starts_with(&wire[..PREFACE.len()]));
    let forwarded = items(&emitted[PREFACE.len()..], true);
    let original = items(client, false);

    let mut reference = httlib_hpack::Decoder::with_dynamic_size(4096);
    let mut replay = httlib_hpack::Decoder::with_dynamic_size(4096);
    let cap = limits.max_header_list_bytes;
    for (i, out) in forwarded.iter().enumerate() {
        let Some(before) = original.get(i) else {
            panic!("item {i}: the layer emitted {out:?}, which the client never sent");
        };
        match (before, out) {
            (Item::Other { head: a, payload: p }, Item::Other { head: b, payload: q }) => {
                assert_eq!(a, b, "frame {i}: a pass-through frame header changed");
                assert!(p.starts_with(q), "frame {i}: a pass-through payload changed");
            }
            (
                Item::Block { stream_id, end_stream, priority, fragments },
                Item::Block { stream_id: s, end_stream: e, priority: p, fragments: f },
            ) => {
                assert_eq!((stream_id, end_stream, priority), (s, e, p), "block {i}");
                let Ok((want, size)) = reference_decode(&mut reference, fragments, cap) else {
                    panic!("block {i}: forwarded, but the independent decoder refuses it");
                };
                assert!(size <= cap, "block {i}: a {size}-byte list was forwarded");
                let (got, _) = reference_decode(&mut replay, f, usize::MAX)
                    .expect("the layer's own encoding decodes");
                assert_eq!(rewritten(want), got, "block {i}: header lists differ");
            }
            (a, b) => panic!("item {i}: {a:?} became {b:?}"),
        }
    }
    // A refused header list really is over the limit (when the reference can decode it).
    if refusal == Some(Violation::HeaderListTooLarge) {
        if let Some(Item::Block { fragments, .. }) = original.get(forwarded.len()) {
            if let Ok((_, size)) = reference_decode(&mut reference, fragments, cap) {
                assert!(size > cap, "a {size}-byte list was refused as too large");
            }
        }
    }
});
