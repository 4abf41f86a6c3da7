//! The Kubernetes source end to end without a cluster: a fake Kubernetes API server
//! (`kvpick_testkit::apiserver`: LIST with resourceVersion, streaming WATCH of newline-delimited
//! events, 410 Gone to force a relist, the InferencePool and its pods) on 127.0.0.1, the real
//! `kvpick serve` binary talking to it with the
//! real `kube::Client`, and assertions on the catalog the core ends up with (gRPC `ListWorkers`),
//! each within a bounded wait (polling with a deadline; no sleeps as synchronisation).

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test/bench harness: a panic is a failure report

use std::collections::BTreeMap;
use std::process::Command;
use std::time::{Duration, Instant};

use kvpick_testkit::apiserver::{pod, pool_object, Fake, NAMESPACE as NS, POOL};
use serde_json::json;
use tonic_health::pb::health_check_response::ServingStatus;

// ---------------------------------------------------------------------------------------------
// kvpick process and assertions
// ---------------------------------------------------------------------------------------------

mod common;

use common::{readiness, wait_readiness, Serve};

fn start(fake: &Fake, extra: &[&str]) -> Serve {
    let url = fake.url.clone();
    common::start_with(common::temp_dir("kvpick-kube"), |c| {
        c.args(["--secure-serving=false", "--kv-events", "off"])
            .args(["--kube-api-url", &url, "--pool-namespace", NS])
            .args(extra)
            .env("RUST_LOG", "info,kvpick=debug")
            .env_remove("NAMESPACE");
    })
}

use common::Api;

async fn api(serve: &Serve) -> Api {
    common::api(serve.grpc).await
}

/// The schedulable catalog as `name addr addr...` lines (one address per rank, in rank order),
/// sorted. Draining workers (NotReady or terminating pods, kept for their in-flight load) are
/// left out; [`draining`] lists them.
async fn catalog(api: &mut Api) -> Vec<String> {
    let workers = common::list_workers(api).await;
    let mut out: Vec<String> = workers
        .iter()
        .filter(|w| w.lifecycle != "Draining")
        .map(|w| {
            assert_eq!(w.namespace, NS);
            assert_eq!(
                w.worker_id,
                kvpick::sources::catalog::worker_id(NS, &w.name)
            );
            let mut ranks = w.ranks.clone();
            ranks.sort_by_key(|r| r.dp_rank);
            let addrs: Vec<String> = ranks.iter().map(|r| r.address.clone()).collect();
            format!("{} {}", w.name, addrs.join(" "))
        })
        .collect();
    out.sort();
    out
}

/// Names of the draining workers, sorted.
async fn draining(api: &mut Api) -> Vec<String> {
    let mut out: Vec<String> = common::list_workers(api)
        .await
        .into_iter()
        .filter(|w| w.lifecycle == "Draining")
        .map(|w| w.name)
        .collect();
    out.sort();
    out
}

const WAIT: Duration = Duration::from_secs(20);

/// Polls `ListWorkers` until the catalog equals `want`, within [`WAIT`].
async fn expect_catalog(api: &mut Api, what: &str, want: &[&str]) -> Duration {
    let start = Instant::now();
    let mut last = Vec::new();
    while start.elapsed() < WAIT {
        last = catalog(api).await;
        if last == want {
            return start.elapsed();
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    panic!("{what}: catalog never became {want:?}; last seen {last:?}");
}

// ---------------------------------------------------------------------------------------------
// Cases
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pool_pods_lifecycle_dp_shapes_readiness_and_latency() {
    let fake = Fake::start(true).await.unwrap();
    fake.put_pool(pool_object(json!({"app": "vllm"}), &[8000, 8001]));
    fake.put_pod(pod("a", "10.0.0.1").build());
    fake.put_pod(pod("b", "10.0.0.2").ready(false).build());
    fake.put_pod(pod("other", "10.0.0.9").label("app", "other").build());
    let serve = start(&fake, &["--pool-name", POOL]);

    // Readiness: NOT_SERVING until the first full sync (the pod LIST is held back).
    assert_eq!(readiness(serve.health).await, ServingStatus::NotServing);
    let mut api = api(&serve).await;
    assert!(catalog(&mut api).await.is_empty());
    assert_eq!(readiness(serve.health).await, ServingStatus::NotServing);
    fake.open_lists();
    wait_readiness(serve.health, ServingStatus::Serving).await;
    expect_catalog(&mut api, "first sync", &["a 10.0.0.1:8000 10.0.0.1:8001"]).await;

    // Ready / NotReady.
    fake.put_pod(pod("b", "10.0.0.2").build());
    expect_catalog(
        &mut api,
        "b ready",
        &[
            "a 10.0.0.1:8000 10.0.0.1:8001",
            "b 10.0.0.2:8000 10.0.0.2:8001",
        ],
    )
    .await;
    fake.put_pod(pod("b", "10.0.0.2").ready(false).build());
    expect_catalog(&mut api, "b not ready", &["a 10.0.0.1:8000 10.0.0.1:8001"]).await;
    assert_eq!(draining(&mut api).await, ["b"], "a NotReady pod drains");

    // No IP yet, then an IP; IP change.
    fake.put_pod(pod("c", "").no_ip().build());
    fake.put_pod(pod("b", "10.0.0.2").build());
    expect_catalog(
        &mut api,
        "c without ip",
        &[
            "a 10.0.0.1:8000 10.0.0.1:8001",
            "b 10.0.0.2:8000 10.0.0.2:8001",
        ],
    )
    .await;
    fake.put_pod(pod("b", "10.0.0.22").build());
    expect_catalog(
        &mut api,
        "b ip change",
        &[
            "a 10.0.0.1:8000 10.0.0.1:8001",
            "b 10.0.0.22:8000 10.0.0.22:8001",
        ],
    )
    .await;

    // Terminating, then deleted.
    fake.put_pod(pod("b", "10.0.0.22").terminating().build());
    expect_catalog(
        &mut api,
        "b terminating",
        &["a 10.0.0.1:8000 10.0.0.1:8001"],
    )
    .await;
    assert!(fake.delete_pod("b"), "pod b exists");
    assert!(fake.delete_pod("c"), "pod c exists");
    expect_catalog(&mut api, "b deleted", &["a 10.0.0.1:8000 10.0.0.1:8001"]).await;

    // UID replacement at the same name: the old pod goes, its successor (new IP) joins when Ready.
    fake.put_pod(pod("a", "10.0.0.1").uid("uid-a1").build());
    assert!(fake.delete_pod("a"), "pod a exists");
    fake.put_pod(pod("a", "10.0.0.11").uid("uid-a2").ready(false).build());
    expect_catalog(&mut api, "a replaced, not ready", &[]).await;
    wait_readiness(serve.health, ServingStatus::NotServing).await;
    fake.put_pod(pod("a", "10.0.0.11").uid("uid-a2").build());
    expect_catalog(
        &mut api,
        "a replaced, ready",
        &["a 10.0.0.11:8000 10.0.0.11:8001"],
    )
    .await;

    // DP shapes: multiplexed ranks (annotation or label) on the first target port; active-ports.
    fake.put_pod(
        pod("mux", "10.0.1.1")
            .annotation("kvpick.io/data-parallel-size", "3")
            .build(),
    );
    fake.put_pod(
        pod("muxl", "10.0.1.2")
            .label("kvpick.io/data-parallel-size", "2")
            .build(),
    );
    fake.put_pod(
        pod("act", "10.0.1.3")
            .annotation("inference.networking.k8s.io/active-ports", "8001")
            .annotation("kvpick.io/kv-events-port", "6000")
            .build(),
    );
    expect_catalog(
        &mut api,
        "dp shapes",
        &[
            "a 10.0.0.11:8000 10.0.0.11:8001",
            "act 10.0.1.3:8001",
            "mux 10.0.1.1:8000 10.0.1.1:8000 10.0.1.1:8000",
            "muxl 10.0.1.2:8000 10.0.1.2:8000",
        ],
    )
    .await;
    // The live active port keeps its rank number (targetPorts[1] is rank 1).
    let act = common::list_workers(&mut api)
        .await
        .into_iter()
        .find(|w| w.name == "act")
        .unwrap();
    assert_eq!(act.ranks.len(), 1);
    assert_eq!(act.ranks[0].dp_rank, 1);
    let workers = common::list_workers(&mut api).await;
    let kv: BTreeMap<&str, &str> = workers
        .iter()
        .map(|w| (w.name.as_str(), w.kv_events.as_str()))
        .collect();
    assert_eq!(kv["a"], "tcp://10.0.0.11:5557");
    assert_eq!(kv["act"], "tcp://10.0.1.3:6000");
    assert_eq!(workers.iter().find(|w| w.name == "mux").unwrap().model, "m");

    // Latency: from the watch event leaving the fake server to ListWorkers showing it.
    let mut samples = Vec::new();
    for i in 0..21u32 {
        let ip = format!("10.0.2.{}", i + 1);
        let sent = fake.put_pod(
            pod("act", &ip)
                .annotation("inference.networking.k8s.io/active-ports", "8001")
                .build(),
        );
        let want = format!("act {ip}:8001");
        let deadline = sent + WAIT;
        loop {
            if catalog(&mut api).await.contains(&want) {
                samples.push(sent.elapsed());
                break;
            }
            assert!(
                Instant::now() < deadline,
                "latency sample {i} never arrived"
            );
        }
    }
    samples.sort();
    println!(
        "pod change -> catalog latency over {} changes: median {:?}, min {:?}, max {:?}",
        samples.len(),
        samples[samples.len() / 2],
        samples[0],
        samples[samples.len() - 1]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relist_watch_cut_and_pool_changes() {
    let fake = Fake::start(false).await.unwrap();
    fake.put_pool(pool_object(json!({"app": "vllm"}), &[8000]));
    fake.put_pod(pod("a", "10.0.0.1").build());
    fake.put_pod(pod("b", "10.0.0.2").build());
    fake.put_pod(pod("z", "10.0.9.1").label("app", "vllm2").build());
    let serve = start(&fake, &["--pool-name", POOL]);
    let mut api = api(&serve).await;
    expect_catalog(
        &mut api,
        "first sync",
        &["a 10.0.0.1:8000", "b 10.0.0.2:8000"],
    )
    .await;

    // A pod removed without a watch event stays until a relist (410 Gone) reveals it.
    let lists = fake.pod_lists();
    assert!(fake.remove_pod_silently("b"), "pod b exists");
    fake.put_pod(pod("a", "10.0.0.11").build());
    expect_catalog(
        &mut api,
        "b still believed",
        &["a 10.0.0.11:8000", "b 10.0.0.2:8000"],
    )
    .await;
    fake.expire_watches();
    expect_catalog(&mut api, "relist after 410", &["a 10.0.0.11:8000"]).await;
    assert!(fake.pod_lists() > lists, "a relist happened");

    // Watch cut: the stream ends; changes made while disconnected arrive after the reconnect,
    // and the catalog is never wiped in between.
    let deadline = Instant::now() + WAIT;
    while fake.pod_watches() == 0 {
        assert!(Instant::now() < deadline, "pod watch never re-established");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    fake.cut_watches();
    assert_eq!(catalog(&mut api).await, ["a 10.0.0.11:8000"]);
    fake.put_pod(pod("c", "10.0.0.3").build());
    expect_catalog(
        &mut api,
        "after reconnect",
        &["a 10.0.0.11:8000", "c 10.0.0.3:8000"],
    )
    .await;

    // The pool changes its ports, then its selector (the pod watcher restarts with it).
    fake.put_pool(pool_object(json!({"app": "vllm"}), &[9000, 9001]));
    expect_catalog(
        &mut api,
        "pool ports",
        &[
            "a 10.0.0.11:9000 10.0.0.11:9001",
            "c 10.0.0.3:9000 10.0.0.3:9001",
        ],
    )
    .await;
    fake.put_pool(pool_object(json!({"app": "vllm2"}), &[9000]));
    expect_catalog(&mut api, "pool selector", &["z 10.0.9.1:9000"]).await;
    fake.put_pod(pod("a", "10.0.0.11").build());
    fake.put_pod(pod("z2", "10.0.9.2").label("app", "vllm2").build());
    expect_catalog(
        &mut api,
        "new selector watched",
        &["z 10.0.9.1:9000", "z2 10.0.9.2:9000"],
    )
    .await;

    // A pod leaving the selector (label change) drops out.
    fake.put_pod(pod("z2", "10.0.9.2").build());
    expect_catalog(&mut api, "label change", &["z 10.0.9.1:9000"]).await;

    // A deleted pool fails closed; re-creating it restores the workers.
    assert!(fake.delete_pool(), "the pool exists");
    expect_catalog(&mut api, "pool deleted", &[]).await;
    wait_readiness(serve.health, ServingStatus::NotServing).await;
    fake.put_pool(pool_object(json!({"app": "vllm"}), &[8000]));
    expect_catalog(
        &mut api,
        "pool back",
        &["a 10.0.0.11:8000", "c 10.0.0.3:8000", "z2 10.0.9.2:8000"],
    )
    .await;
    wait_readiness(serve.health, ServingStatus::Serving).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_outage_keeps_the_catalog_and_the_relist_converges() {
    let fake = Fake::start(false).await.unwrap();
    fake.put_pool(pool_object(json!({"app": "vllm"}), &[8000]));
    fake.put_pod(pod("a", "10.0.0.1").build());
    fake.put_pod(pod("b", "10.0.0.2").build());
    let serve = start(&fake, &["--pool-name", POOL]);
    let mut api = api(&serve).await;
    let before = ["a 10.0.0.1:8000", "b 10.0.0.2:8000"];
    expect_catalog(&mut api, "first sync", &before).await;
    wait_readiness(serve.health, ServingStatus::Serving).await;
    let deadline = Instant::now() + WAIT;
    while fake.pod_watches() == 0 {
        assert!(Instant::now() < deadline, "pod watch never established");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }

    // The watches are cut and the API server refuses everything for a while. Meanwhile the
    // cluster changes, and history is compacted, so a resumed watch gets 410 and must relist.
    fake.set_outage(true);
    let lists = fake.pod_lists();
    assert!(fake.remove_pod_silently("b"), "pod b exists");
    fake.put_pod(pod("c", "10.0.0.3").build());
    fake.put_pod(pod("a", "10.0.0.11").build());
    fake.expire_watches();
    // Throughout the outage (several refused retries) the last known catalog is kept and
    // kvpick stays ready: a control-plane blip must not empty the pool.
    let deadline = Instant::now() + WAIT;
    while fake.refused() < 4 {
        assert!(
            Instant::now() < deadline,
            "kvpick never retried the API server"
        );
        assert_eq!(
            catalog(&mut api).await,
            before,
            "catalog kept during the outage"
        );
        assert_eq!(readiness(serve.health).await, ServingStatus::Serving);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(catalog(&mut api).await, before);

    // The API server is back: the relist converges on the cluster as it is now, including
    // the pod removed without any event.
    fake.set_outage(false);
    expect_catalog(
        &mut api,
        "relist after the outage",
        &["a 10.0.0.11:8000", "c 10.0.0.3:8000"],
    )
    .await;
    assert!(fake.pod_lists() > lists, "a relist happened");
    assert_eq!(readiness(serve.health).await, ServingStatus::Serving);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endpoint_selector_without_the_crd() {
    let fake = Fake::start(false).await.unwrap();
    fake.put_pod(
        pod("a", "10.0.0.1")
            .label("kvpick.io/model", "ignored")
            .build(),
    );
    fake.put_pod(pod("x", "10.0.0.9").label("app", "other").build());
    let serve = start(
        &fake,
        &[
            "--endpoint-selector",
            "app=vllm",
            "--target-ports",
            "8000,8001",
            "--model",
            "flag-model",
        ],
    );
    let mut api = api(&serve).await;
    expect_catalog(
        &mut api,
        "selector mode",
        &["a 10.0.0.1:8000 10.0.0.1:8001"],
    )
    .await;
    let w = common::list_workers(&mut api).await;
    assert_eq!(w[0].model, "flag-model");
    wait_readiness(serve.health, ServingStatus::Serving).await;
    fake.put_pod(pod("b", "10.0.0.2").build());
    expect_catalog(
        &mut api,
        "selector mode add",
        &[
            "a 10.0.0.1:8000 10.0.0.1:8001",
            "b 10.0.0.2:8000 10.0.0.2:8001",
        ],
    )
    .await;
}

#[test]
fn flag_errors_name_the_flag() {
    let run = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_kvpick"))
            .arg("serve")
            .args(args)
            .env_remove("NAMESPACE")
            .env_remove("KVPICK_CONFIG")
            .output()
            .unwrap();
        assert!(!out.status.success());
        String::from_utf8_lossy(&out.stderr).to_string()
    };
    assert!(run(&[]).contains("no catalog source"));
    assert!(run(&["--pool-name", "p"]).contains("--pool-namespace"));
    assert!(run(&["--pool-name", "p", "--config", "x.yaml"]).contains("choose one catalog source"));
    assert!(
        run(&["--endpoint-selector", "a=b", "--pool-namespace", "ns"]).contains("--target-ports")
    );
}
