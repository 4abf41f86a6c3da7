//! `kvpick-lab`: the lab beside the product. The simulated vLLM fleet, the offline replay of a
//! trace through every routing policy, seeded workloads and the HTML report, all from
//! `kvpick-sim`. It is a binary of its own so that the serving binary, `kvpick`, links neither the
//! simulator nor tokio's `test-util`; `kvpick replay|sim|workload|report-html` hands over to this
//! binary when it is installed beside `kvpick` (src/main.rs).
//!
//! It only parses flags and calls `kvpick-sim`: it must not grow logic of its own.

#![forbid(unsafe_code)]

use clap::{Parser, Subcommand};

// The replay allocates per simulated request; the same allocator as `kvpick` keeps its cost.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// kvpick-lab: kvpick's simulated fleet, offline replay, workloads and reports.
#[derive(Parser)]
#[command(version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Offline, virtual-clock replay of a Mooncake trace through each routing policy and a
    /// simulated fleet; prints a Markdown table, optionally writes a JSON report.
    Replay(kvpick_sim::replay::ReplayArgs),
    /// Render chart data (`kvpick-lab replay --chart-data`, e2e/report.py) into a self-contained
    /// HTML report: inline SVG, no script, no network.
    ReportHtml(kvpick_sim::charts::ReportHtmlArgs),
    /// Write a seeded Mooncake JSONL trace of one workload family (chat, agentic, shared-docs,
    /// small-families, no-reuse) and print its statistics.
    Workload(kvpick_sim::workload::WorkloadArgs),
    /// A fleet of simulated vLLM workers (OpenAI HTTP, `vllm:*` metrics, KV events over ZeroMQ).
    Sim(kvpick_sim::sim::server::SimArgs),
}

/// The simulator's log on stderr, as `kvpick serve --log-format text` writes its own.
fn init_logging() {
    // `zeromq` logs each peer disconnect at INFO, which a fleet's restarts make noise of.
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,zeromq=warn"));
    use std::io::IsTerminal;
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr)
        .init();
}

fn sim(args: kvpick_sim::sim::server::SimArgs) -> anyhow::Result<()> {
    init_logging();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|err| anyhow::anyhow!("tokio runtime: {err}"))?;
    runtime.block_on(kvpick_sim::sim::server::run(args))
}

fn main() -> std::process::ExitCode {
    let done = match Cli::parse().command {
        Command::Sim(args) => sim(args),
        Command::Replay(args) => kvpick_sim::replay::run(args),
        Command::ReportHtml(args) => kvpick_sim::charts::run(args),
        Command::Workload(args) => kvpick_sim::workload::run(args),
    };
    match done {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("kvpick-lab: error: {err:#}");
            std::process::ExitCode::from(2)
        }
    }
}
