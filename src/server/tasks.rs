//! What `kvpick serve` starts beside its ports: the shared state (`--shared-state`), the
//! catalog source and its reconcile loop, the flow-policy sources, the engine feeds (metrics
//! scrapes, KV events), the core's maintenance ticks (flow-control release passes, the booking
//! reaper), and the drain at shutdown.
//!
//! It must not bind a port or decide anything: each task drives the selection core's API.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use tokio::sync::watch;

use crate::observability::metrics::Metrics;
use crate::selection::SelectionCore;
use crate::sources::catalog::kube as kube_source;
use crate::sources::catalog::static_file;
use crate::sources::shared::{SharedConfig, SharedState};

/// How often cleared ranks' holders are swept out of the indexes (one shard per tick).
const SWEEP_INTERVAL: Duration = Duration::from_millis(250);

use super::{CatalogSource, ServeArgs};

/// `--tracing`: the OpenTelemetry exporter (none with tracing off).
pub(super) fn start_telemetry(
    args: &ServeArgs,
) -> anyhow::Result<Option<crate::observability::telemetry::Telemetry>> {
    let trace_config =
        crate::observability::telemetry::TraceConfig::resolve(&args.tracing, |name| {
            std::env::var(name).ok()
        })?;
    let telemetry = match &trace_config {
        Some(config) => {
            tracing::info!(
                endpoint = %config.endpoint,
                ratio = config.sampler.ratio,
                parent_based = config.sampler.parent_based,
                service = %config.service_name,
                "tracing: exporting spans over OTLP/gRPC"
            );
            Some(crate::observability::telemetry::Telemetry::start(config)?)
        }
        None => None,
    };
    Ok(telemetry)
}

/// `--shared-state`: connects (lazily), attaches the shared state to the core and starts its
/// tasks; without the flag its secret-file flags are an error.
pub(super) async fn start_shared(
    args: &ServeArgs,
    core: &Arc<SelectionCore>,
    metrics: &Metrics,
) -> anyhow::Result<Option<Arc<SharedState>>> {
    let Some(url) = &args.shared_state else {
        for (set, flag) in [
            (
                args.shared_state_password_file.is_some(),
                "--shared-state-password-file",
            ),
            (
                args.shared_state_ca_file.is_some(),
                "--shared-state-ca-file",
            ),
        ] {
            if set {
                anyhow::bail!("{flag} needs --shared-state URL");
            }
        }
        return Ok(None);
    };
    let config = SharedConfig::new(
        url,
        args.shared_state_password_file.as_deref(),
        args.shared_state_ca_file.as_ref(),
        &args.shared_state_prefix,
        args.shared_state_timeout_ms,
        args.shared_state_interval_ms,
        core.config().sessions.ttl,
    )?;
    let shared = SharedState::new(config, &metrics.registry)?;
    core.attach_shared(Arc::clone(&shared));
    shared.spawn(Arc::clone(core)).await;
    Ok(Some(shared))
}

/// `--kv-index-remote`: the client of the indexer, attached to the core, its probe started.
pub(super) fn start_kv_remote(
    args: &ServeArgs,
    core: &Arc<SelectionCore>,
    metrics: &Metrics,
) -> anyhow::Result<()> {
    let deadline = crate::sources::kv_remote::check_timeout_ms(args.kv_index_remote_timeout_ms)?;
    let Some(url) = &args.kv_index_remote else {
        if args.kv_index_remote_ca_file.is_some() {
            anyhow::bail!("--kv-index-remote-ca-file needs --kv-index-remote URL");
        }
        return Ok(());
    };
    let metrics =
        crate::observability::metrics::kv_remote::KvRemoteMetrics::register(&metrics.registry);
    let ca = args.kv_index_remote_ca_file.as_deref();
    let remote = Arc::new(crate::sources::kv_remote::KvRemote::new(
        url, ca, deadline, metrics,
    )?);
    remote.start(core);
    tracing::info!(%url, deadline_ms = args.kv_index_remote_timeout_ms, "KV view from a remote index: no KV-event subscriptions");
    Ok(())
}

/// Starts the catalog source and the loop reconciling its snapshots into the core; returns the
/// Kubernetes client when the catalog is Kubernetes (the flow-policy source shares it).
pub(super) async fn start_catalog(
    args: &ServeArgs,
    core: &Arc<SelectionCore>,
    catalog: CatalogSource,
) -> anyhow::Result<Option<kube::Client>> {
    match catalog {
        CatalogSource::Static(config_path) => {
            start_static_source(args, core, config_path)?;
            Ok(None)
        }
        CatalogSource::Kubernetes(config) => {
            let client = kube_client(args.kube_api_url.as_deref()).await?;
            let (catalog_tx, catalog_rx) = watch::channel(None);
            tracing::info!(namespace = %config.namespace, target = ?config.target, "watching Kubernetes");
            tokio::spawn(kube_source::run(client.clone(), config, catalog_tx));
            tokio::spawn(crate::selection::reconcile::run(
                Arc::clone(core),
                "kubernetes",
                catalog_rx,
            ));
            Ok(Some(client))
        }
    }
}

/// Starts the flow-policy sources (`--flow-config`, the Kubernetes resources when `kube` is
/// set); an invalid file fails start-up.
pub(super) fn start_flow_policy(
    args: &ServeArgs,
    flow_settings: &crate::sources::flow::FlowSettings,
    kube: Option<(kube::Client, crate::sources::flow::kube::FlowKubeConfig)>,
) -> anyhow::Result<crate::sources::flow::PolicyRx> {
    let flow_policy = crate::sources::flow::start(crate::sources::flow::FlowSourceConfig {
        file: args.flow_config.clone(),
        poll: Duration::from_millis(args.catalog_poll_ms),
        kube,
    })?;
    tracing::info!(
        client_priority = flow_settings.client_priority,
        objectives = flow_policy.borrow().objectives().count(),
        "flow policy ready"
    );
    Ok(flow_policy)
}

/// What the engines tell the core beside the requests: their `/metrics` (`--engine-metrics`)
/// and their KV events (`--kv-events`), each following catalog changes.
pub(super) fn start_engine_feeds(
    args: &ServeArgs,
    core: &Arc<SelectionCore>,
) -> anyhow::Result<()> {
    if let Some(scrape) = super::scrape_config(args)? {
        tracing::info!(interval_ms = args.engine_metrics_interval_ms, names = ?scrape.names, "scraping engine metrics");
        tokio::spawn(crate::sources::engine_metrics::manage(
            Arc::clone(core),
            scrape,
            core.catalog_changes(),
        ));
    }
    if core.config().kv_events {
        tokio::spawn(crate::sources::events::ingest::manage(
            Arc::clone(core),
            core.catalog_changes(),
        ));
    }
    Ok(())
}

/// Draining: readiness goes NOT_SERVING and new streams are refused (`shutdown`), and open
/// streams get `--shutdown-grace` seconds to end.
pub(super) async fn drain(
    args: &ServeArgs,
    core: &SelectionCore,
    shutdown: &watch::Sender<bool>,
    live_streams: &crate::hosts::extproc::LiveStreams,
) {
    tracing::info!(
        grace_s = args.shutdown_grace,
        "shutting down: refusing new streams, draining open ones"
    );
    shutdown.send_replace(true);
    let grace = Duration::from_secs(args.shutdown_grace);
    let drained = tokio::time::timeout(grace, live_streams.idle()).await;
    if drained.is_err() {
        tracing::warn!(
            live_bookings = core.live_bookings(),
            streams = live_streams.count(),
            "grace period over; closing remaining streams"
        );
    } else {
        tracing::info!(live_bookings = core.live_bookings(), "drained");
    }
}

/// The core's ticks: held prefills decayed, and flow control's release pass while requests
/// wait, for what frees capacity without an operation of its own (an engine reading going
/// stale; bookings ending release at once), and the booking reaper.
pub(super) fn spawn_maintenance(core: &Arc<SelectionCore>) {
    let pumps = core.config().flow.enabled;
    let ticker = Arc::clone(core);
    tokio::spawn(async move {
        // A decayed prefill is released within a tick of its deadline even when no pick comes.
        let mut tick = tokio::time::interval(Duration::from_millis(250));
        loop {
            tick.tick().await;
            ticker.decay_bookings();
            if pumps && ticker.waiting_requests() > 0 {
                ticker.pump_queues();
            }
        }
    });
    let sweeper = Arc::clone(core);
    tokio::spawn(async move {
        // A cleared rank's id is reusable after one sweep step per index shard: 16 steps of
        // 1/16 of the index each, 4 s after the last restart, instead of a pass per restart.
        let mut tick = tokio::time::interval(SWEEP_INTERVAL);
        loop {
            tick.tick().await;
            sweeper.sweep_cleared_ranks(tokio::time::Instant::now());
        }
    });
    let core = Arc::clone(core);
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(10));
        loop {
            tick.tick().await;
            let n = core.reap_expired(tokio::time::Instant::now());
            if n > 0 {
                tracing::warn!(reaped = n, "expired bookings reaped");
            }
        }
    });
}

fn start_static_source(
    args: &ServeArgs,
    core: &Arc<SelectionCore>,
    config_path: PathBuf,
) -> anyhow::Result<()> {
    let initial_text = std::fs::read_to_string(&config_path)
        .with_context(|| format!("cannot read catalog file {}", config_path.display()))?;
    let initial = static_file::parse_catalog(&initial_text)
        .with_context(|| format!("in catalog file {}", config_path.display()))?;
    let (catalog_tx, catalog_rx) = watch::channel(Some(initial));
    let reloads = core.metrics().catalog.catalog_reloads.clone();
    tokio::spawn(static_file::watch_catalog(
        config_path,
        initial_text,
        Duration::from_millis(args.catalog_poll_ms),
        catalog_tx,
        move |_| reloads.with_label_values(&["invalid"]).inc(),
    ));
    tokio::spawn(crate::selection::reconcile::run(
        Arc::clone(core),
        "static-file",
        catalog_rx,
    ));
    Ok(())
}

/// The Kubernetes client: in-cluster service account or kubeconfig, or (tests, local use) a
/// plain URL without credentials.
async fn kube_client(api_url: Option<&str>) -> anyhow::Result<kube::Client> {
    match api_url {
        Some(url) => {
            let uri: axum::http::Uri = url
                .parse()
                .with_context(|| format!("invalid --kube-api-url {url:?}"))?;
            let mut config = kube::Config::new(uri);
            config.accept_invalid_certs = true;
            kube::Client::try_from(config).context("cannot build the Kubernetes client")
        }
        None => kube::Client::try_default().await.context(
            "cannot configure the Kubernetes client (no in-cluster service account or kubeconfig)",
        ),
    }
}
