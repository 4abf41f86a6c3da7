//! `--kv-index-remote`: this replica takes its KV view from another kvpick (the indexer, a plain
//! `serve` that subscribes to the engines' KV events) instead of subscribing itself (over h2c, or
//! TLS through [`tls`]). Per pick it
//! asks the indexer's `OverlapScores` (the public RPC, unchanged) for the prompt's block hashes,
//! within `--kv-index-remote-timeout-ms`; a slow, down or refusing indexer leaves the pick to
//! approximate mode (this replica's own predictions), counted by reason. After a failure no
//! pick waits on the indexer: a probe of its gRPC health every [`PROBE_INTERVAL`] brings it back.
//!
//! It implements [`crate::selection::RemoteIndex`]; it must not decide a pick or touch the
//! core's state (the answer goes into the request, the core reads it like its own index).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use futures::future::BoxFuture;
use tonic::transport::{Channel, Endpoint};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

use crate::observability::metrics::kv_remote::KvRemoteMetrics;
use crate::proto::selection_client::SelectionClient;
use crate::proto::SelectRequest;
use crate::selection::{RankKey, RemoteIndex, RemoteOverlap, RemoteQuery, SelectionCore};
use kvpick_core::types::TierDepths;

mod tls;

/// Bound on opening the connection to the indexer (a pick never waits for it: its own
/// deadline is far shorter; the connection keeps being opened behind it).
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// How often a down indexer is probed (gRPC health, service `readiness`).
pub const PROBE_INTERVAL: Duration = Duration::from_secs(1);
/// Bounds of `--kv-index-remote-timeout-ms`.
pub const MIN_TIMEOUT_MS: u64 = 1;
pub const MAX_TIMEOUT_MS: u64 = 10_000;

/// The client of the remote index.
pub struct KvRemote {
    url: String,
    selection: SelectionClient<Channel>,
    health: HealthClient<Channel>,
    deadline: Duration,
    metrics: KvRemoteMetrics,
    /// Set by a failed query or probe; cleared by a SERVING probe. While set, picks skip the
    /// remote (fallback `down`).
    down: AtomicBool,
}

/// `--kv-index-remote-timeout-ms` checked against its bounds (the flag's error names it).
pub fn check_timeout_ms(ms: u64) -> anyhow::Result<Duration> {
    if !(MIN_TIMEOUT_MS..=MAX_TIMEOUT_MS).contains(&ms) {
        anyhow::bail!(
            "--kv-index-remote-timeout-ms {ms} is out of range ({MIN_TIMEOUT_MS}..={MAX_TIMEOUT_MS})"
        );
    }
    Ok(Duration::from_millis(ms))
}

impl KvRemote {
    /// A client of the indexer at `url`: `http://host:port` (its gRPC port served with
    /// `--secure-serving=false`) or `https://host:port` (verified against `ca_file`, else the
    /// system's roots; `#insecure` at the end: not verified); connects lazily.
    pub fn new(
        url: &str,
        ca_file: Option<&std::path::Path>,
        deadline: Duration,
        metrics: KvRemoteMetrics,
    ) -> anyhow::Result<Self> {
        let (address, insecure) = match url.strip_suffix("#insecure") {
            Some(address) => (address, true),
            None => (url, false),
        };
        let tls = address.starts_with("https://");
        if !tls && !address.starts_with("http://") {
            anyhow::bail!(
                "--kv-index-remote {url:?}: expected http://host:port (the indexer's gRPC port served with --secure-serving=false) or https://host:port[#insecure]"
            );
        }
        if !tls && (insecure || ca_file.is_some()) {
            anyhow::bail!(
                "--kv-index-remote {url:?}: #insecure and --kv-index-remote-ca-file need https://"
            );
        }
        let endpoint = Endpoint::from_shared(address.to_string())
            .with_context(|| format!("invalid --kv-index-remote {url:?}"))?
            .connect_timeout(CONNECT_TIMEOUT)
            .tcp_nodelay(true);
        let channel = if tls {
            endpoint.connect_with_connector_lazy(tls::TlsConnect::new(ca_file, insecure)?)
        } else {
            endpoint.connect_lazy()
        };
        Ok(KvRemote {
            url: url.to_string(),
            selection: SelectionClient::new(channel.clone()),
            health: HealthClient::new(channel),
            deadline,
            metrics,
            down: AtomicBool::new(false),
        })
    }

    /// Attaches the client to the core and starts its probe.
    pub fn start(self: &Arc<Self>, core: &SelectionCore) {
        core.attach_remote_index(Arc::clone(self) as Arc<dyn RemoteIndex>);
        let probe = Arc::clone(self);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(PROBE_INTERVAL);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                if probe.down.load(Ordering::Acquire) || probe.metrics.up.get() == 0 {
                    probe.probe().await;
                }
            }
        });
    }

    /// One health check: SERVING brings the remote back for the next pick.
    async fn probe(&self) {
        let mut health = self.health.clone();
        let asked = health.check(HealthCheckRequest {
            service: "readiness".into(),
        });
        let serving = matches!(
            tokio::time::timeout(CONNECT_TIMEOUT, asked).await,
            Ok(Ok(r)) if r.get_ref().status == ServingStatus::Serving as i32
        );
        self.set_up(serving);
    }

    fn set_up(&self, up: bool) {
        let was_down = self.down.swap(!up, Ordering::AcqRel);
        self.metrics.up.set(i64::from(up));
        if was_down == up {
            if up {
                tracing::info!(url = %self.url, "remote KV index answers again");
            } else {
                tracing::warn!(url = %self.url, "remote KV index not answering: picks are approximate until it does");
            }
        }
    }

    fn fallback(&self, reason: &str) -> Option<RemoteOverlap> {
        self.metrics.fallbacks.with_label_values(&[reason]).inc();
        None
    }

    async fn query(&self, query: RemoteQuery) -> Option<RemoteOverlap> {
        if self.down.load(Ordering::Acquire) {
            return self.fallback("down");
        }
        let blocks = query.seq_hashes.len();
        let request = SelectRequest {
            model: query.model,
            routing_group: query.routing_group,
            block_hashes: query.seq_hashes,
            prompt_tokens: query.prompt_tokens,
            ..Default::default()
        };
        let mut client = self.selection.clone();
        let started = Instant::now();
        let answer = tokio::time::timeout(self.deadline, client.overlap_scores(request)).await;
        self.metrics
            .query_seconds
            .observe(started.elapsed().as_secs_f64());
        let response = match answer {
            Ok(Ok(response)) => response.into_inner(),
            Ok(Err(status)) => return self.refused(&status),
            Err(_) => {
                self.set_up(false);
                return self.fallback("timeout");
            }
        };
        self.set_up(true);
        if response.prompt_blocks as usize != blocks {
            // The indexer bounds prompts at fewer blocks (`--max-prompt-blocks`): its depths
            // would not be over the same prompt.
            return self.fallback("mismatch");
        }
        self.metrics.answered.inc();
        Some(overlap_of(response.scores))
    }

    /// A query answered with an error status: the indexer is unreachable (the transport's
    /// own error, no answer from a server), or it refused the query (it is up).
    fn refused(&self, status: &tonic::Status) -> Option<RemoteOverlap> {
        let transport = status.code() == tonic::Code::Unavailable
            && std::error::Error::source(status).is_some();
        if transport {
            self.set_up(false);
            return self.fallback("unavailable");
        }
        tracing::debug!(code = ?status.code(), message = status.message(), "remote KV index refused a query");
        // This replica built the query: hashes the indexer finds malformed are hashes of
        // another block size than its own (see `mismatch` below).
        if status.code() == tonic::Code::InvalidArgument {
            return self.fallback("mismatch");
        }
        self.fallback("rejected")
    }
}

/// The RPC's scores as the core's input.
fn overlap_of(scores: Vec<crate::proto::OverlapScore>) -> RemoteOverlap {
    RemoteOverlap::new(
        scores
            .into_iter()
            .filter_map(|s| {
                let rank = s.rank?;
                Some((
                    RankKey {
                        worker_id: rank.worker_id,
                        dp_rank: rank.dp_rank,
                    },
                    TierDepths {
                        gpu: s.gpu_blocks,
                        host: s.host_blocks,
                        disk: s.disk_blocks,
                    },
                ))
            })
            .collect(),
    )
}

impl RemoteIndex for KvRemote {
    fn overlap(&self, query: RemoteQuery) -> BoxFuture<'_, Option<RemoteOverlap>> {
        Box::pin(self.query(query))
    }
}

#[cfg(test)]
mod tests;
