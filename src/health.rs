//! gRPC health (`grpc.health.v1`) for the services GIE gateways and kubelet probe. Liveness is
//! SERVING while the process runs; the readiness services follow the selection core's readiness.
//! Owns only health status; it never decides routing.

use tokio::sync::watch;
use tonic_health::server::HealthReporter;
use tonic_health::ServingStatus;

pub const LIVENESS: &str = "liveness";
pub const READINESS_SERVICES: [&str; 3] = [
    "readiness",
    "inference-extension",
    "envoy.service.ext_proc.v3.ExternalProcessor",
];

/// Keeps the health statuses in step with `ready` until `shutdown` flips to true, then reports
/// NOT_SERVING everywhere but liveness so gateways stop sending new streams.
pub async fn track(
    reporter: HealthReporter,
    mut ready: watch::Receiver<bool>,
    mut shutdown: watch::Receiver<bool>,
) {
    reporter
        .set_service_status(LIVENESS, ServingStatus::Serving)
        .await;
    loop {
        let serving = *ready.borrow_and_update() && !*shutdown.borrow();
        let status = if serving {
            ServingStatus::Serving
        } else {
            ServingStatus::NotServing
        };
        for service in READINESS_SERVICES {
            reporter.set_service_status(service, status).await;
        }
        reporter.set_service_status("", status).await;
        tokio::select! {
            r = ready.changed() => if r.is_err() { return },
            r = shutdown.changed() => if r.is_err() { return },
        }
    }
}
