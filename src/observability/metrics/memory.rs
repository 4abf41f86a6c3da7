//! The memory account's metrics (`crate::transport::memory_account`): bytes held by kind, the limit, and
//! what the account refused. It only defines them; the account records.

// Static metric definitions: an error is a programming error every test run hits at start-up.
#![allow(clippy::unwrap_used)]

use prometheus::{IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry};

use super::register;

#[derive(Clone)]
pub struct MemoryMetrics {
    /// Bytes charged now, by kind (`body`, `partial_message`, `http2_buffered`).
    pub bytes: IntGaugeVec,
    /// `--memory-account-bytes`.
    pub limit: IntGauge,
    /// Streams reset and connections closed by the account, by reason.
    pub refused: IntCounterVec,
}

impl MemoryMetrics {
    pub(super) fn register(registry: &Registry) -> Self {
        MemoryMetrics {
            bytes: register(
                registry,
                IntGaugeVec::new(
                    Opts::new(
                        "kvpick_memory_account_bytes",
                        "Bytes clients make kvpick hold, by kind: body (request bodies buffered \
                         by ext_proc streams), partial_message (gRPC messages begun and not \
                         finished, at their declared length), http2_buffered (DATA bytes the \
                         HTTP/2 layer holds and has not credited back)",
                    ),
                    &["kind"],
                )
                .unwrap(),
            ),
            limit: register(
                registry,
                IntGauge::new(
                    "kvpick_memory_account_limit_bytes",
                    "The memory account's limit (--memory-account-bytes)",
                )
                .unwrap(),
            ),
            refused: register(
                registry,
                IntCounterVec::new(
                    Opts::new(
                        "kvpick_memory_account_refused_total",
                        "What the memory account refused, by reason: account (a stream reset, \
                         --memory-account-bytes full), connection_share (a stream reset, its \
                         connection's --connection-memory-bytes full), too_many_resets (a \
                         connection closed with GOAWAY)",
                    ),
                    &["reason"],
                )
                .unwrap(),
            ),
        }
    }
}
