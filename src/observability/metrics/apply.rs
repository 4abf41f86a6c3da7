//! Turning the core's facts into metric updates ([`Metrics::apply`]): one dispatch over the
//! fact kinds, then one recorder per area (ranks' load, outliers, sessions, the index and KV
//! events, the catalog, bookings, flow control). Records only; decides nothing.

use kvpick_core::{Fact, Facts, Lifecycle, QueueEvent, QueueExit};

use super::Metrics;

impl Metrics {
    /// Records what a core operation changed (the core returns facts; it records nothing).
    pub fn apply(&self, facts: &Facts) {
        for fact in facts.iter() {
            match fact {
                Fact::Load { .. } | Fact::RankPrecise { .. } | Fact::RankGone { .. } => {
                    self.rank_fact(fact)
                }
                Fact::RankReachable { .. } | Fact::BlockSizeMismatch { .. } => {
                    self.ranks.apply(fact);
                }
                Fact::PredictionGrace { .. } => {
                    self.grace.apply(fact);
                }
                Fact::Inflight(delta) => self.selection.inflight_total.add(*delta),
                Fact::UpstreamResponse { .. } | Fact::Outlier { .. } | Fact::EjectedRanks(_) => {
                    self.outlier_fact(fact)
                }
                Fact::Session(_)
                | Fact::SessionParent(_)
                | Fact::SessionInvalidated(_)
                | Fact::SessionsExpired(_)
                | Fact::SessionsLive(_) => self.session_fact(fact),
                Fact::BookingsDecayed(n) => self.bookings.decayed.inc_by(*n),
                Fact::BookingsReconciled(n) => self.bookings.reconciled.inc_by(*n),
                Fact::BookingsExpired(n) => self.selection.bookings_expired.inc_by(*n),
                Fact::IndexSize { .. }
                | Fact::PredictedOverlap(_)
                | Fact::KvEvents { .. }
                | Fact::TtftObserved { .. } => self.selection_fact(fact),
                Fact::CatalogWorkers(counts) => self.catalog_workers(counts),
                Fact::SloTtft { priority, met } => {
                    self.flow.slo_outcome(&self.flow.slo_ttft, *priority, *met)
                }
                Fact::SloTpot { priority, met } => {
                    self.flow.slo_outcome(&self.flow.slo_tpot, *priority, *met)
                }
                Fact::Queue {
                    priority,
                    fairness_key,
                    event,
                } => self.queue_event(*priority, fairness_key, event),
                // Delivered to its waiter by the selection host, not a metric.
                Fact::Dequeued { .. } => {}
                Fact::SharedTierSize { .. } | Fact::SharedTierPick { .. } | Fact::TransferHint => {
                    self.tiers.record(fact)
                }
            }
        }
    }

    /// A rank's load and precision, and the series of a rank that left.
    fn rank_fact(&self, fact: &Fact) {
        match fact {
            Fact::Load {
                worker,
                dp_rank,
                load,
            } => {
                self.pool.load(worker, *dp_rank, load);
                let labels = [&**worker, &dp_rank.to_string()];
                let selection = &self.selection;
                selection
                    .inflight
                    .with_label_values(&labels)
                    .set(load.active_requests as i64);
                selection
                    .active_prefill_tokens
                    .with_label_values(&labels)
                    .set(load.active_prefill_tokens as i64);
                selection
                    .active_decode_blocks
                    .with_label_values(&labels)
                    .set(load.active_decode_blocks as i64);
            }
            Fact::RankPrecise {
                worker,
                dp_rank,
                precise,
            } => self
                .events
                .rank_precise
                .with_label_values(&[&**worker, &dp_rank.to_string()])
                .set(i64::from(*precise)),
            Fact::RankGone { worker, dp_rank } => self.rank_gone(worker, *dp_rank),
            _ => {}
        }
    }

    fn rank_gone(&self, worker: &std::sync::Arc<str>, dp_rank: u32) {
        self.pool.rank_gone(worker, dp_rank);
        self.ranks.rank_gone(worker, dp_rank);
        self.cache_view.rank_gone(worker, dp_rank);
        let labels = [&**worker, &dp_rank.to_string()];
        let _ = self.events.rank_precise.remove_label_values(&labels);
        let _ = self
            .extproc
            .time_to_first_byte
            .remove_label_values(&[&**worker]);
        let selection = &self.selection;
        let _ = selection.inflight.remove_label_values(&labels);
        let _ = selection.active_prefill_tokens.remove_label_values(&labels);
        let _ = selection.active_decode_blocks.remove_label_values(&labels);
    }

    /// Upstream response classes and outlier ejections.
    fn outlier_fact(&self, fact: &Fact) {
        match fact {
            Fact::UpstreamResponse {
                worker,
                dp_rank,
                class,
            } => self
                .outlier
                .responses
                .with_label_values(&[&**worker, &dp_rank.to_string(), class.as_str()])
                .inc(),
            Fact::Outlier {
                worker,
                dp_rank,
                event,
            } => {
                tracing::warn!(worker = %worker, dp_rank, ?event, "outlier detection");
                if *event != kvpick_core::outlier::HealthEvent::Returned {
                    self.outlier.ejections.with_label_values(&[&**worker]).inc();
                }
            }
            Fact::EjectedRanks(delta) => self.outlier.ejected_ranks.add(*delta),
            _ => {}
        }
    }

    /// Session affinity's outcomes, invalidations, expiries and live count.
    fn session_fact(&self, fact: &Fact) {
        let selection = &self.selection;
        match fact {
            Fact::Session(outcome) => selection
                .session_events
                .with_label_values(&[outcome.as_str()])
                .inc(),
            Fact::SessionParent(parent) => selection
                .session_events
                .with_label_values(&[if parent.followed() {
                    "parent_followed"
                } else {
                    "parent_declined"
                }])
                .inc(),
            Fact::SessionInvalidated(reason) => selection
                .session_invalidated
                .with_label_values(&[reason.as_str()])
                .inc(),
            Fact::SessionsExpired(n) => selection
                .session_events
                .with_label_values(&["expired"])
                .inc_by(*n),
            Fact::SessionsLive(delta) => selection.sessions_live.add(*delta),
            _ => {}
        }
    }

    /// The index's size, predicted overlap, KV events applied and TTFT predictions.
    fn selection_fact(&self, fact: &Fact) {
        let selection = &self.selection;
        match fact {
            Fact::IndexSize {
                partition,
                blocks,
                bytes,
            } => {
                let labels = [partition.model.as_str(), partition.routing_group.as_str()];
                selection
                    .index_blocks
                    .with_label_values(&labels)
                    .set(*blocks as i64);
                if let Some(bytes) = bytes {
                    selection
                        .index_bytes
                        .with_label_values(&labels)
                        .set(*bytes as i64);
                }
            }
            Fact::PredictedOverlap(share) => selection.predicted_overlap.observe(*share),
            Fact::KvEvents {
                applied,
                dropped,
                block_size_mismatches,
            } => {
                let events = &self.events;
                events.block_size_mismatches.inc_by(*block_size_mismatches);
                events
                    .kv_events
                    .with_label_values(&["applied"])
                    .inc_by(*applied);
                events
                    .kv_events
                    .with_label_values(&["dropped"])
                    .inc_by(*dropped);
            }
            Fact::TtftObserved {
                predicted_seconds,
                observed_seconds,
            } => {
                selection
                    .ttft_prediction_error
                    .observe((observed_seconds - predicted_seconds).abs());
                if *predicted_seconds > 0.0 {
                    selection
                        .ttft_prediction_ratio
                        .observe(observed_seconds / predicted_seconds);
                }
            }
            _ => {}
        }
    }

    /// The catalog's workers per lifecycle state.
    fn catalog_workers(&self, counts: &[usize]) {
        for (lifecycle, n) in Lifecycle::ALL.iter().zip(counts) {
            if *lifecycle == Lifecycle::Schedulable {
                self.pool.schedulable(*n as i64);
            }
            self.catalog
                .catalog_workers
                .with_label_values(&[lifecycle.as_str()])
                .set(*n as i64);
        }
    }

    /// A flow-control queue's depth, waits and exits.
    fn queue_event(&self, priority: i32, fairness_key: &str, event: &QueueEvent) {
        let band = self.flow.priority_label(priority);
        let depth = self.flow.queue_depth.with_label_values(&[&band]);
        match event {
            QueueEvent::Enqueued => depth.inc(),
            QueueEvent::Dispatched { waited_seconds } => {
                depth.dec();
                let key = self.flow.fairness_label(fairness_key);
                self.flow
                    .queue_wait
                    .with_label_values(&[&band, &key])
                    .observe(*waited_seconds);
            }
            QueueEvent::Left { exit, .. } => {
                if *exit != QueueExit::Full {
                    depth.dec();
                }
                self.flow
                    .queue_exits
                    .with_label_values(&[&band, exit.label()])
                    .inc();
            }
        }
    }
}
