//! The scale benchmark's parameters ([`ScaleArgs`]: its flags, their defaults and bounds),
//! read by the scenario ([`crate::scale`]) and written into its report ([`crate::report`]).
//! Values only: nothing here runs the benchmark.

use std::path::PathBuf;

use anyhow::bail;

use crate::workload::Workload;

/// Most pods the loopback addressing below gives distinct IPs (127.64.0.1 upwards).
pub const MAX_PODS: u32 = 1 << 20;

/// The benchmark's parameters; the defaults are the issue's.
#[derive(Debug, Clone, clap::Parser)]
#[command(
    name = "scale",
    about = "kvpick at fleet scale: pods × ranks through the Kubernetes reflector"
)]
pub struct ScaleArgs {
    /// Pods in the InferencePool.
    #[arg(long, default_value_t = 1_000)]
    pub pods: u32,
    /// Data-parallel ranks per pod (`kvpick.io/data-parallel-size`), each its own publisher.
    #[arg(long, default_value_t = 8)]
    pub ranks: u32,
    /// Pod changes per second (see `churn` for the mix).
    #[arg(long, default_value_t = 100.0)]
    pub pod_changes_per_second: f64,
    /// Container restarts in the churn become status-only updates (isolates the cost of
    /// forgetting restarted engines' blocks).
    #[arg(long)]
    pub no_restarts: bool,
    /// Picks per second, open loop, through ext_proc.
    #[arg(long, default_value_t = 2_000.0)]
    pub picks_per_second: f64,
    /// KV-event batches per second each rank publishes.
    #[arg(long, default_value_t = 1.0)]
    pub events_per_rank_second: f64,
    /// Blocks stored per KV-event batch.
    #[arg(long, default_value_t = 4)]
    pub blocks_per_event: u32,
    /// Shared prompt prefixes (families) the engines cache and requests ask for.
    #[arg(long, default_value_t = 256)]
    pub families: u32,
    /// Blocks of a family's prefix.
    #[arg(long, default_value_t = 32)]
    pub family_blocks: u32,
    /// Engine KV block size in tokens (annotated on the pods).
    #[arg(long, default_value_t = 16)]
    pub block_size: u32,
    /// Tokens per request prompt (its family's prefix, then its own tokens).
    #[arg(long, default_value_t = 1_024)]
    pub prompt_tokens: u32,
    /// Seconds measured, after the warm-up.
    #[arg(long, default_value_t = 30.0)]
    pub duration_secs: f64,
    /// Seconds of churn, events and picks before the measured window.
    #[arg(long, default_value_t = 5.0)]
    pub warmup_secs: f64,
    /// Milliseconds after which a pick is abandoned and counted at this latency (a lower bound).
    #[arg(long, default_value_t = 5_000)]
    pub pick_timeout_ms: u64,
    /// HTTP/2 connections the picks are spread over.
    #[arg(long, default_value_t = 2)]
    pub connections: usize,
    /// Rank 0's KV-event port on every pod (rank r at + r).
    #[arg(long, default_value_t = 25_557)]
    pub kv_port: u16,
    /// How long to wait for every KV-event subscription before measuring anyway.
    #[arg(long, default_value_t = 120.0)]
    pub subscribe_timeout_secs: f64,
    /// The JSON report.
    #[arg(long, default_value = "target/bench-scale.json")]
    pub out: PathBuf,
    /// Where kvpick's log is copied at the end (default: beside the report, `.kvpick.log`).
    #[arg(long)]
    pub kvpick_log: Option<PathBuf>,
    /// A smoke run at tiny size (4 pods × 2 ranks, 2 s): checks the benchmark works, not kvpick's speed.
    #[arg(long)]
    pub quick: bool,
    /// Another kvpick binary to run (before/after comparisons); default: the one cargo built.
    #[arg(long)]
    pub kvpick_bin: Option<PathBuf>,
    /// Extra `kvpick serve` flag (repeatable), e.g. `--kvpick-arg=--max-prompt-blocks=64`.
    #[arg(long = "kvpick-arg", allow_hyphen_values = true)]
    pub kvpick_args: Vec<String>,
    /// Passed by `cargo bench` (without it the bench binary makes its smoke run).
    #[arg(long, hide = true)]
    pub bench: bool,
}

impl ScaleArgs {
    /// `--quick` applied: the tiny smoke sizes.
    pub fn resolved(mut self) -> ScaleArgs {
        if self.quick {
            self.pods = 4;
            self.ranks = 2;
            self.pod_changes_per_second = 10.0;
            self.picks_per_second = 50.0;
            self.events_per_rank_second = 20.0;
            self.families = 8;
            self.duration_secs = 2.0;
            self.warmup_secs = 1.0;
            self.subscribe_timeout_secs = 30.0;
        }
        self
    }

    pub(crate) fn validate(&self) -> anyhow::Result<()> {
        if !(1..=MAX_PODS).contains(&self.pods) {
            bail!("--pods must be 1..={MAX_PODS}");
        }
        if !(1..=64).contains(&self.ranks) {
            bail!("--ranks must be 1..=64 (kvpick's data-parallel limit)");
        }
        if u32::from(self.kv_port) + self.ranks > 65_536 {
            bail!("--kv-port + --ranks must stay within 65535");
        }
        for (name, value) in [
            ("--duration-secs", self.duration_secs),
            ("--picks-per-second", self.picks_per_second),
        ] {
            if !(value.is_finite() && value > 0.0) {
                bail!("{name} must be a positive number");
            }
        }
        if self.block_size == 0 || self.family_blocks == 0 || self.families == 0 {
            bail!("--block-size, --family-blocks and --families must be positive");
        }
        Ok(())
    }

    pub(crate) fn workload(&self) -> Workload {
        Workload {
            families: self.families,
            family_blocks: self.family_blocks,
            block_size: self.block_size,
            prompt_tokens: self.prompt_tokens,
        }
    }
}
