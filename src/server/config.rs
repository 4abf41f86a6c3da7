//! `kvpick serve`'s flags turned into the settings of each part: the core's configuration
//! (scheduling, sessions, outlier detection, flow control), the engine-metrics scraper, the
//! catalog source and the flow-policy sources, each range check naming its flag.
//!
//! Pure: it reads [`ServeArgs`] and files named by flags, never starts a task or binds a port.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;

use crate::selection::{BusyThresholds, CoreConfig, CostParams, SessionConfig};
use crate::sources::catalog::kube as kube_source;

use super::{EngineMetricsMode, ServeArgs, KUBE_RESYNC};

/// `--tokenizer-config` and `--tokenizer-dir`: the tokenizers, loaded (and validated) before
/// anything listens, so a bad file fails start-up.
pub fn tokenizers(
    args: &ServeArgs,
    registry: &prometheus::Registry,
) -> anyhow::Result<Option<Arc<crate::tokenize::Tokenizers>>> {
    if args.tokenize_stall_ms == 0 {
        anyhow::bail!("--tokenize-stall-ms must be at least 1");
    }
    let Some(tokenizers) = crate::tokenize::Tokenizers::load_sources(
        args.tokenizer_config.as_deref(),
        &args.tokenizer_dir,
        registry,
    )?
    else {
        return Ok(None);
    };
    Ok(Some(Arc::new(tokenizers.with_limits(
        crate::tokenize::TokenizeLimits {
            max_body_bytes: args.tokenize_max_body_bytes,
            max_queued_bytes: args.tokenize_queue_max_bytes,
            stall_timeout: Duration::from_millis(args.tokenize_stall_ms),
        },
    ))))
}

/// `--session-headers`, `--session-parent-headers`, `--session-agent-headers` and
/// `--session-final-headers`, checked (a pair naming no session header is an error).
pub fn session_headers(args: &ServeArgs) -> anyhow::Result<crate::hosts::extproc::SessionHeaders> {
    crate::hosts::extproc::SessionHeaders::from_lists(
        &args.session_headers,
        &args.session_parent_headers,
        &args.session_agent_headers,
        &args.session_final_headers,
    )
    .map_err(anyhow::Error::msg)
}

/// The ext_proc host's settings from flags and the memory account. What start-up makes on its own
/// (tokenizers, session headers, flow policy and settings, tracer) stays at its default here: the
/// caller sets those fields on the returned settings (`ExtProcSettings { tokenizers, ..this }`).
pub fn extproc_settings(
    args: &ServeArgs,
    metrics: &crate::observability::metrics::Metrics,
    memory: &crate::transport::h2_authority::ledger::LedgerConfig,
) -> anyhow::Result<crate::hosts::extproc::ExtProcSettings> {
    let streams = (args.ext_proc_streams).bounds(metrics.extproc.streams_open.clone())?;
    Ok(crate::hosts::extproc::ExtProcSettings {
        max_body_bytes: args.max_body_bytes,
        fallbacks: args.fallbacks,
        conformance_test_mode: args.conformance_test_mode,
        body_budget: crate::hosts::extproc::BodyBudget::new(
            args.max_buffered_body_bytes,
            metrics.extproc.body_bytes_buffered.clone(),
            Arc::clone(&memory.account),
        ),
        pd_protocol: args.pd_protocol,
        kv_transfer_p2p_port: args.tiers.p2p_port()?,
        endpoint_scores: if args.emit_endpoint_scores {
            args.endpoint_scores_limit
        } else {
            0
        },
        max_message_bytes: memory.max_message_bytes,
        streams,
        ..Default::default()
    })
}

/// The memory account and what each connection charges against it (`--memory-account-bytes`,
/// `--connection-memory-bytes`, `--max-ext-proc-message-bytes`).
pub fn memory_ledger(
    args: &ServeArgs,
    metrics: &crate::observability::metrics::Metrics,
) -> anyhow::Result<crate::transport::h2_authority::ledger::LedgerConfig> {
    let limits = args.memory.limits(args.max_body_bytes)?;
    Ok(crate::transport::h2_authority::ledger::LedgerConfig {
        account: crate::transport::memory_account::MemoryAccount::new(
            limits.account_bytes,
            &metrics.memory,
        ),
        connection_bytes: limits.connection_bytes,
        max_message_bytes: limits.max_message_bytes,
    })
}

/// The scraper's settings from flags (`None` with `--engine-metrics off`).
pub fn scrape_config(
    args: &ServeArgs,
) -> anyhow::Result<Option<crate::sources::engine_metrics::ScrapeConfig>> {
    use crate::sources::engine_metrics::{MetricNames, ScrapeConfig};
    let base = match args.engine_metrics {
        EngineMetricsMode::Off => return Ok(None),
        EngineMetricsMode::Vllm => MetricNames::vllm(),
        EngineMetricsMode::Sglang => MetricNames::sglang(),
    };
    let names = base
        .with_overrides(&args.engine_metric_names)
        .context("invalid --engine-metric-names")?;
    if !args.engine_metrics_path.starts_with('/') {
        anyhow::bail!(
            "--engine-metrics-path must start with '/', got {:?}",
            args.engine_metrics_path
        );
    }
    for (name, value) in [
        (
            "--engine-metrics-interval-ms",
            args.engine_metrics_interval_ms,
        ),
        (
            "--engine-metrics-timeout-ms",
            args.engine_metrics_timeout_ms,
        ),
        ("--engine-metrics-stale-ms", args.engine_metrics_stale_ms),
    ] {
        if value == 0 {
            anyhow::bail!("{name} must be at least 1");
        }
    }
    Ok(Some(ScrapeConfig {
        names,
        path: args.engine_metrics_path.clone(),
        interval: Duration::from_millis(args.engine_metrics_interval_ms),
        jitter: 0.2,
        timeout: Duration::from_millis(args.engine_metrics_timeout_ms),
        concurrency: args.engine_metrics_concurrency.max(1),
        max_body_bytes: 8 << 20,
        stale_after: Duration::from_millis(args.engine_metrics_stale_ms),
    }))
}

/// The core's configuration from flags, with range checks that name the flag.
pub fn core_config(args: &ServeArgs) -> anyhow::Result<CoreConfig> {
    for (name, value) in [
        ("--overlap-score-credit", args.overlap_score_credit),
        ("--prefill-load-scale", args.prefill_load_scale),
        ("--decode-block-weight", args.decode_block_weight),
        (
            "--decode-active-request-weight",
            args.decode_active_request_weight,
        ),
        ("--router-temperature", args.router_temperature),
        ("--stall-weight", args.stall_weight),
        ("--session-soft-margin", args.session_soft_margin),
        ("--engine-waiting-weight", args.engine_waiting_weight),
        ("--engine-kv-usage-weight", args.engine_kv_usage_weight),
        ("--adapter-load-weight", args.adapter_load_weight),
        ("--adapter-full-weight", args.adapter_full_weight),
        ("--pd-transfer-block-cost", args.pd_transfer_block_cost),
        ("--pd-decode-request-weight", args.pd_decode_request_weight),
    ] {
        if !value.is_finite() || value < 0.0 {
            anyhow::bail!("{name} must be a finite number >= 0, got {value}");
        }
    }
    Ok(CoreConfig {
        booking_ttl: Duration::from_secs(args.booking_ttl),
        max_api_bookings: args.max_api_bookings,
        max_api_bookings_per_rank: args.max_api_bookings_per_rank,
        max_prompt_blocks: args.max_prompt_blocks,
        seed: args.seed,
        cost: CostParams {
            overlap_score_credit: args.overlap_score_credit,
            prefill_load_scale: args.prefill_load_scale,
            decode_block_weight: args.decode_block_weight,
            decode_active_request_weight: args.decode_active_request_weight,
            router_temperature: args.router_temperature,
            stall_weight: args.stall_weight,
            ttft_slack: {
                let f = args.ttft_slack;
                if f.is_nan() || f < 1.0 {
                    anyhow::bail!("--ttft-slack must be >= 1 (inf = no bound), got {f}");
                }
                f
            },
            engine_waiting_weight: args.engine_waiting_weight,
            engine_kv_usage_weight: args.engine_kv_usage_weight,
            adapter_load_weight: args.adapter_load_weight,
            adapter_full_weight: args.adapter_full_weight,
            ..CostParams::default()
        },
        estimator: kvpick_core::EstimatorConfig {
            calibrate: args.calibrate,
            ..Default::default()
        },
        busy: BusyThresholds {
            active_decode_blocks: args.active_decode_blocks_threshold,
            active_prefill_tokens: args.active_prefill_tokens_threshold,
            sheddable_fraction: {
                let f = args.sheddable_threshold_fraction;
                if !(f > 0.0 && f <= 1.0) {
                    anyhow::bail!("--sheddable-threshold-fraction must be in (0, 1], got {f}");
                }
                f
            },
        },
        allow_pins: args.allow_pins,
        sessions: {
            let sessions = SessionConfig {
                mode: args.session_affinity_mode,
                ttl: Duration::from_secs(args.session_ttl),
                max_entries: args.session_max_entries,
                soft_margin_blocks: args.session_soft_margin,
            };
            sessions.validate().map_err(anyhow::Error::msg)?;
            sessions
        },
        approx_ttl: Duration::from_secs(args.approx_ttl),
        predicted_ttl: Duration::from_secs(args.predicted_ttl),
        // A replica reading a remote index subscribes to nothing: its own picks are approximate.
        kv_events: args.kv_events == "on" && args.kv_index_remote.is_none(),
        index_max_blocks: args.index_max_blocks,
        engine_metrics_max_age: Duration::from_millis(args.engine_metrics_stale_ms),
        flow: flow_config(args)?,
        pd: kvpick_core::PdConfig {
            threshold_tokens: args.pd_threshold_tokens,
            transfer_block_cost: args.pd_transfer_block_cost,
            decode_request_weight: args.pd_decode_request_weight,
        },
        outlier: outlier_config(args)?,
        bookings: args.bookings.bounds(
            (args.engine_metrics != crate::server::EngineMetricsMode::Off)
                .then(|| Duration::from_millis(args.engine_metrics_interval_ms)),
        )?,
        shared_cache: args.tiers.shared_cache()?,
        kv_transfer_hints: args.tiers.kv_transfer_hints,
        ..CoreConfig::default()
    })
}

/// `--outlier-*`.
pub fn outlier_config(args: &ServeArgs) -> anyhow::Result<kvpick_core::outlier::OutlierConfig> {
    let secs = |name: &str, value: f64| {
        if !(value.is_finite() && value > 0.0 && value <= 86_400.0) {
            anyhow::bail!("{name} must be > 0 and at most 86400 seconds, got {value}");
        }
        Ok(Duration::from_secs_f64(value))
    };
    let base = secs(
        "--outlier-base-ejection-secs",
        args.outlier.outlier_base_ejection_secs,
    )?;
    let max = secs(
        "--outlier-max-ejection-secs",
        args.outlier.outlier_max_ejection_secs,
    )?;
    if max < base {
        anyhow::bail!("--outlier-max-ejection-secs must be at least --outlier-base-ejection-secs");
    }
    if args.outlier.outlier_max_ejected_percent > 100 {
        anyhow::bail!(
            "--outlier-max-ejected-percent must be 0..=100, got {}",
            args.outlier.outlier_max_ejected_percent
        );
    }
    Ok(kvpick_core::outlier::OutlierConfig {
        consecutive_failures: args.outlier.outlier_consecutive_5xx,
        base_ejection: base,
        max_ejection: max,
        max_ejected_percent: args.outlier.outlier_max_ejected_percent,
    })
}

/// `--flow-control`, `--queue-*`, `--saturation-*`.
pub fn flow_config(args: &ServeArgs) -> anyhow::Result<kvpick_core::FlowConfig> {
    let timeout = args.queue_timeout;
    if !(0.0..=3600.0).contains(&timeout) {
        anyhow::bail!("--queue-timeout must be 0..=3600 seconds, got {timeout}");
    }
    let wait = args.saturation_wait;
    if wait.is_nan() || wait <= 0.0 {
        anyhow::bail!("--saturation-wait must be > 0 seconds (inf = off), got {wait}");
    }
    let kv = args.saturation_kv_usage;
    if !(kv > 0.0 && kv <= 1.0) {
        anyhow::bail!("--saturation-kv-usage must be in (0, 1], got {kv}");
    }
    if args.queue_band_capacity == 0 {
        anyhow::bail!("--queue-band-capacity must be at least 1");
    }
    if args.queue_capacity == 0 {
        anyhow::bail!("--queue-capacity must be at least 1");
    }
    if args.hold_when_no_endpoints && !args.flow_control {
        anyhow::bail!("--hold-when-no-endpoints needs --flow-control true (the queue holds them)");
    }
    Ok(kvpick_core::FlowConfig {
        enabled: args.flow_control,
        queue_timeout: Duration::from_secs_f64(timeout),
        band_capacity: args.queue_band_capacity,
        capacity: args.queue_capacity,
        hold_when_no_endpoints: args.hold_when_no_endpoints,
        saturation: kvpick_core::SaturationLimits {
            max_wait_seconds: wait.is_finite().then_some(wait),
            max_active_requests: args.saturation_max_requests,
            engine_waiting: Some(args.saturation_engine_waiting),
            engine_kv_usage: Some(kv),
        },
        ..kvpick_core::FlowConfig::default()
    })
}

/// Where the workers come from.
#[derive(Debug)]
pub enum CatalogSource {
    Static(PathBuf),
    Kubernetes(kube_source::KubeSourceConfig),
}

/// Picks exactly one catalog source from the flags (`namespace_env`: env `NAMESPACE`).
pub fn catalog_source(
    args: &ServeArgs,
    namespace_env: Option<String>,
) -> anyhow::Result<CatalogSource> {
    let kube_flags = args.pool_name.is_some() || args.endpoint_selector.is_some();
    match (&args.config, kube_flags) {
        (Some(_), true) => anyhow::bail!(
            "choose one catalog source: --config (static file) or --pool-name / --endpoint-selector (Kubernetes), not both"
        ),
        (None, false) => anyhow::bail!(
            "no catalog source: pass --config FILE (a static catalog YAML), --pool-name NAME (an InferencePool), or --endpoint-selector K=V,... with --target-ports"
        ),
        (Some(path), false) => {
            for (set, flag) in [
                (!args.target_ports.is_empty(), "--target-ports"),
                (args.model.is_some(), "--model"),
                (args.pool_namespace.is_some(), "--pool-namespace"),
            ] {
                if set {
                    anyhow::bail!("{flag} only applies to the Kubernetes source, not --config");
                }
            }
            Ok(CatalogSource::Static(path.clone()))
        }
        (None, true) => {
            let namespace = match args.pool_namespace.clone().or(namespace_env) {
                Some(ns) if !ns.is_empty() => ns,
                _ => anyhow::bail!(
                    "--pool-namespace is required (or set env NAMESPACE) with the Kubernetes source"
                ),
            };
            if args.model.as_deref() == Some("") {
                anyhow::bail!("--model must not be empty");
            }
            let target = match (&args.pool_name, &args.endpoint_selector) {
                (Some(_), Some(_)) => anyhow::bail!(
                    "--pool-name and --endpoint-selector exclude each other (the pool has its own selector)"
                ),
                (Some(name), None) => {
                    if !args.target_ports.is_empty() {
                        anyhow::bail!("--target-ports goes with --endpoint-selector; with --pool-name the pool's targetPorts apply");
                    }
                    kube_source::Target::Pool { name: name.clone() }
                }
                (None, Some(selector)) => {
                    let selector = kube_source::parse_selector(selector)
                        .context("invalid --endpoint-selector")?;
                    if args.target_ports.is_empty() {
                        anyhow::bail!("--endpoint-selector needs --target-ports PORT[,PORT...]");
                    }
                    kube_source::Target::Selector(
                        kube_source::PoolView::new(selector, args.target_ports.clone())
                            .context("invalid --target-ports")?,
                    )
                }
                (None, None) => unreachable!("kube_flags"),
            };
            Ok(CatalogSource::Kubernetes(kube_source::KubeSourceConfig {
                namespace,
                target,
                model: args.model.clone(),
                resync: KUBE_RESYNC,
                role_label: args.role_label.clone(),
            }))
        }
    }
}

/// Classification settings from flags (`--client-priority`).
pub fn flow_settings(args: &ServeArgs) -> crate::sources::flow::FlowSettings {
    crate::sources::flow::FlowSettings {
        client_priority: args.client_priority,
    }
}

/// What the Kubernetes flow-policy source watches: the InferenceObjective / InferenceModelRewrite
/// resources of the served pool's namespace, when the catalog follows an InferencePool
/// (`--pool-name`) and `--flow-watch-crds` is on. With `--endpoint-selector` there is no pool for
/// a poolRef to name, and with `--config` no Kubernetes at all.
pub fn flow_kube_config(
    args: &ServeArgs,
    catalog: &CatalogSource,
) -> Option<crate::sources::flow::kube::FlowKubeConfig> {
    match catalog {
        CatalogSource::Kubernetes(kube_source::KubeSourceConfig {
            namespace,
            target: kube_source::Target::Pool { name },
            ..
        }) if args.flow_watch_crds => Some(crate::sources::flow::kube::FlowKubeConfig::new(
            namespace, name,
        )),
        _ => None,
    }
}
