//! `kvpick sim`: a fleet of simulated vLLM workers in one process, in real time (ARCHITECTURE.md §10).
//!
//! Worker `w` serves HTTP on `base_port + w` (OpenAI `/v1/completions`, `/v1/chat/completions`,
//! SSE or not, `/v1/models`, `/health`, `/metrics` with `vllm:*` names) and has `dp_size` ranks
//! behind that port (`X-data-parallel-rank` picks one; otherwise round-robin, as vLLM's internal
//! balancer would). Global rank `g = w × dp_size + d` runs one [`Engine`] in its own task, sleeping
//! each step's modelled duration divided by `--speedup`, and publishes vLLM-format KV events on a
//! ZeroMQ PUB socket at `kv_events_port + g` with a ROUTER replay socket at `kv_replay_port + g`
//! (so kvpick's "rank r = port + r" convention holds per worker). Port 0 binds ephemeral ports;
//! `--port-file` reports what was bound.
//!
//! Text prompts are tokenized deterministically: 4-byte little-endian words of the UTF-8 text
//! (the same pseudo-tokens kvpick hashes for text without a tokenizer).
//!
//! Prefill/decode disaggregation (`--role`): a `decode` (or `both`) worker that receives a request
//! naming a prefill rank (llm-d's `x-prefiller-host-port`, Dynamo's `x-dynamo-prefill-*`) has that
//! rank prefill it over HTTP ([`super::pd`]), waits `--kv-transfer-us-per-block` per block it does
//! not cache, then decodes the prompt as transferred ([`Engine::add_transferred`]); both ranks
//! publish their KV events. Its response carries `x-sim-prefill-worker`, `x-sim-prefill-rank` and
//! `x-sim-transferred-blocks`. A `prefill` worker serves whatever it is sent (the sidecar sends it
//! `max_tokens: 1`).
//!
//! This module owns sockets and timing only; the engine model is [`super::engine`], the event
//! encoding [`super::wire`]. It never talks to the selection core.

use std::collections::{HashMap, VecDeque};
use std::convert::Infallible;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use parking_lot::Mutex;
use serde_json::{json, Value};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

use super::engine::{AddError, Engine, EngineConfig, EngineRequest, EngineStats, SeqOutput};
use super::wire::{encode_batch, Encoding};
use super::EngineArgs;
use kvpick_core::event::{KvEvent, REPLAY_END_SEQ};
use kvpick_core::Role;

/// `kvpick sim` flags.
#[derive(Debug, Clone, clap::Args)]
pub struct SimArgs {
    /// Simulated workers (one HTTP port each).
    #[arg(long, default_value_t = 4)]
    pub workers: usize,
    /// HTTP port of worker 0 (worker w: +w); 0 = ephemeral ports.
    #[arg(long, default_value_t = 8000)]
    pub base_port: u16,
    /// Data-parallel ranks per worker, multiplexed on its port.
    #[arg(long, default_value_t = 1)]
    pub dp_size: usize,
    /// Address every socket binds to.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Model name served.
    #[arg(long, default_value = super::MODEL)]
    pub model: String,
    /// KV-event PUB port of global rank 0 (rank g: +g); 0 = ephemeral.
    #[arg(long, default_value_t = 5557)]
    pub kv_events_port: u16,
    /// KV-event replay (ROUTER) port of global rank 0 (rank g: +g); 0 = ephemeral.
    #[arg(long, default_value_t = 5600)]
    pub kv_replay_port: u16,
    /// Do not publish KV events.
    #[arg(long)]
    pub no_kv_events: bool,
    /// KV-event payload encoding: vLLM's array_like structs or maps.
    #[arg(long, value_enum, default_value_t = Encoding::Array)]
    pub kv_encoding: Encoding,
    /// Divide every modelled latency by this.
    #[arg(long, default_value_t = 1.0)]
    pub speedup: f64,
    /// Stream a chunk every N tokens (vLLM's `--stream-interval`); the first and last token are
    /// always sent at once.
    #[arg(long, default_value_t = 1)]
    pub stream_interval: u32,
    /// Batches kept for replay per rank (vLLM's `buffer_steps`).
    #[arg(long, default_value_t = 10_000)]
    pub replay_buffer: usize,
    /// LoRA adapters every worker serves besides the base model (requests may name them as
    /// `model`); `/metrics` then exports `vllm:lora_requests_info` like vLLM with `--enable-lora`.
    #[arg(long, value_delimiter = ',', value_name = "NAME,...")]
    pub lora: Vec<String>,
    /// `max_lora` reported in `vllm:lora_requests_info` (vLLM's `--max-loras`).
    #[arg(long, default_value_t = 4)]
    pub max_loras: u32,
    /// Write `{"workers":[{"http":P,"ranks":[{"events":P,"replay":P}]}]}` once bound.
    #[arg(long)]
    pub port_file: Option<PathBuf>,
    /// Prefill/decode role of the workers: one for all, or one per worker (`prefill,decode`).
    /// Decode and both workers honour the prefill headers; prefill workers report their role.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "both",
        value_name = "prefill|decode|both"
    )]
    pub role: Vec<String>,
    /// A prefill worker Dynamo's `x-dynamo-prefill-instance-id` may name: the kvpick static
    /// catalog worker `NAME` (its instance id is kvpick's worker id) serving at `IP:PORT`.
    #[arg(long, value_name = "NAME=IP:PORT")]
    pub prefill_peer: Vec<String>,
    #[command(flatten)]
    pub engine: EngineArgs,
}

/// Commands to a rank's engine task.
enum Cmd {
    Add {
        request: EngineRequest,
        /// The prompt's KV was pulled from a prefill rank ([`Engine::add_transferred`]).
        transferred: bool,
        outputs: mpsc::UnboundedSender<SeqOutput>,
        reply: oneshot::Sender<Result<(), AddError>>,
    },
    Abort(u64),
    /// Prompt tokens the rank caches right now.
    Cached {
        prompt: Vec<u32>,
        reply: oneshot::Sender<usize>,
    },
}

struct Rank {
    cmd: mpsc::UnboundedSender<Cmd>,
    stats: Arc<Mutex<EngineStats>>,
    /// In-flight requests per LoRA adapter (what `vllm:lora_requests_info` reports as running).
    adapters: Arc<Mutex<std::collections::BTreeMap<String, usize>>>,
}

/// Counts one in-flight adapter request on a rank until dropped.
struct AdapterInFlight {
    adapters: Arc<Mutex<std::collections::BTreeMap<String, usize>>>,
    name: String,
}

impl AdapterInFlight {
    fn new(adapters: &Arc<Mutex<std::collections::BTreeMap<String, usize>>>, name: &str) -> Self {
        *adapters.lock().entry(name.to_string()).or_default() += 1;
        AdapterInFlight {
            adapters: Arc::clone(adapters),
            name: name.to_string(),
        }
    }
}

impl Drop for AdapterInFlight {
    fn drop(&mut self) {
        let mut adapters = self.adapters.lock();
        if let Some(n) = adapters.get_mut(&self.name) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                adapters.remove(&self.name);
            }
        }
    }
}

struct Worker {
    index: usize,
    role: Role,
    /// Dynamo instance id -> address of the prefill workers `--prefill-peer` names.
    peers: Arc<HashMap<u64, std::net::SocketAddr>>,
    speedup: f64,
    transfer_ns_per_block: u64,
    stream_interval: u32,
    model: String,
    lora: Vec<String>,
    max_loras: u32,
    config: EngineConfig,
    ranks: Vec<Rank>,
    next_rank: AtomicUsize,
    next_id: Arc<AtomicU64>,
}

/// Ports one rank publishes on.
#[derive(Debug, Clone, Copy, serde::Serialize, serde::Deserialize, PartialEq, Eq)]
pub struct RankPorts {
    pub events: Option<u16>,
    pub replay: Option<u16>,
}

/// Ports of one worker.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, PartialEq, Eq)]
pub struct WorkerPorts {
    pub http: u16,
    pub ranks: Vec<RankPorts>,
}

/// A running fleet.
pub struct Fleet {
    pub workers: Vec<WorkerPorts>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for Fleet {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

fn port_for(base: u16, offset: usize) -> anyhow::Result<u16> {
    if base == 0 {
        return Ok(0);
    }
    u16::try_from(base as usize + offset)
        .map_err(|_| anyhow::anyhow!("port {base}+{offset} overflows"))
}

fn tcp_port(ep: &zeromq::Endpoint) -> Option<u16> {
    match ep {
        zeromq::Endpoint::Tcp(_, port) => Some(*port),
        _ => None,
    }
}

/// Binds and starts every worker and rank.
pub async fn start(args: &SimArgs) -> anyhow::Result<Fleet> {
    anyhow::ensure!(args.workers > 0, "--workers must be at least 1");
    anyhow::ensure!(args.dp_size > 0, "--dp-size must be at least 1");
    anyhow::ensure!(
        args.speedup.is_finite() && args.speedup > 0.0,
        "--speedup must be > 0"
    );
    let config = args.engine.config()?;
    let transfer_ns_per_block = args.engine.kv_transfer_ns_per_block()?;
    let roles = args
        .role
        .iter()
        .map(|r| {
            Role::parse(r)
                .ok_or_else(|| anyhow::anyhow!("--role must be prefill, decode or both, got {r:?}"))
        })
        .collect::<anyhow::Result<Vec<Role>>>()?;
    anyhow::ensure!(
        roles.len() <= 1 || roles.len() == args.workers,
        "--role lists {} roles for {} workers (give one, or one per worker)",
        roles.len(),
        args.workers
    );
    let peers: Arc<HashMap<u64, std::net::SocketAddr>> = Arc::new(
        args.prefill_peer
            .iter()
            .map(|p| super::pd::parse_peer(p).map_err(anyhow::Error::msg))
            .collect::<anyhow::Result<_>>()?,
    );
    let next_id = Arc::new(AtomicU64::new(1));
    let mut tasks = Vec::new();
    let mut ports = Vec::new();
    for w in 0..args.workers {
        let mut ranks = Vec::new();
        let mut rank_ports = Vec::new();
        for d in 0..args.dp_size {
            let g = w * args.dp_size + d;
            let (events_tx, rp) = if args.no_kv_events {
                (
                    None,
                    RankPorts {
                        events: None,
                        replay: None,
                    },
                )
            } else {
                let (tx, rp, publisher_tasks) = start_publisher(
                    &args.host,
                    port_for(args.kv_events_port, g)?,
                    port_for(args.kv_replay_port, g)?,
                    d as u32,
                    args.kv_encoding,
                    args.replay_buffer,
                )
                .await?;
                tasks.extend(publisher_tasks);
                (Some(tx), rp)
            };
            rank_ports.push(rp);
            let (cmd_tx, cmd_rx) = mpsc::unbounded_channel();
            let stats = Arc::new(Mutex::new(EngineStats::default()));
            tasks.push(tokio::spawn(rank_loop(
                Engine::new(config.clone()),
                cmd_rx,
                Arc::clone(&stats),
                events_tx,
                args.speedup,
            )));
            ranks.push(Rank {
                cmd: cmd_tx,
                stats,
                adapters: Arc::default(),
            });
        }
        let worker = Arc::new(Worker {
            index: w,
            role: match roles.as_slice() {
                [] => Role::Both,
                [one] => *one,
                many => many.get(w).copied().unwrap_or_default(),
            },
            peers: Arc::clone(&peers),
            speedup: args.speedup,
            transfer_ns_per_block,
            stream_interval: args.stream_interval.max(1),
            model: args.model.clone(),
            lora: args.lora.clone(),
            max_loras: args.max_loras,
            config: config.clone(),
            ranks,
            next_rank: AtomicUsize::new(0),
            next_id: Arc::clone(&next_id),
        });
        let listener =
            tokio::net::TcpListener::bind((args.host.as_str(), port_for(args.base_port, w)?))
                .await
                .map_err(|e| anyhow::anyhow!("binding worker {w} HTTP: {e}"))?;
        let http = listener.local_addr()?.port();
        let app = router(worker);
        tasks.push(tokio::spawn(async move {
            if let Err(err) = axum::serve(listener, app).await {
                tracing::error!(%err, "sim HTTP server stopped");
            }
        }));
        ports.push(WorkerPorts {
            http,
            ranks: rank_ports,
        });
    }
    Ok(Fleet {
        workers: ports,
        tasks,
    })
}

/// `kvpick sim`: runs until SIGINT/SIGTERM.
pub async fn run(args: SimArgs) -> anyhow::Result<()> {
    let fleet = start(&args).await?;
    let summary = json!({ "workers": fleet.workers });
    if let Some(path) = &args.port_file {
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, summary.to_string())?;
        std::fs::rename(&tmp, path)?;
    }
    for (w, p) in fleet.workers.iter().enumerate() {
        tracing::info!(worker = w, http = p.http, ranks = ?p.ranks, "sim worker up");
    }
    eprintln!(
        "kvpick sim: {} workers x {} ranks serving {:?} ({})",
        args.workers, args.dp_size, args.model, summary
    );
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    drop(fleet);
    Ok(())
}

/// One rank: applies commands, steps the engine, sleeps each step's duration / speedup (against
/// absolute deadlines, so rounding never accumulates), then delivers outputs and events.
async fn rank_loop(
    mut engine: Engine,
    mut rx: mpsc::UnboundedReceiver<Cmd>,
    stats: Arc<Mutex<EngineStats>>,
    events: Option<mpsc::UnboundedSender<Vec<KvEvent>>>,
    speedup: f64,
) {
    let mut streams: HashMap<u64, mpsc::UnboundedSender<SeqOutput>> = HashMap::new();
    let mut deadline = Instant::now();
    let handle = |cmd: Cmd,
                  engine: &mut Engine,
                  streams: &mut HashMap<u64, mpsc::UnboundedSender<SeqOutput>>| {
        match cmd {
            Cmd::Add {
                request,
                transferred,
                outputs,
                reply,
            } => {
                let id = request.id;
                let result = if transferred {
                    engine.add_transferred(request)
                } else {
                    engine.add_request(request)
                };
                if result.is_ok() {
                    streams.insert(id, outputs);
                }
                let _ = reply.send(result);
            }
            Cmd::Abort(id) => {
                engine.abort(id);
                streams.remove(&id);
            }
            Cmd::Cached { prompt, reply } => {
                let _ = reply.send(engine.cached_prefix_tokens(&prompt));
            }
        }
    };
    loop {
        while let Ok(cmd) = rx.try_recv() {
            handle(cmd, &mut engine, &mut streams);
        }
        *stats.lock() = engine.stats();
        let step = if engine.has_work() {
            engine.step()
        } else {
            None
        };
        let Some(step) = step else {
            match rx.recv().await {
                Some(cmd) => handle(cmd, &mut engine, &mut streams),
                None => return,
            }
            deadline = Instant::now();
            continue;
        };
        *stats.lock() = engine.stats();
        let now = Instant::now();
        if deadline < now {
            deadline = now;
        }
        deadline += Duration::from_nanos((step.duration_ns as f64 / speedup) as u64);
        tokio::time::sleep_until(deadline).await;
        if let Some(tx) = &events {
            if !step.events.is_empty() {
                let _ = tx.send(step.events);
            }
        }
        for out in step.outputs {
            let id = out.id;
            let finished = out.finished;
            let gone = match streams.get(&id) {
                Some(tx) => tx.send(out).is_err(),
                None => false,
            };
            if finished || gone {
                streams.remove(&id);
            }
            if gone && !finished {
                engine.abort(id);
            }
        }
    }
}

/// Binds a rank's PUB and ROUTER sockets; returns the batch sender and the bound ports.
async fn start_publisher(
    host: &str,
    events_port: u16,
    replay_port: u16,
    dp_rank: u32,
    encoding: Encoding,
    buffer_steps: usize,
) -> anyhow::Result<(
    mpsc::UnboundedSender<Vec<KvEvent>>,
    RankPorts,
    Vec<tokio::task::JoinHandle<()>>,
)> {
    let mut publisher = PubSocket::new();
    let ep = publisher
        .bind(&format!("tcp://{host}:{events_port}"))
        .await
        .map_err(|e| anyhow::anyhow!("binding KV events on {host}:{events_port}: {e}"))?;
    let events = tcp_port(&ep);
    let mut router = RouterSocket::new();
    let ep = router
        .bind(&format!("tcp://{host}:{replay_port}"))
        .await
        .map_err(|e| anyhow::anyhow!("binding KV replay on {host}:{replay_port}: {e}"))?;
    let replay = tcp_port(&ep);
    let buffer: Arc<Mutex<VecDeque<(u64, Bytes)>>> = Arc::new(Mutex::new(VecDeque::new()));
    let (tx, mut rx) = mpsc::unbounded_channel::<Vec<KvEvent>>();
    let pub_buffer = Arc::clone(&buffer);
    let pub_task = tokio::spawn(async move {
        let mut seq: u64 = 0;
        while let Some(batch) = rx.recv().await {
            let ts = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64());
            let payload = Bytes::from(encode_batch(ts, &batch, Some(dp_rank), encoding));
            {
                let mut buf = pub_buffer.lock();
                buf.push_back((seq, payload.clone()));
                while buf.len() > buffer_steps.max(1) {
                    buf.pop_front();
                }
            }
            let mut msg = ZmqMessage::from(Vec::<u8>::new());
            msg.push_back(Bytes::copy_from_slice(&seq.to_be_bytes()));
            msg.push_back(payload);
            if let Err(err) = publisher.send(msg).await {
                tracing::debug!(%err, "KV-event publish failed");
            }
            seq += 1;
        }
    });
    let router_task = tokio::spawn(async move {
        loop {
            let Ok(msg) = router.recv().await else {
                continue;
            };
            // [identity, b"", start_seq]: anything else is ignored, as vLLM does.
            let frames = msg.into_vec();
            if frames.len() != 3 || frames[2].len() != 8 {
                continue;
            }
            let identity = frames[0].clone();
            let start = u64::from_be_bytes(frames[2][..8].try_into().expect("8 bytes"));
            let batches: Vec<(u64, Bytes)> = buffer
                .lock()
                .iter()
                .filter(|(s, _)| *s >= start)
                .cloned()
                .collect();
            for (s, payload) in batches
                .into_iter()
                .chain(std::iter::once((REPLAY_END_SEQ, Bytes::new())))
            {
                let mut reply = ZmqMessage::from(identity.clone());
                reply.push_back(Bytes::new());
                reply.push_back(Bytes::copy_from_slice(&s.to_be_bytes()));
                reply.push_back(payload);
                if router.send(reply).await.is_err() {
                    break;
                }
            }
        }
    });
    Ok((
        tx,
        RankPorts { events, replay },
        vec![pub_task, router_task],
    ))
}

fn router(worker: Arc<Worker>) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/health", get(|| async { StatusCode::OK }))
        .route("/metrics", get(metrics))
        // What SGLang's router (sglang-router / smg 0.3.x) reads when it registers a worker; it
        // tries the new names first and falls back to the `get_` ones.
        .route("/server_info", get(server_info))
        .route("/get_server_info", get(server_info))
        .route("/model_info", get(model_info))
        .route("/get_model_info", get(model_info))
        .with_state(worker)
}

fn error(status: StatusCode, message: impl std::fmt::Display) -> Response {
    let body = json!({"error": {"message": message.to_string(), "type": "BadRequestError", "code": status.as_u16()}});
    (
        status,
        [("content-type", "application/json")],
        body.to_string(),
    )
        .into_response()
}

/// Deterministic tokenizer for text: 4-byte little-endian words.
pub fn tokenize(text: &str) -> Vec<u32> {
    text.as_bytes()
        .chunks(4)
        .map(|c| {
            let mut word = [0u8; 4];
            word[..c.len()].copy_from_slice(c);
            u32::from_le_bytes(word)
        })
        .collect()
}

fn chat_text(messages: &Value) -> Option<String> {
    let mut text = String::new();
    for m in messages.as_array()? {
        let role = m.get("role").and_then(Value::as_str).unwrap_or("user");
        let content = match m.get("content") {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Array(parts)) => parts
                .iter()
                .filter_map(|p| p.get("text").and_then(Value::as_str))
                .collect::<Vec<_>>()
                .join(""),
            _ => String::new(),
        };
        text.push_str(&format!("<|{role}|>\n{content}\n"));
    }
    text.push_str("<|assistant|>\n");
    Some(text)
}

/// Text of generated token `i`.
fn token_text(i: u32) -> &'static str {
    const WORDS: [&str; 8] = [
        " the", " cache", " is", " warm", " and", " tokens", " flow", ".",
    ];
    WORDS[i as usize % WORDS.len()]
}

struct Parsed {
    prompt: Vec<u32>,
    max_tokens: u32,
    stream: bool,
    include_usage: bool,
    model: String,
}

fn parse(worker: &Worker, body: &[u8], chat: bool) -> Result<Parsed, (StatusCode, String)> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| (StatusCode::BAD_REQUEST, format!("invalid JSON: {e}")))?;
    let model = v
        .get("model")
        .and_then(Value::as_str)
        .unwrap_or(&worker.model)
        .to_string();
    if model != worker.model && !worker.lora.contains(&model) {
        return Err((
            StatusCode::NOT_FOUND,
            format!("The model `{model}` does not exist."),
        ));
    }
    let prompt = if chat {
        let text = v.get("messages").and_then(chat_text).ok_or((
            StatusCode::BAD_REQUEST,
            "messages must be a list".to_string(),
        ))?;
        tokenize(&text)
    } else {
        match v.get("prompt") {
            Some(Value::String(s)) => tokenize(s),
            Some(Value::Array(items)) if items.iter().all(Value::is_u64) => items
                .iter()
                .map(|t| t.as_u64().map(|t| t as u32))
                .collect::<Option<Vec<u32>>>()
                .unwrap_or_default(),
            Some(Value::Array(items)) if items.len() == 1 && items[0].is_string() => {
                tokenize(items[0].as_str().unwrap_or_default())
            }
            _ => {
                return Err((
                    StatusCode::BAD_REQUEST,
                    "prompt must be a string or a list of token ids".to_string(),
                ))
            }
        }
    };
    if prompt.is_empty() {
        return Err((StatusCode::BAD_REQUEST, "empty prompt".to_string()));
    }
    let max_tokens = v
        .get("max_tokens")
        .or_else(|| v.get("max_completion_tokens"))
        .and_then(Value::as_u64)
        .unwrap_or(16)
        .clamp(1, u32::MAX as u64) as u32;
    let stream = v.get("stream").and_then(Value::as_bool).unwrap_or(false);
    let include_usage = v
        .pointer("/stream_options/include_usage")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    Ok(Parsed {
        prompt,
        max_tokens,
        stream,
        include_usage,
        model,
    })
}

/// Aborts the request in its engine unless it finished (client went away mid-request).
struct AbortGuard {
    cmd: mpsc::UnboundedSender<Cmd>,
    id: u64,
    done: bool,
    /// An adapter request counts as running on its rank as long as the request lives.
    _adapter: Option<AdapterInFlight>,
}

impl Drop for AbortGuard {
    fn drop(&mut self) {
        if !self.done {
            let _ = self.cmd.send(Cmd::Abort(self.id));
        }
    }
}

fn usage(prompt: u32, completion: u32, cached: u32) -> Value {
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    })
}

async fn completions(
    State(worker): State<Arc<Worker>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    generate(worker, headers, body, false).await
}

async fn chat_completions(
    State(worker): State<Arc<Worker>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    generate(worker, headers, body, true).await
}

async fn generate(worker: Arc<Worker>, headers: HeaderMap, body: Bytes, chat: bool) -> Response {
    let parsed = match parse(&worker, &body, chat) {
        Ok(p) => p,
        Err((status, message)) => return error(status, message),
    };
    let n = worker.ranks.len();
    let rank = match headers.get("x-data-parallel-rank") {
        Some(v) => match v.to_str().ok().and_then(|s| s.trim().parse::<usize>().ok()) {
            Some(r) if r < n => r,
            _ => {
                return error(
                    StatusCode::BAD_REQUEST,
                    format!("X-data-parallel-rank must be in 0..{n}"),
                )
            }
        },
        None => worker.next_rank.fetch_add(1, Ordering::Relaxed) % n,
    };
    let id = worker.next_id.fetch_add(1, Ordering::Relaxed);
    let cmd = worker.ranks[rank].cmd.clone();
    // Prefill/decode: the named prefill rank computes the prompt, this rank pulls its KV.
    let mut pd_headers: Vec<(&'static str, String)> = Vec::new();
    let target = if worker.role.decodes() {
        match super::pd::target(&headers, &worker.peers) {
            Ok(t) => t,
            Err(message) => return error(StatusCode::BAD_REQUEST, message),
        }
    } else {
        None
    };
    if let Some(target) = target {
        let done = match super::pd::prefill(
            target,
            &parsed.model,
            &parsed.prompt,
            Duration::from_secs(120),
        )
        .await
        {
            Ok(done) => done,
            Err(message) => return error(StatusCode::BAD_GATEWAY, message),
        };
        let (cached_tx, cached_rx) = oneshot::channel();
        let _ = cmd.send(Cmd::Cached {
            prompt: parsed.prompt.clone(),
            reply: cached_tx,
        });
        let bs = worker.config.block_size.max(1);
        let have = cached_rx.await.unwrap_or(0) / bs;
        let blocks = (parsed.prompt.len() / bs).saturating_sub(have) as u64;
        let wait = blocks.saturating_mul(worker.transfer_ns_per_block) as f64 / worker.speedup;
        tokio::time::sleep(Duration::from_nanos(wait as u64)).await;
        pd_headers = vec![
            ("x-sim-prefill-worker", done.worker),
            ("x-sim-prefill-rank", done.rank),
            ("x-sim-prefill-host-port", target.addr.to_string()),
            ("x-sim-transferred-blocks", blocks.to_string()),
        ];
    }
    let (out_tx, mut out_rx) = mpsc::unbounded_channel();
    let (reply_tx, reply_rx) = oneshot::channel();
    if cmd
        .send(Cmd::Add {
            request: EngineRequest {
                id,
                prompt: parsed.prompt,
                max_tokens: parsed.max_tokens,
            },
            transferred: target.is_some(),
            outputs: out_tx,
            reply: reply_tx,
        })
        .is_err()
    {
        return error(StatusCode::SERVICE_UNAVAILABLE, "engine stopped");
    }
    match reply_rx.await {
        Ok(Ok(())) => {}
        Ok(Err(err)) => return error(StatusCode::BAD_REQUEST, err),
        Err(_) => return error(StatusCode::SERVICE_UNAVAILABLE, "engine stopped"),
    }
    let mut guard = AbortGuard {
        cmd,
        id,
        done: false,
        _adapter: (parsed.model != worker.model)
            .then(|| AdapterInFlight::new(&worker.ranks[rank].adapters, &parsed.model)),
    };
    let created = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let rid = if chat {
        format!("chatcmpl-{id}")
    } else {
        format!("cmpl-{id}")
    };
    let model = parsed.model;
    let rank_header = ("x-sim-rank", rank.to_string());
    let worker_header = ("x-sim-worker", worker.index.to_string());
    let role_header = ("x-sim-role", worker.role.as_str().to_string());
    let interval = worker.stream_interval;
    if !parsed.stream {
        let mut text = String::new();
        let mut last = None;
        while let Some(out) = out_rx.recv().await {
            for i in 0..out.new_tokens {
                text.push_str(token_text(out.generated - out.new_tokens + i));
            }
            let finished = out.finished;
            last = Some(out);
            if finished {
                break;
            }
        }
        let Some(last) = last.filter(|o| o.finished) else {
            return error(StatusCode::SERVICE_UNAVAILABLE, "engine stopped");
        };
        guard.done = true;
        let usage = usage(last.prompt_tokens, last.generated, last.cached_tokens);
        let body = if chat {
            json!({"id": rid, "object": "chat.completion", "created": created, "model": model,
                   "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                "logprobs": null, "finish_reason": "length"}],
                   "usage": usage})
        } else {
            json!({"id": rid, "object": "text_completion", "created": created, "model": model,
                   "choices": [{"index": 0, "text": text, "logprobs": null,
                                "finish_reason": "length"}],
                   "usage": usage})
        };
        let mut response = (
            StatusCode::OK,
            [
                ("content-type", "application/json".to_string()),
                rank_header,
                worker_header,
                role_header,
            ],
            body.to_string(),
        )
            .into_response();
        add_headers(&mut response, &pd_headers);
        return response;
    }
    let include_usage = parsed.include_usage;
    let stream = futures::stream::unfold(
        (out_rx, Some(guard), false),
        move |(mut rx, mut guard, mut role_sent)| {
            let rid = rid.clone();
            let model = model.clone();
            async move {
                guard.as_ref()?;
                let mut outs = Vec::new();
                loop {
                    let out: SeqOutput = rx.recv().await?;
                    if out.new_tokens == 0 && !out.finished {
                        continue;
                    }
                    let flush = out.first || out.finished || out.generated.is_multiple_of(interval);
                    outs.push(out);
                    if flush {
                        break;
                    }
                }
                let mut chunk = String::new();
                let mut event = |choice: Value, usage: Option<Value>| {
                    let mut obj = json!({"id": rid, "created": created, "model": model,
                        "object": if chat { "chat.completion.chunk" } else { "text_completion" },
                        "choices": choice});
                    if let Some(u) = usage {
                        obj["usage"] = u;
                    }
                    chunk.push_str(&format!("data: {obj}\n\n"));
                };
                let out = outs.last().expect("at least one output").clone();
                let text: String = outs
                    .iter()
                    .flat_map(|o| {
                        (0..o.new_tokens).map(move |i| token_text(o.generated - o.new_tokens + i))
                    })
                    .collect();
                if !text.is_empty() {
                    let text = text.as_str();
                    let last = out.finished;
                    let finish = if last { json!("length") } else { Value::Null };
                    let choice = if chat {
                        let delta = if role_sent {
                            json!({"content": text})
                        } else {
                            role_sent = true;
                            json!({"role": "assistant", "content": text})
                        };
                        json!([{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}])
                    } else {
                        json!([{"index": 0, "text": text, "logprobs": null, "finish_reason": finish}])
                    };
                    event(choice, None);
                }
                if out.finished {
                    if include_usage {
                        event(
                            json!([]),
                            Some(usage(out.prompt_tokens, out.generated, out.cached_tokens)),
                        );
                    }
                    chunk.push_str("data: [DONE]\n\n");
                    if let Some(mut g) = guard.take() {
                        g.done = true;
                    }
                }
                Some((
                    Ok::<Bytes, Infallible>(Bytes::from(chunk)),
                    (rx, guard, role_sent),
                ))
            }
        },
    );
    let mut response = (
        StatusCode::OK,
        [
            ("content-type", "text/event-stream".to_string()),
            ("cache-control", "no-cache".to_string()),
            rank_header,
            worker_header,
            role_header,
        ],
        Body::from_stream(stream),
    )
        .into_response();
    add_headers(&mut response, &pd_headers);
    response
}

fn add_headers(response: &mut Response, headers: &[(&'static str, String)]) {
    for (name, value) in headers {
        if let Ok(value) = axum::http::HeaderValue::from_str(value) {
            response.headers_mut().insert(*name, value);
        }
    }
}

/// SGLang's `/server_info`: the served model and the cache geometry. No `model_path` or
/// `tokenizer_path`: the router would try to load a tokenizer from it, and text routing
/// (`cache_aware`) needs none.
async fn server_info(State(worker): State<Arc<Worker>>) -> Response {
    let c = &worker.config;
    let body = json!({"served_model_name": worker.model, "dp_size": worker.ranks.len(),
        "page_size": c.block_size, "max_total_num_tokens": c.num_gpu_blocks * c.block_size,
        "max_running_requests": c.max_num_seqs, "chunked_prefill_size": c.max_num_batched_tokens,
        "version": concat!("kvpick-sim ", env!("CARGO_PKG_VERSION"))});
    (
        StatusCode::OK,
        [("content-type", "application/json")],
        body.to_string(),
    )
        .into_response()
}

/// SGLang's `/model_info` (see [`server_info`] for why no paths).
async fn model_info(State(worker): State<Arc<Worker>>) -> Response {
    let body = json!({"served_model_name": worker.model, "is_generation": true,
        "max_context_length": worker.config.num_gpu_blocks * worker.config.block_size,
        "preferred_sampling_params": null});
    (
        StatusCode::OK,
        [("content-type", "application/json")],
        body.to_string(),
    )
        .into_response()
}

async fn models(State(worker): State<Arc<Worker>>) -> Response {
    let body = json!({"object": "list", "data": [{"id": worker.model, "object": "model",
        "owned_by": "kvpick-sim", "max_model_len": worker.config.num_gpu_blocks * worker.config.block_size}]});
    (
        StatusCode::OK,
        [("content-type", "application/json")],
        body.to_string(),
    )
        .into_response()
}

/// LoRA state of one rank for `vllm:lora_requests_info`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoraInfo {
    pub max_loras: u32,
    /// Adapters with in-flight requests, sorted.
    pub running: Vec<String>,
}

/// `vllm:*` metrics, one sample per rank (`engine` label), like a vLLM DP deployment; with
/// `lora` (one per rank), also `vllm:lora_requests_info` (value: the Unix time, as vLLM does).
pub fn metrics_text(
    model: &str,
    config: &EngineConfig,
    ranks: &[EngineStats],
    lora: Option<&[LoraInfo]>,
) -> String {
    let mut s = String::new();
    let mut family =
        |name: &str, kind: &str, help: &str, value: &dyn Fn(&EngineStats) -> String| {
            s.push_str(&format!("# HELP {name} {help}\n# TYPE {name} {kind}\n"));
            for (i, r) in ranks.iter().enumerate() {
                s.push_str(&format!(
                    "{name}{{engine=\"{i}\",model_name=\"{model}\"}} {}\n",
                    value(r)
                ));
            }
        };
    family(
        "vllm:num_requests_running",
        "gauge",
        "Number of requests in model execution batches.",
        &|r| r.running.to_string(),
    );
    family(
        "vllm:num_requests_waiting",
        "gauge",
        "Number of requests waiting to be processed.",
        &|r| r.waiting.to_string(),
    );
    family(
        "vllm:kv_cache_usage_perc",
        "gauge",
        "KV-cache usage. 1 means 100 percent usage.",
        &|r| format!("{}", r.kv_usage),
    );
    family(
        "vllm:prefix_cache_queries_total",
        "counter",
        "Prefix cache queries, in terms of number of queried tokens.",
        &|r| r.prefix_cache_queries.to_string(),
    );
    family(
        "vllm:prefix_cache_hits_total",
        "counter",
        "Prefix cache hits, in terms of number of cached tokens.",
        &|r| r.prefix_cache_hits.to_string(),
    );
    family(
        "vllm:num_preemptions_total",
        "counter",
        "Cumulative number of preemptions.",
        &|r| r.preemptions.to_string(),
    );
    s.push_str(&format!(
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n\
         # TYPE vllm:cache_config_info gauge\n\
         vllm:cache_config_info{{block_size=\"{}\",enable_prefix_caching=\"True\",num_gpu_blocks=\"{}\",model_name=\"{model}\"}} 1.0\n",
        config.block_size, config.num_gpu_blocks
    ));
    if let Some(lora) = lora {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        s.push_str(
            "# HELP vllm:lora_requests_info Running stats on lora requests.\n\
             # TYPE vllm:lora_requests_info gauge\n",
        );
        for (i, info) in lora.iter().enumerate() {
            s.push_str(&format!(
                "vllm:lora_requests_info{{engine=\"{i}\",max_lora=\"{}\",running_lora_adapters=\"{}\",waiting_lora_adapters=\"\"}} {now}\n",
                info.max_loras,
                info.running.join(",")
            ));
        }
    }
    s
}

async fn metrics(State(worker): State<Arc<Worker>>) -> Response {
    let stats: Vec<EngineStats> = worker.ranks.iter().map(|r| *r.stats.lock()).collect();
    let lora: Option<Vec<LoraInfo>> = (!worker.lora.is_empty()).then(|| {
        worker
            .ranks
            .iter()
            .map(|r| LoraInfo {
                max_loras: worker.max_loras,
                running: r.adapters.lock().keys().cloned().collect(),
            })
            .collect()
    });
    (
        StatusCode::OK,
        [("content-type", "text/plain; version=0.0.4")],
        metrics_text(&worker.model, &worker.config, &stats, lora.as_deref()),
    )
        .into_response()
}
