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
    pub input_tokens: HistogramVec,
    pub output_tokens: HistogramVec,
    pub cached_tokens: HistogramVec,
    pub running: IntGaugeVec,
    pub ntpot: HistogramVec,
    /// `llm_d_epp_request_ttft_seconds` (no deprecated alias upstream).
    pub ttft: Option<HistogramVec>,
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

fn opts(name: &str, help: &str) -> Opts {
    Opts::new(name, help)
}

fn hopts(name: &str, help: &str, buckets: &[f64]) -> HistogramOpts {
    HistogramOpts::new(name, help).buckets(buckets.to_vec())
}

impl Series {
    /// Registers `generation`'s series on `registry`.
    pub fn register(registry: &Registry, generation: Generation) -> Self {
        match generation {
            Generation::LlmD => Series {
                generation,
                req: llm_d_requests(registry),
                pool: llm_d_pool(registry),
            },
            Generation::Igw => Series {
                generation,
                req: igw_requests(registry),
                pool: igw_pool(registry),
            },
        }
    }
}

fn llm_d_pool(r: &Registry) -> PoolSeries {
    PoolSeries {
        ready_endpoints: reg(r, IntGaugeVec::new(opts("llm_d_epp_ready_endpoints", "The number of ready endpoints in the inference server pool (kvpick: schedulable workers)"), &["name"]).unwrap()),
        average_kv: reg(r, GaugeVec::new(opts("llm_d_epp_average_kv_cache_utilization", "The average kv cache utilization (0..1) over the pool's ranks with a fresh engine reading"), &["name"]).unwrap()),
        average_queue: reg(r, GaugeVec::new(opts("llm_d_epp_average_queue_size", "The average number of requests waiting in the model servers' queues (fresh engine readings)"), &["name"]).unwrap()),
        average_running: reg(r, GaugeVec::new(opts("llm_d_epp_average_running_requests", "The average number of requests running on the model servers (fresh engine readings)"), &["name"]).unwrap()),
        scheduler_e2e: reg(r, Histogram::with_opts(hopts("llm_d_epp_scheduler_e2e_duration_seconds", "End-to-end scheduling latency in seconds (kvpick: parse and pick, as kvpick_pick_latency_seconds)", SCHEDULER_BUCKETS)).unwrap()),
        plugin_duration: reg(r, HistogramVec::new(hopts("llm_d_epp_plugin_duration_seconds", "Latency in seconds of each stage of kvpick's pick (extension_point, plugin_type, plugin_name)", SCHEDULER_BUCKETS), &["extension_point", "plugin_type", "plugin_name"]).unwrap()),
        info: reg(r, IntGaugeVec::new(opts("llm_d_epp_info", "Build information: 1, labelled with the commit and build ref"), &["commit", "build_ref"]).unwrap()),
        queue_size: reg(r, IntGaugeVec::new(opts("llm_d_epp_flow_control_queue_size", "Requests held in kvpick's flow-control queue"), &["fairness_id", "priority", "inference_pool", "model_name", "target_model_name"]).unwrap()),
        pool_saturation: reg(r, GaugeVec::new(opts("llm_d_epp_flow_control_pool_saturation", "Saturation of the pool (0 = idle, 1 = at the --saturation-* limits; as kvpick_pool_saturation)"), &["inference_pool"]).unwrap()),
    }
}

fn llm_d_requests(r: &Registry) -> RequestSeries {
    let request_total = reg(
        r,
        IntCounterVec::new(
            opts(
                "llm_d_epp_request_total",
                "Total number of requests kvpick answered (routed or refused)",
            ),
            &["model_name", "target_model_name", "fairness_id", "priority"],
        )
        .unwrap(),
    );
    let request_errors = reg(
        r,
        IntCounterVec::new(
            opts(
                "llm_d_epp_request_error_total",
                "Total number of request errors, by error_code",
            ),
            &[
                "model_name",
                "target_model_name",
                "fairness_id",
                "priority",
                "error_code",
            ],
        )
        .unwrap(),
    );
    let duration = reg(
        r,
        HistogramVec::new(
            hopts(
                "llm_d_epp_request_duration_seconds",
                "End-to-end request latency in seconds, request headers to response end",
                LATENCY_BUCKETS,
            ),
            &["model_name", "target_model_name", "fairness_id", "priority"],
        )
        .unwrap(),
    );
    let request_size = reg(
        r,
        HistogramVec::new(
            hopts(
                "llm_d_epp_request_size_bytes",
                "Incoming request body size in bytes",
                REQUEST_SIZE_BUCKETS,
            ),
            &["model_name", "target_model_name", "fairness_id", "priority"],
        )
        .unwrap(),
    );
    let response_size = reg(
        r,
        HistogramVec::new(
            hopts(
                "llm_d_epp_response_size_bytes",
                "Outgoing response body size in bytes",
                RESPONSE_SIZE_BUCKETS,
            ),
            &["model_name", "target_model_name", "fairness_id", "priority"],
        )
        .unwrap(),
    );
    let input_tokens = reg(
        r,
        HistogramVec::new(
            hopts(
                "llm_d_epp_request_input_tokens",
                "Input (prompt) tokens per request, from the response usage",
                INPUT_TOKEN_BUCKETS,
            ),
            &["model_name", "target_model_name", "fairness_id", "priority"],
        )
        .unwrap(),
    );
    let output_tokens = reg(
        r,
        HistogramVec::new(
            hopts(
                "llm_d_epp_request_output_tokens",
                "Output (completion) tokens per request, from the response usage",
                OUTPUT_TOKEN_BUCKETS,
            ),
            &["model_name", "target_model_name", "fairness_id", "priority"],
        )
        .unwrap(),
    );
    let cached_tokens = reg(r, HistogramVec::new(hopts("llm_d_epp_request_cached_tokens", "Prompt tokens read from cache per request, as the model server reports in the usage", INPUT_TOKEN_BUCKETS), &["model_name", "target_model_name", "fairness_id", "priority"]).unwrap());
    let running = reg(
        r,
        IntGaugeVec::new(
            opts(
                "llm_d_epp_request_running",
                "Requests routed and not yet complete",
            ),
            &["model_name", "target_model_name", "fairness_id", "priority"],
        )
        .unwrap(),
    );
    let ntpot = reg(
        r,
        HistogramVec::new(
            hopts(
                "llm_d_epp_request_ntpot_seconds",
                "Normalized time per output token in seconds: request latency over output tokens",
                NTPOT_BUCKETS,
            ),
            &["model_name", "target_model_name", "fairness_id", "priority"],
        )
        .unwrap(),
    );
    let ttft = reg(
        r,
        HistogramVec::new(
            hopts(
                "llm_d_epp_request_ttft_seconds",
                "Time to first token in seconds: request received to first response body byte",
                TTFT_BUCKETS,
            ),
            &[
                "model_name",
                "target_model_name",
                "fairness_id",
                "priority",
                "streaming",
            ],
        )
        .unwrap(),
    );
    RequestSeries {
        request_total,
        request_errors,
        duration,
        request_size,
        response_size,
        input_tokens,
        output_tokens,
        cached_tokens,
        running,
        ntpot,
        ttft: Some(ttft),
    }
}

fn igw_pool(r: &Registry) -> PoolSeries {
    PoolSeries {
        ready_endpoints: reg(r, IntGaugeVec::new(opts("inference_pool_ready_pods", "[Deprecated: use llm_d_epp_ready_endpoints] The number of ready pods in the inference server pool"), &["name"]).unwrap()),
        average_kv: reg(r, GaugeVec::new(opts("inference_pool_average_kv_cache_utilization", "[Deprecated: use llm_d_epp_average_kv_cache_utilization] The average kv cache utilization for an inference server pool"), &["name"]).unwrap()),
        average_queue: reg(r, GaugeVec::new(opts("inference_pool_average_queue_size", "[Deprecated: use llm_d_epp_average_queue_size] The average number of requests pending in the model server queue"), &["name"]).unwrap()),
        average_running: reg(r, GaugeVec::new(opts("inference_pool_average_running_requests", "[Deprecated: use llm_d_epp_average_running_requests] The average number of running requests across model servers in the pool"), &["name"]).unwrap()),
        scheduler_e2e: reg(r, Histogram::with_opts(hopts("inference_extension_scheduler_e2e_duration_seconds", "[Deprecated: use llm_d_epp_scheduler_e2e_duration_seconds] End-to-end scheduling latency in seconds", SCHEDULER_BUCKETS)).unwrap()),
        plugin_duration: reg(r, HistogramVec::new(hopts("inference_extension_plugin_duration_seconds", "[Deprecated: use llm_d_epp_plugin_duration_seconds] Plugin processing latency in seconds", SCHEDULER_BUCKETS), &["extension_point", "plugin_type", "plugin_name"]).unwrap()),
        info: reg(r, IntGaugeVec::new(opts("inference_extension_info", "General information of the current build: 1, labelled with the commit and build ref"), &["commit", "build_ref"]).unwrap()),
        queue_size: reg(r, IntGaugeVec::new(opts("inference_extension_flow_control_queue_size", "[Deprecated: use llm_d_epp_flow_control_queue_size] Requests held in the flow-control queue"), &["fairness_id", "priority", "inference_pool", "model_name", "target_model_name"]).unwrap()),
        pool_saturation: reg(r, GaugeVec::new(opts("inference_extension_flow_control_pool_saturation", "[Deprecated: use llm_d_epp_flow_control_pool_saturation] Saturation of the pool"), &["inference_pool"]).unwrap()),
    }
}

fn igw_requests(r: &Registry) -> RequestSeries {
    let request_total = reg(r, IntCounterVec::new(opts("inference_objective_request_total", "[Deprecated: use llm_d_epp_request_total] Counter of requests broken out for each model and target model"), &["model_name", "target_model_name", "priority"]).unwrap());
    let request_errors = reg(r, IntCounterVec::new(opts("inference_objective_request_error_total", "[Deprecated: use llm_d_epp_request_error_total] Counter of request errors broken out for each model and target model"), &["model_name", "target_model_name", "error_code"]).unwrap());
    let duration = reg(
        r,
        HistogramVec::new(
            hopts(
                "inference_objective_request_duration_seconds",
                "[Deprecated: use llm_d_epp_request_duration_seconds] Response latency in seconds",
                LATENCY_BUCKETS,
            ),
            &["model_name", "target_model_name"],
        )
        .unwrap(),
    );
    let request_size = reg(
        r,
        HistogramVec::new(
            hopts(
                "inference_objective_request_sizes",
                "[Deprecated: use llm_d_epp_request_size_bytes] Request size in bytes",
                REQUEST_SIZE_BUCKETS,
            ),
            &["model_name", "target_model_name"],
        )
        .unwrap(),
    );
    let response_size = reg(
        r,
        HistogramVec::new(
            hopts(
                "inference_objective_response_sizes",
                "[Deprecated: use llm_d_epp_response_size_bytes] Response size in bytes",
                RESPONSE_SIZE_BUCKETS,
            ),
            &["model_name", "target_model_name"],
        )
        .unwrap(),
    );
    let input_tokens = reg(
        r,
        HistogramVec::new(
            hopts(
                "inference_objective_input_tokens",
                "[Deprecated: use llm_d_epp_request_input_tokens] Input token count per request",
                INPUT_TOKEN_BUCKETS,
            ),
            &["model_name", "target_model_name"],
        )
        .unwrap(),
    );
    let output_tokens = reg(
        r,
        HistogramVec::new(
            hopts(
                "inference_objective_output_tokens",
                "[Deprecated: use llm_d_epp_request_output_tokens] Output token count per request",
                OUTPUT_TOKEN_BUCKETS,
            ),
            &["model_name", "target_model_name"],
        )
        .unwrap(),
    );
    let cached_tokens = reg(r, HistogramVec::new(hopts("inference_objective_prompt_cached_tokens", "[Deprecated: use llm_d_epp_request_cached_tokens] Prompt cached token count per request", INPUT_TOKEN_BUCKETS), &["model_name", "target_model_name"]).unwrap());
    let running = reg(r, IntGaugeVec::new(opts("inference_objective_running_requests", "[Deprecated: use llm_d_epp_request_running] Number of running requests for each model"), &["model_name"]).unwrap());
    let ntpot = reg(r, HistogramVec::new(hopts("inference_objective_normalized_time_per_output_token_seconds", "[Deprecated: use llm_d_epp_request_ntpot_seconds] Latency over output tokens in seconds", NTPOT_BUCKETS), &["model_name", "target_model_name"]).unwrap());
    RequestSeries {
        request_total,
        request_errors,
        duration,
        request_size,
        response_size,
        input_tokens,
        output_tokens,
        cached_tokens,
        running,
        ntpot,
        ttft: None,
    }
}
