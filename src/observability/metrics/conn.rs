//! The connection metrics of the gRPC ports (`crate::transport::net`, `crate::transport::h2_authority`,
//! `crate::transport::lanes`). It only defines them; the connection code records.

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
    /// Every GOAWAY sent, the front layer's and h2's own, by error code and reason.
    pub goaways: IntCounterVec,
    pub tls_handshakes: IntCounterVec,
    pub tls_handshakes_waiting: IntGauge,
    pub tls_handshakes_in_progress: IntGauge,
    /// Handshakes refused by client authentication, by reason (`crate::transport::tls::Refusal`).
    pub tls_client_auth_refused: IntCounterVec,
    /// Open connections per connection thread of the ext_proc port (`crate::transport::lanes`); the lanes'
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
                         compression, protocol, settings_flood, window_update_flood, memory_resets)",
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
            goaways: register(
                registry,
                IntCounterVec::new(
                    Opts::new(
                        "kvpick_http2_goaways_sent_total",
                        "GOAWAY frames sent, by error code name and reason: a front-layer \
                         violation (as kvpick_connections_refused_total), idle \
                         (--http2-idle-timeout), or h2's own: h2_too_many_resets (rapid reset), \
                         h2_too_many_data_frames (empty DATA frames), \
                         h2_too_many_internal_resets, h2_header_list_way_too_large, \
                         h2_too_many_continuations, or h2 (protocol errors, graceful shutdown)",
                    ),
                    &["listener", "code", "reason"],
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
            tls_client_auth_refused: register(
                registry,
                IntCounterVec::new(
                    Opts::new(
                        "kvpick_tls_client_auth_refused_total",
                        "TLS handshakes refused by client authentication (--client-ca-path), by \
                         reason: no_certificate, untrusted, san_not_allowed",
                    ),
                    &["reason"],
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
