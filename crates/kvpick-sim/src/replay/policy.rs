//! Routing policies compared by the offline replay (ARCHITECTURE.md §10). Each sees only what its real
//! counterpart would: its own routing decisions and completions, scraped engine metrics (GIE), or
//! KV events plus its own bookings (kvpick, through the real [`Core`]). None may read a
//! simulated engine's cache. Owns no engine state and does no I/O.
//!
//! - `round-robin`: rank `i mod N`.
//! - `random`: uniform, from a seeded SplitMix64 stream.
//! - `least-loaded`: fewest in-flight requests (the router's own count); ties -> lowest rank.
//! - `gie-default`: the Gateway API Inference Extension's default scheduling profile: approximate
//!   prefix-cache scorer (weight 3), queue scorer (2), KV-cache-utilisation scorer (2), max-score
//!   picker with random tie-break. GIE hashes 64-character chunks of the prompt; with token prompts
//!   the equivalent is 16-token chunks (≈4 characters per token). It matches at most 256 chunks and
//!   remembers 31,250 chunks per server (LRU), the plugin defaults. Prefix score = matched
//!   consecutive chunks / chunks considered; queue score = `(max_q - q) / (max_q - min_q)` over
//!   `vllm:num_requests_waiting` (1 when all equal); KV score = `1 - vllm:kv_cache_usage_perc`.
//!   Metrics are read fresh at each pick (GIE scrapes every 50 ms; fresh favours GIE).
//! - `sglang-cache-aware`: SGLang router `cache_aware` with its CLI defaults. Load = the router's
//!   in-flight count per worker. Imbalanced when `max - min > 64` AND `max > 1.5 × min` -> the
//!   least loaded worker. Otherwise the approximate radix tree's longest prefix match: when
//!   `matched / prompt > 0.3` -> the worker owning the deepest matched node, else the worker with
//!   the smallest tree (fewest tokens inserted) — our reading of `cache_aware.rs`, where the
//!   else-branch is `get_smallest_tenant()`, not the least loaded worker. The request is then
//!   inserted into the picked worker's tree. The tree works on 16-token chunks (SGLang's is on
//!   characters); its size cap (2^26) is never reached by the traces here, so no eviction.
//! - `kvpick`: the real selection core in precise mode, fed each rank's KV events as they are
//!   published (virtual time), booking on arrival, prefill-complete at the first token, free at the
//!   end.

use std::collections::{HashMap, VecDeque};
use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;

use crate::sim::engine::EngineStats;
use kvpick_core::catalog::{RankLayout, WorkerSpec};
use kvpick_core::event::KvEvent;
use kvpick_core::hash;
use kvpick_core::{Claim, Core, CoreConfig, CostParams, PromptInput, RankKey, SelectionRequest};

/// Names accepted by `--policy`, in report order.
pub const ALL: [&str; 6] = [
    "kvpick",
    "round-robin",
    "random",
    "least-loaded",
    "gie-default",
    "sglang-cache-aware",
];

/// What a policy may read about the fleet at pick time: scraped `vllm:*` metrics.
pub struct FleetView<'a> {
    pub metrics: &'a [EngineStats],
}

/// A request as the router sees it.
pub struct PickRequest<'a> {
    pub id: u64,
    pub tokens: &'a [u32],
    /// Flow-control class (trace columns): priority (negative = sheddable), tenant, TTFT SLO.
    pub priority: i32,
    pub tenant: Option<&'a str>,
    pub slo_ttft_ms: Option<u64>,
    /// Session columns: kvpick binds the session, and a child's first pick prefers its
    /// parent's rank (docs/sessions.md); other policies ignore them.
    pub session_id: Option<&'a str>,
    pub parent_session_id: Option<&'a str>,
}

impl<'a> PickRequest<'a> {
    /// A request without a flow-control class.
    pub fn new(id: u64, tokens: &'a [u32]) -> Self {
        PickRequest {
            id,
            tokens,
            priority: 0,
            tenant: None,
            slo_ttft_ms: None,
            session_id: None,
            parent_session_id: None,
        }
    }
}

/// What a policy with flow control does with an arriving request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admit {
    /// Dispatch to this rank now.
    Now(usize),
    /// Held in the router's queue: it comes out through [`Policy::take_released`].
    Queued,
    /// Refused with this HTTP status (429, 503).
    Refused(u16),
}

/// A request leaving a policy's queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Released {
    Dispatched { id: u64, rank: usize },
    Refused { id: u64, status: u16 },
}

pub trait Policy {
    fn name(&self) -> &'static str;
    /// The rank (0..N) for this request.
    fn pick(&mut self, request: &PickRequest, fleet: &FleetView) -> usize;
    /// The first response byte of `id` arrived from `rank`.
    fn on_first_token(&mut self, _id: u64, _rank: usize) {}
    /// `id` ended (completed or refused).
    fn on_complete(&mut self, _id: u64, _rank: usize) {}
    /// `rank` published these KV events.
    fn on_kv_events(&mut self, _rank: usize, _events: &[KvEvent]) {}
    /// How well the policy's own TTFT estimate predicted the first tokens (if it makes one).
    fn prediction_report(&self) -> Option<PredictionReport> {
        None
    }
    /// Child sessions' first picks that had a parent rank: `(cheapest anyway, preferred,
    /// declined)` (kvpick).
    fn session_parents(&self) -> Option<(u64, u64, u64)> {
        None
    }
    /// Flow control: dispatch now, hold, or refuse. Policies without a queue pick now.
    fn admit(&mut self, request: &PickRequest, fleet: &FleetView) -> Admit {
        Admit::Now(self.pick(request, fleet))
    }
    /// Requests that left the policy's queue since the last call, in order.
    fn take_released(&mut self) -> Vec<Released> {
        Vec::new()
    }
    /// Virtual time advanced: queue deadlines may have passed.
    fn tick(&mut self) {}
    /// The rank a transfer hint named for request `id`'s pick (kvpick, `--kv-transfer-hints`),
    /// taken once at its dispatch.
    fn transfer_source(&mut self, _id: u64) -> Option<usize> {
        None
    }
    /// kvpick: booked picks with a shared-tier hit, and of them the picks it changed.
    fn shared_tier_picks(&self) -> (u64, u64) {
        (0, 0)
    }
    /// Requests waiting in the policy's own queue now (`None`: the policy has no queue). Read
    /// only, for the report's time series.
    fn queued(&self) -> Option<usize> {
        None
    }
}

/// Predicted vs observed TTFT over a replay.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct PredictionReport {
    pub observations: u64,
    /// Mean |observed - predicted|, milliseconds.
    pub mean_abs_error_ms: f64,
    /// Mean |observed - predicted| / observed.
    pub mean_rel_error: f64,
    /// Mean (predicted - observed), milliseconds (> 0: the estimate is pessimistic).
    pub mean_bias_ms: f64,
}

/// Running sums behind a [`PredictionReport`].
#[derive(Debug, Clone, Default)]
struct PredictionSums {
    n: u64,
    abs: f64,
    rel: f64,
    bias: f64,
}

impl PredictionSums {
    fn add(&mut self, facts: &kvpick_core::Facts) {
        for fact in facts.iter() {
            if let kvpick_core::Fact::TtftObserved {
                predicted_seconds,
                observed_seconds,
            } = *fact
            {
                self.n += 1;
                self.abs += (observed_seconds - predicted_seconds).abs();
                self.bias += predicted_seconds - observed_seconds;
                if observed_seconds > 0.0 {
                    self.rel += (observed_seconds - predicted_seconds).abs() / observed_seconds;
                }
            }
        }
    }

    fn report(&self) -> PredictionReport {
        let n = self.n.max(1) as f64;
        PredictionReport {
            observations: self.n,
            mean_abs_error_ms: self.abs / n * 1e3,
            mean_rel_error: self.rel / n,
            mean_bias_ms: self.bias / n * 1e3,
        }
    }
}

/// Settings every policy may use.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PolicyOptions {
    /// The engines' KV block size (kvpick's partition block size).
    pub block_size: usize,
    pub seed: u64,
    /// kvpick's cost-function weights.
    pub cost: CostParams,
    /// Bound on kvpick's predicted blocks' life (a prediction ends with its request).
    pub predicted_ttl: std::time::Duration,
    /// kvpick's TTFT estimator.
    pub estimator: kvpick_core::EstimatorConfig,
    /// kvpick's flow control (queue, saturation limits).
    pub flow: kvpick_core::FlowConfig,
    /// kvpick's `--shared-cache-multiplier` (0 = off).
    pub shared_cache_multiplier: f64,
    /// kvpick's `--kv-transfer-hints`.
    pub kv_transfer_hints: bool,
    /// The replay's shared store and peer pulls.
    pub tiers: super::tiers::TierOptions,
}

impl PolicyOptions {
    pub fn new(block_size: usize, seed: u64) -> Self {
        PolicyOptions {
            block_size,
            seed,
            cost: CostParams::default(),
            predicted_ttl: CoreConfig::default().predicted_ttl,
            estimator: kvpick_core::EstimatorConfig::default(),
            flow: kvpick_core::FlowConfig::default(),
            shared_cache_multiplier: 0.0,
            kv_transfer_hints: false,
            tiers: Default::default(),
        }
    }
}

/// Policies that drive a real peer router's own code. They are built by the separate
/// `crates/kvpick-peers` workspace (their crates pin dependency versions, e.g. an exact tokio, that
/// must not reach kvpick's own build), which passes them to the replay through
/// [`super::build_report_with`].
pub const PEERS: [&str; 1] = ["dynamo"];

/// Builds a peer policy by name, or `None` when the name is not one it knows.
pub type PeerBuilder<'a> =
    &'a dyn Fn(&str, usize, &PolicyOptions) -> Option<anyhow::Result<Box<dyn Policy>>>;

/// Builds a policy by name for a fleet of `ranks`.
pub fn build(name: &str, ranks: usize, options: &PolicyOptions) -> anyhow::Result<Box<dyn Policy>> {
    let seed = options.seed;
    Ok(match name {
        peer if PEERS.contains(&peer) => anyhow::bail!(
            "policy {peer:?} runs NVIDIA Dynamo's own router crates, which the kvpick binary does \
             not link; run it from the kvpick-peers crate instead: `cargo run --release \
             --manifest-path crates/kvpick-peers/Cargo.toml -- replay --policy {peer},...` \
             (same flags as `kvpick replay`)"
        ),
        "kvpick" => Box::new(Kvpick::new(ranks, options)),
        "round-robin" => Box::new(RoundRobin { n: ranks, next: 0 }),
        "random" => Box::new(Random {
            n: ranks,
            rng: SplitMix(seed),
        }),
        "least-loaded" => Box::new(LeastLoaded::new(ranks)),
        "gie-default" => Box::new(GieDefault::new(ranks, seed)),
        "sglang-cache-aware" => Box::new(SglangCacheAware::new(ranks)),
        other => anyhow::bail!(
            "unknown policy {other:?} (known: {}; with crates/kvpick-peers also: {})",
            ALL.join(", "),
            PEERS.join(", ")
        ),
    })
}

/// SplitMix64 stream (deterministic across platforms and crate versions).
#[derive(Debug, Clone)]
pub struct SplitMix(pub u64);

impl SplitMix {
    pub fn next_u64(&mut self) -> u64 {
        let v = super::trace::splitmix64(self.0);
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        v
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

pub struct RoundRobin {
    n: usize,
    next: usize,
}

impl Policy for RoundRobin {
    fn name(&self) -> &'static str {
        "round-robin"
    }
    fn pick(&mut self, _: &PickRequest, _: &FleetView) -> usize {
        let r = self.next;
        self.next = (self.next + 1) % self.n;
        r
    }
}

pub struct Random {
    n: usize,
    rng: SplitMix,
}

impl Policy for Random {
    fn name(&self) -> &'static str {
        "random"
    }
    fn pick(&mut self, _: &PickRequest, _: &FleetView) -> usize {
        self.rng.below(self.n)
    }
}

/// In-flight counts as a router tracks them (pick -> completion).
#[derive(Debug, Clone)]
struct InFlight {
    load: Vec<u64>,
    rank_of: HashMap<u64, usize>,
}

impl InFlight {
    fn new(n: usize) -> Self {
        InFlight {
            load: vec![0; n],
            rank_of: HashMap::new(),
        }
    }
    fn add(&mut self, id: u64, rank: usize) {
        self.load[rank] += 1;
        self.rank_of.insert(id, rank);
    }
    fn done(&mut self, id: u64) {
        if let Some(rank) = self.rank_of.remove(&id) {
            self.load[rank] -= 1;
        }
    }
    fn least(&self) -> usize {
        let min = *self.load.iter().min().expect("ranks");
        self.load
            .iter()
            .position(|&l| l == min)
            .expect("min exists")
    }
}

pub struct LeastLoaded {
    flight: InFlight,
}

impl LeastLoaded {
    pub fn new(n: usize) -> Self {
        LeastLoaded {
            flight: InFlight::new(n),
        }
    }
}

impl Policy for LeastLoaded {
    fn name(&self) -> &'static str {
        "least-loaded"
    }
    fn pick(&mut self, req: &PickRequest, _: &FleetView) -> usize {
        let r = self.flight.least();
        self.flight.add(req.id, r);
        r
    }
    fn on_complete(&mut self, id: u64, _: usize) {
        self.flight.done(id);
    }
}

/// Chunk hashes of a token prompt the way the approximate routers see it (16-token chunks).
fn chunk_hashes(tokens: &[u32]) -> Vec<u64> {
    hash::prompt_hashes(tokens, APPROX_CHUNK, hash::BASE_SEED)
}

/// Tokens per approximate-router chunk (GIE's 64 characters ≈ 16 tokens).
pub const APPROX_CHUNK: usize = 16;

/// An LRU set of chunk hashes per server (GIE's prefix indexer).
struct LruSet {
    cap: usize,
    tick: u64,
    entries: HashMap<u64, u64>,
    order: VecDeque<(u64, u64)>,
}

impl LruSet {
    fn new(cap: usize) -> Self {
        LruSet {
            cap,
            tick: 0,
            entries: HashMap::new(),
            order: VecDeque::new(),
        }
    }
    fn contains(&self, h: u64) -> bool {
        self.entries.contains_key(&h)
    }
    fn touch(&mut self, h: u64) {
        self.tick += 1;
        self.entries.insert(h, self.tick);
        self.order.push_back((self.tick, h));
        while self.entries.len() > self.cap {
            let (t, old) = self.order.pop_front().expect("order covers entries");
            if self.entries.get(&old) == Some(&t) {
                self.entries.remove(&old);
            }
        }
        // Keep the lazy queue bounded.
        if self.order.len() > 4 * self.cap.max(16) {
            let entries = &self.entries;
            self.order.retain(|(t, h)| entries.get(h) == Some(t));
        }
    }
}

pub struct GieDefault {
    servers: Vec<LruSet>,
    rng: SplitMix,
}

/// GIE prefix plugin defaults.
pub const GIE_MAX_PREFIX_BLOCKS: usize = 256;
pub const GIE_LRU_CAPACITY_PER_SERVER: usize = 31_250;
pub const GIE_WEIGHTS: (f64, f64, f64) = (3.0, 2.0, 2.0);

impl GieDefault {
    pub fn new(n: usize, seed: u64) -> Self {
        GieDefault {
            servers: (0..n)
                .map(|_| LruSet::new(GIE_LRU_CAPACITY_PER_SERVER))
                .collect(),
            rng: SplitMix(seed ^ 0x6769_6500),
        }
    }

    /// Per-server total scores for a prompt (for tests and the pick).
    pub fn scores(&self, tokens: &[u32], fleet: &FleetView) -> Vec<f64> {
        let chunks = chunk_hashes(tokens);
        let considered = &chunks[..chunks.len().min(GIE_MAX_PREFIX_BLOCKS)];
        let queues: Vec<usize> = fleet.metrics.iter().map(|m| m.waiting).collect();
        let (qmin, qmax) = (
            *queues.iter().min().unwrap_or(&0),
            *queues.iter().max().unwrap_or(&0),
        );
        let (wp, wq, wk) = GIE_WEIGHTS;
        (0..self.servers.len())
            .map(|s| {
                let prefix = if considered.is_empty() {
                    0.0
                } else {
                    considered
                        .iter()
                        .take_while(|h| self.servers[s].contains(**h))
                        .count() as f64
                        / considered.len() as f64
                };
                let queue = if qmax == qmin {
                    1.0
                } else {
                    (qmax - queues[s]) as f64 / (qmax - qmin) as f64
                };
                let kv = 1.0 - fleet.metrics[s].kv_usage.clamp(0.0, 1.0);
                wp * prefix + wq * queue + wk * kv
            })
            .collect()
    }
}

impl Policy for GieDefault {
    fn name(&self) -> &'static str {
        "gie-default"
    }
    fn pick(&mut self, req: &PickRequest, fleet: &FleetView) -> usize {
        let scores = self.scores(req.tokens, fleet);
        let best = scores.iter().cloned().fold(f64::MIN, f64::max);
        let ties: Vec<usize> = (0..scores.len()).filter(|&i| scores[i] == best).collect();
        let pick = ties[self.rng.below(ties.len())];
        let chunks = chunk_hashes(req.tokens);
        for h in chunks.iter().take(GIE_MAX_PREFIX_BLOCKS) {
            self.servers[pick].touch(*h);
        }
        pick
    }
}

/// SGLang router `cache_aware` defaults.
pub const SGLANG_CACHE_THRESHOLD: f64 = 0.3;
pub const SGLANG_BALANCE_ABS: u64 = 64;
pub const SGLANG_BALANCE_REL: f64 = 1.5;

pub struct SglangCacheAware {
    flight: InFlight,
    /// Chunk hash -> tenants holding it (the radix tree at chunk granularity).
    tree: HashMap<u64, Vec<usize>>,
    /// Tokens inserted per tenant.
    size: Vec<u64>,
}

impl SglangCacheAware {
    pub fn new(n: usize) -> Self {
        SglangCacheAware {
            flight: InFlight::new(n),
            tree: HashMap::new(),
            size: vec![0; n],
        }
    }

    /// Preloads a tenant's tree and load (tests).
    pub fn seed_state(&mut self, rank: usize, tokens: &[u32], in_flight: u64) {
        self.insert(rank, &chunk_hashes(tokens));
        for i in 0..in_flight {
            self.flight
                .add(u64::MAX - (rank as u64) * 1_000_000 - i, rank);
        }
    }

    fn insert(&mut self, rank: usize, chunks: &[u64]) {
        for h in chunks {
            let tenants = self.tree.entry(*h).or_default();
            if !tenants.contains(&rank) {
                tenants.push(rank);
                self.size[rank] += APPROX_CHUNK as u64;
            }
        }
    }
}

impl Policy for SglangCacheAware {
    fn name(&self) -> &'static str {
        "sglang-cache-aware"
    }
    fn pick(&mut self, req: &PickRequest, _: &FleetView) -> usize {
        let chunks = chunk_hashes(req.tokens);
        let load = &self.flight.load;
        let (min, max) = (
            *load.iter().min().expect("ranks"),
            *load.iter().max().expect("ranks"),
        );
        let imbalanced =
            max - min > SGLANG_BALANCE_ABS && (max as f64) > (min as f64) * SGLANG_BALANCE_REL;
        let pick = if imbalanced {
            self.flight.least()
        } else {
            // Deepest matched chunk and its tenants.
            let mut depth = 0;
            let mut owners: Vec<usize> = Vec::new();
            for h in &chunks {
                match self.tree.get(h) {
                    Some(t) if !t.is_empty() => {
                        depth += 1;
                        owners = t.clone();
                    }
                    _ => break,
                }
            }
            let rate = (depth * APPROX_CHUNK) as f64 / req.tokens.len().max(1) as f64;
            if rate > SGLANG_CACHE_THRESHOLD {
                *owners
                    .iter()
                    .min_by_key(|&&r| (load[r], r))
                    .expect("matched chunk has tenants")
            } else {
                let smallest = *self.size.iter().min().expect("ranks");
                self.size
                    .iter()
                    .position(|&s| s == smallest)
                    .expect("min exists")
            }
        };
        self.insert(pick, &chunks);
        self.flight.add(req.id, pick);
        pick
    }
    fn on_complete(&mut self, id: u64, _: usize) {
        self.flight.done(id);
    }
}

/// The replay's virtual time: the loop runs on a paused tokio clock it advances, so the core's
/// TTLs (predicted blocks, bookings) see virtual time.
fn now() -> std::time::Instant {
    tokio::time::Instant::now().into_std()
}

/// kvpick: the real selection core, one single-rank worker per simulated rank. Metrics are not
/// recorded here, so the facts the core returns are dropped.
pub struct Kvpick {
    core: Arc<Core>,
    ranks: Vec<RankKey>,
    port_to_rank: HashMap<u16, usize>,
    bookings: HashMap<u64, String>,
    /// Flow control: queue tickets -> request ids, and what left the queue.
    tickets: HashMap<u64, u64>,
    released: Vec<Released>,
    predictions: PredictionSums,
    pub rejected: u64,
    pub events_dropped: u64,
    /// Flow control on: the policy has a queue ([`Policy::queued`]).
    flow_enabled: bool,
    /// Child sessions' first picks with a parent rank: cheapest anyway, preferred, declined.
    parents: (u64, u64, u64),
    /// Transfer hints by request id: the named holder's rank.
    hints: HashMap<u64, usize>,
    /// Booked picks with a shared-tier hit, and of them the changed ones.
    shared_picks: (u64, u64),
}

/// Port of simulated rank 0 in the replay's catalog (never bound: no sockets in the replay).
const REPLAY_BASE_PORT: u16 = 20_000;

/// The catalog kvpick sees for a fleet of `ranks` simulated workers on `address`, rank `i`
/// serving on `base_port + i` with KV events on `events_base + i`.
pub fn fleet_specs(
    ranks: usize,
    address: IpAddr,
    base_port: u16,
    events_base: Option<u16>,
    block_size: usize,
) -> Vec<WorkerSpec> {
    (0..ranks)
        .map(|i| WorkerSpec {
            namespace: "sim".into(),
            name: format!("sim-{i}"),
            model: crate::sim::MODEL.into(),
            routing_group: String::new(),
            address,
            ranks: RankLayout::PerPort(vec![base_port + i as u16]),
            block_size: Some(block_size as u32),
            kv_events: events_base.map(|p| format!("tcp://{address}:{}", p + i as u16)),
            kv_replay: None,
            lora_adapters: vec![],
            draining: false,
            incarnation: 0,
            roles: Vec::new(),
        })
        .collect()
}

impl Kvpick {
    pub fn new(ranks: usize, options: &PolicyOptions) -> Self {
        let block_size = options.block_size;
        let core = Arc::new(Core::new(CoreConfig {
            seed: Some(options.seed),
            cost: options.cost,
            predicted_ttl: options.predicted_ttl,
            estimator: options.estimator,
            flow: options.flow,
            kv_events: true,
            shared_cache: kvpick_core::SharedCacheConfig {
                multiplier: options.shared_cache_multiplier,
                models: Vec::new(),
            },
            kv_transfer_hints: options.kv_transfer_hints,
            ..CoreConfig::default()
        }));
        let specs = fleet_specs(
            ranks,
            IpAddr::V4(Ipv4Addr::LOCALHOST),
            REPLAY_BASE_PORT,
            Some(5557),
            block_size,
        );
        let keys: Vec<RankKey> = specs
            .iter()
            .map(|s| RankKey {
                worker_id: s.worker_id(),
                dp_rank: 0,
            })
            .collect();
        core.apply_source_snapshot("catalog", specs, now())
            .expect("valid sim catalog");
        Kvpick {
            core,
            ranks: keys,
            port_to_rank: (0..ranks)
                .map(|i| (REPLAY_BASE_PORT + i as u16, i))
                .collect(),
            bookings: HashMap::new(),
            tickets: HashMap::new(),
            released: Vec::new(),
            predictions: PredictionSums::default(),
            rejected: 0,
            parents: (0, 0, 0),
            events_dropped: 0,
            flow_enabled: options.flow.enabled,
            hints: HashMap::new(),
            shared_picks: (0, 0),
        }
    }

    /// Remembers a booked pick's transfer hint for its dispatch.
    fn note_hint(&mut self, id: u64, selection: &kvpick_core::Selection) {
        if let Some(hint) = &selection.transfer {
            if let Some(&rank) = self.port_to_rank.get(&hint.source.endpoint.port()) {
                self.hints.insert(id, rank);
            }
        }
    }

    pub fn core(&self) -> &Arc<Core> {
        &self.core
    }

    fn rank_of(&self, selection: &kvpick_core::Selection) -> usize {
        self.port_to_rank[&selection.primary.endpoint.port()]
    }

    /// Collects the queued requests an operation released (booked or refused).
    fn collect(&mut self, facts: &kvpick_core::Facts) {
        for fact in facts.iter() {
            if let kvpick_core::Fact::SharedTierPick { changed } = fact {
                self.shared_picks.0 += 1;
                self.shared_picks.1 += u64::from(*changed);
            }
            if let kvpick_core::Fact::SessionParent(parent) = fact {
                use kvpick_core::session::ParentPick;
                let (cheapest, preferred, declined) = &mut self.parents;
                *match parent {
                    ParentPick::Cheapest => cheapest,
                    ParentPick::Preferred => preferred,
                    ParentPick::Declined => declined,
                } += 1;
            }
            let kvpick_core::Fact::Dequeued { ticket, result } = fact else {
                continue;
            };
            let Some(id) = self.tickets.remove(ticket) else {
                continue;
            };
            if let Ok(selection) = result {
                self.note_hint(id, selection);
            }
            self.released.push(match result {
                Ok(selection) => {
                    self.bookings.insert(id, selection.booking_id.clone());
                    Released::Dispatched {
                        id,
                        rank: self.rank_of(selection),
                    }
                }
                Err(e) => Released::Refused {
                    id,
                    status: status_of(e),
                },
            });
        }
    }
}

/// What kvpick's core is asked for a replayed request: the simulated model, its tokens and its
/// flow-control class.
pub fn selection_request(req: &PickRequest) -> SelectionRequest {
    SelectionRequest {
        request_id: format!("r{}", req.id),
        model: Some(crate::sim::MODEL.into()),
        prompt: PromptInput::Tokens(req.tokens.to_vec()),
        priority: req.priority,
        fairness_key: req.tenant.map(str::to_string),
        slo_ttft_ms: req.slo_ttft_ms,
        session_id: req.session_id.map(str::to_string),
        parent_session_id: req.parent_session_id.map(str::to_string),
        ..Default::default()
    }
}

/// The HTTP status ext_proc would answer for a refused request.
fn status_of(e: &kvpick_core::SelectError) -> u16 {
    match e {
        kvpick_core::SelectError::Overloaded(_) => 429,
        kvpick_core::SelectError::BadRequest(_) => 400,
        _ => 503,
    }
}

impl Policy for Kvpick {
    fn name(&self) -> &'static str {
        "kvpick"
    }
    fn pick(&mut self, req: &PickRequest, _: &FleetView) -> usize {
        match self.core.select_and_reserve(&selection_request(req), now()) {
            Ok((sel, facts)) => {
                self.collect(&facts);
                self.note_hint(req.id, &sel);
                self.bookings.insert(req.id, sel.booking_id.clone());
                self.port_to_rank[&sel.primary.endpoint.port()]
            }
            Err(_) => {
                // No busy thresholds are configured, so this does not happen; fall back to 0.
                self.rejected += 1;
                0
            }
        }
    }
    fn admit(&mut self, req: &PickRequest, _: &FleetView) -> Admit {
        let (result, facts) = self.core.admit(&selection_request(req), now());
        self.collect(&facts);
        match result {
            Ok(kvpick_core::core::Admission::Dispatched(sel)) => {
                self.note_hint(req.id, &sel);
                self.bookings.insert(req.id, sel.booking_id.clone());
                Admit::Now(self.rank_of(&sel))
            }
            Ok(kvpick_core::core::Admission::Queued { ticket, .. }) => {
                self.tickets.insert(ticket, req.id);
                Admit::Queued
            }
            Err(e) => {
                self.rejected += 1;
                Admit::Refused(status_of(&e))
            }
        }
    }
    fn take_released(&mut self) -> Vec<Released> {
        std::mem::take(&mut self.released)
    }
    fn queued(&self) -> Option<usize> {
        self.flow_enabled.then(|| self.core.waiting_requests())
    }
    fn tick(&mut self) {
        if self.core.waiting_requests() > 0 {
            let facts = self.core.pump(now());
            self.collect(&facts);
        }
    }
    fn on_first_token(&mut self, id: u64, _: usize) {
        if let Some(b) = self.bookings.get(&id) {
            let (_, facts) = self.core.mark_prefill_complete(b, Claim::Any, now());
            self.predictions.add(&facts);
            self.collect(&facts);
        }
    }
    fn on_complete(&mut self, id: u64, _: usize) {
        if let Some(b) = self.bookings.remove(&id) {
            let (_, facts) = self.core.free(&b, Claim::Any, now());
            self.collect(&facts);
        }
    }
    fn on_kv_events(&mut self, rank: usize, events: &[KvEvent]) {
        let (stats, _) = self
            .core
            .apply_kv_events(self.ranks[rank], events, None, now());
        self.events_dropped += stats.dropped;
    }
    fn session_parents(&self) -> Option<(u64, u64, u64)> {
        Some(self.parents).filter(|&(a, b, c)| a + b + c > 0)
    }
    fn transfer_source(&mut self, id: u64) -> Option<usize> {
        self.hints.remove(&id)
    }
    fn shared_tier_picks(&self) -> (u64, u64) {
        self.shared_picks
    }
    fn prediction_report(&self) -> Option<PredictionReport> {
        Some(self.predictions.report())
    }
}

#[cfg(test)]
mod tests;
