//! What h2 sent on a connection that the front layer accounts for: its DATA frames (credit for
//! the client's WINDOW_UPDATEs, `floods`) and its GOAWAY frames, read for their error code and
//! debug data so every GOAWAY kvpick sends is counted with a reason
//! (`kvpick_http2_goaways_sent_total`), h2's own (rapid reset, empty DATA frames, protocol errors,
//! graceful shutdown) as well as the layer's. Fed by `streams::Outbound` with h2's outbound frame
//! headers and payload bytes. Values only: no I/O; it never changes what is written.

use super::limits::code;

pub const TYPE_DATA: u8 = 0x0;
pub const TYPE_GOAWAY: u8 = 0x7;

/// GOAWAY payload bytes kept: last stream id, error code and enough debug data to recognise
/// h2's abuse reasons.
const KEPT: usize = 8 + 32;

/// The `reason` label of a GOAWAY h2 wrote, from its debug data: h2 0.4's abuse limits name
/// themselves there; anything else (protocol errors, graceful shutdown) is `h2`. A closed set.
pub fn h2_reason(debug: &[u8]) -> &'static str {
    match debug {
        b"too_many_resets" => "h2_too_many_resets",
        b"too_many_internal_resets" => "h2_too_many_internal_resets",
        b"too_many_data_frames" => "h2_too_many_data_frames",
        b"header_list_way_too_large" => "h2_header_list_way_too_large",
        b"too_many_continuations" => "h2_too_many_continuations",
        _ => "h2",
    }
}

/// A GOAWAY being written.
#[derive(Debug)]
struct Partial {
    kept: [u8; KEPT],
    len: usize,
    left: usize,
}

/// h2's frames of interest on one connection.
#[derive(Debug, Default)]
pub struct SentFrames {
    data_frames: u64,
    goaway: Option<Partial>,
    /// GOAWAYs fully written and not yet taken: (error code, reason label).
    done: Vec<(u32, &'static str)>,
}

impl SentFrames {
    /// DATA frames h2 wrote so far.
    pub fn data_frames(&self) -> u64 {
        self.data_frames
    }

    /// A frame header h2 wrote, with its payload length.
    pub fn header(&mut self, kind: u8, len: usize) {
        match kind {
            TYPE_DATA => self.data_frames += 1,
            TYPE_GOAWAY => {
                self.goaway = Some(Partial {
                    kept: [0; KEPT],
                    len: 0,
                    left: len,
                });
                if len == 0 {
                    self.finish();
                }
            }
            _ => {}
        }
    }

    /// Payload bytes of the frame whose header came last.
    pub fn payload(&mut self, bytes: &[u8]) {
        let Some(g) = &mut self.goaway else {
            return;
        };
        let keep = (KEPT - g.len).min(bytes.len());
        g.kept[g.len..g.len + keep].copy_from_slice(&bytes[..keep]);
        g.len += keep;
        g.left -= bytes.len().min(g.left);
        if g.left == 0 {
            self.finish();
        }
    }

    fn finish(&mut self) {
        let Some(g) = self.goaway.take() else {
            return;
        };
        let kept = &g.kept[..g.len];
        let error = match kept.get(4..8) {
            Some(&[a, b, c, d]) => u32::from_be_bytes([a, b, c, d]),
            _ => code::PROTOCOL_ERROR,
        };
        let debug = kept.get(8..).unwrap_or_default();
        self.done.push((error, h2_reason(debug)));
    }

    /// The GOAWAYs completed since the last call.
    pub fn take_goaways(&mut self) -> Vec<(u32, &'static str)> {
        std::mem::take(&mut self.done)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn goaways_are_read_across_split_writes_and_data_frames_counted() {
        let frame =
            super::super::frames::goaway_frame(7, code::ENHANCE_YOUR_CALM, b"too_many_resets");
        let payload = &frame[9..];
        let mut s = SentFrames::default();
        s.header(TYPE_DATA, 5);
        s.header(TYPE_GOAWAY, payload.len());
        s.payload(&payload[..3]);
        assert!(s.take_goaways().is_empty());
        s.payload(&payload[3..]);
        assert_eq!(
            s.take_goaways(),
            vec![(code::ENHANCE_YOUR_CALM, "h2_too_many_resets")]
        );
        s.header(TYPE_GOAWAY, 8);
        s.payload(&[0, 0, 0, 1, 0, 0, 0, 0]);
        assert_eq!(s.take_goaways(), vec![(code::NO_ERROR, "h2")]);
        // Debug data longer than kept is unknown: plain h2.
        s.header(TYPE_GOAWAY, 8 + 100);
        s.payload(&[0; 108]);
        assert_eq!(s.take_goaways(), vec![(code::NO_ERROR, "h2")]);
        assert_eq!(s.data_frames(), 1);
    }
}
