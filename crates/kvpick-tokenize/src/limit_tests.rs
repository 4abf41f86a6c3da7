use super::*;
use std::time::Duration;

fn tokenizers(limits: TokenizeLimits) -> Tokenizers {
    let dir = std::env::temp_dir().join(format!("kvpick-limits-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("tokenizer.json"),
        prefix_cache::testutil::tokenizer_json(),
    )
    .unwrap();
    let entries: Vec<ModelEntry> = serde_yaml::from_str(
        "- model: m\n  tokenizer_json: tokenizer.json\n  chat_template: \"{% for m in messages %}{{ m.content }}\\n{% endfor %}\"\n",
    )
    .unwrap();
    let t = Tokenizers::from_entries(&entries, &dir, &Registry::new()).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    t.with_limits(limits)
}

fn chat(content: &str) -> Bytes {
    Bytes::from(
        serde_json::json!({"model": "m", "messages": [{"role": "user", "content": content}]})
            .to_string(),
    )
}

fn skipped(t: &Tokenizers, reason: &str) -> u64 {
    t.metrics().skipped.with_label_values(&["m", reason]).get()
}

#[tokio::test]
async fn bodies_over_the_cap_are_not_tokenized() {
    let t = tokenizers(TokenizeLimits {
        max_body_bytes: 100,
        ..TokenizeLimits::default()
    });
    assert!(matches!(
        t.tokenize("m", chat("hello")).await,
        TokenizeOutcome::Tokens { .. }
    ));
    let big = chat(&"word ".repeat(40));
    assert!(big.len() > 100);
    assert_eq!(
        t.tokenize("m", big).await,
        TokenizeOutcome::Skipped {
            reason: SKIP_BODY_TOO_LARGE
        }
    );
    assert_eq!(skipped(&t, SKIP_BODY_TOO_LARGE), 1);
    // The one tokenized request waited in the queue once (the skipped one never queued).
    assert_eq!(
        t.metrics()
            .queue_wait
            .with_label_values(&["m"])
            .get_sample_count(),
        1
    );
    assert_eq!(
        t.metrics()
            .outcomes
            .with_label_values(&["m", "fallback"])
            .get(),
        1
    );
    assert!(!t.admits_body("m", 101));
    assert_eq!(skipped(&t, SKIP_BODY_TOO_LARGE), 2);
}

#[tokio::test]
async fn anthropic_bodies_tokenize_as_their_chat_equivalent_within_the_same_limits() {
    let t = tokenizers(TokenizeLimits {
        max_body_bytes: 300,
        ..TokenizeLimits::default()
    });
    let anthropic = Bytes::from(
        serde_json::json!({"model": "m", "max_tokens": 8, "system": [{"type": "text", "text": "sys"}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]})
        .to_string(),
    );
    let chat = Bytes::from(
        serde_json::json!({"model": "m", "messages": [{"role": "system", "content": "sys"},
            {"role": "user", "content": "hello"}]})
        .to_string(),
    );
    let a = t
        .tokenize_request(Endpoint::Messages, "m", anthropic.clone())
        .await;
    assert!(matches!(a, TokenizeOutcome::Tokens { .. }), "{a:?}");
    assert_eq!(a, t.tokenize("m", chat).await);
    // Read as an OpenAI chat body it would be a different prompt (no system message).
    assert_ne!(t.tokenize("m", anthropic).await, a);
    // The body cap applies unchanged: one byte over it is not tokenized.
    let mut big = serde_json::json!({"model": "m", "messages": [{"role": "user", "content": ""}]});
    let len = big.to_string().len();
    big["messages"][0]["content"] = serde_json::Value::String("x".repeat(301 - len));
    let big = Bytes::from(big.to_string());
    assert_eq!(big.len(), 301);
    assert_eq!(
        t.tokenize_request(Endpoint::Messages, "m", big).await,
        TokenizeOutcome::Skipped {
            reason: SKIP_BODY_TOO_LARGE
        }
    );
    // A malformed Anthropic body falls back (counted), it does not fail.
    let bad = Bytes::from_static(
        br#"{"model":"m","messages":[{"role":"user","content":[{"type":"audio"}]}]}"#,
    );
    assert!(matches!(
        t.tokenize_request(Endpoint::Messages, "m", bad).await,
        TokenizeOutcome::Fallback { .. }
    ));
    // SGLang /generate text tokenizes like a completions prompt.
    let generate = Bytes::from_static(br#"{"text":"hello world","rid":"r"}"#);
    let completion = Bytes::from_static(br#"{"model":"m","prompt":"hello world"}"#);
    assert_eq!(
        t.tokenize_request(Endpoint::SglangGenerate, "m", generate)
            .await,
        t.tokenize("m", completion).await
    );
}

/// Holds the only tokenizer thread with a job of `bytes` until the sender is dropped.
async fn hold(
    t: &Arc<Tokenizers>,
    bytes: usize,
) -> (std::sync::mpsc::Sender<()>, tokio::task::JoinHandle<()>) {
    let (release, hold) = std::sync::mpsc::channel::<()>();
    let (started_tx, started) = tokio::sync::oneshot::channel();
    let t2 = Arc::clone(t);
    let busy = tokio::spawn(async move {
        let limits = JobLimits {
            bytes,
            max_bytes: usize::MAX,
            stall: Duration::from_secs(3600),
        };
        t2.pool
            .run(limits, move || {
                let _ = started_tx.send(());
                let _ = hold.recv();
            })
            .await
            .unwrap();
    });
    started.await.unwrap();
    (release, busy)
}

/// The only tokenizer thread is stuck (held by a job until released): the request waits the
/// stall timeout (real time: a paused clock would jump past it while the thread works), then
/// routes on load alone, counted as `queue_stalled`.
#[tokio::test]
async fn a_stuck_tokenizer_routes_on_load_after_the_stall_timeout() {
    let t = tokenizers(TokenizeLimits {
        stall_timeout: Duration::from_millis(20),
        ..TokenizeLimits::default()
    })
    .with_pool(TokenizerPool::new(1, 4).unwrap());
    let t = Arc::new(t);
    let (release, busy) = hold(&t, 10).await;
    let outcome = tokio::time::timeout(Duration::from_secs(60), t.tokenize("m", chat("hi")))
        .await
        .expect("a stuck pool has a bound");
    assert_eq!(
        outcome,
        TokenizeOutcome::Skipped {
            reason: SKIP_QUEUE_STALLED
        }
    );
    assert_eq!(skipped(&t, SKIP_QUEUE_STALLED), 1);
    drop(release);
    busy.await.unwrap();
    assert!(matches!(
        t.tokenize("m", chat("hi")).await,
        TokenizeOutcome::Tokens { .. }
    ));
}

/// The work bound: a request whose body would take the outstanding bytes one byte over
/// `max_queued_bytes` is routed on load alone at once (`queue_full`); one that fits exactly
/// waits and is tokenized. `kvpick_tokenize_queued_bytes` shows the outstanding bytes.
#[tokio::test]
async fn a_request_just_over_the_queued_bytes_bound_routes_on_load_at_once() {
    let fits = chat("hello");
    let over = chat("hello!");
    assert_eq!(over.len(), fits.len() + 1);
    let held = 1_000;
    let t = tokenizers(TokenizeLimits {
        max_queued_bytes: Some(held + fits.len()),
        stall_timeout: Duration::from_secs(3600),
        ..TokenizeLimits::default()
    })
    .with_pool(TokenizerPool::new(1, 4).unwrap());
    let t = Arc::new(t);
    let (release, busy) = hold(&t, held).await;
    assert_eq!(t.metrics().queued_bytes.get(), held as i64);
    // Nothing else queued: one byte too many is refused without waiting for the held thread.
    let refused = tokio::time::timeout(Duration::from_secs(60), t.tokenize("m", over))
        .await
        .expect("refused at once, not queued behind the held thread");
    assert_eq!(
        refused,
        TokenizeOutcome::Skipped {
            reason: SKIP_QUEUE_FULL
        }
    );
    assert_eq!(skipped(&t, SKIP_QUEUE_FULL), 1);
    let waiting = {
        let t = Arc::clone(&t);
        tokio::spawn(async move { t.tokenize("m", fits).await })
    };
    while t.metrics().queued_bytes.get() == held as i64 {
        tokio::task::yield_now().await;
    }
    assert_eq!(t.metrics().queued_bytes.get(), t.max_queued_bytes() as i64);
    drop(release);
    busy.await.unwrap();
    assert!(matches!(
        waiting.await.unwrap(),
        TokenizeOutcome::Tokens { .. }
    ));
    assert_eq!(t.metrics().queued_bytes.get(), 0);
}

#[test]
fn the_queued_bytes_bound_defaults_to_4_mib_per_thread() {
    let t = tokenizers(TokenizeLimits::default()).with_pool(TokenizerPool::new(3, 4).unwrap());
    assert_eq!(t.max_queued_bytes(), 3 * (4 << 20));
}
