//! The gateway's endpoint scores (`SelectionRequest::scores`, issue 46): the decision's own costs,
//! the destinations first, one per address, bounded, and nothing when not asked.

use std::collections::{HashMap, HashSet};
use std::time::Instant;

use super::*;
use crate::catalog::RankLayout;
use crate::request::{PromptInput, MAX_ENDPOINT_SCORES};

fn core_of(specs: Vec<WorkerSpec>) -> Core {
    let core = Core::new(CoreConfig::default());
    core.apply_source_snapshot("catalog", specs, Instant::now())
        .unwrap();
    core
}

/// `n` single-rank workers, each on its own port.
fn fleet(n: u16) -> Core {
    core_of(
        (1..=n)
            .map(|p| WorkerSpec::for_test(&format!("w{p}"), "m", RankLayout::PerPort(vec![p])))
            .collect(),
    )
}

fn request(id: &str, tokens: u32, scores: usize, fallbacks: usize) -> SelectionRequest {
    SelectionRequest {
        request_id: id.into(),
        model: Some("m".into()),
        prompt: PromptInput::Tokens((0..tokens).collect()),
        fallbacks,
        scores,
        on_duplicate: DuplicateId::Suffix,
        ..Default::default()
    }
}

/// Books requests of different sizes so the ranks' costs differ.
fn load(core: &Core, n: u32, now: Instant) {
    for i in 0..n {
        core.select_and_reserve(&request(&format!("load{i}"), 64 * (i + 1), 0, 0), now)
            .unwrap();
    }
}

#[test]
fn n_plus_one_candidates_give_exactly_n_scores_destinations_first_then_by_cost() {
    let core = fleet(5);
    let now = Instant::now();
    load(&core, 4, now);
    // The same decision with room for all five, as a dry run first (nothing booked): it shows
    // the cost of the one the bounded answer leaves out.
    let (all, _) = core.select(&request("dry", 256, 5, 1), now).unwrap();
    let (s, _) = core
        .select_and_reserve(&request("scored", 256, 4, 1), now)
        .unwrap();
    assert_eq!(s.candidates, 5);
    assert_eq!(s.scores.len(), 4, "{:?}", s.scores);
    // The destinations first, with the decision's own cost.
    assert_eq!(s.scores[0].rank, s.primary.key);
    assert_eq!(s.scores[0].endpoint, s.primary.endpoint);
    assert_eq!(
        s.scores[0].cost, s.cost,
        "the primary's score is its decision cost"
    );
    assert_eq!(s.scores[1].rank, s.fallbacks[0].key);
    // The others best first, every address once, scores 1 / (1 + cost) in (0, 1].
    assert!(s.scores[2].cost <= s.scores[3].cost, "{:?}", s.scores);
    let addresses: HashSet<_> = s.scores.iter().map(|e| e.endpoint).collect();
    assert_eq!(addresses.len(), 4);
    for e in &s.scores {
        assert_eq!(e.score(), 1.0 / (1.0 + e.cost));
        assert!(e.score() > 0.0 && e.score() <= 1.0);
    }
    // The one left out costs no less than any non-destination listed.
    assert_eq!(all.scores.len(), 5);
    let listed: HashSet<_> = s.scores.iter().map(|e| e.rank).collect();
    let left_out = all
        .scores
        .iter()
        .find(|e| !listed.contains(&e.rank))
        .unwrap();
    assert!(
        s.scores[2..].iter().all(|e| e.cost <= left_out.cost),
        "{all:?}"
    );
    let costs: HashMap<_, _> = all.scores.iter().map(|e| (e.rank, e.cost)).collect();
    for e in &s.scores {
        assert_eq!(costs[&e.rank], e.cost, "the same decision's cost");
    }
}

#[test]
fn no_scores_unless_asked_and_nothing_allocated() {
    let core = fleet(3);
    let now = Instant::now();
    let (s, _) = core
        .select_and_reserve(&request("plain", 64, 0, 1), now)
        .unwrap();
    assert!(s.scores.is_empty());
    assert_eq!(s.scores.capacity(), 0, "no allocation when scores are off");
}

#[test]
fn a_bound_smaller_than_the_destinations_keeps_the_primary() {
    let core = fleet(3);
    let (s, _) = core
        .select_and_reserve(&request("one", 64, 1, 2), Instant::now())
        .unwrap();
    assert_eq!(s.fallbacks.len(), 2);
    assert_eq!(s.scores.len(), 1);
    assert_eq!(s.scores[0].rank, s.primary.key);
}

/// Ranks of a multiplexed data-parallel engine share one address: it is scored once, by the
/// picked rank when it is the destination.
#[test]
fn a_multiplexed_engine_is_one_address() {
    let core = core_of(vec![
        WorkerSpec::for_test("dp", "m", RankLayout::Multiplexed { port: 9, size: 2 }),
        WorkerSpec::for_test("solo", "m", RankLayout::PerPort(vec![10])),
    ]);
    let now = Instant::now();
    let (s, _) = core
        .select_and_reserve(&request("mux", 128, 16, 0), now)
        .unwrap();
    assert_eq!(s.candidates, 3);
    assert_eq!(s.scores.len(), 2, "two addresses: {:?}", s.scores);
    assert_eq!(s.scores[0].rank, s.primary.key);
    assert_ne!(s.scores[0].endpoint, s.scores[1].endpoint);
}

#[test]
fn more_scores_than_the_cap_is_a_bad_request() {
    let core = fleet(1);
    let now = Instant::now();
    assert!(core
        .select(&request("cap", 64, MAX_ENDPOINT_SCORES, 0), now)
        .is_ok());
    let err = core
        .select(&request("over", 64, MAX_ENDPOINT_SCORES + 1, 0), now)
        .unwrap_err();
    assert!(
        matches!(&err, SelectError::BadRequest(m) if m.contains("endpoint scores")),
        "{err:?}"
    );
}

/// The bounded search costs only a few ranks of a large idle fleet; asked for N scores it costs
/// at least the best N (its exact top grows to N), so the answer still carries N.
#[test]
fn the_bounded_search_costs_the_best_n_when_n_are_asked() {
    let core = fleet(40);
    let now = Instant::now();
    let (plain, _) = core.select(&request("plain", 64, 0, 0), now).unwrap();
    assert!(
        plain.candidates < 40,
        "the bounded search answered: {}",
        plain.candidates
    );
    let (s, _) = core.select(&request("scored", 64, 16, 0), now).unwrap();
    assert!(s.candidates >= 16 && s.candidates < 40, "{}", s.candidates);
    assert_eq!(s.scores.len(), 16);
}
