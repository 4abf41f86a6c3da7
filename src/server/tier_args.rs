//! `serve`'s flags for KV held outside a rank's own tiers: a model's shared KV store
//! (ARCHITECTURE.md §7, "Shared tier": `--shared-cache-multiplier`, `--shared-cache-models`) and
//! KV transfer hints (§4, "Transfer hints": `--kv-transfer-hints`, `--kv-transfer-p2p-port`).
//! Owns the flags and their range checks only; the shared tier and the hints are the core's
//! (`kvpick_core::SharedCacheConfig`, `CoreConfig::kv_transfer_hints`), the hint's wire form the
//! ext_proc host's.

use clap::Args;
use kvpick_core::SharedCacheConfig;

/// Largest `--shared-cache-multiplier`: a shared hit never counts more than a GPU hit.
pub const MAX_SHARED_CACHE_MULTIPLIER: f64 = 1.0;

/// A shared KV store per model.
#[derive(Debug, Clone, Args)]
pub struct TierArgs {
    /// Weight of a prompt block the model's shared KV store holds (LMCache, Mooncake store,
    /// SGLang HiCache with a shared backend; KV events with medium `EXTERNAL`) beyond a rank's
    /// own cached prefix, against a block on the rank's GPU (1) and one it must recompute (0): a
    /// shared hit costs a load, cheaper than a recompute, dearer than a local hit. 0 = off
    /// (`EXTERNAL` stores count as the storing rank's disk tier). At most 1.
    #[arg(
        long,
        default_value_t = 0.0,
        value_name = "X",
        help_heading = "Scheduling"
    )]
    pub shared_cache_multiplier: f64,

    /// With --shared-cache-multiplier: the models attached to a shared KV store,
    /// comma-separated; empty = every model.
    #[arg(
        long,
        value_delimiter = ',',
        value_name = "MODEL,...",
        help_heading = "Scheduling"
    )]
    pub shared_cache_models: Vec<String>,

    /// When a pick is not the rank holding the prompt's longest cached prefix (the holder is
    /// saturated, or an idle rank costs less), name the least-loaded holder so the picked engine
    /// pulls the prefix instead of recomputing it: llm-d's `x-kv-cache-source-host-port`
    /// (holder's host:port, for its routing sidecar's P2P pull). Never on query-only selections.
    #[arg(long, help_heading = "Scheduling")]
    pub kv_transfer_hints: bool,

    /// With --kv-transfer-hints: also set vLLM's `kv_transfer_params.remote_kv_source`
    /// (`remote_host`, this port + the holder's DP rank as `remote_port`, the booking id as
    /// `kv_request_id`) in the request body, for engines whose P2P KV connector reads it
    /// directly (vLLM's side-channel port, 5710 by default). Unset: the header alone.
    #[arg(long, value_name = "PORT", help_heading = "Scheduling")]
    pub kv_transfer_p2p_port: Option<u16>,
}

impl TierArgs {
    /// `--kv-transfer-p2p-port` needs `--kv-transfer-hints` (without hints it would never act),
    /// and is never port 0.
    pub fn p2p_port(&self) -> anyhow::Result<Option<u16>> {
        match self.kv_transfer_p2p_port {
            Some(0) => anyhow::bail!("--kv-transfer-p2p-port must be 1..=65535, got 0"),
            Some(_) if !self.kv_transfer_hints => {
                anyhow::bail!("--kv-transfer-p2p-port needs --kv-transfer-hints")
            }
            port => Ok(port),
        }
    }

    /// The core's shared-cache configuration, checked.
    pub fn shared_cache(&self) -> anyhow::Result<SharedCacheConfig> {
        let m = self.shared_cache_multiplier;
        if !(m.is_finite() && (0.0..=MAX_SHARED_CACHE_MULTIPLIER).contains(&m)) {
            anyhow::bail!("--shared-cache-multiplier must be in [0, 1], got {m}");
        }
        Ok(SharedCacheConfig {
            multiplier: m,
            models: self
                .shared_cache_models
                .iter()
                .map(|m| m.trim().to_string())
                .filter(|m| !m.is_empty())
                .collect(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_p2p_port_needs_hints_and_is_never_zero() {
        let mut a = args(0.0);
        assert_eq!(a.p2p_port().unwrap(), None);
        a.kv_transfer_p2p_port = Some(5710);
        assert!(a
            .p2p_port()
            .unwrap_err()
            .to_string()
            .contains("--kv-transfer-hints"));
        a.kv_transfer_hints = true;
        assert_eq!(a.p2p_port().unwrap(), Some(5710));
        a.kv_transfer_p2p_port = Some(1);
        assert_eq!(a.p2p_port().unwrap(), Some(1), "the lowest port is one");
        a.kv_transfer_p2p_port = Some(0);
        assert!(a.p2p_port().is_err());
    }

    fn args(m: f64) -> TierArgs {
        TierArgs {
            shared_cache_multiplier: m,
            shared_cache_models: vec![" a ".into(), String::new()],
            kv_transfer_hints: false,
            kv_transfer_p2p_port: None,
        }
    }

    #[test]
    fn the_multiplier_is_checked_at_and_just_over_its_bounds() {
        assert_eq!(args(0.0).shared_cache().unwrap().multiplier, 0.0);
        assert_eq!(args(1.0).shared_cache().unwrap().multiplier, 1.0);
        assert_eq!(
            args(0.5).shared_cache().unwrap().models,
            vec!["a".to_string()]
        );
        for bad in [
            1.0 + f64::EPSILON,
            -f64::MIN_POSITIVE,
            f64::NAN,
            f64::INFINITY,
        ] {
            let err = args(bad).shared_cache().unwrap_err().to_string();
            assert!(err.contains("--shared-cache-multiplier"), "{err}");
        }
    }
}
