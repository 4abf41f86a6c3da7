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

mod http;

use http::router;
pub use http::{metrics_text, tokenize, LoraInfo};

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
