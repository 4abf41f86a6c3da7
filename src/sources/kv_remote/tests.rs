//! The remote-index client against real sockets: its deadline, a refused connection, the skip
//! while down, the flag's bounds.

use std::sync::Arc;
use std::time::Duration;

use prometheus::Registry;

use super::*;

fn client(url: &str, deadline_ms: u64) -> (Arc<KvRemote>, KvRemoteMetrics) {
    let metrics = KvRemoteMetrics::register(&Registry::new());
    let remote = KvRemote::new(
        url,
        None,
        Duration::from_millis(deadline_ms),
        metrics.clone(),
    )
    .unwrap();
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

#[tokio::test]
async fn only_http_and_https_urls_are_accepted() {
    let metrics = KvRemoteMetrics::register(&Registry::new());
    for url in ["indexer:9002", "tcp://indexer:9002", "grpc://indexer:9002"] {
        let err = KvRemote::new(url, None, Duration::from_millis(50), metrics.clone())
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.contains("http://host:port"), "{url}: {err}");
    }
    let err = KvRemote::new(
        "http://indexer:9002#insecure",
        None,
        Duration::from_millis(50),
        metrics.clone(),
    )
    .err()
    .map(|e| e.to_string())
    .unwrap_or_default();
    assert!(err.contains("need https://"), "{err}");
    for url in ["https://indexer:9002", "https://indexer:9002#insecure"] {
        assert!(KvRemote::new(url, None, Duration::from_millis(50), metrics.clone()).is_ok());
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

/// The indexer: kvpick's own selection API over a core with workers `a` and `b` of block size
/// `block_size`, on a loopback port.
async fn indexer(block_size: u32) -> (Arc<SelectionCore>, String) {
    use crate::sources::catalog::WorkerSpec;
    use kvpick_core::catalog::RankLayout;
    let core = SelectionCore::new(
        kvpick_core::CoreConfig::default(),
        crate::observability::metrics::Metrics::new(),
    );
    core.apply_snapshot(
        ["a", "b"]
            .iter()
            .zip([1u16, 2])
            .map(|(name, port)| WorkerSpec {
                block_size: Some(block_size),
                ..WorkerSpec::for_test(name, "m", RankLayout::PerPort(vec![port]))
            })
            .collect(),
    )
    .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(crate::hosts::api::SelectionApi::new(Arc::clone(&core)).into_server())
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    (core, url)
}

/// The replica's query for a prompt of `tokens` tokens, as its own core (block size 16) hashes it.
fn replica_query(model: &str, tokens: u32) -> RemoteQuery {
    use crate::sources::catalog::WorkerSpec;
    use kvpick_core::catalog::RankLayout;
    let replica = kvpick_core::Core::new(kvpick_core::CoreConfig::default());
    let spec = WorkerSpec {
        block_size: Some(16),
        ..WorkerSpec::for_test("a", model, RankLayout::PerPort(vec![1]))
    };
    replica
        .apply_source_snapshot("catalog", vec![spec], std::time::Instant::now())
        .unwrap();
    replica
        .remote_query(&crate::selection::SelectionRequest {
            model: Some(model.into()),
            prompt: crate::selection::PromptInput::Tokens((0..tokens).collect()),
            ..Default::default()
        })
        .unwrap()
}

/// The real API answers: the holder's depth comes back, counted as an answer.
#[tokio::test]
async fn the_indexers_scores_come_back_as_the_picks_overlap() {
    let (core, url) = indexer(16).await;
    let query = replica_query("m", 4 * 16 + 1);
    let b = RankKey {
        worker_id: core
            .list_workers(None)
            .into_iter()
            .find(|w| w.record.spec.name == "b")
            .unwrap()
            .record
            .id,
        dp_rank: 0,
    };
    let key = kvpick_core::PartitionKey {
        model: "m".into(),
        routing_group: String::new(),
    };
    core.insert_blocks(
        &key,
        b,
        &query.seq_hashes,
        kvpick_core::index::Tier::Gpu,
        None,
    );
    let (remote, metrics) = client(&url, 1_000);
    let overlap = remote.overlap(query).await.expect("answered");
    let depth = overlap.ranks().iter().find(|r| r.0 == b).map(|r| r.1.gpu);
    assert_eq!(depth, Some(4));
    assert_eq!(metrics.answered.get(), 1);
    assert_eq!(metrics.up.get(), 1);
}

/// The indexer answers with an error: it is up (no `down`), and the pick is approximate.
#[tokio::test]
async fn a_refusal_is_counted_by_what_it_says_and_does_not_take_the_indexer_down() {
    let (_core, url) = indexer(16).await;
    let (remote, metrics) = client(&url, 1_000);
    // A model the indexer does not serve: UNAVAILABLE from its core, not from the transport.
    assert!(remote.overlap(replica_query("other", 33)).await.is_none());
    assert_eq!(fallbacks(&metrics, "rejected"), 1);
    // Still asked: a refusal is not an outage.
    assert!(remote.overlap(replica_query("other", 33)).await.is_none());
    assert_eq!(fallbacks(&metrics, "rejected"), 2);
    assert_eq!(fallbacks(&metrics, "down"), 0);

    // An indexer whose workers declare blocks of 64 tokens: the replica's 16-token hashes do
    // not describe the prompt there.
    let (_core, url) = indexer(64).await;
    let (remote, metrics) = client(&url, 1_000);
    assert!(remote
        .overlap(replica_query("m", 4 * 16 + 1))
        .await
        .is_none());
    assert_eq!(fallbacks(&metrics, "mismatch"), 1);
    assert_eq!(metrics.answered.get(), 0);
}
