//! KV held outside a rank's own tiers (ARCHITECTURE.md §7, "Shared tier"): the blocks each
//! model's shared KV store holds, the picks it changed, and the KV transfer hints given. Only
//! records the core's facts; the shared tier and the hints are the core's.

// Static metric definitions: an error is a programming error every test run hits at start-up.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use kvpick_core::Fact;
use prometheus::{IntCounter, IntCounterVec, IntGaugeVec, Opts, Registry};

/// The shared tier's and the transfer hints' series.
#[derive(Clone)]
pub struct TierMetrics {
    /// Blocks each partition's shared tier holds.
    pub shared_blocks: IntGaugeVec,
    /// Booked picks some candidate could load from the shared tier, by whether it changed them.
    pub shared_picks: IntCounterVec,
    /// Booked picks that carried a KV transfer hint.
    pub transfer_hints: IntCounter,
}

impl TierMetrics {
    pub fn register(registry: &Registry) -> Self {
        let shared_blocks = IntGaugeVec::new(
            Opts::new(
                "kvpick_shared_tier_blocks",
                "Blocks the model's shared KV store holds (KV events with medium EXTERNAL, \
                 --shared-cache-multiplier > 0)",
            ),
            &["model", "routing_group"],
        )
        .unwrap();
        let shared_picks = IntCounterVec::new(
            Opts::new(
                "kvpick_shared_tier_picks_total",
                "Booked picks where some candidate could load prompt blocks from the shared KV \
                 store, by outcome: changed (the same decision without the shared tier picks \
                 another rank) or unchanged",
            ),
            &["outcome"],
        )
        .unwrap();
        let transfer_hints = IntCounter::new(
            "kvpick_kv_transfer_hints_total",
            "Booked picks that named another rank to pull the prompt's cached prefix from \
             (--kv-transfer-hints)",
        )
        .unwrap();
        registry.register(Box::new(shared_blocks.clone())).unwrap();
        registry.register(Box::new(shared_picks.clone())).unwrap();
        registry.register(Box::new(transfer_hints.clone())).unwrap();
        TierMetrics {
            shared_blocks,
            shared_picks,
            transfer_hints,
        }
    }

    /// Records one of the tier facts; other facts are not this module's.
    pub fn record(&self, fact: &Fact) {
        match fact {
            Fact::SharedTierSize { partition, blocks } => self
                .shared_blocks
                .with_label_values(&[partition.model.as_str(), partition.routing_group.as_str()])
                .set(i64::try_from(*blocks).unwrap_or(i64::MAX)),
            Fact::SharedTierPick { changed } => self
                .shared_picks
                .with_label_values(&[if *changed { "changed" } else { "unchanged" }])
                .inc(),
            Fact::TransferHint => self.transfer_hints.inc(),
            _ => {}
        }
    }
}
