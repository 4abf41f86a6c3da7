//! `kvpick serve`: wires the selection core to its catalog source and hosts, binds the three
//! ports (ext_proc + health + selection API, health, metrics), and runs until SIGTERM/SIGINT, then
//! drains: readiness goes NOT_SERVING and new ext_proc streams are refused while every port keeps
//! answering (so probes and Envoy's health checks see NOT_SERVING, not a refused connection); open
//! streams get a bounded grace; then the listeners close and the process exits. The entry is
//! `entry`: [`serve`] for the process, [`run`] for listeners and a shutdown signal a caller (a
//! test) provides.

use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::{Args, ValueEnum};

use crate::selection::AffinityMode;

mod bookings;
mod config;
mod entry;
mod memory;
mod outlier_args;
mod ports;
pub mod settings;
mod tasks;
mod tier_args;
mod tls_args;

pub use entry::{run, serve};
pub use ports::Listeners;

pub use config::{
    catalog_source, core_config, flow_config, flow_kube_config, flow_settings, outlier_config,
    scrape_config, CatalogSource,
};

#[derive(Debug, Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum LogFormat {
    Text,
    Json,
}

/// Flags of `kvpick serve` (names follow the GIE endpoint picker where they overlap).
#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// Static catalog: YAML file with a `workers:` list (docs/configuration.md). Re-read when it changes.
    #[arg(
        long,
        visible_alias = "config-file",
        value_name = "FILE",
        env = "KVPICK_CONFIG"
    )]
    pub config: Option<PathBuf>,

    /// Settings file: YAML mapping any of these flags by its long name to a value
    /// (`queue-timeout: 30`, `session-headers: [a, b]`, booleans as true/false). Flags and
    /// environment variables win over it. Re-read when it changes: cost weights, busy thresholds,
    /// saturation limits, the queue timeout and the soft session margin apply live; other changes
    /// are logged as needing a restart; an invalid version keeps the last good one
    /// (docs/configuration.md#settings-file).
    #[arg(long, value_name = "FILE", env = "KVPICK_SETTINGS")]
    pub settings: Option<PathBuf>,

    /// What `--settings` contributed (set by [`crate::server::settings::apply`], not a flag).
    #[arg(skip)]
    pub settings_loaded: Option<Arc<crate::server::settings::Loaded>>,

    /// Tokenization of text and chat prompts: YAML file with a `tokenizers:` list (per model:
    /// tokenizer_dir, or tokenizer_json, chat_template[_file], bos/eos_token; add_special_tokens,
    /// render_url). Without it (or --tokenizer-dir), text prompts are hashed as pseudo tokens
    /// (docs/tokenization.md).
    #[arg(long, value_name = "FILE", env = "KVPICK_TOKENIZER_CONFIG")]
    pub tokenizer_config: Option<PathBuf>,

    /// A model's tokenizer from its HuggingFace model directory, as `[MODEL=]DIR` (repeatable):
    /// tokenizer.json, bos/eos and the other special tokens, and the chat template
    /// (chat_template.jinja, chat_template.json or tokenizer_config.json) read as transformers
    /// reads them. MODEL is the request `model` (default: DIR as written, vLLM's served name for
    /// `--model DIR`). Adds to --tokenizer-config's models; a model in both is an error.
    #[arg(long, value_name = "[MODEL=]DIR")]
    pub tokenizer_dir: Vec<String>,

    /// Request bodies larger than this are not tokenized: they are routed on load alone
    /// (counted in `kvpick_tokenize_skipped_total{reason="body_too_large"}`).
    #[arg(long, default_value_t = crate::tokenize::DEFAULT_TOKENIZE_MAX_BODY_BYTES, value_name = "BYTES")]
    pub tokenize_max_body_bytes: usize,

    /// Bytes of request bodies the tokenizer threads (one per core) may have queued or running.
    /// A request waits for its tokens; one that would take the total over this is routed on load
    /// alone at once (`kvpick_tokenize_skipped_total{reason="queue_full"}`), so the wait is
    /// bounded by this much tokenization work. Default: 4 MiB per tokenizer thread.
    #[arg(long, value_name = "BYTES")]
    pub tokenize_queue_max_bytes: Option<usize>,

    /// A queued request is routed on load alone when no tokenizer thread has started or finished
    /// any job for this many milliseconds: the pool is stuck, not busy
    /// (`kvpick_tokenize_skipped_total{reason="queue_stalled"}`). A started job is always
    /// waited for. Replaces the fixed queue wait of --tokenize-queue-timeout-ms (its old names
    /// still set this).
    #[arg(
        long,
        default_value_t = 5000,
        value_name = "MS",
        alias = "tokenize-queue-timeout-ms",
        alias = "tokenize-permit-timeout-ms"
    )]
    pub tokenize_stall_ms: u64,

    /// Kubernetes source: the InferencePool (`inference.networking.k8s.io/v1`) whose pods are the
    /// workers. Excludes --config.
    #[arg(long, value_name = "NAME", help_heading = "Kubernetes")]
    pub pool_name: Option<String>,

    /// Namespace of the pool (or of the pods, with --endpoint-selector); default: env `NAMESPACE`.
    #[arg(long, value_name = "NS", help_heading = "Kubernetes")]
    pub pool_namespace: Option<String>,

    /// Kubernetes source without the CRD: pods matching `k=v,...` are the workers (with --target-ports).
    #[arg(long, value_name = "K=V,...", help_heading = "Kubernetes")]
    pub endpoint_selector: Option<String>,

    /// With --endpoint-selector: the model-server ports, one per data-parallel rank (1..=8).
    #[arg(
        long,
        value_delimiter = ',',
        value_name = "PORT,...",
        help_heading = "Kubernetes"
    )]
    pub target_ports: Vec<u16>,

    /// Model served by every selected pod; default: each pod's `kvpick.io/model` annotation (or label).
    #[arg(long, value_name = "NAME", help_heading = "Kubernetes")]
    pub model: Option<String>,

    /// For tests and local use only: talk to this Kubernetes API URL (e.g. `http://127.0.0.1:8001`
    /// from `kubectl proxy`) without credentials, instead of the in-cluster/kubeconfig default.
    #[arg(long, value_name = "URL", hide = true)]
    pub kube_api_url: Option<String>,

    /// Flow control: YAML file of objectives (`name`, `priority`) and model rewrite rules
    /// (`matches` -> weighted `targets`), see docs/flow-control.md. Validated at start-up (an
    /// invalid file fails it); re-read every --catalog-poll-ms, a bad edit is logged and the last
    /// good policy kept.
    #[arg(
        long,
        value_name = "FILE",
        env = "KVPICK_FLOW_CONFIG",
        help_heading = "Flow control"
    )]
    pub flow_config: Option<PathBuf>,

    /// With --pool-name: also watch InferenceObjective (`llm-d.ai/v1`, `llm-d.ai/v1alpha2`,
    /// `inference.networking.x-k8s.io/v1alpha2`) and InferenceModelRewrite (both groups) in the
    /// pool's namespace, keeping those that target the pool (poolRef, poolRefs, or poolSelector on
    /// the pool's labels); with both groups installed only llm-d.ai counts. They override
    /// --flow-config entries of the same name. A CRD that is not installed is retried with
    /// backoff, never fatal. `false`: no watch (and no RBAC needed for them).
    #[arg(
        long,
        default_value_t = true,
        action = clap::ArgAction::Set,
        value_name = "BOOL",
        help_heading = "Flow control"
    )]
    pub flow_watch_crds: bool,

    /// Honour the client-supplied `x-dynamo-request-priority` header (negative = sheddable); it
    /// overrides the priority of the objective the request names. `false`: the header is ignored
    /// and only objectives (operator-defined) set a priority. See docs/security.md.
    #[arg(
        long,
        default_value_t = true,
        action = clap::ArgAction::Set,
        value_name = "BOOL",
        help_heading = "Flow control"
    )]
    pub client_priority: bool,

    /// Address every port binds to.
    #[arg(long, default_value = "0.0.0.0", value_name = "IP")]
    pub bind: IpAddr,

    /// ext_proc gRPC port (also serves gRPC health and the kvpick.v1.Selection API). 0 = any free port.
    #[arg(long, default_value_t = 9002)]
    pub grpc_port: u16,

    /// gRPC health port (plaintext): liveness, readiness, inference-extension, ext_proc services.
    #[arg(long, default_value_t = 9003)]
    pub grpc_health_port: u16,

    /// Prometheus metrics port (`/metrics`).
    #[arg(long, default_value_t = 9090)]
    pub metrics_port: u16,

    /// Metric families `/metrics` exports, comma-separated: `kvpick` (kvpick's own series), `epp` (llm-d's `llm_d_epp_*` EPP contract), `igw` (the deprecated Gateway API Inference Extension names `inference_objective_*`, `inference_pool_*`, `inference_extension_*`).
    #[arg(long, default_value = "kvpick,epp", value_name = "LIST")]
    pub metrics_families: crate::observability::epp_metrics::Families,

    /// TLS on the ext_proc port, and who may connect to it.
    #[command(flatten)]
    pub tls: tls_args::TlsArgs,

    /// Largest request body accepted; larger requests get 413.
    #[arg(long, default_value_t = 32 << 20, value_name = "BYTES")]
    pub max_body_bytes: usize,

    /// Request-body bytes all ext_proc streams together may buffer; a request whose body would
    /// go over it gets 503 (`request body budget exhausted, retry later`).
    #[arg(long, default_value_t = crate::hosts::extproc::DEFAULT_BUDGET_BYTES, value_name = "BYTES")]
    pub max_buffered_body_bytes: usize,

    /// Streams per connection and in the whole process, and the idle timeout before routing.
    #[command(flatten)]
    pub ext_proc_streams: crate::hosts::extproc::bounds::StreamArgs,

    /// How long a booking's load is believed without the engine's evidence.
    #[command(flatten)]
    pub bookings: bookings::BookingArgs,

    /// KV outside a rank's own tiers: a model's shared KV store.
    #[command(flatten)]
    pub tiers: tier_args::TierArgs,

    /// Bounds on connections and on what a client may make the HTTP/2 layer decode.
    #[command(flatten)]
    pub conn: crate::transport::net::ConnArgs,

    #[command(flatten)]
    pub memory: crate::transport::memory_account::MemoryArgs,

    /// OpenTelemetry tracing of the request path (off by default).
    #[command(flatten)]
    pub tracing: crate::observability::telemetry::TraceArgs,

    /// Extra fallback endpoints appended to x-gateway-destination-endpoint, in preference order.
    #[arg(long, default_value_t = 0, value_name = "N")]
    pub fallbacks: usize,

    /// Emit the candidates' scores in the ext_proc response's `envoy.lb` dynamic metadata under
    /// `x-gateway-destination-endpoint-scores` (llm-d-router's flag and key): a struct of
    /// `ip:port` -> 1 / (1 + cost), higher is better (docs/headers.md#endpoint-scores).
    #[arg(long)]
    pub emit_endpoint_scores: bool,

    /// With --emit-endpoint-scores: at most this many endpoints carry a score (the destinations,
    /// then the best other candidates), 1..=1024.
    #[arg(long, default_value_t = DEFAULT_ENDPOINT_SCORES_LIMIT, value_name = "N", value_parser = endpoint_scores_limit)]
    pub endpoint_scores_limit: usize,

    /// Prefill/decode disaggregation: the headers that name the prefill rank of a pair. `llm-d`:
    /// `x-prefiller-host-port` (llm-d's routing sidecar); `dynamo`: `x-dynamo-prefill-instance-id`,
    /// `x-dynamo-prefill-dp-rank`, `x-dynamo-routing-mode`. Only partitions whose workers declare
    /// roles (`role:` / `--role-label`) are ever split.
    #[arg(
        long,
        default_value = "llm-d",
        value_name = "llm-d|dynamo",
        help_heading = "Prefill/decode"
    )]
    pub pd_protocol: crate::hosts::extproc::PdProtocol,

    /// Disaggregate only when at least this many prompt tokens are not cached on the decode rank.
    #[arg(long, default_value_t = kvpick_core::PdConfig::default().threshold_tokens, value_name = "TOKENS", help_heading = "Prefill/decode")]
    pub pd_threshold_tokens: u64,

    /// Cost of transferring one KV block from the prefill to the decode rank, in blocks of
    /// uncached prefill (the pair decision adds it to the prefill rank's cost).
    #[arg(long, default_value_t = kvpick_core::PdConfig::default().transfer_block_cost, value_name = "BLOCKS", help_heading = "Prefill/decode")]
    pub pd_transfer_block_cost: f64,

    /// Weight of one active request on a decode rank (it lengthens every decode step), in blocks.
    #[arg(long, default_value_t = kvpick_core::PdConfig::default().decode_request_weight, value_name = "BLOCKS", help_heading = "Prefill/decode")]
    pub pd_decode_request_weight: f64,

    /// Kubernetes: the pod label naming a pod's role (`prefill`, `decode`, `both`/`prefill-decode`;
    /// absent = both). Annotation `kvpick.io/data-parallel-roles` gives one role per DP rank.
    #[arg(long, default_value = crate::sources::catalog::kube::DEFAULT_ROLE_LABEL, value_name = "KEY", help_heading = "Kubernetes")]
    pub role_label: String,

    /// Seconds after which a gRPC API booking that was never freed is reaped. ext_proc bookings
    /// never expire: each is freed when its stream ends, however long the response runs.
    #[arg(long, default_value_t = 300, value_name = "SECONDS")]
    pub booking_ttl: u64,

    /// Most live bookings gRPC API callers may hold at once (`SelectAndReserve` past it is
    /// RESOURCE_EXHAUSTED until some are freed or expire).
    #[arg(long, default_value_t = 10_000, value_name = "N")]
    pub max_api_bookings: usize,

    /// Most leading KV blocks of one prompt that are hashed, matched against the index and
    /// inserted (the load of the whole prompt still counts). Bounds the work and index churn of
    /// one huge prompt.
    #[arg(long, default_value_t = 16_384, value_name = "BLOCKS")]
    pub max_prompt_blocks: usize,

    /// Seed for sampling (`--router-temperature`, reproducible picks); default: random.
    #[arg(long, value_name = "N")]
    pub seed: Option<u64>,

    /// Cost: credit per cached block against the prompt's prefill blocks.
    #[arg(
        long,
        default_value_t = 1.0,
        value_name = "X",
        help_heading = "Scheduling"
    )]
    pub overlap_score_credit: f64,

    /// Cost: weight of the uncached prefill term.
    #[arg(
        long,
        default_value_t = 1.0,
        value_name = "X",
        help_heading = "Scheduling"
    )]
    pub prefill_load_scale: f64,

    /// Cost: weight of each active KV block on a rank (decode load), against one uncached prefill
    /// block. ARCHITECTURE.md §4 uses 1.0; prefill costs engines far more than held blocks.
    #[arg(
        long,
        default_value_t = crate::selection::DEFAULT_DECODE_BLOCK_WEIGHT,
        value_name = "X",
        help_heading = "Scheduling"
    )]
    pub decode_block_weight: f64,

    /// Cost: weight per active request on a rank.
    #[arg(
        long,
        default_value_t = 0.0,
        value_name = "X",
        help_heading = "Scheduling"
    )]
    pub decode_active_request_weight: f64,

    /// Cost: weight of the stall a pick's own uncached prefill inflicts on each request already
    /// decoding on the rank, against the pick's own time to first token (1 = a second of
    /// another request's delay counts like a second of this one's; 0 = TTFT only).
    #[arg(
        long,
        default_value_t = 1.0,
        value_name = "X",
        help_heading = "Scheduling"
    )]
    pub stall_weight: f64,

    /// The stall may move a pick only to a rank whose own predicted TTFT is at most this factor of
    /// the best candidate's (ranks beyond rank after all within); `inf` = no bound, 1 = fastest
    /// first token first.
    #[arg(
        long,
        default_value_t = kvpick_core::CostParams::default().ttft_slack,
        value_name = "F",
        help_heading = "Scheduling"
    )]
    pub ttft_slack: f64,

    /// Calibrate the TTFT estimator from observed first response bytes (per partition line,
    /// per rank scale); `false` keeps the prior line and treats every rank alike.
    #[arg(
        long,
        default_value_t = true,
        action = clap::ArgAction::Set,
        value_name = "BOOL",
        help_heading = "Scheduling"
    )]
    pub calibrate: bool,

    /// 0 = always the cheapest rank (random among ties); T > 0 samples with softmax over costs.
    #[arg(
        long,
        default_value_t = 0.0,
        value_name = "T",
        help_heading = "Scheduling"
    )]
    pub router_temperature: f64,

    /// A rank with this many active decode blocks or more takes no new requests (429 when all do).
    #[arg(long, value_name = "BLOCKS", help_heading = "Scheduling")]
    pub active_decode_blocks_threshold: Option<u64>,

    /// A rank with this many queued prefill tokens or more takes no new requests.
    #[arg(long, value_name = "TOKENS", help_heading = "Scheduling")]
    pub active_prefill_tokens_threshold: Option<u64>,

    /// Sheddable requests (negative `x-dynamo-request-priority`) see the busy thresholds scaled
    /// by this, so they get 429 before critical requests do.
    #[arg(
        long,
        default_value_t = 0.8,
        value_name = "F",
        help_heading = "Scheduling"
    )]
    pub sheddable_threshold_fraction: f64,

    /// Flow control: when every eligible rank is saturated (see `--saturation-*`), hold the
    /// request in kvpick (the ext_proc stream waits) and release waiting requests by priority,
    /// fairly across fairness keys, as capacity frees. `false`: dispatch at once; only the busy
    /// thresholds refuse (429).
    #[arg(
        long,
        default_value_t = true,
        action = clap::ArgAction::Set,
        value_name = "BOOL",
        help_heading = "Flow control"
    )]
    pub flow_control: bool,

    /// Longest a request waits in the queue; then 503, or 429 for a sheddable request
    /// (negative priority).
    #[arg(
        long,
        default_value_t = 30.0,
        value_name = "SECONDS",
        help_heading = "Flow control"
    )]
    pub queue_timeout: f64,

    /// Most requests waiting per priority band; an arrival to a full band is refused at once
    /// (503, 429 sheddable).
    #[arg(
        long,
        default_value_t = 10_000,
        value_name = "N",
        help_heading = "Flow control"
    )]
    pub queue_band_capacity: usize,

    /// Most requests waiting in all of kvpick's queues together (every band and model); an
    /// arrival that would wait past it is refused at once (503, 429 sheddable). Each waiting
    /// request holds its body (within --body-budget-bytes) and its prompt's block hashes.
    #[arg(
        long,
        default_value_t = 10_000,
        value_name = "N",
        help_heading = "Flow control"
    )]
    pub queue_capacity: usize,

    /// A model with no ready rank (a pool scaled to zero, every pod gone or not ready) queues
    /// its requests for up to --queue-timeout, released when a rank becomes ready, instead of a
    /// 503 at once: scale-from-zero with KEDA or an HPA on kvpick's queue metrics. At most 16
    /// models without a ready rank hold requests (client-chosen names cannot grow it further).
    /// Needs --flow-control.
    #[arg(long, help_heading = "Flow control")]
    pub hold_when_no_endpoints: bool,

    /// A rank is saturated when the prefill already booked on it would take this long at the
    /// calibrated TTFT line (its queue wait); `inf` = never on this ground. It bounds the engine
    /// queue a released request sits behind (lower = priorities enforced more tightly) while
    /// keeping a prefill batch or more queued so engines never idle.
    #[arg(
        long,
        default_value_t = 0.5,
        value_name = "SECONDS",
        help_heading = "Flow control"
    )]
    pub saturation_wait: f64,

    /// A rank is saturated with this many booked requests (this replica's and, with
    /// `--shared-state`, the others'). Unset: no such bound.
    #[arg(long, value_name = "N", help_heading = "Flow control")]
    pub saturation_max_requests: Option<u64>,

    /// With `--engine-metrics`: a rank whose engine reports this many waiting requests is
    /// saturated (fresh readings only).
    #[arg(
        long,
        default_value_t = 8,
        value_name = "N",
        help_heading = "Flow control"
    )]
    pub saturation_engine_waiting: u64,

    /// With `--engine-metrics`: a rank whose engine reports this KV-cache usage (0..1) is
    /// saturated (fresh readings only).
    #[arg(
        long,
        default_value_t = 0.95,
        value_name = "F",
        help_heading = "Flow control"
    )]
    pub saturation_kv_usage: f64,

    /// Honour explicit pins (`x-dynamo-worker-instance-id` [+ `x-dynamo-dp-rank`]); off = ignored.
    #[arg(long, help_heading = "Scheduling")]
    pub allow_pins: bool,

    /// Accept `UpsertWorker` / `DeleteWorker` on the gRPC selection API. Off by default: whoever
    /// can reach the gRPC port could otherwise add endpoints that Envoy then sends traffic to.
    #[arg(long)]
    pub worker_api: bool,

    /// Outlier detection's flags.
    #[command(flatten)]
    pub outlier: outlier_args::OutlierArgs,

    /// Accept `SelectAndReserve`, `Free` and `PrefillComplete` on the gRPC selection API (callers
    /// that route themselves and book load). Off by default: a booking is load, so whoever can
    /// reach the gRPC port could otherwise saturate every rank. Read-only RPCs (`Select`,
    /// `OverlapScores`, `ListWorkers`, `Loads`) are always served. For trusted callers only;
    /// restrict the port with a NetworkPolicy.
    #[arg(long)]
    pub selection_api: bool,

    /// Most live API bookings on one rank: past it the rank takes no API booking
    /// (`SelectAndReserve` is RESOURCE_EXHAUSTED when every rank is at it).
    #[arg(long, default_value_t = 64, value_name = "N")]
    pub max_api_bookings_per_rank: u32,

    /// Seconds a routed prompt's blocks count as cached on its rank (no KV events).
    #[arg(
        long,
        default_value_t = 120,
        value_name = "SECONDS",
        help_heading = "Scheduling"
    )]
    pub approx_ttl: u64,

    /// Session affinity: `hard` keeps a session on its rank while that rank is schedulable and
    /// allowed; `soft` lets the cost function move it under overload.
    #[arg(long, value_parser = affinity_mode, default_value = "hard", help_heading = "Sessions")]
    pub session_affinity_mode: AffinityMode,

    /// Idle seconds after which a session binding expires (1 .. 31536000); the clock starts when
    /// the session's last in-flight request ends.
    #[arg(
        long,
        default_value_t = 300,
        value_name = "SECONDS",
        help_heading = "Sessions"
    )]
    pub session_ttl: u64,

    /// Most session bindings kept; past it the binding idle longest makes room, and only a table
    /// full of sessions with requests in flight routes new sessions without affinity (counted).
    #[arg(
        long,
        default_value_t = 65_536,
        value_name = "N",
        help_heading = "Sessions"
    )]
    pub session_max_entries: usize,

    /// Request headers carrying a session id, in order of preference (docs/sessions.md).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "x-dynamo-session-id,x-claude-code-session-id,session-id,thread-id,x-session-id",
        value_name = "H1,H2",
        help_heading = "Sessions"
    )]
    pub session_headers: Vec<String>,

    /// Each session header's parent-session header, `SESSION=PARENT` (empty: no parents).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "x-dynamo-session-id=x-dynamo-parent-session-id,x-claude-code-session-id=x-claude-code-parent-agent-id,thread-id=x-codex-parent-thread-id,x-session-id=x-parent-session-id",
        value_name = "S=P,..",
        help_heading = "Sessions"
    )]
    pub session_parent_headers: Vec<String>,

    /// Headers naming an agent (a child session `<session>/<agent>`) inside a session,
    /// `SESSION=AGENT`; with one, the session's parent header names the parent agent.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "x-claude-code-session-id=x-claude-code-agent-id",
        value_name = "S=A,..",
        help_heading = "Sessions"
    )]
    pub session_agent_headers: Vec<String>,

    /// Headers whose value `true` marks a session's last request: its binding is released
    /// once it is routed (empty: none).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "x-dynamo-session-final",
        value_name = "H1,H2",
        help_heading = "Sessions"
    )]
    pub session_final_headers: Vec<String>,

    /// Soft mode: keep the bound rank while its cost is within this many blocks of the best;
    /// either mode: how much costlier a child session's parent rank may be for its first pick.
    #[arg(
        long,
        default_value_t = 64.0,
        value_name = "BLOCKS",
        help_heading = "Sessions"
    )]
    pub session_soft_margin: f64,

    /// Subscribe to the engines' KV events (workers with a `kv_events` endpoint) for precise
    /// routing; `off` routes every worker in approximate mode from kvpick's own decisions.
    #[arg(long, default_value = "on", value_parser = ["on", "off"], help_heading = "KV cache")]
    pub kv_events: String,

    /// Bound on a predicted block's life, in seconds. A pick on a rank whose KV events flow
    /// predicts the prompt's blocks there; they live until the engine's own events confirm them
    /// or the request ends (then the unconfirmed ones go). This bounds only a booking whose end
    /// never comes (default: as long as an unfreed API booking, `--booking-ttl`).
    #[arg(
        long,
        default_value_t = kvpick_core::DEFAULT_PREDICTED_TTL.as_secs(),
        value_name = "SECONDS",
        help_heading = "KV cache"
    )]
    pub predicted_ttl: u64,

    /// Most blocks kept in each model's KV index (least recently used evicted).
    #[arg(long, default_value_t = 1 << 20, value_name = "N", help_heading = "Scheduling")]
    pub index_max_blocks: usize,

    /// Let the kernel back kvpick's memory with transparent huge pages. Off by default (Linux:
    /// prctl PR_SET_THP_DISABLE at start): with them, each first touch of fresh heap zeroes a
    /// 2 MiB page inside the allocation; on VMs that back memory lazily (Firecracker) that took
    /// tens of ms a page and made a loaded kvpick fall behind and collapse. On bare metal they
    /// save 6-15% CPU per 32 KB request (docs/benchmarks.md, "Huge pages off").
    #[arg(long, env = "KVPICK_HUGE_PAGES", help_heading = "Scheduling")]
    pub huge_pages: bool,

    /// Gateway API Inference Extension conformance hooks: honour `test-epp-endpoint-selection` and
    /// echo `x-conformance-test-served-endpoint`. Never enable in production.
    #[arg(long)]
    pub conformance_test_mode: bool,

    /// Share session bindings and booked load with the other replicas through Redis or Valkey:
    /// `redis://[USER:PASSWORD@]HOST:PORT[/DB]`, `rediss://` (TLS; `#insecure` skips certificate
    /// checks), `valkey://`, `valkeys://`, `unix:///PATH`. Unset: every replica keeps its own,
    /// in-process state (the default).
    #[arg(
        long,
        value_name = "URL",
        env = "KVPICK_SHARED_STATE",
        help_heading = "Replicas"
    )]
    pub shared_state: Option<String>,

    /// File holding the Redis password (e.g. a mounted Secret); overrides one in the URL.
    #[arg(long, value_name = "FILE", help_heading = "Replicas")]
    pub shared_state_password_file: Option<PathBuf>,

    /// PEM file of the CA(s) that sign the Redis server certificate (`rediss://`); default: the
    /// system's roots.
    #[arg(long, value_name = "FILE", help_heading = "Replicas")]
    pub shared_state_ca_file: Option<PathBuf>,

    /// Prefix of every Redis key, so several pools can share one Redis.
    #[arg(
        long,
        default_value = "kvpick",
        value_name = "PREFIX",
        help_heading = "Replicas"
    )]
    pub shared_state_prefix: String,

    /// Bound of every Redis call, in milliseconds. A slower or failed call counts as an outage:
    /// picks go on local state until Redis answers again.
    #[arg(
        long,
        default_value_t = 20,
        value_name = "MS",
        help_heading = "Replicas"
    )]
    pub shared_state_timeout_ms: u64,

    /// Milliseconds between load exchanges (publish this replica's bookings, read the others').
    /// A replica's published load expires after 20 intervals (at least 1 s).
    #[arg(
        long,
        default_value_t = 50,
        value_name = "MS",
        help_heading = "Replicas"
    )]
    pub shared_state_interval_ms: u64,

    /// Take the KV view from another kvpick (the indexer: a `serve` that subscribes to the
    /// engines' KV events) at this URL instead of subscribing to every engine: this replica
    /// opens no KV-event subscription, and each pick asks the indexer's `OverlapScores` for the
    /// prompt's block hashes. `https://host:port` (its gRPC port as served by default; add
    /// `#insecure` to skip the certificate check, e.g. for its generated self-signed one) or
    /// `http://host:port` (served with `--secure-serving=false`). A slow or unreachable indexer
    /// leaves picks approximate (counted in `kvpick_kv_index_remote_fallbacks_total`); the
    /// indexer itself runs without this flag.
    #[arg(long, value_name = "URL", help_heading = "Replicas")]
    pub kv_index_remote: Option<String>,

    /// PEM file of the CA(s) that sign the indexer's certificate (`--kv-index-remote
    /// https://...`); default: the system's roots.
    #[arg(long, value_name = "FILE", help_heading = "Replicas")]
    pub kv_index_remote_ca_file: Option<PathBuf>,

    /// Deadline of one `--kv-index-remote` query, in milliseconds (1..=10000): a pick whose
    /// answer has not come by then routes approximately, and no pick asks again until the
    /// indexer's health check (every second) answers SERVING. Connecting is bounded at 2 s.
    #[arg(
        long,
        default_value_t = 50,
        value_name = "MS",
        help_heading = "Replicas"
    )]
    pub kv_index_remote_timeout_ms: u64,

    /// Seconds open streams may take to finish after SIGTERM.
    #[arg(long, default_value_t = 30, value_name = "SECONDS")]
    pub shutdown_grace: u64,

    /// Milliseconds between checks of the catalog file (and the --flow-config and --settings
    /// files) for changes.
    #[arg(long, default_value_t = 1000, value_name = "MS")]
    pub catalog_poll_ms: u64,

    /// Once every port is bound, write `{"grpc":P,"health":P,"metrics":P}` here (for port 0).
    #[arg(long, value_name = "FILE")]
    pub port_file: Option<PathBuf>,

    /// Log format.
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,

    /// Scrape every rank's `/metrics` (the GIE model-server protocol) and use queue depth, KV
    /// usage and loaded LoRA adapters in the pick: `vllm` or `sglang` names, `off` = no scraping.
    #[arg(long, value_enum, default_value_t = EngineMetricsMode::Off, help_heading = "Engine metrics")]
    pub engine_metrics: EngineMetricsMode,

    /// Override metric names of the chosen type: `waiting=NAME,running=NAME,kv_usage=NAME,
    /// lora_info=NAME,rank_label=LABEL` (an empty lora_info / rank_label means none).
    #[arg(
        long,
        default_value = "",
        value_name = "K=V,...",
        help_heading = "Engine metrics"
    )]
    pub engine_metric_names: String,

    /// Path of the metrics page on each rank's endpoint.
    #[arg(
        long,
        default_value = "/metrics",
        value_name = "PATH",
        help_heading = "Engine metrics"
    )]
    pub engine_metrics_path: String,

    /// Mean milliseconds between two scrapes of one endpoint (each wait jittered by ±20 %).
    #[arg(
        long,
        default_value_t = 50,
        value_name = "MS",
        help_heading = "Engine metrics"
    )]
    pub engine_metrics_interval_ms: u64,

    /// Milliseconds one scrape may take (connect + response) before it counts as a timeout.
    #[arg(
        long,
        default_value_t = 500,
        value_name = "MS",
        help_heading = "Engine metrics"
    )]
    pub engine_metrics_timeout_ms: u64,

    /// Most scrapes in flight at once over all endpoints.
    #[arg(
        long,
        default_value_t = 64,
        value_name = "N",
        help_heading = "Engine metrics"
    )]
    pub engine_metrics_concurrency: usize,

    /// A reading older than this is stale: ignored by the pick and the rank counted in
    /// `kvpick_engine_stale_ranks`.
    #[arg(
        long,
        default_value_t = 1000,
        value_name = "MS",
        help_heading = "Engine metrics"
    )]
    pub engine_metrics_stale_ms: u64,

    /// Cost: blocks per request waiting in an engine's queue.
    #[arg(long, default_value_t = kvpick_core::decide::DEFAULT_ENGINE_WAITING_WEIGHT, value_name = "X", help_heading = "Engine metrics")]
    pub engine_waiting_weight: f64,

    /// Cost: blocks at full KV-cache usage (linear in the usage).
    #[arg(long, default_value_t = kvpick_core::decide::DEFAULT_ENGINE_KV_USAGE_WEIGHT, value_name = "X", help_heading = "Engine metrics")]
    pub engine_kv_usage_weight: f64,

    /// Cost: blocks for a LoRA request on a rank that has room for its adapter but has not loaded it.
    #[arg(long, default_value_t = kvpick_core::decide::DEFAULT_ADAPTER_LOAD_WEIGHT, value_name = "X", help_heading = "Engine metrics")]
    pub adapter_load_weight: f64,

    /// Cost: blocks for a LoRA request on a rank at `max_lora` without its adapter.
    #[arg(long, default_value_t = kvpick_core::decide::DEFAULT_ADAPTER_FULL_WEIGHT, value_name = "X", help_heading = "Engine metrics")]
    pub adapter_full_weight: f64,
}

/// Which model-server metric names `--engine-metrics` scrapes, or none.
#[derive(Debug, Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum EngineMetricsMode {
    Off,
    Vllm,
    Sglang,
}

pub fn init_logging(format: LogFormat) {
    // `zeromq` logs each peer disconnect at INFO; kvpick says once, at WARN, what a lost KV-event
    // subscription means (`events::ingest`), and its own retries log nothing.
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,zeromq=warn"));
    use std::io::IsTerminal;
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Json => builder.json().init(),
        LogFormat::Text => builder.init(),
    }
}

/// Period of the Kubernetes source's forced re-publication of its full state.
pub const KUBE_RESYNC: Duration = Duration::from_secs(30);

/// `--endpoint-scores-limit`'s default: a gateway weighing fallbacks needs the few best, and the
/// metadata Envoy keeps per request stays a few hundred bytes at any fleet size.
pub const DEFAULT_ENDPOINT_SCORES_LIMIT: usize = 16;

/// `--endpoint-scores-limit`: 1..=[`kvpick_core::request::MAX_ENDPOINT_SCORES`].
fn endpoint_scores_limit(s: &str) -> Result<usize, String> {
    let max = kvpick_core::request::MAX_ENDPOINT_SCORES;
    match s.trim().parse::<usize>() {
        Ok(n) if (1..=max).contains(&n) => Ok(n),
        _ => Err(format!("must be 1..={max}, got {s:?}")),
    }
}

/// `--session-affinity-mode`: `hard` or `soft`.
fn affinity_mode(s: &str) -> Result<AffinityMode, String> {
    s.parse()
        .map_err(|e: kvpick_core::ConfigError| e.to_string())
}
