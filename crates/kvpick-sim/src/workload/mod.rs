//! `kvpick workload`: seeded generators of Mooncake JSONL traces in seven workload families, and
//! their statistics. Owns the families' shapes ([`families`]), the window a trace is cut from,
//! and the statistics ([`stats`]); it must not depend on routing policies or engine state (the
//! one engine reference is the offered-load figure it prints, from the default engine's cost
//! terms).
//!
//! What each family models (distributions are clamped log-normals, truncated geometrics and
//! Zipf popularity; every constant is in [`families`]):
//! - `chat`: multi-turn conversations of 2–20 turns whose next prompt is the whole previous
//!   context + the previous answer + new user text, 10–120 s think time between turns, four shared
//!   system prompts (1–4 blocks, Zipf popularity), a 32k context limit. The shape follows the
//!   published descriptions of chat traffic: Mooncake's conversation trace (Qin et al., FAST '25:
//!   multi-turn, long contexts, ~12k input / ~340 output tokens on average) and multi-turn
//!   ShareGPT/LMSYS-style sessions (short follow-ups on a growing history).
//! - `agentic`: tool loops: a 4–16k-token tool/system prefix per agent application (8 apps, Zipf),
//!   a task, then 4–40 short calls (median 120 output tokens) each followed by a tool result
//!   (median 300 tokens, heavy tail) and 0.2–60 s of tool time; a parent turn fans out 1–3
//!   sub-agents with probability 0.1, each branching off the parent's history for 2–12 calls, the
//!   parent resuming with their summaries. Modelled on Mooncake's tool&agent trace (shorter outputs,
//!   high prefix reuse) and published agent traces (long-lived sessions, sub-agents).
//! - `agent-tree`: `agentic` (the same requests) with session columns: each request names its
//!   agent session (`session_id`), a sub-agent's also its parent (`parent_session_id`), as agents'
//!   session headers do (docs/sessions.md). `agent-tree-fresh`: the same tree, but a sub-agent
//!   starts a fresh context (the app's prefix and its instruction) instead of the parent's history.
//! - `shared-docs`: a pool of 400 documents (median 4k tokens) behind one shared instruction block,
//!   Zipf(0.9) popularity, each request an unrelated user's question on one document: the
//!   retrieval/long-document pattern described by RAG caching work (skewed document reuse).
//! - `small-families`: thousands of small prefix families (1–8 requests, mean ~2.2) with long
//!   gaps (10–600 s, log-uniform) and long prompts (log-normal prefix, mean ≈ 13k tokens, p90 ≈
//!   29k), as in the multi-turn production traces issue 16 describes (2,000+ families of a few
//!   requests, mean 12–15k, p90 27–39k).
//! - `no-reuse`: unique prompts (median 2k tokens), Poisson arrivals.
//!
//! A trace is a window of a steady stream: sessions start as a Poisson process from
//! `warmup` seconds before the window opens, so the first requests include later turns of
//! sessions already in progress (as in any slice of production traffic); requests are kept in
//! time order from the window start until `--requests` are collected, then shifted to start at 0.
//! Timestamps are open-loop (no dependence on the router); a client's wait for an answer is the
//! nominal [`families::NOMINAL_MS_PER_OUTPUT_TOKEN`].

pub mod classes;
pub mod families;
pub mod stats;

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::io::Write;
use std::path::PathBuf;

use crate::replay::trace::{self, TraceRecord};
use families::{SessionSource, Timed};

/// The workload families.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Family {
    Chat,
    Agentic,
    /// `agentic` with every request naming its agent session and a sub-agent its parent
    /// (`session_id` / `parent_session_id` columns).
    AgentTree,
    /// `agent-tree` whose sub-agents start a fresh context (the app prefix and their
    /// instruction), not the parent's history.
    AgentTreeFresh,
    SharedDocs,
    SmallFamilies,
    NoReuse,
}

impl Family {
    pub const ALL: [Family; 7] = [
        Family::Chat,
        Family::Agentic,
        Family::AgentTree,
        Family::AgentTreeFresh,
        Family::SharedDocs,
        Family::SmallFamilies,
        Family::NoReuse,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Family::Chat => "chat",
            Family::Agentic => "agentic",
            Family::AgentTree => "agent-tree",
            Family::AgentTreeFresh => "agent-tree-fresh",
            Family::SharedDocs => "shared-docs",
            Family::SmallFamilies => "small-families",
            Family::NoReuse => "no-reuse",
        }
    }

    /// Requests per second by default: about 0.75 offered load (no-cache prefill demand) on 8
    /// default engines, so rescaling to the matrix's loads (0.5–0.95) stretches or compresses the
    /// think and tool times by at most ~1.5x.
    pub fn default_rate(self) -> f64 {
        match self {
            Family::Chat => 22.0,
            Family::Agentic | Family::AgentTree | Family::AgentTreeFresh => 5.3,
            Family::SharedDocs => 21.5,
            Family::SmallFamilies => 8.0,
            Family::NoReuse => 39.5,
        }
    }

    fn source(self, s: &mut families::Sampler) -> Box<dyn SessionSource> {
        match self {
            Family::Chat => Box::new(families::Chat::new(s)),
            Family::Agentic => Box::new(families::Agentic::new(s)),
            Family::AgentTree => Box::new(families::Agentic::tree(s)),
            Family::AgentTreeFresh => Box::new(families::Agentic::tree_fresh(s)),
            Family::SharedDocs => Box::new(families::SharedDocs::new(s)),
            Family::SmallFamilies => Box::new(families::SmallFamilies),
            Family::NoReuse => Box::new(families::NoReuse),
        }
    }
}

/// `kvpick workload` flags.
#[derive(Debug, Clone, clap::Args)]
pub struct WorkloadArgs {
    #[arg(long, value_enum)]
    pub family: Family,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Requests in the trace.
    #[arg(long, default_value_t = 2_000)]
    pub requests: usize,
    /// Write the Mooncake JSONL trace here.
    #[arg(long)]
    pub out: PathBuf,
    /// Mean arrival rate, requests per second (default: the family's, ~0.75 offered load on 8
    /// default engines; `kvpick replay --offered-load` rescales it anyway).
    #[arg(long)]
    pub rate: Option<f64>,
    /// Also write the statistics as JSON here.
    #[arg(long)]
    pub stats: Option<PathBuf>,
    /// Flow control: priority per request group (session), `PRIORITY:WEIGHT,...`, e.g.
    /// `5:0.2,0:0.5,-1:0.3` (negative = sheddable). Written as the trace's `priority` column.
    #[arg(long, value_name = "SPEC")]
    pub priority_mix: Option<String>,
    /// Flow control: tenant (fairness key) per request group, `NAME:WEIGHT,...`, e.g. `a:4,b:1`.
    #[arg(long, value_name = "SPEC")]
    pub tenant_mix: Option<String>,
    /// Flow control: TTFT SLO in ms of the requests of a priority, `PRIORITY:MS,...`.
    #[arg(long, value_name = "SPEC")]
    pub slo_ttft: Option<String>,
}

/// Most requests one trace may have.
pub const MAX_REQUESTS: usize = 10_000_000;

/// A generated trace and the group (session, document, family) of each request.
#[derive(Debug, Clone, PartialEq)]
pub struct Workload {
    pub family: Family,
    pub records: Vec<TraceRecord>,
    pub groups: Vec<u64>,
}

/// Generates `requests` requests of `family` (see the module doc for the window).
pub fn generate(family: Family, seed: u64, requests: usize, rate: f64) -> anyhow::Result<Workload> {
    anyhow::ensure!(
        (1..=MAX_REQUESTS).contains(&requests),
        "--requests must be in 1..={MAX_REQUESTS}, got {requests}"
    );
    anyhow::ensure!(
        rate.is_finite() && rate > 0.0,
        "--rate must be > 0, got {rate}"
    );
    let mut sampler = families::Sampler::new(seed);
    let mut source = family.source(&mut sampler);
    let session_rate = rate / source.requests_per_session();
    let mut start_ms = -1000.0 * source.warmup_s();
    // Requests not yet final, earliest first: (timestamp, generation order).
    let mut pending: BinaryHeap<Reverse<(u64, u64, usize)>> = BinaryHeap::new();
    let mut store: Vec<Option<Timed>> = Vec::new();
    let mut done: Vec<Timed> = Vec::with_capacity(requests);
    let mut order = 0u64;
    while done.len() < requests {
        start_ms += 1000.0 * sampler.exp_gap(session_rate);
        // Sessions come in start order, so whatever arrives before this start is final.
        while let Some(Reverse((at, _, slot))) = pending.peek().copied() {
            if at as f64 >= start_ms || done.len() >= requests {
                break;
            }
            pending.pop();
            if let Some(t) = store[slot].take() {
                done.push(t);
            }
        }
        if done.len() >= requests {
            break;
        }
        for t in source.session(&mut sampler, start_ms) {
            if t.at_ms < 0.0 {
                continue;
            }
            let at = t.at_ms.round() as u64;
            pending.push(Reverse((at, order, store.len())));
            order += 1;
            store.push(Some(Timed {
                at_ms: at as f64,
                ..t
            }));
        }
    }
    let base = done.first().map_or(0.0, |t| t.at_ms);
    let groups = done.iter().map(|t| t.group).collect();
    let records = done
        .into_iter()
        .map(|t| TraceRecord {
            timestamp: (t.at_ms - base) as u64,
            input_length: t.input_length,
            output_length: t.output_length,
            hash_ids: t.hash_ids,
            class: Default::default(),
            session: t.session.map_or_else(Default::default, |(id, parent)| {
                trace::SessionColumns {
                    session_id: Some(id),
                    parent_session_id: parent,
                }
            }),
        })
        .collect();
    Ok(Workload {
        family,
        records,
        groups,
    })
}

/// The trace as Mooncake JSONL.
pub fn to_jsonl(records: &[TraceRecord]) -> anyhow::Result<Vec<u8>> {
    let mut out = Vec::new();
    for r in records {
        serde_json::to_writer(&mut out, r)?;
        out.push(b'\n');
    }
    Ok(out)
}

/// `kvpick workload`.
pub fn run(args: WorkloadArgs) -> anyhow::Result<()> {
    let rate = args.rate.unwrap_or(args.family.default_rate());
    let classes = classes::ClassSpec::parse(
        args.priority_mix.as_deref(),
        args.tenant_mix.as_deref(),
        args.slo_ttft.as_deref(),
    )?;
    let mut workload = generate(args.family, args.seed, args.requests, rate)?;
    if !classes.is_empty() {
        classes.assign(&mut workload.records, &workload.groups, args.seed);
    }
    let stats = stats::compute(args.family.name(), &workload.records, &workload.groups);
    let bytes = to_jsonl(&workload.records)?;
    std::fs::write(&args.out, bytes)
        .map_err(|e| anyhow::anyhow!("writing {}: {e}", args.out.display()))?;
    if let Some(path) = &args.stats {
        let json = serde_json::to_string_pretty(&stats)?;
        std::fs::write(path, json + "\n")
            .map_err(|e| anyhow::anyhow!("writing {}: {e}", path.display()))?;
    }
    let mut stdout = std::io::stdout().lock();
    write!(stdout, "{}", stats::text(&stats))?;
    Ok(())
}

#[cfg(test)]
mod tests;
