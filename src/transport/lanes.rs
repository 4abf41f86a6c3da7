//! Connection lanes for the ext_proc port (`--connection-threads`): each lane is one thread
//! running its own single-threaded tokio runtime and a clone of the port's tonic server; the
//! accept loop (`crate::transport::net`) hands each accepted connection to the lane holding the fewest,
//! and that lane runs everything of it: the TLS handshake, the HTTP/2 connection, every
//! stream's handler.
//!
//! Why: on one shared work-stealing runtime a request's tasks (hyper/h2's connection and
//! stream tasks, the handler) wake each other across threads, and every such wake-up parks or
//! unparks a sibling worker; on this path that was ~20% of kvpick's CPU (docs/benchmarks.md).
//! Inside a lane those wake-ups stay on one thread; the cores are used by spreading connections,
//! which Envoy keeps several of (one pool per worker thread per gateway pod).
//!
//! It owns the lanes' threads and runtimes and the choice of lane. It must not touch what a
//! connection carries: the services, the selection core and the background tasks stay on the
//! main runtime's side and are shared through their own locks and channels.

use std::sync::Arc;

use anyhow::Context;
use prometheus::IntGauge;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot, watch};
use tonic::transport::server::{Router, TcpConnectInfo};

use crate::transport::net::{Accepted, Admit, ConnSlotHandle, Handoff, Listening};

/// A connection on its way to a lane.
type Moving = (std::net::TcpStream, TcpConnectInfo, ConnSlotHandle);

/// One lane as the accept loop sees it.
struct Lane {
    tx: mpsc::Sender<Moving>,
    /// Its open connections: `kvpick_connection_thread_connections{thread}`.
    open: IntGauge,
}

/// The accept loop's handoff to the lanes.
pub struct Lanes {
    lanes: Vec<Lane>,
    next: usize,
}

impl Lanes {
    /// The lane for the next connection: the one holding the fewest, ties taken in turn so that
    /// connections opened together spread.
    fn choose(&mut self) -> usize {
        let loads: Vec<usize> = self
            .lanes
            .iter()
            .map(|l| usize::try_from(l.open.get()).unwrap_or(0))
            .collect();
        let chosen = least_loaded(&loads, self.next);
        self.next = (chosen + 1) % self.lanes.len();
        chosen
    }
}

/// The index of the smallest of `loads`, looking from `start` on (wrapping), so ties go to the
/// first at or after `start`.
pub fn least_loaded(loads: &[usize], start: usize) -> usize {
    let n = loads.len();
    (0..n)
        .map(|k| (start + k) % n)
        .min_by_key(|&i| loads[i])
        .unwrap_or(0)
}

impl Handoff for Lanes {
    async fn hand(&mut self, mut accepted: Accepted) -> bool {
        let lane = self.choose();
        accepted.count_in(self.lanes[lane].open.clone());
        let moving = match accepted.into_std() {
            Ok(moving) => moving,
            Err(err) => {
                tracing::debug!(%err, "cannot move an accepted connection to its lane");
                return true;
            }
        };
        self.lanes[lane].tx.send(moving).await.is_ok()
    }

    async fn closed(&self) {
        // Lanes end only with the process or at shutdown, which the accept loop sees itself;
        // a lane whose server failed closes its channel and fails `hand`.
        std::future::pending::<()>().await
    }
}

/// Serves `router` on `listener` over `threads` lanes until `exit`; resolves once every lane's
/// server has finished (its connections closed) or one failed.
pub async fn serve(
    router: Router,
    listener: TcpListener,
    listening: Listening,
    exit: watch::Receiver<bool>,
    threads: usize,
) -> anyhow::Result<()> {
    let handshakes = Admit::handshake_bound(&listening);
    let mut lanes = Vec::with_capacity(threads);
    let mut finished = Vec::with_capacity(threads);
    for index in 0..threads {
        let (tx, rx) = mpsc::channel::<Moving>(128);
        let (done_tx, done_rx) = oneshot::channel();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("cannot build a connection thread's runtime")?;
        let (admit, ready) = Admit::new(listening.clone(), Arc::clone(&handshakes));
        let router = router.clone();
        let exit = exit.clone();
        std::thread::Builder::new()
            .name(format!("kvpick-conn-{index}"))
            .spawn(move || {
                let served = runtime.block_on(async move {
                    tokio::spawn(intake(rx, admit));
                    router
                        .serve_with_incoming_shutdown(ready, crate::transport::net::closed(exit))
                        .await
                });
                let _ = done_tx.send(served);
            })
            .context("cannot start a connection thread")?;
        let open = listening
            .metrics
            .thread_open
            .with_label_values(&[index.to_string()]);
        lanes.push(Lane { tx, open });
        finished.push(done_rx);
    }
    tracing::debug!(
        threads,
        listener = listening.name,
        "connection threads serving"
    );
    tokio::spawn(crate::transport::net::accept_loop(
        listener,
        listening,
        exit,
        Lanes { lanes, next: 0 },
    ));
    for done in finished {
        match done.await {
            Ok(Ok(())) => {}
            Ok(Err(err)) => return Err(err).context("a connection thread's server failed"),
            Err(_) => anyhow::bail!("a connection thread ended without its server finishing"),
        }
    }
    Ok(())
}

/// A lane's side of the handoff: registers each arriving socket with this lane's runtime and
/// admits it (TLS handshake here, then to this lane's server).
async fn intake(mut rx: mpsc::Receiver<Moving>, admit: Admit) {
    while let Some((stream, info, slot)) = rx.recv().await {
        let accepted = match Accepted::from_std(stream, info, slot) {
            Ok(accepted) => accepted,
            Err(err) => {
                tracing::debug!(%err, "a connection thread cannot register a connection");
                continue;
            }
        };
        if !admit.admit(accepted).await {
            return;
        }
    }
}

#[cfg(test)]
#[path = "lanes_tests.rs"]
mod tests;
