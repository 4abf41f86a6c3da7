//! One connection's share of the memory account (`crate::transport::memory_account`), kept by the front
//! layer because it sees every client frame before h2 does. Two things are charged:
//!
//! - **Unfinished gRPC messages.** The 5-byte prefix of each gRPC message is read from the
//!   stream's DATA payloads (padding skipped); the message's declared length is charged from
//!   its prefix until its last byte has gone to h2, because tonic reserves that much as soon as
//!   it reads the prefix. A length over the message limit is not charged: tonic refuses it
//!   (OUT_OF_RANGE) without reserving.
//! - **DATA bytes in h2.** Each DATA frame's flow-controlled length is charged before it goes to
//!   h2 and released as h2 credits the connection window back (its WINDOW_UPDATEs on stream 0,
//!   read from its outbound frames): what h2 holds in receive buffers, plus what it has handed
//!   on and not yet credited.
//!
//! A charge the account or the connection's share cannot cover resets the stream: the DATA
//! frame is dropped (and its bytes credited to the client's connection window by the layer), h2
//! gets a RST_STREAM(CANCEL) as if from the client at the next inbound frame boundary (so it and
//! tonic drop the stream's buffers at once), the client gets RST_STREAM(ENHANCE_YOUR_CALM), and
//! the stream's later frames are dropped. A connection holding more such streams than
//! [`MAX_RESET_STREAMS`] is closed with GOAWAY. Every charge is released when its message
//! completes or its stream ends (either side), and the rest when the connection ends (`Drop`).
//!
//! Values only, no I/O; it never looks at what a message means.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use crate::transport::memory_account::{Kind, MemoryAccount, Refusal};

use super::limits::code;
use super::streams::{FLAG_END_STREAM, FRAME_HEADER_LEN, TYPE_DATA, TYPE_HEADERS, TYPE_RST_STREAM};

const TYPE_WINDOW_UPDATE: u8 = 0x8;
const FLAG_PADDED: u8 = 0x8;
/// RST_STREAM code h2 gets for a stream the ledger resets (the client "cancelled" it).
const CANCEL: u32 = 0x8;
/// gRPC's length-prefixed message: compressed flag and a 4-byte big-endian length.
const GRPC_PREFIX: usize = 5;

/// Streams reset by the ledger whose client has not yet ended them; one more closes the
/// connection (GOAWAY ENHANCE_YOUR_CALM). Each costs a map entry here, and a client that keeps
/// sending on streams it was told to stop is not a gateway.
pub const MAX_RESET_STREAMS: usize = 256;

/// What a connection's ledger charges against, shared by all connections.
#[derive(Debug, Clone)]
pub struct LedgerConfig {
    pub account: Arc<MemoryAccount>,
    /// Most one connection may hold (`--connection-memory-bytes`).
    pub connection_bytes: usize,
    /// Messages longer than this are refused by tonic itself (`--max-ext-proc-message-bytes`).
    pub max_message_bytes: usize,
}

/// What the layer does with a client frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Pass it to h2.
    Pass,
    /// Drop it (header and payload): its stream was reset by the ledger.
    Drop,
}

/// Too many streams reset; the connection must be closed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TooManyResets;

/// A client stream's gRPC framing.
#[derive(Debug, Default)]
struct Stream {
    prefix: [u8; GRPC_PREFIX],
    prefix_len: usize,
    /// Bytes of the current message still to come after its prefix.
    message_left: usize,
    /// What the current message holds in the account.
    charged: usize,
}

/// The client DATA frame whose payload is passing to h2.
#[derive(Debug)]
struct DataFrame {
    stream_id: u32,
    /// Payload bytes still to pass (data and padding).
    left: usize,
    /// The pad-length byte is still to come.
    pad_len_next: bool,
    padding: usize,
    end_stream: bool,
}

/// Where h2's outbound bytes stand: a frame header being read, or a payload (the 4 bytes of a
/// connection-level WINDOW_UPDATE kept).
#[derive(Debug, Default)]
struct ServerFrames {
    head: [u8; FRAME_HEADER_LEN],
    head_len: usize,
    payload_left: usize,
    window: Option<([u8; 4], usize)>,
}

/// One connection's ledger (see the module doc). Inactive (charges nothing) without a config.
#[derive(Debug, Default)]
pub struct Ledger {
    config: Option<LedgerConfig>,
    streams: HashMap<u32, Stream>,
    highest_client: u32,
    /// Unfinished messages of this connection, in the account.
    partial: usize,
    /// DATA bytes given to h2 and not credited back, in the account.
    in_h2: usize,
    data: Option<DataFrame>,
    reset: HashSet<u32>,
    /// Streams h2 must be told are gone, at the next inbound frame boundary.
    inbound_resets: Vec<u32>,
    /// Frames for the client (RST_STREAM, WINDOW_UPDATE), written between h2's frames.
    to_client: Vec<u8>,
    server: ServerFrames,
}

impl Ledger {
    pub fn new(config: LedgerConfig) -> Self {
        let mut ledger = Ledger::default();
        ledger.config = Some(config);
        ledger
    }

    /// This connection's bytes in the account.
    pub fn held(&self) -> usize {
        self.partial + self.in_h2
    }

    /// Streams reset by the ledger and not yet ended by the client.
    pub fn reset_streams(&self) -> usize {
        self.reset.len()
    }

    pub fn has_frames_for_client(&self) -> bool {
        !self.to_client.is_empty()
    }

    /// Frames the layer must write to the client (take them all).
    pub fn to_client(&mut self) -> &mut Vec<u8> {
        &mut self.to_client
    }

    /// The streams h2 must now be told are gone, each with the RST_STREAM(CANCEL) that tells it.
    pub fn take_inbound_resets(&mut self) -> Vec<(u32, [u8; 13])> {
        self.inbound_resets
            .drain(..)
            .map(|id| (id, rst_stream_frame(id, CANCEL)))
            .collect()
    }

    /// A client header block is complete (HEADERS + CONTINUATION). `Drop` for a reset stream.
    pub fn client_headers(&mut self, stream_id: u32, flags: u8) -> Verdict {
        if self.config.is_none() {
            return Verdict::Pass;
        }
        if self.reset.contains(&stream_id) {
            if flags & FLAG_END_STREAM != 0 {
                self.reset.remove(&stream_id);
            }
            return Verdict::Drop;
        }
        if stream_id > self.highest_client && stream_id % 2 == 1 {
            self.highest_client = stream_id;
            self.streams.insert(stream_id, Stream::default());
        }
        if flags & FLAG_END_STREAM != 0 {
            self.end_stream(stream_id);
        }
        Verdict::Pass
    }

    /// A client frame header other than HEADERS / CONTINUATION, before any of it goes to h2.
    pub fn client_frame(
        &mut self,
        kind: u8,
        flags: u8,
        stream_id: u32,
        len: usize,
    ) -> Result<Verdict, TooManyResets> {
        self.data = None;
        if self.config.is_none() {
            return Ok(Verdict::Pass);
        }
        if stream_id != 0 && self.reset.contains(&stream_id) {
            if kind == TYPE_DATA && len > 0 {
                // h2 never sees these bytes, so the layer gives the client its window back.
                self.to_client.extend(window_update_frame(0, len as u32));
            }
            let ended =
                kind == TYPE_RST_STREAM || (kind == TYPE_DATA && flags & FLAG_END_STREAM != 0);
            if ended {
                self.reset.remove(&stream_id);
            }
            return Ok(Verdict::Drop);
        }
        match kind {
            TYPE_RST_STREAM => self.end_stream(stream_id),
            TYPE_DATA => return self.data_frame(flags, stream_id, len),
            _ => {}
        }
        Ok(Verdict::Pass)
    }

    fn data_frame(
        &mut self,
        flags: u8,
        stream_id: u32,
        len: usize,
    ) -> Result<Verdict, TooManyResets> {
        if len > 0 {
            if let Err(why) = self.charge(Kind::Http2Buffered, len) {
                self.reset_stream(stream_id, why)?;
                self.to_client.extend(window_update_frame(0, len as u32));
                return Ok(Verdict::Drop);
            }
            self.in_h2 += len;
        }
        let end_stream = flags & FLAG_END_STREAM != 0;
        if len == 0 {
            if end_stream {
                self.end_stream(stream_id);
            }
            return Ok(Verdict::Pass);
        }
        self.data = Some(DataFrame {
            stream_id,
            left: len,
            pad_len_next: flags & FLAG_PADDED != 0,
            padding: 0,
            end_stream,
        });
        Ok(Verdict::Pass)
    }

    /// Payload bytes of the current frame passing to h2 (all of them, in order).
    pub fn client_payload(&mut self, mut bytes: &[u8]) -> Result<(), TooManyResets> {
        let Some(stream_id) = self.data.as_ref().map(|f| f.stream_id) else {
            return Ok(());
        };
        let mut refused = None;
        while !bytes.is_empty() {
            let Some(frame) = self.data.as_mut().filter(|f| f.left > 0) else {
                break;
            };
            if frame.pad_len_next {
                frame.pad_len_next = false;
                frame.padding = bytes[0] as usize;
                frame.left -= 1;
                bytes = &bytes[1..];
                continue;
            }
            let data_left = frame.left.saturating_sub(frame.padding);
            if data_left == 0 {
                let skip = frame.left.min(bytes.len());
                frame.left -= skip;
                bytes = &bytes[skip..];
                continue;
            }
            let n = data_left.min(bytes.len());
            frame.left -= n;
            let (data, rest) = bytes.split_at(n);
            bytes = rest;
            if refused.is_none() {
                refused = self.messages(stream_id, data).err();
            }
        }
        let finished = self.data.take_if(|f| f.left == 0);
        if let Some(why) = refused {
            // The rest of this frame still goes to h2 (its header has); h2 learns at the next
            // frame boundary that the stream is gone.
            self.reset_stream(stream_id, why)?;
        } else if finished.is_some_and(|f| f.end_stream) {
            self.end_stream(stream_id);
        }
        Ok(())
    }

    /// Reads gRPC framing from a stream's data bytes; `Err` when a new message cannot be charged.
    fn messages(&mut self, stream_id: u32, mut data: &[u8]) -> Result<(), Refusal> {
        while !data.is_empty() {
            let Some(stream) = self.streams.get_mut(&stream_id) else {
                return Ok(());
            };
            if stream.message_left > 0 {
                let n = stream.message_left.min(data.len());
                stream.message_left -= n;
                data = &data[n..];
                if stream.message_left == 0 {
                    let done = std::mem::take(&mut stream.charged);
                    self.release(Kind::PartialMessage, done);
                }
                continue;
            }
            let n = (GRPC_PREFIX - stream.prefix_len).min(data.len());
            stream.prefix[stream.prefix_len..stream.prefix_len + n].copy_from_slice(&data[..n]);
            stream.prefix_len += n;
            data = &data[n..];
            if stream.prefix_len < GRPC_PREFIX {
                return Ok(());
            }
            stream.prefix_len = 0;
            let p = stream.prefix;
            let declared = u32::from_be_bytes([p[1], p[2], p[3], p[4]]) as usize;
            stream.message_left = declared;
            let limit = self.config.as_ref().map_or(0, |c| c.max_message_bytes);
            if declared == 0 || declared > limit {
                continue;
            }
            self.charge(Kind::PartialMessage, declared)?;
            self.partial += declared;
            if let Some(stream) = self.streams.get_mut(&stream_id) {
                stream.charged = declared;
            }
        }
        Ok(())
    }

    /// Charges `n` bytes against the connection's share and the account.
    fn charge(&mut self, kind: Kind, n: usize) -> Result<(), Refusal> {
        let Some(config) = &self.config else {
            return Ok(());
        };
        if self.partial + self.in_h2 + n > config.connection_bytes {
            return Err(Refusal::ConnectionShare);
        }
        if !config.account.try_charge(kind, n) {
            return Err(Refusal::Account);
        }
        Ok(())
    }

    fn release(&mut self, kind: Kind, n: usize) {
        if n == 0 {
            return;
        }
        if kind == Kind::PartialMessage {
            self.partial -= n;
        }
        if let Some(config) = &self.config {
            config.account.release(kind, n);
        }
    }

    /// The stream is over for the ledger: its unfinished message is released.
    fn end_stream(&mut self, stream_id: u32) {
        if let Some(stream) = self.streams.remove(&stream_id) {
            self.release(Kind::PartialMessage, stream.charged);
        }
    }

    fn reset_stream(&mut self, stream_id: u32, why: Refusal) -> Result<(), TooManyResets> {
        let Some(account) = self.config.as_ref().map(|c| Arc::clone(&c.account)) else {
            return Ok(());
        };
        account.refused(why);
        tracing::debug!(
            stream_id,
            reason = why.label(),
            "memory account: stream reset"
        );
        self.end_stream(stream_id);
        self.inbound_resets.push(stream_id);
        self.to_client
            .extend(rst_stream_frame(stream_id, code::ENHANCE_YOUR_CALM));
        self.reset.insert(stream_id);
        if self.reset.len() > MAX_RESET_STREAMS {
            account.refused(Refusal::TooManyResets);
            return Err(TooManyResets);
        }
        Ok(())
    }

    /// Bytes h2 wrote to the client: its stream ends release their messages, its connection
    /// WINDOW_UPDATEs release DATA bytes.
    pub fn server_bytes(&mut self, mut bytes: &[u8]) {
        if self.config.is_none() {
            return;
        }
        while !bytes.is_empty() {
            let s = &mut self.server;
            if s.payload_left > 0 {
                let n = s.payload_left.min(bytes.len());
                if let Some((buf, got)) = s.window.as_mut() {
                    let take = n.min(4 - *got);
                    buf[*got..*got + take].copy_from_slice(&bytes[..take]);
                    *got += take;
                }
                s.payload_left -= n;
                bytes = &bytes[n..];
                if s.payload_left == 0 {
                    if let Some((buf, 4)) = s.window.take() {
                        let increment = u32::from_be_bytes(buf) & 0x7fff_ffff;
                        let credited = (increment as usize).min(self.in_h2);
                        self.in_h2 -= credited;
                        self.release(Kind::Http2Buffered, credited);
                    }
                }
                continue;
            }
            let n = (FRAME_HEADER_LEN - s.head_len).min(bytes.len());
            s.head[s.head_len..s.head_len + n].copy_from_slice(&bytes[..n]);
            s.head_len += n;
            bytes = &bytes[n..];
            if s.head_len < FRAME_HEADER_LEN {
                continue;
            }
            s.head_len = 0;
            let h = s.head;
            let len = u32::from_be_bytes([0, h[0], h[1], h[2]]) as usize;
            let (kind, flags) = (h[3], h[4]);
            let stream_id = u32::from_be_bytes([h[5], h[6], h[7], h[8]]) & 0x7fff_ffff;
            s.payload_left = len;
            s.window =
                (kind == TYPE_WINDOW_UPDATE && stream_id == 0 && len == 4).then_some(([0; 4], 0));
            let ends = kind == TYPE_RST_STREAM
                || ((kind == TYPE_HEADERS || kind == TYPE_DATA) && flags & FLAG_END_STREAM != 0);
            if ends && stream_id != 0 {
                self.end_stream(stream_id);
            }
        }
    }
}

impl Drop for Ledger {
    fn drop(&mut self) {
        let partial = std::mem::take(&mut self.partial);
        let in_h2 = std::mem::take(&mut self.in_h2);
        if let Some(config) = &self.config {
            config.account.release(Kind::PartialMessage, partial);
            config.account.release(Kind::Http2Buffered, in_h2);
        }
    }
}

/// RST_STREAM (RFC 9113 §6.4).
pub fn rst_stream_frame(stream_id: u32, error_code: u32) -> [u8; 13] {
    let mut f = [0u8; 13];
    f[..5].copy_from_slice(&[0, 0, 4, TYPE_RST_STREAM, 0]);
    f[5..9].copy_from_slice(&(stream_id & 0x7fff_ffff).to_be_bytes());
    f[9..].copy_from_slice(&error_code.to_be_bytes());
    f
}

/// WINDOW_UPDATE (RFC 9113 §6.9).
pub fn window_update_frame(stream_id: u32, increment: u32) -> [u8; 13] {
    let mut f = [0u8; 13];
    f[..5].copy_from_slice(&[0, 0, 4, TYPE_WINDOW_UPDATE, 0]);
    f[5..9].copy_from_slice(&(stream_id & 0x7fff_ffff).to_be_bytes());
    f[9..].copy_from_slice(&(increment & 0x7fff_ffff).to_be_bytes());
    f
}

#[cfg(test)]
#[path = "ledger_tests.rs"]
mod tests;
