//! The `kvpick` command line: parses flags and hands each subcommand to its module.

use clap::{Parser, Subcommand};

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
    /// Print the token ids kvpick computes for request bodies (one JSON body per stdin line;
    /// one JSON answer per line: `{"ids": [...], "source": "ok|cached|render|body"}` or
    /// `{"fallback": "reason"}`). For checking a tokenizer config against an engine.
    Tokenize(kvpick::tokenize::cli::TokenizeArgs),
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Serve(args) => {
            kvpick::server::init_logging(args.log_format);
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()
                .expect("tokio runtime");
            match runtime.block_on(kvpick::server::run(*args)) {
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
