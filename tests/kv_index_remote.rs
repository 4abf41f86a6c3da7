//! `--kv-index-remote` with two real `kvpick serve` processes and two loopback vLLM-like engines
//! (`kvpick_testkit::engine`: vLLM's msgpack KV events over ZeroMQ): the indexer subscribes to
//! the engines, the replica subscribes to nothing and routes on the indexer's `OverlapScores`.
//!
//! - Each engine has one subscriber (the indexer's) while both processes run; the replica's
//!   `kvpick_kv_subscriptions` and `kvpick_kv_events_total` stay 0.
//! - The replica picks the rank whose engine announced the prompt's blocks, through the API and
//!   through ext_proc (answers counted).
//! - The indexer killed: the replica keeps answering, approximately, the fallback counted and
//!   `kvpick_kv_index_remote_up` 0. The indexer back on the same port: the probe sees it
//!   (`up` 1) and the next pick routes on its index again.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test harness: a panic is a failure report

mod common;

use kvpick::proto::SelectRequest;
use kvpick_core::event::{KvEvent, Medium};
use kvpick_testkit::engine::FakeEngine;

use common::{prompt, until};

const BS: u32 = 16;

/// `blocks` full blocks of prompt `p`'s tokens, stored on the engine's GPU.
fn store(p: u32, blocks: u32) -> KvEvent {
    common::stored(p, blocks, BS, Medium::Gpu)
}

fn metric(serve: &common::Serve, name: &str, labels: &[(&str, &str)]) -> f64 {
    common::metric_sum(serve.metrics, name, labels)
}

/// The replica's pick (a dry run: nothing booked, so nothing predicted) of prompt `p`.
async fn pick(api: &mut common::Api, p: u32, blocks: u32) -> String {
    api.select(SelectRequest {
        model: "m".into(),
        token_ids: prompt(p, blocks * BS + 1),
        ..Default::default()
    })
    .await
    .unwrap()
    .into_inner()
    .primary
    .unwrap()
    .address
}

/// The replica's pick of prompt `p` through ext_proc, as Envoy asks for it: the destination
/// header of the headers response.
async fn extproc_pick(grpc: u16, p: u32, blocks: u32) -> String {
    let body = serde_json::json!({"model": "m", "prompt": prompt(p, blocks * BS + 1)});
    let routed = common::extproc_route(grpc, &[], &body).await;
    routed
        .header("x-gateway-destination-endpoint")
        .expect("a destination")
        .to_string()
}

/// The indexer: a plain `serve` over the catalog, on `grpc_port` (0: any).
fn indexer(dir: std::path::PathBuf, catalog: &std::path::Path, grpc_port: u16) -> common::Serve {
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_kvpick"));
    command
        .args(["serve", "--bind", "127.0.0.1"])
        .args(["--grpc-port", &grpc_port.to_string()])
        .args(["--grpc-health-port", "0", "--metrics-port", "0"]);
    common::start_command(dir, command, |c| {
        c.args(["--secure-serving=false", "--catalog-poll-ms", "50"])
            .arg("--config")
            .arg(catalog);
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_routes_on_the_indexers_events_without_subscribing_and_survives_its_loss() {
    let mut a = FakeEngine::start(0).await.unwrap();
    let mut b = FakeEngine::start(0).await.unwrap();
    let catalog = format!(
        "workers:\n  - {{name: a, model: m, address: 127.0.0.1, ports: [{}], block_size: {BS}, kv_events: \"{}\"}}\n  - {{name: b, model: m, address: 127.0.0.1, ports: [{}], block_size: {BS}, kv_events: \"{}\"}}\n",
        a.ports.http,
        a.ports.events_endpoint(),
        b.ports.http,
        b.ports.events_endpoint(),
    );
    // Outlives the first indexer's directory (removed when it is killed).
    let catalog_dir = common::temp_dir("kvpick-catalog");
    let catalog_path = catalog_dir.join("catalog.yaml");
    std::fs::write(&catalog_path, &catalog).unwrap();
    let index = indexer(common::temp_dir("kvpick-indexer"), &catalog_path, 0);
    let grpc = index.grpc;
    let remote = format!("http://127.0.0.1:{grpc}");
    let replica = common::start_static(&catalog, &["--kv-index-remote", &remote]);
    common::wait_readiness(
        replica.health,
        tonic_health::pb::health_check_response::ServingStatus::Serving,
    )
    .await;
    a.subscribed(1).await;
    b.subscribed(1).await;
    until("the replica's probe sees the indexer", || {
        metric(&replica, "kvpick_kv_index_remote_up", &[]) == 1.0
    })
    .await;

    // Prompt 1's four blocks are on b, by b's own events, which only the indexer reads.
    b.publish(&[store(1, 4)], true);
    until("the indexer applied b's store", || {
        metric(&index, "kvpick_kv_events_total", &[("result", "applied")]) >= 1.0
    })
    .await;
    let mut api = common::api(replica.grpc).await;
    let b_address = format!("127.0.0.1:{}", b.ports.http);
    for _ in 0..4 {
        assert_eq!(pick(&mut api, 1, 4).await, b_address);
    }
    // The same through ext_proc (Envoy's path).
    assert_eq!(extproc_pick(replica.grpc, 1, 4).await, b_address);
    assert_eq!(
        metric(&replica, "kvpick_kv_index_remote_answers_total", &[]),
        5.0
    );
    // One subscription per engine: the indexer's.
    assert_eq!((a.subscribers(), b.subscribers()), (1, 1));
    assert_eq!(metric(&index, "kvpick_kv_subscriptions", &[]), 2.0);
    assert_eq!(metric(&replica, "kvpick_kv_subscriptions", &[]), 0.0);
    assert_eq!(metric(&replica, "kvpick_kv_events_total", &[]), 0.0);

    // The indexer dies: the replica keeps answering, approximately, and says why.
    drop(index);
    let address = pick(&mut api, 1, 4).await;
    assert!(address.starts_with("127.0.0.1:"), "{address}");
    assert!(metric(&replica, "kvpick_kv_index_remote_fallbacks_total", &[]) >= 1.0);
    assert_eq!(metric(&replica, "kvpick_kv_index_remote_up", &[]), 0.0);
    let answered = metric(&replica, "kvpick_kv_index_remote_answers_total", &[]);
    assert_eq!(answered, 5.0);
    pick(&mut api, 1, 4).await;
    assert!(
        metric(
            &replica,
            "kvpick_kv_index_remote_fallbacks_total",
            &[("reason", "down")]
        ) >= 1.0,
        "while down, picks do not wait on the indexer"
    );

    // Back on the same port: its events again, and the replica uses it once its probe says so.
    let index = indexer(common::temp_dir("kvpick-indexer"), &catalog_path, grpc);
    a.subscribed(2).await;
    until("the replica's probe sees the indexer again", || {
        metric(&replica, "kvpick_kv_index_remote_up", &[]) == 1.0
    })
    .await;
    a.publish(&[store(2, 3)], true);
    until("the new indexer applied a's store", || {
        metric(&index, "kvpick_kv_events_total", &[("result", "applied")]) >= 1.0
    })
    .await;
    assert_eq!(
        pick(&mut api, 2, 3).await,
        format!("127.0.0.1:{}", a.ports.http)
    );
    assert_eq!(
        metric(&replica, "kvpick_kv_index_remote_answers_total", &[]),
        answered + 1.0
    );
    assert_eq!(metric(&replica, "kvpick_kv_subscriptions", &[]), 0.0);
    let _ = std::fs::remove_dir_all(catalog_dir);
}

/// Subscriptions per engine with three replicas: three when each subscribes itself, one (the
/// indexer's) when they read it with `--kv-index-remote`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_replicas_on_one_indexer_cost_each_engine_one_subscription() {
    let catalog_of = |e: &FakeEngine| {
        format!(
            "workers:\n  - {{name: a, model: m, address: 127.0.0.1, ports: [{}], block_size: {BS}, kv_events: \"{}\"}}\n",
            e.ports.http,
            e.ports.events_endpoint(),
        )
    };
    // Each replica subscribing itself.
    let a = FakeEngine::start(0).await.unwrap();
    let plain: Vec<common::Serve> = (0..3)
        .map(|_| common::start_static(&catalog_of(&a), &[]))
        .collect();
    a.subscribed(3).await;
    assert_eq!(a.subscribers(), 3);
    drop(plain);

    // One indexer, three replicas reading it (another engine: a fresh count).
    let b = FakeEngine::start(0).await.unwrap();
    let catalog = catalog_of(&b);
    let index = common::start_static(&catalog, &[]);
    b.subscribed(1).await;
    let remote = format!("http://127.0.0.1:{}", index.grpc);
    let replicas: Vec<common::Serve> = (0..3)
        .map(|_| common::start_static(&catalog, &["--kv-index-remote", &remote]))
        .collect();
    for r in &replicas {
        // Up: it has started (its engine feeds, none, before its ports) and reached the indexer.
        until("a replica reaches the indexer", || {
            metric(r, "kvpick_kv_index_remote_up", &[]) == 1.0
        })
        .await;
        assert_eq!(metric(r, "kvpick_kv_subscriptions", &[]), 0.0);
    }
    assert_eq!(b.subscribers(), 1, "the indexer's alone");
    assert_eq!(metric(&index, "kvpick_kv_subscriptions", &[]), 1.0);
}

/// An indexer serving its gRPC port over TLS (kvpick's default): a replica verifying its
/// certificate against `--kv-index-remote-ca-file`, one skipping the check (`#insecure`), and one
/// that cannot verify it (the system's roots), which routes approximately and says why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_indexer_over_tls_is_verified_against_the_given_ca() {
    let mut b = FakeEngine::start(0).await.unwrap();
    let catalog = format!(
        "workers:\n  - {{name: a, model: m, address: 127.0.0.1, ports: [1], block_size: {BS}}}\n  - {{name: b, model: m, address: 127.0.0.1, ports: [{}], block_size: {BS}, kv_events: \"{}\"}}\n",
        b.ports.http,
        b.ports.events_endpoint(),
    );
    let certs = common::temp_dir("kvpick-indexer-certs");
    let cert = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).unwrap();
    std::fs::write(certs.join("tls.key"), cert.signing_key.serialize_pem()).unwrap();
    std::fs::write(certs.join("tls.crt"), cert.cert.pem()).unwrap();
    let dir = common::temp_dir("kvpick-indexer");
    std::fs::write(dir.join("catalog.yaml"), &catalog).unwrap();
    let config = dir.join("catalog.yaml");
    let index = common::start_with(dir, |c| {
        c.args(["--catalog-poll-ms", "50", "--cert-path"])
            .arg(&certs)
            .arg("--config")
            .arg(config);
    });
    b.subscribed(1).await;
    b.publish(&[store(3, 2)], true);
    until("the indexer applied b's store", || {
        metric(&index, "kvpick_kv_events_total", &[("result", "applied")]) >= 1.0
    })
    .await;
    let b_address = format!("127.0.0.1:{}", b.ports.http);
    let ca = certs.join("tls.crt");
    let verified = format!("https://localhost:{}", index.grpc);
    let insecure = format!("https://127.0.0.1:{}#insecure", index.grpc);
    for flags in [
        vec![
            "--kv-index-remote",
            &verified,
            "--kv-index-remote-ca-file",
            ca.to_str().unwrap(),
        ],
        vec!["--kv-index-remote", &insecure],
    ] {
        let replica = common::start_static(&catalog, &flags);
        until("the replica's probe sees the indexer", || {
            metric(&replica, "kvpick_kv_index_remote_up", &[]) == 1.0
        })
        .await;
        let mut api = common::api(replica.grpc).await;
        assert_eq!(pick(&mut api, 3, 2).await, b_address, "{flags:?}");
        assert_eq!(
            metric(&replica, "kvpick_kv_index_remote_answers_total", &[]),
            1.0
        );
    }
    // The certificate is nobody the system trusts: no answer, the pick approximate.
    let replica = common::start_static(&catalog, &["--kv-index-remote", &verified]);
    let mut api = common::api(replica.grpc).await;
    pick(&mut api, 3, 2).await;
    assert!(metric(&replica, "kvpick_kv_index_remote_fallbacks_total", &[]) >= 1.0);
    assert_eq!(
        metric(&replica, "kvpick_kv_index_remote_answers_total", &[]),
        0.0
    );
    let _ = std::fs::remove_dir_all(certs);
}
