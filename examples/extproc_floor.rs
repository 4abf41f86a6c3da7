//! The cost floor of an ext_proc server on this stack: stock tonic + h2 + tokio with envoy-types'
//! prost messages, answering the protocol kvpick answers (FULL_DUPLEX_STREAMED both ways, the
//! request body held until its end, then the routing headers and the echoed chunks) and doing
//! nothing else: no parsing, no hashing, no index, no metrics. TLS as kvpick's default: with
//! `--secure-serving=true` (as `e2e/bench_overhead.py` passes without `--plaintext`) it terminates
//! TLS with kvpick's own OpenSSL setup (`kvpick::transport::tls`, a self-signed certificate,
//! ALPN h2), so the floor with TLS is measured on the same TLS stack.
//!
//! It exists to split kvpick's CPU per request into "what any ext_proc server on this stack pays"
//! and "what kvpick adds". It takes kvpick's `serve` flags as `e2e/bench_overhead.py` passes them
//! (`KVPICK_BIN=target/release/examples/extproc_floor e2e/bench_overhead.py ...`),
//! routes round-robin over the ranks of the catalog's first worker, and answers `/metrics` with
//! the one series the benchmark reads.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a bench tool: a panic is a failure report

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use envoy_types::pb::envoy::config::core::v3::{HeaderValue, HeaderValueOption};
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    body_mutation, processing_request, processing_response, BodyMutation, BodyResponse,
    CommonResponse, HeaderMutation, HeadersResponse, ProcessingRequest, ProcessingResponse,
    StreamedBodyResponse, TrailersResponse,
};
use tokio::io::AsyncWriteExt;
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status, Streaming};

struct Floor {
    endpoints: Vec<String>,
    next: AtomicUsize,
}

#[derive(Clone)]
struct FloorService(Arc<Floor>);

type Answers = Pin<Box<dyn Stream<Item = Result<ProcessingResponse, Status>> + Send>>;

fn answer(response: processing_response::Response) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(response),
        ..Default::default()
    }
}

fn echo(body: Vec<u8>, end_of_stream: bool, request_side: bool) -> ProcessingResponse {
    let body = BodyResponse {
        response: Some(CommonResponse {
            body_mutation: Some(BodyMutation {
                mutation: Some(body_mutation::Mutation::StreamedResponse(
                    StreamedBodyResponse {
                        body,
                        end_of_stream,
                        ..Default::default()
                    },
                )),
            }),
            ..Default::default()
        }),
    };
    answer(if request_side {
        processing_response::Response::RequestBody(body)
    } else {
        processing_response::Response::ResponseBody(body)
    })
}

fn route(destination: String) -> ProcessingResponse {
    answer(processing_response::Response::RequestHeaders(
        HeadersResponse {
            response: Some(CommonResponse {
                header_mutation: Some(HeaderMutation {
                    set_headers: vec![HeaderValueOption {
                        header: Some(HeaderValue {
                            key: "x-gateway-destination-endpoint".into(),
                            raw_value: destination.into_bytes(),
                            ..Default::default()
                        }),
                        append_action: 2, // OVERWRITE_IF_EXISTS_OR_ADD
                        ..Default::default()
                    }],
                    remove_headers: vec![],
                }),
                clear_route_cache: true,
                ..Default::default()
            }),
        },
    ))
}

#[tonic::async_trait]
impl ExternalProcessor for FloorService {
    type ProcessStream = Answers;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Answers>, Status> {
        let mut inbound = request.into_inner();
        let floor = Arc::clone(&self.0);
        let (tx, rx) = tokio::sync::mpsc::channel(16);
        tokio::spawn(async move {
            use processing_request::Request as In;
            use processing_response::Response as Out;
            let mut held: Vec<Vec<u8>> = Vec::new();
            while let Some(Ok(message)) = inbound.next().await {
                let out = match message.request {
                    Some(In::RequestHeaders(_)) => vec![],
                    Some(In::RequestBody(body)) if !body.end_of_stream => {
                        held.push(body.body);
                        vec![]
                    }
                    Some(In::RequestBody(body)) => {
                        held.push(body.body);
                        let n = floor.next.fetch_add(1, Ordering::Relaxed);
                        let destination = floor.endpoints[n % floor.endpoints.len()].clone();
                        let last = held.len() - 1;
                        let mut out = vec![route(destination)];
                        out.extend(
                            held.drain(..)
                                .enumerate()
                                .map(|(i, chunk)| echo(chunk, i == last, true)),
                        );
                        out
                    }
                    Some(In::RequestTrailers(_)) => {
                        vec![answer(Out::RequestTrailers(TrailersResponse::default()))]
                    }
                    Some(In::ResponseHeaders(_)) => {
                        vec![answer(Out::ResponseHeaders(HeadersResponse::default()))]
                    }
                    Some(In::ResponseBody(body)) => {
                        vec![echo(body.body, body.end_of_stream, false)]
                    }
                    Some(In::ResponseTrailers(_)) => {
                        vec![answer(Out::ResponseTrailers(TrailersResponse::default()))]
                    }
                    None => vec![],
                };
                for response in out {
                    if tx.send(Ok(response)).await.is_err() {
                        return;
                    }
                }
            }
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }
}

fn flag<'a>(args: &'a [String], name: &str) -> Option<&'a str> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .map(String::as_str)
}

fn endpoints(catalog: &str) -> Vec<String> {
    let doc: serde_yaml::Value = serde_yaml::from_str(catalog).expect("catalog YAML");
    let worker = &doc["workers"][0];
    let address = worker["address"].as_str().unwrap_or("127.0.0.1");
    worker["ports"]
        .as_sequence()
        .expect("the catalog's first worker lists ports")
        .iter()
        .map(|p| format!("{address}:{}", p.as_u64().expect("a port number")))
        .collect()
}

async fn serve_metrics(listener: tokio::net::TcpListener) {
    const BODY: &str = "kvpick_inflight_total 0\n";
    while let Ok((mut socket, _)) = listener.accept().await {
        let reply = format!(
            "HTTP/1.1 200 OK\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{BODY}",
            BODY.len()
        );
        let _ = socket.write_all(reply.as_bytes()).await;
    }
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let secure = !args.iter().any(|a| a == "--secure-serving=false");
    let catalog = std::fs::read_to_string(flag(&args, "--config").expect("--config"))
        .expect("readable --config");
    let floor = Arc::new(Floor {
        endpoints: endpoints(&catalog),
        next: AtomicUsize::new(0),
    });
    let bind = flag(&args, "--bind").unwrap_or("127.0.0.1");
    let grpc = tokio::net::TcpListener::bind((bind, 0))
        .await
        .expect("bind");
    let metrics = tokio::net::TcpListener::bind((bind, 0))
        .await
        .expect("bind");
    let grpc_addr: SocketAddr = grpc.local_addr().expect("address");
    let metrics_port = metrics.local_addr().expect("address").port();
    tokio::spawn(serve_metrics(metrics));
    if let Some(path) = flag(&args, "--port-file") {
        let ports = format!(
            "{{\"grpc\": {0}, \"health\": {0}, \"metrics\": {metrics_port}}}",
            grpc_addr.port()
        );
        std::fs::write(path, ports).expect("port file");
    }
    let service = ExternalProcessorServer::new(FloorService(floor));
    if secure {
        serve_tls(grpc, service).await;
        return;
    }
    let incoming = tokio_stream::wrappers::TcpListenerStream::new(grpc).map(|s| {
        s.inspect(|socket| {
            let _ = socket.set_nodelay(true);
        })
    });
    tonic::transport::Server::builder()
        .add_service(service)
        .serve_with_incoming(incoming)
        .await
        .expect("serve");
}

/// Serves `service` over TLS: kvpick's TLS state (self-signed, ALPN h2), one handshake task per
/// accepted connection, the finished streams handed to tonic.
async fn serve_tls(grpc: tokio::net::TcpListener, service: ExternalProcessorServer<FloorService>) {
    let tls = kvpick::transport::tls::server(None).expect("TLS state");
    let (tx, rx) = tokio::sync::mpsc::channel::<std::io::Result<TlsConn>>(64);
    tokio::spawn(async move {
        while let Ok((socket, _)) = grpc.accept().await {
            let _ = socket.set_nodelay(true);
            let (tls, tx) = (Arc::clone(&tls), tx.clone());
            tokio::spawn(async move {
                let Ok(ssl) = tls.ssl() else { return };
                let Ok(mut stream) = tokio_openssl::SslStream::new(ssl, socket) else {
                    return;
                };
                if Pin::new(&mut stream).accept().await.is_ok() {
                    let _ = tx.send(Ok(TlsConn(stream))).await;
                }
            });
        }
    });
    tonic::transport::Server::builder()
        .add_service(service)
        .serve_with_incoming(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .expect("serve");
}

/// A TLS connection as tonic's server takes it (no connect info).
struct TlsConn(tokio_openssl::SslStream<tokio::net::TcpStream>);

impl tonic::transport::server::Connected for TlsConn {
    type ConnectInfo = ();
    fn connect_info(&self) {}
}

impl tokio::io::AsyncRead for TlsConn {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for TlsConn {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }
    fn poll_flush(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }
    fn poll_shutdown(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
}
