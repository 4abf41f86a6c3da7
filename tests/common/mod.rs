//! Shared by the integration tests: run the real `kvpick serve` binary on 127.0.0.1 with every
//! port 0, wait for its port file (its readiness signal), and ask gRPC health. The process is
//! killed and its directory removed on drop; a failing test prints the tail of kvpick's log.
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

pub struct Serve {
    pub child: Child,
    pub dir: PathBuf,
    pub grpc: u16,
    pub health: u16,
    pub metrics: u16,
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            let log = std::fs::read_to_string(self.dir.join("kvpick.log")).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(60).collect();
            eprintln!("--- kvpick log (last lines) ---");
            for l in tail.iter().rev() {
                eprintln!("{l}");
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A fresh directory under the system temp dir.
pub fn temp_dir(prefix: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("{prefix}-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// `kvpick serve` with its ports on 127.0.0.1:0, for the test to add its flags to.
pub fn serve_command() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_kvpick"));
    command
        .args(["serve", "--bind", "127.0.0.1", "--grpc-port", "0"])
        .args(["--grpc-health-port", "0", "--metrics-port", "0"]);
    command
}

/// Starts `kvpick serve` with its ports on 127.0.0.1:0 and its log in `dir/kvpick.log`;
/// `configure` adds the test's own flags and environment.
pub fn start_with(dir: PathBuf, configure: impl FnOnce(&mut Command)) -> Serve {
    start_command(dir, serve_command(), configure)
}

/// [`start_with`] from a command the test built itself (e.g. `kvpick serve` on a fixed port:
/// a process restarted where its clients knew it).
pub fn start_command(
    dir: PathBuf,
    mut command: Command,
    configure: impl FnOnce(&mut Command),
) -> Serve {
    let port_file = dir.join("ports.json");
    let log = std::fs::File::create(dir.join("kvpick.log")).unwrap();
    command
        .arg("--port-file")
        .arg(&port_file)
        .stdout(Stdio::null())
        .stderr(log);
    configure(&mut command);
    let child = command.spawn().expect("kvpick binary runs");
    let mut serve = Serve {
        child,
        dir,
        grpc: 0,
        health: 0,
        metrics: 0,
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    let ports = loop {
        if let Ok(text) = std::fs::read_to_string(&port_file) {
            break text;
        }
        if let Ok(Some(status)) = serve.child.try_wait() {
            panic!("kvpick exited early: {status}");
        }
        assert!(
            Instant::now() < deadline,
            "kvpick did not write its port file"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    let ports: serde_json::Value = serde_json::from_str(&ports).unwrap();
    serve.grpc = ports["grpc"].as_u64().unwrap() as u16;
    serve.health = ports["health"].as_u64().unwrap() as u16;
    serve.metrics = ports["metrics"].as_u64().unwrap() as u16;
    serve
}

/// `kvpick serve --config <dir>/catalog.yaml` over h2c, with `catalog` as the file's content.
pub fn start_static(catalog: &str, extra: &[&str]) -> Serve {
    let dir = temp_dir("kvpick-it");
    std::fs::write(dir.join("catalog.yaml"), catalog).unwrap();
    let config = dir.join("catalog.yaml");
    start_with(dir, |c| {
        c.args(["--secure-serving=false", "--catalog-poll-ms", "50"])
            .args(extra)
            .arg("--config")
            .arg(config);
    })
}

pub async fn readiness(port: u16) -> ServingStatus {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://127.0.0.1:{port}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let status = HealthClient::new(channel)
        .check(HealthCheckRequest {
            service: "readiness".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .status;
    ServingStatus::try_from(status).unwrap()
}

/// Polls readiness until it is `want` (bounded: 30 s).
pub async fn wait_readiness(port: u16, want: ServingStatus) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while readiness(port).await != want {
        assert!(Instant::now() < deadline, "readiness never became {want:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

pub type Api = kvpick::proto::selection_client::SelectionClient<tonic::transport::Channel>;

/// A selection-API client for the h2c gRPC port.
pub async fn api(port: u16) -> Api {
    Api::connect(format!("http://127.0.0.1:{port}"))
        .await
        .unwrap()
}

/// `ListWorkers` for every model.
pub async fn list_workers(api: &mut Api) -> Vec<kvpick::proto::Worker> {
    api.list_workers(kvpick::proto::ListWorkersRequest::default())
        .await
        .unwrap()
        .into_inner()
        .workers
}

/// `Loads` of model `m`.
pub async fn loads(api: &mut Api, model: &str) -> Vec<kvpick::proto::Worker> {
    api.loads(kvpick::proto::LoadsRequest {
        model: model.into(),
        ..Default::default()
    })
    .await
    .unwrap()
    .into_inner()
    .workers
}

// The fake Kubernetes API server's building blocks live in the testkit, shared with the benches.
#[allow(unused_imports)] // each test binary uses some of them
pub use kvpick_testkit::apiserver::{serve_fake_apiserver, watch_gone, watch_line, watch_response};

/// An ext_proc client of a kvpick gRPC port.
pub type ExtProcClient =
    envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient<
        tonic::transport::Channel,
    >;

/// Opens an ext_proc stream (as Envoy opens one per request), fed by the returned sender.
pub async fn open_stream(
    client: &mut ExtProcClient,
) -> (
    tokio::sync::mpsc::Sender<envoy_types::pb::envoy::service::ext_proc::v3::ProcessingRequest>,
    tonic::Streaming<envoy_types::pb::envoy::service::ext_proc::v3::ProcessingResponse>,
) {
    let (tx, rx) = tokio::sync::mpsc::channel(8);
    let inbound = client
        .process(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    (tx, inbound)
}

/// An ext_proc header map of `pairs` as Envoy sends them (values in `raw_value`).
pub fn http_headers(
    pairs: &[(&str, &str)],
) -> envoy_types::pb::envoy::service::ext_proc::v3::HttpHeaders {
    use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
    envoy_types::pb::envoy::service::ext_proc::v3::HttpHeaders {
        headers: Some(HeaderMap {
            headers: pairs
                .iter()
                .map(|(k, v)| HeaderValue {
                    key: k.to_string(),
                    value: String::new(),
                    raw_value: v.as_bytes().to_vec(),
                })
                .collect(),
        }),
        ..Default::default()
    }
}

/// One unlabelled sample of kvpick's metrics port (`name value`), read over plain HTTP/1.0.
pub fn metric(port: u16, name: &str) -> f64 {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
        .unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
        .unwrap_or_else(|| panic!("metric {name} not exported"))
}

/// Polls kvpick's metric until it equals `want` (bounded: 10 s).
pub async fn wait_metric(port: u16, name: &str, want: f64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while metric(port, name) != want {
        assert!(Instant::now() < deadline, "{name} never became {want}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The sum of `name`'s samples whose labels include `labels` on kvpick's metrics port.
pub fn metric_sum(port: u16, name: &str, labels: &[(&str, &str)]) -> f64 {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
        .unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    kvpick_testkit::prom::sum(&kvpick_testkit::prom::parse(&text), name, labels)
}

/// Polls `cond` every 10 ms (a readiness signal read from outside); fails past 20 s.
pub async fn until(what: &str, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < Duration::from_secs(20), "never: {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// What one ext_proc stream's routing answered: the headers response's set headers and the
/// request body as echoed to the upstream.
pub struct Routed {
    pub set_headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Routed {
    /// The value the routing set for header `key`, if any.
    pub fn header(&self, key: &str) -> Option<&str> {
        self.set_headers
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }
}

/// Routes one `/v1/completions` request through kvpick's ext_proc port as Envoy does: the request
/// headers (with `extra`), the JSON body, then the routing answer and the body's echo (the
/// stream is then dropped, which frees the booking).
pub async fn extproc_route(grpc: u16, extra: &[(&str, &str)], body: &serde_json::Value) -> Routed {
    use envoy_types::pb::envoy::service::ext_proc::v3::{
        body_mutation, processing_request, processing_response, HttpBody, ProcessingRequest,
    };
    let mut client = ExtProcClient::connect(format!("http://127.0.0.1:{grpc}"))
        .await
        .unwrap();
    let (tx, mut inbound) = open_stream(&mut client).await;
    let mut pairs = vec![
        (":method", "POST"),
        (":path", "/v1/completions"),
        ("content-type", "application/json"),
    ];
    pairs.extend_from_slice(extra);
    tx.send(ProcessingRequest {
        request: Some(processing_request::Request::RequestHeaders(http_headers(
            &pairs,
        ))),
        ..Default::default()
    })
    .await
    .unwrap();
    tx.send(ProcessingRequest {
        request: Some(processing_request::Request::RequestBody(HttpBody {
            body: serde_json::to_vec(body).unwrap(),
            end_of_stream: true,
            ..Default::default()
        })),
        ..Default::default()
    })
    .await
    .unwrap();
    let answer = inbound
        .message()
        .await
        .unwrap()
        .expect("a headers response");
    let Some(processing_response::Response::RequestHeaders(h)) = answer.response else {
        panic!("not a headers response: {answer:?}");
    };
    let set_headers = h
        .response
        .and_then(|c| c.header_mutation)
        .map(|m| m.set_headers)
        .unwrap_or_default()
        .into_iter()
        .filter_map(|o| o.header)
        .map(|h| (h.key, String::from_utf8(h.raw_value).unwrap()))
        .collect();
    let mut echoed = Vec::new();
    loop {
        let answer = inbound.message().await.unwrap().expect("the body's echo");
        let Some(processing_response::Response::RequestBody(b)) = answer.response else {
            panic!("not a body response: {answer:?}");
        };
        match b
            .response
            .and_then(|c| c.body_mutation)
            .and_then(|m| m.mutation)
        {
            Some(body_mutation::Mutation::StreamedResponse(s)) => {
                echoed.extend_from_slice(&s.body);
                if s.end_of_stream {
                    break;
                }
            }
            other => panic!("not a streamed echo: {other:?}"),
        }
    }
    Routed {
        set_headers,
        body: echoed,
    }
}

/// Prompt `p`'s first `tokens` token ids (distinct per prompt).
pub fn prompt(p: u32, tokens: u32) -> Vec<u32> {
    (0..tokens).map(|t| p * 100_000 + t).collect()
}

/// Prompt `p`'s first `blocks` full blocks of `block_size` tokens, stored on `medium` (vLLM's
/// `BlockStored`; engine hashes `p * 1000 + block`).
pub fn stored(
    p: u32,
    blocks: u32,
    block_size: u32,
    medium: kvpick_core::event::Medium,
) -> kvpick_core::event::KvEvent {
    kvpick_core::event::KvEvent::BlockStored {
        block_hashes: engine_hashes(p, blocks),
        parent_block_hash: None,
        token_ids: prompt(p, blocks * block_size),
        block_size,
        lora_id: None,
        medium,
        lora_name: None,
        cache_salt: None,
        group_idx: None,
        media: Vec::new(),
    }
}

/// The engine hashes [`stored`] gave prompt `p`'s first `blocks` blocks.
pub fn engine_hashes(p: u32, blocks: u32) -> Vec<u64> {
    (0..u64::from(blocks))
        .map(|b| u64::from(p) * 1_000 + b)
        .collect()
}
