//! The real `kvpick serve` binary against loopback vLLM-like engines (`kvpick_testkit::engine`:
//! KV-event PUB, replay ROUTER, HTTP port), observed only from outside, as an operator (and the
//! real-vLLM tier) sees it: `/metrics`, `ListWorkers`, the log.
//!
//! - A killed engine: `kvpick_rank_unreachable` within 2 s, `kvpick_kv_subscriptions` 0, one
//!   WARN for the lost subscription and none per reconnect attempt; its restart: cleared
//!   (`kvpick_kv_resets_total`) and back in the picks.
//! - Block sizes: a worker that declares none shows the one learned from the events in
//!   `ListWorkers`; a worker that declares another than its engine publishes gets one ERROR
//!   line, `kv_events_block_size` in `ListWorkers` and `kvpick_rank_kv_block_size_mismatch`.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test harness: a panic is a failure report

mod common;

use std::time::{Duration, Instant};

use kvpick_core::event::{KvEvent, Medium};
use kvpick_testkit::engine::FakeEngine;
use kvpick_testkit::prom;

fn store(p: u64, block_size: u32) -> KvEvent {
    KvEvent::BlockStored {
        block_hashes: (0..2).map(|b| p * 1_000 + b).collect(),
        parent_block_hash: None,
        token_ids: (0..2 * block_size)
            .map(|t| p as u32 * 100_000 + t)
            .collect(),
        block_size,
        lora_id: None,
        medium: Medium::Gpu,
        lora_name: None,
        cache_salt: None,
        group_idx: None,
        media: Vec::new(),
    }
}

fn metric(serve: &common::Serve, name: &str, labels: &[(&str, &str)]) -> f64 {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", serve.metrics)).unwrap();
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
        .unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    prom::sum(&prom::parse(&text), name, labels)
}

/// Polls `cond` every 10 ms; fails past `within`. Returns how long it took.
async fn within(what: &str, bound: Duration, mut cond: impl FnMut() -> bool) -> Duration {
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < bound, "not within {bound:?}: {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    start.elapsed()
}

fn log(serve: &common::Serve) -> String {
    std::fs::read_to_string(serve.dir.join("kvpick.log")).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_engine_leaves_the_picks_quietly_and_its_restart_comes_back_cleared() {
    let mut engine = FakeEngine::start(0).await.unwrap();
    let other = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let ports = engine.ports;
    let catalog = format!(
        "workers:\n  - {{name: a, model: m, address: 127.0.0.1, ports: [{}], kv_events: \"{}\", kv_replay: \"{}\"}}\n  - {{name: b, model: m, address: 127.0.0.1, ports: [{}]}}\n",
        ports.http,
        ports.events_endpoint(),
        ports.replay_endpoint(),
        other.local_addr().unwrap().port(),
    );
    let serve = common::start_static(&catalog, &[]);
    engine.subscribed(1).await;
    engine.publish(&[store(1, 16)], true);
    let labels = [("worker", "a"), ("rank", "0")];
    within("event applied", Duration::from_secs(20), || {
        metric(&serve, "kvpick_kv_events_total", &[("result", "applied")]) >= 1.0
    })
    .await;
    assert_eq!(metric(&serve, "kvpick_kv_subscriptions", &[]), 1.0);

    let ports = engine.stop().await;
    let took = within("a unreachable", Duration::from_secs(2), || {
        metric(&serve, "kvpick_rank_unreachable", &labels) == 1.0
    })
    .await;
    assert_eq!(metric(&serve, "kvpick_kv_subscriptions", &[]), 0.0);
    let mut api = common::api(serve.grpc).await;
    let a = common::list_workers(&mut api)
        .await
        .into_iter()
        .find(|w| w.name == "a")
        .unwrap();
    assert!(a.ranks[0].unreachable, "ListWorkers shows it");
    // The engine stays down long enough for several of kvpick's reconnect attempts (0.1, 0.2,
    // 0.4, 0.8 s apart, each up to 1 s): an outage, not a synchronisation.
    tokio::time::sleep(Duration::from_secs(3)).await;

    let mut engine = FakeEngine::start_at(ports, 0).await.unwrap();
    engine.subscribed(1).await;
    within("a back", Duration::from_secs(10), || {
        metric(&serve, "kvpick_rank_unreachable", &labels) == 0.0
    })
    .await;
    assert_eq!(metric(&serve, "kvpick_kv_resets_total", &[]), 1.0);
    assert_eq!(
        metric(&serve, "kvpick_rank_unreachable_total", &[("worker", "a")]),
        1.0
    );
    engine.publish(&[store(2, 16)], true);
    within("the new run applied", Duration::from_secs(10), || {
        metric(&serve, "kvpick_kv_events_total", &[("result", "applied")]) >= 2.0
    })
    .await;

    let log = log(&serve);
    let count = |needle: &str| log.lines().filter(|l| l.contains(needle)).count();
    assert_eq!(count("KV-event subscription lost"), 1, "{log}");
    assert_eq!(count("engine unreachable"), 1, "{log}");
    assert_eq!(count("KV-event subscription restored"), 1, "{log}");
    assert_eq!(
        count("Reconnection attempt"),
        0,
        "zeromq's own retries: {log}"
    );
    assert_eq!(count("WARN"), 2, "one per loss and one per rank out: {log}");
    eprintln!("out of the picks {took:?} after the kill");
    engine.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn block_sizes_learned_or_mismatched_are_shown_and_logged_once() {
    let mut learned = FakeEngine::start(0).await.unwrap();
    let mut wrong = FakeEngine::start(0).await.unwrap();
    let catalog = format!(
        "workers:\n  - {{name: l, model: m, address: 127.0.0.1, ports: [{}], kv_events: \"{}\"}}\n  - {{name: w, model: n, address: 127.0.0.1, ports: [{}], block_size: 16, kv_events: \"{}\"}}\n",
        learned.ports.http,
        learned.ports.events_endpoint(),
        wrong.ports.http,
        wrong.ports.events_endpoint(),
    );
    let serve = common::start_static(&catalog, &[]);
    learned.subscribed(1).await;
    wrong.subscribed(1).await;
    learned.publish(&[store(1, 32)], true);
    for p in 0..5 {
        wrong.publish(&[store(p, 32)], true);
    }
    within("mismatches counted", Duration::from_secs(20), || {
        metric(&serve, "kvpick_kv_block_size_mismatch_total", &[]) >= 5.0
    })
    .await;
    let mut api = common::api(serve.grpc).await;
    let workers = common::list_workers(&mut api).await;
    let by_name = |n: &str| workers.iter().find(|w| w.name == n).unwrap().clone();
    assert_eq!(by_name("l").block_size, 32, "learned from the events");
    assert_eq!(by_name("l").ranks[0].kv_events_block_size, 0);
    assert_eq!(by_name("w").block_size, 16, "declared");
    assert_eq!(by_name("w").ranks[0].kv_events_block_size, 32);
    assert_eq!(
        metric(
            &serve,
            "kvpick_rank_kv_block_size_mismatch",
            &[("worker", "w"), ("rank", "0")]
        ),
        32.0
    );
    let log = log(&serve);
    let errors: Vec<&str> = log.lines().filter(|l| l.contains("ERROR")).collect();
    assert_eq!(
        errors.len(),
        1,
        "once per rank and size, not per event: {log}"
    );
    assert!(errors[0].contains("engine_block_size=32"), "{}", errors[0]);
    learned.stop().await;
    wrong.stop().await;
}
