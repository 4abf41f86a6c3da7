//! The live part of [`CoreConfig`]: the settings a running core may swap without a restart
//! (cost weights, busy thresholds, saturation limits, the queue timeout, the soft session
//! margin), their validation, and how they are laid over a full config. It owns no state; the
//! swap itself is [`crate::Core::update_live_config`]. Everything else in [`CoreConfig`] (index
//! sizes, TTLs, bounds, seeds) is fixed for the life of a core and must not be added here.

use std::time::Duration;

use crate::config::{BusyThresholds, CoreConfig};
use crate::decide::CostParams;
use crate::flow::SaturationLimits;

/// Longest queue timeout a live update may set (the flag's own bound).
pub const MAX_QUEUE_TIMEOUT: Duration = Duration::from_secs(3600);

/// The settings a running core may change.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LiveConfig {
    pub cost: CostParams,
    pub busy: BusyThresholds,
    pub saturation: SaturationLimits,
    pub queue_timeout: Duration,
    pub session_soft_margin_blocks: f64,
}

/// A live setting the core refuses; the previous settings stay in force.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("live setting {field} must be {expected}, got {value}")]
pub struct LiveConfigError {
    pub field: &'static str,
    pub expected: &'static str,
    pub value: f64,
}

impl LiveConfig {
    /// The live part of `config`.
    pub fn of(config: &CoreConfig) -> Self {
        LiveConfig {
            cost: config.cost,
            busy: config.busy,
            saturation: config.flow.saturation,
            queue_timeout: config.flow.queue_timeout,
            session_soft_margin_blocks: config.sessions.soft_margin_blocks,
        }
    }

    /// `config` with its live part replaced by `self`.
    pub fn apply_to(&self, config: &CoreConfig) -> CoreConfig {
        let mut next = config.clone();
        next.cost = self.cost;
        next.busy = self.busy;
        next.flow.saturation = self.saturation;
        next.flow.queue_timeout = self.queue_timeout;
        next.sessions.soft_margin_blocks = self.session_soft_margin_blocks;
        next
    }

    /// The ranges the cost function and the queue rely on.
    pub fn validate(&self) -> Result<(), LiveConfigError> {
        let c = &self.cost;
        let weights = [
            ("overlap_score_credit", c.overlap_score_credit),
            ("prefill_load_scale", c.prefill_load_scale),
            ("decode_block_weight", c.decode_block_weight),
            (
                "decode_active_request_weight",
                c.decode_active_request_weight,
            ),
            ("host_tier_weight", c.host_tier_weight),
            ("disk_tier_weight", c.disk_tier_weight),
            ("router_temperature", c.router_temperature),
            ("stall_weight", c.stall_weight),
            ("engine_waiting_weight", c.engine_waiting_weight),
            ("engine_kv_usage_weight", c.engine_kv_usage_weight),
            ("adapter_load_weight", c.adapter_load_weight),
            ("adapter_full_weight", c.adapter_full_weight),
            (
                "session_soft_margin_blocks",
                self.session_soft_margin_blocks,
            ),
        ];
        for (field, value) in weights {
            check(
                field,
                value,
                "a finite number >= 0",
                value.is_finite() && value >= 0.0,
            )?;
        }
        let slack = c.ttft_slack;
        check("ttft_slack", slack, ">= 1 (inf = no bound)", slack >= 1.0)?;
        let f = self.busy.sheddable_fraction;
        check("sheddable_fraction", f, "in (0, 1]", f > 0.0 && f <= 1.0)?;
        if let Some(wait) = self.saturation.max_wait_seconds {
            check("max_wait_seconds", wait, "> 0", wait > 0.0)?;
        }
        if let Some(kv) = self.saturation.engine_kv_usage {
            check("engine_kv_usage", kv, "in (0, 1]", kv > 0.0 && kv <= 1.0)?;
        }
        let timeout = self.queue_timeout;
        check(
            "queue_timeout",
            timeout.as_secs_f64(),
            "at most 3600 seconds",
            timeout <= MAX_QUEUE_TIMEOUT,
        )
    }
}

fn check(
    field: &'static str,
    value: f64,
    expected: &'static str,
    ok: bool,
) -> Result<(), LiveConfigError> {
    if ok {
        Ok(())
    } else {
        Err(LiveConfigError {
            field,
            expected,
            value,
        })
    }
}
