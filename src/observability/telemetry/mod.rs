//! OpenTelemetry tracing of the request path (docs/observability.md, "Tracing"): which flags and
//! `OTEL_*` variables turn it on ([`TraceArgs`], [`TraceConfig::resolve`]), the tracer provider
//! with its OTLP/gRPC exporter and parent-based ratio sampler ([`Telemetry`]), and, in
//! [`request`], the spans of one ext_proc stream.
//!
//! It owns no routing state and never touches the selection core: the hosts hand it what they
//! already know (headers, the pick's [`kvpick_core::Selection`]). Off by default; when off no
//! tracer exists, so the request path builds no span and adds no header.

pub mod request;
#[cfg(test)]
pub mod testing;

use std::time::Duration;

use anyhow::{bail, Context as _};
use clap::Args;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::{WithExportConfig as _, OTEL_EXPORTER_OTLP_ENDPOINT};
use opentelemetry_sdk::trace::{Sampler, SdkTracerProvider};
use opentelemetry_sdk::Resource;

pub use request::{RequestTrace, RequestTracer, TraceHeaders};

/// The instrumentation scope of every kvpick span.
pub const SCOPE: &str = "kvpick";
/// `service.name` when neither `--otel-service-name` nor `OTEL_SERVICE_NAME` says otherwise.
pub const DEFAULT_SERVICE_NAME: &str = "kvpick";
/// How long one OTLP export may take before it is given up (the batch is dropped).
pub const EXPORT_TIMEOUT: Duration = Duration::from_secs(10);

/// Tracing flags of `kvpick serve`. Each overrides the `OTEL_*` variable named in its help.
#[derive(Args, Debug, Clone, Default)]
pub struct TraceArgs {
    /// OpenTelemetry traces: the OTLP/gRPC collector endpoint (`http://host:4317`). Tracing is off
    /// without one. Default: env `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, then
    /// `OTEL_EXPORTER_OTLP_ENDPOINT`.
    #[arg(long, value_name = "URL", help_heading = "Tracing")]
    pub otlp_endpoint: Option<String>,

    /// Share of new traces kvpick samples, 0 to 1. Parent-based: a request whose `traceparent`
    /// (Envoy's) is sampled is always traced, one whose parent is not sampled never. Default:
    /// env `OTEL_TRACES_SAMPLER` / `OTEL_TRACES_SAMPLER_ARG`, else 1.
    #[arg(long, value_name = "RATIO", help_heading = "Tracing")]
    pub trace_sampling_ratio: Option<f64>,

    /// `service.name` of kvpick's spans. Default: env `OTEL_SERVICE_NAME`, else `kvpick`.
    #[arg(long, value_name = "NAME", help_heading = "Tracing")]
    pub otel_service_name: Option<String>,
}

/// Which traces are sampled.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplerConfig {
    /// Follow the parent's sampled flag when there is a parent.
    pub parent_based: bool,
    /// Share of root traces (and of all traces when not parent-based) sampled.
    pub ratio: f64,
}

/// Tracing as configured: `None` from [`TraceConfig::resolve`] means off.
#[derive(Debug, Clone, PartialEq)]
pub struct TraceConfig {
    pub endpoint: String,
    pub sampler: SamplerConfig,
    pub service_name: String,
}

impl TraceConfig {
    /// Flags first, then the standard `OTEL_*` variables (read through `env`). `Ok(None)`: no
    /// endpoint anywhere, or the SDK disabled by `OTEL_SDK_DISABLED=true` /
    /// `OTEL_TRACES_EXPORTER=none` without an `--otlp-endpoint` flag.
    pub fn resolve(
        args: &TraceArgs,
        env: impl Fn(&str) -> Option<String>,
    ) -> anyhow::Result<Option<TraceConfig>> {
        let env = |name: &str| {
            env(name)
                .map(|v| v.trim().to_string())
                .filter(|v| !v.is_empty())
        };
        let endpoint = match &args.otlp_endpoint {
            Some(flag) => flag.trim().to_string(),
            None => {
                let disabled = env("OTEL_SDK_DISABLED")
                    .is_some_and(|v| v.eq_ignore_ascii_case("true"))
                    || env("OTEL_TRACES_EXPORTER").is_some_and(|v| v.eq_ignore_ascii_case("none"));
                let from_env = env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
                    .or_else(|| env(OTEL_EXPORTER_OTLP_ENDPOINT));
                match from_env {
                    Some(e) if !disabled => e,
                    _ => return Ok(None),
                }
            }
        };
        check_endpoint(&endpoint)?;
        for var in [
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
            "OTEL_EXPORTER_OTLP_PROTOCOL",
        ] {
            if let Some(protocol) = env(var) {
                if protocol != "grpc" {
                    bail!("{var}={protocol}: kvpick exports traces over OTLP/gRPC only (\"grpc\")");
                }
                break;
            }
        }
        let sampler = match args.trace_sampling_ratio {
            Some(ratio) => SamplerConfig {
                parent_based: true,
                ratio: check_ratio(ratio, "--trace-sampling-ratio")?,
            },
            None => sampler_from_env(
                env("OTEL_TRACES_SAMPLER").as_deref(),
                env("OTEL_TRACES_SAMPLER_ARG").as_deref(),
            )?,
        };
        let service_name = args
            .otel_service_name
            .clone()
            .or_else(|| env("OTEL_SERVICE_NAME"))
            .unwrap_or_else(|| DEFAULT_SERVICE_NAME.to_string());
        Ok(Some(TraceConfig {
            endpoint,
            sampler,
            service_name,
        }))
    }
}

fn check_endpoint(endpoint: &str) -> anyhow::Result<()> {
    let uri: http::Uri = endpoint
        .parse()
        .with_context(|| format!("OTLP endpoint {endpoint:?} is not a URL"))?;
    match uri.scheme_str() {
        Some("http") if uri.authority().is_some() => Ok(()),
        Some("https") => bail!(
            "OTLP endpoint {endpoint:?}: kvpick exports over plaintext gRPC (`http://`); \
             send to a local collector (sidecar or node agent) that forwards over TLS"
        ),
        _ => bail!("OTLP endpoint {endpoint:?} must be `http://host:port`"),
    }
}

fn check_ratio(ratio: f64, what: &str) -> anyhow::Result<f64> {
    if (0.0..=1.0).contains(&ratio) {
        Ok(ratio)
    } else {
        bail!("{what} must be between 0 and 1, got {ratio}")
    }
}

/// `OTEL_TRACES_SAMPLER` as the OpenTelemetry specification names them; an unknown name or a
/// bad argument is an error (the SDK would silently fall back to always-on).
fn sampler_from_env(sampler: Option<&str>, arg: Option<&str>) -> anyhow::Result<SamplerConfig> {
    let ratio = || -> anyhow::Result<f64> {
        match arg {
            None => Ok(1.0),
            Some(a) => {
                let r: f64 = a
                    .parse()
                    .with_context(|| format!("OTEL_TRACES_SAMPLER_ARG={a:?} is not a number"))?;
                check_ratio(r, "OTEL_TRACES_SAMPLER_ARG")
            }
        }
    };
    let (parent_based, ratio) = match sampler.unwrap_or("parentbased_always_on") {
        "always_on" => (false, 1.0),
        "always_off" => (false, 0.0),
        "traceidratio" => (false, ratio()?),
        "parentbased_always_on" => (true, 1.0),
        "parentbased_always_off" => (true, 0.0),
        "parentbased_traceidratio" => (true, ratio()?),
        other => bail!(
            "OTEL_TRACES_SAMPLER={other:?} is not supported (always_on, always_off, traceidratio, \
             parentbased_always_on, parentbased_always_off, parentbased_traceidratio)"
        ),
    };
    Ok(SamplerConfig {
        parent_based,
        ratio,
    })
}

impl SamplerConfig {
    fn sampler(self) -> Sampler {
        let root = if self.ratio >= 1.0 {
            Sampler::AlwaysOn
        } else if self.ratio <= 0.0 {
            Sampler::AlwaysOff
        } else {
            Sampler::TraceIdRatioBased(self.ratio)
        };
        if self.parent_based {
            Sampler::ParentBased(Box::new(root))
        } else {
            root
        }
    }
}

/// The process's tracer provider: spans batched (a bounded queue; a full one drops spans, never
/// blocks a request) and exported over OTLP/gRPC on tonic.
pub struct Telemetry {
    provider: SdkTracerProvider,
    tracer: RequestTracer,
}

impl Telemetry {
    /// Builds the exporter and the provider. Must run inside the tokio runtime (the gRPC channel
    /// connects lazily on it); nothing is sent before the first span ends.
    pub fn start(config: &TraceConfig) -> anyhow::Result<Telemetry> {
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .with_endpoint(config.endpoint.clone())
            .with_timeout(EXPORT_TIMEOUT)
            .build()
            .context("OTLP span exporter")?;
        let provider = SdkTracerProvider::builder()
            .with_batch_exporter(exporter)
            .with_sampler(config.sampler.sampler())
            .with_resource(
                Resource::builder()
                    .with_service_name(config.service_name.clone())
                    .build(),
            )
            .build();
        Ok(Self::from_provider(provider))
    }

    /// A provider built elsewhere (tests export to memory).
    pub fn from_provider(provider: SdkTracerProvider) -> Telemetry {
        let tracer = RequestTracer::new(provider.tracer(SCOPE));
        Telemetry { provider, tracer }
    }

    /// What the ext_proc host starts its spans with.
    pub fn tracer(&self) -> RequestTracer {
        self.tracer.clone()
    }

    /// Exports the spans still queued (bounded by [`EXPORT_TIMEOUT`]) and stops the exporter.
    /// Blocks: call it from a blocking thread while the runtime still runs.
    pub fn shutdown(&self) {
        if let Err(err) = self.provider.shutdown_with_timeout(EXPORT_TIMEOUT) {
            tracing::warn!(%err, "tracing: flushing spans at shutdown failed");
        }
    }
}

#[cfg(test)]
#[path = "tests.rs"]
mod tests;
