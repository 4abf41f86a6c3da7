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

/// Sets every status once (liveness SERVING, the readiness services as `ready` says), before the
/// ports are announced; [`track`] then keeps them current.
pub async fn register(reporter: &HealthReporter, ready: bool) {
    reporter
        .set_service_status(LIVENESS, ServingStatus::Serving)
        .await;
    set_readiness(reporter, ready).await;
}

async fn set_readiness(reporter: &HealthReporter, serving: bool) {
    let status = if serving {
        ServingStatus::Serving
    } else {
        ServingStatus::NotServing
    };
    for service in READINESS_SERVICES {
        reporter.set_service_status(service, status).await;
    }
    reporter.set_service_status("", status).await;
}

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
        set_readiness(&reporter, serving).await;
        tokio::select! {
            r = ready.changed() => if r.is_err() { return },
            r = shutdown.changed() => if r.is_err() { return },
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use tonic_health::pb::health_server::Health;
    use tonic_health::pb::HealthCheckRequest;

    #[tokio::test]
    async fn every_service_answers_once_registered_before_any_task_runs() {
        let reporter = HealthReporter::new();
        let service = tonic_health::server::HealthService::from_health_reporter(reporter.clone());
        register(&reporter, false).await;
        let status = |name: &str| {
            let request = tonic::Request::new(HealthCheckRequest {
                service: name.into(),
            });
            let service = &service;
            async move { service.check(request).await.map(|r| r.into_inner().status) }
        };
        assert_eq!(
            status(LIVENESS).await.unwrap(),
            ServingStatus::Serving as i32
        );
        for name in READINESS_SERVICES.iter().copied().chain([""]) {
            assert_eq!(
                status(name).await.unwrap(),
                ServingStatus::NotServing as i32,
                "{name}"
            );
        }
    }
}
