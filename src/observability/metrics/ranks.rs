//! The engines' standing per rank as the core reports it ([`Fact::RankReachable`],
//! [`Fact::BlockSizeMismatch`]): the series, and the one log line per change (a WARN when a rank
//! leaves the picks, an INFO when it comes back, an ERROR when a rank's KV events carry another
//! block size than its partition's). It only records; the judgement is the hosts' and the core's.

// Static metric definitions: an error is a programming error every test run hits at start-up.
#![allow(clippy::unwrap_used)]

use kvpick_core::Fact;
use prometheus::{IntCounterVec, IntGaugeVec, Opts, Registry};

use super::register;

#[derive(Clone)]
pub struct RankMetrics {
    /// 1 while a rank is out of picks because its engine is unreachable, 0 after it came back
    /// (absent: never reported unreachable).
    pub unreachable: IntGaugeVec,
    /// Times a worker's ranks were reported unreachable.
    pub unreachable_total: IntCounterVec,
    /// The block size a rank's KV events carry while it is not its partition's, 0 once they
    /// match again.
    pub block_size_mismatch: IntGaugeVec,
}

impl RankMetrics {
    pub(super) fn register(registry: &Registry) -> Self {
        RankMetrics {
            unreachable: register(
                registry,
                IntGaugeVec::new(
                    Opts::new(
                        "kvpick_rank_unreachable",
                        "1 while a rank takes no picks because its engine is unreachable (KV events \
                         lost and its endpoint refusing connections, or a refused engine-metrics \
                         scrape), 0 once it answers again",
                    ),
                    &["worker", "rank"],
                )
                .unwrap(),
            ),
            unreachable_total: register(
                registry,
                IntCounterVec::new(
                    Opts::new(
                        "kvpick_rank_unreachable_total",
                        "Times a rank of the worker was taken out of picks as unreachable",
                    ),
                    &["worker"],
                )
                .unwrap(),
            ),
            block_size_mismatch: register(
                registry,
                IntGaugeVec::new(
                    Opts::new(
                        "kvpick_rank_kv_block_size_mismatch",
                        "The block size a rank's KV events carry while it differs from the \
                         worker's (their stores are dropped), 0 once they match",
                    ),
                    &["worker", "rank"],
                )
                .unwrap(),
            ),
        }
    }

    /// Records one of the standing facts; false for any other fact.
    pub(super) fn apply(&self, fact: &Fact) -> bool {
        match fact {
            Fact::RankReachable {
                worker,
                dp_rank,
                reachable,
            } => {
                let labels = [&**worker, &dp_rank.to_string()];
                self.unreachable
                    .with_label_values(&labels)
                    .set(i64::from(!*reachable));
                if *reachable {
                    tracing::info!(worker = %worker, dp_rank, "engine answers again: rank back in picks");
                } else {
                    self.unreachable_total.with_label_values(&[&**worker]).inc();
                    tracing::warn!(
                        worker = %worker,
                        dp_rank,
                        "engine unreachable (KV events lost, endpoint refusing connections): rank out of picks"
                    );
                }
            }
            Fact::BlockSizeMismatch {
                worker,
                dp_rank,
                partition,
                engine,
            } => {
                let labels = [&**worker, &dp_rank.to_string()];
                let gauge = self.block_size_mismatch.with_label_values(&labels);
                match engine {
                    Some(size) => {
                        gauge.set(i64::from(*size));
                        tracing::error!(
                            worker = %worker,
                            dp_rank,
                            engine_block_size = size,
                            block_size = partition,
                            "KV events carry another block size than the worker's: every store \
                             of this rank is dropped and its cache is invisible to routing; set \
                             the worker's block_size to the engine's (vLLM --block-size), or \
                             leave it out to learn it from the events"
                        );
                    }
                    None => {
                        gauge.set(0);
                        tracing::info!(worker = %worker, dp_rank, block_size = partition, "KV events match the block size again");
                    }
                }
            }
            _ => return false,
        }
        true
    }

    /// A rank left: its series go.
    pub(super) fn rank_gone(&self, worker: &str, dp_rank: u32) {
        let labels = [worker, &dp_rank.to_string()];
        let _ = self.unreachable.remove_label_values(&labels);
        let _ = self.block_size_mismatch.remove_label_values(&labels);
    }
}
