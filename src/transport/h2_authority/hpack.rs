//! Bounded HPACK decoding of one client header block: entry by entry, counting the decoded list
//! (RFC 7541 §4.1 size: name + value + 32) as it goes and stopping at the first entry that takes
//! it past the limit, so a block of references to one large table entry never materialises
//! (before: a 64 KiB block decoded to ~250 MB).
//!
//! `loona_hpack`'s decoder decodes a whole buffer and its callback cannot stop it. So this module
//! finds each field representation's length itself (the HPACK wire structure: integers and string
//! lengths, no Huffman decoding needed) and hands the decoder one representation at a time; the
//! decoder keeps the dynamic table. Huffman-coded strings are decoded here (`huffman`, linear
//! time) and handed on as raw literals, because `loona_hpack`'s own Huffman decoder costs
//! milliseconds per short string. Dynamic table size updates are handled here, not by the
//! decoder: only at the start of a block (RFC 7541 §4.2, as h2 enforces) and never above the
//! advertised table size. It knows nothing of frames or `:authority`.

use super::huffman;
use super::limits::{FrontLimits, Violation};

/// A decoded header list: (name, value) in block order.
pub type HeaderList = Vec<(Vec<u8>, Vec<u8>)>;

/// Decodes `block` with the connection's `decoder`, bounded by `limits`.
pub fn decode_block(
    decoder: &mut loona_hpack::Decoder<'static>,
    block: &[u8],
    limits: &FrontLimits,
) -> Result<HeaderList, Violation> {
    let mut pos = 0;
    // Size updates first (any number, each at least one byte of the bounded block).
    while pos < block.len() && is_size_update(block[pos]) {
        let (size, used) = integer(&block[pos..], 5).ok_or(Violation::Compression)?;
        if size > limits.header_table_size {
            return Err(Violation::TableSizeUpdate);
        }
        // Checked above: the decoder's own assertion (size <= its allowed maximum) holds.
        decoder.set_max_table_size(size);
        pos += used;
    }
    let mut list = HeaderList::new();
    let mut size = 0usize;
    let mut raw = Vec::new();
    while pos < block.len() {
        if is_size_update(block[pos]) {
            return Err(Violation::TableSizeUpdate);
        }
        let len = field_len(&block[pos..]).ok_or(Violation::Compression)?;
        let representation = without_huffman(&block[pos..pos + len], &mut raw)?;
        let mut fields = 0;
        let mut over = false;
        decoder
            .decode_with_cb(representation, |name, value| {
                fields += 1;
                size = size.saturating_add(name.len() + value.len() + 32);
                if size > limits.max_header_list_bytes {
                    over = true;
                } else {
                    list.push((name.into_owned(), value.into_owned()));
                }
            })
            .map_err(|_| Violation::Compression)?;
        if over {
            return Err(Violation::HeaderListTooLarge);
        }
        // One representation is one field; anything else means the two parsers disagree.
        if fields != 1 {
            return Err(Violation::Compression);
        }
        pos += len;
    }
    Ok(list)
}

/// `representation` (one whole field, as `field_len` measured it) with every Huffman-coded
/// string replaced by its raw octets, written into `scratch`; or `representation` itself when it
/// has none.
fn without_huffman<'a>(
    representation: &'a [u8],
    scratch: &'a mut Vec<u8>,
) -> Result<&'a [u8], Violation> {
    let first = representation[0];
    if first & 0x80 != 0 {
        return Ok(representation);
    }
    let prefix = if first & 0x40 != 0 { 6 } else { 4 };
    let (index, mut pos) = integer(representation, prefix).ok_or(Violation::Compression)?;
    let strings = if index == 0 { 2 } else { 1 };
    let mut starts = [pos; 2];
    for start in starts.iter_mut().take(strings) {
        *start = pos;
        pos += string_len(&representation[pos..]).ok_or(Violation::Compression)?;
    }
    if !starts[..strings]
        .iter()
        .any(|&s| representation[s] & 0x80 != 0)
    {
        return Ok(representation);
    }
    scratch.clear();
    scratch.extend_from_slice(&representation[..starts[0]]);
    let mut decoded = Vec::new();
    for &start in &starts[..strings] {
        let (len, used) = integer(&representation[start..], 7).ok_or(Violation::Compression)?;
        let octets = &representation[start + used..start + used + len];
        if representation[start] & 0x80 == 0 {
            push_string(scratch, octets);
        } else {
            decoded.clear();
            huffman::decode(octets, &mut decoded).map_err(|_| Violation::Compression)?;
            push_string(scratch, &decoded);
        }
    }
    Ok(scratch)
}

/// A raw (non-Huffman) string literal: 7-bit-prefix length, then the octets.
fn push_string(out: &mut Vec<u8>, octets: &[u8]) {
    let mut len = octets.len();
    if len < 0x7f {
        out.push(len as u8);
    } else {
        out.push(0x7f);
        len -= 0x7f;
        while len >= 0x80 {
            out.push((len as u8 & 0x7f) | 0x80);
            len >>= 7;
        }
        out.push(len as u8);
    }
    out.extend_from_slice(octets);
}

/// `001xxxxx`: a dynamic table size update (RFC 7541 §6.3).
fn is_size_update(first: u8) -> bool {
    first & 0xe0 == 0x20
}

/// The length in bytes of the field representation at the start of `buf` (RFC 7541 §6.1, §6.2),
/// or `None` if it is truncated or malformed.
fn field_len(buf: &[u8]) -> Option<usize> {
    let first = *buf.first()?;
    if first & 0x80 != 0 {
        // Indexed: the index alone.
        return integer(buf, 7).map(|(_, used)| used);
    }
    // Literal: with incremental indexing (01, 6-bit index) or without / never indexed (0000 /
    // 0001, 4-bit index); index 0 = the name follows as a string.
    let prefix = if first & 0x40 != 0 { 6 } else { 4 };
    let (index, mut pos) = integer(buf, prefix)?;
    if index == 0 {
        pos += string_len(&buf[pos..])?;
    }
    pos += string_len(buf.get(pos..)?)?;
    Some(pos)
}

/// Length of the string literal (length prefix + octets) at the start of `buf`.
fn string_len(buf: &[u8]) -> Option<usize> {
    let (len, used) = integer(buf, 7)?;
    let end = used.checked_add(len)?;
    (end <= buf.len()).then_some(end)
}

/// An HPACK integer with an `prefix`-bit prefix (RFC 7541 §5.1): (value, bytes used). At most 5
/// bytes, like loona_hpack and h2 (so values stay below 2^28 and never overflow).
fn integer(buf: &[u8], prefix: u8) -> Option<(usize, usize)> {
    let mask = (1u16 << prefix) - 1;
    let mut value = usize::from(*buf.first()? & mask as u8);
    if value < usize::from(mask) {
        return Some((value, 1));
    }
    let mut shift = 0;
    for (i, &b) in buf.iter().enumerate().skip(1).take(4) {
        value += usize::from(b & 0x7f) << shift;
        shift += 7;
        if b & 0x80 == 0 {
            return Some((value, i + 1));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    fn decoder() -> loona_hpack::Decoder<'static> {
        let mut d = loona_hpack::Decoder::new();
        d.set_max_allowed_table_size(4096);
        d
    }

    fn limits(list: usize) -> FrontLimits {
        FrontLimits::new(list.max(1024))
    }

    /// Literal without indexing, new name, raw strings.
    fn literal(name: &[u8], value: &[u8]) -> Vec<u8> {
        let mut out = vec![0x00];
        out.extend(string(name));
        out.extend(string(value));
        out
    }

    fn string(s: &[u8]) -> Vec<u8> {
        let mut out = loona_hpack::encoder::encode_integer(s.len(), 7);
        out.extend_from_slice(s);
        out
    }

    #[test]
    fn integers_match_rfc_7541_examples_and_refuse_six_bytes() {
        assert_eq!(integer(&[0x0a], 5), Some((10, 1)));
        assert_eq!(integer(&[0x1f, 0x9a, 0x0a], 5), Some((1337, 3)));
        assert_eq!(integer(&[0x1f], 5), None);
        assert_eq!(
            integer(&[0xff, 0x80, 0x80, 0x80, 0x01], 8),
            Some((255 + (1 << 21), 5))
        );
        assert_eq!(integer(&[0xff, 0x80, 0x80, 0x80, 0x80, 0x01], 8), None);
    }

    #[test]
    fn a_list_exactly_at_the_limit_decodes_and_one_byte_more_is_refused() {
        let l = limits(1024);
        // One entry: 3 + value + 32 bytes.
        let at = literal(b"x-a", &vec![b'v'; 1024 - 35]);
        let list = decode_block(&mut decoder(), &at, &l).unwrap();
        assert_eq!(list.len(), 1);
        let over = literal(b"x-a", &vec![b'v'; 1024 - 34]);
        assert_eq!(
            decode_block(&mut decoder(), &over, &l),
            Err(Violation::HeaderListTooLarge)
        );
    }

    #[test]
    fn references_to_one_large_entry_stop_at_the_limit() {
        // The header bomb: one 4000-byte entry inserted, then referenced 60,000 times.
        let mut block = vec![0x40];
        block.extend(string(b"x-bomb"));
        block.extend(string(&[b'b'; 4000]));
        block.extend(std::iter::repeat_n(0x80 | 62, 60_000));
        let l = FrontLimits::default();
        assert_eq!(
            decode_block(&mut decoder(), &block, &l),
            Err(Violation::HeaderListTooLarge)
        );
        // Four copies (4 * 4038 = 16,152 bytes) still fit 16 KiB.
        let list = decode_block(&mut decoder(), &block[..block.len() - 60_000 + 3], &l).unwrap();
        assert_eq!(list.len(), 4);
    }

    #[test]
    fn table_size_updates_only_at_the_start_and_never_above_the_table() {
        let l = FrontLimits::default();
        let field = [0x82]; // :method GET
                            // 4096 at the start: accepted (0x3f 0xe1 0x1f = 31 + 4065).
        let mut ok = vec![0x3f, 0xe1, 0x1f, 0x20];
        ok.extend(field);
        assert_eq!(decode_block(&mut decoder(), &ok, &l).unwrap().len(), 1);
        // 4097: refused.
        let mut big = vec![0x3f, 0xe2, 0x1f];
        big.extend(field);
        assert_eq!(
            decode_block(&mut decoder(), &big, &l),
            Err(Violation::TableSizeUpdate)
        );
        // After a field: refused.
        let late = [0x82, 0x20];
        assert_eq!(
            decode_block(&mut decoder(), &late, &l),
            Err(Violation::TableSizeUpdate)
        );
        // A block of size updates only is an empty list (h2 accepts it the same way).
        assert!(decode_block(&mut decoder(), &[0x20], &l)
            .unwrap()
            .is_empty());
    }

    /// A Huffman-coded string literal.
    fn huffman_string(s: &[u8]) -> Vec<u8> {
        let octets = super::huffman::encode(s);
        let mut out = loona_hpack::encoder::encode_integer(octets.len(), 7);
        out[0] |= 0x80;
        out.extend(octets);
        out
    }

    #[test]
    fn huffman_strings_decode_like_raw_ones() {
        let l = FrontLimits::default();
        // "custom-key" = 25 a8 49 e9 5b a9 7d 7f (RFC 7541 C.4.3), then a raw value.
        let mut huffman = vec![0x00, 0x88, 0x25, 0xa8, 0x49, 0xe9, 0x5b, 0xa9, 0x7d, 0x7f];
        huffman.extend(string(b"v"));
        let list = decode_block(&mut decoder(), &huffman, &l).unwrap();
        assert_eq!(list, vec![(b"custom-key".to_vec(), b"v".to_vec())]);
        // An indexed name with a Huffman value (:authority = www.example.com, C.4.1).
        let indexed = [
            0x41, 0x8c, 0xf1, 0xe3, 0xc2, 0xe5, 0xf2, 0x3a, 0x6b, 0xa0, 0xab, 0x90, 0xf4, 0xff,
        ];
        let list = decode_block(&mut decoder(), &indexed, &l).unwrap();
        assert_eq!(
            list,
            vec![(b":authority".to_vec(), b"www.example.com".to_vec())]
        );
        // A long value (its length past the 7-bit prefix) added to the dynamic table, then
        // referenced from it.
        let long = vec![b'q'; 300];
        let mut d = decoder();
        let mut block = vec![0x40];
        block.extend(huffman_string(b"x-long"));
        block.extend(huffman_string(&long));
        block.push(0x80 | 62);
        let list = decode_block(&mut d, &block, &l).unwrap();
        let entry = (b"x-long".to_vec(), long);
        assert_eq!(list, vec![entry.clone(), entry]);
    }

    #[test]
    fn many_one_byte_huffman_strings_decode_and_bad_huffman_is_a_compression_error() {
        let l = FrontLimits::default();
        // The CPU flood: 400 one-byte (34 bytes each in the list, 13,600 in all) Huffman values ('0' = 00000 + padding = 0x07).
        let mut flood = Vec::new();
        for _ in 0..400 {
            flood.extend([0x00, 0x81, 0x07, 0x81, 0x07]);
        }
        let list = decode_block(&mut decoder(), &flood, &l).unwrap();
        assert_eq!(list.len(), 400);
        assert!(list.iter().all(|(n, v)| n == b"0" && v == b"0"));
        // Padding with a zero bit; EOS inside a string.
        for bad in [
            &[0x00, 0x81, 0x06, 0x00][..],
            &[0x00, 0x01, b'a', 0x84, 0xff, 0xff, 0xff, 0xfc],
        ] {
            assert_eq!(
                decode_block(&mut decoder(), bad, &l),
                Err(Violation::Compression),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn truncated_and_bad_indexes_are_compression_errors() {
        let l = FrontLimits::default();
        for bad in [
            &[0x80][..],
            &[0xff, 0x80],
            &[0x00, 0x05, b'a'],
            &[0x40, 0x01],
        ] {
            assert_eq!(
                decode_block(&mut decoder(), bad, &l),
                Err(Violation::Compression),
                "{bad:?}"
            );
        }
    }
}
