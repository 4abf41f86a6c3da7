//! The connection metrics of the gRPC ports (`crate::net`, `crate::h2_authority`,
//! `crate::lanes`). It only defines them; the connection code records.

// Static metric definitions: an error is a programming error every test run hits at start-up.
#![allow(clippy::unwrap_used)]

use prometheus::{IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry};

use super::register;

/// Connections on the gRPC ports (`net`, `h2_authority`): open, refused or closed by kvpick (by
/// a bounded reason: `connection_limit` or an HTTP/2 front-layer violation), closed idle, TLS
/// handshakes by result and waiting for a handshake slot. `listener` is `grpc` or `health`.
#[derive(Clone)]
pub struct ConnMetrics {
    pub open: IntGaugeVec,
    pub refused: IntCounterVec,
    pub idle_closed: IntCounterVec,
    pub tls_handshakes: IntCounterVec,
    pub tls_handshakes_waiting: IntGauge,
    pub tls_handshakes_in_progress: IntGauge,
    /// Open connections per connection thread of the ext_proc port (`crate::lanes`); the lanes'
    /// own load counts, read to choose a lane.
    pub thread_open: IntGaugeVec,
}

impl ConnMetrics {
    pub(super) fn register(registry: &Registry) -> Self {
        ConnMetrics {
            open: register(
                registry,
                IntGaugeVec::new(
                    Opts::new(
                        "kvpick_connections_open",
                        "Open connections per listener (TLS handshakes included)",
                    ),
                    &["listener"],
                )
                .unwrap(),
            ),
            refused: register(
                registry,
                IntCounterVec::new(
                    Opts::new(
                        "kvpick_connections_refused_total",
                        "Connections kvpick refused or closed for breaking a limit, by reason: \
                         connection_limit (--max-connections), or an HTTP/2 front-layer \
                         violation (frame_too_large, header_block_too_large, \
                         too_many_continuations, header_list_too_large, table_size_update, \
                         compression, protocol, memory_resets)",
                    ),
                    &["listener", "reason"],
                )
                .unwrap(),
            ),
            idle_closed: register(
                registry,
                IntCounterVec::new(
                    Opts::new(
                        "kvpick_connections_idle_closed_total",
                        "Connections closed after --http2-idle-timeout without an open stream",
                    ),
                    &["listener"],
                )
                .unwrap(),
            ),
            tls_handshakes: register(
                registry,
                IntCounterVec::new(
                    Opts::new(
                        "kvpick_tls_handshakes_total",
                        "TLS handshakes by result: ok, failed, timeout (--tls-handshake-timeout, \
                         waiting for a slot included)",
                    ),
                    &["result"],
                )
                .unwrap(),
            ),
            tls_handshakes_waiting: register(
                registry,
                IntGauge::new(
                    "kvpick_tls_handshakes_waiting",
                    "Accepted connections waiting for one of --max-concurrent-tls-handshakes",
                )
                .unwrap(),
            ),
            tls_handshakes_in_progress: register(
                registry,
                IntGauge::new(
                    "kvpick_tls_handshakes_in_progress",
                    "TLS handshakes holding one of --max-concurrent-tls-handshakes",
                )
                .unwrap(),
            ),
            thread_open: register(
                registry,
                IntGaugeVec::new(
                    Opts::new(
                        "kvpick_connection_thread_connections",
                        "Open ext_proc connections per connection thread (--connection-threads; \
                         a new connection goes to the thread holding the fewest)",
                    ),
                    &["thread"],
                )
                .unwrap(),
            ),
        }
    }
}
