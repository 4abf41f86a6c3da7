//! The end grace per partition as the core reports it ([`Fact::PredictionGrace`]): how long a
//! precise rank's unconfirmed predicted index entries outlive their request, adapted to the
//! partition's KV-event lag (`kvpick_core`'s `partition::grace`). It only records.

// Static metric definitions: an error is a programming error every test run hits at start-up.
#![allow(clippy::unwrap_used)]

use kvpick_core::Fact;
use prometheus::{GaugeVec, Opts, Registry};

use super::register;

#[derive(Clone)]
pub struct GraceMetrics {
    /// Seconds, per partition: 1 with prompt KV events, up to 10 while they arrive late.
    pub prediction_grace: GaugeVec,
}

impl GraceMetrics {
    pub(super) fn register(registry: &Registry) -> Self {
        GraceMetrics {
            prediction_grace: register(
                registry,
                GaugeVec::new(
                    Opts::new(
                        "kvpick_prediction_grace_seconds",
                        "How long a precise rank's unconfirmed predicted index entries outlive \
                         their request, per partition: 1 s, up to 10 s while its KV events \
                         arrive late (twice the recent peak lag, halving every 10 s of batches)",
                    ),
                    &["model", "routing_group"],
                )
                .unwrap(),
            ),
        }
    }

    /// Records the grace fact; false for any other fact.
    pub(super) fn apply(&self, fact: &Fact) -> bool {
        let Fact::PredictionGrace { partition, seconds } = fact else {
            return false;
        };
        self.prediction_grace
            .with_label_values(&[partition.model.as_str(), partition.routing_group.as_str()])
            .set(*seconds);
        true
    }
}
