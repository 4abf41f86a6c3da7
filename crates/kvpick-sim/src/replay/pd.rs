//! `kvpick replay --pd-prefill-ranks P`: the prefill/decode mode of the offline replay. The same
//! trace runs on the same `N` simulated ranks four ways: aggregated kvpick (every rank `both`),
//! kvpick P/D (ranks `0..P` prefill, `P..N` decode, the core's pair decision), and a random and a
//! round-robin pair choice (always split, as a P/D deployment without a pair-aware picker).
//!
//! A split request runs as llm-d's routing sidecar runs it: the prefill rank computes the prompt
//! (a `max_tokens = 1` request; its KV events reach the policy), the decode rank then pulls the
//! blocks it does not cache, paying `--kv-transfer-us-per-block` per block, and decodes
//! ([`Engine::add_transferred`]); the client's first token comes from the decode rank. Reported
//! per policy: TTFT and TPOT (mean/p50/p99), throughput per rank, and each rank's share.
//!
//! This module owns the P/D loop and its report. It must not change the aggregated replay
//! ([`super::run_one`]) or reach into the core beyond its public API; like the rest of the replay
//! it is deterministic for a seed.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;

use super::policy::{self, FleetView, PickRequest, Policy, PolicyOptions, SplitMix};
use super::{ratio, stat, Prepared, Stat};
use crate::sim::engine::{Engine, EngineConfig, EngineRequest, EngineStats, StepResult};
use kvpick_core::event::KvEvent;
use kvpick_core::{Claim, Core, CoreConfig, PdConfig, RankKey, Role};

/// Policies of the P/D mode, in report order.
pub const PD_POLICIES: [&str; 4] = ["kvpick", "kvpick-pd", "random-pair", "round-robin-pair"];

/// Settings of the P/D mode.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PdOptions {
    /// Ranks `0..prefill_ranks` prefill, the rest decode (for the split policies).
    pub prefill_ranks: usize,
    /// Transfer time per KV block pulled by the decode rank, nanoseconds.
    pub transfer_ns_per_block: u64,
    /// kvpick's pair-decision settings.
    pub pd: PdConfig,
}

/// Where a policy sends a request: the decode rank (the destination), and the prefill rank when
/// it splits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pair {
    pub decode: usize,
    pub prefill: Option<usize>,
}

/// A router that picks pairs. Notifications are the client's view: the first token and the end
/// come from the decode rank.
pub trait PairPolicy {
    fn name(&self) -> &'static str;
    fn pick(&mut self, request: &PickRequest, fleet: &FleetView) -> Pair;
    fn on_first_token(&mut self, _id: u64) {}
    fn on_complete(&mut self, _id: u64) {}
    fn on_kv_events(&mut self, _rank: usize, _events: &[KvEvent]) {}
}

/// An aggregated policy: never splits.
struct Aggregated(Box<dyn Policy>, HashMap<u64, usize>);

impl PairPolicy for Aggregated {
    fn name(&self) -> &'static str {
        self.0.name()
    }
    fn pick(&mut self, request: &PickRequest, fleet: &FleetView) -> Pair {
        let decode = self.0.pick(request, fleet);
        self.1.insert(request.id, decode);
        Pair {
            decode,
            prefill: None,
        }
    }
    fn on_first_token(&mut self, id: u64) {
        if let Some(&r) = self.1.get(&id) {
            self.0.on_first_token(id, r);
        }
    }
    fn on_complete(&mut self, id: u64) {
        if let Some(r) = self.1.remove(&id) {
            self.0.on_complete(id, r);
        }
    }
    fn on_kv_events(&mut self, rank: usize, events: &[KvEvent]) {
        self.0.on_kv_events(rank, events);
    }
}

/// kvpick with role-split ranks: the real core's pair decision and split bookings.
pub struct KvpickPd {
    core: Arc<Core>,
    ranks: Vec<RankKey>,
    port_to_rank: HashMap<u16, usize>,
    bookings: HashMap<u64, String>,
    pub splits: u64,
}

const PD_BASE_PORT: u16 = 21_000;

impl KvpickPd {
    pub fn new(ranks: usize, options: &PolicyOptions, pd: &PdOptions) -> anyhow::Result<Self> {
        let core = Arc::new(Core::new(CoreConfig {
            seed: Some(options.seed),
            cost: options.cost,
            predicted_ttl: options.predicted_ttl,
            estimator: options.estimator,
            kv_events: true,
            pd: pd.pd,
            ..CoreConfig::default()
        }));
        let mut specs = policy::fleet_specs(
            ranks,
            IpAddr::V4(Ipv4Addr::LOCALHOST),
            PD_BASE_PORT,
            Some(5557),
            options.block_size,
        );
        for (i, spec) in specs.iter_mut().enumerate() {
            spec.roles = vec![if i < pd.prefill_ranks {
                Role::Prefill
            } else {
                Role::Decode
            }];
        }
        let keys = specs
            .iter()
            .map(|s| RankKey {
                worker_id: s.worker_id(),
                dp_rank: 0,
            })
            .collect();
        core.apply_source_snapshot("catalog", specs, now())
            .map_err(|e| anyhow::anyhow!("P/D replay catalog: {e}"))?;
        Ok(KvpickPd {
            core,
            ranks: keys,
            port_to_rank: (0..ranks).map(|i| (PD_BASE_PORT + i as u16, i)).collect(),
            bookings: HashMap::new(),
            splits: 0,
        })
    }
}

impl PairPolicy for KvpickPd {
    fn name(&self) -> &'static str {
        "kvpick-pd"
    }
    fn pick(&mut self, req: &PickRequest, _: &FleetView) -> Pair {
        match self
            .core
            .select_and_reserve(&super::policy::selection_request(req), now())
        {
            Ok((sel, _)) => {
                self.bookings.insert(req.id, sel.booking_id.clone());
                let rank = |port: u16| self.port_to_rank.get(&port).copied();
                let prefill = sel.prefill.as_ref().and_then(|p| rank(p.endpoint.port()));
                self.splits += u64::from(prefill.is_some());
                Pair {
                    decode: rank(sel.primary.endpoint.port()).unwrap_or(self.ranks.len() - 1),
                    prefill,
                }
            }
            // No busy thresholds are configured: the catalog always has a decode rank.
            Err(_) => Pair {
                decode: self.ranks.len() - 1,
                prefill: None,
            },
        }
    }
    fn on_first_token(&mut self, id: u64) {
        if let Some(b) = self.bookings.get(&id) {
            self.core.mark_prefill_complete(b, Claim::Any, now());
        }
    }
    fn on_complete(&mut self, id: u64) {
        if let Some(b) = self.bookings.remove(&id) {
            self.core.free(&b, Claim::Any, now());
        }
    }
    fn on_kv_events(&mut self, rank: usize, events: &[KvEvent]) {
        if let Some(key) = self.ranks.get(rank) {
            self.core.apply_kv_events(*key, events, None, now());
        }
    }
}

/// A pair chosen without looking: random, or round-robin over each role's ranks. Always splits.
struct BlindPair {
    name: &'static str,
    prefill: usize,
    ranks: usize,
    rng: Option<SplitMix>,
    next: (usize, usize),
}

impl PairPolicy for BlindPair {
    fn name(&self) -> &'static str {
        self.name
    }
    fn pick(&mut self, _: &PickRequest, _: &FleetView) -> Pair {
        let decodes = self.ranks - self.prefill;
        let (p, d) = match &mut self.rng {
            Some(rng) => (rng.below(self.prefill), rng.below(decodes)),
            None => {
                let (p, d) = self.next;
                self.next = ((p + 1) % self.prefill, (d + 1) % decodes);
                (p, d)
            }
        };
        Pair {
            decode: self.prefill + d,
            prefill: Some(p),
        }
    }
}

fn now() -> std::time::Instant {
    tokio::time::Instant::now().into_std()
}

/// Builds a P/D-mode policy by name.
pub fn build(
    name: &str,
    ranks: usize,
    options: &PolicyOptions,
    pd: &PdOptions,
) -> anyhow::Result<Box<dyn PairPolicy>> {
    Ok(match name {
        "kvpick" => Box::new(Aggregated(
            policy::build("kvpick", ranks, options)?,
            HashMap::new(),
        )),
        "kvpick-pd" => Box::new(KvpickPd::new(ranks, options, pd)?),
        "random-pair" => Box::new(BlindPair {
            name: "random-pair",
            prefill: pd.prefill_ranks,
            ranks,
            rng: Some(SplitMix(options.seed)),
            next: (0, 0),
        }),
        "round-robin-pair" => Box::new(BlindPair {
            name: "round-robin-pair",
            prefill: pd.prefill_ranks,
            ranks,
            rng: None,
            next: (0, 0),
        }),
        other => anyhow::bail!(
            "unknown P/D policy {other:?} (known: {})",
            PD_POLICIES.join(", ")
        ),
    })
}

/// One rank's share of a P/D run.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct PdRankReport {
    pub role: &'static str,
    /// Requests this rank decoded (or served whole).
    pub decoded: u64,
    /// Requests this rank prefilled for another rank.
    pub prefilled: u64,
    pub output_tok_s: f64,
    /// Engine step time / makespan.
    pub busy_fraction: f64,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct PdPolicyReport {
    pub policy: String,
    pub ttft_ms: Stat,
    /// Time per output token after the first: (end − first token) / (output − 1).
    pub tpot_ms: Stat,
    pub e2e_ms: Stat,
    pub throughput_tok_s: f64,
    /// `throughput_tok_s / ranks`: what one GPU delivers.
    pub throughput_per_rank_tok_s: f64,
    /// Prompt tokens not recomputed (cached where the prompt was prefilled) / prompt tokens.
    pub kv_hit_rate: f64,
    /// Requests split onto a prefill rank / completed.
    pub split_fraction: f64,
    /// KV blocks pulled by decode ranks.
    pub transferred_blocks: u64,
    pub makespan_s: f64,
    pub completed: u64,
    pub refused: u64,
    pub ranks: Vec<PdRankReport>,
}

#[derive(Debug, Clone, Default)]
struct Outcome {
    pair: Option<Pair>,
    first_ns: Option<u64>,
    done_ns: Option<u64>,
    cached: u64,
    output: u64,
    refused: bool,
}

struct RankState {
    engine: Engine,
    busy_until: Option<u64>,
    pending: Option<StepResult>,
    step_ns: u64,
}

/// Replays `requests` through a pair policy on `ranks` fresh engines (paused tokio clock).
async fn run_one(
    requests: &[Prepared],
    policy: &mut dyn PairPolicy,
    ranks_n: usize,
    config: &EngineConfig,
    pd: &PdOptions,
) -> PdPolicyReport {
    let mut ranks: Vec<RankState> = (0..ranks_n)
        .map(|_| RankState {
            engine: Engine::new(config.clone()),
            busy_until: None,
            pending: None,
            step_ns: 0,
        })
        .collect();
    let index_of: HashMap<u64, usize> = requests
        .iter()
        .enumerate()
        .map(|(i, r)| (r.id, i))
        .collect();
    let mut outcomes = vec![Outcome::default(); requests.len()];
    // Transfers in flight: (done at, request index).
    let mut transfers: BinaryHeap<Reverse<(u64, usize)>> = BinaryHeap::new();
    let mut transferred_blocks = 0u64;
    let mut clock = 0u64;
    let mut next_arrival = 0usize;
    let bs = config.block_size;
    loop {
        let arrival = requests.get(next_arrival).map(|r| r.arrival_ns);
        let step_end = ranks.iter().filter_map(|r| r.busy_until).min();
        let transfer = transfers.peek().map(|Reverse((t, _))| *t);
        let Some(now) = [arrival, step_end, transfer].into_iter().flatten().min() else {
            break;
        };
        if now > clock {
            tokio::time::advance(Duration::from_nanos(now - clock)).await;
            clock = now;
        }
        // 1. Steps ending now: outputs and KV events.
        for r in 0..ranks.len() {
            if ranks[r].busy_until != Some(now) {
                continue;
            }
            ranks[r].busy_until = None;
            let Some(step) = ranks[r].pending.take() else {
                continue;
            };
            if !step.events.is_empty() {
                policy.on_kv_events(r, &step.events);
            }
            for o in &step.outputs {
                let Some(&i) = index_of.get(&o.id) else {
                    continue;
                };
                let out = &mut outcomes[i];
                let Some(pair) = out.pair else { continue };
                if pair.prefill == Some(r) && pair.decode != r {
                    // The prefill side is done: the decode rank pulls what it lacks.
                    if o.finished {
                        out.cached = o.cached_tokens as u64;
                        let prompt = &requests[i].tokens;
                        let have = ranks[pair.decode].engine.cached_prefix_tokens(prompt) / bs;
                        let blocks = (prompt.len() / bs).saturating_sub(have) as u64;
                        transferred_blocks += blocks;
                        transfers.push(Reverse((now + blocks * pd.transfer_ns_per_block, i)));
                    }
                    continue;
                }
                if o.first {
                    out.first_ns = Some(now);
                    if pair.prefill.is_none() {
                        out.cached = o.cached_tokens as u64;
                    }
                    policy.on_first_token(o.id);
                }
                if o.finished {
                    out.done_ns = Some(now);
                    out.output = o.generated as u64;
                    policy.on_complete(o.id);
                }
            }
        }
        // 2. Transfers done now: the decode rank admits the pulled prompt.
        while let Some(Reverse((t, i))) = transfers.peek().copied() {
            if t != now {
                break;
            }
            transfers.pop();
            let (req, out) = (&requests[i], &mut outcomes[i]);
            let Some(pair) = out.pair else { continue };
            let added = ranks[pair.decode].engine.add_transferred(EngineRequest {
                id: req.id,
                prompt: req.tokens.clone(),
                max_tokens: req.output,
            });
            if added.is_err() {
                out.refused = true;
                policy.on_complete(req.id);
            }
        }
        // 3. Arrivals: pick a pair, start the prefill (or the whole request).
        while let Some(req) = requests.get(next_arrival).filter(|r| r.arrival_ns == now) {
            next_arrival += 1;
            let metrics: Vec<EngineStats> = ranks.iter().map(|r| r.engine.stats()).collect();
            let pair = policy.pick(
                &PickRequest::new(req.id, &req.tokens),
                &FleetView { metrics: &metrics },
            );
            let Some(&i) = index_of.get(&req.id) else {
                continue;
            };
            let pair = Pair {
                decode: pair.decode.min(ranks_n - 1),
                prefill: pair.prefill.filter(|&p| p < ranks_n && p != pair.decode),
            };
            outcomes[i].pair = Some(pair);
            let (rank, max_tokens) = match pair.prefill {
                Some(p) => (p, 1),
                None => (pair.decode, req.output),
            };
            let added = ranks[rank].engine.add_request(EngineRequest {
                id: req.id,
                prompt: req.tokens.clone(),
                max_tokens,
            });
            if added.is_err() {
                outcomes[i].refused = true;
                policy.on_complete(req.id);
            }
        }
        // 4. Idle ranks step.
        for rank in ranks.iter_mut() {
            if rank.busy_until.is_some() {
                continue;
            }
            if let Some(step) = rank.engine.step() {
                rank.step_ns += step.duration_ns;
                rank.busy_until = Some(now + step.duration_ns.max(1));
                rank.pending = Some(step);
            }
        }
    }
    report(
        policy.name(),
        requests,
        &outcomes,
        &ranks,
        pd,
        transferred_blocks,
    )
}

fn report(
    name: &str,
    requests: &[Prepared],
    outcomes: &[Outcome],
    ranks: &[RankState],
    pd: &PdOptions,
    transferred_blocks: u64,
) -> PdPolicyReport {
    let first_arrival = requests.first().map_or(0, |r| r.arrival_ns);
    let end = outcomes
        .iter()
        .filter_map(|o| o.done_ns)
        .max()
        .unwrap_or(first_arrival);
    let makespan_ns = end.saturating_sub(first_arrival).max(1);
    let span_s = makespan_ns as f64 / 1e9;
    let (mut ttft, mut tpot, mut e2e) = (Vec::new(), Vec::new(), Vec::new());
    let (mut cached, mut prompt, mut output) = (0u64, 0u64, 0u64);
    let (mut completed, mut refused, mut splits) = (0u64, 0u64, 0u64);
    let mut decoded = vec![0u64; ranks.len()];
    let mut prefilled = vec![0u64; ranks.len()];
    let mut rank_output = vec![0u64; ranks.len()];
    for (o, r) in outcomes.iter().zip(requests) {
        if o.refused {
            refused += 1;
            continue;
        }
        let (Some(pair), Some(f), Some(d)) = (o.pair, o.first_ns, o.done_ns) else {
            continue;
        };
        completed += 1;
        output += o.output;
        prompt += r.tokens.len() as u64;
        cached += o.cached;
        decoded[pair.decode] += 1;
        rank_output[pair.decode] += o.output;
        if let Some(p) = pair.prefill {
            prefilled[p] += 1;
            splits += 1;
        }
        ttft.push((f - r.arrival_ns) as f64 / 1e6);
        e2e.push((d - r.arrival_ns) as f64 / 1e6);
        if o.output > 1 {
            tpot.push((d - f) as f64 / 1e6 / (o.output - 1) as f64);
        }
    }
    let split_policy = name != "kvpick";
    PdPolicyReport {
        policy: name.to_string(),
        ttft_ms: stat(&mut ttft),
        tpot_ms: stat(&mut tpot),
        e2e_ms: stat(&mut e2e),
        throughput_tok_s: output as f64 / span_s,
        throughput_per_rank_tok_s: output as f64 / span_s / ranks.len().max(1) as f64,
        kv_hit_rate: ratio(cached, prompt),
        split_fraction: ratio(splits, completed),
        transferred_blocks,
        makespan_s: span_s,
        completed,
        refused,
        ranks: ranks
            .iter()
            .enumerate()
            .map(|(i, r)| PdRankReport {
                role: match (split_policy, i < pd.prefill_ranks) {
                    (false, _) => "both",
                    (true, true) => "prefill",
                    (true, false) => "decode",
                },
                decoded: decoded[i],
                prefilled: prefilled[i],
                output_tok_s: rank_output[i] as f64 / span_s,
                busy_fraction: r.step_ns as f64 / makespan_ns as f64,
            })
            .collect(),
    }
}

/// Runs every named P/D-mode policy over the same requests, each on its own paused clock.
pub fn run_policies(
    requests: &[Prepared],
    names: &[String],
    ranks: usize,
    config: &EngineConfig,
    options: &PolicyOptions,
    pd: &PdOptions,
) -> anyhow::Result<Vec<PdPolicyReport>> {
    anyhow::ensure!(
        pd.prefill_ranks >= 1 && pd.prefill_ranks < ranks,
        "--pd-prefill-ranks must be in 1..{ranks} (the rest decode), got {}",
        pd.prefill_ranks
    );
    let mut out = Vec::new();
    for name in names {
        let mut policy = build(name, ranks, options, pd)?;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()?;
        out.push(runtime.block_on(run_one(requests, policy.as_mut(), ranks, config, pd)));
    }
    Ok(out)
}

/// The Markdown table of a P/D report.
pub fn markdown(policies: &[PdPolicyReport]) -> String {
    let mut s = String::from(
        "| policy | TTFT mean (ms) | TTFT p99 | TPOT mean (ms) | TPOT p99 | tok/s per rank | split | KV hit | requests decoded / prefilled per rank |\n\
         |---|---|---|---|---|---|---|---|---|\n",
    );
    for p in policies {
        let per_rank = p
            .ranks
            .iter()
            .map(|r| format!("{}/{}", r.decoded, r.prefilled))
            .collect::<Vec<_>>()
            .join(" ");
        s.push_str(&format!(
            "| {} | {:.0} | {:.0} | {:.1} | {:.1} | {:.0} | {:.0}% | {:.1}% | {} |\n",
            p.policy,
            p.ttft_ms.mean,
            p.ttft_ms.p99,
            p.tpot_ms.mean,
            p.tpot_ms.p99,
            p.throughput_per_rank_tok_s,
            p.split_fraction * 100.0,
            p.kv_hit_rate * 100.0,
            per_rank
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn requests() -> Vec<Prepared> {
        // 40 requests of 2-6k tokens sharing a 1k prefix, one every 100 ms.
        (0..40u64)
            .map(|i| Prepared {
                id: i,
                arrival_ns: i * 100_000_000,
                tokens: (0..1024u32)
                    .chain(
                        (0..(2048 + (i as u32 % 5) * 1024)).map(|t| t + 1_000_000 * (i as u32 + 1)),
                    )
                    .collect(),
                output: 64,
                class: Default::default(),
                session: Default::default(),
            })
            .collect()
    }

    fn run(names: &[&str]) -> Vec<PdPolicyReport> {
        let config = EngineConfig::default();
        let options = PolicyOptions::new(config.block_size, 3);
        let pd = PdOptions {
            prefill_ranks: 1,
            transfer_ns_per_block: 40_000,
            pd: PdConfig::default(),
        };
        let names: Vec<String> = names.iter().map(|s| s.to_string()).collect();
        run_policies(&requests(), &names, 3, &config, &options, &pd).unwrap()
    }

    #[test]
    fn every_request_completes_and_split_ones_are_prefilled_on_prefill_ranks() {
        let reports = run(&PD_POLICIES);
        for r in &reports {
            assert_eq!((r.completed, r.refused), (40, 0), "{}", r.policy);
            let decoded: u64 = r.ranks.iter().map(|k| k.decoded).sum();
            assert_eq!(decoded, 40, "{}", r.policy);
        }
        let agg = &reports[0];
        assert_eq!((agg.split_fraction, agg.transferred_blocks), (0.0, 0));
        for r in &reports[1..] {
            assert!(r.split_fraction > 0.0, "{} splits some requests", r.policy);
            assert_eq!(r.ranks[0].decoded, 0, "{}: rank 0 only prefills", r.policy);
            assert!(
                r.ranks[1..].iter().all(|k| k.prefilled == 0),
                "{}",
                r.policy
            );
            assert!(r.transferred_blocks > 0, "{}", r.policy);
        }
        // The blind pairs split everything, so every prompt crosses to a decode rank.
        assert_eq!(reports[2].split_fraction, 1.0);
    }

    #[test]
    fn the_same_seed_gives_the_same_report() {
        assert_eq!(
            run(&["kvpick-pd", "random-pair"]),
            run(&["kvpick-pd", "random-pair"])
        );
    }
}
