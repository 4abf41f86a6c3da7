//! The EPP series of one naming generation, registered on kvpick's registry: `llm_d_epp_*`
//! (llm-d's current names) or the Gateway API Inference Extension names llm-d still exports as
//! deprecated aliases (`inference_objective_*`, `inference_pool_*`, `inference_extension_*`).
//! Names, label sets, units and buckets follow upstream; this file only defines them (the
//! recording is `super`'s).

// Static metric definitions: an error is a programming error every test run hits at start-up.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use prometheus::{
    GaugeVec, Histogram, HistogramOpts, HistogramVec, IntCounterVec, IntGaugeVec, Opts, Registry,
};

/// Which generation of names a [`Series`] carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Generation {
    /// `llm_d_epp_*`: request series labelled `model_name`, `target_model_name`,
    /// `fairness_id`, `priority`.
    LlmD,
    /// `inference_objective_*` / `inference_pool_*` / `inference_extension_*`: request series
    /// labelled `model_name`, `target_model_name` (plus `priority` on the request total).
    Igw,
}

const LATENCY_BUCKETS: &[f64] = &[
    0.005, 0.025, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 1.25, 1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0,
    10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 120.0, 180.0, 240.0, 300.0, 360.0, 480.0, 600.0, 900.0,
    1200.0, 1800.0, 2700.0, 3600.0,
];
const TTFT_BUCKETS: &[f64] = &[
    0.005, 0.025, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 1.25, 1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0,
    10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 120.0,
];
const REQUEST_SIZE_BUCKETS: &[f64] = &[
    64.0,
    128.0,
    256.0,
    512.0,
    1024.0,
    2048.0,
    4096.0,
    8192.0,
    16384.0,
    32768.0,
    65536.0,
    131072.0,
    262144.0,
    524288.0,
    1048576.0,
    2097152.0,
    4194304.0,
    8388608.0,
    16777216.0,
    33554432.0,
    67108864.0,
    134217728.0,
    268435456.0,
    536870912.0,
    1073741824.0,
];
const RESPONSE_SIZE_BUCKETS: &[f64] = &[
    1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0,
    32768.0, 65536.0,
];
const INPUT_TOKEN_BUCKETS: &[f64] = &[
    1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0,
    32768.0, 65536.0, 131072.0, 262144.0, 524288.0, 1048576.0,
];
const OUTPUT_TOKEN_BUCKETS: &[f64] = &[
    1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0,
];
const NTPOT_BUCKETS: &[f64] = &[
    0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0,
];
const SCHEDULER_BUCKETS: &[f64] = &[
    0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1,
];

/// One generation's per-request series. Cheap to clone.
#[derive(Clone)]
pub struct RequestSeries {
    pub request_total: IntCounterVec,
    pub request_errors: IntCounterVec,
    pub duration: HistogramVec,
    pub request_size: HistogramVec,
    pub response_size: HistogramVec,
    pub running: IntGaugeVec,
    /// `llm_d_epp_request_ttft_seconds` (no deprecated alias upstream).
    pub ttft: Option<HistogramVec>,
    pub tokens: TokenSeries,
}

/// One generation's series from the response usage.
#[derive(Clone)]
pub struct TokenSeries {
    pub input: HistogramVec,
    pub output: HistogramVec,
    pub cached: HistogramVec,
    /// Normalized time per output token.
    pub ntpot: HistogramVec,
}

/// One generation's pool, scheduler and flow-control series.
#[derive(Clone)]
pub struct PoolSeries {
    pub ready_endpoints: IntGaugeVec,
    pub average_kv: GaugeVec,
    pub average_queue: GaugeVec,
    pub average_running: GaugeVec,
    pub scheduler_e2e: Histogram,
    pub plugin_duration: HistogramVec,
    pub info: IntGaugeVec,
    pub queue_size: IntGaugeVec,
    pub pool_saturation: GaugeVec,
}

/// One generation's handles.
#[derive(Clone)]
pub struct Series {
    pub generation: Generation,
    pub req: RequestSeries,
    pub pool: PoolSeries,
}

fn reg<T: prometheus::core::Collector + Clone + 'static>(registry: &Registry, c: T) -> T {
    registry
        .register(Box::new(c.clone()))
        .expect("metric names are unique");
    c
}

// Constructors of one registered metric each (`tests/docs/metrics.rs` reads their calls).
fn epp_counter(r: &Registry, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    reg(
        r,
        IntCounterVec::new(Opts::new(name, help), labels).unwrap(),
    )
}

fn epp_gauge(r: &Registry, name: &str, help: &str, labels: &[&str]) -> IntGaugeVec {
    reg(r, IntGaugeVec::new(Opts::new(name, help), labels).unwrap())
}

fn epp_fgauge(r: &Registry, name: &str, help: &str, labels: &[&str]) -> GaugeVec {
    reg(r, GaugeVec::new(Opts::new(name, help), labels).unwrap())
}

fn epp_histogram_vec(
    r: &Registry,
    name: &str,
    help: &str,
    buckets: &[f64],
    labels: &[&str],
) -> HistogramVec {
    let opts = HistogramOpts::new(name, help).buckets(buckets.to_vec());
    reg(r, HistogramVec::new(opts, labels).unwrap())
}

fn epp_histogram(r: &Registry, name: &str, help: &str, buckets: &[f64]) -> Histogram {
    let opts = HistogramOpts::new(name, help).buckets(buckets.to_vec());
    reg(r, Histogram::with_opts(opts).unwrap())
}

impl Series {
    /// Registers `generation`'s series on `registry`.
    pub fn register(registry: &Registry, generation: Generation) -> Self {
        let (req, pool) = match generation {
            Generation::LlmD => (llm_d_requests(registry), llm_d_pool(registry)),
            Generation::Igw => (igw_requests(registry), igw_pool(registry)),
        };
        Series {
            generation,
            req,
            pool,
        }
    }
}

/// llm-d's pool, scheduler and flow-control series.
fn llm_d_pool(r: &Registry) -> PoolSeries {
    PoolSeries {
        ready_endpoints: epp_gauge(
            r,
            "llm_d_epp_ready_endpoints",
            "Ready endpoints in the pool (kvpick: schedulable workers)",
            &["name"],
        ),
        average_kv: epp_fgauge(
            r,
            "llm_d_epp_average_kv_cache_utilization",
            "Mean KV-cache use (0..1) over ranks with a fresh engine reading",
            &["name"],
        ),
        average_queue: epp_fgauge(
            r,
            "llm_d_epp_average_queue_size",
            "Mean requests waiting in the engines' queues (fresh readings)",
            &["name"],
        ),
        average_running: epp_fgauge(
            r,
            "llm_d_epp_average_running_requests",
            "Mean requests running on the engines (fresh readings)",
            &["name"],
        ),
        scheduler_e2e: epp_histogram(
            r,
            "llm_d_epp_scheduler_e2e_duration_seconds",
            "Scheduling latency in seconds: parse and pick (kvpick_pick_latency_seconds)",
            SCHEDULER_BUCKETS,
        ),
        plugin_duration: epp_histogram_vec(
            r,
            "llm_d_epp_plugin_duration_seconds",
            "Latency in seconds of each stage of kvpick's pick",
            SCHEDULER_BUCKETS,
            &["extension_point", "plugin_type", "plugin_name"],
        ),
        info: epp_gauge(
            r,
            "llm_d_epp_info",
            "Build information: 1, labelled with the commit and build ref",
            &["commit", "build_ref"],
        ),
        queue_size: epp_gauge(
            r,
            "llm_d_epp_flow_control_queue_size",
            "Requests held in kvpick's flow-control queue",
            &[
                "fairness_id",
                "priority",
                "inference_pool",
                "model_name",
                "target_model_name",
            ],
        ),
        pool_saturation: epp_fgauge(
            r,
            "llm_d_epp_flow_control_pool_saturation",
            "Pool saturation: 0 idle, 1 at the limits (kvpick_pool_saturation)",
            &["inference_pool"],
        ),
    }
}

/// llm-d's request series, labelled `model_name`, `target_model_name`, `fairness_id`, `priority`.
fn llm_d_requests(r: &Registry) -> RequestSeries {
    RequestSeries {
        request_total: epp_counter(
            r,
            "llm_d_epp_request_total",
            "Total number of requests kvpick answered (routed or refused)",
            &["model_name", "target_model_name", "fairness_id", "priority"],
        ),
        request_errors: epp_counter(
            r,
            "llm_d_epp_request_error_total",
            "Total number of request errors, by error_code",
            &[
                "model_name",
                "target_model_name",
                "fairness_id",
                "priority",
                "error_code",
            ],
        ),
        duration: epp_histogram_vec(
            r,
            "llm_d_epp_request_duration_seconds",
            "End-to-end request latency in seconds, request headers to response end",
            LATENCY_BUCKETS,
            &["model_name", "target_model_name", "fairness_id", "priority"],
        ),
        request_size: epp_histogram_vec(
            r,
            "llm_d_epp_request_size_bytes",
            "Incoming request body size in bytes",
            REQUEST_SIZE_BUCKETS,
            &["model_name", "target_model_name", "fairness_id", "priority"],
        ),
        response_size: epp_histogram_vec(
            r,
            "llm_d_epp_response_size_bytes",
            "Outgoing response body size in bytes",
            RESPONSE_SIZE_BUCKETS,
            &["model_name", "target_model_name", "fairness_id", "priority"],
        ),
        running: epp_gauge(
            r,
            "llm_d_epp_request_running",
            "Requests routed and not yet complete",
            &["model_name", "target_model_name", "fairness_id", "priority"],
        ),
        ttft: Some(epp_histogram_vec(
            r,
            "llm_d_epp_request_ttft_seconds",
            "Time to first token in seconds: request received to first response body byte",
            TTFT_BUCKETS,
            &[
                "model_name",
                "target_model_name",
                "fairness_id",
                "priority",
                "streaming",
            ],
        )),
        tokens: llm_d_tokens(r),
    }
}

/// llm-d's usage series.
fn llm_d_tokens(r: &Registry) -> TokenSeries {
    TokenSeries {
        input: epp_histogram_vec(
            r,
            "llm_d_epp_request_input_tokens",
            "Input (prompt) tokens per request, from the response usage",
            INPUT_TOKEN_BUCKETS,
            &["model_name", "target_model_name", "fairness_id", "priority"],
        ),
        output: epp_histogram_vec(
            r,
            "llm_d_epp_request_output_tokens",
            "Output (completion) tokens per request, from the response usage",
            OUTPUT_TOKEN_BUCKETS,
            &["model_name", "target_model_name", "fairness_id", "priority"],
        ),
        cached: epp_histogram_vec(
            r,
            "llm_d_epp_request_cached_tokens",
            "Prompt tokens read from cache per request, as the model server reports in the usage",
            INPUT_TOKEN_BUCKETS,
            &["model_name", "target_model_name", "fairness_id", "priority"],
        ),
        ntpot: epp_histogram_vec(
            r,
            "llm_d_epp_request_ntpot_seconds",
            "Normalized time per output token in seconds: request latency over output tokens",
            NTPOT_BUCKETS,
            &["model_name", "target_model_name", "fairness_id", "priority"],
        ),
    }
}

/// The deprecated pool, scheduler and flow-control names.
fn igw_pool(r: &Registry) -> PoolSeries {
    PoolSeries {
        ready_endpoints: epp_gauge(
            r,
            "inference_pool_ready_pods",
            "[Deprecated: use llm_d_epp_ready_endpoints]",
            &["name"],
        ),
        average_kv: epp_fgauge(
            r,
            "inference_pool_average_kv_cache_utilization",
            "[Deprecated: use llm_d_epp_average_kv_cache_utilization]",
            &["name"],
        ),
        average_queue: epp_fgauge(
            r,
            "inference_pool_average_queue_size",
            "[Deprecated: use llm_d_epp_average_queue_size]",
            &["name"],
        ),
        average_running: epp_fgauge(
            r,
            "inference_pool_average_running_requests",
            "[Deprecated: use llm_d_epp_average_running_requests]",
            &["name"],
        ),
        scheduler_e2e: epp_histogram(
            r,
            "inference_extension_scheduler_e2e_duration_seconds",
            "[Deprecated: use llm_d_epp_scheduler_e2e_duration_seconds]",
            SCHEDULER_BUCKETS,
        ),
        plugin_duration: epp_histogram_vec(
            r,
            "inference_extension_plugin_duration_seconds",
            "[Deprecated: use llm_d_epp_plugin_duration_seconds]",
            SCHEDULER_BUCKETS,
            &["extension_point", "plugin_type", "plugin_name"],
        ),
        info: epp_gauge(
            r,
            "inference_extension_info",
            "Build information: 1, labelled with the commit and build ref",
            &["commit", "build_ref"],
        ),
        queue_size: epp_gauge(
            r,
            "inference_extension_flow_control_queue_size",
            "[Deprecated: use llm_d_epp_flow_control_queue_size]",
            &[
                "fairness_id",
                "priority",
                "inference_pool",
                "model_name",
                "target_model_name",
            ],
        ),
        pool_saturation: epp_fgauge(
            r,
            "inference_extension_flow_control_pool_saturation",
            "[Deprecated: use llm_d_epp_flow_control_pool_saturation]",
            &["inference_pool"],
        ),
    }
}

/// The deprecated request names, labelled `model_name`, `target_model_name`.
fn igw_requests(r: &Registry) -> RequestSeries {
    RequestSeries {
        request_total: epp_counter(
            r,
            "inference_objective_request_total",
            "[Deprecated: use llm_d_epp_request_total]",
            &["model_name", "target_model_name", "priority"],
        ),
        request_errors: epp_counter(
            r,
            "inference_objective_request_error_total",
            "[Deprecated: use llm_d_epp_request_error_total]",
            &["model_name", "target_model_name", "error_code"],
        ),
        duration: epp_histogram_vec(
            r,
            "inference_objective_request_duration_seconds",
            "[Deprecated: use llm_d_epp_request_duration_seconds]",
            LATENCY_BUCKETS,
            &["model_name", "target_model_name"],
        ),
        request_size: epp_histogram_vec(
            r,
            "inference_objective_request_sizes",
            "[Deprecated: use llm_d_epp_request_size_bytes]",
            REQUEST_SIZE_BUCKETS,
            &["model_name", "target_model_name"],
        ),
        response_size: epp_histogram_vec(
            r,
            "inference_objective_response_sizes",
            "[Deprecated: use llm_d_epp_response_size_bytes]",
            RESPONSE_SIZE_BUCKETS,
            &["model_name", "target_model_name"],
        ),
        running: epp_gauge(
            r,
            "inference_objective_running_requests",
            "[Deprecated: use llm_d_epp_request_running]",
            &["model_name"],
        ),
        ttft: None,
        tokens: igw_tokens(r),
    }
}

/// The deprecated usage names.
fn igw_tokens(r: &Registry) -> TokenSeries {
    TokenSeries {
        input: epp_histogram_vec(
            r,
            "inference_objective_input_tokens",
            "[Deprecated: use llm_d_epp_request_input_tokens]",
            INPUT_TOKEN_BUCKETS,
            &["model_name", "target_model_name"],
        ),
        output: epp_histogram_vec(
            r,
            "inference_objective_output_tokens",
            "[Deprecated: use llm_d_epp_request_output_tokens]",
            OUTPUT_TOKEN_BUCKETS,
            &["model_name", "target_model_name"],
        ),
        cached: epp_histogram_vec(
            r,
            "inference_objective_prompt_cached_tokens",
            "[Deprecated: use llm_d_epp_request_cached_tokens]",
            INPUT_TOKEN_BUCKETS,
            &["model_name", "target_model_name"],
        ),
        ntpot: epp_histogram_vec(
            r,
            "inference_objective_normalized_time_per_output_token_seconds",
            "[Deprecated: use llm_d_epp_request_ntpot_seconds]",
            NTPOT_BUCKETS,
            &["model_name", "target_model_name"],
        ),
    }
}
