//! The catalog as the core schedules it: source snapshots and edits applied to the catalog and
//! reconciled into partitions, the partition a request resolves to, worker listings, and KV
//! state written into a partition's index (events, inserted blocks, cleared ranks, engine
//! metrics). It must not book or decide.

use super::*;

/// Most partitions without a ready rank that `--hold-when-no-endpoints` keeps requests waiting in.
pub const MAX_HELD_PARTITIONS: usize = 16;

impl Core {
    /// Replaces one source's workers with `specs` and reconciles the union of all sources:
    /// duplicate ids are rejected before anything changes; unchanged workers are skipped; changed
    /// ones are replaced in one batch per partition (surviving ranks keep their bookings);
    /// workers absent from every source are deleted with their bookings.
    pub fn apply_source_snapshot(
        &self,
        source: SourceName,
        specs: Vec<WorkerSpec>,
        now: Instant,
    ) -> Result<(ApplyReport, Facts), CatalogError> {
        // The snapshot replaces the list whole: nothing of the old one to copy.
        let catalog = self.catalog.lock();
        self.reconcile(catalog, source, specs, now)
    }

    /// Edits one source's worker list with `edit` and reconciles, all under the catalog lock, so
    /// concurrent edits of one source never lose each other's changes.
    pub fn modify_source<R>(
        &self,
        source: SourceName,
        edit: impl FnOnce(&mut Vec<WorkerSpec>) -> R,
        now: Instant,
    ) -> Result<(R, ApplyReport, Facts), CatalogError> {
        let catalog = self.catalog.lock();
        let mut list = catalog.source(source).to_vec();
        let result = edit(&mut list);
        let (report, facts) = self.reconcile(catalog, source, list, now)?;
        Ok((result, report, facts))
    }

    /// Makes `list` the source's workers and reconciles the partitions, the catalog lock held
    /// until the partitions have their batches.
    fn reconcile(
        &self,
        mut catalog: parking_lot::MutexGuard<'_, Catalog>,
        source: SourceName,
        list: Vec<WorkerSpec>,
        now: Instant,
    ) -> Result<(ApplyReport, Facts), CatalogError> {
        let (mut report, changes) = catalog.replace_source(source, list)?;
        let mut facts = Facts::default();
        let mut changed = Vec::new();
        for (key, change) in changes {
            let partition = self.partition(&key, now);
            changed.push(Arc::clone(&partition));
            let batch = partition.apply_batch(&change.gone, &change.upserts, now, &mut facts);
            for (id, reason) in batch.failed {
                if let Some(name) = catalog.mark_failed(id, reason.clone()) {
                    report.failed.push((name, reason));
                }
            }
            for (id, generation) in batch.dropped_bookings {
                self.unregister(&id, Claim::Generation(generation));
            }
        }
        self.synced.store(true, Ordering::Release);
        report.ready = catalog.any_schedulable();
        facts.push(Fact::CatalogWorkers(Facts::lifecycle_counts(
            catalog.records().map(|r| r.lifecycle),
        )));
        drop(catalog);
        // A rank joined or came back: waiting requests may fit now (or fail for good when
        // their partition lost every rank).
        for partition in &changed {
            self.pump_partition(partition, now, &mut facts);
        }
        Ok((report, facts))
    }

    /// Adds or replaces one worker of a source (matched by name) and reconciles.
    pub fn upsert_source_worker(
        &self,
        source: SourceName,
        spec: WorkerSpec,
        now: Instant,
    ) -> Result<(ApplyReport, Facts), CatalogError> {
        self.modify_source(
            source,
            |list| {
                list.retain(|w| w.name != spec.name);
                list.push(spec);
            },
            now,
        )
        .map(|((), report, facts)| (report, facts))
    }

    /// Removes one worker of a source by name; says whether it existed.
    pub fn delete_source_worker(
        &self,
        source: SourceName,
        name: &str,
        now: Instant,
    ) -> Result<(bool, ApplyReport, Facts), CatalogError> {
        self.modify_source(
            source,
            |list| {
                let before = list.len();
                list.retain(|w| w.name != name);
                list.len() != before
            },
            now,
        )
    }

    /// The two decision paths' answers on the partition `request` resolves to (the bounded
    /// search's equality test, [`crate::partition`]'s `sparse`).
    #[cfg(test)]
    pub(crate) fn decision_paths(
        &self,
        request: &SelectionRequest,
        now: Instant,
        flow: bool,
    ) -> [crate::partition::PathAnswer; 2] {
        match self.resolve_partition(request) {
            Ok(p) => p.decision_paths(request, &self.config(), now, flow),
            Err(e) => [Err(format!("{e:?}")), Err(format!("{e:?}"))],
        }
    }

    /// The partition a request resolves to (tests of the partition's internals).
    #[cfg(test)]
    pub(crate) fn partition_for_test(&self, request: &SelectionRequest) -> Arc<Partition> {
        self.resolve_partition(request)
            .unwrap_or_else(|e| panic!("no partition: {e:?}"))
    }

    /// The partition for `key`, created lazily.
    pub(super) fn partition(&self, key: &PartitionKey, now: Instant) -> Arc<Partition> {
        if let Some(p) = self.partitions.read().get(key) {
            return Arc::clone(p);
        }
        let mut partitions = self.partitions.write();
        Arc::clone(
            partitions
                .entry(key.clone())
                .or_insert_with(|| Arc::new(Partition::new(key.clone(), &self.config(), now))),
        )
    }

    /// Finds the partition a request belongs to: its `(model, routing_group)`, else a partition
    /// serving the model as a LoRA adapter; requests without a model go to the partition with the
    /// most schedulable ranks.
    pub(super) fn resolve_partition(
        &self,
        request: &SelectionRequest,
    ) -> Result<Arc<Partition>, SelectError> {
        self.resolve_partition_of(request.model.as_deref(), &request.routing_group)
    }

    pub(super) fn resolve_partition_of(
        &self,
        model: Option<&str>,
        routing_group: &str,
    ) -> Result<Arc<Partition>, SelectError> {
        let partitions = self.partitions.read();
        let Some(model) = model else {
            return partitions
                .values()
                .filter(|p| p.schedulable_ranks() > 0)
                .max_by_key(|p| p.schedulable_ranks())
                .cloned()
                .ok_or_else(|| SelectError::Unavailable("no ready worker in the pool".into()));
        };
        let key = PartitionKey {
            model: model.to_string(),
            routing_group: routing_group.to_string(),
        };
        if let Some(p) = partitions.get(&key) {
            if p.schedulable_ranks() > 0 {
                return Ok(Arc::clone(p));
            }
        }
        partitions
            .values()
            .find(|p| p.routing_group_is(routing_group) && p.serves_adapter(model))
            .cloned()
            .ok_or_else(|| {
                SelectError::Unavailable(format!("no ready worker serves model {}", clip(model)))
            })
    }

    pub(super) fn ensure_ready(
        &self,
        request: &SelectionRequest,
    ) -> Result<Arc<Partition>, SelectError> {
        request.validate()?;
        // Read on every pick: an atomic, not the catalog lock.
        if !self.synced.load(Ordering::Acquire) {
            return Err(SelectError::Unavailable("catalog not synced yet".into()));
        }
        let partition = self.resolve_partition(request)?;
        crate::request::check_block_hashes(&request.prompt, partition.block_size())?;
        Ok(partition)
    }

    /// With `--hold-when-no-endpoints`: the partition a request for a model with no ready rank
    /// waits in, created for it when the model has none yet (a pool scaled to zero, or kvpick
    /// started while it was). Client-chosen model names must not create partitions without
    /// bound: at most [`MAX_HELD_PARTITIONS`] partitions without a ready rank exist; past that
    /// the request is refused as before. A request without a model waits in the one partition
    /// the pool has, if it has exactly one.
    pub(super) fn held_partition(
        &self,
        request: &SelectionRequest,
        now: Instant,
    ) -> Result<Arc<Partition>, SelectError> {
        if !self.synced.load(Ordering::Acquire) {
            return Err(SelectError::Unavailable("catalog not synced yet".into()));
        }
        // The write lock: the bound is checked and the partition created in one step.
        let mut partitions = self.partitions.write();
        let model = match request.model.as_deref() {
            Some(model) => model.to_string(),
            None => match partitions.keys().collect::<Vec<_>>().as_slice() {
                [only] => only.model.clone(),
                _ => {
                    return Err(SelectError::Unavailable(
                        "no ready worker in the pool".into(),
                    ))
                }
            },
        };
        let key = PartitionKey {
            model,
            routing_group: request.routing_group.clone(),
        };
        if !partitions.contains_key(&key) {
            let empty = partitions
                .values()
                .filter(|p| p.schedulable_ranks() == 0)
                .count();
            if empty >= MAX_HELD_PARTITIONS {
                return Err(SelectError::Unavailable(format!(
                    "no ready worker serves model {} ({MAX_HELD_PARTITIONS} models already wait \
                     for workers)",
                    clip(&key.model)
                )));
            }
        }
        let partition = Arc::clone(
            partitions
                .entry(key.clone())
                .or_insert_with(|| Arc::new(Partition::new(key, &self.config(), now))),
        );
        drop(partitions);
        crate::request::check_block_hashes(&request.prompt, partition.block_size())?;
        Ok(partition)
    }

    /// Every worker record (for hosts that derive their own view, e.g. KV subscriptions).
    pub fn records(&self) -> Vec<WorkerRecord> {
        self.catalog.lock().records().cloned().collect()
    }

    /// Runs `visit` over every worker record without copying them, under the catalog lock (so
    /// `visit` must be short and must not call back into the core): a host that follows the
    /// catalog through thousands of workers reads what changed instead of cloning them all.
    pub fn with_records<R>(
        &self,
        visit: impl FnOnce(&mut dyn Iterator<Item = &WorkerRecord>) -> R,
    ) -> R {
        let catalog = self.catalog.lock();
        let mut records = catalog.records();
        visit(&mut records)
    }

    /// The catalog with per-rank load, sorted by worker name.
    pub fn list_workers(&self, model: Option<&str>) -> Vec<WorkerView> {
        let records: Vec<WorkerRecord> = self
            .catalog
            .lock()
            .records()
            .filter(|w| model.is_none_or(|m| w.spec.serves(m)))
            .cloned()
            .collect();
        let mut views: Vec<WorkerView> = records
            .into_iter()
            .map(|record| {
                let partition = self.partitions.read().get(&record.partition_key()).cloned();
                let (loads, status): (Vec<RankLoad>, Vec<crate::outcome::RankStatus>) = record
                    .ranks
                    .iter()
                    .map(|r| {
                        partition
                            .as_ref()
                            .and_then(|p| {
                                p.rank_view(RankKey {
                                    worker_id: record.id,
                                    dp_rank: r.dp_rank,
                                })
                            })
                            .unwrap_or_default()
                    })
                    .unzip();
                let block_size = partition
                    .as_ref()
                    .and_then(|p| p.known_block_size())
                    .or(record.spec.block_size);
                WorkerView {
                    record,
                    loads,
                    status,
                    block_size,
                }
            })
            .collect();
        views.sort_by(|a, b| a.record.spec.name.cmp(&b.record.spec.name));
        views
    }

    /// Records that `rank` holds `seq_hashes` in the partition `key` (warm-up, tests).
    pub fn insert_blocks(
        &self,
        key: &PartitionKey,
        rank: RankKey,
        seq_hashes: &[u64],
        tier: Tier,
        expires: Option<Instant>,
        now: Instant,
    ) {
        self.partition(key, now)
            .insert_blocks(rank, seq_hashes, tier, expires);
    }

    /// Records that the model's shared KV store holds `seq_hashes` (tests: the events' path is
    /// `apply_kv_events` with an `EXTERNAL` medium). Nothing without a shared tier.
    #[cfg(test)]
    pub(crate) fn insert_shared_blocks(
        &self,
        key: &PartitionKey,
        seq_hashes: &[u64],
        now: Instant,
    ) {
        self.partition(key, now).insert_shared(seq_hashes);
    }

    /// Applies KV events published by one rank. Returns what was applied / dropped.
    ///
    /// `lag`: for a live batch, how late it arrived (the engine's timestamp to the host's clock
    /// now; a timestamp ahead of it, clock skew, is lag 0); `None` for a replayed batch (its
    /// timestamp is as old as the message) or one without a plausible timestamp. The partition's
    /// end grace follows it ([`crate::partition`]'s `grace`): how long a precise rank's
    /// unconfirmed predictions outlive their request.
    pub fn apply_kv_events(
        &self,
        rank: RankKey,
        events: &[KvEvent],
        lag: Option<std::time::Duration>,
        now: Instant,
    ) -> (EventStats, Facts) {
        let mut facts = Facts::default();
        let Some(partition) = self.partition_of_worker(rank.worker_id) else {
            // Not counted as facts: the rank is not (or no longer) in the catalog.
            let stats = EventStats {
                dropped: events.len() as u64,
                ..EventStats::default()
            };
            return (stats, facts);
        };
        let stats = partition.apply_events(rank, events, lag, now, &mut facts);
        facts.push(Fact::KvEvents {
            applied: stats.applied,
            dropped: stats.dropped,
            block_size_mismatches: stats.block_size_mismatches,
        });
        facts.push(partition.index_size());
        if let Some(fact) = partition.shared_tier_size() {
            facts.push(fact);
        }
        (stats, facts)
    }

    /// Every partition's index size and end grace now, one fact each: a metrics scrape reads
    /// them, so the gauge follows whatever changed the index (a clear's sweep, a purge), not only
    /// the operations that report it, and a partition without KV events shows its grace too.
    pub fn index_sizes(&self) -> Facts {
        let partitions: Vec<Arc<Partition>> = self.partitions.read().values().cloned().collect();
        let mut facts = Facts::default();
        for p in partitions {
            facts.push(p.index_size_now());
            facts.push(p.grace_now());
            if let Some(fact) = p.shared_tier_size() {
                facts.push(fact);
            }
        }
        facts
    }

    /// Forgets a rank's blocks (its engine restarted).
    pub fn clear_rank(&self, rank: RankKey) {
        if let Some(partition) = self.partition_of_worker(rank.worker_id) {
            partition.clear_rank(rank);
        }
    }

    /// Marks a rank's engine reachable or not (the host's judgement: its KV events lost and its
    /// endpoint refusing connections, or a refused scrape). An unreachable rank takes no picks;
    /// its index entries stay until the host clears them. A rank coming back runs a release pass
    /// (waiting requests may fit now). Facts only on a change.
    pub fn set_rank_reachable(&self, rank: RankKey, reachable: bool, now: Instant) -> Facts {
        let mut facts = Facts::default();
        if let Some(partition) = self.partition_of_worker(rank.worker_id) {
            if partition.set_reachable(rank, reachable, &mut facts) && reachable {
                self.pump_partition(&partition, now, &mut facts);
            }
        }
        facts
    }

    /// The HTTP endpoint of a rank as the catalog has it now.
    pub fn rank_endpoint(&self, rank: RankKey) -> Option<SocketAddr> {
        let catalog = self.catalog.lock();
        let record = catalog.record(rank.worker_id)?;
        record
            .ranks
            .iter()
            .find(|r| r.dp_rank == rank.dp_rank)
            .map(|r| r.endpoint)
    }

    /// Stores one engine-metrics reading of a rank (the host's scraper calls this after each
    /// scrape) and reconciles the rank's bookings with it (`BookingBounds::reconcile_after`); a
    /// reconciliation runs a release pass. False when the rank is not in the catalog (it left
    /// while the scrape ran).
    pub fn record_engine_metrics(
        &self,
        rank: RankKey,
        metrics: crate::engine::EngineMetrics,
    ) -> (bool, Facts) {
        let mut facts = Facts::default();
        let Some(partition) = self.partition_of_worker(rank.worker_id) else {
            return (false, facts);
        };
        let now = metrics.at;
        let config = self.config();
        match partition.record_engine_metrics(rank, metrics, &config, &mut facts) {
            None => (false, facts),
            Some(reconciled) => {
                if reconciled > 0 {
                    self.pump_partition(&partition, now, &mut facts);
                }
                (true, facts)
            }
        }
    }

    pub(super) fn partition_of_worker(&self, worker_id: u64) -> Option<Arc<Partition>> {
        let key = self.catalog.lock().record(worker_id)?.partition_key();
        self.partitions.read().get(&key).cloned()
    }

    /// The block size of a model's partition (default until a worker declares one).
    pub fn block_size(&self, key: &PartitionKey) -> u32 {
        self.partitions
            .read()
            .get(key)
            .map_or(DEFAULT_BLOCK_SIZE, |p| p.block_size())
    }

    /// Per-rank overlap (GPU-tier blocks) of a prompt in a model's partition, for the API.
    pub fn overlap_scores(
        &self,
        request: &SelectionRequest,
        now: Instant,
    ) -> Result<(u32, Vec<(PickedRank, TierDepths)>), SelectError> {
        request.validate()?;
        let partition = self.resolve_partition(request)?;
        crate::request::check_block_hashes(&request.prompt, partition.block_size())?;
        Ok(partition.overlaps(request, self.config().max_prompt_blocks, now))
    }
}
