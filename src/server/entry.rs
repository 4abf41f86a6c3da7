//! The server's entry: start-up (the core, its sources, the tokenizers, the hosts), the three
//! ports served on their listeners, and the drain when the shutdown signal comes. `serve` is the
//! process's (it binds `--bind`/`--*-port` and waits for SIGTERM/SIGINT); `run` takes listeners
//! and a shutdown future from its caller, so a test binds 127.0.0.1 port 0 itself and runs the
//! whole server in-process.
//!
//! It must not own what a port carries beyond wiring the services to it (`ports`), nor the flags
//! (`super::ServeArgs`, `config`).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use crate::hosts::api::SelectionApi;
use crate::hosts::extproc::ExtProcService;
use crate::observability::metrics::Metrics;
use crate::selection::SelectionCore;

use super::ports::{self, Listeners};
use super::ServeArgs;
use super::{catalog_source, config, core_config, flow_kube_config, flow_settings, memory, tasks};

/// `kvpick serve`: the server on the ports `args` names, until SIGTERM or SIGINT. The ports are
/// bound where start-up always bound them (after the tokenizers and the catalog load, so a bad
/// file fails start-up before anything listens); a taken port fails start-up naming it.
pub async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let addresses = ports::Addresses::of(&args);
    start(args, addresses.bind(), ports::termination()).await
}

/// The server on `listeners` the caller bound (`args`' `--bind` and `--*-port` are not read),
/// until `shutdown` resolves; then it drains as on SIGTERM (readiness NOT_SERVING, open streams
/// get `--shutdown-grace`), closes the listeners and returns. `--port-file`, if set, gets the
/// listeners' ports.
pub async fn run(
    args: ServeArgs,
    listeners: Listeners,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    start(args, async { Ok(listeners) }, shutdown).await
}

async fn start(
    args: ServeArgs,
    bind: impl Future<Output = anyhow::Result<Listeners>>,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    // Before any KV index allocates.
    let huge_pages_off = memory::apply_huge_pages(args.huge_pages);
    tracing::debug!(huge_pages_off, "transparent huge pages");
    let metrics = Metrics::with_families(args.metrics_families);
    let mut conn_limits = args.conn.limits()?;
    let memory = config::memory_ledger(&args, &metrics)?;
    conn_limits.memory = Some(memory.clone());
    let telemetry = tasks::start_telemetry(&args)?;
    let core = SelectionCore::new(core_config(&args)?, metrics.clone());
    super::settings::start(&args, &core)?;
    metrics
        .epp
        .set_pool_name(args.pool_name.as_deref().unwrap_or("default"));

    // Tokenizers load (and validate) before anything listens: a bad file fails start-up.
    let tokenizers = config::tokenizers(&args, &metrics.registry)?;
    let session_headers = config::session_headers(&args)?;
    let (shutdown_tx, shutdown_rx) = watch::channel(false);
    let (shared, flow_settings, flow_policy) = start_sources(&args, &core, &metrics).await?;

    let health_service = start_health(&core, shutdown_rx.clone()).await;

    let listeners = bind.await?;
    let ports = listeners.ports()?;
    let tls = server_tls(&args)?;

    let extproc = ExtProcService::new(
        Arc::clone(&core),
        crate::hosts::extproc::ExtProcSettings {
            tokenizers,
            session_headers,
            flow_policy: Some(flow_policy.clone()),
            flow_settings,
            tracer: telemetry
                .as_ref()
                .map(crate::observability::telemetry::Telemetry::tracer),
            ..config::extproc_settings(&args, &metrics, &memory)?
        },
    );
    let extproc = extproc.with_drain(shutdown_rx.clone());
    let live_streams = extproc.live_streams();
    // Listeners close only once draining is over: until then health answers NOT_SERVING.
    let (exit_tx, exit_rx) = watch::channel(false);
    let listening = |name, tls| crate::transport::net::Listening {
        name,
        tls,
        limits: conn_limits.clone(),
        metrics: metrics.conn.clone(),
    };
    let grpc_server = ports::serve_grpc(
        conn_limits
            .http2_settings(tonic::transport::Server::builder())
            .max_concurrent_streams(Some(args.ext_proc_streams.max_concurrent_streams))
            .add_service(health_service.clone())
            .add_service(extproc.into_server())
            .add_service(
                SelectionApi::new(Arc::clone(&core))
                    .with_worker_writes(args.worker_api)
                    .with_reservations(args.selection_api)
                    .into_server(),
            ),
        listeners.grpc,
        listening("grpc", tls),
        exit_rx.clone(),
        conn_limits.connection_threads,
    );
    let health_server = ports::serve_grpc(
        conn_limits
            .http2_settings(tonic::transport::Server::builder())
            .add_service(health_service),
        listeners.health,
        listening("health", None),
        exit_rx.clone(),
        0,
    );
    let metrics_server = ports::serve_metrics(listeners.metrics, metrics.clone(), exit_rx.clone());

    if let Some(path) = &args.port_file {
        ports::write_port_file(path, ports)?;
    }
    tracing::info!(
        grpc = ports.0,
        health = ports.1,
        metrics = ports.2,
        tls = args.tls.secure_serving,
        connection_threads = conn_limits.connection_threads,
        "kvpick serving"
    );

    let grpc_task = tokio::spawn(grpc_server);
    let health_task = tokio::spawn(health_server);
    let metrics_task = tokio::spawn(metrics_server);

    shutdown.await;
    tasks::drain(&args, &core, &shutdown_tx, &live_streams).await;
    if let Some(shared) = &shared {
        shared.leave().await;
    }
    // The policy sources run for as long as a receiver lives.
    drop(flow_policy);
    close_ports(&exit_tx, [grpc_task, health_task], metrics_task).await;
    if let Some(telemetry) = telemetry {
        // The exporter's channel runs on this runtime: flush from a blocking thread beside it.
        let _ = tokio::task::spawn_blocking(move || telemetry.shutdown()).await;
    }
    Ok(())
}

/// gRPC health for every service, registered before a port is announced (an early probe reads
/// NOT_SERVING, never "service not registered"), then following the core's readiness until
/// shutdown.
async fn start_health(
    core: &Arc<SelectionCore>,
    shutdown: watch::Receiver<bool>,
) -> tonic_health::pb::health_server::HealthServer<impl tonic_health::pb::health_server::Health> {
    let (reporter, service) = tonic_health::server::health_reporter();
    // Read before the await: the watch's guard must not be held across it (the future is Send).
    let ready = *core.readiness().borrow();
    crate::transport::health::register(&reporter, ready).await;
    tokio::spawn(crate::transport::health::track(
        reporter,
        core.readiness(),
        shutdown,
    ));
    service
}

/// The gRPC port's TLS (`--secure-serving`, `--cert-path`, client authentication), or none.
fn server_tls(args: &ServeArgs) -> anyhow::Result<Option<Arc<crate::transport::tls::TlsServer>>> {
    if !args.tls.secure_serving {
        return Ok(None);
    }
    let client_auth = args.tls.client_auth()?;
    Ok(Some(crate::transport::tls::server_with(
        args.tls.cert_path.clone(),
        client_auth,
    )?))
}

/// Tells the servers to close their (idle) connections and waits for them at most 2 s: a peer
/// that does not let go of one cannot hold the exit.
async fn close_ports<G, M>(
    exit: &watch::Sender<bool>,
    grpc_ports: [tokio::task::JoinHandle<G>; 2],
    metrics_port: tokio::task::JoinHandle<M>,
) {
    exit.send_replace(true);
    let _ = tokio::time::timeout(Duration::from_secs(2), async {
        for task in grpc_ports {
            let _ = task.await;
        }
        let _ = metrics_port.await;
    })
    .await;
}

/// What feeds the core, in start-up order: the shared state's peers, the remote index, the
/// catalog (a bad catalog fails start-up with a clear message), the flow-control policy (an
/// invalid `--flow-config` fails start-up), the engines' feeds and the maintenance tick.
async fn start_sources(
    args: &ServeArgs,
    core: &Arc<SelectionCore>,
    metrics: &Metrics,
) -> anyhow::Result<(
    Option<Arc<crate::sources::shared::SharedState>>,
    crate::sources::flow::FlowSettings,
    crate::sources::flow::PolicyRx,
)> {
    let shared = tasks::start_shared(args, core, metrics).await?;
    tasks::start_kv_remote(args, core, metrics)?;

    // Catalog source first: a bad catalog fails start-up with a clear message.
    let catalog = catalog_source(args, std::env::var("NAMESPACE").ok())?;
    let flow_kube = flow_kube_config(args, &catalog);
    let kube = tasks::start_catalog(args, core, catalog).await?;

    // Flow-control policy (objectives, rewrites): an invalid --flow-config fails start-up.
    let flow_settings = flow_settings(args);
    let flow_policy = tasks::start_flow_policy(
        args,
        &flow_settings,
        kube.zip(flow_kube.map(|c| c.with_in_use_gauge(metrics.flow.crd_in_use.clone()))),
    )?;
    tasks::start_engine_feeds(args, core)?;
    tasks::spawn_maintenance(core);
    Ok((shared, flow_settings, flow_policy))
}
