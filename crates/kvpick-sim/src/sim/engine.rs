//! One simulated vLLM-like engine rank, as a pure state machine with no clock of its own
//! (ARCHITECTURE.md §10). It owns the paged KV cache (blocks keyed by the router's chained block hashes
//! from [`kvpick_core::hash`], reference counts, LRU of unreferenced blocks), the continuous
//! batching scheduler (`max_num_seqs`, `max_num_batched_tokens`, chunked prefill, per-token
//! decode, preemption by recompute) and the latency model; it reports the KV events a real vLLM
//! would publish as [`KvEvent`] values.
//!
//! The caller owns time: [`Engine::step`] plans one engine iteration starting at `now` and returns
//! its duration; its outputs (tokens, finished requests, KV events) take effect at
//! `now + duration`, and the caller must not step again before then. Both the real-time HTTP
//! simulator and the offline virtual-clock replay drive it. This module must not do I/O, read a
//! clock, or know about routing.
//!
//! Latency model (all integer nanoseconds, so it is exact):
//! `step = prefill_overhead × (requests starting prefill) + prefill_per_token × prefill tokens`
//! plus `itl + itl_per_seq × decoding requests (+ itl_per_kv_token × their KV tokens)` when any
//! request decodes. A request alone on an idle engine
//! therefore sees `TTFT = prefill_overhead + uncached_tokens × prefill_per_token`; queue wait and
//! batch interference add to it.

use std::collections::{BTreeSet, HashMap, VecDeque};

use kvpick_core::event::{KvEvent, Medium};
use kvpick_core::hash;

/// Static engine settings (vLLM's cache/scheduler config plus the latency model).
#[derive(Debug, Clone, PartialEq)]
pub struct EngineConfig {
    pub block_size: usize,
    pub num_gpu_blocks: usize,
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    /// Paid once per request when its prefill starts.
    pub prefill_overhead_ns: u64,
    pub prefill_ns_per_token: u64,
    /// Decode iteration time `itl(batch) = itl_ns + itl_ns_per_seq × batch`.
    pub itl_ns: u64,
    pub itl_ns_per_seq: u64,
    /// Decode cost of attention over the batch's KV, picoseconds per cached token of every
    /// decoding request (memory-bound decode); 0 = `itl` depends on the batch size only.
    pub itl_ps_per_kv_token: u64,
}

impl Default for EngineConfig {
    /// Roughly an 8B model on one H100: ~20k prefill tokens/s, ~8 ms decode steps, ~0.5 M
    /// tokens of KV cache.
    fn default() -> Self {
        EngineConfig {
            block_size: 16,
            num_gpu_blocks: 32_768,
            max_num_seqs: 256,
            max_num_batched_tokens: 8_192,
            prefill_overhead_ns: 5_000_000,
            prefill_ns_per_token: 50_000,
            itl_ns: 8_000_000,
            itl_ns_per_seq: 50_000,
            itl_ps_per_kv_token: 0,
        }
    }
}

impl EngineConfig {
    /// Decode iteration time for `batch` decoding requests.
    pub fn itl(&self, batch: usize) -> u64 {
        if batch == 0 {
            0
        } else {
            self.itl_ns + self.itl_ns_per_seq * batch as u64
        }
    }
}

/// A request handed to the engine.
#[derive(Debug, Clone)]
pub struct EngineRequest {
    pub id: u64,
    pub prompt: Vec<u32>,
    /// Output tokens to generate (at least 1).
    pub max_tokens: u32,
}

/// KV a request may load at admission instead of prefilling it: the prompt's first `blocks`
/// blocks are held outside this rank (a shared KV store, or a peer named by a transfer hint), and
/// each one this rank does not hold itself costs `ns_per_block` of the admitting step (loading is
/// modelled synchronous, as LMCache's default retrieval is: the step waits for it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExternalKv {
    pub blocks: usize,
    pub ns_per_block: u64,
}

/// Why a request was refused at admission.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AddError {
    #[error(
        "prompt of {tokens} tokens needs {blocks} blocks, more than the {capacity} the cache has"
    )]
    TooLong {
        tokens: usize,
        blocks: usize,
        capacity: usize,
    },
    #[error("empty prompt")]
    Empty,
    #[error("duplicate request id {0}")]
    Duplicate(u64),
}

/// What one request got out of one step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeqOutput {
    pub id: u64,
    /// Tokens sampled this step (0 or 1).
    pub new_tokens: u32,
    /// This step produced the request's first token.
    pub first: bool,
    /// The request is done (all `max_tokens` generated); its blocks are released.
    pub finished: bool,
    pub prompt_tokens: u32,
    /// Prompt tokens served from the prefix cache (at its first admission).
    pub cached_tokens: u32,
    /// Tokens generated so far.
    pub generated: u32,
}

/// One engine iteration.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepResult {
    pub duration_ns: u64,
    /// The decode part of `duration_ns`.
    pub decode_ns: u64,
    pub prefill_tokens: usize,
    pub decode_seqs: usize,
    pub outputs: Vec<SeqOutput>,
    /// KV events in the order they happened (what vLLM publishes after the step).
    pub events: Vec<KvEvent>,
}

/// Counters in the shape of vLLM's metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct EngineStats {
    pub running: usize,
    pub waiting: usize,
    /// Referenced + private blocks over capacity (cached but unreferenced blocks count as free,
    /// like vLLM's `kv_cache_usage_perc`).
    pub kv_usage: f64,
    pub prefix_cache_queries: u64,
    pub prefix_cache_hits: u64,
    pub cached_blocks: usize,
    pub preemptions: u64,
}

#[derive(Debug)]
struct Seq {
    id: u64,
    prompt: Vec<u32>,
    /// Chained hashes of the prompt's complete blocks.
    hashes: Vec<u64>,
    max_tokens: u32,
    /// Prompt tokens found cached at first admission (reported as `cached_tokens`).
    cached_tokens: Option<u32>,
    /// Prompt tokens whose KV is computed or cached.
    computed: usize,
    generated: u32,
    /// Prompt blocks `[0..hashed)` referenced in the cache.
    hashed: usize,
    /// Blocks held outside the cache (uncomputed prompt blocks, partial tail, decode).
    private: usize,
    /// Prefill/decode disaggregation: the prompt's KV was computed by a prefill rank and
    /// transferred here, so its uncached blocks enter the cache at admission without a prefill.
    transferred: bool,
    /// KV it may load at admission beyond its cached prefix.
    external: Option<ExternalKv>,
}

#[derive(Debug, Clone, Copy)]
struct Block {
    refs: u32,
    /// LRU position while `refs == 0`.
    tick: u64,
}

/// One simulated engine rank.
#[derive(Debug)]
pub struct Engine {
    config: EngineConfig,
    seed: u64,
    cache: HashMap<u64, Block>,
    /// Unreferenced cached blocks, least recently released first.
    lru: BTreeSet<(u64, u64)>,
    tick: u64,
    private_total: usize,
    waiting: VecDeque<Seq>,
    running: Vec<Seq>,
    queries: u64,
    hits: u64,
    preemptions: u64,
}

impl Engine {
    pub fn new(config: EngineConfig) -> Self {
        assert!(config.block_size > 0 && config.max_num_batched_tokens > 0);
        Engine {
            config,
            seed: hash::block_seed(None, None),
            cache: HashMap::new(),
            lru: BTreeSet::new(),
            tick: 0,
            private_total: 0,
            waiting: VecDeque::new(),
            running: Vec::new(),
            queries: 0,
            hits: 0,
            preemptions: 0,
        }
    }

    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// Queues a request (FCFS).
    pub fn add_request(&mut self, request: EngineRequest) -> Result<(), AddError> {
        if request.prompt.is_empty() {
            return Err(AddError::Empty);
        }
        if self.contains(request.id) {
            return Err(AddError::Duplicate(request.id));
        }
        let bs = self.config.block_size;
        let blocks = (request.prompt.len() + request.max_tokens.max(1) as usize).div_ceil(bs);
        if blocks > self.config.num_gpu_blocks {
            return Err(AddError::TooLong {
                tokens: request.prompt.len(),
                blocks,
                capacity: self.config.num_gpu_blocks,
            });
        }
        let hashes = hash::prompt_hashes(&request.prompt, bs, self.seed);
        self.waiting.push_back(Seq {
            id: request.id,
            prompt: request.prompt,
            hashes,
            max_tokens: request.max_tokens.max(1),
            cached_tokens: None,
            computed: 0,
            generated: 0,
            hashed: 0,
            private: 0,
            transferred: false,
            external: None,
        });
        Ok(())
    }

    /// Queues a request that may load `external` KV at admission (blocks beyond its cached
    /// prefix, paid in the admitting step's time; they enter the cache and the KV events);
    /// `None` is [`Engine::add_request`].
    pub fn add_with_external(
        &mut self,
        request: EngineRequest,
        external: Option<ExternalKv>,
    ) -> Result<(), AddError> {
        let id = request.id;
        self.add_request(request)?;
        if let Some(seq) = self.waiting.iter_mut().rev().find(|s| s.id == id) {
            seq.external = external;
        }
        Ok(())
    }

    /// Queues a request whose prompt KV a prefill rank computed and this rank pulled
    /// (prefill/decode disaggregation, after the caller paid the transfer): at admission its
    /// uncached prompt blocks enter the prefix cache (and the KV events) with no prefill cost,
    /// and its first token comes from its first decode step.
    pub fn add_transferred(&mut self, request: EngineRequest) -> Result<(), AddError> {
        let id = request.id;
        self.add_request(request)?;
        if let Some(seq) = self.waiting.iter_mut().rev().find(|s| s.id == id) {
            seq.transferred = true;
        }
        Ok(())
    }

    fn contains(&self, id: u64) -> bool {
        self.waiting.iter().any(|s| s.id == id) || self.running.iter().any(|s| s.id == id)
    }

    /// Drops a request (client went away); its blocks are released. Returns whether it existed.
    pub fn abort(&mut self, id: u64) -> bool {
        if let Some(pos) = self.waiting.iter().position(|s| s.id == id) {
            self.waiting.remove(pos);
            return true;
        }
        if let Some(pos) = self.running.iter().position(|s| s.id == id) {
            let mut seq = self.running.remove(pos);
            self.release(&mut seq);
            return true;
        }
        false
    }

    /// Whether there is anything to step.
    pub fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    pub fn stats(&self) -> EngineStats {
        let referenced = self.cache.len() - self.lru.len();
        EngineStats {
            running: self.running.len(),
            waiting: self.waiting.len(),
            kv_usage: (referenced + self.private_total) as f64 / self.config.num_gpu_blocks as f64,
            prefix_cache_queries: self.queries,
            prefix_cache_hits: self.hits,
            cached_blocks: self.cache.len(),
            preemptions: self.preemptions,
        }
    }

    /// Hashes of every block in the prefix cache (referenced or not), sorted.
    pub fn cached_block_hashes(&self) -> Vec<u64> {
        let mut out: Vec<u64> = self.cache.keys().copied().collect();
        out.sort_unstable();
        out
    }

    /// Prompt tokens a new request would find cached right now (longest cached prefix, at most
    /// `len - 1` tokens: the last token is always computed).
    pub fn cached_prefix_tokens(&self, prompt: &[u32]) -> usize {
        let hashes = hash::prompt_hashes(prompt, self.config.block_size, self.seed);
        self.hit_blocks(&hashes, prompt.len()) * self.config.block_size
    }

    fn hit_blocks(&self, hashes: &[u64], len: usize) -> usize {
        let max = (len - 1) / self.config.block_size;
        hashes
            .iter()
            .take(max)
            .take_while(|h| self.cache.contains_key(h))
            .count()
    }

    fn free_blocks(&self) -> usize {
        self.config.num_gpu_blocks - self.cache.len() - self.private_total
    }

    /// Makes `n` blocks free, evicting unreferenced cached blocks (least recent first).
    fn make_room(&mut self, n: usize, removed: &mut Vec<u64>) -> bool {
        if self.free_blocks() + self.lru.len() < n {
            return false;
        }
        while self.free_blocks() < n {
            let (_, h) = self.lru.pop_first().expect("checked above");
            self.cache.remove(&h);
            removed.push(h);
        }
        true
    }

    fn reference(&mut self, h: u64) {
        let block = self.cache.get_mut(&h).expect("cached block");
        if block.refs == 0 {
            self.lru.remove(&(block.tick, h));
        }
        block.refs += 1;
    }

    fn release(&mut self, seq: &mut Seq) {
        // Tail blocks first, so they are the first evicted (as vLLM frees them).
        for i in (0..seq.hashed).rev() {
            let h = seq.hashes[i];
            let block = self.cache.get_mut(&h).expect("referenced block is cached");
            block.refs -= 1;
            if block.refs == 0 {
                self.tick += 1;
                block.tick = self.tick;
                self.lru.insert((self.tick, h));
            }
        }
        seq.hashed = 0;
        self.private_total -= seq.private;
        seq.private = 0;
    }

    fn flush_removed(removed: &mut Vec<u64>, events: &mut Vec<KvEvent>) {
        if !removed.is_empty() {
            events.push(KvEvent::BlockRemoved {
                block_hashes: std::mem::take(removed),
                medium: Medium::Gpu,
                group_idx: None,
            });
        }
    }

    /// Plans and applies one iteration starting at the caller's `now`; `None` when nothing can
    /// run (idle, or every waiting request is blocked on memory).
    pub fn step(&mut self) -> Option<StepResult> {
        if !self.has_work() {
            return None;
        }
        let bs = self.config.block_size;
        let mut budget = self.config.max_num_batched_tokens;
        let mut events = Vec::new();
        let mut removed = Vec::new();
        // (index in running, prefill tokens; 0 = decode)
        let mut plan: Vec<(usize, usize)> = Vec::new();
        let mut starts = 0usize;
        let mut load_ns = 0u64;

        // 1. Running requests: continue prefill chunks, or decode one token (which may need a
        //    new block; without one, the most recently admitted request is preempted).
        let mut i = 0;
        while i < self.running.len() {
            if budget == 0 {
                break;
            }
            let seq = &self.running[i];
            let len = seq.prompt.len();
            if seq.computed < len {
                let chunk = (len - seq.computed).min(budget);
                budget -= chunk;
                plan.push((i, chunk));
                i += 1;
                continue;
            }
            let needed = (len + seq.generated as usize).div_ceil(bs);
            let held = seq.hashed + seq.private;
            if needed > held {
                let mut ok = self.make_room(1, &mut removed);
                while !ok {
                    // Preempt the newest request (recompute later); maybe this one.
                    let mut victim = self.running.pop().expect("non-empty");
                    self.release(&mut victim);
                    victim.computed = 0;
                    self.preemptions += 1;
                    let was_self = self.running.len() == i;
                    self.waiting.push_front(victim);
                    plan.retain(|&(j, _)| j < self.running.len());
                    if was_self {
                        break;
                    }
                    ok = self.make_room(1, &mut removed);
                }
                if !ok {
                    break;
                }
                self.running[i].private += 1;
                self.private_total += 1;
            }
            budget -= 1;
            plan.push((i, 0));
            i += 1;
        }

        // 2. Admit waiting requests FCFS while seats, budget and memory allow.
        while budget > 0 && self.running.len() < self.config.max_num_seqs {
            let Some(seq) = self.waiting.front() else {
                break;
            };
            let len = seq.prompt.len();
            let hit = self.hit_blocks(&seq.hashes, len);
            let total = len.div_ceil(bs);
            let hits_in_lru = seq.hashes[..hit]
                .iter()
                .filter(|h| self.cache[*h].refs == 0)
                .count();
            let new_blocks = total - hit;
            if self.free_blocks() + self.lru.len() - hits_in_lru < new_blocks {
                break;
            }
            let mut seq = self.waiting.pop_front().expect("front exists");
            for j in 0..hit {
                self.reference(seq.hashes[j]);
            }
            let ok = self.make_room(new_blocks, &mut removed);
            debug_assert!(ok);
            seq.hashed = hit;
            seq.private = new_blocks;
            self.private_total += new_blocks;
            seq.computed = hit * bs;
            // Blocks loaded from outside: computed without a prefill, paid in this step.
            let loaded = match seq.external.take() {
                Some(e) => {
                    let n = e.blocks.min((len - 1) / bs).saturating_sub(hit);
                    load_ns += n as u64 * e.ns_per_block;
                    n
                }
                None => 0,
            };
            if loaded > 0 {
                Self::flush_removed(&mut removed, &mut events);
                let before = seq.computed;
                seq.computed = (hit + loaded) * bs;
                commit_blocks(
                    &mut self.cache,
                    &mut self.lru,
                    &mut self.private_total,
                    &mut seq,
                    before,
                    bs,
                    &mut events,
                );
            }
            if seq.cached_tokens.is_none() {
                seq.cached_tokens = Some(((hit + loaded) * bs) as u32);
                self.queries += len as u64;
                self.hits += ((hit + loaded) * bs) as u64;
            }
            if seq.transferred {
                // Pulled from the prefill rank: the prompt is computed; this step decodes.
                seq.transferred = false;
                Self::flush_removed(&mut removed, &mut events);
                let before = seq.computed;
                seq.computed = len;
                commit_blocks(
                    &mut self.cache,
                    &mut self.lru,
                    &mut self.private_total,
                    &mut seq,
                    before,
                    bs,
                    &mut events,
                );
                budget -= 1;
                self.running.push(seq);
                plan.push((self.running.len() - 1, 0));
                continue;
            }
            let chunk = (len - seq.computed).min(budget);
            budget -= chunk;
            starts += 1;
            self.running.push(seq);
            plan.push((self.running.len() - 1, chunk));
        }
        Self::flush_removed(&mut removed, &mut events);

        if plan.is_empty() {
            return None;
        }

        // 3. Apply the iteration.
        let prefill_tokens: usize = plan.iter().map(|&(_, c)| c).sum();
        let decode_seqs = plan.iter().filter(|&&(_, c)| c == 0).count();
        let decode_kv_tokens: u64 = plan
            .iter()
            .filter(|&&(_, c)| c == 0)
            .map(|&(i, _)| {
                (self.running[i].prompt.len() + self.running[i].generated as usize) as u64
            })
            .sum();
        let decode_ns = self.config.itl(decode_seqs)
            + decode_kv_tokens * self.config.itl_ps_per_kv_token / 1000;
        let duration_ns = self.config.prefill_overhead_ns * starts as u64
            + self.config.prefill_ns_per_token * prefill_tokens as u64
            + load_ns
            + decode_ns;
        let mut outputs = Vec::with_capacity(plan.len());
        let mut finished = Vec::new();
        for &(idx, chunk) in &plan {
            let seq = &mut self.running[idx];
            let len = seq.prompt.len();
            let sampled = if chunk > 0 {
                let before = seq.computed;
                seq.computed += chunk;
                commit_blocks(
                    &mut self.cache,
                    &mut self.lru,
                    &mut self.private_total,
                    seq,
                    before,
                    bs,
                    &mut events,
                );
                seq.computed == len
            } else {
                true
            };
            let first = sampled && seq.generated == 0;
            if sampled {
                seq.generated += 1;
            }
            let done = seq.generated >= seq.max_tokens;
            outputs.push(SeqOutput {
                id: seq.id,
                new_tokens: sampled as u32,
                first,
                finished: done,
                prompt_tokens: len as u32,
                cached_tokens: seq.cached_tokens.unwrap_or(0),
                generated: seq.generated,
            });
            if done {
                finished.push(idx);
            }
        }
        finished.sort_unstable();
        for idx in finished.into_iter().rev() {
            let mut seq = self.running.remove(idx);
            self.release(&mut seq);
        }
        Some(StepResult {
            duration_ns,
            decode_ns,
            prefill_tokens,
            decode_seqs,
            outputs,
            events,
        })
    }
}

/// Moves a sequence's prompt blocks completed since `before` (tokens) into the prefix cache and
/// reports the new ones as `BlockStored` events (runs of consecutive new blocks; a block another
/// request computed meanwhile is shared instead).
fn commit_blocks(
    cache: &mut HashMap<u64, Block>,
    lru: &mut BTreeSet<(u64, u64)>,
    private_total: &mut usize,
    seq: &mut Seq,
    before: usize,
    bs: usize,
    events: &mut Vec<KvEvent>,
) {
    let first_new = before / bs;
    let done_blocks = (seq.computed / bs).min(seq.hashes.len());
    let mut run: Vec<u64> = Vec::new();
    let mut run_start = first_new;
    let mut stored: Vec<(usize, Vec<u64>)> = Vec::new();
    for b in first_new.max(seq.hashed)..done_blocks {
        let h = seq.hashes[b];
        seq.private -= 1;
        seq.hashed = b + 1;
        match cache.get_mut(&h) {
            Some(block) => {
                // Computed concurrently by another request: share that block.
                *private_total -= 1;
                if block.refs == 0 {
                    lru.remove(&(block.tick, h));
                }
                block.refs += 1;
                if !run.is_empty() {
                    stored.push((run_start, std::mem::take(&mut run)));
                }
                run_start = b + 1;
            }
            None => {
                *private_total -= 1;
                cache.insert(h, Block { refs: 1, tick: 0 });
                if run.is_empty() {
                    run_start = b;
                }
                run.push(h);
            }
        }
    }
    if !run.is_empty() {
        stored.push((run_start, run));
    }
    for (start, block_hashes) in stored {
        let token_ids = seq.prompt[start * bs..(start + block_hashes.len()) * bs].to_vec();
        events.push(KvEvent::BlockStored {
            parent_block_hash: start.checked_sub(1).map(|p| seq.hashes[p]),
            block_hashes,
            token_ids,
            block_size: bs as u32,
            lora_id: None,
            medium: Medium::Gpu,
            lora_name: None,
            cache_salt: None,
            group_idx: None,
            media: Vec::new(),
        });
    }
}

#[cfg(test)]
mod tests;
