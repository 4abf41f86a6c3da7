//! The workload families as seeded generators of timed requests (see the module doc of
//! [`super`] for what each models and where its numbers come from). Owns the sampling and the
//! sessions' contexts as Mooncake blocks; writes nothing and knows nothing of engines or policies.
//!
//! A session's context is a stream of 512-token Mooncake blocks ([`Context`]): a prompt is the
//! stream's first `len` tokens, so a later turn that extends the context repeats every earlier
//! block id, and a partial last block keeps its id while it fills up (the synthesized tokens of an
//! id are fixed, so the shorter prompt is a prefix of the longer one). Shared parts (system
//! prompts, tool prefixes, documents) are whole blocks, so sharing never spans a block that also
//! holds private text.

use rand::distr::weighted::WeightedIndex;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Exp, LogNormal};

use crate::replay::trace::MOONCAKE_BLOCK;

/// Nominal generation time per output token (a decode step of ~8 ms plus queueing): the time a
/// client waits for an answer before its think or tool time starts. Fixed, because a trace is
/// open-loop: its timestamps cannot depend on the router being measured.
pub const NOMINAL_MS_PER_OUTPUT_TOKEN: f64 = 15.0;

/// One generated request, before the window and the time shift.
#[derive(Debug, Clone, PartialEq)]
pub struct Timed {
    pub at_ms: f64,
    pub input_length: usize,
    pub output_length: u32,
    pub hash_ids: Vec<u64>,
    /// The session, document or prefix family the request belongs to.
    pub group: u64,
    /// `agent-tree`: the agent session and its parent session (a sub-agent's), as the
    /// trace's `session_id` / `parent_session_id` columns.
    pub session: Option<(String, Option<String>)>,
}

/// The seeded sampler every family draws from, and the allocator of fresh block ids.
pub struct Sampler {
    rng: ChaCha8Rng,
    next_id: u64,
    next_group: u64,
}

impl Sampler {
    /// ChaCha8: a stream rand documents as reproducible across platforms and versions.
    pub fn new(seed: u64) -> Self {
        Sampler {
            rng: ChaCha8Rng::seed_from_u64(seed),
            next_id: 0,
            next_group: 0,
        }
    }

    pub fn fresh_id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id - 1
    }

    pub fn fresh_ids(&mut self, n: usize) -> Vec<u64> {
        (0..n).map(|_| self.fresh_id()).collect()
    }

    pub fn group(&mut self) -> u64 {
        self.next_group += 1;
        self.next_group - 1
    }

    pub fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * self.rng.random::<f64>()
    }

    pub fn log_uniform(&mut self, lo: f64, hi: f64) -> f64 {
        (lo.ln() + (hi.ln() - lo.ln()) * self.rng.random::<f64>()).exp()
    }

    pub fn int(&mut self, lo: usize, hi_inclusive: usize) -> usize {
        self.rng.random_range(lo..=hi_inclusive)
    }

    pub fn chance(&mut self, p: f64) -> bool {
        self.rng.random::<f64>() < p
    }

    /// Exponential inter-arrival gap, seconds, for `rate` per second.
    pub fn exp_gap(&mut self, rate: f64) -> f64 {
        Exp::new(rate)
            .map(|d| d.sample(&mut self.rng))
            .unwrap_or(f64::INFINITY)
    }

    /// A token count from a log-normal with this median and sigma, clamped to `[lo, hi]`.
    pub fn tokens(&mut self, shape: LenShape) -> usize {
        let d = LogNormal::new(shape.median.ln(), shape.sigma).expect("finite log-normal shape");
        d.sample(&mut self.rng)
            .round()
            .clamp(shape.lo as f64, shape.hi as f64) as usize
    }

    /// `k` in `min..=max` with `P(k) ∝ ratio^(k - min)`: a geometric law cut at `max`.
    pub fn truncated_geometric(&mut self, g: Geometric) -> usize {
        let weights: Vec<f64> = (g.min..=g.max)
            .map(|k| g.ratio.powi((k - g.min) as i32))
            .collect();
        let index = WeightedIndex::new(&weights).expect("positive weights");
        g.min + index.sample(&mut self.rng)
    }

    /// An index `0..n` with Zipf weights `1 / (i + 1)^exponent`.
    pub fn zipf_index(&mut self, weights: &WeightedIndex<f64>) -> usize {
        weights.sample(&mut self.rng)
    }
}

/// A clamped log-normal token count.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LenShape {
    pub median: f64,
    pub sigma: f64,
    pub lo: usize,
    pub hi: usize,
}

const fn shape(median: f64, sigma: f64, lo: usize, hi: usize) -> LenShape {
    LenShape {
        median,
        sigma,
        lo,
        hi,
    }
}

/// A truncated geometric count (see [`Sampler::truncated_geometric`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Geometric {
    pub min: usize,
    pub max: usize,
    pub ratio: f64,
}

impl Geometric {
    pub fn mean(&self) -> f64 {
        let (mut num, mut den) = (0.0, 0.0);
        for k in self.min..=self.max {
            let w = self.ratio.powi((k - self.min) as i32);
            num += w * k as f64;
            den += w;
        }
        num / den
    }
}

pub fn zipf_weights(n: usize, exponent: f64) -> WeightedIndex<f64> {
    WeightedIndex::new((0..n).map(|i| 1.0 / ((i + 1) as f64).powf(exponent)))
        .expect("n > 0 positive weights")
}

/// A session's context as Mooncake blocks (see the module doc).
#[derive(Debug, Clone, PartialEq)]
pub struct Context {
    ids: Vec<u64>,
    len: usize,
}

impl Context {
    /// A context that starts with whole shared blocks.
    pub fn from_blocks(ids: &[u64]) -> Self {
        Context {
            ids: ids.to_vec(),
            len: ids.len() * MOONCAKE_BLOCK,
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Appends `tokens` of new text: the partial last block fills up, then fresh blocks follow.
    pub fn append(&mut self, tokens: usize, ids: &mut Sampler) {
        self.len += tokens;
        while self.ids.len() * MOONCAKE_BLOCK < self.len {
            self.ids.push(ids.fresh_id());
        }
    }

    /// A copy that will diverge from this one. A partial last block gets a fresh id: both sides
    /// would fill it with different text, and one id would claim they share it.
    pub fn branch(&self, ids: &mut Sampler) -> Context {
        let mut child = self.clone();
        if !child.len.is_multiple_of(MOONCAKE_BLOCK) {
            if let Some(last) = child.ids.last_mut() {
                *last = ids.fresh_id();
            }
        }
        child
    }

    /// The request whose prompt is the whole context.
    pub fn request(&self, at_ms: f64, output_length: u32, group: u64) -> Timed {
        Timed {
            at_ms,
            input_length: self.len,
            output_length,
            hash_ids: self.ids.clone(),
            group,
            session: None,
        }
    }
}

/// A family's generator: sessions in start order, each with all its requests.
pub trait SessionSource {
    /// Expected requests per session (nominal, from the distributions), to turn a request rate
    /// into a session rate.
    fn requests_per_session(&self) -> f64;
    /// How long before the window's start sessions begin, seconds, so the window opens on
    /// sessions already in progress (a slice of a steady stream, like a production trace).
    fn warmup_s(&self) -> f64;
    /// All requests of one session starting at `start_ms`.
    fn session(&mut self, s: &mut Sampler, start_ms: f64) -> Vec<Timed>;
}

// ----------------------------------------------------------------------------------------------
// chat

pub struct Chat {
    system_prompts: Vec<Vec<u64>>,
    popularity: WeightedIndex<f64>,
}

pub const CHAT_TURNS: Geometric = Geometric {
    min: 2,
    max: 20,
    ratio: 0.85,
};
pub const CHAT_SYSTEM_PROMPT_BLOCKS: [usize; 4] = [1, 2, 3, 4];
pub const CHAT_FIRST_MESSAGE: LenShape = shape(800.0, 1.2, 16, 16_000);
pub const CHAT_MESSAGE: LenShape = shape(150.0, 1.0, 4, 8_000);
pub const CHAT_ANSWER: LenShape = shape(300.0, 0.7, 8, 2_048);
pub const CHAT_THINK_S: (f64, f64) = (10.0, 120.0);
/// A conversation ends when its next prompt would not fit the model's context.
pub const CHAT_CONTEXT_LIMIT: usize = 32_768;

impl Chat {
    pub fn new(s: &mut Sampler) -> Self {
        Chat {
            system_prompts: CHAT_SYSTEM_PROMPT_BLOCKS
                .iter()
                .map(|&n| s.fresh_ids(n))
                .collect(),
            popularity: zipf_weights(CHAT_SYSTEM_PROMPT_BLOCKS.len(), 1.0),
        }
    }
}

impl SessionSource for Chat {
    fn requests_per_session(&self) -> f64 {
        CHAT_TURNS.mean()
    }
    fn warmup_s(&self) -> f64 {
        (CHAT_TURNS.max - 1) as f64 * CHAT_THINK_S.1
    }
    fn session(&mut self, s: &mut Sampler, start_ms: f64) -> Vec<Timed> {
        let group = s.group();
        let system = &self.system_prompts[s.zipf_index(&self.popularity)];
        let mut ctx = Context::from_blocks(system);
        let turns = s.truncated_geometric(CHAT_TURNS);
        let mut at = start_ms;
        let mut out = Vec::new();
        for turn in 0..turns {
            let message = s.tokens(if turn == 0 {
                CHAT_FIRST_MESSAGE
            } else {
                CHAT_MESSAGE
            });
            if ctx.len() + message > CHAT_CONTEXT_LIMIT {
                break;
            }
            ctx.append(message, s);
            let answer = s.tokens(CHAT_ANSWER);
            out.push(ctx.request(at, answer as u32, group));
            ctx.append(answer, s);
            at += answer as f64 * NOMINAL_MS_PER_OUTPUT_TOKEN
                + 1000.0 * s.uniform(CHAT_THINK_S.0, CHAT_THINK_S.1);
        }
        out
    }
}

// ----------------------------------------------------------------------------------------------
// agentic

pub struct Agentic {
    prefixes: Vec<Vec<u64>>,
    popularity: WeightedIndex<f64>,
    /// `agent-tree`: every request names its agent session, and a sub-agent its parent's.
    tree: bool,
    /// `agent-tree-fresh`: a sub-agent starts a fresh context (the app's prefix and its
    /// instruction) instead of the parent's history.
    fresh: bool,
}

/// Which agent of a session a loop is, when requests name their sessions (`agent-tree`).
struct AgentTag {
    session: String,
    parent: Option<String>,
    /// `agent-tree-fresh`: the app prefix a sub-agent's fresh context starts with.
    fresh: Option<Vec<u64>>,
}

/// What every loop of one agent session shares: its prefix group, the requests it made so far
/// (parent and sub-agents interleaved in the order they were generated), and how many sub-agents
/// it spawned (which numbers the next one's session id).
struct AgentSession<'a> {
    group: u64,
    out: &'a mut Vec<Timed>,
    agents: u32,
}

/// Agent applications, each with its own tool/system prefix of 8–32 blocks (4–16k tokens).
pub const AGENT_APPS: usize = 8;
pub const AGENT_PREFIX_BLOCKS: (usize, usize) = (8, 32);
pub const AGENT_TASK: LenShape = shape(400.0, 1.0, 16, 8_000);
pub const AGENT_TURNS: Geometric = Geometric {
    min: 4,
    max: 40,
    ratio: 0.92,
};
pub const SUBAGENT_TURNS: Geometric = Geometric {
    min: 2,
    max: 12,
    ratio: 0.8,
};
pub const AGENT_CALL: LenShape = shape(120.0, 0.8, 8, 2_000);
pub const AGENT_TOOL_RESULT: LenShape = shape(300.0, 1.2, 8, 16_000);
/// Tool execution time, seconds (log-normal median 1.5 s, clamped to 0.2–60 s).
pub const AGENT_TOOL_TIME: LenShape = shape(1500.0, 1.0, 200, 60_000);
/// Chance that a parent turn (after the first) fans out sub-agents.
pub const SUBAGENT_SPAWN_CHANCE: f64 = 0.1;
pub const SUBAGENT_FANOUT: (usize, usize) = (1, 3);
pub const SUBAGENT_INSTRUCTION: LenShape = shape(200.0, 0.8, 16, 4_000);
pub const SUBAGENT_SUMMARY: LenShape = shape(300.0, 0.8, 16, 4_000);
pub const AGENT_CONTEXT_LIMIT: usize = 65_536;

impl Agentic {
    pub fn new(s: &mut Sampler) -> Self {
        Agentic {
            prefixes: (0..AGENT_APPS)
                .map(|_| {
                    let n = s.int(AGENT_PREFIX_BLOCKS.0, AGENT_PREFIX_BLOCKS.1);
                    s.fresh_ids(n)
                })
                .collect(),
            popularity: zipf_weights(AGENT_APPS, 1.0),
            tree: false,
            fresh: false,
        }
    }

    /// `agent-tree`: the `agentic` generator (same draws, same requests), each request tagged
    /// with its agent session: the root `a<group>`, its sub-agents `a<group>.<k>` whose parent
    /// is the root. A sub-agent's prompt starts with the parent's whole history.
    pub fn tree(s: &mut Sampler) -> Self {
        Agentic {
            tree: true,
            ..Agentic::new(s)
        }
    }

    /// `agent-tree-fresh`: as [`Agentic::tree`], but a sub-agent's context starts fresh from
    /// the app's tool/system prefix and its instruction (Claude Code's subagents run in their
    /// own context): the parent's history is not in its prompt, only its session says whose
    /// it is.
    pub fn tree_fresh(s: &mut Sampler) -> Self {
        Agentic {
            fresh: true,
            ..Agentic::tree(s)
        }
    }

    /// One agent loop of `turns` calls on `ctx` from `at`; returns when its last answer arrived.
    /// A parent (`spawn`) may fan out sub-agents that branch off its history; `tag` names the
    /// loop's session (`agent-tree`); `session` collects the requests of the whole tree.
    fn agent_loop(
        s: &mut Sampler,
        session: &mut AgentSession<'_>,
        ctx: &mut Context,
        mut at: f64,
        turns: usize,
        spawn: bool,
        tag: Option<&AgentTag>,
    ) -> f64 {
        for turn in 0..turns {
            if ctx.len() > AGENT_CONTEXT_LIMIT {
                break;
            }
            let call = s.tokens(AGENT_CALL);
            let mut request = ctx.request(at, call as u32, session.group);
            request.session = tag.map(|t| (t.session.clone(), t.parent.clone()));
            session.out.push(request);
            ctx.append(call, s);
            at += call as f64 * NOMINAL_MS_PER_OUTPUT_TOKEN;
            if spawn && turn > 0 && s.chance(SUBAGENT_SPAWN_CHANCE) {
                let fanout = s.int(SUBAGENT_FANOUT.0, SUBAGENT_FANOUT.1);
                let mut done = at;
                for _ in 0..fanout {
                    let mut sub = match tag.and_then(|t| t.fresh.as_deref()) {
                        Some(prefix) => Context::from_blocks(prefix),
                        None => ctx.branch(s),
                    };
                    let instruction = s.tokens(SUBAGENT_INSTRUCTION);
                    sub.append(instruction, s);
                    let sub_turns = s.truncated_geometric(SUBAGENT_TURNS);
                    session.agents += 1;
                    let sub_tag = tag.map(|t| AgentTag {
                        session: format!("{}.{}", t.session, session.agents),
                        parent: Some(t.session.clone()),
                        fresh: None,
                    });
                    done = done.max(Self::agent_loop(
                        s,
                        session,
                        &mut sub,
                        at,
                        sub_turns,
                        false,
                        sub_tag.as_ref(),
                    ));
                }
                at = done;
                for _ in 0..fanout {
                    let summary = s.tokens(SUBAGENT_SUMMARY);
                    ctx.append(summary, s);
                }
            } else {
                at += s.tokens(AGENT_TOOL_TIME) as f64;
                let result = s.tokens(AGENT_TOOL_RESULT);
                ctx.append(result, s);
            }
        }
        at
    }
}

impl SessionSource for Agentic {
    fn requests_per_session(&self) -> f64 {
        let parent = AGENT_TURNS.mean();
        let fanout = (SUBAGENT_FANOUT.0 + SUBAGENT_FANOUT.1) as f64 / 2.0;
        parent * (1.0 + SUBAGENT_SPAWN_CHANCE * fanout * SUBAGENT_TURNS.mean())
    }
    fn warmup_s(&self) -> f64 {
        600.0
    }
    fn session(&mut self, s: &mut Sampler, start_ms: f64) -> Vec<Timed> {
        let group = s.group();
        let prefix = &self.prefixes[s.zipf_index(&self.popularity)];
        let mut ctx = Context::from_blocks(prefix);
        let task = s.tokens(AGENT_TASK);
        ctx.append(task, s);
        let turns = s.truncated_geometric(AGENT_TURNS);
        let mut out = Vec::new();
        let tag = self.tree.then(|| AgentTag {
            session: format!("a{group}"),
            parent: None,
            fresh: self.fresh.then(|| prefix.clone()),
        });
        let mut session = AgentSession {
            group,
            out: &mut out,
            agents: 0,
        };
        Self::agent_loop(
            s,
            &mut session,
            &mut ctx,
            start_ms,
            turns,
            true,
            tag.as_ref(),
        );
        out
    }
}

// ----------------------------------------------------------------------------------------------
// shared-docs

pub struct SharedDocs {
    template: Vec<u64>,
    docs: Vec<Vec<u64>>,
    groups: Vec<u64>,
    popularity: WeightedIndex<f64>,
}

pub const DOC_POOL: usize = 400;
pub const DOC_LENGTH: LenShape = shape(4_000.0, 0.7, 512, 32_768);
pub const DOC_ZIPF_EXPONENT: f64 = 0.9;
pub const DOC_TEMPLATE_BLOCKS: usize = 1;
pub const DOC_QUESTION: LenShape = shape(80.0, 0.7, 8, 1_000);
pub const DOC_ANSWER: LenShape = shape(200.0, 0.7, 8, 2_048);

impl SharedDocs {
    pub fn new(s: &mut Sampler) -> Self {
        let template = s.fresh_ids(DOC_TEMPLATE_BLOCKS);
        let docs: Vec<Vec<u64>> = (0..DOC_POOL)
            .map(|_| {
                let blocks = s.tokens(DOC_LENGTH).div_ceil(MOONCAKE_BLOCK);
                s.fresh_ids(blocks)
            })
            .collect();
        let groups = (0..DOC_POOL).map(|_| s.group()).collect();
        SharedDocs {
            template,
            docs,
            groups,
            popularity: zipf_weights(DOC_POOL, DOC_ZIPF_EXPONENT),
        }
    }
}

impl SessionSource for SharedDocs {
    fn requests_per_session(&self) -> f64 {
        1.0
    }
    fn warmup_s(&self) -> f64 {
        0.0
    }
    fn session(&mut self, s: &mut Sampler, start_ms: f64) -> Vec<Timed> {
        let doc = s.zipf_index(&self.popularity);
        let mut blocks = self.template.clone();
        blocks.extend_from_slice(&self.docs[doc]);
        let mut ctx = Context::from_blocks(&blocks);
        let question = s.tokens(DOC_QUESTION);
        ctx.append(question, s);
        let answer = s.tokens(DOC_ANSWER);
        vec![ctx.request(start_ms, answer as u32, self.groups[doc])]
    }
}

// ----------------------------------------------------------------------------------------------
// small-families

pub struct SmallFamilies;

pub const FAMILY_SIZE: Geometric = Geometric {
    min: 1,
    max: 8,
    ratio: 0.55,
};
/// Log-normal with sigma 1: mean ≈ 1.65 × median ≈ 13k tokens, p90 ≈ 3.6 × median ≈ 29k.
pub const FAMILY_PREFIX: LenShape = shape(8_000.0, 1.0, 1_024, 100_000);
pub const FAMILY_SUFFIX: LenShape = shape(300.0, 1.0, 8, 8_000);
pub const FAMILY_GAP_S: (f64, f64) = (10.0, 600.0);
pub const FAMILY_ANSWER: LenShape = shape(150.0, 0.9, 4, 2_048);

impl SessionSource for SmallFamilies {
    fn requests_per_session(&self) -> f64 {
        FAMILY_SIZE.mean()
    }
    fn warmup_s(&self) -> f64 {
        (FAMILY_SIZE.max - 1) as f64 * FAMILY_GAP_S.1
    }
    fn session(&mut self, s: &mut Sampler, start_ms: f64) -> Vec<Timed> {
        let group = s.group();
        let blocks = s.tokens(FAMILY_PREFIX).div_ceil(MOONCAKE_BLOCK);
        let prefix = Context::from_blocks(&s.fresh_ids(blocks));
        let size = s.truncated_geometric(FAMILY_SIZE);
        let mut at = start_ms;
        let mut out = Vec::new();
        for _ in 0..size {
            let mut ctx = prefix.clone();
            let suffix = s.tokens(FAMILY_SUFFIX);
            ctx.append(suffix, s);
            let answer = s.tokens(FAMILY_ANSWER);
            out.push(ctx.request(at, answer as u32, group));
            at += 1000.0 * s.log_uniform(FAMILY_GAP_S.0, FAMILY_GAP_S.1);
        }
        out
    }
}

// ----------------------------------------------------------------------------------------------
// no-reuse

pub struct NoReuse;

pub const UNIQUE_PROMPT: LenShape = shape(2_000.0, 0.9, 32, 32_768);
pub const UNIQUE_ANSWER: LenShape = shape(200.0, 0.8, 4, 2_048);

impl SessionSource for NoReuse {
    fn requests_per_session(&self) -> f64 {
        1.0
    }
    fn warmup_s(&self) -> f64 {
        0.0
    }
    fn session(&mut self, s: &mut Sampler, start_ms: f64) -> Vec<Timed> {
        let group = s.group();
        let mut ctx = Context::from_blocks(&[]);
        let prompt = s.tokens(UNIQUE_PROMPT);
        ctx.append(prompt, s);
        let answer = s.tokens(UNIQUE_ANSWER);
        vec![ctx.request(start_ms, answer as u32, group)]
    }
}
