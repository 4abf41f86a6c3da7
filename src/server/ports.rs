//! The three ports of `kvpick serve`: bound before anything serves (a taken port fails start-up
//! naming it), each served until the exit signal: the gRPC ports through the accept loop of
//! [`crate::transport::net`] (connection bounds, TLS, the HTTP/2 front layer) with tonic's HTTP/2 settings
//! from the same limits, `/metrics` over plain HTTP/1. Also the port file and the termination
//! signal.
//!
//! It must not decide which services a port carries (`entry` does) or when draining ends.

use std::net::{IpAddr, SocketAddr};

use anyhow::Context;
use axum::routing::get;
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::observability::metrics::Metrics;
use crate::transport::net::Listening;

use super::ServeArgs;

/// The listeners of the three ports, bound by `serve` from the flags or by the caller of
/// [`super::run`] (a test binds 127.0.0.1 port 0).
pub struct Listeners {
    /// ext_proc, gRPC health and the selection API (`--grpc-port`).
    pub grpc: TcpListener,
    /// gRPC health alone, never TLS (`--grpc-health-port`).
    pub health: TcpListener,
    /// `/metrics` over HTTP/1 (`--metrics-port`).
    pub metrics: TcpListener,
}

/// Where `serve` binds the three ports (`--bind` and the `--*-port` flags), owned so that the
/// binding can wait until start-up reaches it.
#[derive(Clone, Copy)]
pub(super) struct Addresses {
    ip: IpAddr,
    grpc: u16,
    health: u16,
    metrics: u16,
}

impl Addresses {
    pub fn of(args: &ServeArgs) -> Addresses {
        Addresses {
            ip: args.bind,
            grpc: args.grpc_port,
            health: args.grpc_health_port,
            metrics: args.metrics_port,
        }
    }

    pub async fn bind(self) -> anyhow::Result<Listeners> {
        Ok(Listeners {
            grpc: bind(self.ip, self.grpc, "ext_proc gRPC").await?,
            health: bind(self.ip, self.health, "gRPC health").await?,
            metrics: bind(self.ip, self.metrics, "metrics").await?,
        })
    }
}

impl Listeners {
    /// The bound ports `(grpc, health, metrics)` (port 0 asks the system for one).
    pub fn ports(&self) -> anyhow::Result<(u16, u16, u16)> {
        Ok((
            self.grpc.local_addr()?.port(),
            self.health.local_addr()?.port(),
            self.metrics.local_addr()?.port(),
        ))
    }
}

/// Serves a gRPC port: the accept loop of [`crate::transport::net::incoming`] under `router` until `exit`,
/// on this runtime (`threads` 0) or on that many connection threads ([`crate::transport::lanes`]).
pub(super) async fn serve_grpc(
    router: tonic::transport::server::Router,
    listener: TcpListener,
    listening: Listening,
    exit: watch::Receiver<bool>,
    threads: usize,
) -> anyhow::Result<()> {
    if threads > 0 {
        return crate::transport::lanes::serve(router, listener, listening, exit, threads).await;
    }
    Ok(router
        .serve_with_incoming_shutdown(
            crate::transport::net::incoming(listener, listening, exit.clone()),
            crate::transport::net::closed(exit),
        )
        .await?)
}

/// Serves `/metrics` (the Prometheus text of `metrics`) until `exit`.
pub(super) async fn serve_metrics(
    listener: TcpListener,
    metrics: Metrics,
    exit: watch::Receiver<bool>,
) -> std::io::Result<()> {
    let router = axum::Router::new().route(
        "/metrics",
        get(move || {
            let m = metrics.clone();
            async move {
                (
                    [(
                        axum::http::header::CONTENT_TYPE,
                        "text/plain; version=0.0.4",
                    )],
                    m.render(),
                )
            }
        }),
    );
    axum::serve(listener, router)
        .with_graceful_shutdown(crate::transport::net::closed(exit))
        .await
}

async fn bind(ip: IpAddr, port: u16, what: &str) -> anyhow::Result<TcpListener> {
    TcpListener::bind(SocketAddr::new(ip, port))
        .await
        .with_context(|| format!("cannot bind the {what} port {ip}:{port}"))
}

/// Resolves when SIGTERM or SIGINT arrives.
// Installing a signal handler fails only at start-up, where exiting loudly is right.
#[allow(clippy::expect_used)]
pub(super) async fn termination() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("SIGTERM handler");
    tokio::select! {
        _ = term.recv() => {},
        _ = tokio::signal::ctrl_c() => {},
    }
}

pub(super) fn write_port_file(
    path: &std::path::Path,
    ports: (u16, u16, u16),
) -> anyhow::Result<()> {
    let body =
        serde_json::json!({"grpc": ports.0, "health": ports.1, "metrics": ports.2}).to_string();
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, body).with_context(|| format!("cannot write {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("cannot write {}", path.display()))?;
    Ok(())
}
