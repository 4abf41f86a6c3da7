//! The memory account: one process-wide count of the bytes clients make kvpick hold, by kind,
//! against one limit (`--memory-account-bytes`). Request bodies buffered by ext_proc streams
//! (`extproc::budget`, which also keeps its own `--max-buffered-body-bytes`), unfinished gRPC
//! messages and the DATA bytes h2 holds for a connection (`h2_authority::ledger`) are charged
//! here. Lock-free (atomics), shared by every connection lane and runtime. It only counts and
//! refuses; what a refusal does (a 503, a reset stream, a GOAWAY) belongs to whoever charged.
//! Also the flags of these bounds (`MemoryArgs`) and the ext_proc message limit derived from
//! them. The worst-case arithmetic is in docs/security.md ("Memory account").

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use anyhow::bail;
use prometheus::{IntCounterVec, IntGauge};

use crate::observability::metrics::MemoryMetrics;

/// Default of `--memory-account-bytes`.
pub const DEFAULT_ACCOUNT_BYTES: usize = 1 << 30;
/// Default of `--connection-memory-bytes`.
pub const DEFAULT_CONNECTION_BYTES: usize = 256 << 20;

/// Room a message needs beyond the body bytes it carries. Envoy's largest `ProcessingRequest` is
/// a `request_body` holding a whole body: BUFFERED mode sends the body in one message once it is
/// complete (a body over Envoy's buffer limit gets 413 from Envoy), BUFFERED_PARTIAL sends at
/// most the buffer limit, STREAMED and FULL_DUPLEX_STREAMED send each chunk as it arrives. For
/// kvpick to route a body, it must be at most `--max-body-bytes`, so a message is at most that
/// plus the message's own fields: protobuf framing (a few bytes), `metadata_context`,
/// `attributes`. A `request_headers` message carries the request headers, which Envoy bounds at
/// `max_request_headers_kb` (60 KiB by default). 1 MiB covers either many times over.
pub const MESSAGE_HEADROOM_BYTES: usize = 1 << 20;

/// The default of `--max-ext-proc-message-bytes`: the largest body kvpick accepts plus
/// [`MESSAGE_HEADROOM_BYTES`].
pub fn max_message_bytes(max_body_bytes: usize) -> usize {
    max_body_bytes
        .saturating_add(MESSAGE_HEADROOM_BYTES)
        .min(u32::MAX as usize)
}

/// What a charge holds (the `kind` label of `kvpick_memory_account_bytes`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Request-body bytes an ext_proc stream keeps until routing, and their echo.
    Body,
    /// gRPC messages begun and not finished, at their declared length: tonic reserves that much
    /// as soon as it reads the 5-byte prefix.
    PartialMessage,
    /// DATA bytes handed to h2 that h2 has not given back to the client's connection window
    /// (h2's receive buffers and what tonic has taken but h2 not yet credited).
    Http2Buffered,
}

impl Kind {
    pub const ALL: [Kind; 3] = [Kind::Body, Kind::PartialMessage, Kind::Http2Buffered];

    pub fn label(self) -> &'static str {
        match self {
            Kind::Body => "body",
            Kind::PartialMessage => "partial_message",
            Kind::Http2Buffered => "http2_buffered",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// Why the account made kvpick drop something (the `reason` label of
/// `kvpick_memory_account_refused_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// A stream reset: its charge would pass `--memory-account-bytes`.
    Account,
    /// A stream reset: its charge would pass its connection's `--connection-memory-bytes`.
    ConnectionShare,
    /// A connection sent GOAWAY: more streams reset by the account than it may keep reset.
    TooManyResets,
}

impl Refusal {
    pub const ALL: [Refusal; 3] = [
        Refusal::Account,
        Refusal::ConnectionShare,
        Refusal::TooManyResets,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Refusal::Account => "account",
            Refusal::ConnectionShare => "connection_share",
            Refusal::TooManyResets => "too_many_resets",
        }
    }
}

/// The process-wide account (see the module doc).
#[derive(Debug)]
pub struct MemoryAccount {
    limit: usize,
    used: AtomicUsize,
    by_kind: [AtomicUsize; 3],
    gauges: [IntGauge; 3],
    refused: Option<IntCounterVec>,
}

impl MemoryAccount {
    /// An account of `limit` bytes reporting to `metrics`.
    pub fn new(limit: usize, metrics: &MemoryMetrics) -> Arc<Self> {
        metrics.limit.set(i64::try_from(limit).unwrap_or(i64::MAX));
        Arc::new(MemoryAccount {
            limit,
            used: AtomicUsize::new(0),
            by_kind: Default::default(),
            gauges: Kind::ALL.map(|k| metrics.bytes.with_label_values(&[k.label()])),
            refused: Some(metrics.refused.clone()),
        })
    }

    /// An account reporting to gauges nobody exports (tests, fuzzing, a budget on its own).
    // Constant, valid metric names: `new` cannot fail here.
    #[allow(clippy::expect_used)]
    pub fn unmetered(limit: usize) -> Arc<Self> {
        let gauge = || IntGauge::new("kvpick_memory_account_bytes", "unexported").expect("valid");
        Arc::new(MemoryAccount {
            limit,
            used: AtomicUsize::new(0),
            by_kind: Default::default(),
            gauges: [gauge(), gauge(), gauge()],
            refused: None,
        })
    }

    pub fn limit(&self) -> usize {
        self.limit
    }

    /// Bytes charged now, all kinds.
    pub fn used(&self) -> usize {
        self.used.load(Ordering::Acquire)
    }

    /// Bytes charged now as `kind`.
    pub fn used_by(&self, kind: Kind) -> usize {
        self.by_kind[kind.index()].load(Ordering::Acquire)
    }

    /// Charges `n` bytes of `kind`, or nothing (`false`) when the account cannot cover them.
    pub fn try_charge(&self, kind: Kind, n: usize) -> bool {
        if n == 0 {
            return true;
        }
        let taken = self
            .used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(n).filter(|&total| total <= self.limit)
            })
            .is_ok();
        if taken {
            self.by_kind[kind.index()].fetch_add(n, Ordering::AcqRel);
            self.gauges[kind.index()].add(n as i64);
        }
        taken
    }

    /// Gives back `n` bytes of `kind` charged earlier.
    pub fn release(&self, kind: Kind, n: usize) {
        if n == 0 {
            return;
        }
        self.used.fetch_sub(n, Ordering::AcqRel);
        self.by_kind[kind.index()].fetch_sub(n, Ordering::AcqRel);
        self.gauges[kind.index()].sub(n as i64);
    }

    /// Counts one refusal.
    pub fn refused(&self, why: Refusal) {
        if let Some(counter) = &self.refused {
            counter.with_label_values(&[why.label()]).inc();
        }
    }
}

/// The memory account's flags (`kvpick serve`).
#[derive(Debug, Clone, clap::Args)]
#[command(next_help_heading = "Memory account")]
pub struct MemoryArgs {
    /// Bytes all clients together may make kvpick hold: request bodies buffered by ext_proc
    /// streams (within --max-buffered-body-bytes), gRPC messages begun and not finished (at the
    /// length their 5-byte prefix declares, which the gRPC layer reserves at once) and DATA
    /// bytes the HTTP/2 layer holds and has not credited back to the client. A body over it gets
    /// 503; a message or DATA frame over it has its stream reset (RST_STREAM ENHANCE_YOUR_CALM).
    /// Use: `kvpick_memory_account_bytes{kind}`; the worst case of the whole process is in
    /// docs/security.md.
    #[arg(long, default_value_t = DEFAULT_ACCOUNT_BYTES, value_name = "BYTES")]
    pub memory_account_bytes: usize,

    /// Most of the memory account one connection may hold in unfinished messages and HTTP/2
    /// buffers; a stream that would take its connection past it is reset (ENHANCE_YOUR_CALM), so
    /// one client cannot take the whole account. Envoy sends each message whole, so a gateway
    /// connection holds about one message in flight per busy stream.
    #[arg(long, default_value_t = DEFAULT_CONNECTION_BYTES, value_name = "BYTES")]
    pub connection_memory_bytes: usize,

    /// Largest gRPC message accepted from Envoy on the ext_proc port; a larger one ends its stream
    /// with OUT_OF_RANGE before anything is reserved for it. Default: --max-body-bytes + 1 MiB.
    /// Envoy's largest message is a `request_body` holding a whole body (BUFFERED mode; the other
    /// body modes send less), and kvpick routes no body over --max-body-bytes; the 1 MiB covers
    /// the message's own fields (framing, metadata, attributes) and a header message (Envoy's
    /// default header limit is 60 KiB). 1024..=4294967295.
    #[arg(long, value_name = "BYTES")]
    pub max_ext_proc_message_bytes: Option<usize>,
}

/// The checked values of [`MemoryArgs`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryLimits {
    pub account_bytes: usize,
    pub connection_bytes: usize,
    pub max_message_bytes: usize,
}

impl MemoryArgs {
    /// The limits, given `--max-body-bytes` (the message limit's default follows it).
    pub fn limits(&self, max_body_bytes: usize) -> anyhow::Result<MemoryLimits> {
        let max_message_bytes = self
            .max_ext_proc_message_bytes
            .unwrap_or_else(|| max_message_bytes(max_body_bytes));
        if !(1024..=u32::MAX as usize).contains(&max_message_bytes) {
            bail!(
                "--max-ext-proc-message-bytes must be 1024..=4294967295, got {max_message_bytes}"
            );
        }
        if self.memory_account_bytes == 0 || self.connection_memory_bytes == 0 {
            bail!("--memory-account-bytes and --connection-memory-bytes must be more than 0");
        }
        Ok(MemoryLimits {
            account_bytes: self.memory_account_bytes,
            connection_bytes: self.connection_memory_bytes,
            max_message_bytes,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charges_share_one_limit_across_kinds_and_come_back() {
        let account = MemoryAccount::unmetered(100);
        assert!(account.try_charge(Kind::Body, 60));
        assert!(
            !account.try_charge(Kind::PartialMessage, 41),
            "one past the limit"
        );
        assert!(
            account.try_charge(Kind::PartialMessage, 40),
            "exactly at it"
        );
        assert_eq!(account.used(), 100);
        assert_eq!(account.used_by(Kind::Body), 60);
        account.release(Kind::Body, 60);
        assert!(account.try_charge(Kind::Http2Buffered, 60));
        assert!(!account.try_charge(Kind::Body, usize::MAX), "no overflow");
        account.release(Kind::PartialMessage, 40);
        account.release(Kind::Http2Buffered, 60);
        assert_eq!(account.used(), 0);
    }

    #[test]
    fn the_message_limit_follows_the_body_limit_unless_set() {
        let args = |m: Option<usize>| MemoryArgs {
            memory_account_bytes: DEFAULT_ACCOUNT_BYTES,
            connection_memory_bytes: DEFAULT_CONNECTION_BYTES,
            max_ext_proc_message_bytes: m,
        };
        let l = args(None).limits(32 << 20).unwrap();
        assert_eq!(l.max_message_bytes, (32 << 20) + (1 << 20));
        assert_eq!(
            args(Some(4096)).limits(32 << 20).unwrap().max_message_bytes,
            4096
        );
        assert!(args(Some(1023)).limits(1).is_err());
        assert!(args(Some(1 << 32)).limits(1).is_err());
    }
}
