//! The remote-index client against real sockets: its deadline, a refused connection, the skip
//! while down, the flag's bounds.

use std::sync::Arc;
use std::time::Duration;

use prometheus::Registry;

use super::*;

fn client(url: &str, deadline_ms: u64) -> (Arc<KvRemote>, KvRemoteMetrics) {
    let metrics = KvRemoteMetrics::register(&Registry::new());
    let remote = KvRemote::new(url, Duration::from_millis(deadline_ms), metrics.clone()).unwrap();
    (Arc::new(remote), metrics)
}

fn query() -> RemoteQuery {
    RemoteQuery {
        model: "m".into(),
        routing_group: String::new(),
        seq_hashes: vec![1, 2, 3],
        prompt_tokens: 49,
    }
}

fn fallbacks(metrics: &KvRemoteMetrics, reason: &str) -> u64 {
    metrics.fallbacks.with_label_values(&[reason]).get()
}

#[test]
fn the_deadline_flag_is_bounded_both_ways() {
    assert!(check_timeout_ms(MIN_TIMEOUT_MS - 1).is_err());
    assert_eq!(
        check_timeout_ms(MIN_TIMEOUT_MS).unwrap(),
        Duration::from_millis(1)
    );
    assert_eq!(
        check_timeout_ms(MAX_TIMEOUT_MS).unwrap(),
        Duration::from_secs(10)
    );
    let err = check_timeout_ms(MAX_TIMEOUT_MS + 1)
        .unwrap_err()
        .to_string();
    assert!(err.contains("--kv-index-remote-timeout-ms"), "{err}");
}

#[test]
fn only_a_plain_grpc_url_is_accepted() {
    let metrics = KvRemoteMetrics::register(&Registry::new());
    for url in ["https://indexer:9002", "indexer:9002", "tcp://indexer:9002"] {
        let err = KvRemote::new(url, Duration::from_millis(50), metrics.clone())
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.contains("http://host:port"), "{url}: {err}");
    }
}

/// A peer that accepts connections and never answers: the pick waits no longer than the
/// deadline, counts `timeout`, and the next pick does not wait at all (`down`).
#[tokio::test]
async fn a_silent_indexer_costs_one_deadline_then_picks_skip_it() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let held = tokio::spawn(async move {
        let mut open = Vec::new();
        while let Ok((socket, _)) = listener.accept().await {
            open.push(socket);
        }
    });
    let (remote, metrics) = client(&format!("http://{addr}"), 50);
    let started = std::time::Instant::now();
    assert!(remote.overlap(query()).await.is_none());
    let waited = started.elapsed();
    assert!(waited >= Duration::from_millis(50), "{waited:?}");
    assert!(
        waited < CONNECT_TIMEOUT,
        "bounded by the deadline: {waited:?}"
    );
    assert_eq!(fallbacks(&metrics, "timeout"), 1);
    assert_eq!(metrics.up.get(), 0);
    let started = std::time::Instant::now();
    assert!(remote.overlap(query()).await.is_none());
    assert!(started.elapsed() < Duration::from_millis(50));
    assert_eq!(fallbacks(&metrics, "down"), 1);
    held.abort();
}

/// Nothing listens: the transport's own error, counted `unavailable`.
#[tokio::test]
async fn a_refused_connection_is_unavailable() {
    let addr = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let (remote, metrics) = client(&format!("http://{addr}"), 1_000);
    assert!(remote.overlap(query()).await.is_none());
    assert_eq!(fallbacks(&metrics, "unavailable"), 1);
    assert_eq!(metrics.answered.get(), 0);
}
