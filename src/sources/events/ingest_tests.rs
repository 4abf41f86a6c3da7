//! Ingestion against real loopback engines (`kvpick_testkit::engine`: a PUB port, vLLM's replay
//! ROUTER, an HTTP port), through the real subscription tasks ([`manage`]) into a real
//! [`SelectionCore`]: a dead engine leaves the picks within the bound and comes back cleared, a
//! restarted engine is told from a blip whatever its new sequence numbers, and replayed batches
//! do not count as ingestion lag.

use super::*;
use crate::observability::metrics::Metrics;
use crate::selection::{CoreConfig, PromptInput, SelectionRequest};
use crate::sources::catalog::{RankLayout, WorkerSpec};
use kvpick_core::event::{KvEvent, Medium};
use kvpick_testkit::engine::{EnginePorts, FakeEngine};

const BS: u32 = 16;

#[test]
fn event_lag_is_wall_clock_since_the_batch_timestamp_and_implausible_stamps_are_none() {
    let now = UNIX_EPOCH + Duration::from_secs(1_700_000_000);
    let ts = 1_700_000_000.0 - 0.25;
    assert_eq!(event_lag(ts, now), Some(Duration::from_millis(250)));
    assert_eq!(
        event_lag(1_700_000_000.5, now),
        Some(Duration::ZERO),
        "a stamp ahead of our clock (skew) is no lag"
    );
    let just_over = 1_700_000_000.0 - MAX_EVENT_LAG.as_secs_f64() - 1.0;
    assert_eq!(event_lag(just_over, now), None, "an hour and a second");
    assert_eq!(event_lag(0.0, now), None);
    assert_eq!(event_lag(f64::NAN, now), None);
    assert_eq!(event_lag(1.7e12, now), None, "milliseconds, not seconds");
}

/// Prompt `p`'s four blocks.
fn tokens(p: u32) -> Vec<u32> {
    (0..4 * BS).map(|t| p * 100_000 + t).collect()
}

fn store(p: u32) -> KvEvent {
    KvEvent::BlockStored {
        block_hashes: (0..4).map(|b| u64::from(p) * 1_000 + b).collect(),
        parent_block_hash: None,
        token_ids: tokens(p),
        block_size: BS,
        lora_id: None,
        medium: Medium::Gpu,
        lora_name: None,
        cache_salt: None,
        group_idx: None,
        media: Vec::new(),
    }
}

fn worker(name: &str, ports: &EnginePorts, replay: bool, bs: u32) -> WorkerSpec {
    WorkerSpec {
        block_size: Some(bs),
        kv_events: Some(ports.events_endpoint()),
        kv_replay: replay.then(|| ports.replay_endpoint()),
        ..WorkerSpec::for_test(name, "m", RankLayout::PerPort(vec![ports.http]))
    }
}

struct Rig {
    core: Arc<SelectionCore>,
    task: JoinHandle<()>,
}

impl Drop for Rig {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// `a` with KV events at `engine` (replay or not), `b` a plain rank (its HTTP port answers).
async fn rig(engine: &FakeEngine, replay: bool, b_http: u16) -> Rig {
    rig_sized(engine, replay, b_http, BS).await
}

/// [`rig`] with blocks of `bs` tokens.
async fn rig_sized(engine: &FakeEngine, replay: bool, b_http: u16, bs: u32) -> Rig {
    let core = SelectionCore::new(
        CoreConfig {
            seed: Some(7),
            kv_events: true,
            ..CoreConfig::default()
        },
        Metrics::new(),
    );
    let b = WorkerSpec {
        block_size: Some(bs),
        ..WorkerSpec::for_test("b", "m", RankLayout::PerPort(vec![b_http]))
    };
    core.apply_snapshot(vec![worker("a", &engine.ports, replay, bs), b])
        .unwrap();
    let task = tokio::spawn(manage(Arc::clone(&core), core.catalog_changes()));
    Rig { core, task }
}

impl Rig {
    /// Blocks of prompt `p` cached on `a`.
    /// Blocks of prompt `p` indexed on rank a. The query is one token longer than the stored
    /// blocks: a block-aligned prompt is credited one block less (the engine recomputes its
    /// last token).
    fn on_a(&self, p: u32) -> u32 {
        self.blocks_on_a(tokens(p))
    }

    /// Blocks of `query` plus one token indexed on rank a.
    fn blocks_on_a(&self, mut query: Vec<u32>) -> u32 {
        query.push(7);
        let request = SelectionRequest {
            model: Some("m".into()),
            prompt: PromptInput::Tokens(query),
            ..Default::default()
        };
        let (_, ranks) = self.core.overlap_scores(&request).unwrap();
        ranks
            .iter()
            .find(|(r, _)| &*r.worker_name == "a")
            .map_or(0, |(_, d)| d.gpu)
    }

    /// The worker the pick of prompt `p` goes to.
    fn pick(&self, p: u32, id: &str) -> String {
        let request = SelectionRequest {
            request_id: id.into(),
            model: Some("m".into()),
            prompt: PromptInput::Tokens(tokens(p)),
            ..Default::default()
        };
        self.core
            .select(&request)
            .unwrap()
            .primary
            .worker_name
            .to_string()
    }

    fn a_reachable(&self) -> bool {
        let workers = self.core.list_workers(None);
        let a = workers.iter().find(|w| w.record.spec.name == "a").unwrap();
        a.status[0].reachable
    }

    fn subscriptions(&self) -> i64 {
        self.core.metrics().events.kv_subscriptions.get()
    }

    fn resets(&self) -> u64 {
        self.core.metrics().events.kv_resets.get()
    }

    /// Polls `cond` every 5 ms until it holds; fails past `within`. Returns how long it took.
    async fn until(&self, what: &str, within: Duration, cond: impl Fn(&Rig) -> bool) -> Duration {
        let start = tokio::time::Instant::now();
        while !cond(self) {
            assert!(
                start.elapsed() < within,
                "timed out ({within:?}) waiting for {what}"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        start.elapsed()
    }
}

/// Waits for the subscription and its catch-up replay, then publishes prompt 1 and waits for it.
async fn subscribed_with_prompt_one(rig: &Rig, engine: &mut FakeEngine) {
    engine.subscribed(1).await;
    rig.until("subscribed", Duration::from_secs(10), |r| {
        r.subscriptions() == 1
    })
    .await;
    engine.publish(&[store(1)], true);
    rig.until("prompt 1 indexed", Duration::from_secs(10), |r| {
        r.on_a(1) == 4
    })
    .await;
}

/// The bound on taking a dead engine out of the picks (issue 44: 1–2 s).
const DEAD_WITHIN: Duration = Duration::from_secs(2);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_engine_leaves_the_picks_at_once_and_comes_back_cleared() {
    let b_http = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mut engine = FakeEngine::start(0).await.unwrap();
    let rig = rig(&engine, true, b_http.local_addr().unwrap().port()).await;
    subscribed_with_prompt_one(&rig, &mut engine).await;
    assert_eq!(rig.pick(1, "warm"), "a", "the cache pulls the pick");

    // The engine dies: events and HTTP gone.
    let ports = engine.stop().await;
    let took = rig
        .until("a unreachable", DEAD_WITHIN, |r| !r.a_reachable())
        .await;
    assert_eq!(rig.subscriptions(), 0, "a lost subscription is not counted");
    for i in 0..20 {
        assert_eq!(
            rig.pick(1, &format!("dead{i}")),
            "b",
            "picked {took:?} after the kill"
        );
    }
    assert_eq!(
        rig.core
            .metrics()
            .ranks
            .unreachable
            .with_label_values(&["a", "0"])
            .get(),
        1
    );

    // A new engine run on the same ports: sequence from 0, nothing cached.
    let mut engine = FakeEngine::start_at(ports, 0).await.unwrap();
    rig.until("a back", Duration::from_secs(10), |r| r.a_reachable())
        .await;
    assert_eq!(rig.on_a(1), 0, "cleared before it took picks again");
    assert_eq!(rig.resets(), 1);
    assert_eq!(rig.subscriptions(), 1);
    engine.publish(&[store(2)], true);
    rig.until("the new run indexed", Duration::from_secs(10), |r| {
        r.on_a(2) == 4
    })
    .await;
    assert_eq!(rig.pick(2, "new"), "a");
    assert_eq!(
        rig.core
            .metrics()
            .ranks
            .unreachable_total
            .with_label_values(&["a"])
            .get(),
        1,
        "one transition, however many probes"
    );
}

/// A restarted engine is cleared when its subscription comes back, whether its new sequence is
/// below the old one, past it, or far past it (which the old rule took for a gap to fill).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_engine_is_cleared_at_resubscription_whatever_its_new_sequence() {
    let b_http = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    for (new_first, new_messages) in [(0u64, 1u32), (0, 4), (10, 1)] {
        let mut engine = FakeEngine::start(0).await.unwrap();
        let rig = rig(&engine, true, b_http.local_addr().unwrap().port()).await;
        subscribed_with_prompt_one(&rig, &mut engine).await;
        engine.publish(&[store(3)], true);
        rig.until("two messages applied", Duration::from_secs(10), |r| {
            r.on_a(3) == 4
        })
        .await;
        let ports = engine.stop().await;
        let mut engine = FakeEngine::start_at(ports, new_first).await.unwrap();
        for m in 0..new_messages {
            // Published before kvpick is back: only a replay brings them.
            engine.publish(&[store(10 + m)], false);
        }
        let case = format!("new run from {new_first} with {new_messages} messages");
        engine.subscribed(1).await;
        rig.until(&case, Duration::from_secs(10), |r| {
            r.subscriptions() == 1 && (0..new_messages).all(|m| r.on_a(10 + m) == 4)
        })
        .await;
        assert_eq!(
            (rig.on_a(1), rig.on_a(3)),
            (0, 0),
            "{case}: old blocks cleared"
        );
        assert_eq!(rig.resets(), 1, "{case}");
        assert_eq!(
            rig.core.metrics().events.kv_event_gaps.get(),
            0,
            "{case}: not a gap"
        );
        engine.stop().await;
    }
}

/// A connection that drops while the engine runs on: the replay from the last applied message
/// returns it byte for byte, so nothing is cleared, what was published meanwhile is replayed,
/// and the rank never leaves the picks (its endpoint answers).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blip_keeps_the_index_and_replays_what_was_missed() {
    let b_http = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mut engine = FakeEngine::start(0).await.unwrap();
    let rig = rig(&engine, true, b_http.local_addr().unwrap().port()).await;
    subscribed_with_prompt_one(&rig, &mut engine).await;
    engine.drop_subscribers();
    engine.publish(&[store(4)], false);
    engine.subscribed(2).await;
    rig.until("replayed", Duration::from_secs(10), |r| r.on_a(4) == 4)
        .await;
    assert_eq!(rig.on_a(1), 4, "same run: kept");
    assert_eq!(rig.resets(), 0);
    assert!(rig.a_reachable());
    assert_eq!(
        rig.core
            .metrics()
            .ranks
            .unreachable_total
            .with_label_values(&["a"])
            .get(),
        0,
        "events lost but the engine answers: never out of the picks"
    );
    engine.stop().await;
}

/// Without a replay endpoint a reconnect cannot tell a blip from a restart: the rank is cleared.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_replay_endpoint_a_resubscription_clears_the_rank() {
    let b_http = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mut engine = FakeEngine::start(0).await.unwrap();
    let rig = rig(&engine, false, b_http.local_addr().unwrap().port()).await;
    subscribed_with_prompt_one(&rig, &mut engine).await;
    engine.drop_subscribers();
    engine.subscribed(2).await;
    rig.until("cleared", Duration::from_secs(10), |r| r.on_a(1) == 0)
        .await;
    assert_eq!(rig.resets(), 1);
    // The next live message, whatever its number, applies (no gap, no restart).
    engine.publish(&[store(5)], true);
    rig.until("applied", Duration::from_secs(10), |r| r.on_a(5) == 4)
        .await;
    assert_eq!(rig.core.metrics().events.kv_event_gaps.get(), 0);
    engine.stop().await;
}

/// The partition's end grace as last reported (`None`: no live batch reported one yet).
fn grace(rig: &Rig) -> Option<f64> {
    let family = rig
        .core
        .metrics()
        .registry
        .gather()
        .into_iter()
        .find(|f| f.name() == "kvpick_prediction_grace_seconds")?;
    let m = family
        .get_metric()
        .iter()
        .find(|m| m.get_label().iter().any(|l| l.value() == "m"))?;
    Some(m.get_gauge().get_value())
}

/// Replayed batches carry their original timestamps (27 of them added 4,123 s to the lag sum in
/// issue 44's run): only live batches are observed, as lag and for the end grace; a live batch
/// 3 s late makes predictions outlive their request about 6 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replayed_batches_are_not_observed_as_lag_nor_lengthen_the_grace() {
    let b_http = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mut engine = FakeEngine::start(0).await.unwrap();
    let old = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
        - 600.0;
    for p in 20..23 {
        engine.publish_at(&[store(p)], false, old);
    }
    let rig = rig(&engine, true, b_http.local_addr().unwrap().port()).await;
    engine.subscribed(1).await;
    rig.until("caught up by replay", Duration::from_secs(10), |r| {
        r.on_a(22) == 4
    })
    .await;
    assert_eq!(
        grace(&rig).unwrap_or(1.0),
        1.0,
        "ten minutes old, replayed: no lag"
    );
    engine.publish(&[store(1)], true);
    rig.until("live batch", Duration::from_secs(10), |r| r.on_a(1) == 4)
        .await;
    let lag = &rig.core.metrics().events.event_lag;
    assert_eq!(lag.get_sample_count(), 1, "the live batch only");
    assert!(lag.get_sample_sum() < 5.0, "{} s", lag.get_sample_sum());
    assert_eq!(grace(&rig), Some(1.0));
    let late = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
        - 3.0;
    engine.publish_at(&[store(2)], true, late);
    rig.until("late live batch", Duration::from_secs(10), |r| {
        r.on_a(2) == 4
    })
    .await;
    let g = grace(&rig).unwrap();
    assert!((6.0..7.0).contains(&g), "{g} s");
    engine.stop().await;
}

/// A payload of `tests/fixtures/kv_events/hybrid/` (recorded from a real vLLM 0.32).
macro_rules! hybrid {
    ($name:literal) => {
        bytes::Bytes::from_static(include_bytes!(concat!(
            "../../../tests/fixtures/kv_events/hybrid/",
            $name
        )))
    };
}

fn by_kind(rig: &Rig, event: &str, kind: &str, outcome: &str) -> u64 {
    rig.core
        .metrics()
        .events
        .kv_events_by_kind
        .with_label_values(&[event, kind, outcome])
        .get()
}

fn a_precise(rig: &Rig) -> i64 {
    rig.core
        .metrics()
        .events
        .rank_precise
        .with_label_values(&["a", "0"])
        .get()
}

/// What a real vLLM published for a hybrid model (sliding-window group 0, full-attention group
/// 1, block size 32), byte for byte through a real subscription: the full-attention blocks are
/// indexed (the batch used to be a decode error), the sliding-window events dropped and counted,
/// and the evictions of the full-attention group take the prompt's blocks out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hybrid_vllms_recorded_events_index_its_full_attention_blocks() {
    let b_http = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mut engine = FakeEngine::start(0).await.unwrap();
    let rig = rig_sized(&engine, true, b_http.local_addr().unwrap().port(), 32).await;
    engine.subscribed(1).await;
    rig.until("subscribed", Duration::from_secs(10), |r| {
        r.subscriptions() == 1
    })
    .await;
    let store = hybrid!("recorded_store.msgpack");
    let prompt = match &decode_batch(&store).unwrap().events[1] {
        KvEvent::BlockStored { token_ids, .. } => token_ids.clone(),
        other => panic!("{other:?}"),
    };
    engine.publish_payload(store, true);
    rig.until(
        "full-attention blocks indexed",
        Duration::from_secs(10),
        |r| r.blocks_on_a(prompt.clone()) == 63,
    )
    .await;
    assert_eq!(by_kind(&rig, "stored", "full_attention", "admitted"), 1);
    assert_eq!(by_kind(&rig, "stored", "sliding_window", "dropped"), 1);
    assert_eq!(a_precise(&rig), 1);
    let decode_errors = rig
        .core
        .metrics()
        .events
        .kv_events
        .with_label_values(&["decode_error"]);
    assert_eq!(decode_errors.get(), 0);

    engine.publish_payload(hybrid!("recorded_evict.msgpack"), true);
    rig.until(
        "evicted but its first block",
        Duration::from_secs(10),
        |r| r.blocks_on_a(prompt.clone()) == 1,
    )
    .await;
    assert_eq!(by_kind(&rig, "removed", "full_attention", "admitted"), 63);
    assert_eq!(by_kind(&rig, "removed", "sliding_window", "dropped"), 2);
    engine.stop().await;
}

/// A model with sliding-window attention on every layer (recorded from a real vLLM): its events
/// cannot confirm a prefix, so the rank stays approximate; its AllBlocksCleared does not make it
/// precise either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_without_full_attention_stays_approximate() {
    let b_http = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mut engine = FakeEngine::start(0).await.unwrap();
    let rig = rig_sized(&engine, true, b_http.local_addr().unwrap().port(), 32).await;
    engine.subscribed(1).await;
    rig.until("subscribed", Duration::from_secs(10), |r| {
        r.subscriptions() == 1
    })
    .await;
    engine.publish_payload(hybrid!("recorded_sliding_only_store.msgpack"), true);
    engine.publish_payload(hybrid!("recorded_sliding_only_cleared.msgpack"), true);
    // A groupless remove of a block never stored: handled after both, applied by nothing.
    let marker = KvEvent::BlockRemoved {
        block_hashes: vec![42],
        medium: Medium::Gpu,
        group_idx: None,
    };
    engine.publish(&[marker], true);
    rig.until("all three handled", Duration::from_secs(10), |r| {
        by_kind(r, "removed", "none", "admitted") == 1
    })
    .await;
    assert_eq!(by_kind(&rig, "stored", "sliding_window", "dropped"), 1);
    let applied = rig
        .core
        .metrics()
        .events
        .kv_events
        .with_label_values(&["applied"]);
    assert_eq!(applied.get(), 0, "nothing reached the index as an event");
    assert_eq!(a_precise(&rig), 0, "approximate");
    engine.stop().await;
}
