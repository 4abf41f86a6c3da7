use super::*;
use crate::sources::catalog::RankLayout;
use crate::sources::events::offset_endpoint;
use kvpick_core::hash::{prompt_hashes, BASE_SEED};
use kvpick_core::index::Tier;
use std::collections::HashMap;
use std::time::Duration;
use tokio::time::Instant;

fn spec(name: &str, model: &str, layout: RankLayout) -> WorkerSpec {
    WorkerSpec::for_test(name, model, layout)
}

fn ports(p: &[u16]) -> RankLayout {
    RankLayout::PerPort(p.to_vec())
}

fn core_with(config: CoreConfig) -> Arc<SelectionCore> {
    SelectionCore::new(
        CoreConfig {
            seed: Some(7),
            ..config
        },
        Metrics::new(),
    )
}

fn core() -> Arc<SelectionCore> {
    core_with(CoreConfig::default())
}

fn request(id: &str, model: Option<&str>) -> SelectionRequest {
    SelectionRequest {
        request_id: id.into(),
        model: model.map(str::to_string),
        ..Default::default()
    }
}

fn key(model: &str) -> PartitionKey {
    PartitionKey {
        model: model.into(),
        routing_group: String::new(),
    }
}

fn rank_of(core: &SelectionCore, name: &str, dp_rank: u32) -> RankKey {
    let w = core
        .list_workers(None)
        .into_iter()
        .find(|w| w.record.spec.name == name)
        .unwrap();
    RankKey {
        worker_id: w.record.id,
        dp_rank,
    }
}

#[test]
fn not_synced_is_unavailable() {
    let core = core();
    let err = core
        .select_and_reserve(&request("r", Some("m")))
        .err()
        .unwrap();
    assert_eq!(
        err,
        SelectError::Unavailable("catalog not synced yet".into())
    );
    assert!(!*core.readiness().borrow());
}

#[test]
fn worked_example_through_the_core() {
    // Prefill 10 blocks of 16 on three workers, overlaps 2/5/8, decode 10/5/9 -> the second,
    // with DESIGN.md's weight of a decode block (1.0), no stall term and no TTFT bound (DESIGN's
    // cost has neither).
    let core = core_with(CoreConfig {
        cost: CostParams {
            decode_block_weight: 1.0,
            stall_weight: 0.0,
            ttft_slack: f64::INFINITY,
            ..Default::default()
        },
        ..Default::default()
    });
    core.apply_snapshot(vec![
        spec("a", "m", ports(&[1])),
        spec("b", "m", ports(&[2])),
        spec("c", "m", ports(&[3])),
    ])
    .unwrap();
    let tokens: Vec<u32> = (0..160).collect();
    let hashes = prompt_hashes(&tokens, 16, BASE_SEED);
    for (name, overlap, decode) in [("a", 2usize, 10u32), ("b", 5, 5), ("c", 8, 9)] {
        let rank = rank_of(&core, name, 0);
        core.insert_blocks(&key("m"), rank, &hashes[..overlap], Tier::Gpu, None);
        // Build the decode load with held bookings of `decode` blocks each (16 tokens, 1 block),
        // pinned to the rank through the subset filter; they cache nothing of the prompt.
        for i in 0..decode {
            let mut r = request(&format!("{name}-load-{i}"), Some("m"));
            r.subset = Some(EndpointFilter::parse([format!(
                "127.0.0.1:{}",
                rank_port(name)
            )
            .as_str()]));
            r.prompt = PromptInput::Tokens(vec![1_000_000 + i; 16]);
            core.select_and_reserve(&r).unwrap().detach();
            core.mark_prefill_complete(&format!("{name}-load-{i}"));
        }
    }
    let mut r = request("x", Some("m"));
    r.prompt = PromptInput::Tokens(tokens);
    let pick = core.select(&r).unwrap();
    assert_eq!(pick.primary.worker_name, "b");
    assert_eq!(pick.cost, 10.0);
    assert_eq!(pick.overlap_blocks, 5);
    assert_eq!(pick.prompt_blocks, 10);
}

fn rank_port(name: &str) -> u16 {
    match name {
        "a" => 1,
        "b" => 2,
        _ => 3,
    }
}

#[test]
fn load_is_derived_from_bookings() {
    let core = core();
    core.apply_snapshot(vec![spec("a", "m", ports(&[1]))])
        .unwrap();
    let mut r = request("r1", Some("m"));
    r.prompt = PromptInput::Tokens((0..40).collect());
    let pick = core.select_and_reserve(&r).unwrap();
    let load = core.list_workers(None)[0].loads[0];
    assert_eq!(
        load,
        RankLoad {
            active_prefill_tokens: 40,
            active_decode_blocks: 3,
            active_requests: 1
        }
    );
    pick.mark_prefill_complete();
    assert_eq!(core.list_workers(None)[0].loads[0].active_prefill_tokens, 0);
    // The same prompt again: its 2 complete blocks are now cached (approximate mode), so only
    // the 8 uncached tokens are queued prefill.
    let mut again = request("r2", Some("m"));
    again.prompt = PromptInput::Tokens((0..40).collect());
    let second = core.select_and_reserve(&again).unwrap();
    assert_eq!(second.selection().overlap_blocks, 2);
    assert_eq!(core.list_workers(None)[0].loads[0].active_prefill_tokens, 8);
    drop(pick);
    drop(second);
    assert_eq!(core.list_workers(None)[0].loads[0], RankLoad::default());
    assert_eq!(core.metrics().selection.inflight_total.get(), 0);
}

#[test]
fn least_loaded_rank_wins_and_bookings_free_on_drop() {
    let core = core();
    core.apply_snapshot(vec![spec("a", "m", ports(&[1, 2]))])
        .unwrap();
    assert!(*core.readiness().borrow());
    let first = core.select_and_reserve(&request("r1", Some("m"))).unwrap();
    let second = core.select_and_reserve(&request("r2", Some("m"))).unwrap();
    // No prompt: costs tie on prefill; decode blocks are 0 too, so use the active-request weight.
    let _ = (&first, &second);
    assert_eq!(core.live_bookings(), 2);
    assert_eq!(core.metrics().selection.inflight_total.get(), 2);
    drop(first);
    second.free();
    assert_eq!(core.live_bookings(), 0);
    assert_eq!(core.metrics().selection.inflight_total.get(), 0);
    assert!(!core.free("r1"), "repeated free is a no-op");
}

#[test]
fn active_request_weight_spreads_promptless_requests() {
    let core = core_with(CoreConfig {
        cost: CostParams {
            decode_active_request_weight: 1.0,
            ..Default::default()
        },
        ..Default::default()
    });
    core.apply_snapshot(vec![spec("a", "m", ports(&[1, 2]))])
        .unwrap();
    let first = core.select_and_reserve(&request("r1", Some("m"))).unwrap();
    let second = core.select_and_reserve(&request("r2", Some("m"))).unwrap();
    assert_ne!(
        first.selection().primary.endpoint,
        second.selection().primary.endpoint
    );
}

#[test]
fn model_and_subset_filter_with_clear_errors() {
    let core = core();
    core.apply_snapshot(vec![
        spec("a", "m", ports(&[1])),
        spec("b", "other", ports(&[2])),
    ])
    .unwrap();
    let err = core
        .select_and_reserve(&request("r", Some("nope")))
        .err()
        .unwrap();
    assert_eq!(
        err,
        SelectError::Unavailable("no ready worker serves model nope".into())
    );
    let mut req = request("r", Some("m"));
    req.subset = Some(EndpointFilter::parse(["127.0.0.1:2"]));
    let err = core.select_and_reserve(&req).err().unwrap();
    assert_eq!(
        err,
        SelectError::Unavailable("subset hint matches no eligible endpoint".into())
    );
    req.subset = Some(EndpointFilter::parse(["127.0.0.1", "garbage"]));
    let pick = core.select_and_reserve(&req).unwrap();
    assert_eq!(pick.selection().primary.endpoint.port(), 1);
    assert_eq!(
        core.live_bookings(),
        1,
        "failed selections leave no claim behind"
    );
}

#[test]
fn eligibility_order_pins_lora_and_busy_thresholds() {
    let core = core_with(CoreConfig {
        allow_pins: true,
        busy: BusyThresholds {
            active_decode_blocks: Some(2),
            active_prefill_tokens: None,
            ..Default::default()
        },
        ..Default::default()
    });
    let mut lora_worker = spec("b", "m", ports(&[2, 3]));
    lora_worker.lora_adapters = vec!["sql".into()];
    core.apply_snapshot(vec![spec("a", "m", ports(&[1])), lora_worker])
        .unwrap();
    let a = rank_of(&core, "a", 0);
    let b = rank_of(&core, "b", 0);

    // LoRA narrowing: only b has the adapter.
    for i in 0..4 {
        let pick = core
            .select(&request(&format!("l{i}"), Some("sql")))
            .unwrap();
        assert_eq!(pick.primary.worker_name, "b");
        assert_eq!(pick.partition, key("m"));
    }
    // Pins: rank out of range -> 400; unknown worker -> 503; pin outside subset -> 503.
    let mut pinned = request("p", Some("m"));
    pinned.pin = Some(Pin {
        worker_id: b.worker_id,
        dp_rank: Some(5),
    });
    assert_eq!(core.select(&pinned).err().unwrap().http_status(), 400);
    pinned.pin = Some(Pin {
        worker_id: 12345,
        dp_rank: None,
    });
    assert_eq!(core.select(&pinned).err().unwrap().http_status(), 503);
    pinned.pin = Some(Pin {
        worker_id: b.worker_id,
        dp_rank: Some(1),
    });
    pinned.subset = Some(EndpointFilter::parse(["127.0.0.1:1"]));
    assert_eq!(core.select(&pinned).err().unwrap().http_status(), 503);
    pinned.subset = None;
    assert_eq!(core.select(&pinned).unwrap().primary.endpoint.port(), 3);
    // A pin for a LoRA the pinned worker lacks -> 503.
    let mut lora_pin = request("lp", Some("sql"));
    lora_pin.pin = Some(Pin {
        worker_id: a.worker_id,
        dp_rank: None,
    });
    assert_eq!(core.select(&lora_pin).err().unwrap().http_status(), 503);

    // Busy: fill a's rank to 2 decode blocks -> pinned to a is 429, never rerouted.
    for i in 0..2 {
        let mut r = request(&format!("busy{i}"), Some("m"));
        r.pin = Some(Pin {
            worker_id: a.worker_id,
            dp_rank: None,
        });
        r.prompt = PromptInput::Tokens(vec![9; 16]);
        core.select_and_reserve(&r).unwrap().detach();
    }
    let mut r = request("over", Some("m"));
    r.pin = Some(Pin {
        worker_id: a.worker_id,
        dp_rank: None,
    });
    assert_eq!(
        core.select(&r).err().unwrap(),
        SelectError::Overloaded("pinned worker is over its busy threshold".into())
    );
    // Unpinned requests avoid the busy rank.
    for i in 0..5 {
        assert_ne!(
            core.select(&request(&format!("u{i}"), Some("m")))
                .unwrap()
                .primary
                .key,
            a
        );
    }
    // Everything busy -> 429.
    for (i, port) in [2u16, 2, 3, 3].iter().enumerate() {
        let mut r = request(&format!("fill{i}"), Some("m"));
        r.subset = Some(EndpointFilter::parse(
            [format!("127.0.0.1:{port}").as_str()],
        ));
        r.prompt = PromptInput::Tokens(vec![8; 16]);
        core.select_and_reserve(&r).unwrap().detach();
    }
    assert_eq!(
        core.select(&request("all", Some("m")))
            .err()
            .unwrap()
            .http_status(),
        429
    );
    // Pins are ignored unless allowed.
    let strict = core_with(CoreConfig::default());
    strict
        .apply_snapshot(vec![
            spec("a", "m", ports(&[1])),
            spec("c", "m", ports(&[4])),
        ])
        .unwrap();
    let mut r = request("np", Some("m"));
    r.pin = Some(Pin {
        worker_id: 999,
        dp_rank: None,
    });
    assert!(strict.select(&r).is_ok());
}

#[test]
fn duplicate_ids_are_suffixed_or_rejected() {
    let core = core();
    core.apply_snapshot(vec![spec("a", "m", ports(&[1]))])
        .unwrap();
    let a = core
        .select_and_reserve(&request("same", Some("m")))
        .unwrap();
    let b = core
        .select_and_reserve(&request("same", Some("m")))
        .unwrap();
    assert_eq!(a.booking_id(), "same");
    assert_eq!(b.booking_id(), "same#2");
    let mut reject = request("same", Some("m"));
    reject.on_duplicate = DuplicateId::Reject;
    assert_eq!(
        core.select_and_reserve(&reject)
            .err()
            .unwrap()
            .http_status(),
        409
    );
}

#[test]
fn fallbacks_are_distinct_endpoints() {
    let core = core();
    core.apply_snapshot(vec![
        spec("a", "m", RankLayout::Multiplexed { port: 1, size: 4 }),
        spec("b", "m", ports(&[2])),
    ])
    .unwrap();
    let mut req = request("r", Some("m"));
    req.fallbacks = 3;
    let pick = core.select_and_reserve(&req).unwrap();
    let sel = pick.selection();
    let mut endpoints: Vec<_> = sel.fallbacks.iter().map(|f| f.endpoint).collect();
    endpoints.push(sel.primary.endpoint);
    endpoints.sort();
    endpoints.dedup();
    assert_eq!(endpoints.len(), 2);
    assert_eq!(sel.fallbacks.len(), 1);
}

#[test]
fn snapshot_rules() {
    let core = core();
    let a = spec("a", "m", ports(&[1, 2]));
    let b = spec("b", "m", ports(&[3]));
    let report = core.apply_snapshot(vec![a.clone(), b.clone()]).unwrap();
    assert_eq!((report.added, report.partitions_published), (2, 1));
    // Duplicates are rejected before anything changes.
    assert!(core.apply_snapshot(vec![a.clone(), a.clone()]).is_err());
    assert_eq!(core.list_workers(None).len(), 2);

    let mut req = request("r", Some("m"));
    req.subset = Some(EndpointFilter::parse(["127.0.0.1:1"]));
    let held = core.select_and_reserve(&req).unwrap();
    // A metadata change that keeps rank 0's endpoint keeps its booking.
    let mut a2 = a.clone();
    a2.lora_adapters = vec!["l".into()];
    let report = core.apply_snapshot(vec![a2.clone(), b.clone()]).unwrap();
    assert_eq!(
        (
            report.updated,
            report.unchanged,
            report.partitions_published
        ),
        (1, 1, 1)
    );
    assert_eq!(core.live_bookings(), 1);
    assert_eq!(core.list_workers(None)[0].loads[0].active_requests, 1);
    // Unchanged snapshot: nothing published.
    let report = core.apply_snapshot(vec![a2.clone(), b.clone()]).unwrap();
    assert_eq!((report.unchanged, report.partitions_published), (2, 0));
    // Removing the worker drops its bookings; the guard's later free is a no-op.
    let report = core.apply_snapshot(vec![b.clone()]).unwrap();
    assert_eq!(report.removed, 1);
    assert_eq!(core.live_bookings(), 0);
    assert_eq!(core.metrics().selection.inflight_total.get(), 0);
    drop(held);
    assert_eq!(core.metrics().selection.inflight_total.get(), 0);
    // Empty snapshot: not ready, 503.
    core.apply_snapshot(vec![]).unwrap();
    assert!(!*core.readiness().borrow());
    assert_eq!(
        core.select_and_reserve(&request("r", None))
            .err()
            .unwrap()
            .http_status(),
        503
    );
}

#[test]
fn moving_partitions_block_size_conflicts_and_kept_index() {
    let core = core();
    let mut a = spec("a", "m", ports(&[1]));
    a.block_size = Some(32);
    let mut b = spec("b", "m", ports(&[2]));
    b.block_size = Some(64);
    let report = core.apply_snapshot(vec![a.clone(), b.clone()]).unwrap();
    assert_eq!(report.failed.len(), 1, "{report:?}");
    let views = core.list_workers(None);
    let failed = views
        .iter()
        .find(|v| v.record.lifecycle == Lifecycle::Unschedulable)
        .unwrap();
    assert!(
        failed.record.reason.contains("conflicts with block size"),
        "{}",
        failed.record.reason
    );
    assert_eq!(core.block_size(&key("m")), 32);
    // Only the consistent worker serves.
    for i in 0..10 {
        let pick = core.select(&request(&format!("{i}"), Some("m"))).unwrap();
        assert_eq!(
            pick.primary.worker_name,
            failed_other(&failed.record.spec.name)
        );
    }

    // A routed prompt is remembered; the worker moves to another model (a new engine) and back:
    // what the old engine cached is gone with it, so nothing matches.
    let tokens: Vec<u32> = (0..64).collect();
    let mut r = request("warm", Some("m"));
    r.prompt = PromptInput::Tokens(tokens.clone());
    let winner = core
        .select_and_reserve(&r)
        .unwrap()
        .detach()
        .primary
        .worker_name;
    core.free("warm");
    let only = if winner == "a" { a.clone() } else { b.clone() };
    let mut moved = only.clone();
    moved.model = "m2".into();
    core.apply_snapshot(vec![moved]).unwrap();
    assert_eq!(
        core.select(&request("x", Some("m")))
            .err()
            .unwrap()
            .http_status(),
        503
    );
    assert!(core.select(&request("x", Some("m2"))).is_ok());
    core.apply_snapshot(vec![only]).unwrap();
    let mut again = request("again", Some("m"));
    again.prompt = PromptInput::Tokens(tokens);
    assert_eq!(
        core.select(&again).unwrap().overlap_blocks,
        0,
        "a worker that left its partition left its cached blocks behind"
    );
}

fn failed_other(failed: &str) -> &'static str {
    if failed == "a" {
        "b"
    } else {
        "a"
    }
}

#[test]
fn served_endpoint_moves_the_booking() {
    let core = core();
    core.apply_snapshot(vec![spec("a", "m", ports(&[1, 2]))])
        .unwrap();
    let mut req = request("r", Some("m"));
    req.subset = Some(EndpointFilter::parse(["127.0.0.1:1"]));
    req.prompt = PromptInput::Tokens(vec![3; 32]);
    let pick = core.select_and_reserve(&req).unwrap();
    assert!(pick.served_by("127.0.0.1:2".parse().unwrap()));
    let loads: Vec<u64> = core.list_workers(None)[0]
        .loads
        .iter()
        .map(|l| l.active_requests)
        .collect();
    assert_eq!(loads, vec![0, 1]);
    assert_eq!(core.list_workers(None)[0].loads[1].active_decode_blocks, 2);
    assert!(!pick.served_by("127.0.0.1:2".parse().unwrap()));
    drop(pick);
    assert_eq!(core.list_workers(None)[0].loads[1], RankLoad::default());
}

#[test]
fn a_long_stream_keeps_its_booking_past_the_ttl() {
    let core = core();
    core.apply_snapshot(vec![spec("a", "m", ports(&[1]))])
        .unwrap();
    let stream = core.select_and_reserve(&request("r", Some("m"))).unwrap();
    assert_eq!(
        core.reap_expired(Instant::now() + Duration::from_secs(3_600)),
        0,
        "a stream still open is still load"
    );
    assert_eq!(core.metrics().selection.inflight_total.get(), 1);
    drop(stream);
    assert_eq!(core.metrics().selection.inflight_total.get(), 0);
    assert_eq!(core.live_bookings(), 0);
}

#[test]
fn expired_bookings_are_reaped() {
    let core = core();
    core.apply_snapshot(vec![spec("a", "m", ports(&[1]))])
        .unwrap();
    // Only API bookings expire; a stream's booking lives as long as its stream (the next test).
    let api = SelectionRequest {
        holder: Holder::Api,
        ..request("r", Some("m"))
    };
    let pick = core.select_and_reserve(&api).unwrap();
    assert_eq!(core.reap_expired(Instant::now()), 0);
    assert_eq!(
        core.reap_expired(Instant::now() + Duration::from_secs(301)),
        1
    );
    assert_eq!(core.live_bookings(), 0);
    assert_eq!(core.metrics().selection.inflight_total.get(), 0);
    assert_eq!(core.metrics().selection.bookings_expired.get(), 1);
    drop(pick);
    assert_eq!(core.metrics().selection.inflight_total.get(), 0);
}

#[tokio::test]
async fn a_selection_dropped_at_an_await_frees_its_booking() {
    let core = core();
    core.apply_snapshot(vec![spec("a", "m", ports(&[1]))])
        .unwrap();
    let (entered_tx, entered_rx) = tokio::sync::oneshot::channel();
    let c = Arc::clone(&core);
    let task = tokio::spawn(async move {
        let reservation = c.select_and_reserve(&request("r", Some("m"))).unwrap();
        entered_tx.send(()).unwrap();
        // Waiting for a response that never comes.
        std::future::pending::<()>().await;
        drop(reservation);
    });
    entered_rx.await.unwrap();
    assert_eq!(core.live_bookings(), 1);
    task.abort();
    assert!(task.await.unwrap_err().is_cancelled());
    assert_eq!(core.live_bookings(), 0);
    assert_eq!(core.metrics().selection.inflight_total.get(), 0);
}

#[test]
fn same_seed_same_decisions_and_trace() {
    let run = || {
        let core = core_with(CoreConfig {
            trace_decisions: 100,
            ..Default::default()
        });
        core.apply_snapshot(vec![
            spec("a", "m", ports(&[1, 2])),
            spec("b", "m", ports(&[3])),
        ])
        .unwrap();
        for i in 0..20u32 {
            let mut r = request(&format!("r{i}"), Some("m"));
            r.prompt = PromptInput::Tokens((0..(16 * (i % 4 + 1))).collect());
            core.select_and_reserve(&r).unwrap().detach();
        }
        core.decision_trace()
    };
    let (a, b) = (run(), run());
    assert_eq!(a.len(), 20);
    assert_eq!(a, b);
}

#[test]
fn api_source_merges_with_the_catalog() {
    let core = core();
    core.apply_snapshot(vec![spec("a", "m", ports(&[1]))])
        .unwrap();
    let mut api = spec("x", "m", ports(&[9]));
    api.namespace = "api".into();
    core.upsert_source_worker("api", api).unwrap();
    assert_eq!(core.list_workers(None).len(), 2);
    // A file reload keeps API workers.
    core.apply_snapshot(vec![spec("a", "m", ports(&[1]))])
        .unwrap();
    assert_eq!(core.list_workers(None).len(), 2);
    assert!(core.delete_source_worker("api", "x").unwrap());
    assert!(!core.delete_source_worker("api", "x").unwrap());
    assert_eq!(core.list_workers(None).len(), 1);
}

#[test]
fn clip_keeps_messages_short() {
    let long = "é".repeat(200);
    assert!(clip(&long).len() <= 131);
    assert_eq!(clip("short"), "short");
}

fn session_request(id: &str, session: &str, tokens: Vec<u32>) -> SelectionRequest {
    SelectionRequest {
        request_id: id.into(),
        model: Some("m".into()),
        session_id: Some(session.into()),
        prompt: PromptInput::Tokens(tokens),
        ..Default::default()
    }
}

fn session_core(sessions: SessionConfig, busy: BusyThresholds) -> Arc<SelectionCore> {
    let core = core_with(CoreConfig {
        sessions,
        busy,
        allow_pins: true,
        ..Default::default()
    });
    core.apply_snapshot(vec![
        spec("a", "m", ports(&[1, 2])),
        spec("b", "m", ports(&[3, 4])),
    ])
    .unwrap();
    core
}

fn events(core: &SelectionCore, event: &str) -> u64 {
    core.metrics()
        .selection
        .session_events
        .with_label_values(&[event])
        .get()
}

#[test]
fn hard_sessions_stick_even_against_load_and_cache() {
    let core = session_core(SessionConfig::default(), BusyThresholds::default());
    let first = core
        .select_and_reserve(&session_request("t0", "s1", vec![1; 64]))
        .unwrap();
    let home = first.selection().primary.key;
    assert_eq!(first.selection().session, Some(SessionOutcome::Created));
    // Load the home rank heavily and warm another rank with the next prompt: still home.
    let mut held = vec![first];
    for turn in 1..20 {
        let pick = core
            .select_and_reserve(&session_request(&format!("t{turn}"), "s1", vec![turn; 64]))
            .unwrap();
        assert_eq!(pick.selection().primary.key, home, "turn {turn}");
        assert_eq!(pick.selection().session, Some(SessionOutcome::Reused));
        held.push(pick);
    }
    assert_eq!(events(&core, "created"), 1);
    assert_eq!(events(&core, "reused"), 19);
    assert_eq!(core.metrics().selection.sessions_live.get(), 1);
}

#[test]
fn concurrent_first_requests_converge_on_one_rank() {
    let core = session_core(SessionConfig::default(), BusyThresholds::default());
    let picks: Vec<RankKey> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..50)
            .map(|i| {
                let core = Arc::clone(&core);
                scope.spawn(move || {
                    core.select_and_reserve(&session_request(
                        &format!("c{i}"),
                        "burst",
                        vec![i; 32],
                    ))
                    .unwrap()
                    .detach()
                    .primary
                    .key
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(picks.iter().all(|k| *k == picks[0]), "{picks:?}");
    assert_eq!(events(&core, "created"), 1);
}

#[test]
fn removed_rank_moves_its_sessions_once_and_they_stick() {
    let core = session_core(SessionConfig::default(), BusyThresholds::default());
    let mut homes = HashMap::new();
    for s in 0..40 {
        let sid = format!("s{s}");
        let k = core
            .select_and_reserve(&session_request(&format!("{sid}-0"), &sid, vec![s; 16]))
            .unwrap()
            .selection()
            .primary
            .key;
        homes.insert(sid, k);
    }
    let a = rank_of(&core, "a", 0);
    let on_a: Vec<String> = homes
        .iter()
        .filter(|(_, k)| k.worker_id == a.worker_id)
        .map(|(s, _)| s.clone())
        .collect();
    assert!(!on_a.is_empty());
    core.apply_snapshot(vec![spec("b", "m", ports(&[3, 4]))])
        .unwrap();
    for turn in 1..4 {
        for (sid, old) in &homes {
            let k = core
                .select_and_reserve(&session_request(&format!("{sid}-{turn}"), sid, vec![7; 16]))
                .unwrap()
                .selection()
                .primary
                .key;
            assert_ne!(k.worker_id, a.worker_id);
            if old.worker_id != a.worker_id {
                assert_eq!(k, *old, "sessions on surviving ranks do not move");
            }
        }
    }
    let invalidated = core
        .metrics()
        .selection
        .session_invalidated
        .with_label_values(&["gone"])
        .get();
    assert_eq!(
        invalidated as usize,
        on_a.len(),
        "each moved session moved exactly once"
    );
}

#[test]
fn subset_pins_and_full_tables() {
    let core = session_core(
        SessionConfig {
            max_entries: 2,
            ..Default::default()
        },
        BusyThresholds::default(),
    );
    let home = core
        .select_and_reserve(&session_request("p0", "s", vec![1; 16]))
        .unwrap()
        .detach()
        .primary;
    // A pin that contradicts the hard binding -> 400.
    let other = core
        .list_workers(None)
        .into_iter()
        .find(|w| w.record.id != home.key.worker_id)
        .unwrap()
        .record
        .id;
    let mut pinned = session_request("p1", "s", vec![1; 16]);
    pinned.pin = Some(Pin {
        worker_id: other,
        dp_rank: None,
    });
    assert_eq!(
        core.select_and_reserve(&pinned)
            .err()
            .unwrap()
            .http_status(),
        400
    );
    // Outside the subset hint -> invalidated and rebound inside it.
    let mut hinted = session_request("p2", "s", vec![1; 16]);
    let elsewhere = if home.endpoint.port() == 1 {
        "127.0.0.1:4"
    } else {
        "127.0.0.1:1"
    };
    hinted.subset = Some(EndpointFilter::parse([elsewhere]));
    let moved = core.select_and_reserve(&hinted).unwrap().detach();
    assert_eq!(moved.primary.endpoint.to_string(), elsewhere);
    assert_eq!(
        core.metrics()
            .selection
            .session_invalidated
            .with_label_values(&["outside_subset"])
            .get(),
        1
    );
    let again = core
        .select_and_reserve(&session_request("p3", "s", vec![1; 16]))
        .unwrap()
        .detach();
    assert_eq!(
        again.primary.endpoint.to_string(),
        elsewhere,
        "sticks to the new rank"
    );
    // Table of 2: the third session is routed without affinity, and counted.
    core.select_and_reserve(&session_request("q0", "s2", vec![2; 16]))
        .unwrap()
        .detach();
    let third = core
        .select_and_reserve(&session_request("q1", "s3", vec![3; 16]))
        .unwrap()
        .detach();
    assert_eq!(third.session, Some(SessionOutcome::TableFull));
    assert_eq!(events(&core, "table_full"), 1);
    // Partitions do not share sessions: the same id in another model is a new session.
    core.apply_snapshot(vec![
        spec("a", "m", ports(&[1, 2])),
        spec("b", "m", ports(&[3, 4])),
        spec("c", "m2", ports(&[5])),
    ])
    .unwrap();
    let mut other_model = session_request("x", "s", vec![1; 16]);
    other_model.model = Some("m2".into());
    assert_eq!(
        core.select_and_reserve(&other_model)
            .unwrap()
            .selection()
            .session,
        Some(SessionOutcome::Created)
    );
}

#[test]
fn soft_sessions_yield_to_overload() {
    let core = session_core(
        SessionConfig {
            mode: AffinityMode::Soft,
            soft_margin_blocks: 4.0,
            ..Default::default()
        },
        BusyThresholds::default(),
    );
    let home = core
        .select_and_reserve(&session_request("s0", "soft", vec![1; 16]))
        .unwrap()
        .detach()
        .primary
        .key;
    // Within the margin: stays.
    let pick = core
        .select_and_reserve(&session_request("s1", "soft", vec![2; 16]))
        .unwrap()
        .detach();
    assert_eq!(pick.primary.key, home);
    // Pile 10 blocks onto home: its cost exceeds the best by more than 4 blocks -> moves once.
    for i in 0..10u32 {
        let mut r = request(&format!("load{i}"), Some("m"));
        r.pin = Some(Pin {
            worker_id: home.worker_id,
            dp_rank: Some(home.dp_rank),
        });
        r.prompt = PromptInput::Tokens(vec![100 + i; 16]);
        core.select_and_reserve(&r).unwrap().detach();
    }
    let moved = core
        .select_and_reserve(&session_request("s2", "soft", vec![3; 16]))
        .unwrap()
        .detach();
    assert_ne!(moved.primary.key, home);
    assert_eq!(
        core.metrics()
            .selection
            .session_invalidated
            .with_label_values(&["soft_override"])
            .get(),
        1
    );
}

#[tokio::test(start_paused = true)]
async fn session_ttl_expiry_frees_entries() {
    let core = session_core(
        SessionConfig {
            ttl: Duration::from_secs(30),
            ..Default::default()
        },
        BusyThresholds::default(),
    );
    let held = core
        .select_and_reserve(&session_request("e0", "ttl", vec![1; 16]))
        .unwrap();
    tokio::time::advance(Duration::from_secs(120)).await;
    core.reap_expired(Instant::now());
    assert_eq!(
        core.metrics().selection.sessions_live.get(),
        1,
        "a leased session never expires"
    );
    drop(held);
    tokio::time::advance(Duration::from_secs(29)).await;
    core.reap_expired(Instant::now());
    assert_eq!(core.metrics().selection.sessions_live.get(), 1);
    tokio::time::advance(Duration::from_secs(1)).await;
    core.reap_expired(Instant::now());
    assert_eq!(core.metrics().selection.sessions_live.get(), 0);
    assert_eq!(events(&core, "expired"), 1);
    let next = core
        .select_and_reserve(&session_request("e1", "ttl", vec![1; 16]))
        .unwrap();
    assert_eq!(next.selection().session, Some(SessionOutcome::Created));
}

#[test]
fn sheddable_requests_are_shed_before_critical_ones() {
    let core = core_with(CoreConfig {
        busy: BusyThresholds {
            active_decode_blocks: Some(10),
            active_prefill_tokens: None,
            sheddable_fraction: 0.5,
        },
        ..Default::default()
    });
    core.apply_snapshot(vec![spec("a", "m", ports(&[1]))])
        .unwrap();
    let mut load = request("load", Some("m"));
    load.prompt = PromptInput::Tokens(vec![5; 16 * 6]);
    core.select_and_reserve(&load).unwrap().detach(); // 6 of 10 blocks
    let mut sheddable = request("low", Some("m"));
    sheddable.priority = -1;
    let err = core.select(&sheddable).err().unwrap();
    assert_eq!(err.http_status(), 429);
    assert!(err.to_string().contains("sheddable"), "{err}");
    assert!(core.select(&request("critical", Some("m"))).is_ok());
}

mod kv_events {
    use super::*;
    use crate::sources::events::decode::{KvEvent, Medium};

    fn stored(hashes: &[u64], parent: Option<u64>, tokens: Vec<u32>, medium: Medium) -> KvEvent {
        KvEvent::BlockStored {
            block_hashes: hashes.to_vec(),
            parent_block_hash: parent,
            token_ids: tokens,
            block_size: 16,
            lora_id: None,
            medium,
            lora_name: None,
            cache_salt: None,
            group_idx: None,
            media: Vec::new(),
        }
    }

    fn removed(hashes: &[u64], medium: Medium) -> KvEvent {
        KvEvent::BlockRemoved {
            block_hashes: hashes.to_vec(),
            medium,
            group_idx: None,
        }
    }

    /// `tokens`' depth on `rank`, asked with one token more: an engine computes a prompt's last
    /// token, so only then are all of `tokens`' blocks reusable.
    fn overlap_on(core: &SelectionCore, rank: RankKey, tokens: &[u32]) -> TierDepths {
        let mut r = request("q", Some("m"));
        r.prompt = PromptInput::Tokens([tokens, &[u32::MAX]].concat());
        let (_, scores) = core.overlap_scores(&r).unwrap();
        scores.into_iter().find(|(p, _)| p.key == rank).unwrap().1
    }

    #[test]
    fn stored_chains_route_requests_to_the_rank_that_holds_them() {
        let core = core();
        core.apply_snapshot(vec![
            spec("a", "m", ports(&[1])),
            spec("b", "m", ports(&[2])),
        ])
        .unwrap();
        let b = rank_of(&core, "b", 0);
        let tokens: Vec<u32> = (0..64).collect();
        // Two events: blocks 0-1, then 2-3 chained on engine hash 11.
        let stats = core.apply_kv_events(
            b,
            &[
                stored(&[10, 11], None, tokens[..32].to_vec(), Medium::Gpu),
                stored(&[12, 13], Some(11), tokens[32..].to_vec(), Medium::Gpu),
            ],
        );
        assert_eq!(
            stats,
            EventStats {
                applied: 2,
                dropped: 0,
                block_size_mismatches: 0,
            }
        );
        assert_eq!(overlap_on(&core, b, &tokens).gpu, 4);
        let mut r = request("x", Some("m"));
        r.prompt = PromptInput::Tokens([tokens.clone(), vec![9; 16]].concat());
        assert_eq!(core.select(&r).unwrap().primary.key, b);
        assert_eq!(
            core.metrics()
                .events
                .kv_events
                .with_label_values(&["applied"])
                .get(),
            2
        );
    }

    #[test]
    fn removal_counts_references_and_tiers() {
        let core = core();
        core.apply_snapshot(vec![spec("a", "m", ports(&[1]))])
            .unwrap();
        let a = rank_of(&core, "a", 0);
        let tokens: Vec<u32> = (100..132).collect();
        let store = stored(&[1, 2], None, tokens.clone(), Medium::Gpu);
        core.apply_kv_events(a, &[store.clone(), store]);
        core.apply_kv_events(a, &[removed(&[2], Medium::Gpu)]);
        assert_eq!(
            overlap_on(&core, a, &tokens).gpu,
            2,
            "stored twice, removed once"
        );
        // Offload block 2 to CPU without tokens, then drop it from GPU.
        core.apply_kv_events(
            a,
            &[
                stored(&[2], Some(1), vec![], Medium::Cpu),
                removed(&[2], Medium::Gpu),
            ],
        );
        assert_eq!(
            overlap_on(&core, a, &tokens),
            TierDepths {
                gpu: 1,
                host: 2,
                disk: 2
            }
        );
        core.apply_kv_events(a, &[KvEvent::AllBlocksCleared]);
        assert_eq!(overlap_on(&core, a, &tokens), TierDepths::default());
    }

    #[test]
    fn index_size_is_published_per_partition() {
        let core = core();
        core.apply_snapshot(vec![spec("a", "m", ports(&[1]))])
            .unwrap();
        let a = rank_of(&core, "a", 0);
        let bytes = || {
            core.metrics()
                .selection
                .index_bytes
                .with_label_values(&["m", ""])
                .get()
        };
        core.reap_expired(Instant::now());
        let empty = bytes();
        let tokens: Vec<u32> = (0..16 * 64).collect();
        let hashes: Vec<u64> = (1..=64).collect();
        core.apply_kv_events(a, &[stored(&hashes, None, tokens, Medium::Gpu)]);
        core.reap_expired(Instant::now());
        assert!(bytes() > empty + 64 * 16, "index and engine map counted");
        assert_eq!(
            core.metrics()
                .selection
                .index_blocks
                .with_label_values(&["m", ""])
                .get(),
            64
        );
    }

    /// `kvpick_index_blocks` is read at each scrape: a clear (an engine restart, with no fact)
    /// shows once its sweep has dropped the blocks, not at the next 10 s reap.
    #[test]
    fn index_blocks_is_current_at_each_scrape() {
        let core = core();
        core.apply_snapshot(vec![spec("a", "m", ports(&[1]))])
            .unwrap();
        let a = rank_of(&core, "a", 0);
        let scraped = || {
            let text = core.metrics().render();
            text.lines()
                .find_map(|l| {
                    l.strip_prefix("kvpick_index_blocks{model=\"m\",routing_group=\"\"} ")
                        .map(str::to_owned)
                })
                .unwrap_or_default()
        };
        let tokens: Vec<u32> = (0..16 * 8).collect();
        let hashes: Vec<u64> = (1..=8).collect();
        core.apply_kv_events(a, &[stored(&hashes, None, tokens, Medium::Gpu)]);
        assert_eq!(scraped(), "8");
        core.clear_rank(a);
        let now = Instant::now();
        while core.sweep_cleared_ranks(now) > 0 {}
        assert_eq!(
            scraped(),
            "0",
            "no fact reported the sweep; the scrape reads it"
        );
    }

    #[test]
    fn unusable_events_are_dropped_not_fatal() {
        let core = core();
        core.apply_snapshot(vec![spec("a", "m", ports(&[1]))])
            .unwrap();
        let a = rank_of(&core, "a", 0);
        let mut wrong_size = stored(&[5], None, vec![1; 32], Medium::Gpu);
        if let KvEvent::BlockStored { block_size, .. } = &mut wrong_size {
            *block_size = 32;
        }
        let stats = core.apply_kv_events(
            a,
            &[
                stored(&[7], Some(999), vec![1; 16], Medium::Gpu), // unknown parent
                wrong_size,
                removed(&[12345], Medium::Gpu), // never stored
                stored(&[8], None, vec![2; 16], Medium::Gpu),
            ],
        );
        assert_eq!(
            stats,
            EventStats {
                applied: 1,
                dropped: 3,
                block_size_mismatches: 1,
            }
        );
        let unknown_rank = RankKey {
            worker_id: 77,
            dp_rank: 0,
        };
        assert_eq!(
            core.apply_kv_events(unknown_rank, &[KvEvent::AllBlocksCleared])
                .dropped,
            1
        );
    }

    #[test]
    fn lora_stores_match_adapter_requests_only() {
        let core = core();
        let mut a = spec("a", "m", ports(&[1]));
        a.lora_adapters = vec!["sql".into()];
        core.apply_snapshot(vec![a]).unwrap();
        let rank = rank_of(&core, "a", 0);
        let tokens: Vec<u32> = (0..16).collect();
        let mut store = stored(&[1], None, tokens.clone(), Medium::Gpu);
        if let KvEvent::BlockStored { lora_name, .. } = &mut store {
            *lora_name = Some("sql".into());
        }
        core.apply_kv_events(rank, &[store]);
        assert_eq!(
            overlap_on(&core, rank, &tokens).gpu,
            0,
            "base-model prompt differs"
        );
        let mut r = request("q", Some("sql"));
        r.prompt = PromptInput::Tokens([tokens, vec![u32::MAX]].concat());
        let (_, scores) = core.overlap_scores(&r).unwrap();
        assert_eq!(scores[0].1.gpu, 1);
    }

    #[test]
    fn endpoints_offset_by_rank() {
        assert_eq!(
            offset_endpoint("tcp://10.0.0.1:5557", 3).as_deref(),
            Some("tcp://10.0.0.1:5560")
        );
        assert_eq!(
            offset_endpoint("tcp://[::1]:5557", 1).as_deref(),
            Some("tcp://[::1]:5558")
        );
        assert_eq!(offset_endpoint("garbage", 1), None);
        let core = core();
        let mut a = spec("a", "m", ports(&[1, 2]));
        a.kv_events = Some("tcp://127.0.0.1:5557".into());
        a.kv_replay = Some("tcp://127.0.0.1:5600".into());
        core.apply_snapshot(vec![a, spec("b", "m", ports(&[3]))])
            .unwrap();
        let eps: Vec<(u32, String, Option<String>)> = core
            .kv_event_endpoints()
            .into_iter()
            .map(|(k, e, r)| (k.dp_rank, e, r))
            .collect();
        assert_eq!(
            eps,
            vec![
                (
                    0,
                    "tcp://127.0.0.1:5557".into(),
                    Some("tcp://127.0.0.1:5600".into())
                ),
                (
                    1,
                    "tcp://127.0.0.1:5558".into(),
                    Some("tcp://127.0.0.1:5601".into())
                ),
            ]
        );
    }
}

#[test]
fn by_default_a_cached_prefix_outweighs_a_little_decode_load() {
    // The worked example's ranks under the default weights: a decode block weighs 0.01 of an
    // uncached prefill block, so the rank holding 8 of 10 blocks wins despite 9 blocks of decode.
    let params = CostParams::default();
    let cand = |decode: u64, overlap: u32| {
        Candidate::new(
            RankKey {
                worker_id: decode,
                dp_rank: 0,
            },
            RankLoad {
                active_decode_blocks: decode,
                ..RankLoad::default()
            },
            kvpick_core::index::TierDepths {
                gpu: overlap,
                host: overlap,
                disk: overlap,
            },
        )
    };
    let costs: Vec<f64> = [cand(10, 2), cand(5, 5), cand(9, 8)]
        .iter()
        .map(|c| cost(c, 160, 16, &params))
        .collect();
    assert_eq!(costs, vec![8.1, 5.05, 2.09]);
    // With equal overlap, decode load still decides.
    assert!(cost(&cand(3, 0), 160, 16, &params) < cost(&cand(4, 0), 160, 16, &params));
}

#[test]
fn a_moved_booking_keeps_its_session_lease() {
    let core = session_core(SessionConfig::default(), BusyThresholds::default());
    let pick = core
        .select_and_reserve(&session_request("r", "s", vec![1; 32]))
        .unwrap();
    let other = if pick.selection().primary.worker_name == "a" {
        "127.0.0.1:3"
    } else {
        "127.0.0.1:1"
    };
    assert!(pick.served_by(other.parse().unwrap()));
    // Long past the idle TTL, but the request is still in flight: the binding must stay.
    core.reap_expired(Instant::now() + Duration::from_secs(3_600));
    assert_eq!(core.metrics().selection.sessions_live.get(), 1);
    drop(pick);
    core.reap_expired(Instant::now() + Duration::from_secs(3_600));
    assert_eq!(core.metrics().selection.sessions_live.get(), 0);
}

#[test]
fn a_multiplexed_fallback_is_booked_on_the_same_rank_of_the_serving_pod() {
    let core = core_with(CoreConfig {
        allow_pins: true,
        ..Default::default()
    });
    let mux = |port| RankLayout::Multiplexed { port, size: 2 };
    core.apply_snapshot(vec![spec("p1", "m", mux(1)), spec("p2", "m", mux(2))])
        .unwrap();
    let p1 = rank_of(&core, "p1", 1);
    let mut r = request("r", Some("m"));
    r.pin = Some(Pin {
        worker_id: p1.worker_id,
        dp_rank: Some(1),
    });
    let pick = core.select_and_reserve(&r).unwrap();
    assert!(pick.served_by("127.0.0.1:2".parse().unwrap()));
    let p2 = core
        .list_workers(None)
        .into_iter()
        .find(|w| w.record.spec.name == "p2")
        .unwrap();
    let requests: Vec<u64> = p2.loads.iter().map(|l| l.active_requests).collect();
    assert_eq!(
        requests,
        vec![0, 1],
        "rank 1 of p2 runs it (X-data-parallel-rank: 1)"
    );
}

#[test]
fn a_soft_binding_moved_by_a_pin_is_still_one_live_session() {
    let soft = SessionConfig {
        mode: AffinityMode::Soft,
        ..SessionConfig::default()
    };
    let core = session_core(soft, BusyThresholds::default());
    let first = core
        .select_and_reserve(&session_request("r1", "s", vec![1; 32]))
        .unwrap()
        .detach();
    let other = if first.primary.worker_name == "a" {
        "b"
    } else {
        "a"
    };
    let mut pinned = session_request("r2", "s", vec![2; 32]);
    pinned.pin = Some(Pin {
        worker_id: rank_of(&core, other, 0).worker_id,
        dp_rank: None,
    });
    let second = core.select_and_reserve(&pinned).unwrap();
    assert_eq!(
        second.selection().primary.worker_name,
        other,
        "soft: the pin wins"
    );
    assert_eq!(core.metrics().selection.sessions_live.get(), 1);
}

#[test]
fn a_departed_workers_series_are_removed() {
    let core = core();
    core.apply_snapshot(vec![
        spec("a", "m", ports(&[1])),
        spec("b", "m", ports(&[2])),
    ])
    .unwrap();
    let ttfb = &core.metrics().extproc.time_to_first_byte;
    ttfb.with_label_values(&["a"]).observe(0.1);
    ttfb.with_label_values(&["b"]).observe(0.1);
    core.select_and_reserve(&request("r", Some("m")))
        .unwrap()
        .free();
    core.apply_snapshot(vec![spec("b", "m", ports(&[2]))])
        .unwrap();
    let text = core.metrics().render();
    assert!(!text.contains("worker=\"a\""), "{text}");
    assert!(text.contains("kvpick_time_to_first_byte_seconds_count{worker=\"b\"}"));
}

/// A split pick's two bookings through the RAII reservation: the first token frees the prefill
/// rank, dropping (a stream that ended, failed or went away) frees the decode rank, once; the
/// per-rank gauges follow.
#[test]
fn a_split_reservation_frees_each_rank_once() {
    let core = core_with(CoreConfig {
        pd: kvpick_core::PdConfig {
            transfer_block_cost: 0.0,
            ..Default::default()
        },
        ..CoreConfig::default()
    });
    let with_role = |name: &str, port: u16, role: kvpick_core::Role| WorkerSpec {
        roles: vec![role],
        ..spec(name, "m", ports(&[port]))
    };
    core.apply_snapshot(vec![
        with_role("p", 1, kvpick_core::Role::Prefill),
        with_role("d", 2, kvpick_core::Role::Decode),
    ])
    .unwrap();
    let requests = |core: &SelectionCore| -> Vec<u64> {
        let mut v: Vec<(String, u64)> = core
            .list_workers(None)
            .iter()
            .map(|w| (w.record.spec.name.clone(), w.loads[0].active_requests))
            .collect();
        v.sort();
        v.into_iter().map(|(_, n)| n).collect()
    };
    let long = |id: &str, first: u32| SelectionRequest {
        prompt: PromptInput::Tokens((first..first + 2048).collect()),
        ..request(id, Some("m"))
    };
    let gauge = |core: &SelectionCore, worker: &str| {
        core.metrics()
            .selection
            .inflight
            .with_label_values(&[worker, "0"])
            .get()
    };
    let first = core.select_and_reserve(&long("r1", 0)).unwrap();
    assert_eq!(
        first
            .selection()
            .prefill
            .as_ref()
            .map(|p| p.worker_name.as_str()),
        Some("p")
    );
    assert_eq!(
        requests(&core),
        vec![1, 1],
        "decode d and prefill p both booked"
    );
    assert_eq!((gauge(&core, "d"), gauge(&core, "p")), (1, 1));
    first.mark_prefill_complete();
    first.mark_prefill_complete();
    assert_eq!(requests(&core), vec![1, 0]);
    assert_eq!((gauge(&core, "d"), gauge(&core, "p")), (1, 0));
    drop(first);
    assert_eq!(requests(&core), vec![0, 0]);
    assert_eq!(core.metrics().selection.inflight_total.get(), 0);
    assert!(!core.free("r1"), "freed exactly once");
    // The same prompt again: the decode rank caches it now, so it prefills the short rest itself.
    let again = core.select_and_reserve(&long("r3", 0)).unwrap();
    assert!(again.selection().prefill.is_none());
    drop(again);
    // Another prompt, dropped before its first token: both ranks at once.
    let second = core.select_and_reserve(&long("r2", 100_000)).unwrap();
    assert_eq!(requests(&core), vec![1, 1]);
    drop(second);
    assert_eq!(requests(&core), vec![0, 0]);
    assert_eq!((gauge(&core, "d"), gauge(&core, "p")), (0, 0));
    assert_eq!(core.live_bookings(), 0);
}
