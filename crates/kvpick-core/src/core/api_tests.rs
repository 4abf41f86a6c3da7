//! The selection API's bounds in the core: precomputed hashes must describe their prompt, a rank
//! holds a bounded number of API bookings, and API bookings respect saturation.

use std::time::Instant;

use super::registry_tests::core_with;
use super::*;
use crate::flow::SaturationLimits;
use crate::request::PromptInput;

fn api_request(id: &str, prompt: PromptInput) -> SelectionRequest {
    SelectionRequest {
        request_id: id.into(),
        model: Some("m".into()),
        prompt,
        holder: Holder::Api,
        on_duplicate: DuplicateId::Reject,
        ..Default::default()
    }
}

fn hashes(n: usize, prompt_tokens: u64) -> PromptInput {
    PromptInput::BlockHashes {
        seq_hashes: (1..=n as u64).collect(),
        prompt_tokens,
    }
}

#[test]
fn block_hashes_must_agree_with_prompt_tokens_within_one_block() {
    let core = core_with(CoreConfig::default());
    let now = Instant::now();
    let bs = u64::from(DEFAULT_BLOCK_SIZE);
    // 4 hashes: complete blocks only (4·bs .. 5·bs−1 tokens) or the last one partial (3·bs+1 ..).
    for (i, tokens) in [3 * bs + 1, 4 * bs, 5 * bs - 1].into_iter().enumerate() {
        let r = api_request(&format!("ok{i}"), hashes(4, tokens));
        assert!(core.select_and_reserve(&r, now).is_ok(), "{tokens} tokens");
    }
    // Just over either side, and the attack: a few hashes declaring 2^32 tokens of load.
    for (i, tokens) in [3 * bs, 5 * bs, 1 << 32].into_iter().enumerate() {
        let r = api_request(&format!("bad{i}"), hashes(4, tokens));
        let err = core.select_and_reserve(&r, now).unwrap_err();
        assert!(
            matches!(&err, SelectError::BadRequest(m) if m.contains("does not match")),
            "{tokens}: {err:?}"
        );
        assert!(core.select(&r, now).is_err());
        assert!(core.overlap_scores(&r, now).is_err());
    }
}

#[test]
fn a_rank_takes_at_most_the_cap_of_api_bookings() {
    let core = core_with(CoreConfig {
        max_api_bookings_per_rank: 2,
        flow: crate::FlowConfig {
            enabled: false,
            ..Default::default()
        },
        ..CoreConfig::default()
    });
    let now = Instant::now();
    let mut per_rank: HashMap<RankKey, u32> = HashMap::new();
    for i in 0..4 {
        let r = api_request(&format!("r{i}"), PromptInput::Tokens(vec![1; 64]));
        let (s, _) = core.select_and_reserve(&r, now).unwrap();
        *per_rank.entry(s.primary.key).or_default() += 1;
    }
    assert!(per_rank.values().all(|&n| n == 2), "{per_rank:?}");
    // Just over: the fifth finds both ranks at the cap.
    let r = api_request("r4", PromptInput::Tokens(vec![1; 64]));
    let err = core.select_and_reserve(&r, now).unwrap_err();
    assert!(
        matches!(&err, SelectError::Overloaded(m) if m.contains("API bookings")),
        "{err:?}"
    );
    // Stream requests are not capped by it.
    let stream = SelectionRequest {
        holder: Holder::Stream,
        on_duplicate: DuplicateId::Suffix,
        ..r.clone()
    };
    assert!(core.select_and_reserve(&stream, now).is_ok());
    // A freed API booking makes room again.
    assert!(core.free("r0", Claim::HeldBy(Holder::Api), now).0);
    let again = api_request("r5", PromptInput::Tokens(vec![1; 64]));
    assert!(core.select_and_reserve(&again, now).is_ok());
}

#[test]
fn api_bookings_stop_at_saturation_while_flow_control_is_on() {
    let core = core_with(CoreConfig {
        flow: crate::FlowConfig {
            saturation: SaturationLimits {
                max_wait_seconds: None,
                max_active_requests: Some(1),
                engine_waiting: None,
                engine_kv_usage: None,
            },
            ..Default::default()
        },
        ..CoreConfig::default()
    });
    let now = Instant::now();
    for i in 0..2 {
        let r = api_request(&format!("r{i}"), PromptInput::Tokens(vec![1; 64]));
        assert!(core.select_and_reserve(&r, now).is_ok());
    }
    let r = api_request("r2", PromptInput::Tokens(vec![1; 64]));
    let err = core.select_and_reserve(&r, now).unwrap_err();
    assert!(
        matches!(&err, SelectError::Overloaded(m) if m.contains("saturated")),
        "{err:?}"
    );
    // A stream request arriving now waits for capacity rather than finding it taken.
    let stream = SelectionRequest {
        holder: Holder::Stream,
        on_duplicate: DuplicateId::Suffix,
        ..r
    };
    assert!(matches!(
        core.admit(&stream, now).0,
        Ok(Admission::Queued { .. })
    ));
}

fn flow_core(flow: crate::FlowConfig) -> Core {
    core_with(CoreConfig {
        flow: crate::FlowConfig {
            saturation: SaturationLimits {
                max_wait_seconds: None,
                max_active_requests: Some(1),
                engine_waiting: None,
                engine_kv_usage: None,
            },
            ..flow
        },
        ..CoreConfig::default()
    })
}

fn stream_request(id: &str, priority: i32) -> SelectionRequest {
    SelectionRequest {
        request_id: id.into(),
        model: Some("m".into()),
        prompt: PromptInput::Tokens(vec![1; 64]),
        priority,
        ..Default::default()
    }
}

/// `--queue-capacity` bounds every band together: with room left in each band, the arrival
/// just over the whole-queue cap is refused at once (503; 429 sheddable).
#[test]
fn the_whole_queue_is_capped_across_bands() {
    let core = flow_core(crate::FlowConfig {
        capacity: 3,
        ..Default::default()
    });
    let now = Instant::now();
    let mut held = Vec::new();
    for i in 0..2 {
        let (r, _) = core.admit(&stream_request(&format!("busy{i}"), 0), now);
        assert!(matches!(r, Ok(Admission::Dispatched(_))));
        held.push(r);
    }
    for (i, priority) in [5, 0, -1].into_iter().enumerate() {
        let (r, _) = core.admit(&stream_request(&format!("w{i}"), priority), now);
        assert!(matches!(r, Ok(Admission::Queued { .. })), "{r:?}");
    }
    assert_eq!(core.waiting_requests(), 3);
    let (r, facts) = core.admit(&stream_request("over", 7), now);
    let err = r.unwrap_err();
    assert!(
        matches!(&err, SelectError::Unavailable(m) if m.contains("the queue is full (3")),
        "{err:?}"
    );
    assert!(facts.iter().any(|f| matches!(
        f,
        Fact::Queue {
            event: crate::facts::QueueEvent::Left {
                exit: crate::facts::QueueExit::Full,
                ..
            },
            ..
        }
    )));
    let (r, _) = core.admit(&stream_request("shed", -3), now);
    assert_eq!(r.unwrap_err().label(), "overloaded");
    assert_eq!(
        core.waiting_requests(),
        3,
        "the refused left nothing queued"
    );
    assert_eq!(core.live_bookings(), 2, "nor any booking or claim");
}

/// A queued request keeps its block hashes, not its prompt, and is still bound to its session
/// when released (the request had a prompt).
#[test]
fn a_queued_request_keeps_no_prompt_and_still_binds_its_session() {
    let core = flow_core(crate::FlowConfig::default());
    let now = Instant::now();
    let (busy_a, _) = core.admit(&stream_request("busy-a", 0), now);
    let (busy_b, _) = core.admit(&stream_request("busy-b", 0), now);
    let busy_id = |r: &Result<Admission, SelectError>| match r {
        Ok(Admission::Dispatched(s)) => (s.booking_id.clone(), s.generation),
        other => panic!("{other:?}"),
    };
    let waiting = SelectionRequest {
        session_id: Some("s".into()),
        prompt: PromptInput::Text(vec![b'x'; 1 << 20]),
        ..stream_request("w", 0)
    };
    let (r, _) = core.admit(&waiting, now);
    let Ok(Admission::Queued { ticket, .. }) = r else {
        panic!("{r:?}");
    };
    let held = core
        .waiting
        .get(&ticket)
        .map(|p| Arc::clone(p.value()))
        .unwrap();
    let queued = held.queued(ticket).unwrap();
    assert_eq!(queued.request.prompt, PromptInput::None);
    assert!(queued.prompt.present);
    assert!(!queued.prompt.seq_hashes.is_empty());
    let (id, generation) = busy_id(&busy_a);
    let (_, facts) = core.free(&id, Claim::Generation(generation), now);
    let released = facts.iter().find_map(|f| match f {
        Fact::Dequeued { ticket: t, result } if *t == ticket => Some(result.clone()),
        _ => None,
    });
    let selection = released.unwrap().unwrap();
    assert_eq!(
        selection.session,
        Some(crate::session::SessionOutcome::Created)
    );
    drop(busy_b);
}

/// Operations that free nothing run no release pass over a waiting queue.
#[test]
fn nothing_freed_runs_no_release_pass() {
    let core = flow_core(crate::FlowConfig::default());
    let now = Instant::now();
    let mut ids = Vec::new();
    for i in 0..2 {
        if let (Ok(Admission::Dispatched(s)), _) =
            core.admit(&stream_request(&format!("busy{i}"), 0), now)
        {
            ids.push((s.booking_id.clone(), s.generation));
        }
    }
    assert!(matches!(
        core.admit(&stream_request("w", 0), now).0,
        Ok(Admission::Queued { .. })
    ));
    let (id, generation) = ids[0].clone();
    let claim = Claim::Generation(generation);
    assert!(core.mark_prefill_complete(&id, claim, now).0);
    let passes = core.release_passes();
    assert!(passes >= 1, "a first token frees prefill load: a pass");
    assert!(
        core.mark_prefill_complete(&id, claim, now).0,
        "found, again"
    );
    assert!(!core.free("nobody", Claim::Any, now).0);
    assert_eq!(core.reap_expired(now).0, 0);
    assert_eq!(core.release_passes(), passes, "nothing changed: no pass");
    assert!(core.free(&id, claim, now).0);
    assert!(core.release_passes() > passes);
}
