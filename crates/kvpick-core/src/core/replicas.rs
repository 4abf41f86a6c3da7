//! What kvpick replicas share through the core: loads booked by other replicas, this replica's
//! own loads to publish, and session bindings read or installed from elsewhere. It must not
//! decide or book.

use super::*;

impl Core {
    /// Sets the load other replicas of the picker booked, per rank (a rank not named has none).
    /// It is added to this process's own bookings wherever load is read for a decision.
    pub fn set_remote_loads(&self, loads: &HashMap<RankKey, RankLoad>) {
        let partitions: Vec<Arc<Partition>> = self.partitions.read().values().cloned().collect();
        for p in partitions {
            p.set_remote_loads(loads);
        }
    }

    /// This process's own booked load of every rank that has any (what it tells other replicas).
    pub fn local_loads(&self) -> Vec<(RankKey, RankLoad)> {
        let partitions: Vec<Arc<Partition>> = self.partitions.read().values().cloned().collect();
        let mut out = Vec::new();
        for p in partitions {
            p.local_loads(&mut out);
        }
        out
    }

    /// The partition a request for `model` resolves to and the session's binding there, if any.
    /// `None` when no partition serves the model (the pick will fail anyway).
    pub fn session_binding(
        &self,
        model: Option<&str>,
        routing_group: &str,
        sid: &str,
        now: Instant,
    ) -> Option<(PartitionKey, Option<RankKey>, Facts)> {
        let partition = self.resolve_partition_of(model, routing_group).ok()?;
        let mut facts = Facts::default();
        let rank = partition.bound_session(sid, now, self.config().sessions.ttl, &mut facts);
        Some(((*partition.key).clone(), rank, facts))
    }

    /// Installs a session binding decided elsewhere (another replica): later picks of the
    /// session follow it like a binding made here. Not installed when the partition or rank is
    /// unknown here or the session table is full of sessions with requests in flight.
    pub fn install_session_binding(
        &self,
        key: &PartitionKey,
        sid: &str,
        rank: RankKey,
        now: Instant,
    ) -> (crate::session::Installed, Facts) {
        let mut facts = Facts::default();
        let Some(partition) = self.partitions.read().get(key).cloned() else {
            return (crate::session::Installed::UnknownRank, facts);
        };
        let max = self.config().sessions.max_entries;
        let installed = partition.install_session(sid, rank, now, max, &mut facts);
        (installed, facts)
    }
}

/// What a replica asks a remote index for one prompt (`--kv-index-remote`): the prompt's
/// block hashes as this process hashes them for the request's partition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteQuery {
    pub model: String,
    pub routing_group: String,
    /// Chained block hashes (LoRA seed and cache salt folded in), at most `max_prompt_blocks`.
    pub seq_hashes: Vec<u64>,
    /// The prompt length the remote checks the hashes against (one token past the hashed blocks
    /// when the prompt was cut at `max_prompt_blocks`: every hashed block is then reusable).
    pub prompt_tokens: u64,
}

impl Core {
    /// The remote-index query of a request: `None` when it has no model or no partition serves
    /// it, or it has no complete block to match.
    pub fn remote_query(&self, request: &SelectionRequest) -> Option<RemoteQuery> {
        let model = request.model.clone()?;
        let partition = self.resolve_partition(request).ok()?;
        let prompt = partition.prompt_of(request, &self.config());
        if prompt.seq_hashes.is_empty() {
            return None;
        }
        let block = u64::from(partition.block_size().max(1));
        let covered = (prompt.seq_hashes.len() as u64).saturating_mul(block);
        // The remote refuses a length a block or more away from the hashes it is sent.
        let cut = covered.saturating_add(u64::from(block > 1));
        let prompt_tokens = prompt.tokens.min(cut);
        Some(RemoteQuery {
            model,
            routing_group: request.routing_group.clone(),
            seq_hashes: prompt.seq_hashes,
            prompt_tokens,
        })
    }
}
