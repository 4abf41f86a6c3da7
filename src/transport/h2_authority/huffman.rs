//! HPACK Huffman decoding (RFC 7541 §5.2, Appendix B) in constant time per input bit: a
//! nibble-driven state machine over the code tree, built once per process.
//!
//! Why kvpick has its own: `loona_hpack` rebuilds a map of all 257 codes for every Huffman
//! string it decodes and then walks it bit by bit, so a 2.4 KB header block of one-byte Huffman
//! strings cost ~20 ms of CPU — a cheap way for a client to burn a core. `hpack` now decodes
//! every Huffman string with this module and hands `loona_hpack` raw literals only.
//!
//! It owns nothing but the code table and the decoder; it knows nothing of header blocks,
//! limits or frames.

use std::sync::LazyLock;

/// A Huffman string that is not a valid encoding: it contains EOS, or its padding is longer
/// than 7 bits or not the most significant bits of EOS (RFC 7541 §5.2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InvalidHuffman;

/// Appends the decoding of `encoded` to `out`.
pub fn decode(encoded: &[u8], out: &mut Vec<u8>) -> Result<(), InvalidHuffman> {
    let machine = &*MACHINE;
    let mut state = 0u8;
    for &byte in encoded {
        for nibble in [byte >> 4, byte & 0x0f] {
            let step = machine.steps[usize::from(state)][usize::from(nibble)];
            if step.flags & FAILS != 0 {
                return Err(InvalidHuffman);
            }
            if step.flags & EMITS != 0 {
                out.push(step.symbol);
            }
            state = step.next;
        }
    }
    if machine.may_end[usize::from(state)] {
        Ok(())
    } else {
        Err(InvalidHuffman)
    }
}

const EMITS: u8 = 1;
const FAILS: u8 = 2;
/// The code of EOS (symbol 256), which must never appear decoded.
const EOS: u16 = 256;

/// What four more input bits do from one state (an internal node of the code tree).
#[derive(Clone, Copy, Default)]
struct Step {
    next: u8,
    flags: u8,
    symbol: u8,
}

struct Machine {
    steps: Vec<[Step; 16]>,
    /// A string may end in this state: it is the root or an all-ones path of at most 7 bits
    /// (padding = the most significant bits of EOS).
    may_end: Vec<bool>,
}

#[derive(Clone, Copy)]
enum Child {
    Node(u8),
    Leaf(u16),
}

static MACHINE: LazyLock<Machine> = LazyLock::new(build);

/// The code tree (internal nodes only; a complete prefix code of 257 leaves has 256 of them, so
/// a node index fits a `u8`), then each (node, nibble) walked once.
// The table is a constant and `every_byte_value_round_trips` walks all of it: the expects can
// only fire on an edit of `CODES`, at the first HTTP/2 connection of a test run.
#[allow(clippy::expect_used)]
fn build() -> Machine {
    let mut nodes: Vec<[Option<Child>; 2]> = vec![[None, None]];
    for (symbol, &(code, len)) in (0u16..).zip(CODES.iter()) {
        let mut node = 0usize;
        for i in (0..len).rev() {
            let bit = ((code >> i) & 1) as usize;
            if i == 0 {
                nodes[node][bit] = Some(Child::Leaf(symbol));
            } else if let Some(Child::Node(next)) = nodes[node][bit] {
                node = usize::from(next);
            } else {
                let next = u8::try_from(nodes.len()).expect("256 internal nodes");
                nodes.push([None, None]);
                nodes[node][bit] = Some(Child::Node(next));
                node = usize::from(next);
            }
        }
    }
    let steps = (0..nodes.len())
        .map(|state| std::array::from_fn(|nibble| walk(&nodes, state, nibble as u8)))
        .collect();
    let mut may_end = vec![false; nodes.len()];
    let (mut node, mut depth) = (0usize, 0);
    while depth <= 7 {
        may_end[node] = true;
        match nodes[node][1] {
            Some(Child::Node(next)) => node = usize::from(next),
            _ => break,
        }
        depth += 1;
    }
    Machine { steps, may_end }
}

#[allow(clippy::expect_used)] // as in `build`: a complete code has both children everywhere
fn walk(nodes: &[[Option<Child>; 2]], state: usize, nibble: u8) -> Step {
    let mut step = Step::default();
    let mut node = state;
    for i in (0..4).rev() {
        match nodes[node][usize::from((nibble >> i) & 1)].expect("complete code") {
            Child::Node(next) => node = usize::from(next),
            Child::Leaf(EOS) => {
                step.flags = FAILS;
                return step;
            }
            Child::Leaf(symbol) => {
                // The shortest code is 5 bits: four bits finish at most one symbol.
                debug_assert!(step.flags & EMITS == 0);
                step.flags |= EMITS;
                step.symbol = symbol as u8;
                node = 0;
            }
        }
    }
    step.next = node as u8;
    step
}

/// RFC 7541 Appendix B: (code, length in bits) for symbols 0..=255 and EOS.
const CODES: [(u32, u8); 257] = [
    (0x1ff8, 13),
    (0x7fffd8, 23),
    (0xfffffe2, 28),
    (0xfffffe3, 28),
    (0xfffffe4, 28),
    (0xfffffe5, 28),
    (0xfffffe6, 28),
    (0xfffffe7, 28),
    (0xfffffe8, 28),
    (0xffffea, 24),
    (0x3ffffffc, 30),
    (0xfffffe9, 28),
    (0xfffffea, 28),
    (0x3ffffffd, 30),
    (0xfffffeb, 28),
    (0xfffffec, 28),
    (0xfffffed, 28),
    (0xfffffee, 28),
    (0xfffffef, 28),
    (0xffffff0, 28),
    (0xffffff1, 28),
    (0xffffff2, 28),
    (0x3ffffffe, 30),
    (0xffffff3, 28),
    (0xffffff4, 28),
    (0xffffff5, 28),
    (0xffffff6, 28),
    (0xffffff7, 28),
    (0xffffff8, 28),
    (0xffffff9, 28),
    (0xffffffa, 28),
    (0xffffffb, 28),
    (0x14, 6),
    (0x3f8, 10),
    (0x3f9, 10),
    (0xffa, 12),
    (0x1ff9, 13),
    (0x15, 6),
    (0xf8, 8),
    (0x7fa, 11),
    (0x3fa, 10),
    (0x3fb, 10),
    (0xf9, 8),
    (0x7fb, 11),
    (0xfa, 8),
    (0x16, 6),
    (0x17, 6),
    (0x18, 6),
    (0x0, 5),
    (0x1, 5),
    (0x2, 5),
    (0x19, 6),
    (0x1a, 6),
    (0x1b, 6),
    (0x1c, 6),
    (0x1d, 6),
    (0x1e, 6),
    (0x1f, 6),
    (0x5c, 7),
    (0xfb, 8),
    (0x7ffc, 15),
    (0x20, 6),
    (0xffb, 12),
    (0x3fc, 10),
    (0x1ffa, 13),
    (0x21, 6),
    (0x5d, 7),
    (0x5e, 7),
    (0x5f, 7),
    (0x60, 7),
    (0x61, 7),
    (0x62, 7),
    (0x63, 7),
    (0x64, 7),
    (0x65, 7),
    (0x66, 7),
    (0x67, 7),
    (0x68, 7),
    (0x69, 7),
    (0x6a, 7),
    (0x6b, 7),
    (0x6c, 7),
    (0x6d, 7),
    (0x6e, 7),
    (0x6f, 7),
    (0x70, 7),
    (0x71, 7),
    (0x72, 7),
    (0xfc, 8),
    (0x73, 7),
    (0xfd, 8),
    (0x1ffb, 13),
    (0x7fff0, 19),
    (0x1ffc, 13),
    (0x3ffc, 14),
    (0x22, 6),
    (0x7ffd, 15),
    (0x3, 5),
    (0x23, 6),
    (0x4, 5),
    (0x24, 6),
    (0x5, 5),
    (0x25, 6),
    (0x26, 6),
    (0x27, 6),
    (0x6, 5),
    (0x74, 7),
    (0x75, 7),
    (0x28, 6),
    (0x29, 6),
    (0x2a, 6),
    (0x7, 5),
    (0x2b, 6),
    (0x76, 7),
    (0x2c, 6),
    (0x8, 5),
    (0x9, 5),
    (0x2d, 6),
    (0x77, 7),
    (0x78, 7),
    (0x79, 7),
    (0x7a, 7),
    (0x7b, 7),
    (0x7ffe, 15),
    (0x7fc, 11),
    (0x3ffd, 14),
    (0x1ffd, 13),
    (0xffffffc, 28),
    (0xfffe6, 20),
    (0x3fffd2, 22),
    (0xfffe7, 20),
    (0xfffe8, 20),
    (0x3fffd3, 22),
    (0x3fffd4, 22),
    (0x3fffd5, 22),
    (0x7fffd9, 23),
    (0x3fffd6, 22),
    (0x7fffda, 23),
    (0x7fffdb, 23),
    (0x7fffdc, 23),
    (0x7fffdd, 23),
    (0x7fffde, 23),
    (0xffffeb, 24),
    (0x7fffdf, 23),
    (0xffffec, 24),
    (0xffffed, 24),
    (0x3fffd7, 22),
    (0x7fffe0, 23),
    (0xffffee, 24),
    (0x7fffe1, 23),
    (0x7fffe2, 23),
    (0x7fffe3, 23),
    (0x7fffe4, 23),
    (0x1fffdc, 21),
    (0x3fffd8, 22),
    (0x7fffe5, 23),
    (0x3fffd9, 22),
    (0x7fffe6, 23),
    (0x7fffe7, 23),
    (0xffffef, 24),
    (0x3fffda, 22),
    (0x1fffdd, 21),
    (0xfffe9, 20),
    (0x3fffdb, 22),
    (0x3fffdc, 22),
    (0x7fffe8, 23),
    (0x7fffe9, 23),
    (0x1fffde, 21),
    (0x7fffea, 23),
    (0x3fffdd, 22),
    (0x3fffde, 22),
    (0xfffff0, 24),
    (0x1fffdf, 21),
    (0x3fffdf, 22),
    (0x7fffeb, 23),
    (0x7fffec, 23),
    (0x1fffe0, 21),
    (0x1fffe1, 21),
    (0x3fffe0, 22),
    (0x1fffe2, 21),
    (0x7fffed, 23),
    (0x3fffe1, 22),
    (0x7fffee, 23),
    (0x7fffef, 23),
    (0xfffea, 20),
    (0x3fffe2, 22),
    (0x3fffe3, 22),
    (0x3fffe4, 22),
    (0x7ffff0, 23),
    (0x3fffe5, 22),
    (0x3fffe6, 22),
    (0x7ffff1, 23),
    (0x3ffffe0, 26),
    (0x3ffffe1, 26),
    (0xfffeb, 20),
    (0x7fff1, 19),
    (0x3fffe7, 22),
    (0x7ffff2, 23),
    (0x3fffe8, 22),
    (0x1ffffec, 25),
    (0x3ffffe2, 26),
    (0x3ffffe3, 26),
    (0x3ffffe4, 26),
    (0x7ffffde, 27),
    (0x7ffffdf, 27),
    (0x3ffffe5, 26),
    (0xfffff1, 24),
    (0x1ffffed, 25),
    (0x7fff2, 19),
    (0x1fffe3, 21),
    (0x3ffffe6, 26),
    (0x7ffffe0, 27),
    (0x7ffffe1, 27),
    (0x3ffffe7, 26),
    (0x7ffffe2, 27),
    (0xfffff2, 24),
    (0x1fffe4, 21),
    (0x1fffe5, 21),
    (0x3ffffe8, 26),
    (0x3ffffe9, 26),
    (0xffffffd, 28),
    (0x7ffffe3, 27),
    (0x7ffffe4, 27),
    (0x7ffffe5, 27),
    (0xfffec, 20),
    (0xfffff3, 24),
    (0xfffed, 20),
    (0x1fffe6, 21),
    (0x3fffe9, 22),
    (0x1fffe7, 21),
    (0x1fffe8, 21),
    (0x7ffff3, 23),
    (0x3fffea, 22),
    (0x3fffeb, 22),
    (0x1ffffee, 25),
    (0x1ffffef, 25),
    (0xfffff4, 24),
    (0xfffff5, 24),
    (0x3ffffea, 26),
    (0x7ffff4, 23),
    (0x3ffffeb, 26),
    (0x7ffffe6, 27),
    (0x3ffffec, 26),
    (0x3ffffed, 26),
    (0x7ffffe7, 27),
    (0x7ffffe8, 27),
    (0x7ffffe9, 27),
    (0x7ffffea, 27),
    (0x7ffffeb, 27),
    (0xffffffe, 28),
    (0x7ffffec, 27),
    (0x7ffffed, 27),
    (0x7ffffee, 27),
    (0x7ffffef, 27),
    (0x7fffff0, 27),
    (0x3ffffee, 26),
    (0x3fffffff, 30),
];

/// A reference encoder straight from the table, for tests' round trips.
#[cfg(test)]
pub(super) fn encode(plain: &[u8]) -> Vec<u8> {
    let (mut acc, mut bits, mut out) = (0u64, 0u32, Vec::new());
    for &b in plain {
        let (code, len) = CODES[usize::from(b)];
        acc = (acc << len) | u64::from(code);
        bits += u32::from(len);
        while bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
        }
    }
    if bits > 0 {
        let pad = 8 - bits;
        out.push(((acc << pad) | ((1 << pad) - 1)) as u8);
    }
    out
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    fn decoded(encoded: &[u8]) -> Result<Vec<u8>, InvalidHuffman> {
        let mut out = Vec::new();
        decode(encoded, &mut out).map(|()| out)
    }

    #[test]
    fn rfc_7541_appendix_c_examples_decode() {
        // C.4.1 "www.example.com", C.4.2 "no-cache", C.4.3 "custom-key" / "custom-value".
        let www = [
            0xf1, 0xe3, 0xc2, 0xe5, 0xf2, 0x3a, 0x6b, 0xa0, 0xab, 0x90, 0xf4, 0xff,
        ];
        assert_eq!(decoded(&www).unwrap(), b"www.example.com");
        let no_cache = [0xa8, 0xeb, 0x10, 0x64, 0x9c, 0xbf];
        assert_eq!(decoded(&no_cache).unwrap(), b"no-cache");
        let key = [0x25, 0xa8, 0x49, 0xe9, 0x5b, 0xa9, 0x7d, 0x7f];
        assert_eq!(decoded(&key).unwrap(), b"custom-key");
        let value = [0x25, 0xa8, 0x49, 0xe9, 0x5b, 0xb8, 0xe8, 0xb4, 0xbf];
        assert_eq!(decoded(&value).unwrap(), b"custom-value");
    }

    #[test]
    fn every_byte_value_round_trips() {
        let all: Vec<u8> = (0..=255).collect();
        assert_eq!(decoded(&encode(&all)).unwrap(), all);
        for b in 0..=255u8 {
            assert_eq!(decoded(&encode(&[b])).unwrap(), [b], "byte {b}");
        }
        assert_eq!(decoded(&[]).unwrap(), b"");
    }

    #[test]
    fn bad_padding_and_eos_are_refused() {
        // '0' is 00000 (5 bits); padding of 1s is valid, a 0 in the padding is not.
        assert_eq!(decoded(&[0x07]).unwrap(), b"0");
        assert_eq!(decoded(&[0x06]), Err(InvalidHuffman));
        // Eight bits of padding (a whole 0xff byte after a complete string) are too many.
        assert_eq!(decoded(&[0x07, 0xff]), Err(InvalidHuffman));
        // EOS itself: 30 ones.
        assert_eq!(decoded(&[0xff, 0xff, 0xff, 0xfc]), Err(InvalidHuffman));
        // A whole byte of padding is never valid, all ones or not.
        assert_eq!(decoded(&[0xfe]), Err(InvalidHuffman));
        assert_eq!(decoded(&[0xff]), Err(InvalidHuffman));
    }

    #[test]
    fn agrees_with_loona_hpack_on_random_inputs() {
        let mut decoder = loona_hpack::huffman::HuffmanDecoder::new();
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..2_000 {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            let len = (seed % 12) as usize;
            let bytes: Vec<u8> = (0..len).map(|i| (seed >> (i * 5)) as u8).collect();
            assert_eq!(
                decoded(&bytes).ok(),
                decoder.decode(&bytes).ok(),
                "{bytes:?}"
            );
        }
    }
}
