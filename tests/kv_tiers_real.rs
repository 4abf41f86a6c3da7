//! KV held beyond a rank's own tiers, through the real `kvpick serve` binary and loopback
//! vLLM-like engines (`kvpick_testkit::engine`: vLLM's msgpack KV events over ZeroMQ):
//!
//! - The shared tier (`--shared-cache-multiplier`): a rank's `BlockStored` with medium `EXTERNAL`
//!   fills the model's shared set (`kvpick_shared_tier_blocks`), a booked pick over the prompt
//!   reads it (`kvpick_shared_tier_picks_total`), the matching `BlockRemoved` empties it. Without
//!   the flag the same events leave the shared set empty.
//! - KV transfer hints (`--kv-transfer-hints`): an ext_proc pick pinned away from the rank
//!   holding the prompt names the holder in `x-kv-cache-source-host-port` (and, with
//!   `--kv-transfer-p2p-port`, in the body's `kv_transfer_params.remote_kv_source`), counted in
//!   `kvpick_kv_transfer_hints_total`; without the flag neither appears.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test harness: a panic is a failure report

mod common;

use kvpick_core::event::{KvEvent, Medium};
use kvpick_testkit::engine::FakeEngine;
use tonic_health::pb::health_check_response::ServingStatus;

use common::{engine_hashes, prompt, stored, until};

const BS: u32 = 16;
const BLOCKS: u32 = 4;

fn external() -> Medium {
    Medium::Other("EXTERNAL".into())
}

/// Two workers `a` and `b` of model `m`, each one rank fed by its engine's events.
fn catalog(a: &FakeEngine, b: &FakeEngine) -> String {
    format!(
        "workers:\n  - {{name: a, model: m, address: 127.0.0.1, ports: [{}], block_size: {BS}, kv_events: \"{}\"}}\n  - {{name: b, model: m, address: 127.0.0.1, ports: [{}], block_size: {BS}, kv_events: \"{}\"}}\n",
        a.ports.http,
        a.ports.events_endpoint(),
        b.ports.http,
        b.ports.events_endpoint(),
    )
}

fn metric(serve: &common::Serve, name: &str, labels: &[(&str, &str)]) -> f64 {
    common::metric_sum(serve.metrics, name, labels)
}

/// `kvpick serve` over `catalog` with `flags`, ready (its catalog applied).
async fn serve(catalog: &str, flags: &[&str]) -> common::Serve {
    let serve = common::start_static(catalog, flags);
    common::wait_readiness(serve.health, ServingStatus::Serving).await;
    serve
}

/// Waits until `serve` has applied `n` event batches.
async fn applied(serve: &common::Serve, n: f64) {
    until("the engine's events applied", || {
        metric(serve, "kvpick_kv_events_total", &[("result", "applied")]) >= n
    })
    .await;
}

/// Prompt `p` (its `BLOCKS` full blocks and one more token) as a `/v1/completions` body.
fn completion(p: u32) -> serde_json::Value {
    serde_json::json!({"model": "m", "prompt": prompt(p, BLOCKS * BS + 1)})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn external_stores_fill_the_models_shared_tier_and_removals_empty_it() {
    let mut a = FakeEngine::start(0).await.unwrap();
    let b = FakeEngine::start(0).await.unwrap();
    let catalog = catalog(&a, &b);
    let shared = serve(&catalog, &["--shared-cache-multiplier", "0.5"]).await;
    // The same events without a shared tier: EXTERNAL is then the storing rank's disk tier.
    let plain = serve(&catalog, &[]).await;
    a.subscribed(2).await;
    b.subscribed(2).await;
    let blocks = |s: &common::Serve| metric(s, "kvpick_shared_tier_blocks", &[("model", "m")]);
    assert_eq!(blocks(&shared), 0.0);

    a.publish(&[stored(1, BLOCKS, BS, external())], true);
    until("the shared tier holds the stored blocks", || {
        blocks(&shared) == f64::from(BLOCKS)
    })
    .await;
    applied(&plain, 1.0).await;
    assert_eq!(blocks(&plain), 0.0, "no shared tier without the flag");

    // A booked pick over the prompt reads the shared tier (whichever rank it picks: both can
    // load the blocks); a pick over another prompt does not.
    let picks = |s: &common::Serve| metric(s, "kvpick_shared_tier_picks_total", &[]);
    let routed = common::extproc_route(shared.grpc, &[], &completion(2)).await;
    assert!(routed.header("x-gateway-destination-endpoint").is_some());
    assert_eq!(picks(&shared), 0.0, "prompt 2 has no shared blocks");
    let routed = common::extproc_route(shared.grpc, &[], &completion(1)).await;
    let picked = routed.header("x-gateway-destination-endpoint").unwrap();
    let ranks = [
        format!("127.0.0.1:{}", a.ports.http),
        format!("127.0.0.1:{}", b.ports.http),
    ];
    assert!(ranks.iter().any(|r| r == picked), "{picked}");
    assert_eq!(picks(&shared), 1.0);
    assert_eq!(picks(&plain), 0.0);

    // Removed from the shared store: the shared tier is empty again.
    a.publish(
        &[KvEvent::BlockRemoved {
            block_hashes: engine_hashes(1, BLOCKS),
            medium: external(),
            group_idx: None,
        }],
        true,
    );
    until("the shared tier lost the removed blocks", || {
        blocks(&shared) == 0.0
    })
    .await;
    assert_eq!(
        metric(&shared, "kvpick_kv_events_total", &[("result", "applied")]),
        2.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pick_away_from_the_holder_names_it_only_with_transfer_hints() {
    let mut a = FakeEngine::start(0).await.unwrap();
    let b = FakeEngine::start(0).await.unwrap();
    let catalog = catalog(&a, &b);
    let hints = serve(
        &catalog,
        &[
            "--allow-pins",
            "--kv-transfer-hints",
            "--kv-transfer-p2p-port",
            "5710",
        ],
    )
    .await;
    let plain = serve(&catalog, &["--allow-pins"]).await;
    a.subscribed(2).await;
    b.subscribed(2).await;

    // Prompt 1's blocks are on a's GPU, by a's own events.
    a.publish(&[stored(1, BLOCKS, BS, Medium::Gpu)], true);
    applied(&hints, 1.0).await;
    applied(&plain, 1.0).await;
    let a_address = format!("127.0.0.1:{}", a.ports.http);
    let b_address = format!("127.0.0.1:{}", b.ports.http);

    let mut api = common::api(hints.grpc).await;
    let b_id = common::list_workers(&mut api)
        .await
        .into_iter()
        .find(|w| w.name == "b")
        .unwrap()
        .worker_id
        .to_string();
    let pinned = [
        ("x-dynamo-worker-instance-id", b_id.as_str()),
        ("x-request-id", "pull-1"),
        // A client's own hint never passes.
        ("x-kv-cache-source-host-port", "6.6.6.6:1"),
    ];
    let hints_total = |s: &common::Serve| metric(s, "kvpick_kv_transfer_hints_total", &[]);

    // Unpinned, the pick is the holder itself: no hint.
    let routed = common::extproc_route(hints.grpc, &[], &completion(1)).await;
    assert_eq!(
        routed.header("x-gateway-destination-endpoint"),
        Some(a_address.as_str())
    );
    assert_eq!(routed.header("x-kv-cache-source-host-port"), None);
    assert_eq!(hints_total(&hints), 0.0);

    // Pinned to b, which holds none of it: b is told to pull it from a.
    let routed = common::extproc_route(hints.grpc, &pinned, &completion(1)).await;
    assert_eq!(
        routed.header("x-gateway-destination-endpoint"),
        Some(b_address.as_str())
    );
    assert_eq!(
        routed.header("x-kv-cache-source-host-port"),
        Some(a_address.as_str())
    );
    assert_eq!(hints_total(&hints), 1.0);
    let body: serde_json::Value = serde_json::from_slice(&routed.body).unwrap();
    assert_eq!(
        body["kv_transfer_params"]["remote_kv_source"],
        serde_json::json!({"kv_request_id": "pull-1", "remote_host": "127.0.0.1", "remote_port": 5710})
    );
    assert_eq!(body["prompt"], completion(1)["prompt"], "the rest as sent");

    // The same pinned request without --kv-transfer-hints: no hint anywhere.
    let routed = common::extproc_route(plain.grpc, &pinned, &completion(1)).await;
    assert_eq!(
        routed.header("x-gateway-destination-endpoint"),
        Some(b_address.as_str())
    );
    assert_eq!(routed.header("x-kv-cache-source-host-port"), None);
    let body: serde_json::Value = serde_json::from_slice(&routed.body).unwrap();
    assert!(body.get("kv_transfer_params").is_none(), "{body}");
    assert_eq!(hints_total(&plain), 0.0);
}
