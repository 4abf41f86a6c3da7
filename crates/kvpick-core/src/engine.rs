//! What an engine says about itself: one scrape of a rank's model-server metrics (the GIE
//! model-server protocol: queue depth, running requests, KV-cache usage, LoRA adapters), as the
//! host read it, and what the decision takes from it. Values only: the scraping, its schedule
//! and its failures are the host's; how much a reading costs is [`crate::decide`]'s.

use std::sync::Arc;
use std::time::{Duration, Instant};

/// One reading of a rank's engine metrics.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineMetrics {
    /// Requests queued in the engine (vLLM `num_requests_waiting`).
    pub waiting: u64,
    /// Requests in the engine's running batch (vLLM `num_requests_running`).
    pub running: u64,
    /// KV-cache usage, 0..=1 (vLLM `kv_cache_usage_perc`).
    pub kv_usage: f64,
    /// Adapters with running or waiting requests (vLLM `lora_requests_info`): loaded on the rank.
    pub adapters: Arc<[String]>,
    /// Most adapters the engine holds at once (`max_lora`), when it says.
    pub max_adapters: Option<u32>,
    /// When the reading was taken.
    pub at: Instant,
}

/// The load part of a fresh reading, as a decision candidate carries it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EngineLoad {
    pub waiting: u64,
    pub running: u64,
    pub kv_usage: f64,
}

/// Where a LoRA request's adapter stands on a rank, by the rank's fresh reading.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AdapterFit {
    /// Not an adapter request, or no fresh reading: nothing is known, nothing is charged.
    #[default]
    Unknown,
    /// The adapter has running or waiting requests on the rank.
    Loaded,
    /// Not loaded, and the rank has room for another adapter.
    Room,
    /// Not loaded, and the rank already holds `max_adapters` others: serving it means an
    /// eviction or a wait.
    Full,
}

impl EngineMetrics {
    /// Whether the reading may be used at `now`: taken within `max_age`. A stale reading (the
    /// rank stopped answering, or answers slowly) is ignored, as if there were none.
    pub fn is_fresh(&self, now: Instant, max_age: Duration) -> bool {
        now.saturating_duration_since(self.at) <= max_age
    }

    pub fn load(&self) -> EngineLoad {
        EngineLoad {
            waiting: self.waiting,
            running: self.running,
            kv_usage: self.kv_usage,
        }
    }

    /// How `adapter` fits this rank.
    pub fn adapter_fit(&self, adapter: &str) -> AdapterFit {
        if self.adapters.iter().any(|a| a == adapter) {
            AdapterFit::Loaded
        } else if self
            .max_adapters
            .is_some_and(|max| self.adapters.len() >= max as usize)
        {
            AdapterFit::Full
        } else {
            AdapterFit::Room
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reading(adapters: &[&str], max: Option<u32>) -> EngineMetrics {
        EngineMetrics {
            waiting: 0,
            running: 0,
            kv_usage: 0.0,
            adapters: adapters.iter().map(|a| a.to_string()).collect(),
            max_adapters: max,
            at: Instant::now(),
        }
    }

    #[test]
    fn adapter_fit_respects_max_adapters() {
        assert_eq!(
            reading(&["a"], Some(1)).adapter_fit("a"),
            AdapterFit::Loaded
        );
        assert_eq!(reading(&["a"], Some(1)).adapter_fit("b"), AdapterFit::Full);
        assert_eq!(reading(&["a"], Some(2)).adapter_fit("b"), AdapterFit::Room);
        assert_eq!(reading(&["a"], None).adapter_fit("b"), AdapterFit::Room);
    }

    #[test]
    fn a_reading_goes_stale_after_max_age() {
        let r = reading(&[], None);
        let max_age = Duration::from_millis(500);
        assert!(r.is_fresh(r.at, max_age));
        assert!(r.is_fresh(r.at + max_age, max_age));
        assert!(!r.is_fresh(r.at + max_age + Duration::from_millis(1), max_age));
    }
}
