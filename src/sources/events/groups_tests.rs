use super::*;
use crate::sources::events::decode::{GroupSpec, Medium};

fn store(hashes: &[u64], group: Option<u32>) -> KvEvent {
    KvEvent::BlockStored {
        block_hashes: hashes.to_vec(),
        parent_block_hash: None,
        token_ids: (0..hashes.len() as u32 * 4).collect(),
        block_size: 4,
        lora_id: None,
        medium: Medium::Gpu,
        lora_name: None,
        cache_salt: None,
        group_idx: group,
        media: Vec::new(),
    }
}

fn remove(hashes: &[u64], group: Option<u32>) -> KvEvent {
    KvEvent::BlockRemoved {
        block_hashes: hashes.to_vec(),
        medium: Medium::Gpu,
        group_idx: group,
    }
}

/// A batch of `(event, announced kind)`.
fn batch(events: Vec<(KvEvent, Option<SpecKind>)>) -> EventBatch {
    let group_specs = events
        .iter()
        .enumerate()
        .filter_map(|(i, (_, kind))| {
            kind.map(|kind| GroupSpec {
                event: i,
                kind,
                sliding_window: (kind == SpecKind::SlidingWindow).then_some(64),
            })
        })
        .collect();
    EventBatch {
        ts: 1.0,
        events: events.into_iter().map(|(e, _)| e).collect(),
        data_parallel_rank: Some(0),
        skipped_unknown: 0,
        group_specs,
    }
}

/// [`RankGroups::filter`] on a batch of `(event, announced kind)`, its result owned.
fn run(groups: &mut RankGroups, events: Vec<(KvEvent, Option<SpecKind>)>) -> Owned {
    let b = batch(events);
    let f = groups.filter(&b);
    Owned {
        events: f.events.into_owned(),
        outcomes: f.outcomes,
        clear_rank: f.clear_rank,
    }
}

struct Owned {
    events: Vec<KvEvent>,
    outcomes: Vec<Outcome>,
    clear_rank: bool,
}

const FULL: Option<SpecKind> = Some(SpecKind::FullAttention);
const SLIDING: Option<SpecKind> = Some(SpecKind::SlidingWindow);

fn outcome(event: &'static str, class: GroupClass, admitted: bool) -> Outcome {
    Outcome {
        event,
        class,
        admitted,
    }
}

/// A hybrid step as vLLM publishes it: both groups store the same hashes; the sliding-window
/// group's evictions follow. Only the full-attention group's events reach the core.
#[test]
fn only_full_attention_groups_reach_the_core() {
    let mut groups = RankGroups::default();
    let f = run(
        &mut groups,
        vec![
            (store(&[1, 2], Some(0)), FULL),
            (store(&[1, 2], Some(1)), SLIDING),
            (remove(&[1], Some(1)), None),
            (remove(&[2], Some(0)), None),
        ],
    );
    assert_eq!(
        f.events.as_slice(),
        &[store(&[1, 2], Some(0)), remove(&[2], Some(0))]
    );
    let full = GroupClass::Kind(SpecKind::FullAttention);
    let sliding = GroupClass::Kind(SpecKind::SlidingWindow);
    assert_eq!(
        f.outcomes,
        vec![
            outcome("stored", full, true),
            outcome("stored", sliding, false),
            outcome("removed", sliding, false),
            outcome("removed", full, true),
        ]
    );
    assert!(!f.clear_rank);
    assert_eq!(groups.mode(), Mode::Events);
    // A later kind-less store of a learnt group (an offload connector's) keeps the group's kind.
    let f = run(
        &mut groups,
        vec![(store(&[3], Some(1)), None), (store(&[3], Some(0)), None)],
    );
    assert_eq!(f.events.as_slice(), &[store(&[3], Some(0))]);
}

#[test]
fn mla_and_sink_full_attention_count_mamba_and_unknown_do_not() {
    for (kind, admitted) in [
        (SpecKind::FullAttention, true),
        (SpecKind::MlaAttention, true),
        (SpecKind::SinkFullAttention, true),
        (SpecKind::SlidingWindow, false),
        (SpecKind::SlidingWindowMla, false),
        (SpecKind::ChunkedLocalAttention, false),
        (SpecKind::Mamba, false),
        (SpecKind::EncoderOnlyAttention, false),
        (SpecKind::CrossAttention, false),
        (SpecKind::Unknown, false),
    ] {
        let mut groups = RankGroups::default();
        let f = run(&mut groups, vec![(store(&[1], Some(0)), Some(kind))]);
        assert_eq!(f.events.len() == 1, admitted, "{kind:?}");
    }
}

/// Removes carry only `group_idx`: a group never announced is dropped once the rank announces
/// kinds (nothing of it was admitted), applied as before on a rank that never does.
#[test]
fn a_remove_of_an_unclassified_group_is_dropped_only_on_a_rank_that_announces_kinds() {
    let mut legacy = RankGroups::default();
    let f = run(
        &mut legacy,
        vec![(store(&[1], Some(0)), None), (remove(&[1], Some(2)), None)],
    );
    assert_eq!(f.events.len(), 2, "no kinds announced: as before");
    assert_eq!(
        f.outcomes[1],
        outcome("removed", GroupClass::Unclassified, true)
    );

    let mut hybrid = RankGroups::default();
    run(&mut hybrid, vec![(store(&[1], Some(0)), FULL)]);
    let f = run(
        &mut hybrid,
        vec![
            (remove(&[1], Some(2)), None),
            (store(&[5], Some(3)), None),
            (remove(&[1], None), None),
        ],
    );
    assert_eq!(f.events.as_slice(), &[remove(&[1], None)]);
    assert_eq!(
        f.outcomes,
        vec![
            outcome("removed", GroupClass::Unclassified, false),
            outcome("stored", GroupClass::Unclassified, false),
            outcome("removed", GroupClass::None, true),
        ]
    );
}

/// A remove before its group's first store in the same batch is judged before it; one after,
/// with it.
#[test]
fn stores_teach_the_removes_after_them() {
    let mut groups = RankGroups::default();
    run(&mut groups, vec![(store(&[9], Some(0)), FULL)]);
    let f = run(
        &mut groups,
        vec![
            (remove(&[1], Some(1)), None),
            (store(&[2], Some(1)), SLIDING),
            (remove(&[2], Some(1)), None),
        ],
    );
    assert!(f.events.is_empty());
    assert_eq!(f.outcomes[0].class, GroupClass::Unclassified);
    assert_eq!(
        f.outcomes[2].class,
        GroupClass::Kind(SpecKind::SlidingWindow)
    );
}

/// A model with sliding-window attention on every layer: nothing can confirm a prefix, the rank
/// is approximate, and its AllBlocksCleared clears it without reaching the core as an event.
#[test]
fn a_rank_without_a_full_attention_group_is_approximate_and_clears_without_events() {
    let mut groups = RankGroups::default();
    assert_eq!(groups.mode(), Mode::Events, "nothing announced yet");
    let f = run(
        &mut groups,
        vec![
            (store(&[1, 2], Some(0)), SLIDING),
            (KvEvent::AllBlocksCleared, None),
        ],
    );
    assert!(f.events.is_empty());
    assert!(f.clear_rank);
    assert_eq!(groups.mode(), Mode::Approximate);

    // A rank with a full-attention group applies its clears as events.
    let mut hybrid = RankGroups::default();
    let f = run(
        &mut hybrid,
        vec![
            (store(&[1], Some(0)), FULL),
            (store(&[1], Some(1)), SLIDING),
            (KvEvent::AllBlocksCleared, None),
        ],
    );
    assert!(!f.clear_rank);
    assert_eq!(
        f.events.as_slice(),
        &[store(&[1], Some(0)), KvEvent::AllBlocksCleared]
    );
}

/// A restart forgets the groups: the new run's are learnt again (another model may be served).
#[test]
fn reset_forgets_the_groups() {
    let mut groups = RankGroups::default();
    run(&mut groups, vec![(store(&[1], Some(0)), SLIDING)]);
    assert_eq!(groups.mode(), Mode::Approximate);
    groups.reset();
    assert_eq!(groups.mode(), Mode::Events);
    let f = run(&mut groups, vec![(remove(&[1], Some(0)), None)]);
    assert_eq!(
        f.events.len(),
        1,
        "unclassified on a rank that announced nothing"
    );
    let f = run(&mut groups, vec![(store(&[1], Some(0)), FULL)]);
    assert_eq!(
        f.events.len(),
        1,
        "group 0 is full attention in the new run"
    );
    assert_eq!(groups.mode(), Mode::Events);
}

/// At most MAX_GROUPS groups are learnt: the next one stays unclassified (its removes drop), its
/// stores are judged by their own announcement.
#[test]
fn groups_past_the_limit_are_not_learnt() {
    let mut groups = RankGroups::default();
    let events = (0..MAX_GROUPS as u32)
        .map(|g| (store(&[u64::from(g)], Some(g)), FULL))
        .collect();
    run(&mut groups, events);
    assert_eq!(groups.kinds().len(), MAX_GROUPS);
    let over = MAX_GROUPS as u32;
    let f = run(
        &mut groups,
        vec![
            (store(&[100], Some(over)), FULL),
            (remove(&[100], Some(over)), None),
            (remove(&[0], Some(0)), None),
        ],
    );
    assert_eq!(groups.kinds().len(), MAX_GROUPS);
    assert_eq!(
        f.events.as_slice(),
        &[store(&[100], Some(over)), remove(&[0], Some(0))]
    );
    assert_eq!(f.outcomes[1].class, GroupClass::Unclassified);
}

macro_rules! fixture {
    ($name:literal) => {
        include_bytes!(concat!("../../../tests/fixtures/kv_events/hybrid/", $name)).as_slice()
    };
}

fn spec(event: usize, kind: SpecKind, sliding_window: Option<u32>) -> GroupSpec {
    GroupSpec {
        event,
        kind,
        sliding_window,
    }
}

/// (block hashes, token count) of a store.
fn shape(event: &KvEvent) -> (Vec<u64>, usize) {
    match event {
        KvEvent::BlockStored {
            block_hashes,
            token_ids,
            ..
        } => (block_hashes.clone(), token_ids.len()),
        other => panic!("not a store: {other:?}"),
    }
}

/// vLLM 0.32's own structs and encoder (make_fixtures.py): full-attention, sliding-window and
/// Mamba groups of one step, then evictions of three groups.
#[test]
fn vllm_hybrid_step_admits_only_the_full_attention_group() {
    let b = crate::sources::events::decode::decode_batch(fixture!("hybrid.msgpack")).unwrap();
    assert_eq!(
        b.group_specs,
        vec![
            spec(0, SpecKind::FullAttention, None),
            spec(1, SpecKind::SlidingWindow, Some(32)),
            spec(2, SpecKind::Mamba, None),
        ]
    );
    assert_eq!(shape(&b.events[0]), (vec![0xA1, 0xA2, 0xA3, 0xA4], 64));
    // Null blocks are left out of block_hashes, not out of token_ids: kept tokenless.
    assert_eq!(shape(&b.events[1]), (vec![0xA3, 0xA4], 0));
    assert_eq!(shape(&b.events[2]), (vec![0xA4], 0));
    let mut groups = RankGroups::default();
    let f = groups.filter(&b);
    assert_eq!(
        f.events.as_ref(),
        &[b.events[0].clone(), b.events[4].clone()]
    );
    let got: Vec<(&str, &str, bool)> = f
        .outcomes
        .iter()
        .map(|o| (o.event, o.class.label(), o.admitted))
        .collect();
    assert_eq!(
        got,
        vec![
            ("stored", "full_attention", true),
            ("stored", "sliding_window", false),
            ("stored", "mamba", false),
            ("removed", "sliding_window", false),
            ("removed", "full_attention", true),
            ("removed", "unclassified", false),
        ]
    );
}

#[test]
fn vllm_sliding_only_model_is_approximate() {
    let b = crate::sources::events::decode::decode_batch(fixture!("sliding_only.msgpack")).unwrap();
    let mut groups = RankGroups::default();
    let f = groups.filter(&b);
    assert!(f.events.is_empty(), "{:?}", f.events);
    assert!(f.clear_rank);
    assert_eq!(groups.mode(), Mode::Approximate);
}

/// Payloads a real vLLM 0.32 (CPU) published for a Llama with sliding-window attention (64
/// tokens) on alternate layers, block size 32: group 0 sliding window, group 1 full attention.
/// The sliding-window store names 2 blocks for its 2,016 tokens, which the strict token check
/// rejected (the whole batch was a decode error before: no hybrid model's stores applied).
#[test]
fn recorded_vllm_hybrid_payloads_decode_and_keep_the_full_attention_group() {
    let store =
        crate::sources::events::decode::decode_batch(fixture!("recorded_store.msgpack")).unwrap();
    assert_eq!(
        store.group_specs,
        vec![
            spec(0, SpecKind::SlidingWindow, Some(64)),
            spec(1, SpecKind::FullAttention, None),
        ]
    );
    let (sliding, tokens) = shape(&store.events[0]);
    assert_eq!((sliding.len(), tokens), (2, 0));
    let (full, tokens) = shape(&store.events[1]);
    assert_eq!((full.len(), tokens), (63, 63 * 32));
    assert_eq!(
        &full[61..],
        sliding.as_slice(),
        "the same hashes in both groups"
    );
    let mut groups = RankGroups::default();
    let f = groups.filter(&store);
    assert_eq!(f.events.as_ref(), &store.events[1..]);

    let evict =
        crate::sources::events::decode::decode_batch(fixture!("recorded_evict.msgpack")).unwrap();
    let f = groups.filter(&evict);
    let count = |event: &str, kind: SpecKind, admitted: bool| {
        f.outcomes
            .iter()
            .filter(|o| {
                o.event == event && o.class == GroupClass::Kind(kind) && o.admitted == admitted
            })
            .count()
    };
    assert_eq!(count("removed", SpecKind::SlidingWindow, false), 2);
    assert_eq!(count("removed", SpecKind::FullAttention, true), 63);
    assert_eq!(count("stored", SpecKind::SlidingWindow, false), 1);
    assert_eq!(count("stored", SpecKind::FullAttention, true), 1);
    assert_eq!(f.events.len(), 64);
}
