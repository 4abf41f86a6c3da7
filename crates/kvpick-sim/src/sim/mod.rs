//! The vLLM-like simulator (ARCHITECTURE.md §10): [`engine`] is the pure, clock-agnostic model of one
//! rank (paged prefix cache, continuous batching, latency model, KV events as values); the
//! real-time HTTP/ZeroMQ fleet that serves it is [`server`], its KV-event encoder [`wire`]. Nothing here routes requests or
//! touches the selection core.

pub mod engine;
pub mod pd;
pub mod server;
pub mod wire;

/// Model name the simulated fleet serves by default (and the replay's catalog uses).
pub const MODEL: &str = "kvpick-sim";

/// Engine and latency-model flags shared by `kvpick sim` and `kvpick replay`.
#[derive(Debug, Clone, clap::Args)]
pub struct EngineArgs {
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// KV blocks per rank.
    #[arg(long, default_value_t = 32_768)]
    pub num_gpu_blocks: usize,
    /// Most requests running at once per rank.
    #[arg(long, default_value_t = 256)]
    pub max_num_seqs: usize,
    /// Token budget of one engine step (chunked prefill + decodes).
    #[arg(long, default_value_t = 8_192)]
    pub max_num_batched_tokens: usize,
    /// Fixed cost when a request's prefill starts, milliseconds.
    #[arg(long, default_value_t = 5.0)]
    pub prefill_overhead_ms: f64,
    /// Prefill cost per uncached prompt token, microseconds.
    #[arg(long, default_value_t = 50.0)]
    pub prefill_us_per_token: f64,
    /// Decode step time at batch 0 (`itl(b) = itl_ms + itl_ms_per_seq × b`), milliseconds.
    #[arg(long, default_value_t = 8.0)]
    pub itl_ms: f64,
    /// Decode step time per running request, milliseconds.
    #[arg(long, default_value_t = 0.05)]
    pub itl_ms_per_seq: f64,
    /// Decode step time per KV token of the decoding requests (memory-bound attention),
    /// nanoseconds; 0 = `itl` depends on the batch size only. ~40 models an 8B model's
    /// 128 KiB/token KV read at ~3 TB/s.
    #[arg(long, default_value_t = 0.0)]
    pub itl_ns_per_kv_token: f64,
    /// Prefill/decode disaggregation: time a decode rank spends pulling one KV block from the
    /// prefill rank, microseconds (NIXL/RDMA; default 5% of computing the block at the default
    /// prefill speed).
    #[arg(long, default_value_t = 40.0)]
    pub kv_transfer_us_per_block: f64,
}

impl EngineArgs {
    /// `--kv-transfer-us-per-block` in nanoseconds, checked.
    pub fn kv_transfer_ns_per_block(&self) -> anyhow::Result<u64> {
        let v = self.kv_transfer_us_per_block;
        anyhow::ensure!(
            v.is_finite() && v >= 0.0,
            "--kv-transfer-us-per-block must be >= 0, got {v}"
        );
        Ok((v * 1e3).round() as u64)
    }

    pub fn config(&self) -> anyhow::Result<engine::EngineConfig> {
        for (name, v) in [
            ("--prefill-overhead-ms", self.prefill_overhead_ms),
            ("--prefill-us-per-token", self.prefill_us_per_token),
            ("--itl-ms", self.itl_ms),
            ("--itl-ms-per-seq", self.itl_ms_per_seq),
            ("--itl-ns-per-kv-token", self.itl_ns_per_kv_token),
        ] {
            anyhow::ensure!(v.is_finite() && v >= 0.0, "{name} must be >= 0, got {v}");
        }
        anyhow::ensure!(self.block_size > 0, "--block-size must be > 0");
        anyhow::ensure!(self.num_gpu_blocks > 0, "--num-gpu-blocks must be > 0");
        anyhow::ensure!(self.max_num_seqs > 0, "--max-num-seqs must be > 0");
        anyhow::ensure!(
            self.max_num_batched_tokens > 0,
            "--max-num-batched-tokens must be > 0"
        );
        Ok(engine::EngineConfig {
            block_size: self.block_size,
            num_gpu_blocks: self.num_gpu_blocks,
            max_num_seqs: self.max_num_seqs,
            max_num_batched_tokens: self.max_num_batched_tokens,
            prefill_overhead_ns: (self.prefill_overhead_ms * 1e6).round() as u64,
            prefill_ns_per_token: (self.prefill_us_per_token * 1e3).round() as u64,
            itl_ns: (self.itl_ms * 1e6).round() as u64,
            itl_ns_per_seq: (self.itl_ms_per_seq * 1e6).round() as u64,
            itl_ps_per_kv_token: (self.itl_ns_per_kv_token * 1e3).round() as u64,
        })
    }
}
