//! Bounded HPACK decoding of one client header block: entry by entry, counting the decoded list
//! (RFC 7541 §4.1 size: name + value + 32) as it goes and stopping at the first entry that takes
//! it past the limit, so a block of references to one large table entry never materialises
//! (before: a 64 KiB block decoded to ~250 MB).
//!
//! `loona_hpack`'s decoder decodes a whole buffer and its callback cannot stop it. So this module
//! finds each field representation's length itself (the HPACK wire structure: integers and string
//! lengths, no Huffman decoding needed) and hands the decoder one representation at a time; the
//! decoder keeps the dynamic table. Dynamic table size updates are handled here, not by the
//! decoder: only at the start of a block (RFC 7541 §4.2, as h2 enforces) and never above the
//! advertised table size. It knows nothing of frames or `:authority`.

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
    while pos < block.len() {
        if is_size_update(block[pos]) {
            return Err(Violation::TableSizeUpdate);
        }
        let len = field_len(&block[pos..]).ok_or(Violation::Compression)?;
        let mut fields = 0;
        let mut over = false;
        decoder
            .decode_with_cb(&block[pos..pos + len], |name, value| {
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
