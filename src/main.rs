//! The `kvpick` command line: parses flags and hands each subcommand to its module.

#![forbid(unsafe_code)]

use clap::{Parser, Subcommand};

// mimalloc: tokenizers, minijinja and body parsing allocate per token and per string; with
// glibc malloc the allocator was ~40% of a tokenization (crates/kvpick-tokenize/benches/tokenize.rs), with mimalloc the
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
    /// simulated fleet (runs `kvpick-lab replay`).
    #[command(disable_help_flag = true)]
    Replay(LabArgs),
    /// Render chart data into a self-contained HTML report (runs `kvpick-lab report-html`).
    #[command(disable_help_flag = true)]
    ReportHtml(LabArgs),
    /// Write a seeded Mooncake JSONL trace of one workload family (runs `kvpick-lab workload`).
    #[command(disable_help_flag = true)]
    Workload(LabArgs),
    /// A fleet of simulated vLLM workers (runs `kvpick-lab sim`).
    #[command(disable_help_flag = true)]
    Sim(LabArgs),
    /// Print the token ids kvpick computes for request bodies (one JSON body per stdin line;
    /// one JSON answer per line: `{"ids": [...], "source": "ok|cached|render|body"}` or
    /// `{"fallback": "reason"}`). For checking a tokenizer config against an engine.
    Tokenize(kvpick::tokenize::cli::TokenizeArgs),
}

/// The arguments of a lab subcommand, handed to `kvpick-lab` untouched (its `--help` included).
#[derive(clap::Args)]
struct LabArgs {
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    args: Vec<std::ffi::OsString>,
}

/// The lab's subcommands live in `kvpick-lab` (crates/kvpick-lab), so that this binary links
/// neither the simulator nor tokio's `test-util`. As git and cargo do for their external
/// subcommands, `kvpick replay ...` becomes `kvpick-lab replay ...` when the lab is installed
/// beside this binary (`cargo build -p kvpick -p kvpick-lab` builds both into one folder); the
/// process is replaced, so signals and the exit status are the lab's own. Without it, the error
/// names the commands that build and run it.
fn lab(subcommand: &str, args: LabArgs) -> std::process::ExitCode {
    use std::os::unix::process::CommandExt;
    let beside = std::env::current_exe()
        .ok()
        .map(|exe| exe.with_file_name("kvpick-lab"));
    if let Some(lab) = beside.as_ref().filter(|lab| lab.is_file()) {
        let err = std::process::Command::new(lab)
            .arg(subcommand)
            .args(&args.args)
            .exec();
        eprintln!("kvpick: error: cannot run {}: {err}", lab.display());
        return std::process::ExitCode::from(2);
    }
    let command: Vec<String> = std::iter::once(subcommand.to_string())
        .chain(args.args.iter().map(|a| shell_word(&a.to_string_lossy())))
        .collect();
    let place = beside.map(|p| format!(" ({})", p.display()));
    eprintln!(
        "kvpick: error: `kvpick {subcommand}` is in the lab binary, kvpick-lab, which is not \
         installed beside this kvpick{}.\n\
         Build it:  cargo build --release -p kvpick-lab\n\
         Then run:  target/release/kvpick-lab {}",
        place.unwrap_or_default(),
        command.join(" "),
    );
    std::process::ExitCode::from(2)
}

/// `word` as one shell word (quoted when it holds anything but safe characters).
fn shell_word(word: &str) -> String {
    let safe = |c: char| c.is_ascii_alphanumeric() || "-_./=:,+@%".contains(c);
    if !word.is_empty() && word.chars().all(safe) {
        word.to_string()
    } else {
        format!("'{}'", word.replace('\'', r"'\''"))
    }
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
        Command::Replay(args) => lab("replay", args),
        Command::ReportHtml(args) => lab("report-html", args),
        Command::Workload(args) => lab("workload", args),
        Command::Sim(args) => lab("sim", args),
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
            match runtime.block_on(kvpick::server::serve(args)) {
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
