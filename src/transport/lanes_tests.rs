//! The lanes over loopback: connections spread over the lanes by their open connections, each
//! served entirely on its lane's thread, and the connection cap holds across lanes.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use super::*;

use std::sync::Mutex;
use std::time::Duration;

use tokio::io::AsyncReadExt;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::health_server::HealthServer;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::server::HealthService;

use crate::observability::metrics::Metrics;
use crate::transport::net::ConnLimits;

#[test]
fn least_loaded_takes_the_fewest_and_ties_in_turn() {
    assert_eq!(least_loaded(&[3, 1, 2], 0), 1);
    assert_eq!(least_loaded(&[0, 0, 0], 0), 0);
    assert_eq!(least_loaded(&[0, 0, 0], 1), 1);
    assert_eq!(least_loaded(&[0, 0, 0], 2), 2);
    assert_eq!(least_loaded(&[1, 0, 0], 2), 2);
    assert_eq!(least_loaded(&[0, 1, 1], 1), 0);
}

/// Serves gRPC health on `threads` lanes, recording the thread that runs each request's handler.
async fn serve_recording(
    threads: usize,
    limits: ConnLimits,
) -> (
    std::net::SocketAddr,
    Arc<Mutex<Vec<String>>>,
    crate::observability::metrics::ConnMetrics,
    watch::Sender<bool>,
) {
    let (reporter, _) = tonic_health::server::health_reporter();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let record = Arc::clone(&seen);
    let service = HealthServer::with_interceptor(
        HealthService::from_health_reporter(reporter),
        move |request| {
            let name = std::thread::current().name().unwrap_or("").to_string();
            record.lock().unwrap().push(name);
            Ok(request)
        },
    );
    let router = tonic::transport::Server::builder().add_service(service);
    let metrics = Metrics::new().conn;
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let listening = Listening {
        name: "grpc",
        tls: None,
        limits,
        metrics: metrics.clone(),
    };
    let (stop, exit) = watch::channel(false);
    tokio::spawn(serve(router, listener, listening, exit, threads));
    (addr, seen, metrics, stop)
}

async fn check(client: &mut HealthClient<tonic::transport::Channel>) {
    let request = HealthCheckRequest {
        service: String::new(),
    };
    client.check(request).await.unwrap();
}

async fn client(addr: std::net::SocketAddr) -> HealthClient<tonic::transport::Channel> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    HealthClient::new(channel)
}

#[tokio::test]
async fn connections_spread_over_the_lanes_and_stay_on_theirs() {
    let (addr, seen, metrics, _stop) = serve_recording(2, ConnLimits::default()).await;
    let mut clients = Vec::new();
    for _ in 0..4 {
        clients.push(client(addr).await);
    }
    for _ in 0..3 {
        for c in clients.iter_mut() {
            check(c).await;
        }
    }
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 12);
    // Each connection's three requests ran on one lane's thread...
    for (i, _) in clients.iter().enumerate() {
        let mine: Vec<&String> = seen.iter().skip(i).step_by(4).collect();
        assert!(mine.iter().all(|t| *t == mine[0]), "{seen:?}");
        assert!(mine[0].starts_with("kvpick-conn-"), "{seen:?}");
    }
    // ...and the four connections went two to each lane.
    let on_first = seen[..4].iter().filter(|t| *t == "kvpick-conn-0").count();
    assert_eq!(on_first, 2, "{seen:?}");
    // Each thread's gauge counts its two.
    for thread in ["0", "1"] {
        assert_eq!(metrics.thread_open.with_label_values(&[thread]).get(), 2);
    }
}

#[tokio::test]
async fn the_connection_past_the_cap_is_closed_and_closed_ones_free_their_lane() {
    let limits = ConnLimits {
        max_connections: 3,
        ..ConnLimits::default()
    };
    let (addr, seen, metrics, _stop) = serve_recording(2, limits).await;
    let mut conns = Vec::new();
    for _ in 0..3 {
        let mut c = client(addr).await;
        check(&mut c).await;
        conns.push(c);
    }
    // Lanes 0, 1, 0 in turn.
    assert_eq!(
        *seen.lock().unwrap(),
        ["kvpick-conn-0", "kvpick-conn-1", "kvpick-conn-0"]
    );
    // The fourth connection is accepted and closed at once.
    let mut fourth = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut buf = [0u8; 64];
    let read = tokio::time::timeout(Duration::from_secs(10), fourth.read(&mut buf)).await;
    assert!(matches!(read.expect("closed"), Ok(0) | Err(_)));
    // Closing both of lane 0's connections empties it: the next connection goes there, though
    // lane 1 is next in turn.
    conns.remove(2);
    conns.remove(0);
    let (lane0, lane1) = (
        metrics.thread_open.with_label_values(&["0"]),
        metrics.thread_open.with_label_values(&["1"]),
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while lane0.get() != 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "lane 0: {}",
            lane0.get()
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    assert_eq!(lane1.get(), 1);
    assert_eq!(metrics.open.with_label_values(&["grpc"]).get(), 1);
    let mut next = client(addr).await;
    check(&mut next).await;
    assert_eq!(seen.lock().unwrap().last().unwrap(), "kvpick-conn-0");
}
