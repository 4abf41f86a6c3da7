//! Which HTTP/2 streams of one connection are open, seen from the frame headers both ways, so the
//! layer can tell an idle connection (no open stream) from a quiet one (a stream waiting for a
//! slow upstream sends nothing for minutes). And the frame boundaries of h2's outbound bytes, so a
//! GOAWAY the layer writes never lands inside one of h2's frames. Values only: no I/O.

use std::collections::HashMap;

/// Frame types and flags read here.
pub const TYPE_DATA: u8 = 0x0;
pub const TYPE_HEADERS: u8 = 0x1;
pub const TYPE_RST_STREAM: u8 = 0x3;
pub const FLAG_END_STREAM: u8 = 0x1;
pub const FRAME_HEADER_LEN: usize = 9;

/// Streams tracked before the connection is treated as never idle. h2 refuses streams past
/// SETTINGS_MAX_CONCURRENT_STREAMS with RST_STREAM (which removes them here), so only a peer
/// half-closing thousands of streams without ever ending them reaches it; it then simply is not
/// closed for idleness (keepalive pings still watch it).
const MAX_TRACKED_STREAMS: usize = 8_192;

const CLIENT_DONE: u8 = 1;
const SERVER_DONE: u8 = 2;

/// The open streams of one connection.
#[derive(Debug, Default)]
pub struct Streams {
    /// Stream id -> which sides have ended it.
    open: HashMap<u32, u8>,
    highest_client: u32,
    /// Streams opened so far (an idle timer restarts when this moves).
    opened: u64,
    untracked: bool,
}

impl Streams {
    /// No stream open (and tracking not given up).
    pub fn is_idle(&self) -> bool {
        !self.untracked && self.open.is_empty()
    }

    /// Streams the client has opened on this connection.
    pub fn opened(&self) -> u64 {
        self.opened
    }

    /// A client frame header (HEADERS once its block is complete).
    pub fn client_frame(&mut self, kind: u8, flags: u8, stream_id: u32) {
        let end = flags & FLAG_END_STREAM != 0;
        match kind {
            TYPE_HEADERS if stream_id > self.highest_client && stream_id % 2 == 1 => {
                self.highest_client = stream_id;
                self.opened += 1;
                if self.open.len() >= MAX_TRACKED_STREAMS {
                    self.untracked = true;
                    return;
                }
                self.open.insert(stream_id, 0);
                if end {
                    self.end(stream_id, CLIENT_DONE);
                }
            }
            TYPE_HEADERS | TYPE_DATA if end => self.end(stream_id, CLIENT_DONE),
            TYPE_RST_STREAM => {
                self.open.remove(&stream_id);
            }
            _ => {}
        }
    }

    /// A frame header h2 wrote.
    pub fn server_frame(&mut self, kind: u8, flags: u8, stream_id: u32) {
        match kind {
            TYPE_HEADERS | TYPE_DATA if flags & FLAG_END_STREAM != 0 => {
                self.end(stream_id, SERVER_DONE)
            }
            TYPE_RST_STREAM => {
                self.open.remove(&stream_id);
            }
            _ => {}
        }
    }

    fn end(&mut self, stream_id: u32, side: u8) {
        if let Some(done) = self.open.get_mut(&stream_id) {
            *done |= side;
            if *done == CLIENT_DONE | SERVER_DONE {
                self.open.remove(&stream_id);
            }
        }
    }
}

/// Where h2's outbound byte stream stands relative to its frames.
#[derive(Debug, Default)]
pub struct Outbound {
    head: [u8; FRAME_HEADER_LEN],
    head_len: usize,
    payload_left: usize,
    written: u64,
    sent: super::sent::SentFrames,
}

impl Outbound {
    /// Between two frames: a frame of the layer's own may go here.
    pub fn at_boundary(&self) -> bool {
        self.head_len == 0 && self.payload_left == 0
    }

    /// Nothing written yet (not even h2's SETTINGS, its connection preface).
    pub fn nothing_written(&self) -> bool {
        self.written == 0
    }

    /// Bytes h2 may still write before the next boundary (0 at a boundary).
    pub fn to_boundary(&self) -> usize {
        if self.head_len > 0 {
            FRAME_HEADER_LEN - self.head_len
        } else {
            self.payload_left
        }
    }

    /// h2's DATA and GOAWAY frames so far.
    pub fn sent(&mut self) -> &mut super::sent::SentFrames {
        &mut self.sent
    }

    /// Accounts for `bytes` that reached the connection, noting each complete frame header.
    pub fn advance(&mut self, mut bytes: &[u8], streams: &mut Streams) {
        self.written += bytes.len() as u64;
        while !bytes.is_empty() {
            if self.payload_left > 0 {
                let n = self.payload_left.min(bytes.len());
                self.payload_left -= n;
                self.sent.payload(&bytes[..n]);
                bytes = &bytes[n..];
                continue;
            }
            let n = (FRAME_HEADER_LEN - self.head_len).min(bytes.len());
            self.head[self.head_len..self.head_len + n].copy_from_slice(&bytes[..n]);
            self.head_len += n;
            bytes = &bytes[n..];
            if self.head_len == FRAME_HEADER_LEN {
                let h = self.head;
                self.head_len = 0;
                self.payload_left = u32::from_be_bytes([0, h[0], h[1], h[2]]) as usize;
                let stream_id = u32::from_be_bytes([h[5], h[6], h[7], h[8]]) & 0x7fff_ffff;
                streams.server_frame(h[3], h[4], stream_id);
                self.sent.header(h[3], self.payload_left);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(len: u32, kind: u8, flags: u8, id: u32) -> Vec<u8> {
        let mut h = len.to_be_bytes()[1..].to_vec();
        h.extend([kind, flags]);
        h.extend(id.to_be_bytes());
        h
    }

    #[test]
    fn a_stream_is_open_until_both_sides_end_it_or_either_resets_it() {
        let mut s = Streams::default();
        assert!(s.is_idle());
        s.client_frame(TYPE_HEADERS, 0, 1);
        s.client_frame(TYPE_DATA, FLAG_END_STREAM, 1);
        assert!(!s.is_idle());
        s.server_frame(TYPE_HEADERS, 0, 1);
        s.server_frame(TYPE_HEADERS, FLAG_END_STREAM, 1);
        assert!(s.is_idle());
        s.client_frame(TYPE_HEADERS, 0, 3);
        s.server_frame(TYPE_RST_STREAM, 0, 3);
        assert!(s.is_idle());
        s.client_frame(TYPE_HEADERS, 0, 5);
        s.client_frame(TYPE_RST_STREAM, 0, 5);
        assert!(s.is_idle());
        // Trailers for a finished stream, or even ids, open nothing.
        s.client_frame(TYPE_HEADERS, 0, 1);
        s.client_frame(TYPE_HEADERS, 0, 6);
        assert!(s.is_idle());
    }

    #[test]
    fn outbound_boundaries_follow_frames_split_anywhere() {
        let mut s = Streams::default();
        s.client_frame(TYPE_HEADERS, FLAG_END_STREAM, 1);
        let mut wire = header(3, TYPE_DATA, 0, 1);
        wire.extend([1, 2, 3]);
        wire.extend(header(0, TYPE_HEADERS, FLAG_END_STREAM, 1));
        let mut out = Outbound::default();
        assert!(out.nothing_written() && out.at_boundary());
        out.advance(&wire[..4], &mut s);
        assert_eq!(out.to_boundary(), 5);
        out.advance(&wire[4..10], &mut s);
        assert_eq!(out.to_boundary(), 2);
        out.advance(&wire[10..12], &mut s);
        assert!(out.at_boundary() && !s.is_idle());
        out.advance(&wire[12..], &mut s);
        assert!(out.at_boundary() && s.is_idle());
    }
}
