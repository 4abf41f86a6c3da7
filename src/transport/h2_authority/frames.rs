//! The client-to-server half of the front layer as a value: bytes read from the connection go in
//! (`input`), bytes for h2 come out (`output`), or a [`Violation`] ends the connection. Every
//! frame header is checked against the advertised frame size; header blocks are collected
//! (bounded in bytes and CONTINUATION frames), decoded with the client's HPACK table under the
//! header-list bound (`hpack`), get an acceptable `:authority` and are re-encoded with h2's table.
//! Every other frame passes through byte for byte, seen by the connection's memory ledger
//! (`ledger`: DATA charged, frames of a stream it reset dropped, h2 told of the reset at a frame
//! boundary). No I/O, no clock: the fuzz target
//! (`fuzz/fuzz_targets/h2_front.rs`) drives it directly.

use bytes::{Buf, BufMut, BytesMut};

use super::floods::FrameCounts;
use super::hpack::{decode_block, HeaderList};
use super::ledger::{Ledger, Verdict};
use super::limits::{FrontLimits, Violation};
use super::streams::{Streams, FRAME_HEADER_LEN, TYPE_HEADERS, TYPE_RST_STREAM};

/// The client connection preface (RFC 9113 §3.4) that precedes the first frame.
pub const PREFACE_LEN: usize = 24;
pub const TYPE_PUSH_PROMISE: u8 = 0x5;
pub const TYPE_CONTINUATION: u8 = 0x9;
pub const FLAG_END_STREAM: u8 = 0x1;
pub const FLAG_END_HEADERS: u8 = 0x4;
pub const FLAG_PADDED: u8 = 0x8;
pub const FLAG_PRIORITY: u8 = 0x20;
/// Frames written towards h2 stay within the default SETTINGS_MAX_FRAME_SIZE, which every
/// HTTP/2 server accepts whatever it advertised.
const MAX_EMITTED_FRAME: usize = 16_384;

/// The first frame of a header block being collected, and its fragments so far.
struct PendingBlock {
    stream_id: u32,
    /// END_STREAM and PRIORITY of the HEADERS frame (END_HEADERS is set on what is emitted).
    flags: u8,
    /// The 5 priority bytes when PRIORITY is set.
    priority: Option<[u8; 5]>,
    fragments: Vec<u8>,
    continuations: usize,
}

/// One connection's inbound frame processing (see the module doc).
pub struct FrameFilter {
    limits: FrontLimits,
    /// Bytes read from the connection and not yet processed.
    raw: BytesMut,
    /// Processed bytes ready for h2.
    out: BytesMut,
    preface_left: usize,
    /// Payload bytes of the current non-header frame still to pass through untouched.
    passthrough_left: usize,
    pending: Option<PendingBlock>,
    decoder: loona_hpack::Decoder<'static>,
    encoder: loona_hpack::Encoder<'static>,
    rewrites: u64,
    /// Highest stream id whose HEADERS went to h2 (a GOAWAY's last-stream-id).
    last_stream_id: u32,
    streams: Streams,
    ledger: Ledger,
    /// Payload bytes of a dropped frame still to discard.
    drop_left: usize,
    /// SETTINGS and WINDOW_UPDATE frames so far (rate-limited by the layer, `floods`).
    counts: FrameCounts,
}

impl FrameFilter {
    pub fn new(limits: FrontLimits) -> Self {
        let mut decoder = loona_hpack::Decoder::new();
        decoder.set_max_allowed_table_size(limits.header_table_size);
        let mut encoder = loona_hpack::Encoder::new();
        // h2's table: the default size (the layer never sends h2 a size update).
        encoder.set_max_table_size(super::limits::HEADER_TABLE_SIZE);
        FrameFilter {
            limits,
            raw: BytesMut::with_capacity(16 * 1024),
            out: BytesMut::new(),
            preface_left: PREFACE_LEN,
            passthrough_left: 0,
            pending: None,
            decoder,
            encoder,
            rewrites: 0,
            last_stream_id: 0,
            streams: Streams::default(),
            ledger: Ledger::default(),
            drop_left: 0,
            counts: FrameCounts::default(),
        }
    }

    /// Charges this connection's frames to the memory account (`ledger`).
    pub fn set_ledger(&mut self, ledger: Ledger) {
        self.ledger = ledger;
    }

    pub fn ledger_mut(&mut self) -> &mut Ledger {
        &mut self.ledger
    }

    /// Where bytes read from the connection go.
    pub fn input(&mut self) -> &mut BytesMut {
        &mut self.raw
    }

    /// Bytes ready for h2 (take them with `split_to`).
    pub fn output(&mut self) -> &mut BytesMut {
        &mut self.out
    }

    /// Payload bytes of a pass-through frame that may be read straight into h2's buffer (nothing
    /// is buffered ahead of them); 0 otherwise.
    pub fn direct_read_room(&self) -> usize {
        if self.raw.is_empty() && self.out.is_empty() && self.preface_left == 0 {
            self.passthrough_left
        } else {
            0
        }
    }

    /// `bytes` were read straight into h2's buffer (at most `direct_read_room`).
    pub fn consumed_direct(&mut self, bytes: &[u8]) -> Result<(), Violation> {
        self.passthrough_left -= bytes.len().min(self.passthrough_left);
        self.ledger
            .client_payload(bytes)
            .map_err(|_| Violation::MemoryResets)
    }

    /// Authority values rewritten or dropped so far.
    pub fn rewrites(&self) -> u64 {
        self.rewrites
    }

    pub fn last_stream_id(&self) -> u32 {
        self.last_stream_id
    }

    pub fn streams(&self) -> &Streams {
        &self.streams
    }

    pub fn streams_mut(&mut self) -> &mut Streams {
        &mut self.streams
    }

    pub fn counts(&self) -> FrameCounts {
        self.counts
    }

    /// Moves what can be processed from `input` to `output`.
    pub fn process(&mut self) -> Result<(), Violation> {
        if self.preface_left > 0 {
            let n = self.preface_left.min(self.raw.len());
            self.out.extend_from_slice(&self.raw.split_to(n));
            self.preface_left -= n;
            if self.preface_left > 0 {
                return Ok(());
            }
        }
        loop {
            if self.passthrough_left > 0 {
                let n = self.passthrough_left.min(self.raw.len());
                let bytes = self.raw.split_to(n);
                self.ledger
                    .client_payload(&bytes)
                    .map_err(|_| Violation::MemoryResets)?;
                self.out.extend_from_slice(&bytes);
                self.passthrough_left -= n;
                if self.passthrough_left > 0 {
                    return Ok(());
                }
            }
            if self.drop_left > 0 {
                let n = self.drop_left.min(self.raw.len());
                self.raw.advance(n);
                self.drop_left -= n;
                if self.drop_left > 0 {
                    return Ok(());
                }
            }
            // Between two frames towards h2: the streams the ledger reset end here for h2.
            for (stream_id, reset) in self.ledger.take_inbound_resets() {
                self.streams.client_frame(TYPE_RST_STREAM, 0, stream_id);
                self.out.extend_from_slice(&reset);
            }
            if self.raw.len() < FRAME_HEADER_LEN {
                return Ok(());
            }
            let len = u32::from_be_bytes([0, self.raw[0], self.raw[1], self.raw[2]]) as usize;
            let (kind, flags) = (self.raw[3], self.raw[4]);
            let stream_id =
                u32::from_be_bytes([self.raw[5], self.raw[6], self.raw[7], self.raw[8]])
                    & 0x7fff_ffff;
            // Checked on the header alone: an oversized frame is never buffered.
            if len > self.limits.max_frame_size {
                return Err(Violation::FrameTooLarge);
            }
            if kind == TYPE_PUSH_PROMISE {
                // Only servers push (RFC 9113 §8.4); its header block would bypass the bounds.
                return Err(Violation::Protocol);
            }
            if kind != TYPE_HEADERS && kind != TYPE_CONTINUATION {
                if self.pending.is_some() {
                    // RFC 9113 §6.10: nothing may interrupt a header block.
                    return Err(Violation::Protocol);
                }
                let verdict = self
                    .ledger
                    .client_frame(kind, flags, stream_id, len)
                    .map_err(|_| Violation::MemoryResets)?;
                if verdict == Verdict::Drop {
                    self.raw.advance(FRAME_HEADER_LEN);
                    self.drop_left = len;
                    continue;
                }
                self.streams.client_frame(kind, flags, stream_id);
                self.counts.client_frame(kind, flags);
                self.out
                    .extend_from_slice(&self.raw.split_to(FRAME_HEADER_LEN));
                self.passthrough_left = len;
                continue;
            }
            if self.raw.len() < FRAME_HEADER_LEN + len {
                return Ok(());
            }
            self.raw.advance(FRAME_HEADER_LEN);
            let payload = self.raw.split_to(len);
            if kind == TYPE_HEADERS {
                self.start_block(stream_id, flags, &payload)?;
            } else {
                self.continue_block(stream_id, &payload)?;
            }
            if flags & FLAG_END_HEADERS != 0 {
                self.finish_block()?;
            }
        }
    }

    fn start_block(&mut self, stream_id: u32, flags: u8, payload: &[u8]) -> Result<(), Violation> {
        if self.pending.is_some() {
            return Err(Violation::Protocol);
        }
        let mut body = payload;
        if flags & FLAG_PADDED != 0 {
            let (&pad, rest) = body.split_first().ok_or(Violation::Protocol)?;
            let keep = rest
                .len()
                .checked_sub(pad as usize)
                .ok_or(Violation::Protocol)?;
            body = &rest[..keep];
        }
        let priority = if flags & FLAG_PRIORITY != 0 {
            let (p, rest) = body.split_first_chunk::<5>().ok_or(Violation::Protocol)?;
            body = rest;
            Some(*p)
        } else {
            None
        };
        if body.len() > self.limits.max_header_block_bytes {
            return Err(Violation::HeaderBlockTooLarge);
        }
        self.pending = Some(PendingBlock {
            stream_id,
            flags: flags & (FLAG_END_STREAM | FLAG_PRIORITY),
            priority,
            fragments: body.to_vec(),
            continuations: 0,
        });
        Ok(())
    }

    fn continue_block(&mut self, stream_id: u32, payload: &[u8]) -> Result<(), Violation> {
        let block = self
            .pending
            .as_mut()
            .filter(|b| b.stream_id == stream_id)
            .ok_or(Violation::Protocol)?;
        block.continuations += 1;
        if block.continuations > self.limits.max_continuation_frames {
            return Err(Violation::TooManyContinuations);
        }
        if block.fragments.len() + payload.len() > self.limits.max_header_block_bytes {
            return Err(Violation::HeaderBlockTooLarge);
        }
        block.fragments.extend_from_slice(payload);
        Ok(())
    }

    /// Decodes the collected block, fixes `:authority`, re-encodes it and emits HEADERS (+
    /// CONTINUATION frames when it does not fit one frame).
    fn finish_block(&mut self) -> Result<(), Violation> {
        let Some(block) = self.pending.take() else {
            return Ok(());
        };
        let decoded = decode_block(&mut self.decoder, &block.fragments, &self.limits)?;
        let headers = self.fix_authority(decoded);
        if self.ledger.client_headers(block.stream_id, block.flags) == Verdict::Drop {
            // A stream the ledger reset: h2 has forgotten it (the block still went through the
            // HPACK table, which the client's next blocks rely on).
            return Ok(());
        }
        let encoded = self
            .encoder
            .encode(headers.iter().map(|(n, v)| (n.as_slice(), v.as_slice())));
        self.emit_block(&block, &encoded);
        self.last_stream_id = self.last_stream_id.max(block.stream_id);
        self.streams
            .client_frame(TYPE_HEADERS, block.flags, block.stream_id);
        Ok(())
    }

    fn fix_authority(&mut self, decoded: HeaderList) -> HeaderList {
        let mut headers = HeaderList::with_capacity(decoded.len());
        for (name, value) in decoded {
            if name != b":authority" {
                headers.push((name, value));
                continue;
            }
            match super::acceptable_authority(&value) {
                Some(fixed) if fixed == value => headers.push((name, value)),
                Some(fixed) => {
                    self.rewrites += 1;
                    headers.push((name, fixed));
                }
                None => self.rewrites += 1,
            }
        }
        headers
    }

    fn emit_block(&mut self, block: &PendingBlock, encoded: &[u8]) {
        let priority: &[u8] = match &block.priority {
            Some(p) => p,
            None => &[],
        };
        let first_room = MAX_EMITTED_FRAME - priority.len();
        let (first, mut rest) = encoded.split_at(encoded.len().min(first_room));
        let end_headers = if rest.is_empty() { FLAG_END_HEADERS } else { 0 };
        self.put_frame_header(
            priority.len() + first.len(),
            TYPE_HEADERS,
            block.flags | end_headers,
            block.stream_id,
        );
        self.out.extend_from_slice(priority);
        self.out.extend_from_slice(first);
        while !rest.is_empty() {
            let (chunk, tail) = rest.split_at(rest.len().min(MAX_EMITTED_FRAME));
            let end_headers = if tail.is_empty() { FLAG_END_HEADERS } else { 0 };
            self.put_frame_header(chunk.len(), TYPE_CONTINUATION, end_headers, block.stream_id);
            self.out.extend_from_slice(chunk);
            rest = tail;
        }
    }

    fn put_frame_header(&mut self, len: usize, kind: u8, flags: u8, stream_id: u32) {
        let len = len as u32;
        self.out.put_slice(&len.to_be_bytes()[1..]);
        self.out.put_u8(kind);
        self.out.put_u8(flags);
        self.out.put_u32(stream_id);
    }
}

/// A GOAWAY frame (RFC 9113 §6.8) with `debug` as its debug data.
pub fn goaway_frame(last_stream_id: u32, error_code: u32, debug: &[u8]) -> Vec<u8> {
    let len = (8 + debug.len()) as u32;
    let mut out = len.to_be_bytes()[1..].to_vec();
    out.extend([0x7, 0]);
    out.extend(0u32.to_be_bytes());
    out.extend((last_stream_id & 0x7fff_ffff).to_be_bytes());
    out.extend(error_code.to_be_bytes());
    out.extend_from_slice(debug);
    out
}

/// An empty SETTINGS frame: the server connection preface, when h2 has not written its own.
pub const EMPTY_SETTINGS: [u8; 9] = [0, 0, 0, 0x4, 0, 0, 0, 0, 0];

#[cfg(test)]
#[path = "frames_tests.rs"]
pub(crate) mod tests;
