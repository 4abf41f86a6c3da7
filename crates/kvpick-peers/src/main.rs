//! `kvpick-peers replay`: `kvpick replay` with the peer policies of this crate added (same flags;
//! the default policy list is every built-in policy plus every peer).

#![forbid(unsafe_code)]

use clap::Parser;
use kvpick_sim::replay::{self, policy};

#[derive(Parser)]
#[command(
    name = "kvpick-peers",
    about = "kvpick's offline replay with real peer routers"
)]
enum Command {
    /// Replay a Mooncake trace through each policy, peers included (as `kvpick replay`).
    Replay(replay::ReplayArgs),
}

fn main() -> std::process::ExitCode {
    let Command::Replay(mut args) = Command::parse();
    if args.policy == policy::ALL.map(String::from) {
        // The flag's default (every built-in policy): add the peers.
        args.policy
            .extend(policy::PEERS.iter().map(|p| p.to_string()));
    }
    let engine = match args.engine.config() {
        Ok(engine) => engine,
        Err(e) => {
            eprintln!("kvpick-peers: {e:#}");
            return std::process::ExitCode::from(2);
        }
    };
    let peers = |name: &str, ranks: usize, options: &policy::PolicyOptions| {
        kvpick_peers::build_peer(name, ranks, options, &engine)
    };
    match replay::run_with(args, &peers) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvpick-peers: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
