use super::families::{Context, Sampler};
use super::*;
use crate::replay::trace::{self, MOONCAKE_BLOCK};
use crate::replay::{self, policy};
use crate::sim::engine::EngineConfig;

fn stats_of(family: Family, seed: u64, requests: usize) -> stats::Stats {
    let w = generate(family, seed, requests, family.default_rate()).unwrap();
    stats::compute(family.name(), &w.records, &w.groups)
}

fn within(name: &str, v: f64, lo: f64, hi: f64) {
    assert!((lo..=hi).contains(&v), "{name} = {v}, expected {lo}..={hi}");
}

#[test]
fn same_seed_gives_byte_identical_jsonl_and_another_seed_does_not() {
    for family in Family::ALL {
        let a = to_jsonl(
            &generate(family, 7, 300, family.default_rate())
                .unwrap()
                .records,
        )
        .unwrap();
        let b = to_jsonl(
            &generate(family, 7, 300, family.default_rate())
                .unwrap()
                .records,
        )
        .unwrap();
        let c = to_jsonl(
            &generate(family, 8, 300, family.default_rate())
                .unwrap()
                .records,
        )
        .unwrap();
        assert_eq!(a, b, "{}", family.name());
        assert_ne!(a, c, "{}", family.name());
    }
}

#[test]
fn written_traces_parse_and_replay_to_completion() {
    for family in Family::ALL {
        let w = generate(family, 3, 60, family.default_rate()).unwrap();
        let text = String::from_utf8(to_jsonl(&w.records).unwrap()).unwrap();
        let parsed = trace::parse(&text).unwrap();
        assert_eq!(parsed, w.records, "{}", family.name());
        assert_eq!(parsed.len(), 60);
        assert_eq!(parsed[0].timestamp, 0);
        assert!(parsed.windows(2).all(|p| p[0].timestamp <= p[1].timestamp));
        let requests = replay::prepare(&parsed, 1.0);
        let reports = replay::run_policies(
            &requests,
            &["kvpick".to_string(), "round-robin".to_string()],
            4,
            &EngineConfig::default(),
            &policy::PolicyOptions::new(16, 1),
        )
        .unwrap();
        for p in reports {
            assert_eq!(p.completed, 60, "{} {}", family.name(), p.policy);
        }
    }
}

#[test]
fn chat_statistics_are_in_range() {
    let s = stats_of(Family::Chat, 1, 4_000);
    within("input mean", s.input_tokens.mean, 3_000.0, 12_000.0);
    within("output mean", s.output_tokens.mean, 200.0, 500.0);
    within("reuse fraction", s.reuse_fraction, 0.3, 0.9);
    // Reused context comes back after a think time (10–120 s) plus the answer.
    within("reuse gap p50", s.reuse_gap_s.p50, 10.0, 125.0);
    within("group size max", s.group_size.max, 2.0, 20.0);
    within("offered load", s.offered_load_8_ranks, 0.6, 0.9);
}

#[test]
fn chat_turns_extend_the_whole_previous_context_after_a_think_time() {
    let w = generate(Family::Chat, 2, 2_000, Family::Chat.default_rate()).unwrap();
    let mut last: std::collections::HashMap<u64, &trace::TraceRecord> = Default::default();
    let mut follow_ups = 0;
    for (r, g) in w.records.iter().zip(&w.groups) {
        if let Some(prev) = last.insert(*g, r) {
            follow_ups += 1;
            assert!(r.hash_ids.starts_with(&prev.hash_ids));
            assert!(r.input_length > prev.input_length + prev.output_length as usize);
            assert!(r.timestamp - prev.timestamp >= 10_000);
        }
    }
    assert!(follow_ups > 200, "{follow_ups}");
}

#[test]
fn agentic_statistics_are_in_range() {
    let s = stats_of(Family::Agentic, 1, 3_000);
    within("input mean", s.input_tokens.mean, 8_000.0, 30_000.0);
    within(
        "input p50 above the smallest prefix",
        s.input_tokens.p50,
        4_096.0,
        30_000.0,
    );
    within("output mean", s.output_tokens.mean, 80.0, 300.0);
    within("reuse fraction", s.reuse_fraction, 0.8, 1.0);
    within("reuse gap p50", s.reuse_gap_s.p50, 0.2, 10.0);
    within("group size mean", s.group_size.mean, 5.0, 60.0);
    within("offered load", s.offered_load_8_ranks, 0.6, 0.9);
}

#[test]
fn subagents_branch_off_the_parent_history() {
    // Some request shares a long prefix with an earlier one of its session without extending it:
    // a sub-agent's first call (or the parent after it branched).
    let w = generate(Family::Agentic, 4, 3_000, Family::Agentic.default_rate()).unwrap();
    let mut by_group: std::collections::HashMap<u64, Vec<&trace::TraceRecord>> = Default::default();
    for (r, g) in w.records.iter().zip(&w.groups) {
        by_group.entry(*g).or_default().push(r);
    }
    let branches = by_group
        .values()
        .flat_map(|rs| {
            rs.iter().enumerate().filter(move |(i, r)| {
                rs[..*i].iter().any(|p| {
                    let common = p
                        .hash_ids
                        .iter()
                        .zip(&r.hash_ids)
                        .take_while(|(a, b)| a == b)
                        .count();
                    common >= 8 && common < p.hash_ids.len().min(r.hash_ids.len()) - 1
                })
            })
        })
        .count();
    assert!(branches > 20, "{branches}");
}

#[test]
fn shared_docs_statistics_are_in_range() {
    let s = stats_of(Family::SharedDocs, 1, 3_000);
    within("input mean", s.input_tokens.mean, 3_000.0, 9_000.0);
    within("reuse fraction", s.reuse_fraction, 0.6, 0.95);
    within("documents", s.groups as f64, 200.0, 400.0);
    // Zipf popularity: the hottest document is asked about far more than the median one.
    assert!(
        s.group_size.max > 20.0 * s.group_size.p50,
        "{:?}",
        s.group_size
    );
    within("offered load", s.offered_load_8_ranks, 0.6, 0.9);
}

#[test]
fn small_families_statistics_are_in_range() {
    let s = stats_of(Family::SmallFamilies, 1, 3_500);
    assert!(s.groups >= 2_000, "{}", s.groups);
    within("input mean", s.input_tokens.mean, 12_000.0, 15_000.0);
    within("input p90", s.input_tokens.p90, 27_000.0, 39_000.0);
    within("group size mean", s.group_size.mean, 1.2, 3.0);
    within("group size max", s.group_size.max, 3.0, 8.0);
    within("reuse gap p50", s.reuse_gap_s.p50, 10.0, 600.0);
    within("reuse fraction", s.reuse_fraction, 0.2, 0.6);
    within("offered load", s.offered_load_8_ranks, 0.6, 0.9);
}

#[test]
fn no_reuse_prompts_share_nothing() {
    let s = stats_of(Family::NoReuse, 1, 2_000);
    assert_eq!(s.reuse_fraction, 0.0);
    assert_eq!(s.groups, 2_000);
    within("input mean", s.input_tokens.mean, 1_500.0, 5_000.0);
    within("offered load", s.offered_load_8_ranks, 0.6, 0.9);
}

#[test]
fn context_fills_its_partial_block_and_a_branch_gets_its_own() {
    let mut s = Sampler::new(1);
    let shared = s.fresh_ids(2);
    let mut ctx = Context::from_blocks(&shared);
    ctx.append(100, &mut s);
    let before = ctx.request(0.0, 1, 0);
    assert_eq!(before.hash_ids.len(), 3);
    ctx.append(MOONCAKE_BLOCK, &mut s);
    let after = ctx.request(0.0, 1, 0);
    assert_eq!(
        after.input_length,
        2 * MOONCAKE_BLOCK + 100 + MOONCAKE_BLOCK
    );
    assert_eq!(after.hash_ids[..3], before.hash_ids[..]);
    assert_eq!(after.hash_ids.len(), 4);
    let child = ctx.branch(&mut s).request(0.0, 1, 0);
    assert_eq!(child.hash_ids[..3], after.hash_ids[..3]);
    assert_ne!(child.hash_ids[3], after.hash_ids[3]);
}

#[test]
fn bad_arguments_are_errors() {
    assert!(generate(Family::Chat, 1, 0, 1.0).is_err());
    assert!(generate(Family::Chat, 1, 10, 0.0).is_err());
    assert!(generate(Family::Chat, 1, 10, f64::NAN).is_err());
}

#[test]
fn the_rate_sets_the_request_rate() {
    let slow = stats_of(Family::NoReuse, 1, 2_000);
    let w = generate(
        Family::NoReuse,
        1,
        2_000,
        2.0 * Family::NoReuse.default_rate(),
    )
    .unwrap();
    let fast = stats::compute("no-reuse", &w.records, &w.groups);
    within(
        "rate ratio",
        fast.request_rate / slow.request_rate,
        1.8,
        2.2,
    );
}

/// `agent-tree` is `agentic` with session columns: the same requests, every one naming its
/// agent session, each sub-agent's naming the root as parent, and a sub-agent's first prompt
/// starting with its parent's last prompt (all but that prompt's partial last block).
#[test]
fn agent_tree_is_agentic_with_sessions_and_parents() {
    let rate = Family::Agentic.default_rate();
    let tree = generate(Family::AgentTree, 4, 3_000, rate).unwrap();
    let plain = generate(Family::Agentic, 4, 3_000, rate).unwrap();
    assert_eq!(tree.records.len(), plain.records.len());
    let mut last_of: std::collections::HashMap<&str, &trace::TraceRecord> = Default::default();
    let (mut children, mut checked) = (0, 0);
    for (t, p) in tree.records.iter().zip(&plain.records) {
        assert_eq!(
            (t.timestamp, &t.hash_ids, p.session.session_id.as_deref()),
            (p.timestamp, &p.hash_ids, None)
        );
        let sid = t.session.session_id.as_deref().unwrap();
        match t.session.parent_session_id.as_deref() {
            None => assert!(!sid.contains('.'), "{sid}"),
            Some(parent) => {
                assert_eq!(sid.split_once('.').map(|(root, _)| root), Some(parent));
                children += 1;
                let first = !last_of.contains_key(sid);
                if let Some(prev) = last_of.get(parent).filter(|_| first) {
                    let whole = prev.hash_ids.len() - 1;
                    assert_eq!(t.hash_ids[..whole], prev.hash_ids[..whole], "{sid}");
                    checked += 1;
                }
            }
        }
        last_of.insert(sid, t);
    }
    assert!(children > 300 && checked > 20, "{children} {checked}");
}
