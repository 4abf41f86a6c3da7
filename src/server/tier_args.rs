//! `serve`'s flags for KV held outside a rank's own tiers (ARCHITECTURE.md §7, "Shared tier"):
//! a model's shared KV store (`--shared-cache-multiplier`, `--shared-cache-models`). Owns the
//! flags and their range checks only; the shared tier itself is the core's
//! (`kvpick_core::SharedCacheConfig`).

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
}

impl TierArgs {
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

    fn args(m: f64) -> TierArgs {
        TierArgs {
            shared_cache_multiplier: m,
            shared_cache_models: vec![" a ".into(), String::new()],
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
