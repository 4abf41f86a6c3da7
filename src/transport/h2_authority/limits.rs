//! The bounds of the HTTP/2 front layer, in one place: the values the server advertises to h2's
//! peers (max frame size, header-list size, HPACK table size) and the ones the layer derives from
//! them (whole header block, CONTINUATION frames per block), plus the ways a connection can break
//! them ([`Violation`]: its metric label and its GOAWAY error code). It decides nothing itself.

use std::fmt;

/// SETTINGS_MAX_FRAME_SIZE the gRPC servers advertise (hyper's default, set explicitly on the
/// tonic builder from here): the largest frame a client may send.
pub const MAX_FRAME_SIZE: u32 = 16_384;

/// SETTINGS_HEADER_TABLE_SIZE of the servers (the HTTP/2 default; hyper does not change it): the
/// most the client's HPACK encoder may use, and the largest dynamic table size update it may send.
pub const HEADER_TABLE_SIZE: usize = 4_096;

/// Default SETTINGS_MAX_HEADER_LIST_SIZE (`--max-header-list-bytes`), hyper's server default.
pub const DEFAULT_MAX_HEADER_LIST_BYTES: usize = 16 * 1024;

/// Bounds of `--max-header-list-bytes`: gRPC's own headers need a few hundred bytes; past 1 MiB
/// one connection could again make the layer decode megabytes per block.
pub const MIN_MAX_HEADER_LIST_BYTES: usize = 1024;
pub const MAX_MAX_HEADER_LIST_BYTES: usize = 1 << 20;

/// The smallest bound on one encoded header block (all its fragments). An HPACK encoder never
/// needs more bytes than the decoded list (each entry costs 32 bytes in the list and at most a few
/// bytes of framing; Huffman is used only where it is shorter), so a block is bounded by
/// `max(64 KiB, header-list limit)`.
pub const MIN_MAX_HEADER_BLOCK_BYTES: usize = 64 * 1024;

/// The fewest CONTINUATION frames accepted per block. A maximal block (64 KiB) in frames of the
/// maximal size needs 3; real clients (Envoy's nghttp2/oghttp2, grpc-go, h2) split a block only at
/// the frame size, so a 16 KiB list needs at most 1. 8 allows a client splitting at half the frame
/// size and still stops a flood of empty CONTINUATION frames (which the block bound alone would
/// not). h2 itself allows 5 with its defaults.
pub const MIN_MAX_CONTINUATION_FRAMES: usize = 8;

/// Everything the layer enforces on one connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrontLimits {
    /// Largest frame payload accepted (FRAME_SIZE_ERROR past it).
    pub max_frame_size: usize,
    /// Largest decoded header list, RFC 7541 size: name + value + 32 per entry.
    pub max_header_list_bytes: usize,
    /// Largest encoded header block (HEADERS + CONTINUATION fragments, padding stripped).
    pub max_header_block_bytes: usize,
    /// Most CONTINUATION frames in one block.
    pub max_continuation_frames: usize,
    /// Largest dynamic table size update accepted (the advertised SETTINGS_HEADER_TABLE_SIZE).
    pub header_table_size: usize,
}

impl FrontLimits {
    /// The limits for a header-list bound; the others follow from it and the advertised settings.
    pub fn new(max_header_list_bytes: usize) -> Self {
        let max_frame_size = MAX_FRAME_SIZE as usize;
        let max_header_block_bytes = max_header_list_bytes.max(MIN_MAX_HEADER_BLOCK_BYTES);
        // Twice the frames a maximal block needs at the maximal frame size.
        let max_continuation_frames =
            (2 * max_header_block_bytes.div_ceil(max_frame_size)).max(MIN_MAX_CONTINUATION_FRAMES);
        FrontLimits {
            max_frame_size,
            max_header_list_bytes,
            max_header_block_bytes,
            max_continuation_frames,
            header_table_size: HEADER_TABLE_SIZE,
        }
    }
}

impl Default for FrontLimits {
    fn default() -> Self {
        FrontLimits::new(DEFAULT_MAX_HEADER_LIST_BYTES)
    }
}

/// HTTP/2 error codes (RFC 9113 §7) the layer sends in its GOAWAY.
pub mod code {
    pub const NO_ERROR: u32 = 0x0;
    pub const PROTOCOL_ERROR: u32 = 0x1;
    pub const FRAME_SIZE_ERROR: u32 = 0x6;
    pub const COMPRESSION_ERROR: u32 = 0x9;
    pub const ENHANCE_YOUR_CALM: u32 = 0xb;

    /// The `code` label of `kvpick_http2_goaways_sent_total` (a closed set).
    pub fn name(code: u32) -> &'static str {
        const NAMES: [&str; 14] = [
            "NO_ERROR",
            "PROTOCOL_ERROR",
            "INTERNAL_ERROR",
            "FLOW_CONTROL_ERROR",
            "SETTINGS_TIMEOUT",
            "STREAM_CLOSED",
            "FRAME_SIZE_ERROR",
            "REFUSED_STREAM",
            "CANCEL",
            "COMPRESSION_ERROR",
            "CONNECT_ERROR",
            "ENHANCE_YOUR_CALM",
            "INADEQUATE_SECURITY",
            "HTTP_1_1_REQUIRED",
        ];
        NAMES.get(code as usize).copied().unwrap_or("UNKNOWN")
    }
}

/// How a connection broke a limit or the protocol; the connection gets GOAWAY and is closed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Violation {
    /// A frame longer than the advertised SETTINGS_MAX_FRAME_SIZE.
    FrameTooLarge,
    /// A header block whose fragments together exceed the block bound.
    HeaderBlockTooLarge,
    /// More CONTINUATION frames in one block than allowed.
    TooManyContinuations,
    /// A decoded header list over `--max-header-list-bytes`.
    HeaderListTooLarge,
    /// A dynamic table size update that is not at the start of a block or exceeds the
    /// advertised table size.
    TableSizeUpdate,
    /// Any other HPACK decoding error.
    Compression,
    /// Framing the layer cannot pass on: an interrupted block, a CONTINUATION without its
    /// HEADERS, bad padding, a client PUSH_PROMISE.
    Protocol,
    /// More streams reset by the memory account (`ledger`) than a connection may keep open.
    MemoryResets,
    /// SETTINGS frames over `--http2-max-settings-per-second` (`floods`).
    SettingsFlood,
    /// WINDOW_UPDATE frames over their allowance (`floods`).
    WindowUpdateFlood,
}

impl Violation {
    pub const ALL: [Violation; 10] = [
        Violation::FrameTooLarge,
        Violation::HeaderBlockTooLarge,
        Violation::TooManyContinuations,
        Violation::HeaderListTooLarge,
        Violation::TableSizeUpdate,
        Violation::Compression,
        Violation::Protocol,
        Violation::MemoryResets,
        Violation::SettingsFlood,
        Violation::WindowUpdateFlood,
    ];

    /// The `reason` label of `kvpick_connections_refused_total` (a closed set).
    pub fn reason(self) -> &'static str {
        match self {
            Violation::FrameTooLarge => "frame_too_large",
            Violation::HeaderBlockTooLarge => "header_block_too_large",
            Violation::TooManyContinuations => "too_many_continuations",
            Violation::HeaderListTooLarge => "header_list_too_large",
            Violation::TableSizeUpdate => "table_size_update",
            Violation::Compression => "compression",
            Violation::Protocol => "protocol",
            Violation::MemoryResets => "memory_resets",
            Violation::SettingsFlood => "settings_flood",
            Violation::WindowUpdateFlood => "window_update_flood",
        }
    }

    /// The GOAWAY error code. The resource bounds use ENHANCE_YOUR_CALM, as h2 does for its own
    /// abuse limits (header list, CONTINUATION count); RFC 9113 mandates FRAME_SIZE_ERROR for a
    /// frame over the advertised size and COMPRESSION_ERROR for HPACK errors (RFC 7541 §4.2 for a
    /// misplaced or oversized table size update).
    pub fn error_code(self) -> u32 {
        match self {
            Violation::FrameTooLarge => code::FRAME_SIZE_ERROR,
            Violation::HeaderBlockTooLarge
            | Violation::TooManyContinuations
            | Violation::HeaderListTooLarge
            | Violation::MemoryResets
            | Violation::SettingsFlood
            | Violation::WindowUpdateFlood => code::ENHANCE_YOUR_CALM,
            Violation::TableSizeUpdate | Violation::Compression => code::COMPRESSION_ERROR,
            Violation::Protocol => code::PROTOCOL_ERROR,
        }
    }
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let what = match self {
            Violation::FrameTooLarge => "frame larger than SETTINGS_MAX_FRAME_SIZE",
            Violation::HeaderBlockTooLarge => "header block too large",
            Violation::TooManyContinuations => "too many CONTINUATION frames",
            Violation::HeaderListTooLarge => "header list larger than the limit",
            Violation::TableSizeUpdate => "misplaced or oversized HPACK table size update",
            Violation::Compression => "HPACK decoding error",
            Violation::Protocol => "HTTP/2 framing error",
            Violation::MemoryResets => "too many streams reset by the memory account",
            Violation::SettingsFlood => "SETTINGS frames over the rate limit",
            Violation::WindowUpdateFlood => "WINDOW_UPDATE frames over the allowance",
        };
        f.write_str(what)
    }
}

impl std::error::Error for Violation {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_follow_hyper_and_derive_block_and_continuation_bounds() {
        let l = FrontLimits::default();
        assert_eq!(l.max_frame_size, 16_384);
        assert_eq!(l.max_header_list_bytes, 16_384);
        assert_eq!(l.max_header_block_bytes, 65_536);
        assert_eq!(l.max_continuation_frames, 8);
        assert_eq!(l.header_table_size, 4_096);
        // A larger list limit grows the block bound and the frames it needs.
        let big = FrontLimits::new(256 * 1024);
        assert_eq!(big.max_header_block_bytes, 256 * 1024);
        assert_eq!(big.max_continuation_frames, 32);
    }

    #[test]
    fn every_violation_has_a_distinct_reason() {
        let reasons: std::collections::HashSet<_> =
            Violation::ALL.iter().map(|v| v.reason()).collect();
        assert_eq!(reasons.len(), Violation::ALL.len());
    }
}
