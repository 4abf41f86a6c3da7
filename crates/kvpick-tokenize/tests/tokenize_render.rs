//! The render client against a small local HTTP server that behaves like vLLM's render
//! endpoints: ids on success, a deadline, a cap on the answer size, connection reuse, and the
//! registry's fallback to load-only routing when the engine misbehaves.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test/bench harness: a panic is a failure report

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use kvpick_tokenize::render::{RenderClient, RenderError, RenderKind};
use kvpick_tokenize::{ModelEntry, Source, TokenizeOutcome, Tokenizers};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// What the fake engine does with each request.
#[derive(Clone, Copy)]
enum Mode {
    Ok,
    Huge,
    Hang,
    Status500,
}

/// A minimal HTTP/1.1 keep-alive server; counts accepted connections and requests.
async fn fake_engine(mode: Mode) -> (String, Arc<AtomicUsize>, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let conns = Arc::new(AtomicUsize::new(0));
    let reqs = Arc::new(AtomicUsize::new(0));
    let (c, r) = (Arc::clone(&conns), Arc::clone(&reqs));
    tokio::spawn(async move {
        loop {
            let Ok((mut sock, _)) = listener.accept().await else {
                return;
            };
            c.fetch_add(1, Ordering::SeqCst);
            let r = Arc::clone(&r);
            tokio::spawn(async move {
                let mut buf = Vec::new();
                loop {
                    // Read one request: headers, then content-length bytes.
                    let (head_end, len) = loop {
                        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                            let head = String::from_utf8_lossy(&buf[..i]).to_ascii_lowercase();
                            let len = head
                                .lines()
                                .find_map(|l| l.strip_prefix("content-length:"))
                                .map(|v| v.trim().parse::<usize>().unwrap())
                                .unwrap_or(0);
                            break (i + 4, len);
                        }
                        let mut chunk = [0u8; 4096];
                        match sock.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                    };
                    while buf.len() < head_end + len {
                        let mut chunk = [0u8; 4096];
                        match sock.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                    }
                    let path = String::from_utf8_lossy(&buf[..head_end])
                        .split_whitespace()
                        .nth(1)
                        .unwrap_or("")
                        .to_string();
                    buf.drain(..head_end + len);
                    r.fetch_add(1, Ordering::SeqCst);
                    let (status, body) = match mode {
                        Mode::Hang => {
                            std::future::pending::<()>().await;
                            unreachable!()
                        }
                        Mode::Status500 => ("500 Internal Server Error", b"{}".to_vec()),
                        Mode::Huge => ("200 OK", vec![b' '; 4096]),
                        Mode::Ok if path == "/v1/chat/completions/render" => {
                            ("200 OK", br#"{"token_ids":[1,2,3]}"#.to_vec())
                        }
                        Mode::Ok if path == "/v1/completions/render" => {
                            ("200 OK", br#"[{"prompt_token_ids":[4,5]}]"#.to_vec())
                        }
                        Mode::Ok => ("404 Not Found", Vec::new()),
                    };
                    let head = format!(
                        "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
                        body.len()
                    );
                    if sock.write_all(head.as_bytes()).await.is_err()
                        || sock.write_all(&body).await.is_err()
                    {
                        return;
                    }
                }
            });
        }
    });
    (url, conns, reqs)
}

#[tokio::test]
async fn renders_both_endpoints_over_one_reused_connection() {
    let (url, conns, reqs) = fake_engine(Mode::Ok).await;
    let client = RenderClient::new(&url).unwrap();
    for _ in 0..5 {
        let ids = client
            .render(RenderKind::Chat, Bytes::from_static(b"{}"))
            .await
            .unwrap();
        assert_eq!(ids, vec![1, 2, 3]);
        let ids = client
            .render(RenderKind::Completions, Bytes::from_static(b"{}"))
            .await
            .unwrap();
        assert_eq!(ids, vec![4, 5]);
    }
    assert_eq!(reqs.load(Ordering::SeqCst), 10);
    assert_eq!(
        conns.load(Ordering::SeqCst),
        1,
        "the pooled connection is reused"
    );
}

#[tokio::test]
async fn deadline_size_cap_and_status_are_errors() {
    let (url, _, _) = fake_engine(Mode::Hang).await;
    let client = RenderClient::new(&url)
        .unwrap()
        .with_limits(Duration::from_millis(200), 1 << 20);
    assert_eq!(
        client.render(RenderKind::Chat, Bytes::new()).await,
        Err(RenderError::Timeout)
    );
    let (url, _, _) = fake_engine(Mode::Huge).await;
    let client = RenderClient::new(&url)
        .unwrap()
        .with_limits(Duration::from_secs(5), 1024);
    assert_eq!(
        client.render(RenderKind::Chat, Bytes::new()).await,
        Err(RenderError::TooLarge)
    );
    let (url, _, _) = fake_engine(Mode::Status500).await;
    let client = RenderClient::new(&url).unwrap();
    assert_eq!(
        client.render(RenderKind::Chat, Bytes::new()).await,
        Err(RenderError::Status(500))
    );
    // Nobody listens: a transport error, not a panic.
    let dead = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", dead.local_addr().unwrap());
    drop(dead);
    let client = RenderClient::new(&url).unwrap();
    assert!(matches!(
        client.render(RenderKind::Chat, Bytes::new()).await,
        Err(RenderError::Transport(_))
    ));
}

fn render_only(url: &str) -> Tokenizers {
    let entry: ModelEntry =
        serde_yaml::from_str(&format!("model: m\nrender_url: {url}\n")).unwrap();
    Tokenizers::from_entries(
        &[entry],
        std::path::Path::new("."),
        &prometheus::Registry::new(),
    )
    .unwrap()
}

#[tokio::test]
async fn registry_uses_render_and_falls_back_to_load_only_counting_it() {
    let (url, _, _) = fake_engine(Mode::Ok).await;
    let t = render_only(&url);
    let chat = Bytes::from_static(br#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#);
    assert_eq!(
        t.tokenize("m", chat.clone()).await,
        TokenizeOutcome::Tokens {
            ids: vec![1, 2, 3],
            source: Source::Render,
            media: Vec::new(),
        }
    );
    let responses = Bytes::from_static(br#"{"model":"m","input":"hi"}"#);
    assert_eq!(
        t.tokenize("m", responses).await,
        TokenizeOutcome::Tokens {
            ids: vec![1, 2, 3],
            source: Source::Render,
            media: Vec::new(),
        }
    );
    assert_eq!(
        t.tokenize("other", chat.clone()).await,
        TokenizeOutcome::NotApplicable
    );

    let (url, _, _) = fake_engine(Mode::Status500).await;
    let t = render_only(&url);
    assert!(matches!(
        t.tokenize("m", chat.clone()).await,
        TokenizeOutcome::Fallback { .. }
    ));
    assert!(matches!(
        t.tokenize("m", Bytes::from_static(b"{not json")).await,
        TokenizeOutcome::Fallback { .. }
    ));
    let m = t.metrics();
    assert_eq!(m.outcomes.with_label_values(&["m", "fallback"]).get(), 2);
    assert_eq!(m.errors.with_label_values(&["m", "render"]).get(), 1);
    assert_eq!(m.errors.with_label_values(&["m", "body"]).get(), 1);
}

#[test]
fn config_errors_name_the_model_and_field() {
    let registry = prometheus::Registry::new();
    let parse = |y: &str| -> Vec<ModelEntry> { serde_yaml::from_str(y).unwrap() };
    let err = |entries: Vec<ModelEntry>| {
        Tokenizers::from_entries(&entries, std::path::Path::new("."), &registry)
            .unwrap_err()
            .to_string()
    };
    assert!(err(parse("- model: a\n"))
        .contains("model \"a\": set tokenizer_dir, tokenizer_json or render_url"));
    assert!(err(parse("- model: a\n  render_url: https://x:1\n")).contains("TLS"));
    assert!(err(parse(
        "- model: a\n  render_url: http://x:1\n- model: a\n  render_url: http://x:1\n"
    ))
    .contains("listed twice"));
    assert!(err(parse(
        "- model: a\n  tokenizer_json: /does/not/exist.json\n"
    ))
    .contains("tokenizer_json"));
    assert!(err(parse(
        "- model: a\n  render_url: http://x:1\n  chat_template: x\n"
    ))
    .contains("chat_template needs tokenizer_json or tokenizer_dir"));
    assert!(serde_yaml::from_str::<Vec<ModelEntry>>("- model: a\n  tokenizer_jsn: x\n").is_err());
}
