//! KV-cache groups of hybrid models: which of a rank's KV events may confirm a prefix.
//!
//! vLLM (0.32) keeps one KV-cache group per kind of layer (full attention, sliding window, Mamba
//! state, ...) and publishes every group's blocks under the same block hashes: each `BlockStored`
//! carries its `group_idx` and the group's `kv_cache_spec_kind`, each `BlockRemoved` only the
//! `group_idx`. Only a full-attention group's block holds the whole prefix's keys and values; a
//! sliding-window group keeps the last window of tokens and a state-space group a running state, so
//! their blocks do not make a prefix reusable the way a full-attention block does. Counting them
//! would keep a prefix "cached" after its full-attention blocks were evicted (the index counts
//! holders per block: the sliding-window store of the same hash keeps it alive).
//!
//! So a rank's events pass to the core only for the prefix kinds ([`prefix_kind`]: full, MLA and
//! sink-full attention, the kinds llm-d-router and Dynamo admit); the others are **dropped**, not
//! tracked (kvpick's index answers "which ranks hold this prefix", which they cannot answer). What
//! each group is, is learnt per rank from the stores ([`RankGroups`]) and forgotten when the rank's
//! engine restarts (the ingest task calls [`RankGroups::reset`]). A remove names only its group:
//! one of a group never classified is dropped when the rank announces kinds at all (its blocks were
//! never admitted, so the remove can only hit a full-attention holder of the same hash), and
//! applied as before when it never does (an engine older than the kinds, SGLang, TensorRT-LLM).
//! A rank whose groups are all of other kinds (a model with sliding-window attention on every
//! layer) cannot confirm anything: it stays approximate (its index fed by kvpick's own picks), and
//! its `AllBlocksCleared` clears the rank without making it precise ([`Filtered::clear_rank`]).
//!
//! This module decides per event; the ingest task logs the rank's changes and counts the outcomes.

use std::borrow::Cow;
use std::collections::BTreeMap;

use super::decode::{EventBatch, KvEvent, SpecKind};

/// Most groups learnt per rank. vLLM models have a handful (Gemma 3: one full-attention group and
/// five sliding-window groups); a publisher naming more is not trusted with more memory: the
/// groups past it stay unclassified.
pub const MAX_GROUPS: usize = 64;

/// Kinds whose blocks hold the whole prefix and count as prefix matches.
pub fn prefix_kind(kind: SpecKind) -> bool {
    matches!(
        kind,
        SpecKind::FullAttention | SpecKind::MlaAttention | SpecKind::SinkFullAttention
    )
}

/// What an event's group is, as far as the rank's announcements tell.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupClass {
    /// No `group_idx` (engines without KV-cache groups).
    None,
    /// A group whose kind this rank announced.
    Kind(SpecKind),
    /// A `group_idx` whose kind the rank has not announced (yet).
    Unclassified,
}

impl GroupClass {
    /// Metric label (`kind`).
    pub fn label(self) -> &'static str {
        match self {
            GroupClass::None => "none",
            GroupClass::Kind(kind) => kind.as_str(),
            GroupClass::Unclassified => "unclassified",
        }
    }
}

/// What became of one event, for the by-kind counter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Outcome {
    /// `stored` or `removed`.
    pub event: &'static str,
    pub class: GroupClass,
    pub admitted: bool,
}

/// A batch after the group filter.
#[derive(Debug)]
pub struct Filtered<'a> {
    /// The events for the core (borrowed when every event passed).
    pub events: Cow<'a, [KvEvent]>,
    /// One per store and remove of the batch, in order.
    pub outcomes: Vec<Outcome>,
    /// The batch held an `AllBlocksCleared` while the rank had no prefix group: clear the rank
    /// (its predictions) without applying an event, which would make it precise.
    pub clear_rank: bool,
}

/// The rank's mode as its groups decide it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// No kinds announced, or at least one prefix group: events confirm prefixes.
    Events,
    /// Every announced group is of another kind: kvpick's own picks predict the rank's cache.
    Approximate,
}

/// One rank's KV-cache groups, learnt from its stores.
#[derive(Debug, Default)]
pub struct RankGroups {
    kinds: BTreeMap<u32, SpecKind>,
}

impl RankGroups {
    /// Forgets the groups (a new engine run may serve another model).
    pub fn reset(&mut self) {
        self.kinds.clear();
    }

    /// The groups learnt so far, for logs.
    pub fn kinds(&self) -> &BTreeMap<u32, SpecKind> {
        &self.kinds
    }

    /// Approximate once the rank announced kinds and none is a prefix kind.
    pub fn mode(&self) -> Mode {
        if !self.kinds.is_empty() && !self.kinds.values().any(|k| prefix_kind(*k)) {
            Mode::Approximate
        } else {
            Mode::Events
        }
    }

    fn learn(&mut self, group: u32, kind: SpecKind) {
        if self.kinds.len() < MAX_GROUPS || self.kinds.contains_key(&group) {
            self.kinds.insert(group, kind);
        }
    }

    fn class(&self, group: Option<u32>) -> GroupClass {
        match group {
            None => GroupClass::None,
            Some(g) => self
                .kinds
                .get(&g)
                .map_or(GroupClass::Unclassified, |k| GroupClass::Kind(*k)),
        }
    }

    /// Whether an event of this class reaches the core.
    fn admits(&self, class: GroupClass) -> bool {
        match class {
            GroupClass::None => true,
            GroupClass::Kind(kind) => prefix_kind(kind),
            // Legacy engines send group_idx without kinds: as before. A rank that announces kinds
            // announced this group's with every store, so nothing of it was admitted.
            GroupClass::Unclassified => self.kinds.is_empty(),
        }
    }

    /// Learns the batch's announced kinds (in event order: a store teaches the removes after it)
    /// and keeps the events the core may apply.
    pub fn filter<'a>(&mut self, batch: &'a EventBatch) -> Filtered<'a> {
        let mut specs = batch.group_specs.iter().peekable();
        let mut keep = Vec::with_capacity(batch.events.len());
        let mut outcomes = Vec::new();
        let mut clear_rank = false;
        for (i, event) in batch.events.iter().enumerate() {
            let announced = specs.next_if(|s| s.event == i).map(|s| s.kind);
            let (name, group) = match event {
                KvEvent::BlockStored { group_idx, .. } => {
                    if let (Some(g), Some(kind)) = (group_idx, announced) {
                        self.learn(*g, kind);
                    }
                    ("stored", *group_idx)
                }
                KvEvent::BlockRemoved { group_idx, .. } => ("removed", *group_idx),
                KvEvent::AllBlocksCleared => {
                    let approximate = self.mode() == Mode::Approximate;
                    clear_rank |= approximate;
                    keep.push(!approximate);
                    continue;
                }
            };
            // A store announcing a kind beyond MAX_GROUPS is judged by its own announcement.
            let class = match (self.class(group), announced, group) {
                (GroupClass::Unclassified, Some(kind), Some(_)) => GroupClass::Kind(kind),
                (class, _, _) => class,
            };
            let admitted = self.admits(class);
            outcomes.push(Outcome {
                event: name,
                class,
                admitted,
            });
            keep.push(admitted);
        }
        let events = if keep.iter().all(|k| *k) {
            Cow::Borrowed(batch.events.as_slice())
        } else {
            Cow::Owned(
                batch
                    .events
                    .iter()
                    .zip(&keep)
                    .filter(|(_, k)| **k)
                    .map(|(e, _)| e.clone())
                    .collect(),
            )
        };
        Filtered {
            events,
            outcomes,
            clear_rank,
        }
    }
}

#[cfg(test)]
#[path = "groups_tests.rs"]
mod tests;
