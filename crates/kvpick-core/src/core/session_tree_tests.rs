//! Session trees (docs/sessions.md): a child session's first pick prefers its parent's bound
//! rank within the soft-affinity bounds, and a session's final request releases its binding.

use std::time::Instant;

use super::registry_tests::core_with;
use super::*;
use crate::request::PromptInput;
use crate::session::{Invalidation, ParentPick, SessionOutcome};

fn request(id: &str, session: Option<&str>, prompt: u32) -> SelectionRequest {
    SelectionRequest {
        request_id: id.into(),
        model: Some("m".into()),
        prompt: PromptInput::Tokens(vec![prompt; 64]),
        session_id: session.map(Into::into),
        holder: Holder::Stream,
        on_duplicate: DuplicateId::Suffix,
        ..Default::default()
    }
}

fn child(id: &str, parent: &str) -> SelectionRequest {
    SelectionRequest {
        parent_session_id: Some(parent.into()),
        ..request(id, Some(id), 900)
    }
}

fn rank_of(core: &Core, name: &str) -> RankKey {
    let record = core
        .records()
        .into_iter()
        .find(|r| r.spec.name == name)
        .unwrap();
    RankKey {
        worker_id: record.id,
        dp_rank: 0,
    }
}

/// The parent session "p" bound to rank `a`, which also carries `load` in-flight requests of
/// other prompts, so that rank `b` is the cheaper pick for anything new.
fn parent_on_loaded_a(config: CoreConfig, load: u32) -> (Core, RankKey, RankKey) {
    let core = core_with(config);
    let now = Instant::now();
    let (a, b) = (rank_of(&core, "a"), rank_of(&core, "b"));
    let (key, _, _) = core.session_binding(Some("m"), "", "p", now).unwrap();
    assert!(core.install_session_binding(&key, "p", a, now).0.is_yes());
    for i in 0..load {
        let (s, _) = core
            .select_and_reserve(&request(&format!("p{i}"), Some("p"), i + 1), now)
            .unwrap();
        assert_eq!(s.primary.key, a);
    }
    (core, a, b)
}

fn parent_fact(facts: &Facts) -> Option<ParentPick> {
    facts.iter().find_map(|f| match f {
        Fact::SessionParent(parent) => Some(*parent),
        _ => None,
    })
}

#[test]
fn a_child_prefers_its_parents_rank_within_the_soft_margin() {
    let (core, a, b) = parent_on_loaded_a(CoreConfig::default(), 2);
    let now = Instant::now();
    // Without a parent the new session goes to the idle rank.
    let (alone, facts) = core
        .select_and_reserve(&request("alone", Some("alone"), 900), now)
        .unwrap();
    assert_eq!(alone.primary.key, b);
    assert_eq!(parent_fact(&facts), None);
    // With one it joins the parent, and then binds there as usual.
    let (first, facts) = core.select_and_reserve(&child("c1", "p"), now).unwrap();
    assert_eq!(first.primary.key, a);
    assert_eq!(first.session, Some(SessionOutcome::Created));
    assert_eq!(parent_fact(&facts), Some(ParentPick::Preferred));
    assert_eq!(
        core.session_binding(Some("m"), "", "c1", now).unwrap().1,
        Some(a)
    );
    // Its later requests follow its own binding (no parent step), the parent's is unchanged.
    let (again, facts) = core.select_and_reserve(&child("c1", "p"), now).unwrap();
    assert_eq!(
        (again.primary.key, again.session),
        (a, Some(SessionOutcome::Reused))
    );
    assert_eq!(parent_fact(&facts), None);
    assert_eq!(
        core.session_binding(Some("m"), "", "p", now).unwrap().1,
        Some(a)
    );
    // A child whose prompt the parent's rank caches goes there on cost alone.
    let tokens: Vec<u32> = (1_000..3_048).collect();
    let hashes =
        crate::hash::prompt_hashes(&tokens, DEFAULT_BLOCK_SIZE as usize, crate::hash::BASE_SEED);
    let partition = PartitionKey {
        model: "m".into(),
        routing_group: String::new(),
    };
    core.insert_blocks(&partition, a, &hashes, crate::index::Tier::Gpu, None, now);
    let cached = SelectionRequest {
        prompt: PromptInput::Tokens(tokens),
        ..child("c4", "p")
    };
    let (s, facts) = core.select_and_reserve(&cached, now).unwrap();
    assert_eq!(
        (s.primary.key, parent_fact(&facts)),
        (a, Some(ParentPick::Cheapest))
    );
    // A parent without a binding, or naming the child itself, is no preference.
    for (id, parent) in [("c2", "unknown"), ("c3", "c3")] {
        let (s, facts) = core.select_and_reserve(&child(id, parent), now).unwrap();
        assert_eq!(s.primary.key, b, "{id}");
        assert_eq!(parent_fact(&facts), None, "{id}");
    }
}

#[test]
fn a_child_does_not_follow_a_parent_rank_costlier_than_the_margin() {
    let mut config = CoreConfig::default();
    config.sessions.soft_margin_blocks = 0.5;
    let (core, _, b) = parent_on_loaded_a(config, 2);
    let (s, facts) = core
        .select_and_reserve(&child("c1", "p"), Instant::now())
        .unwrap();
    assert_eq!(s.primary.key, b);
    assert_eq!(s.session, Some(SessionOutcome::Created));
    assert_eq!(parent_fact(&facts), Some(ParentPick::Declined));
}

/// A parent rank over a busy threshold is no candidate: the child goes elsewhere, where a
/// hard-bound request of the parent itself would be refused (the preference is soft even when
/// affinity is hard).
#[test]
fn a_child_does_not_follow_an_overloaded_parent_rank() {
    let mut config = CoreConfig::default();
    config.busy.active_prefill_tokens = Some(128);
    let (core, _, b) = parent_on_loaded_a(config, 2);
    let now = Instant::now();
    let refused = core.select_and_reserve(&request("p-next", Some("p"), 50), now);
    assert!(
        matches!(refused, Err(SelectError::Overloaded(_))),
        "{refused:?}"
    );
    let (s, facts) = core.select_and_reserve(&child("c1", "p"), now).unwrap();
    assert_eq!(s.primary.key, b);
    assert_eq!(parent_fact(&facts), Some(ParentPick::Declined));
}

#[test]
fn a_final_request_is_routed_on_the_binding_then_releases_it() {
    let (core, a, b) = parent_on_loaded_a(CoreConfig::default(), 2);
    let now = Instant::now();
    let last = SelectionRequest {
        session_final: true,
        ..request("p-final", Some("p"), 77)
    };
    let (s, facts) = core.select_and_reserve(&last, now).unwrap();
    assert_eq!(s.primary.key, a, "routed on the binding");
    assert_eq!(s.session, Some(SessionOutcome::Released));
    assert!(facts.iter().any(|f| matches!(f, Fact::SessionsLive(-1))));
    assert!(facts
        .iter()
        .any(|f| matches!(f, Fact::SessionInvalidated(Invalidation::Final))));
    assert_eq!(
        core.session_binding(Some("m"), "", "p", now).unwrap().1,
        None
    );
    // The next request with that id is free to go anywhere (here: the idle rank) and binds anew.
    let (next, _) = core
        .select_and_reserve(&request("p-again", Some("p"), 78), now)
        .unwrap();
    assert_eq!(
        (next.primary.key, next.session),
        (b, Some(SessionOutcome::Created))
    );
    // A final request of a session with no binding creates none.
    let (s, facts) = core
        .select_and_reserve(
            &SelectionRequest {
                session_final: true,
                ..request("q-final", Some("q"), 79)
            },
            now,
        )
        .unwrap();
    assert_eq!(s.session, Some(SessionOutcome::Released));
    assert!(!facts.iter().any(|f| matches!(f, Fact::SessionsLive(_))));
    assert_eq!(
        core.session_binding(Some("m"), "", "q", now).unwrap().1,
        None
    );
}
