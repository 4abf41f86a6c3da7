//! Runs the real `kvpick serve` binary on loopback (port 0, h2c) and talks to it over gRPC: the
//! selection API and health follow the catalog file as it changes.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test/bench harness: a panic is a failure report

use kvpick::proto::{BookingRef, SelectRequest};
use tonic_health::pb::health_check_response::ServingStatus;

mod common;

use common::{readiness, start_static, wait_readiness};

/// A server whose API takes bookings (`--selection-api`).
fn start(catalog: &str) -> common::Serve {
    start_static(catalog, &["--selection-api"])
}

#[tokio::test]
async fn selection_api_and_health_follow_the_catalog() {
    let serve = start("workers: []\n");
    assert_eq!(readiness(serve.health).await, ServingStatus::NotServing);
    // The same health service is on the ext_proc port too.
    assert_eq!(readiness(serve.grpc).await, ServingStatus::NotServing);

    let mut api = common::api(serve.grpc).await;
    // Distinct 16-token prompts: one KV block each, nothing shared, so load decides.
    let select = |id: &str| SelectRequest {
        request_id: id.into(),
        model: "m".into(),
        token_ids: id.bytes().map(u32::from).cycle().take(16).collect(),
        ..Default::default()
    };
    let err = api.select_and_reserve(select("r0")).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unavailable);

    std::fs::write(
        serve.dir.join("catalog.yaml"),
        "workers:\n  - {name: a, model: m, address: 127.0.0.1, ports: [8000, 8001]}\n  - {name: b, model: m, address: 127.0.0.1, port: 9000, data_parallel_size: 2}\n",
    )
    .unwrap();
    wait_readiness(serve.health, ServingStatus::Serving).await;

    let workers = common::list_workers(&mut api).await;
    assert_eq!(workers.len(), 2);
    assert_eq!(workers[0].name, "a");
    assert_eq!(workers[0].ranks.len(), 2);
    assert_eq!(workers[1].ranks[1].address, "127.0.0.1:9000");
    assert_eq!(workers[0].lifecycle, "Schedulable");

    // Four ranks, four concurrent bookings: each lands on a different rank (lowest cost).
    let mut picked = Vec::new();
    for i in 0..4 {
        let pick = api
            .select_and_reserve(select(&format!("r{i}")))
            .await
            .unwrap()
            .into_inner();
        let p = pick.primary.unwrap();
        picked.push((p.worker_id, p.dp_rank));
    }
    picked.sort();
    picked.dedup();
    assert_eq!(picked.len(), 4);
    let dup = api.select_and_reserve(select("r0")).await.unwrap_err();
    assert_eq!(dup.code(), tonic::Code::AlreadyExists);

    let freed = api
        .free(BookingRef {
            request_id: "r0".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(freed.found);
    let again = api
        .free(BookingRef {
            request_id: "r0".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(!again.found, "a repeated free is a no-op");

    std::fs::write(serve.dir.join("catalog.yaml"), "workers: []\n").unwrap();
    wait_readiness(serve.health, ServingStatus::NotServing).await;
}

#[test]
fn bad_catalog_fails_start_up_with_a_clear_message() {
    let dir = std::env::temp_dir().join(format!("kvpick-it-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("catalog.yaml");
    std::fs::write(&path, "workers: [{name: a, model: m, address: 1.2.3.4}]").unwrap();
    let out = common::serve_command()
        .arg("--config")
        .arg(&path)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("workers[0] (a)"), "{stderr}");
    assert!(stderr.contains("missing `ports`"), "{stderr}");
    std::fs::remove_dir_all(dir).unwrap();
}

#[tokio::test]
async fn every_selection_rpc_over_the_wire() {
    use kvpick::proto::{DeleteWorkerRequest, WorkerSpec};
    let serve = start_static(
        "workers:\n  - {name: a, model: m, address: 127.0.0.1, ports: [8000, 8001]}\n",
        &["--worker-api", "--selection-api"],
    );
    wait_readiness(serve.health, ServingStatus::Serving).await;
    let mut api = common::api(serve.grpc).await;
    let prompt: Vec<u32> = (0..64).collect();
    let request = |id: &str| SelectRequest {
        request_id: id.into(),
        model: "m".into(),
        token_ids: prompt.clone(),
        ..Default::default()
    };
    let active = |workers: &[kvpick::proto::Worker]| -> Vec<(u64, u64)> {
        workers[0]
            .ranks
            .iter()
            .map(|r| (r.active_requests, r.active_prefill_tokens))
            .collect()
    };

    // Select books nothing.
    let query = api.select(request("q")).await.unwrap().into_inner();
    assert_eq!(query.prompt_blocks, 4);
    let loads = common::loads(&mut api, "m").await;
    assert_eq!(active(&loads), vec![(0, 0), (0, 0)]);

    // SelectAndReserve books prefill + decode; PrefillComplete releases the prefill part.
    let pick = api
        .select_and_reserve(request("r1"))
        .await
        .unwrap()
        .into_inner();
    let rank = pick.primary.as_ref().unwrap().dp_rank as usize;
    let loads = common::loads(&mut api, "m").await;
    assert_eq!(active(&loads)[rank], (1, 64));
    assert_eq!(loads[0].ranks[rank].active_decode_blocks, 4);
    assert!(
        api.prefill_complete(BookingRef {
            request_id: "r1".into()
        })
        .await
        .unwrap()
        .into_inner()
        .found
    );
    let loads = common::loads(&mut api, "m").await;
    assert_eq!(active(&loads)[rank], (1, 0));

    // The routed prompt is now cached on the picked rank (approximate mode). It is 4 blocks
    // exactly: the engine computes its last token, so 3 of them are credited.
    let scores = api.overlap_scores(request("o")).await.unwrap().into_inner();
    assert_eq!(scores.prompt_blocks, 4);
    let cached: Vec<(u32, u32)> = scores
        .scores
        .iter()
        .map(|s| (s.rank.as_ref().unwrap().dp_rank, s.gpu_blocks))
        .collect();
    assert!(cached.contains(&(rank as u32, 3)), "{cached:?}");
    assert!(cached.contains(&(1 - rank as u32, 0)), "{cached:?}");

    // UpsertWorker / DeleteWorker manage the "api" source beside the file.
    let bad = api
        .upsert_worker(WorkerSpec {
            name: "x".into(),
            model: "m".into(),
            address: "not-an-ip".into(),
            port: 9000,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(bad.code(), tonic::Code::InvalidArgument);
    assert!(bad.message().contains("IP address"), "{}", bad.message());
    let ack = api
        .upsert_worker(WorkerSpec {
            name: "x".into(),
            model: "m".into(),
            address: "127.0.0.1".into(),
            port: 9000,
            data_parallel_size: 2,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let workers = common::list_workers(&mut api).await;
    let x = workers.iter().find(|w| w.name == "x").unwrap();
    assert_eq!(
        (x.worker_id, x.namespace.as_str(), x.ranks.len()),
        (ack.worker_id, "api", 2)
    );
    assert!(
        api.delete_worker(DeleteWorkerRequest { name: "x".into() })
            .await
            .unwrap()
            .into_inner()
            .found
    );
    assert!(
        !api.delete_worker(DeleteWorkerRequest { name: "x".into() })
            .await
            .unwrap()
            .into_inner()
            .found
    );
    let workers = common::list_workers(&mut api).await;
    assert_eq!(workers.len(), 1);

    // Error codes follow the HTTP table.
    let missing = api
        .select(SelectRequest {
            model: String::new(),
            ..request("e")
        })
        .await
        .unwrap_err();
    assert_eq!(missing.code(), tonic::Code::InvalidArgument);
    let unknown = api
        .select(SelectRequest {
            model: "nope".into(),
            ..request("e")
        })
        .await
        .unwrap_err();
    assert_eq!(unknown.code(), tonic::Code::Unavailable);
    let long_session = api
        .select(SelectRequest {
            session_id: "s".repeat(257),
            ..request("e")
        })
        .await
        .unwrap_err();
    assert_eq!(long_session.code(), tonic::Code::InvalidArgument);
    // A parent session id is bounded like a session id: 256 bytes pass, 257 do not.
    let with_parent = |len: usize| SelectRequest {
        session_id: "child".into(),
        parent_session_id: "p".repeat(len),
        ..request("e")
    };
    assert!(api.select(with_parent(256)).await.is_ok());
    let long_parent = api.select(with_parent(257)).await.unwrap_err();
    assert_eq!(long_parent.code(), tonic::Code::InvalidArgument);
    assert!(
        long_parent.message().contains("parent_session_id"),
        "{}",
        long_parent.message()
    );
}

#[tokio::test]
async fn catalog_writes_need_the_worker_api_flag() {
    use kvpick::proto::{DeleteWorkerRequest, WorkerSpec};
    let serve = start("workers:\n  - {name: a, model: m, address: 127.0.0.1, port: 8000}\n");
    wait_readiness(serve.health, ServingStatus::Serving).await;
    let mut api = common::api(serve.grpc).await;
    let denied = api
        .upsert_worker(WorkerSpec {
            name: "evil".into(),
            model: "m".into(),
            address: "10.9.9.9".into(),
            port: 80,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(denied.code(), tonic::Code::PermissionDenied);
    assert!(
        denied.message().contains("--worker-api"),
        "{}",
        denied.message()
    );
    let denied = api
        .delete_worker(DeleteWorkerRequest { name: "a".into() })
        .await
        .unwrap_err();
    assert_eq!(denied.code(), tonic::Code::PermissionDenied);
    let workers = common::list_workers(&mut api).await;
    assert_eq!(
        workers.iter().map(|w| w.name.as_str()).collect::<Vec<_>>(),
        ["a"]
    );
}

/// Without `--selection-api` the API books nothing: `SelectAndReserve`, `Free` and
/// `PrefillComplete` are PERMISSION_DENIED naming the flag; read-only RPCs still answer.
#[tokio::test]
async fn bookings_need_the_selection_api_flag() {
    let serve = start_static(
        "workers:\n  - {name: a, model: m, address: 127.0.0.1, port: 8000}\n",
        &[],
    );
    wait_readiness(serve.health, ServingStatus::Serving).await;
    let mut api = common::api(serve.grpc).await;
    let request = SelectRequest {
        request_id: "r".into(),
        model: "m".into(),
        token_ids: vec![1; 16],
        ..Default::default()
    };
    let denied = api.select_and_reserve(request.clone()).await.unwrap_err();
    assert_eq!(denied.code(), tonic::Code::PermissionDenied);
    assert!(denied.message().contains("--selection-api"), "{denied:?}");
    let booking = || BookingRef {
        request_id: "r".into(),
    };
    assert_eq!(
        api.free(booking()).await.unwrap_err().code(),
        tonic::Code::PermissionDenied
    );
    assert_eq!(
        api.prefill_complete(booking()).await.unwrap_err().code(),
        tonic::Code::PermissionDenied
    );
    let pick = api.select(request).await.unwrap().into_inner();
    assert!(pick.primary.is_some(), "Select is read-only and stays open");
}

/// Protocol violations on the real ext_proc server: each ends its gRPC stream with a clear
/// status, a booking made before the violation is freed, nested metadata deeper than the
/// protobuf recursion limit is refused at decoding (no stack overflow), and the server keeps
/// serving.
#[tokio::test]
async fn ext_proc_protocol_errors_over_the_wire() {
    use envoy_types::pb::envoy::config::core::v3::Metadata;
    use envoy_types::pb::envoy::service::ext_proc::v3::{
        external_processor_client::ExternalProcessorClient, processing_request, HttpBody,
        ProcessingRequest,
    };
    use envoy_types::pb::google::protobuf::{value::Kind, ListValue, Struct, Value};
    use std::time::{Duration, Instant};

    let serve =
        start("workers:\n  - {name: a, model: m, address: 127.0.0.1, ports: [8000, 8001]}\n");
    wait_readiness(serve.health, ServingStatus::Serving).await;
    let mut api = common::api(serve.grpc).await;
    let mut client = ExternalProcessorClient::connect(format!("http://127.0.0.1:{}", serve.grpc))
        .await
        .unwrap();

    let headers = || ProcessingRequest {
        request: Some(processing_request::Request::RequestHeaders(
            common::http_headers(&[(":method", "POST"), ("content-type", "application/json")]),
        )),
        ..Default::default()
    };
    let body = || ProcessingRequest {
        request: Some(processing_request::Request::RequestBody(HttpBody {
            body: br#"{"model":"m","prompt":"hi"}"#.to_vec(),
            end_of_stream: true,
            ..Default::default()
        })),
        ..Default::default()
    };
    let live = |workers: Vec<kvpick::proto::Worker>| -> u64 {
        workers[0].ranks.iter().map(|r| r.active_requests).sum()
    };

    // Opens a stream fed by the returned sender.
    let mut open = async || common::open_stream(&mut client).await;

    // Routed, then headers again: FAILED_PRECONDITION, and the booking is freed.
    let (tx, mut inbound) = open().await;
    tx.send(headers()).await.unwrap();
    tx.send(body()).await.unwrap();
    for _ in 0..2 {
        inbound
            .message()
            .await
            .unwrap()
            .expect("headers and body responses");
    }
    assert_eq!(live(common::loads(&mut api, "m").await), 1);
    tx.send(headers()).await.unwrap();
    let err = inbound.message().await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{err:?}");
    assert!(err.message().contains("twice"), "{}", err.message());
    let deadline = Instant::now() + Duration::from_secs(10);
    while live(common::loads(&mut api, "m").await) != 0 {
        assert!(
            Instant::now() < deadline,
            "booking freed after the protocol error"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    // A body before any headers.
    let (tx, mut inbound) = open().await;
    tx.send(body()).await.unwrap();
    let err = inbound.message().await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{err:?}");

    // A subset hint nested 1,000 lists deep (prost's limit is 100): refused while decoding.
    let mut deep = Value {
        kind: Some(Kind::StringValue("127.0.0.1:8000".into())),
    };
    for _ in 0..1_000 {
        deep = Value {
            kind: Some(Kind::ListValue(ListValue { values: vec![deep] })),
        };
    }
    let mut msg = headers();
    msg.metadata_context = Some(Metadata {
        filter_metadata: [(
            "envoy.lb.subset_hint".to_string(),
            Struct {
                fields: [("x-gateway-destination-endpoint-subset".to_string(), deep)].into(),
            },
        )]
        .into(),
        ..Default::default()
    });
    let (tx, mut inbound) = open().await;
    tx.send(msg).await.unwrap();
    // (It used to end the stream cleanly, which tells Envoy to go on without a pick.)
    let err = inbound.message().await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::Internal, "{err:?}");
    assert!(err.message().contains("decode"), "{}", err.message());

    // Still serving: a well-formed stream is routed.
    let (tx, mut inbound) = open().await;
    tx.send(headers()).await.unwrap();
    tx.send(body()).await.unwrap();
    assert!(inbound.message().await.unwrap().is_some());
    drop(tx);
    drop(inbound);
    let deadline = Instant::now() + Duration::from_secs(10);
    while live(common::loads(&mut api, "m").await) != 0 {
        assert!(
            Instant::now() < deadline,
            "booking freed when the stream closed"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Prefill/decode through the API: `SelectAndReserve` returns the pair (the optional `prefill`
/// endpoint), `PrefillComplete` frees the prefill side, `Free` the rest; `UpsertWorker` takes roles.
#[tokio::test]
async fn the_api_returns_and_books_the_prefill_decode_pair() {
    use kvpick::proto::{ListWorkersRequest, WorkerSpec};
    let serve = start_static(
        "workers:\n  - {name: p, model: m, address: 127.0.0.1, port: 8000, role: prefill}\n  - {name: d, model: m, address: 127.0.0.1, port: 9000, role: decode}\n",
        &[
            "--pd-transfer-block-cost",
            "0",
            "--worker-api",
            "--selection-api",
        ],
    );
    wait_readiness(serve.health, ServingStatus::Serving).await;
    let mut api = common::api(serve.grpc).await;
    let loads = |workers: &[kvpick::proto::Worker]| -> Vec<(String, u64)> {
        workers
            .iter()
            .map(|w| (w.name.clone(), w.ranks[0].active_requests))
            .collect()
    };
    let request = SelectRequest {
        request_id: "r".into(),
        model: "m".into(),
        token_ids: (0..2048).collect(),
        ..Default::default()
    };
    let pick = api
        .select_and_reserve(request.clone())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(pick.primary.unwrap().address, "127.0.0.1:9000");
    assert_eq!(pick.prefill.unwrap().address, "127.0.0.1:8000");
    let list = || ListWorkersRequest {
        model: String::new(),
    };
    let workers = api.list_workers(list()).await.unwrap().into_inner().workers;
    assert_eq!(loads(&workers), vec![("d".into(), 1), ("p".into(), 1)]);
    let r = || BookingRef {
        request_id: "r".into(),
    };
    assert!(api.prefill_complete(r()).await.unwrap().into_inner().found);
    let workers = api.list_workers(list()).await.unwrap().into_inner().workers;
    assert_eq!(loads(&workers), vec![("d".into(), 1), ("p".into(), 0)]);
    assert!(api.free(r()).await.unwrap().into_inner().found);
    assert!(!api.free(r()).await.unwrap().into_inner().found);
    let workers = api.list_workers(list()).await.unwrap().into_inner().workers;
    assert_eq!(loads(&workers), vec![("d".into(), 0), ("p".into(), 0)]);
    // A short prompt is not split: no prefill endpoint.
    let short = api
        .select(SelectRequest {
            token_ids: (0..64).collect(),
            ..request.clone()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(short.prefill.is_none());
    // Roles through the API: an unknown one is refused, naming the field.
    let bad = api
        .upsert_worker(WorkerSpec {
            name: "x".into(),
            model: "m".into(),
            address: "127.0.0.1".into(),
            port: 9100,
            roles: vec!["encode".into()],
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(bad.code(), tonic::Code::InvalidArgument);
    assert!(bad.message().contains("role"), "{}", bad.message());
}

/// The kernel's view of the served process (`/proc/PID/status`, Linux ≥ 5.0): transparent huge
/// pages off by default, as for any process with `--huge-pages` (src/server/memory.rs).
#[cfg(target_os = "linux")]
#[test]
fn huge_pages_are_off_unless_asked_for() {
    let thp_enabled = |pid: &str| {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        status
            .lines()
            .find_map(|l| l.strip_prefix("THP_enabled:"))
            .expect("THP_enabled in /proc/PID/status")
            .trim()
            .to_string()
    };
    let usual = thp_enabled("self");
    for (extra, want) in [(&[][..], "0"), (&["--huge-pages"][..], usual.as_str())] {
        // The port file `start_static` waits for is written after `run` applied the setting.
        let serve = start_static("workers: []\n", extra);
        assert_eq!(
            thp_enabled(&serve.child.id().to_string()),
            want,
            "flags {extra:?}"
        );
    }
}
