//! KV transfer hints through the core (`--kv-transfer-hints`): a booked pick that holds less of
//! the prefix than another rank names the least-loaded holder of the longest prefix; never with
//! the flag off, never on a query-only selection, never when the pick is a holder.

use std::time::Instant;

use super::fixtures::{evented_worker as spec, rank_of, BS};
use super::*;
use crate::event::KvEvent;
use crate::request::Pin;

/// Eight blocks of its own, one token more so all eight are reusable.
fn prompt() -> Vec<u32> {
    fixtures::whole_blocks(50_000, 8)
}

fn request(id: &str, tokens: Vec<u32>) -> SelectionRequest {
    fixtures::token_request(id, tokens)
}

fn store(tokens: &[u32]) -> KvEvent {
    fixtures::gpu_store(tokens, BS, 700)
}

/// Books `blocks` blocks of prefill on `rank` (pinned), so it is busy.
fn queue_on(core: &Core, id: &str, rank: RankKey, blocks: u32, now: Instant) {
    let mut r = request(
        id,
        (900_000 + blocks * 1000..)
            .take((blocks * BS) as usize)
            .collect(),
    );
    r.pin = Some(Pin {
        worker_id: rank.worker_id,
        dp_rank: Some(0),
    });
    let (s, _) = core.select_and_reserve(&r, now).unwrap();
    assert_eq!(s.primary.key, rank);
}

/// `a` and `b` hold the prompt, busy with 20 and 10 blocks of queued prefill; `c` is idle.
fn busy_holders(hints: bool) -> (Core, [RankKey; 3], Instant) {
    let core = Core::new(CoreConfig {
        kv_events: true,
        allow_pins: true,
        seed: Some(1),
        kv_transfer_hints: hints,
        ..CoreConfig::default()
    });
    let specs = [spec("a", 1), spec("b", 2), spec("c", 3)];
    let t0 = Instant::now();
    core.apply_source_snapshot("catalog", specs.to_vec(), t0)
        .unwrap();
    let keys = specs.each_ref().map(rank_of);
    for k in keys {
        core.apply_kv_events(k, &[KvEvent::AllBlocksCleared], None, t0);
    }
    for k in &keys[..2] {
        core.apply_kv_events(*k, &[store(&prompt())], None, t0);
    }
    queue_on(&core, "qa", keys[0], 20, t0);
    queue_on(&core, "qb", keys[1], 10, t0);
    (core, keys, t0)
}

fn hint_facts(facts: &Facts) -> usize {
    facts
        .iter()
        .filter(|f| matches!(f, Fact::TransferHint))
        .count()
}

#[test]
fn a_pick_away_from_busy_holders_names_the_least_loaded_holder() {
    let (core, [_, b, c], t0) = busy_holders(true);
    let (s, facts) = core
        .select_and_reserve(&request("r", prompt()), t0)
        .unwrap();
    assert_eq!(
        s.primary.key, c,
        "the idle rank wins over both busy holders"
    );
    let hint = s.transfer.expect("a hint");
    assert_eq!(hint.source.key, b, "b has less queued than a");
    assert_eq!((hint.blocks, hint.gain), (8, 8));
    assert_eq!(hint_facts(&facts), 1);
}

#[test]
fn no_hint_with_the_flag_off() {
    let (core, [_, _, c], t0) = busy_holders(false);
    let (s, facts) = core
        .select_and_reserve(&request("r", prompt()), t0)
        .unwrap();
    assert_eq!((s.primary.key, s.transfer), (c, None));
    assert_eq!(hint_facts(&facts), 0);
}

#[test]
fn a_query_only_selection_never_carries_a_hint() {
    let (core, [_, _, c], t0) = busy_holders(true);
    let (s, facts) = core.select(&request("q", prompt()), t0).unwrap();
    assert_eq!((s.primary.key, s.transfer), (c, None));
    assert_eq!(hint_facts(&facts), 0);
}

#[test]
fn a_pick_that_holds_the_prefix_gets_no_hint() {
    let (core, [a, b, c], t0) = busy_holders(true);
    // `c` fills up past the holders: now `b` (a holder) wins.
    queue_on(&core, "qc", c, 40, t0);
    let (s, _) = core
        .select_and_reserve(&request("r", prompt()), t0)
        .unwrap();
    assert_eq!((s.primary.key, s.transfer), (b, None));
    let _ = a;
}
