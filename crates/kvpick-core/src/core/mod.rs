//! [`Core`]: the catalog as scheduled, the partitions and the registry of live bookings. Every
//! host (ext_proc, the gRPC API, the replay) drives this one type. It takes time as an argument
//! and returns what changed as [`Facts`]; it has no clock, no channels and no metrics of its own.
//!
//! Layout: this file holds the type, selection (`select`, `select_and_reserve`) and a booked
//! request's events (prefill complete, response, decode complete); [`catalog`] the catalog and
//! KV state written into partitions; [`registry`] the live bookings; [`flow`] flow control
//! across partitions; [`replicas`] what replicas share. Tests sit beside each part
//! (`*_tests.rs`).

mod catalog;
mod flow;
mod registry;
mod replicas;

pub use catalog::MAX_HELD_PARTITIONS;
use registry::Registered;
pub use replicas::RemoteQuery;

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use dashmap::DashMap;
use parking_lot::{Mutex, RwLock};

use crate::catalog::{ApplyReport, Catalog, SourceName, WorkerRecord, WorkerSpec};
use crate::config::{CoreConfig, DEFAULT_BLOCK_SIZE};
use crate::error::{CatalogError, SelectError};
use crate::event::KvEvent;
use crate::facts::{Fact, Facts};
use crate::index::{Tier, TierDepths};
use crate::live::{LiveConfig, LiveConfigError};
use crate::outcome::{PickedRank, Selection, WorkerView};
use crate::partition::{Admitted, Claims, EventStats, Partition, SelectOutcome};
use crate::request::{clip, Claim, DuplicateId, Holder, SelectionRequest};
use crate::types::{PartitionKey, RankKey, RankLoad};

/// The selection core shared by every host.
pub struct Core {
    /// Swapped whole by [`Core::update_live_config`]; each operation reads it once.
    config: RwLock<Arc<CoreConfig>>,
    catalog: Mutex<Catalog>,
    /// Set once the first catalog snapshot has been applied.
    synced: AtomicBool,
    partitions: RwLock<BTreeMap<PartitionKey, Arc<Partition>>>,
    /// Live booking ids -> the partition holding them (claims are made before scheduling).
    bookings: DashMap<String, Registered>,
    /// Source of booking generations (never 0, which means "nothing booked").
    generations: AtomicU64,
    /// Live bookings made through the API (bounded by `max_api_bookings`).
    api_bookings: AtomicUsize,
    trace: Mutex<VecDeque<String>>,
    /// Source of queue tickets (flow control).
    tickets: AtomicU64,
    /// Waiting requests -> the partition whose queue holds them.
    waiting: DashMap<u64, Arc<Partition>>,
    /// Release passes run over a non-empty queue (tests: nothing runs one without a change).
    release_passes: AtomicU64,
}

/// What [`Core::admit`] did with a request.
#[derive(Debug, Clone, PartialEq)]
pub enum Admission {
    /// Booked now.
    Dispatched(Box<Selection>),
    /// Waiting for capacity. Its outcome comes later as a [`Fact::Dequeued`] for `ticket` from
    /// whichever core operation releases it, or from [`Core::expire_waiting`] at `deadline`;
    /// [`Core::cancel_waiting`] takes it out if its client goes away.
    Queued { ticket: u64, deadline: Instant },
}

impl Core {
    pub fn new(config: CoreConfig) -> Self {
        Core {
            config: RwLock::new(Arc::new(config)),
            catalog: Mutex::new(Catalog::default()),
            synced: AtomicBool::new(false),
            partitions: RwLock::new(BTreeMap::new()),
            bookings: DashMap::new(),
            generations: AtomicU64::new(0),
            api_bookings: AtomicUsize::new(0),
            trace: Mutex::new(VecDeque::new()),
            tickets: AtomicU64::new(0),
            waiting: DashMap::new(),
            release_passes: AtomicU64::new(0),
        }
    }

    /// The settings in force now (a snapshot: a live update does not change it).
    pub fn config(&self) -> Arc<CoreConfig> {
        Arc::clone(&self.config.read())
    }

    /// Replaces the live part of the settings ([`LiveConfig`]); operations that start after it
    /// see the new values. A refused update changes nothing.
    pub fn update_live_config(&self, live: LiveConfig) -> Result<(), LiveConfigError> {
        live.validate()?;
        let mut config = self.config.write();
        *config = Arc::new(live.apply_to(&config));
        Ok(())
    }

    /// Computes a decision without booking anything (the API's `Select`).
    pub fn select(
        &self,
        request: &SelectionRequest,
        now: Instant,
    ) -> Result<(Selection, Facts), SelectError> {
        let partition = self.ensure_ready(request)?;
        let mut facts = Facts::default();
        let outcome = partition.select(request, None, false, &self.config(), now, &mut facts)?;
        Ok((outcome.selection, facts))
    }

    /// Picks a rank and books it atomically: the request id is claimed first, then the decision
    /// and the booking are made under the partition's lock. The booking lives until
    /// [`Core::free`] or expiry.
    pub fn select_and_reserve(
        &self,
        request: &SelectionRequest,
        now: Instant,
    ) -> Result<(Selection, Facts), SelectError> {
        let partition = self.ensure_ready(request)?;
        let (booking_id, generation) = self.claim(request, &partition)?;
        let mut facts = Facts::default();
        let booking = Some((booking_id.as_str(), generation));
        let config = self.config();
        let gate = config.flow.enabled && request.holder == Holder::Api;
        match partition.select(request, booking, gate, &config, now, &mut facts) {
            Ok(outcome) => {
                self.record_trace(request, &outcome);
                Ok((outcome.selection, facts))
            }
            Err(err) => {
                self.unregister(&booking_id, Claim::Generation(generation));
                Err(err)
            }
        }
    }

    fn record_trace(&self, request: &SelectionRequest, outcome: &SelectOutcome) {
        if self.config().trace_decisions == 0 {
            return;
        }
        let s = &outcome.selection;
        let line = format!(
            "{} partition={}/{} pick={}:{} overlap={} cost={:.3} candidates={}",
            request.request_id,
            s.partition.model,
            s.partition.routing_group,
            s.primary.key.worker_id,
            s.primary.key.dp_rank,
            s.overlap_blocks,
            s.cost,
            outcome.trace
        );
        let mut trace = self.trace.lock();
        if trace.len() >= self.config().trace_decisions {
            trace.pop_front();
        }
        trace.push_back(line);
    }

    /// The decision trace (when `trace_decisions > 0`), oldest first.
    pub fn decision_trace(&self) -> Vec<String> {
        self.trace.lock().iter().cloned().collect()
    }

    /// Marks the booking's prefill as done (first response byte at `now`; the time since the
    /// pick calibrates the TTFT estimator). Unknown ids are ignored.
    pub fn mark_prefill_complete(
        &self,
        booking_id: &str,
        claim: Claim,
        now: Instant,
    ) -> (bool, Facts) {
        let mut facts = Facts::default();
        let Some((generation, p)) = self.booked(booking_id, claim) else {
            return (false, facts);
        };
        let marked = p.prefill_complete(&(booking_id.to_string(), generation), now, &mut facts);
        // Nothing freed (a repeated first byte): no release pass.
        if marked == Some(true) {
            self.pump_partition(&p, now, &mut facts);
        }
        (marked.is_some(), facts)
    }

    /// How the picked rank answered the booking's request (its response status, or a reset
    /// before any response): outlier detection, and whether its first byte is a TTFT sample
    /// (only 2xx). Only the first answer counts; unknown ids are ignored.
    pub fn record_response(
        &self,
        booking_id: &str,
        claim: Claim,
        class: crate::facts::ResponseClass,
        now: Instant,
    ) -> (bool, Facts) {
        let mut facts = Facts::default();
        let recorded = self
            .booked(booking_id, claim)
            .is_some_and(|(generation, p)| {
                p.record_response(
                    &(booking_id.to_string(), generation),
                    class,
                    &self.config(),
                    now,
                    &mut facts,
                )
            });
        (recorded, facts)
    }

    /// The booking's response ended after `output_tokens` tokens (call before freeing it): its
    /// decode speed calibrates the TPOT estimator and settles its TPOT SLO. Unknown ids are
    /// ignored.
    pub fn decode_complete(
        &self,
        booking_id: &str,
        claim: Claim,
        output_tokens: u64,
        now: Instant,
    ) -> (bool, Facts) {
        let mut facts = Facts::default();
        let done = self
            .booked(booking_id, claim)
            .is_some_and(|(generation, p)| {
                p.decode_complete(
                    &(booking_id.to_string(), generation),
                    output_tokens,
                    now,
                    &mut facts,
                )
            });
        (done, facts)
    }
}

#[cfg(test)]
mod catalog_tests;
#[cfg(test)]
mod fixtures;

#[cfg(test)]
mod registry_tests;

#[cfg(test)]
mod lifecycle_tests;

#[cfg(test)]
mod calibration_tests;

#[cfg(test)]
mod flow_tests;

#[cfg(test)]
mod hold_tests;

#[cfg(test)]
mod api_tests;

#[cfg(test)]
mod outlier_tests;

#[cfg(test)]
mod sparse_tests;

#[cfg(test)]
mod reach_tests;

#[cfg(test)]
mod prediction_tests;

#[cfg(test)]
mod session_tree_tests;

#[cfg(test)]
mod scores_tests;

#[cfg(test)]
mod decay_tests;

#[cfg(test)]
mod remote_tests;
#[cfg(test)]
mod shared_tier_tests;
#[cfg(test)]
mod transfer_tests;
