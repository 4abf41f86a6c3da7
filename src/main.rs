//! The `kvpick` command line: parses flags and hands each subcommand to its module.

#![forbid(unsafe_code)]

use clap::{Parser, Subcommand};

// mimalloc: tokenizers, minijinja and body parsing allocate per token and per string; with
// glibc malloc the allocator was ~40% of a tokenization (benches/tokenize.rs), with mimalloc the
// same work is ~1.8x faster.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// kvpick: a KV-cache-aware endpoint picker (Envoy ext_proc) for vLLM/SGLang fleets.
#[derive(Parser)]
#[command(version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the endpoint picker: Envoy ext_proc on --grpc-port, health, metrics.
    Serve(Box<kvpick::server::ServeArgs>),
    /// Offline, virtual-clock replay of a Mooncake trace through each routing policy and a
    /// simulated fleet; prints a Markdown table, optionally writes a JSON report.
    Replay(kvpick_sim::replay::ReplayArgs),
    /// Render chart data (`kvpick replay --chart-data`, e2e/report.py) into a self-contained HTML
    /// report: inline SVG, no script, no network.
    ReportHtml(kvpick_sim::charts::ReportHtmlArgs),
    /// Write a seeded Mooncake JSONL trace of one workload family (chat, agentic, shared-docs,
    /// small-families, no-reuse) and print its statistics.
    Workload(kvpick_sim::workload::WorkloadArgs),
    /// A fleet of simulated vLLM workers (OpenAI HTTP, `vllm:*` metrics, KV events over ZeroMQ).
    Sim(kvpick_sim::sim::server::SimArgs),
    /// Print the token ids kvpick computes for request bodies (one JSON body per stdin line;
    /// one JSON answer per line: `{"ids": [...], "source": "ok|cached|render|body"}` or
    /// `{"fallback": "reason"}`). For checking a tokenizer config against an engine.
    Tokenize(kvpick::tokenize::cli::TokenizeArgs),
}

/// A multi-threaded tokio runtime; failing to build one is fatal before anything starts.
fn runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Sim(args) => {
            kvpick::server::init_logging(kvpick::server::LogFormat::Text);
            let runtime = match runtime() {
                Ok(r) => r,
                Err(err) => {
                    eprintln!("kvpick: error: tokio runtime: {err}");
                    return std::process::ExitCode::from(2);
                }
            };
            match runtime.block_on(kvpick_sim::sim::server::run(args)) {
                Ok(()) => std::process::ExitCode::SUCCESS,
                Err(err) => {
                    eprintln!("kvpick: error: {err:#}");
                    std::process::ExitCode::from(2)
                }
            }
        }
        Command::Replay(args) => match kvpick_sim::replay::run(args) {
            Ok(()) => std::process::ExitCode::SUCCESS,
            Err(err) => {
                eprintln!("kvpick: error: {err:#}");
                std::process::ExitCode::from(2)
            }
        },
        Command::ReportHtml(args) => match kvpick_sim::charts::run(args) {
            Ok(()) => std::process::ExitCode::SUCCESS,
            Err(err) => {
                eprintln!("kvpick: error: {err:#}");
                std::process::ExitCode::from(2)
            }
        },
        Command::Workload(args) => match kvpick_sim::workload::run(args) {
            Ok(()) => std::process::ExitCode::SUCCESS,
            Err(err) => {
                eprintln!("kvpick: error: {err:#}");
                std::process::ExitCode::from(2)
            }
        },
        Command::Serve(args) => {
            let args = match kvpick::server::settings::apply(
                *args,
                kvpick::server::settings::serve_argv(),
            ) {
                Ok(args) => args,
                Err(err) => {
                    eprintln!("kvpick: error: {err:#}");
                    return std::process::ExitCode::from(2);
                }
            };
            kvpick::server::init_logging(args.log_format);
            let runtime = match runtime() {
                Ok(r) => r,
                Err(err) => {
                    eprintln!("kvpick: error: tokio runtime: {err}");
                    return std::process::ExitCode::from(2);
                }
            };
            match runtime.block_on(kvpick::server::run(args)) {
                Ok(()) => std::process::ExitCode::SUCCESS,
                Err(err) => {
                    tracing::error!("{err:#}");
                    eprintln!("kvpick: error: {err:#}");
                    std::process::ExitCode::from(2)
                }
            }
        }
        Command::Tokenize(args) => match kvpick::tokenize::cli::run(args) {
            Ok(()) => std::process::ExitCode::SUCCESS,
            Err(err) => {
                eprintln!("kvpick: error: {err:#}");
                std::process::ExitCode::from(2)
            }
        },
    }
}
