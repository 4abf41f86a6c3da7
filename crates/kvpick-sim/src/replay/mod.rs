//! `kvpick replay`: offline, virtual-clock replay of a Mooncake trace through each routing policy
//! and a fleet of simulated engines ([`crate::sim::engine`]), with no sockets (ARCHITECTURE.md §10).
//!
//! One discrete-event loop per policy: at each instant, finished engine steps deliver their
//! outputs and KV events to the policy (rank order), then arrivals are routed and queued, then idle
//! ranks start their next step. The loop runs on a paused tokio clock that it advances to the
//! virtual time, so the selection core's TTLs (predicted blocks, bookings) see virtual time too.
//! Everything is deterministic for a seed: same inputs -> byte-identical JSON.
//!
//! This module owns the loop, the metrics and the report; policies live in [`policy`], the trace
//! format in [`trace`], the prefill/decode mode (`--pd-prefill-ranks`, its own loop) in [`pd`],
//! what the HTML report's charts record of the loop in [`series`].
//! It must not reach into the selection core beyond its public API.

mod flow_report;
pub mod pd;
pub mod policy;
mod series;
pub mod tiers;
pub mod trace;

use std::collections::HashSet;
use std::path::PathBuf;
use std::time::Duration;

use serde::Serialize;

use crate::charts::{self, ChartData, PolicyCharts, Section};
use crate::sim::engine::{Engine, EngineConfig, EngineRequest, EngineStats};
use crate::sim::EngineArgs;
use kvpick_core::hash;
use policy::{FleetView, PickRequest, Policy};
use trace::TraceRecord;

/// `kvpick replay` flags.
#[derive(Debug, Clone, clap::Args)]
pub struct ReplayArgs {
    /// Mooncake JSONL trace.
    #[arg(long)]
    pub trace: PathBuf,
    /// Simulated ranks.
    #[arg(long, default_value_t = 8)]
    pub workers: usize,
    /// Comma-separated policies (default: all of them).
    #[arg(long, value_delimiter = ',', default_values_t = policy::ALL.map(String::from))]
    pub policy: Vec<String>,
    /// Divide the trace's inter-arrival times by this. The default loads 8 default workers to
    /// ~80% of their prefill capacity on `mooncake_trace_1000.jsonl` (see `offered_load`).
    #[arg(long, default_value_t = DEFAULT_ARRIVAL_SPEEDUP, conflicts_with = "offered_load")]
    pub arrival_speedup: f64,
    /// Rescale the trace's timestamps so its offered load (see `offered_load`) on `--workers`
    /// engines is this, instead of `--arrival-speedup`.
    #[arg(long)]
    pub offered_load: Option<f64>,
    /// Replay only the first N requests.
    #[arg(long)]
    pub limit: Option<usize>,
    /// Seed for the random policy and kvpick's sampling (ties go to the rank picked least recently).
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Write the JSON report here.
    #[arg(long)]
    pub report: Option<PathBuf>,
    /// Write an HTML report here: TTFT and E2E CDFs, KV hit rate and requests per rank per
    /// policy, load per rank and kvpick's queue length over time (inline SVG, no network).
    #[arg(long, value_name = "FILE")]
    pub report_html: Option<PathBuf>,
    /// Write the HTML report's data here (JSON; `kvpick report-html --input` renders it, and
    /// several runs' sections can be merged into one page).
    #[arg(long, value_name = "FILE")]
    pub chart_data: Option<PathBuf>,
    #[command(flatten)]
    pub engine: EngineArgs,
    /// kvpick policy: credit per cached block (as `kvpick serve`).
    #[arg(long, default_value_t = 1.0)]
    pub overlap_score_credit: f64,
    /// kvpick policy: weight of the uncached prefill term (as `kvpick serve`).
    #[arg(long, default_value_t = 1.0)]
    pub prefill_load_scale: f64,
    /// kvpick policy: weight of each active KV block (as `kvpick serve`).
    #[arg(long, default_value_t = kvpick_core::decide::DEFAULT_DECODE_BLOCK_WEIGHT)]
    pub decode_block_weight: f64,
    /// kvpick policy: weight per active request (as `kvpick serve`).
    #[arg(long, default_value_t = 0.0)]
    pub decode_active_request_weight: f64,
    /// kvpick policy: bound on a predicted block's life, seconds; a prediction ends when the
    /// engine's events confirm it or its request ends (as `kvpick serve`).
    #[arg(long, default_value_t = kvpick_core::DEFAULT_PREDICTED_TTL.as_secs())]
    pub predicted_ttl: u64,
    /// kvpick policy: weight of the stall a pick's prefill inflicts on the rank's decoding
    /// requests against its own TTFT (as `kvpick serve`).
    #[arg(long, default_value_t = 1.0)]
    pub stall_weight: f64,
    /// kvpick policy: the stall may move a pick only to a rank whose predicted TTFT is within
    /// this factor of the best (as `kvpick serve`; `inf` = no bound).
    #[arg(long, default_value_t = kvpick_core::CostParams::default().ttft_slack)]
    pub ttft_slack: f64,
    /// kvpick policy: calibrate the TTFT estimator from observed first tokens (`false` keeps
    /// the prior line and every rank at scale 1; as `kvpick serve`).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub calibrate: bool,
    /// kvpick policy: flow control — hold requests in kvpick while every rank is saturated and
    /// release them by priority and fairness (as `kvpick serve`).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub flow_control: bool,
    /// kvpick policy: longest wait in kvpick's queue, seconds (as `kvpick serve`).
    #[arg(long, default_value_t = 30.0)]
    pub queue_timeout: f64,
    /// kvpick policy: a rank is saturated when its booked prefill would take this long, seconds
    /// (as `kvpick serve`; `inf` = off).
    #[arg(long, default_value_t = 0.5)]
    pub saturation_wait: f64,
    /// kvpick policy: bind the trace's `session_id` column as `kvpick serve` binds a session
    /// header (`false` drops the session columns).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub sessions: bool,
    /// kvpick policy: a child session's first pick prefers its parent's rank (the trace's
    /// `parent_session_id` column); `false` binds children independently.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub session_parents: bool,
    /// Prefill/decode mode ([`pd`]): ranks `0..P` prefill and the rest decode for the split
    /// policies; runs `--pd-policy` instead of `--policy`.
    #[arg(long, value_name = "P", help_heading = "Prefill/decode")]
    pub pd_prefill_ranks: Option<usize>,
    /// P/D-mode policies (default: all of them).
    #[arg(long, value_delimiter = ',', default_values_t = pd::PD_POLICIES.map(String::from), help_heading = "Prefill/decode")]
    pub pd_policy: Vec<String>,
    /// kvpick-pd: split only when this many prompt tokens are not cached on the decode rank.
    #[arg(long, default_value_t = kvpick_core::PdConfig::default().threshold_tokens, help_heading = "Prefill/decode")]
    pub pd_threshold_tokens: u64,
    /// kvpick-pd: transfer cost per block, in blocks of uncached prefill (as `kvpick serve`).
    #[arg(long, default_value_t = kvpick_core::PdConfig::default().transfer_block_cost, help_heading = "Prefill/decode")]
    pub pd_transfer_block_cost: f64,
    /// kvpick-pd: weight of one active request on a decode rank, blocks (as `kvpick serve`).
    #[arg(long, default_value_t = kvpick_core::PdConfig::default().decode_request_weight, help_heading = "Prefill/decode")]
    pub pd_decode_request_weight: f64,
    /// A shared KV store and transfer hints.
    #[command(flatten)]
    pub tiers: tiers::TierArgs,
}

/// kvpick's flow control in the replay, from `--flow-control`, `--queue-timeout`,
/// `--saturation-wait` (as `kvpick serve`).
fn replay_flow(args: &ReplayArgs) -> anyhow::Result<kvpick_core::FlowConfig> {
    anyhow::ensure!(
        (0.0..=3600.0).contains(&args.queue_timeout),
        "--queue-timeout must be 0..=3600 seconds"
    );
    anyhow::ensure!(
        args.saturation_wait > 0.0,
        "--saturation-wait must be > 0 seconds (inf = off)"
    );
    Ok(kvpick_core::FlowConfig {
        enabled: args.flow_control,
        queue_timeout: Duration::from_secs_f64(args.queue_timeout),
        saturation: kvpick_core::SaturationLimits {
            max_wait_seconds: args
                .saturation_wait
                .is_finite()
                .then_some(args.saturation_wait),
            ..Default::default()
        },
        ..Default::default()
    })
}

/// See [`ReplayArgs::arrival_speedup`].
pub const DEFAULT_ARRIVAL_SPEEDUP: f64 = 2.3;

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Stat {
    pub mean: f64,
    pub p50: f64,
    pub p99: f64,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct PolicyReport {
    pub policy: String,
    /// Cached prompt tokens / prompt tokens.
    pub kv_hit_rate: f64,
    pub ttft_ms: Stat,
    pub e2e_ms: Stat,
    /// Output tokens per second over the makespan.
    pub throughput_tok_s: f64,
    pub requests_per_s: f64,
    pub makespan_s: f64,
    /// Engine step time / (ranks × makespan).
    pub busy_fraction: f64,
    /// Prefill part of the step time / (ranks × makespan).
    pub prefill_fraction: f64,
    pub per_rank_requests: Vec<u64>,
    pub completed: u64,
    pub refused: u64,
    pub preemptions: u64,
    /// How well the policy's TTFT estimate predicted the observed TTFT (kvpick only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ttft_prediction: Option<policy::PredictionReport>,
    /// Child sessions' first picks that had a bound parent rank (kvpick, traces with session
    /// columns): whether the preference decided them.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub session_parents: Option<SessionParents>,
    /// Per priority band, highest first (traces with flow-control columns only).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub bands: Vec<flow_report::BandReport>,
    /// Per tenant (traces with a `tenant` column only).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tenants: Vec<flow_report::TenantReport>,
    /// The shared store and transfer hints (`--shared-store-gb-s`, `--kv-transfer-hints`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tiers: Option<tiers::TierReport>,
    /// The HTML report's data for this policy (not in the JSON report).
    #[serde(skip)]
    pub charts: Option<Box<PolicyCharts>>,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct EngineReport {
    pub block_size: usize,
    pub num_gpu_blocks: usize,
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    pub prefill_overhead_ms: f64,
    pub prefill_us_per_token: f64,
    pub itl_ms: f64,
    pub itl_ms_per_seq: f64,
    pub itl_ns_per_kv_token: f64,
}

/// The kvpick policy's cost weights (ARCHITECTURE.md §4).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct KvpickCost {
    pub overlap_score_credit: f64,
    pub prefill_load_scale: f64,
    pub decode_block_weight: f64,
    pub decode_active_request_weight: f64,
    pub predicted_ttl_s: u64,
    pub stall_weight: f64,
    pub ttft_slack: f64,
    pub calibrate: bool,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Report {
    pub trace: String,
    pub requests: usize,
    pub workers: usize,
    pub arrival_speedup: f64,
    pub seed: u64,
    pub engine: EngineReport,
    pub kvpick_cost: KvpickCost,
    /// No-cache prefill demand / fleet prefill capacity over the arrival span.
    pub offered_load: f64,
    /// Hit rate if every rank had every block ever computed (blocks seen earlier in the trace).
    pub infinite_cache_hit_rate: f64,
    pub policies: Vec<PolicyReport>,
    /// `--pd-prefill-ranks`: the prefill/decode mode's policies (then `policies` is empty).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pd: Option<PdSection>,
}

/// The prefill/decode mode's part of a report.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct PdSection {
    pub prefill_ranks: usize,
    pub kv_transfer_us_per_block: f64,
    pub threshold_tokens: u64,
    pub transfer_block_cost: f64,
    pub policies: Vec<pd::PdPolicyReport>,
}

/// Child sessions' first picks with a parent rank ([`PolicyReport::session_parents`]).
#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq)]
pub struct SessionParents {
    /// The parent's rank was the best pick anyway.
    pub cheapest: u64,
    /// The parent's rank went first though another cost less (within the soft margin).
    pub preferred: u64,
    /// The parent's rank was no candidate or cost more than the margin.
    pub declined: u64,
}

/// One trace request ready to replay.
#[derive(Debug, Clone)]
pub struct Prepared {
    pub id: u64,
    pub arrival_ns: u64,
    pub tokens: Vec<u32>,
    pub output: u32,
    pub class: trace::FlowClass,
    pub session: trace::SessionColumns,
}

pub fn prepare(records: &[TraceRecord], speedup: f64) -> Vec<Prepared> {
    let base = records.iter().map(|r| r.timestamp).min().unwrap_or(0);
    let mut out: Vec<Prepared> = records
        .iter()
        .enumerate()
        .map(|(i, r)| Prepared {
            id: i as u64,
            arrival_ns: ((r.timestamp - base) as f64 * 1e6 / speedup).round() as u64,
            tokens: trace::synthesize(r),
            output: r.output_length.max(1),
            class: r.class.clone(),
            session: r.session.clone(),
        })
        .collect();
    out.sort_by_key(|p| (p.arrival_ns, p.id));
    out
}

/// Hit rate with an infinite shared cache: the longest prefix of each prompt's blocks seen in any
/// earlier request (at most `len - 1` tokens, like the engine).
pub fn infinite_cache_hit_rate(requests: &[Prepared], block_size: usize) -> f64 {
    let mut seen = HashSet::new();
    let (mut hit, mut total) = (0u64, 0u64);
    for r in requests {
        let hashes = hash::prompt_hashes(&r.tokens, block_size, hash::BASE_SEED);
        let max = (r.tokens.len() - 1) / block_size;
        let h = hashes
            .iter()
            .take(max)
            .take_while(|h| seen.contains(*h))
            .count();
        hit += (h * block_size) as u64;
        total += r.tokens.len() as u64;
        seen.extend(hashes);
    }
    ratio(hit, total)
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        a as f64 / b as f64
    }
}

/// The engine time one request of `input_tokens` costs with nothing cached: the latency model's
/// prefill terms (`prefill_overhead + prefill_per_token × input`). Decode is not counted: it rides
/// on the same engine steps (chunked prefill batches decodes with prefill chunks).
pub fn no_cache_prefill_ns(config: &EngineConfig, input_tokens: usize) -> u64 {
    config.prefill_overhead_ns + config.prefill_ns_per_token * input_tokens as u64
}

/// **Offered load** = arrival rate × mean no-cache prefill time per request ÷ ranks, i.e. the sum
/// of [`no_cache_prefill_ns`] over the trace / (ranks × arrival span): the fraction of the fleet's
/// prefill capacity the trace would use if no prompt token were ever cached. It is a property of
/// the trace and the engine model, the same for every policy; cache hits are what a router can
/// take off it. 0 for a trace whose requests all arrive at once.
pub fn offered_load(requests: &[Prepared], config: &EngineConfig, workers: usize) -> f64 {
    let span =
        requests.last().map_or(0, |r| r.arrival_ns) - requests.first().map_or(0, |r| r.arrival_ns);
    if span == 0 {
        return 0.0;
    }
    let demand: u64 = requests
        .iter()
        .map(|r| no_cache_prefill_ns(config, r.tokens.len()))
        .sum();
    demand as f64 / (workers as f64 * span as f64)
}

/// The arrival speedup that puts `records` at offered load `target` on `workers` engines
/// (offered load is proportional to the speedup).
pub fn speedup_for_load(
    records: &[TraceRecord],
    config: &EngineConfig,
    workers: usize,
    target: f64,
) -> anyhow::Result<f64> {
    anyhow::ensure!(
        target.is_finite() && target > 0.0,
        "--offered-load must be > 0, got {target}"
    );
    let first = records.iter().map(|r| r.timestamp).min().unwrap_or(0);
    let last = records.iter().map(|r| r.timestamp).max().unwrap_or(0);
    anyhow::ensure!(
        last > first,
        "--offered-load needs a trace whose arrivals span some time"
    );
    let demand: u64 = records
        .iter()
        .map(|r| no_cache_prefill_ns(config, r.input_length))
        .sum();
    let load_at_1 = demand as f64 / (workers as f64 * (last - first) as f64 * 1e6);
    Ok(target / load_at_1)
}

fn stat(values: &mut [f64]) -> Stat {
    if values.is_empty() {
        return Stat {
            mean: 0.0,
            p50: 0.0,
            p99: 0.0,
        };
    }
    values.sort_by(f64::total_cmp);
    let pct =
        |p: f64| values[((p * values.len() as f64).ceil() as usize).clamp(1, values.len()) - 1];
    Stat {
        mean: values.iter().sum::<f64>() / values.len() as f64,
        p50: pct(0.50),
        p99: pct(0.99),
    }
}

#[derive(Debug, Clone, Default)]
struct Outcome {
    rank: usize,
    first_ns: Option<u64>,
    done_ns: Option<u64>,
    cached: u64,
    prompt: u64,
    output: u64,
    refused: bool,
    /// The status a refused request got (429 / 503), when the router refused it.
    status: Option<u16>,
}

struct RankState {
    engine: Engine,
    busy_until: Option<u64>,
    pending: Option<crate::sim::engine::StepResult>,
    step_ns: u64,
    prefill_ns: u64,
}

/// Replays `requests` through `policy` on `workers` fresh engines. Must run on a paused tokio
/// clock (see [`run_policies`]).
async fn run_one(
    requests: &[Prepared],
    policy: &mut dyn Policy,
    workers: usize,
    config: &EngineConfig,
    tier_options: tiers::TierOptions,
) -> PolicyReport {
    let mut tier_sim = tiers::TierSim::new(tier_options, config.block_size);
    let mut ranks: Vec<RankState> = (0..workers)
        .map(|_| RankState {
            engine: Engine::new(config.clone()),
            busy_until: None,
            pending: None,
            step_ns: 0,
            prefill_ns: 0,
        })
        .collect();
    let mut outcomes: Vec<Outcome> = vec![Outcome::default(); requests.len()];
    let index_of: std::collections::HashMap<u64, usize> = requests
        .iter()
        .enumerate()
        .map(|(i, r)| (r.id, i))
        .collect();
    let mut clock = 0u64;
    let mut next_arrival = 0usize;
    // The report's time series (read-only observations of the loop's state, never inputs).
    let mut observer = series::Observer::new(workers);
    loop {
        let arrival = requests.get(next_arrival).map(|r| r.arrival_ns);
        let busy = ranks.iter().filter_map(|r| r.busy_until);
        let step_end = busy.chain(tier_sim.next_landing()).min();
        let now = match (arrival, step_end) {
            (None, None) => break,
            (Some(a), None) => a,
            (None, Some(s)) => s,
            (Some(a), Some(s)) => a.min(s),
        };
        if now > clock {
            tokio::time::advance(Duration::from_nanos(now - clock)).await;
            clock = now;
        }
        // 1. Steps ending now publish their outputs and KV events.
        for (r, rank) in ranks.iter_mut().enumerate() {
            if rank.busy_until != Some(now) {
                continue;
            }
            rank.busy_until = None;
            let step = rank.pending.take().expect("a busy rank has a pending step");
            if !step.events.is_empty() {
                policy.on_kv_events(r, &step.events);
                tier_sim.forward(r, &step.events, policy);
            }
            for o in &step.outputs {
                let out = &mut outcomes[index_of[&o.id]];
                if o.first {
                    out.first_ns = Some(now);
                    out.cached = o.cached_tokens as u64;
                    policy.on_first_token(o.id, r);
                }
                if o.finished {
                    observer.finished(r);
                    out.done_ns = Some(now);
                    out.output = o.generated as u64;
                    policy.on_complete(o.id, r);
                }
            }
        }
        // 2. Arrivals now are routed and queued (in the engine, or in the router's own queue).
        policy.tick();
        // Requests whose peer pull landed reach their engine now.
        let mut dispatch: Vec<(u64, usize)> = tier_sim.landed(now);
        while let Some(req) = requests.get(next_arrival).filter(|r| r.arrival_ns == now) {
            next_arrival += 1;
            let metrics: Vec<EngineStats> = ranks.iter().map(|r| r.engine.stats()).collect();
            let admitted = policy.admit(
                &PickRequest {
                    id: req.id,
                    tokens: &req.tokens,
                    priority: req.class.priority.unwrap_or(0),
                    tenant: req.class.tenant.as_deref(),
                    slo_ttft_ms: req.class.slo_ttft_ms,
                    session_id: req.session.session_id.as_deref(),
                    parent_session_id: req.session.parent_session_id.as_deref(),
                },
                &FleetView { metrics: &metrics },
            );
            let out = &mut outcomes[index_of[&req.id]];
            out.prompt = req.tokens.len() as u64;
            match admitted {
                policy::Admit::Now(rank) => dispatch.push((req.id, rank)),
                policy::Admit::Queued => {}
                policy::Admit::Refused(status) => {
                    out.refused = true;
                    out.status = Some(status);
                }
            }
        }
        for released in policy.take_released() {
            match released {
                policy::Released::Dispatched { id, rank } => dispatch.push((id, rank)),
                policy::Released::Refused { id, status } => {
                    let out = &mut outcomes[index_of[&id]];
                    out.refused = true;
                    out.status = Some(status);
                }
            }
        }
        for (id, rank) in dispatch {
            let req = &requests[index_of[&id]];
            let out = &mut outcomes[index_of[&id]];
            out.rank = rank;
            let hint = policy.transfer_source(id).and_then(|s| ranks.get(s));
            let target = &ranks[rank].engine;
            let Some(external) = tier_sim.plan(id, rank, now, &req.tokens, target, hint) else {
                continue; // a peer pull in flight: the request reaches its engine when it lands
            };
            let added = ranks[rank].engine.add_with_external(
                EngineRequest {
                    id,
                    prompt: req.tokens.clone(),
                    max_tokens: req.output,
                },
                external,
            );
            if added.is_err() {
                out.refused = true;
                policy.on_complete(id, rank);
            } else {
                observer.dispatched(rank);
            }
        }
        // 3. Idle ranks start their next step.
        for rank in ranks.iter_mut() {
            if rank.busy_until.is_some() {
                continue;
            }
            if let Some(step) = rank.engine.step() {
                rank.step_ns += step.duration_ns;
                rank.prefill_ns += step.duration_ns - step.decode_ns;
                // A zero-length step (free config) still advances: at least 1 ns.
                rank.busy_until = Some(now + step.duration_ns.max(1));
                rank.pending = Some(step);
            }
        }
        observer.after_instant(now, policy);
    }

    let first_arrival = requests.first().map_or(0, |r| r.arrival_ns);
    let end = outcomes
        .iter()
        .filter_map(|o| o.done_ns)
        .max()
        .unwrap_or(first_arrival);
    let makespan_ns = (end - first_arrival).max(1);
    let mut ttft: Vec<f64> = Vec::new();
    let mut e2e: Vec<f64> = Vec::new();
    let (mut cached, mut prompt, mut output) = (0u64, 0u64, 0u64);
    let mut per_rank = vec![0u64; workers];
    let (mut completed, mut refused) = (0u64, 0u64);
    for (o, r) in outcomes.iter().zip(requests) {
        // A request the router refused (flow control) reached no rank.
        if o.status.is_none() {
            per_rank[o.rank] += 1;
        }
        if o.refused {
            refused += 1;
            continue;
        }
        prompt += o.prompt;
        cached += o.cached;
        if let (Some(f), Some(d)) = (o.first_ns, o.done_ns) {
            completed += 1;
            output += o.output;
            ttft.push((f - r.arrival_ns) as f64 / 1e6);
            e2e.push((d - r.arrival_ns) as f64 / 1e6);
        }
    }
    let span_s = makespan_ns as f64 / 1e9;
    let capacity = workers as f64 * makespan_ns as f64;
    let chart = observer.charts(
        policy,
        &ttft,
        &e2e,
        ratio(cached, prompt),
        &per_rank,
        (first_arrival, first_arrival + makespan_ns),
    );
    PolicyReport {
        policy: policy.name().to_string(),
        kv_hit_rate: ratio(cached, prompt),
        ttft_ms: stat(&mut ttft),
        e2e_ms: stat(&mut e2e),
        throughput_tok_s: output as f64 / span_s,
        requests_per_s: completed as f64 / span_s,
        makespan_s: span_s,
        busy_fraction: ranks.iter().map(|r| r.step_ns).sum::<u64>() as f64 / capacity,
        prefill_fraction: ranks.iter().map(|r| r.prefill_ns).sum::<u64>() as f64 / capacity,
        per_rank_requests: per_rank,
        completed,
        refused,
        preemptions: ranks.iter().map(|r| r.engine.stats().preemptions).sum(),
        ttft_prediction: policy.prediction_report(),
        session_parents: policy
            .session_parents()
            .map(|(cheapest, preferred, declined)| SessionParents {
                cheapest,
                preferred,
                declined,
            }),
        bands: flow_report::bands(&outcomes, requests, makespan_ns),
        tenants: flow_report::tenants(&outcomes, requests, makespan_ns),
        tiers: tier_sim.report(policy),
        charts: Some(Box::new(chart)),
    }
}

/// Runs every named policy over the same requests, each on its own paused-clock runtime.
pub fn run_policies(
    requests: &[Prepared],
    names: &[String],
    workers: usize,
    config: &EngineConfig,
    options: &policy::PolicyOptions,
) -> anyhow::Result<Vec<PolicyReport>> {
    run_policies_with(requests, names, workers, config, options, &|_, _, _| None)
}

/// [`run_policies`], where `peers` builds the names it knows (the peer routers of
/// `crates/kvpick-peers`) and every other name is one of [`policy::ALL`].
pub fn run_policies_with(
    requests: &[Prepared],
    names: &[String],
    workers: usize,
    config: &EngineConfig,
    options: &policy::PolicyOptions,
    peers: policy::PeerBuilder,
) -> anyhow::Result<Vec<PolicyReport>> {
    anyhow::ensure!(workers > 0, "--workers must be at least 1");
    let mut out = Vec::new();
    for name in names {
        let mut policy = match peers(name, workers, options) {
            Some(built) => built?,
            None => policy::build(name, workers, options)?,
        };
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()?;
        let report = runtime.block_on(run_one(
            requests,
            policy.as_mut(),
            workers,
            config,
            options.tiers,
        ));
        out.push(report);
    }
    Ok(out)
}

pub fn build_report(args: &ReplayArgs) -> anyhow::Result<Report> {
    build_report_with(args, &|_, _, _| None)
}

/// [`build_report`] with peer policies (see [`run_policies_with`]).
pub fn build_report_with(args: &ReplayArgs, peers: policy::PeerBuilder) -> anyhow::Result<Report> {
    anyhow::ensure!(
        args.arrival_speedup.is_finite() && args.arrival_speedup > 0.0,
        "--arrival-speedup must be > 0"
    );
    anyhow::ensure!(args.workers > 0, "--workers must be at least 1");
    let mut records = trace::load(&args.trace)?;
    if let Some(limit) = args.limit {
        records.truncate(limit);
    }
    anyhow::ensure!(!records.is_empty(), "the trace has no requests");
    let config = args.engine.config()?;
    let arrival_speedup = match args.offered_load {
        Some(target) => speedup_for_load(&records, &config, args.workers, target)?,
        None => args.arrival_speedup,
    };
    let mut requests = prepare(&records, arrival_speedup);
    for r in &mut requests {
        if !args.sessions {
            r.session = trace::SessionColumns::default();
        }
        if !args.session_parents {
            r.session.parent_session_id = None;
        }
    }
    for (name, v) in [
        ("--overlap-score-credit", args.overlap_score_credit),
        ("--prefill-load-scale", args.prefill_load_scale),
        ("--decode-block-weight", args.decode_block_weight),
        (
            "--decode-active-request-weight",
            args.decode_active_request_weight,
        ),
        ("--stall-weight", args.stall_weight),
    ] {
        anyhow::ensure!(v.is_finite() && v >= 0.0, "{name} must be >= 0, got {v}");
    }
    anyhow::ensure!(
        args.ttft_slack >= 1.0,
        "--ttft-slack must be >= 1 (inf = no bound), got {}",
        args.ttft_slack
    );
    let options = policy::PolicyOptions {
        block_size: config.block_size,
        seed: args.seed,
        predicted_ttl: Duration::from_secs(args.predicted_ttl),
        cost: kvpick_core::CostParams {
            overlap_score_credit: args.overlap_score_credit,
            prefill_load_scale: args.prefill_load_scale,
            decode_block_weight: args.decode_block_weight,
            decode_active_request_weight: args.decode_active_request_weight,
            stall_weight: args.stall_weight,
            ttft_slack: args.ttft_slack,
            ..Default::default()
        },
        estimator: kvpick_core::EstimatorConfig {
            calibrate: args.calibrate,
            ..Default::default()
        },
        flow: replay_flow(args)?,
        shared_cache_multiplier: args.tiers.shared_cache_multiplier,
        kv_transfer_hints: args.tiers.kv_transfer_hints,
        tiers: args.tiers.options(config.block_size)?,
    };
    let (policies, pd) = match args.pd_prefill_ranks {
        None => (
            run_policies_with(
                &requests,
                &args.policy,
                args.workers,
                &config,
                &options,
                peers,
            )?,
            None,
        ),
        Some(prefill_ranks) => {
            for (name, v) in [
                ("--pd-transfer-block-cost", args.pd_transfer_block_cost),
                ("--pd-decode-request-weight", args.pd_decode_request_weight),
            ] {
                anyhow::ensure!(v.is_finite() && v >= 0.0, "{name} must be >= 0, got {v}");
            }
            let pd_options = pd::PdOptions {
                prefill_ranks,
                transfer_ns_per_block: args.engine.kv_transfer_ns_per_block()?,
                pd: kvpick_core::PdConfig {
                    threshold_tokens: args.pd_threshold_tokens,
                    transfer_block_cost: args.pd_transfer_block_cost,
                    decode_request_weight: args.pd_decode_request_weight,
                },
            };
            let reports = pd::run_policies(
                &requests,
                &args.pd_policy,
                args.workers,
                &config,
                &options,
                &pd_options,
            )?;
            (
                Vec::new(),
                Some(PdSection {
                    prefill_ranks,
                    kv_transfer_us_per_block: args.engine.kv_transfer_us_per_block,
                    threshold_tokens: args.pd_threshold_tokens,
                    transfer_block_cost: args.pd_transfer_block_cost,
                    policies: reports,
                }),
            )
        }
    };
    Ok(Report {
        trace: args.trace.display().to_string(),
        requests: requests.len(),
        workers: args.workers,
        arrival_speedup,
        seed: args.seed,
        engine: EngineReport::from(&config),
        kvpick_cost: KvpickCost {
            overlap_score_credit: options.cost.overlap_score_credit,
            prefill_load_scale: options.cost.prefill_load_scale,
            decode_block_weight: options.cost.decode_block_weight,
            decode_active_request_weight: options.cost.decode_active_request_weight,
            predicted_ttl_s: args.predicted_ttl,
            stall_weight: options.cost.stall_weight,
            ttft_slack: options.cost.ttft_slack,
            calibrate: options.estimator.calibrate,
        },
        offered_load: offered_load(&requests, &config, args.workers),
        infinite_cache_hit_rate: infinite_cache_hit_rate(&requests, config.block_size),
        policies,
        pd,
    })
}

impl From<&EngineConfig> for EngineReport {
    fn from(c: &EngineConfig) -> Self {
        EngineReport {
            block_size: c.block_size,
            num_gpu_blocks: c.num_gpu_blocks,
            max_num_seqs: c.max_num_seqs,
            max_num_batched_tokens: c.max_num_batched_tokens,
            prefill_overhead_ms: c.prefill_overhead_ns as f64 / 1e6,
            prefill_us_per_token: c.prefill_ns_per_token as f64 / 1e3,
            itl_ms: c.itl_ns as f64 / 1e6,
            itl_ms_per_seq: c.itl_ns_per_seq as f64 / 1e6,
            itl_ns_per_kv_token: c.itl_ps_per_kv_token as f64 / 1e3,
        }
    }
}

/// `x` rounded to three significant digits, for figures a person reads (an arrival speedup fitted
/// to an offered load is 0.6562185358190088; the table says 0.656). Round values print as before
/// (2.3 stays 2.3), so the default replay's output is unchanged.
fn three_digits(x: f64) -> f64 {
    if x == 0.0 || !x.is_finite() {
        return x;
    }
    let shift = 2 - x.abs().log10().floor() as i32;
    // Scale by an exact power of ten in the direction that keeps it exact.
    if shift >= 0 {
        let m = 10f64.powi(shift);
        (x * m).round() / m
    } else {
        let m = 10f64.powi(-shift);
        (x / m).round() * m
    }
}

/// The Markdown table of a report.
pub fn markdown(report: &Report) -> String {
    let mut s = format!(
        "{} requests, {} workers, arrival speedup {}, offered load {:.2}, seed {}\n\n\
         | policy | KV hit rate | TTFT mean (ms) | TTFT p50 | TTFT p99 | E2E mean (ms) | E2E p99 | output tok/s | busy | requests per rank |\n\
         |---|---|---|---|---|---|---|---|---|---|\n",
        report.requests,
        report.workers,
        three_digits(report.arrival_speedup),
        report.offered_load,
        report.seed
    );
    for p in &report.policies {
        s.push_str(&format!(
            "| {} | {:.1}% | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0}% | {} |\n",
            p.policy,
            p.kv_hit_rate * 100.0,
            p.ttft_ms.mean,
            p.ttft_ms.p50,
            p.ttft_ms.p99,
            p.e2e_ms.mean,
            p.e2e_ms.p99,
            p.throughput_tok_s,
            p.busy_fraction * 100.0,
            p.per_rank_requests
                .iter()
                .map(u64::to_string)
                .collect::<Vec<_>>()
                .join("/"),
        ));
    }
    if let Some(pd) = &report.pd {
        s = format!(
            "{} requests, {} ranks ({} prefill / {} decode for the split policies), offered load {:.2}, \
             KV transfer {} us/block, seed {}\n\n{}",
            report.requests,
            report.workers,
            pd.prefill_ranks,
            report.workers - pd.prefill_ranks,
            report.offered_load,
            pd.kv_transfer_us_per_block,
            report.seed,
            pd::markdown(&pd.policies)
        );
        return s;
    }
    s.push_str(&format!(
        "| infinite-cache bound | {:.1}% | | | | | | | | |\n",
        report.infinite_cache_hit_rate * 100.0
    ));
    s.push_str(&tiers::markdown(&report.policies));
    s
}

/// `kvpick replay`.
pub fn run(args: ReplayArgs) -> anyhow::Result<()> {
    run_with(args, &|_, _, _| None)
}

/// `kvpick replay` with peer policies (`kvpick-peers replay`).
pub fn run_with(args: ReplayArgs, peers: policy::PeerBuilder) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.pd_prefill_ranks.is_none()
            || (args.report_html.is_none() && args.chart_data.is_none()),
        "--report-html and --chart-data are not available with --pd-prefill-ranks"
    );
    let report = build_report_with(&args, peers)?;
    print!("{}", markdown(&report));
    if let Some(path) = &args.report {
        let json = serde_json::to_string_pretty(&report)?;
        std::fs::write(path, json + "\n")
            .map_err(|e| anyhow::anyhow!("writing {}: {e}", path.display()))?;
    }
    if args.report_html.is_some() || args.chart_data.is_some() {
        let data = chart_data(&report);
        if let Some(path) = &args.chart_data {
            let json = serde_json::to_string(&data)?;
            std::fs::write(path, json + "\n")
                .map_err(|e| anyhow::anyhow!("writing {}: {e}", path.display()))?;
        }
        if let Some(path) = &args.report_html {
            charts::write_html(&data, path)?;
        }
    }
    Ok(())
}

/// The HTML report's data of a replay: one section, every policy in report order.
pub fn chart_data(report: &Report) -> ChartData {
    let trace = std::path::Path::new(&report.trace)
        .file_name()
        .map_or(report.trace.clone(), |n| n.to_string_lossy().into_owned());
    ChartData {
        title: format!("kvpick replay: {trace}"),
        sections: vec![Section {
            title: format!(
                "{trace}: {} requests, {} workers",
                report.requests, report.workers
            ),
            note: format!(
                "Offered load {:.2} (arrival speedup {:.3}), seed {}; infinite-cache hit rate \
                 {:.1}%. Virtual-clock replay (kvpick replay); time series sampled at {} \
                 instants of the makespan.",
                report.offered_load,
                report.arrival_speedup,
                report.seed,
                report.infinite_cache_hit_rate * 100.0,
                charts::SERIES_SAMPLES
            ),
            policies: report
                .policies
                .iter()
                .map(|p| match &p.charts {
                    Some(c) => (**c).clone(),
                    None => PolicyCharts {
                        name: p.policy.clone(),
                        ttft_cdf: Vec::new(),
                        e2e_cdf: Vec::new(),
                        kv_hit_rate: p.kv_hit_rate,
                        requests_per_rank: p.per_rank_requests.clone(),
                        load: None,
                        queue: None,
                    },
                })
                .collect(),
        }],
    }
}

#[cfg(test)]
mod tests;
