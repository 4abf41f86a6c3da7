//! KV held outside a rank in the replay (ARCHITECTURE.md §10): a fleet-wide shared KV store
//! (`--shared-store-gb-s`: LMCache-like, every block an engine computes is written through to
//! it, and an engine loads the blocks it holds beyond its own cached prefix at admission, each at
//! the store's bandwidth) and peer pulls named by kvpick's transfer hints (`--kv-transfer-hints`:
//! the picked engine pulls the prefix the hint's holder caches, at `--p2p-gb-s`, beside its
//! batch as NIXL does: the request alone waits for the pull, then reaches its engine with the
//! blocks in hand). It owns the store's contents, the pulls in flight, the flags and the counts;
//! the engines pay the store's loads
//! ([`crate::sim::engine::ExternalKv`]), kvpick's core decides (it learns the store's blocks as
//! `EXTERNAL` KV events, as SGLang publishes them). It never changes a policy's decision itself.

use std::collections::HashSet;

use clap::Args;
use kvpick_core::event::{KvEvent, Medium};
use kvpick_core::hash;
use serde::Serialize;

use super::policy::Policy;
use crate::sim::engine::{Engine, ExternalKv};

/// The replay's shared store and transfer hints.
#[derive(Debug, Clone, Args)]
pub struct TierArgs {
    /// A fleet-wide shared KV store that every engine writes its computed blocks to and loads
    /// from at this many GB/s (a block costs --block-size × --kv-bytes-per-token bytes over it);
    /// 0 = no store.
    #[arg(long, default_value_t = 0.0, value_name = "GB_S")]
    pub shared_store_gb_s: f64,
    /// kvpick's --shared-cache-multiplier in the replay (the store's blocks reach kvpick as
    /// EXTERNAL KV events); 0 = kvpick does not weigh the store.
    #[arg(long, default_value_t = 0.0, value_name = "X")]
    pub shared_cache_multiplier: f64,
    /// kvpick names a holder of the prompt's prefix when its pick is not one
    /// (--kv-transfer-hints), and the picked engine pulls that prefix from it at --p2p-gb-s.
    #[arg(long)]
    pub kv_transfer_hints: bool,
    /// Bandwidth of a peer pull (NIXL / RDMA between engines), GB/s.
    #[arg(long, default_value_t = 25.0, value_name = "GB_S")]
    pub p2p_gb_s: f64,
    /// KV bytes per token: 131072 is an 8B model's (32 layers × 8 KV heads × 128 dims × K and
    /// V × 2 bytes).
    #[arg(long, default_value_t = 131_072, value_name = "BYTES")]
    pub kv_bytes_per_token: u64,
}

/// What the replay loop needs of [`TierArgs`]: each source's time per block.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct TierOptions {
    /// The shared store's load time per block; `None` = no store.
    pub store_ns_per_block: Option<u64>,
    /// A peer pull's time per block; `None` = hints are not followed.
    pub p2p_ns_per_block: Option<u64>,
}

impl TierArgs {
    /// Checked; `block_size` in tokens.
    pub fn options(&self, block_size: usize) -> anyhow::Result<TierOptions> {
        let m = self.shared_cache_multiplier;
        anyhow::ensure!(
            m.is_finite() && (0.0..=1.0).contains(&m),
            "--shared-cache-multiplier must be in [0, 1], got {m}"
        );
        let block_bytes = block_size as f64 * self.kv_bytes_per_token as f64;
        let per_block = |name: &str, gb_s: f64| -> anyhow::Result<Option<u64>> {
            anyhow::ensure!(
                gb_s.is_finite() && gb_s >= 0.0,
                "{name} must be >= 0, got {gb_s}"
            );
            // 1 GB/s is one byte per nanosecond.
            Ok((gb_s > 0.0).then(|| (block_bytes / gb_s).round() as u64))
        };
        Ok(TierOptions {
            store_ns_per_block: per_block("--shared-store-gb-s", self.shared_store_gb_s)?,
            p2p_ns_per_block: if self.kv_transfer_hints {
                per_block("--p2p-gb-s", self.p2p_gb_s)?
            } else {
                None
            },
        })
    }
}

/// What the tiers did in one policy's run.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct TierReport {
    /// Blocks engines loaded from the shared store instead of prefilling them.
    pub store_blocks_loaded: u64,
    /// Blocks engines pulled from a peer a transfer hint named.
    pub peer_blocks_pulled: u64,
    /// Requests dispatched with a transfer hint.
    pub hinted_requests: u64,
    /// kvpick: booked picks where some candidate could load from the store, and of them the
    /// picks the shared tier changed (`kvpick_shared_tier_picks_total`).
    pub shared_hit_picks: u64,
    pub shared_changed_picks: u64,
}

/// The replay's store and the loads it and the hints make.
pub(super) struct TierSim {
    options: TierOptions,
    store: HashSet<u64>,
    /// Peer pulls in flight: (landing time, request id, rank, blocks pulled), and the pulls
    /// landed whose requests are being dispatched (id -> blocks).
    pulls: Vec<(u64, u64, usize, usize)>,
    landed: std::collections::HashMap<u64, usize>,
    block_size: usize,
    seed: u64,
    report: TierReport,
}

impl TierSim {
    pub fn new(options: TierOptions, block_size: usize) -> Self {
        TierSim {
            options,
            store: HashSet::new(),
            pulls: Vec::new(),
            landed: std::collections::HashMap::new(),
            block_size,
            seed: hash::block_seed(None, None),
            report: TierReport::default(),
        }
    }

    /// An engine's KV events, written through to the store: the `EXTERNAL` copies of its stores
    /// of blocks new to it, which the policy is told (as the engine's own events).
    pub fn on_events(&mut self, events: &[KvEvent]) -> Vec<KvEvent> {
        if self.options.store_ns_per_block.is_none() {
            return Vec::new();
        }
        let mut out = Vec::new();
        for event in events {
            if let KvEvent::BlockStored { block_hashes, .. } = event {
                let mut fresh = false;
                for h in block_hashes {
                    fresh |= self.store.insert(*h);
                }
                if fresh {
                    let mut copy = event.clone();
                    if let KvEvent::BlockStored { medium, .. } = &mut copy {
                        *medium = Medium::parse("EXTERNAL");
                    }
                    out.push(copy);
                }
            }
        }
        out
    }

    /// Tells `policy` the `EXTERNAL` copies of rank `rank`'s events ([`TierSim::on_events`]).
    pub fn forward(&mut self, rank: usize, events: &[KvEvent], policy: &mut dyn Policy) {
        let shared = self.on_events(events);
        if !shared.is_empty() {
            policy.on_kv_events(rank, &shared);
        }
    }

    /// The run's tier report (with the policy's shared-tier picks), when a store or hints ran.
    pub fn report(&self, policy: &dyn Policy) -> Option<TierReport> {
        if self.options == TierOptions::default() {
            return None;
        }
        let (hits, changed) = policy.shared_tier_picks();
        Some(TierReport {
            shared_hit_picks: hits,
            shared_changed_picks: changed,
            ..self.report.clone()
        })
    }

    /// The earliest time a peer pull lands.
    pub fn next_landing(&self) -> Option<u64> {
        self.pulls.iter().map(|p| p.0).min()
    }

    /// The requests whose peer pull landed at `now`, to dispatch (to the same rank).
    pub fn landed(&mut self, now: u64) -> Vec<(u64, usize)> {
        let mut out = Vec::new();
        self.pulls.retain(|&(at, id, rank, blocks)| {
            if at > now {
                return true;
            }
            out.push((id, rank));
            self.landed.insert(id, blocks);
            false
        });
        out
    }

    /// What request `id`, dispatched to `rank` at `now`, takes to its engine: `Some(load)` now
    /// (a store load is paid in its admitting step, as LMCache retrieves), or `None` while a peer
    /// pull runs: vLLM's NIXL pulls run beside the engine's batch, so the request alone waits
    /// (blocks × time per block) and reaches the engine with the blocks in hand.
    pub fn plan(
        &mut self,
        id: u64,
        rank: usize,
        now: u64,
        tokens: &[u32],
        target: &Engine,
        hint: Option<&super::RankState>,
    ) -> Option<Option<ExternalKv>> {
        if let Some(blocks) = self.landed.remove(&id) {
            return Some(Some(ExternalKv {
                blocks,
                ns_per_block: 0,
            }));
        }
        match self.external(tokens, target, hint.map(|h| &h.engine)) {
            Some((e, true)) => {
                let own = target.cached_prefix_tokens(tokens) / self.block_size;
                let wait = (e.blocks.saturating_sub(own) as u64).saturating_mul(e.ns_per_block);
                self.pulls
                    .push((now.saturating_add(wait.max(1)), id, rank, e.blocks));
                None
            }
            Some((e, false)) => Some(Some(e)),
            None => Some(None),
        }
    }

    /// What a request dispatched to `target` may load, and whether from a peer: from the peer a
    /// hint named (the blocks it caches now), or from the store (its consecutive prefix of the
    /// prompt), whichever holds more; `None` when neither holds anything.
    fn external(
        &mut self,
        tokens: &[u32],
        target: &Engine,
        hint: Option<&Engine>,
    ) -> Option<(ExternalKv, bool)> {
        let bs = self.block_size;
        let own = target.cached_prefix_tokens(tokens) / bs;
        let peer = hint
            .zip(self.options.p2p_ns_per_block)
            .map(|(e, ns)| (e.cached_prefix_tokens(tokens) / bs, ns))
            .filter(|(blocks, _)| *blocks > own);
        let store = self.options.store_ns_per_block.map(|ns| {
            let held = hash::prompt_hashes(tokens, bs, self.seed)
                .iter()
                .take_while(|h| self.store.contains(h))
                .count();
            (held.min(tokens.len().saturating_sub(1) / bs), ns)
        });
        if peer.is_some() {
            self.report.hinted_requests += 1;
        }
        let (blocks, ns_per_block, from_peer) = match (peer, store) {
            (Some(p), Some(s)) if s.0 >= p.0 => (s.0, s.1, false),
            (Some(p), _) => (p.0, p.1, true),
            (None, Some(s)) => (s.0, s.1, false),
            (None, None) => return None,
        };
        let loaded = blocks.saturating_sub(own) as u64;
        if from_peer {
            self.report.peer_blocks_pulled += loaded;
        } else {
            self.report.store_blocks_loaded += loaded;
        }
        (loaded > 0).then_some((
            ExternalKv {
                blocks,
                ns_per_block,
            },
            from_peer,
        ))
    }
}

/// The tiers' table for the Markdown report (policies that ran with a store or hints).
pub fn markdown(policies: &[super::PolicyReport]) -> String {
    let rows: Vec<String> = policies
        .iter()
        .filter_map(|p| {
            let t = p.tiers.as_ref()?;
            Some(format!(
                "| {} | {} | {} | {} | {} | {} |\n",
                p.policy,
                t.store_blocks_loaded,
                t.peer_blocks_pulled,
                t.hinted_requests,
                t.shared_hit_picks,
                t.shared_changed_picks
            ))
        })
        .collect();
    if rows.is_empty() {
        return String::new();
    }
    let mut s = String::from(
        "\n| policy | blocks loaded from the store | blocks pulled from peers | hinted requests | \
         picks with a shared hit | picks the shared tier changed |\n|---|---|---|---|---|---|\n",
    );
    s.extend(rows);
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::engine::{EngineConfig, EngineRequest};

    #[test]
    fn a_peer_pull_holds_its_request_until_it_lands_then_loads_for_free() {
        let config = EngineConfig {
            num_gpu_blocks: 100,
            ..EngineConfig::default()
        };
        let tokens: Vec<u32> = (0..16 * 6 + 1).collect();
        let mut holder = Engine::new(config.clone());
        holder
            .add_request(EngineRequest {
                id: 1,
                prompt: tokens.clone(),
                max_tokens: 1,
            })
            .unwrap();
        while holder.step().is_some() {}
        let holder = super::super::RankState {
            engine: holder,
            busy_until: None,
            pending: None,
            step_ns: 0,
            prefill_ns: 0,
        };
        let target = Engine::new(config);
        let options = TierOptions {
            store_ns_per_block: None,
            p2p_ns_per_block: Some(100),
        };
        let mut sim = TierSim::new(options, 16);
        // No hint: nothing to load, dispatched at once.
        assert_eq!(sim.plan(2, 0, 1_000, &tokens, &target, None), Some(None));
        // A hint to a holder of 6 blocks: the request waits 6 × 100 ns.
        assert_eq!(sim.plan(3, 0, 1_000, &tokens, &target, Some(&holder)), None);
        assert_eq!(sim.next_landing(), Some(1_600));
        assert!(sim.landed(1_599).is_empty(), "not before it lands");
        assert_eq!(sim.landed(1_600), vec![(3, 0)]);
        let load = ExternalKv {
            blocks: 6,
            ns_per_block: 0,
        };
        assert_eq!(
            sim.plan(3, 0, 1_600, &tokens, &target, None),
            Some(Some(load))
        );
        assert_eq!(sim.next_landing(), None);
        assert_eq!(
            (sim.report.peer_blocks_pulled, sim.report.hinted_requests),
            (6, 1)
        );
    }

    #[test]
    fn bandwidths_become_time_per_block_and_are_checked() {
        let mut args = TierArgs {
            shared_store_gb_s: 10.0,
            shared_cache_multiplier: 0.5,
            kv_transfer_hints: false,
            p2p_gb_s: 25.0,
            kv_bytes_per_token: 131_072,
        };
        let o = args.options(16).unwrap();
        // 16 × 128 KiB = 2 MiB at 10 GB/s.
        assert_eq!(o.store_ns_per_block, Some(209_715));
        assert_eq!(o.p2p_ns_per_block, None, "hints off: no pulls");
        args.kv_transfer_hints = true;
        assert_eq!(args.options(16).unwrap().p2p_ns_per_block, Some(83_886));
        args.shared_cache_multiplier = 1.0 + f64::EPSILON;
        assert!(args.options(16).is_err());
        args.shared_cache_multiplier = 1.0;
        args.shared_store_gb_s = -1.0;
        assert!(args.options(16).is_err());
    }
}
