//! State shared by active-active replicas of kvpick on Redis or Valkey (`--shared-state URL`):
//! hard session bindings (the first replica to bind wins, the others follow; they survive a
//! replica's restart) and each replica's booked load per rank (every replica adds the others'
//! to its own within about two `--shared-state-interval-ms`).
//!
//! Owns: the one Redis connection, the up/down state (logged once per outage, counted), the
//! session writer task ([`sessions`]) and the load exchange task ([`load`]). The selection core
//! never sees Redis: this module gives it remote loads ([`kvpick_core::Core::set_remote_loads`])
//! and session bindings decided elsewhere ([`kvpick_core::Core::install_session_binding`]).
//!
//! Must not: decide picks, fail a request, block a pick on Redis except the one bounded lookup
//! of a session this replica has no binding for (skipped while Redis is down), or touch
//! readiness. Without the flag none of this exists (no task, no metric, no call).

pub mod load;
mod metrics;
pub mod sessions;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::IntoConnectionInfo;
use tokio::sync::{mpsc, Mutex};

use crate::selection::SelectionCore;
pub use crate::selection::SessionLookupJob;
pub use metrics::SharedMetrics;
pub use sessions::SessionWrite;

/// Queue of session writes waiting for the writer task; past it writes are dropped (counted).
const SESSION_QUEUE: usize = 8192;

/// What `kvpick serve` was told about the shared state.
#[derive(Debug, Clone)]
pub struct SharedConfig {
    /// `redis://`, `rediss://` (TLS), `valkey://`, `valkeys://` or `unix://` URL.
    pub url: String,
    /// Password from `--shared-state-password-file` (overrides one in the URL).
    pub password: Option<String>,
    /// PEM roots for `rediss://` from `--shared-state-ca-file` (default: the system's).
    pub ca_pem: Option<Vec<u8>>,
    /// Key prefix, so several pools can share one Redis.
    pub prefix: String,
    /// Bound of every Redis call.
    pub timeout: Duration,
    /// Period of the load exchange.
    pub interval: Duration,
    /// Idle TTL of session bindings (the core's `--session-ttl`).
    pub session_ttl: Duration,
}

impl SharedConfig {
    /// Reads the optional secret files and checks the ranges, naming the flag.
    pub fn new(
        url: &str,
        password_file: Option<&Path>,
        ca_file: Option<&PathBuf>,
        prefix: &str,
        timeout_ms: u64,
        interval_ms: u64,
        session_ttl: Duration,
    ) -> anyhow::Result<SharedConfig> {
        if !(1..=10_000).contains(&timeout_ms) {
            anyhow::bail!("--shared-state-timeout-ms must be in 1..=10000, got {timeout_ms}");
        }
        if !(10..=10_000).contains(&interval_ms) {
            anyhow::bail!("--shared-state-interval-ms must be in 10..=10000, got {interval_ms}");
        }
        if prefix.is_empty() || prefix.len() > 128 {
            anyhow::bail!("--shared-state-prefix must be 1..=128 bytes");
        }
        let password = match password_file {
            Some(path) => {
                let text = std::fs::read_to_string(path).with_context(|| {
                    format!(
                        "cannot read --shared-state-password-file {}",
                        path.display()
                    )
                })?;
                let password = text.trim_end_matches(['\r', '\n']).to_string();
                if password.is_empty() {
                    anyhow::bail!("--shared-state-password-file {} is empty", path.display());
                }
                Some(password)
            }
            None => None,
        };
        let ca_pem = match ca_file {
            Some(path) => Some(std::fs::read(path).with_context(|| {
                format!("cannot read --shared-state-ca-file {}", path.display())
            })?),
            None => None,
        };
        let config = SharedConfig {
            url: url.to_string(),
            password,
            ca_pem,
            prefix: prefix.to_string(),
            timeout: Duration::from_millis(timeout_ms),
            interval: Duration::from_millis(interval_ms),
            session_ttl,
        };
        config.client()?;
        Ok(config)
    }

    /// The Redis client (no connection yet). A bad URL is an error naming the flag, never
    /// echoing the URL (it may carry a password).
    fn client(&self) -> anyhow::Result<redis::Client> {
        let mut info = self.url.as_str().into_connection_info().map_err(|e| {
            anyhow::anyhow!(
                "invalid --shared-state URL ({}): expected redis://[USER:PASSWORD@]HOST:PORT[/DB], rediss://..., valkey://... or unix:///PATH",
                e.category()
            )
        })?;
        if let Some(password) = &self.password {
            let settings = info.redis_settings().clone().set_password(password);
            info = info.set_redis_settings(settings);
        }
        let client = match &self.ca_pem {
            Some(pem) => redis::Client::build_with_tls(
                info,
                redis::TlsCertificates {
                    client_tls: None,
                    root_cert: Some(pem.clone()),
                },
            ),
            None => redis::Client::open(info),
        };
        client.map_err(|e| anyhow::anyhow!("--shared-state: {}", e.category()))
    }

    /// Where Redis is, for logs: scheme, host and port, never the password.
    pub fn redacted_url(&self) -> String {
        match self.url.split_once("://") {
            Some((scheme, rest)) => {
                let rest = rest.rsplit_once('@').map_or(rest, |(_, host)| host);
                format!("{scheme}://{}", rest.split('#').next().unwrap_or_default())
            }
            None => "(unparsable)".into(),
        }
    }
}

/// How long a replica's published load lives without a refresh: a replica that died (or lost
/// Redis) stops counting after this.
pub fn load_ttl(interval: Duration) -> Duration {
    (interval * 20).max(Duration::from_secs(1))
}

/// The connection, the health state and the queues; cheap to share.
pub struct SharedState {
    conn: ConnectionManager,
    config: SharedConfig,
    /// Names this process's load entry; random per start, so a restarted replica never reads
    /// its previous incarnation's load as another replica's.
    replica_id: String,
    up: AtomicBool,
    metrics: SharedMetrics,
    writes: mpsc::Sender<SessionWrite>,
    writes_rx: Mutex<Option<mpsc::Receiver<SessionWrite>>>,
}

impl SharedState {
    /// Sets up the (lazy) connection; nothing is sent until [`SharedState::spawn`]. Redis being
    /// down at start-up is no error: kvpick starts on local state and reconciles later.
    pub fn new(
        config: SharedConfig,
        registry: &prometheus::Registry,
    ) -> anyhow::Result<Arc<SharedState>> {
        let client = config.client()?;
        let manager_config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(config.timeout.max(Duration::from_millis(100))))
            .set_number_of_retries(1)
            .set_min_delay(Duration::from_millis(20))
            .set_max_delay(Duration::from_millis(500));
        let conn = ConnectionManager::new_lazy_with_config(client, manager_config)
            .map_err(|e| anyhow::anyhow!("--shared-state: {}", e.category()))?;
        let metrics = SharedMetrics::register(registry);
        // Up until a call fails: the first outage is then logged like any other.
        metrics.up.set(1);
        let (writes, writes_rx) = mpsc::channel(SESSION_QUEUE);
        Ok(Arc::new(SharedState {
            conn,
            config,
            replica_id: uuid::Uuid::new_v4().simple().to_string(),
            up: AtomicBool::new(true),
            metrics,
            writes,
            writes_rx: Mutex::new(Some(writes_rx)),
        }))
    }

    /// Starts the session writer and the load exchange (once).
    pub async fn spawn(self: &Arc<Self>, core: Arc<SelectionCore>) {
        let Some(rx) = self.writes_rx.lock().await.take() else {
            return;
        };
        tracing::info!(
            redis = %self.config.redacted_url(),
            replica = %self.replica_id,
            prefix = %self.config.prefix,
            "sharing sessions and load with the other replicas"
        );
        tokio::spawn(sessions::run_writer(
            Arc::clone(self),
            Arc::clone(&core),
            rx,
        ));
        tokio::spawn(load::run(Arc::clone(self), core));
    }

    pub fn config(&self) -> &SharedConfig {
        &self.config
    }

    pub fn replica_id(&self) -> &str {
        &self.replica_id
    }

    pub fn metrics(&self) -> &SharedMetrics {
        &self.metrics
    }

    pub fn is_up(&self) -> bool {
        self.up.load(Ordering::Relaxed)
    }

    fn connection(&self) -> ConnectionManager {
        self.conn.clone()
    }

    /// A call failed or timed out: counted; the first failure of an outage is logged.
    fn failed(&self, op: &str, error: &str) {
        self.metrics.errors.with_label_values(&[op]).inc();
        if self.up.swap(false, Ordering::Relaxed) {
            self.metrics.up.set(0);
            self.metrics.outages.inc();
            tracing::warn!(
                op,
                error,
                redis = %self.config.redacted_url(),
                "shared state unreachable: routing on local state until it returns"
            );
        }
    }

    /// A call succeeded: an outage, if any, is over.
    fn succeeded(&self) {
        if !self.up.swap(true, Ordering::Relaxed) {
            self.metrics.up.set(1);
            tracing::info!(
                redis = %self.config.redacted_url(),
                "shared state reachable again: reconciling sessions and load"
            );
        }
    }

    /// Runs one Redis call bounded by `--shared-state-timeout-ms`; failures mark the outage.
    async fn call<T>(
        &self,
        op: &str,
        call: impl std::future::Future<Output = redis::RedisResult<T>>,
    ) -> Result<T, CallError> {
        match tokio::time::timeout(self.config.timeout, call).await {
            Ok(Ok(value)) => {
                self.succeeded();
                Ok(value)
            }
            Ok(Err(e)) => {
                self.failed(op, &e.to_string());
                Err(CallError::Failed)
            }
            Err(_) => {
                self.failed(op, "timeout");
                Err(CallError::Timeout)
            }
        }
    }

    /// On shutdown: withdraws this replica's load at once (instead of after its TTL).
    pub async fn leave(&self) {
        let mut conn = self.connection();
        let (load_key, replicas_key) = (load::load_key(self), load::replicas_key(self));
        let _ = tokio::time::timeout(
            self.config.timeout,
            redis::pipe()
                .del(load_key)
                .ignore()
                .srem(replicas_key, &self.replica_id)
                .ignore()
                .exec_async(&mut conn),
        )
        .await;
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CallError {
    Timeout,
    Failed,
}

#[cfg(test)]
mod tests;
