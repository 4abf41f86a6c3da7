//! The `dynamo` replay policy: NVIDIA Dynamo's KV router, driven through its own published code.
//!
//! - Index: `dynamo_kv_router::RadixTree`, fed the same KV events kvpick's policy gets, translated
//!   to Dynamo's `RouterEvent`s. Dynamo matches requests on *local* block hashes
//!   (`compute_block_hash_for_seq`: xxh3 of each block's tokens, default options, the replay's
//!   block size) and links blocks by the engine's own hashes, so a stored block carries both.
//! - Load: `ActiveSequencesMultiWorker`, Dynamo's active-sequence tracker (prefill tokens until
//!   the first token, active blocks until the end), with its tracking hashes computed by
//!   `KvRouterConfig::compute_seq_hashes_for_tracking_with_context`.
//! - Choice: `dynamo_custom_policy_builtin::DefaultWorkerSelector` (Dynamo's default cost
//!   function and picker) with `KvRouterConfig::default()`: overlap credit 1.0, temperature 0.
//!   Seeded, so ties break the same way on every run (the seeded picker is Dynamo's own replay
//!   path).
//!
//! What differs from a Dynamo deployment, on purpose: no router-side queue (the default config
//! has no `router_queue_threshold`, so Dynamo admits at once too), events applied the instant the
//! engine publishes them (as for kvpick), and one worker per simulated rank (dp size 1).
//!
//! Owns only the translation; the decision is Dynamo's.

use std::collections::HashMap;
use std::sync::Arc;

use dynamo_custom_policy_builtin::DefaultWorkerSelector;
use dynamo_kv_router::indexer::TieredMatchDetails;
use dynamo_kv_router::protocols::{
    BlockHashOptions, ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheRemoveData,
    KvCacheStoreData, KvCacheStoredBlockData, PrefillLoadHint, RoutingConstraints,
    WorkerConfigLike, WorkerId, WorkerWithDpRank,
};
use dynamo_kv_router::scheduling::{OverlapAnalysis, ScheduleMode};
use dynamo_kv_router::{
    compute_block_hash_for_seq, ActiveSequencesMultiWorker, KvRouterConfig, NoopSequencePublisher,
    RadixTree, RouterEvent, RoutingPartitionRef, SchedulingRequest, SequenceRequest,
    TrackingHashContext, TrackingHashScope, WorkerSelectionInput, WorkerSelector,
};
use kvpick_core::event::{KvEvent, Medium};
use kvpick_sim::replay::policy::{FleetView, PickRequest, Policy, PolicyOptions};
use kvpick_sim::sim::engine::EngineConfig;

/// Label Dynamo's load tracking and selector get for an aggregated (prefill + decode) worker.
const WORKER_TYPE: &str = "replay";

/// What a Dynamo worker publishes about itself at registration (its runtime config), here the
/// simulated engine's settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SimWorkerConfig {
    max_num_batched_tokens: u64,
    total_kv_blocks: u64,
}

impl WorkerConfigLike for SimWorkerConfig {
    fn data_parallel_start_rank(&self) -> u32 {
        0
    }
    fn data_parallel_size(&self) -> u32 {
        1
    }
    fn max_num_batched_tokens(&self) -> Option<u64> {
        Some(self.max_num_batched_tokens)
    }
    fn total_kv_blocks(&self) -> Option<u64> {
        Some(self.total_kv_blocks)
    }
}

pub struct DynamoRouter {
    config: KvRouterConfig,
    block_size: u32,
    tree: RadixTree,
    slots: Arc<ActiveSequencesMultiWorker<NoopSequencePublisher>>,
    selector: DefaultWorkerSelector,
    workers: HashMap<WorkerId, SimWorkerConfig>,
    tracking_hash: TrackingHashContext,
    next_event_id: u64,
    /// Events or lifecycle calls Dynamo refused (printed when the policy is dropped).
    errors: u64,
    /// Requests Dynamo could not place (the replay then uses rank 0).
    failed_picks: u64,
}

/// The replay's virtual time: the replay runs on a paused tokio clock it advances, and Dynamo's
/// load tracking takes `tokio::time::Instant`s.
fn now() -> tokio::time::Instant {
    tokio::time::Instant::now()
}

impl DynamoRouter {
    pub fn new(
        ranks: usize,
        options: &PolicyOptions,
        engine: &EngineConfig,
    ) -> anyhow::Result<Self> {
        anyhow::ensure!(ranks > 0, "the dynamo policy needs at least one rank");
        let block_size = u32::try_from(options.block_size)
            .map_err(|_| anyhow::anyhow!("block size {} too large", options.block_size))?;
        let config = KvRouterConfig::default();
        let tracking_hash = TrackingHashContext::from_config(&config)?;
        let worker = SimWorkerConfig {
            max_num_batched_tokens: engine.max_num_batched_tokens as u64,
            total_kv_blocks: engine.num_gpu_blocks as u64,
        };
        let workers: HashMap<WorkerId, SimWorkerConfig> = (0..ranks as WorkerId)
            .map(|id| (id, worker.clone()))
            .collect();
        let dp_ranges = workers.keys().map(|&id| (id, (0, 1))).collect();
        // Without expiry: requests leave through the replay's completion calls, and wall-clock
        // expiry must not see virtual time (Dynamo's own offline replay does the same).
        let slots = Arc::new(ActiveSequencesMultiWorker::new_without_expiry(
            NoopSequencePublisher,
            options.block_size,
            dp_ranges,
            false,
            0,
            WORKER_TYPE,
        ));
        let selector =
            DefaultWorkerSelector::new_seeded(Some(config.clone()), WORKER_TYPE, options.seed);
        Ok(DynamoRouter {
            config,
            block_size,
            tree: RadixTree::new(),
            slots,
            selector,
            workers,
            tracking_hash,
            next_event_id: 0,
            errors: 0,
            failed_picks: 0,
        })
    }

    /// Events and lifecycle calls Dynamo refused, and picks it could not make.
    pub fn errors(&self) -> (u64, u64) {
        (self.errors, self.failed_picks)
    }

    /// Dynamo's own local block hashes of a token sequence (complete blocks only).
    pub fn local_hashes(&self, tokens: &[u32]) -> Vec<dynamo_kv_router::LocalBlockHash> {
        compute_block_hash_for_seq(tokens, self.block_size, BlockHashOptions::default())
    }

    /// Blocks of `tokens`' longest cached prefix per rank, as Dynamo's index sees them.
    pub fn overlap_blocks(&self, tokens: &[u32]) -> Vec<u32> {
        let scores = self
            .tree
            .find_matches(self.local_hashes(tokens), false)
            .scores;
        (0..self.workers.len() as WorkerId)
            .map(|id| {
                scores
                    .get(&WorkerWithDpRank::new(id, 0))
                    .copied()
                    .unwrap_or(0)
            })
            .collect()
    }

    /// One kvpick KV event as Dynamo's, or `None` for what Dynamo's device index does not take
    /// (blocks of other tiers, a store whose tokens do not fill its blocks).
    fn translate(&self, event: &KvEvent) -> Option<KvCacheEventData> {
        match event {
            KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                medium: Medium::Gpu,
                ..
            } if token_ids.len() == block_hashes.len() * self.block_size as usize => {
                let blocks = block_hashes
                    .iter()
                    .zip(self.local_hashes(token_ids))
                    .map(|(&engine_hash, tokens_hash)| KvCacheStoredBlockData {
                        block_hash: ExternalSequenceBlockHash(engine_hash),
                        tokens_hash,
                        mm_extra_info: None,
                    })
                    .collect();
                Some(KvCacheEventData::Stored(KvCacheStoreData {
                    parent_hash: parent_block_hash.map(ExternalSequenceBlockHash),
                    start_position: None,
                    blocks,
                }))
            }
            KvEvent::BlockRemoved {
                block_hashes,
                medium: Medium::Gpu,
                ..
            } => Some(KvCacheEventData::Removed(KvCacheRemoveData {
                block_hashes: block_hashes
                    .iter()
                    .map(|&h| ExternalSequenceBlockHash(h))
                    .collect(),
            })),
            KvEvent::AllBlocksCleared => Some(KvCacheEventData::Cleared),
            _ => None,
        }
    }

    fn select(&mut self, request: &PickRequest) -> anyhow::Result<usize> {
        let hashes = self.local_hashes(request.tokens);
        let tiered = TieredMatchDetails {
            device: self.tree.find_match_details(hashes.clone(), false),
            lower_tier: Default::default(),
        };
        let overlap = OverlapAnalysis::new(&self.config, self.block_size, &tiered).signals();
        let token_seq = self.config.compute_seq_hashes_for_tracking_with_context(
            &self.tracking_hash,
            TrackingHashScope {
                partition: RoutingPartitionRef::new(kvpick_sim::sim::MODEL, ""),
                block_size: self.block_size,
            },
            request.tokens,
            None,
            BlockHashOptions::default(),
            Some(&hashes),
        );
        let decay_now = now();
        let worker_loads = self
            .slots
            .project_worker_loads(token_seq.as_deref(), decay_now);
        let request_id = format!("r{}", request.id);
        let track_prefill_tokens = self.config.router_track_prefill_tokens;
        let mut scheduling = SchedulingRequest {
            mode: ScheduleMode::Tracked {
                request_id: request_id.clone(),
            },
            token_seq,
            isl_tokens: request.tokens.len(),
            lora_name: None,
            // The router does not know the output length (the trace's is the engine's stop).
            expected_output_tokens: None,
            affinity_target: None,
            pinned_worker: None,
            allowed_worker_ids: None,
            routing_constraints: RoutingConstraints::default(),
            router_config_override: None,
            track_prefill_tokens,
            priority_jump: 0.0,
            strict_priority: 0,
            policy_class: None,
            session_context: None,
            overlap,
            kv_transfer_candidates: None,
            retain_kv_transfer_chain: false,
            shared_cache_hits: None,
            worker_loads,
            resp_tx: None,
        };
        let eligibility = scheduling.eligibility();
        let selection = self
            .selector
            .select_worker(WorkerSelectionInput::configured(
                &self.workers,
                &scheduling,
                eligibility,
                self.block_size,
            ))?;
        let uncached = request
            .tokens
            .len()
            .saturating_sub(selection.cached_tokens.min(request.tokens.len()));
        let prefill_load_hint = (track_prefill_tokens && uncached > 0).then_some(PrefillLoadHint {
            initial_effective_prefill_tokens: uncached,
            expected_prefill_duration: None,
        });
        self.slots.add_request(
            SequenceRequest {
                request_id,
                token_sequence: scheduling.token_seq.take(),
                track_prefill_tokens,
                expected_output_tokens: None,
                prefill_load_hint,
                worker: selection.worker,
                lora_name: None,
            },
            decay_now,
        )?;
        let rank = usize::try_from(selection.worker.worker_id)?;
        anyhow::ensure!(
            rank < self.workers.len(),
            "Dynamo picked unknown worker {rank}"
        );
        Ok(rank)
    }
}

impl Policy for DynamoRouter {
    fn name(&self) -> &'static str {
        "dynamo"
    }

    fn pick(&mut self, request: &PickRequest, _: &FleetView) -> usize {
        match self.select(request) {
            Ok(rank) => rank,
            Err(e) => {
                // Every rank is eligible and nothing is queued, so this means a translation bug:
                // say so once per request rather than skewing the numbers silently.
                eprintln!("dynamo policy: request {} not placed: {e:#}", request.id);
                self.failed_picks += 1;
                0
            }
        }
    }

    fn on_first_token(&mut self, id: u64, _: usize) {
        if self
            .slots
            .mark_prefill_completed(&format!("r{id}"), now())
            .is_err()
        {
            self.errors += 1;
        }
    }

    fn on_complete(&mut self, id: u64, _: usize) {
        if self.slots.free(&format!("r{id}"), now()).is_err() {
            self.errors += 1;
        }
    }

    fn on_kv_events(&mut self, rank: usize, events: &[KvEvent]) {
        for event in events {
            let Some(data) = self.translate(event) else {
                continue;
            };
            let event = RouterEvent::new(
                rank as WorkerId,
                KvCacheEvent {
                    event_id: self.next_event_id,
                    data,
                    dp_rank: 0,
                },
            );
            self.next_event_id += 1;
            if self.tree.apply_event(event).is_err() {
                self.errors += 1;
            }
        }
    }
}

impl Drop for DynamoRouter {
    fn drop(&mut self) {
        if self.errors > 0 || self.failed_picks > 0 {
            eprintln!(
                "dynamo policy: {} KV events or lifecycle calls refused by Dynamo, {} requests not placed",
                self.errors, self.failed_picks
            );
        }
    }
}
