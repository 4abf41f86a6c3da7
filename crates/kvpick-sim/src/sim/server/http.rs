//! The simulated engine's HTTP surface: the OpenAI-compatible routes (completions, chat,
//! models, server info), the request parser, streaming generation against the rank's engine
//! loop, and the Prometheus `/metrics` text a vLLM server would expose. It owns no fleet state:
//! the worker, its ranks and their command channels are [`super`]'s.

use super::*;

pub(super) fn router(worker: Arc<Worker>) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/health", get(|| async { StatusCode::OK }))
        .route("/metrics", get(metrics))
        // What SGLang's router (sglang-router / smg 0.3.x) reads when it registers a worker; it
        // tries the new names first and falls back to the `get_` ones.
        .route("/server_info", get(server_info))
        .route("/get_server_info", get(server_info))
        .route("/model_info", get(model_info))
        .route("/get_model_info", get(model_info))
        .with_state(worker)
}

fn error(status: StatusCode, message: impl std::fmt::Display) -> Response {
    let body = json!({"error": {"message": message.to_string(), "type": "BadRequestError", "code": status.as_u16()}});
    (
        status,
        [("content-type", "application/json")],
        body.to_string(),
    )
        .into_response()
}

/// Deterministic tokenizer for text: kvpick's own pseudo-tokens (4-byte little-endian words).
pub fn tokenize(text: &str) -> Vec<u32> {
    kvpick_core::hash::pseudo_tokens(text.as_bytes())
}

fn chat_text(messages: &Value) -> Option<String> {
    let mut text = String::new();
    for m in messages.as_array()? {
        let role = m.get("role").and_then(Value::as_str).unwrap_or("user");
        let content = match m.get("content") {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Array(parts)) => parts
                .iter()
                .filter_map(|p| p.get("text").and_then(Value::as_str))
                .collect::<Vec<_>>()
                .join(""),
            _ => String::new(),
        };
        text.push_str(&format!("<|{role}|>\n{content}\n"));
    }
    text.push_str("<|assistant|>\n");
    Some(text)
}

/// Text of generated token `i`.
fn token_text(i: u32) -> &'static str {
    const WORDS: [&str; 8] = [
        " the", " cache", " is", " warm", " and", " tokens", " flow", ".",
    ];
    WORDS[i as usize % WORDS.len()]
}

struct Parsed {
    prompt: Vec<u32>,
    max_tokens: u32,
    stream: bool,
    include_usage: bool,
    model: String,
}

fn parse(worker: &Worker, body: &[u8], chat: bool) -> Result<Parsed, (StatusCode, String)> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| (StatusCode::BAD_REQUEST, format!("invalid JSON: {e}")))?;
    let model = v
        .get("model")
        .and_then(Value::as_str)
        .unwrap_or(&worker.model)
        .to_string();
    if model != worker.model && !worker.lora.contains(&model) {
        return Err((
            StatusCode::NOT_FOUND,
            format!("The model `{model}` does not exist."),
        ));
    }
    let prompt = if chat {
        let text = v.get("messages").and_then(chat_text).ok_or((
            StatusCode::BAD_REQUEST,
            "messages must be a list".to_string(),
        ))?;
        tokenize(&text)
    } else {
        match v.get("prompt") {
            Some(Value::String(s)) => tokenize(s),
            Some(Value::Array(items)) if items.iter().all(Value::is_u64) => items
                .iter()
                .map(|t| t.as_u64().map(|t| t as u32))
                .collect::<Option<Vec<u32>>>()
                .unwrap_or_default(),
            Some(Value::Array(items)) if items.len() == 1 && items[0].is_string() => {
                tokenize(items[0].as_str().unwrap_or_default())
            }
            _ => {
                return Err((
                    StatusCode::BAD_REQUEST,
                    "prompt must be a string or a list of token ids".to_string(),
                ))
            }
        }
    };
    if prompt.is_empty() {
        return Err((StatusCode::BAD_REQUEST, "empty prompt".to_string()));
    }
    let max_tokens = v
        .get("max_tokens")
        .or_else(|| v.get("max_completion_tokens"))
        .and_then(Value::as_u64)
        .unwrap_or(16)
        .clamp(1, u32::MAX as u64) as u32;
    let stream = v.get("stream").and_then(Value::as_bool).unwrap_or(false);
    let include_usage = v
        .pointer("/stream_options/include_usage")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    Ok(Parsed {
        prompt,
        max_tokens,
        stream,
        include_usage,
        model,
    })
}

/// Aborts the request in its engine unless it finished (client went away mid-request).
struct AbortGuard {
    cmd: mpsc::UnboundedSender<Cmd>,
    id: u64,
    done: bool,
    /// An adapter request counts as running on its rank as long as the request lives.
    _adapter: Option<AdapterInFlight>,
}

impl Drop for AbortGuard {
    fn drop(&mut self) {
        if !self.done {
            let _ = self.cmd.send(Cmd::Abort(self.id));
        }
    }
}

fn usage(prompt: u32, completion: u32, cached: u32) -> Value {
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    })
}

async fn completions(
    State(worker): State<Arc<Worker>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    generate(worker, headers, body, false).await
}

async fn chat_completions(
    State(worker): State<Arc<Worker>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    generate(worker, headers, body, true).await
}

async fn generate(worker: Arc<Worker>, headers: HeaderMap, body: Bytes, chat: bool) -> Response {
    let parsed = match parse(&worker, &body, chat) {
        Ok(p) => p,
        Err((status, message)) => return error(status, message),
    };
    let n = worker.ranks.len();
    let rank = match headers.get("x-data-parallel-rank") {
        Some(v) => match v.to_str().ok().and_then(|s| s.trim().parse::<usize>().ok()) {
            Some(r) if r < n => r,
            _ => {
                return error(
                    StatusCode::BAD_REQUEST,
                    format!("X-data-parallel-rank must be in 0..{n}"),
                )
            }
        },
        None => worker.next_rank.fetch_add(1, Ordering::Relaxed) % n,
    };
    let id = worker.next_id.fetch_add(1, Ordering::Relaxed);
    let cmd = worker.ranks[rank].cmd.clone();
    // Prefill/decode: the named prefill rank computes the prompt, this rank pulls its KV.
    let mut pd_headers: Vec<(&'static str, String)> = Vec::new();
    let target = if worker.role.decodes() {
        match crate::sim::pd::target(&headers, &worker.peers) {
            Ok(t) => t,
            Err(message) => return error(StatusCode::BAD_REQUEST, message),
        }
    } else {
        None
    };
    if let Some(target) = target {
        let done = match crate::sim::pd::prefill(
            target,
            &parsed.model,
            &parsed.prompt,
            Duration::from_secs(120),
        )
        .await
        {
            Ok(done) => done,
            Err(message) => return error(StatusCode::BAD_GATEWAY, message),
        };
        let (cached_tx, cached_rx) = oneshot::channel();
        let _ = cmd.send(Cmd::Cached {
            prompt: parsed.prompt.clone(),
            reply: cached_tx,
        });
        let bs = worker.config.block_size.max(1);
        let have = cached_rx.await.unwrap_or(0) / bs;
        let blocks = (parsed.prompt.len() / bs).saturating_sub(have) as u64;
        let wait = blocks.saturating_mul(worker.transfer_ns_per_block) as f64 / worker.speedup;
        tokio::time::sleep(Duration::from_nanos(wait as u64)).await;
        pd_headers = vec![
            ("x-sim-prefill-worker", done.worker),
            ("x-sim-prefill-rank", done.rank),
            ("x-sim-prefill-host-port", target.addr.to_string()),
            ("x-sim-transferred-blocks", blocks.to_string()),
        ];
    }
    let (out_tx, mut out_rx) = mpsc::unbounded_channel();
    let (reply_tx, reply_rx) = oneshot::channel();
    if cmd
        .send(Cmd::Add {
            request: EngineRequest {
                id,
                prompt: parsed.prompt,
                max_tokens: parsed.max_tokens,
            },
            transferred: target.is_some(),
            outputs: out_tx,
            reply: reply_tx,
        })
        .is_err()
    {
        return error(StatusCode::SERVICE_UNAVAILABLE, "engine stopped");
    }
    match reply_rx.await {
        Ok(Ok(())) => {}
        Ok(Err(err)) => return error(StatusCode::BAD_REQUEST, err),
        Err(_) => return error(StatusCode::SERVICE_UNAVAILABLE, "engine stopped"),
    }
    let mut guard = AbortGuard {
        cmd,
        id,
        done: false,
        _adapter: (parsed.model != worker.model)
            .then(|| AdapterInFlight::new(&worker.ranks[rank].adapters, &parsed.model)),
    };
    let created = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let rid = if chat {
        format!("chatcmpl-{id}")
    } else {
        format!("cmpl-{id}")
    };
    let model = parsed.model;
    let rank_header = ("x-sim-rank", rank.to_string());
    let worker_header = ("x-sim-worker", worker.index.to_string());
    let role_header = ("x-sim-role", worker.role.as_str().to_string());
    let interval = worker.stream_interval;
    if !parsed.stream {
        let mut text = String::new();
        let mut last = None;
        while let Some(out) = out_rx.recv().await {
            for i in 0..out.new_tokens {
                text.push_str(token_text(out.generated - out.new_tokens + i));
            }
            let finished = out.finished;
            last = Some(out);
            if finished {
                break;
            }
        }
        let Some(last) = last.filter(|o| o.finished) else {
            return error(StatusCode::SERVICE_UNAVAILABLE, "engine stopped");
        };
        guard.done = true;
        let usage = usage(last.prompt_tokens, last.generated, last.cached_tokens);
        let body = if chat {
            json!({"id": rid, "object": "chat.completion", "created": created, "model": model,
                   "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                "logprobs": null, "finish_reason": "length"}],
                   "usage": usage})
        } else {
            json!({"id": rid, "object": "text_completion", "created": created, "model": model,
                   "choices": [{"index": 0, "text": text, "logprobs": null,
                                "finish_reason": "length"}],
                   "usage": usage})
        };
        let mut response = (
            StatusCode::OK,
            [
                ("content-type", "application/json".to_string()),
                rank_header,
                worker_header,
                role_header,
            ],
            body.to_string(),
        )
            .into_response();
        add_headers(&mut response, &pd_headers);
        return response;
    }
    let include_usage = parsed.include_usage;
    let stream = futures::stream::unfold(
        (out_rx, Some(guard), false),
        move |(mut rx, mut guard, mut role_sent)| {
            let rid = rid.clone();
            let model = model.clone();
            async move {
                guard.as_ref()?;
                let mut outs = Vec::new();
                loop {
                    let out: SeqOutput = rx.recv().await?;
                    if out.new_tokens == 0 && !out.finished {
                        continue;
                    }
                    let flush = out.first || out.finished || out.generated.is_multiple_of(interval);
                    outs.push(out);
                    if flush {
                        break;
                    }
                }
                let mut chunk = String::new();
                let mut event = |choice: Value, usage: Option<Value>| {
                    let mut obj = json!({"id": rid, "created": created, "model": model,
                        "object": if chat { "chat.completion.chunk" } else { "text_completion" },
                        "choices": choice});
                    if let Some(u) = usage {
                        obj["usage"] = u;
                    }
                    chunk.push_str(&format!("data: {obj}\n\n"));
                };
                let out = outs.last().expect("at least one output").clone();
                let text: String = outs
                    .iter()
                    .flat_map(|o| {
                        (0..o.new_tokens).map(move |i| token_text(o.generated - o.new_tokens + i))
                    })
                    .collect();
                if !text.is_empty() {
                    let text = text.as_str();
                    let last = out.finished;
                    let finish = if last { json!("length") } else { Value::Null };
                    let choice = if chat {
                        let delta = if role_sent {
                            json!({"content": text})
                        } else {
                            role_sent = true;
                            json!({"role": "assistant", "content": text})
                        };
                        json!([{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}])
                    } else {
                        json!([{"index": 0, "text": text, "logprobs": null, "finish_reason": finish}])
                    };
                    event(choice, None);
                }
                if out.finished {
                    if include_usage {
                        event(
                            json!([]),
                            Some(usage(out.prompt_tokens, out.generated, out.cached_tokens)),
                        );
                    }
                    chunk.push_str("data: [DONE]\n\n");
                    if let Some(mut g) = guard.take() {
                        g.done = true;
                    }
                }
                Some((
                    Ok::<Bytes, Infallible>(Bytes::from(chunk)),
                    (rx, guard, role_sent),
                ))
            }
        },
    );
    let mut response = (
        StatusCode::OK,
        [
            ("content-type", "text/event-stream".to_string()),
            ("cache-control", "no-cache".to_string()),
            rank_header,
            worker_header,
            role_header,
        ],
        Body::from_stream(stream),
    )
        .into_response();
    add_headers(&mut response, &pd_headers);
    response
}

fn add_headers(response: &mut Response, headers: &[(&'static str, String)]) {
    for (name, value) in headers {
        if let Ok(value) = axum::http::HeaderValue::from_str(value) {
            response.headers_mut().insert(*name, value);
        }
    }
}

/// SGLang's `/server_info`: the served model and the cache geometry. No `model_path` or
/// `tokenizer_path`: the router would try to load a tokenizer from it, and text routing
/// (`cache_aware`) needs none.
async fn server_info(State(worker): State<Arc<Worker>>) -> Response {
    let c = &worker.config;
    let body = json!({"served_model_name": worker.model, "dp_size": worker.ranks.len(),
        "page_size": c.block_size, "max_total_num_tokens": c.num_gpu_blocks * c.block_size,
        "max_running_requests": c.max_num_seqs, "chunked_prefill_size": c.max_num_batched_tokens,
        "version": concat!("kvpick-sim ", env!("CARGO_PKG_VERSION"))});
    (
        StatusCode::OK,
        [("content-type", "application/json")],
        body.to_string(),
    )
        .into_response()
}

/// SGLang's `/model_info` (see [`server_info`] for why no paths).
async fn model_info(State(worker): State<Arc<Worker>>) -> Response {
    let body = json!({"served_model_name": worker.model, "is_generation": true,
        "max_context_length": worker.config.num_gpu_blocks * worker.config.block_size,
        "preferred_sampling_params": null});
    (
        StatusCode::OK,
        [("content-type", "application/json")],
        body.to_string(),
    )
        .into_response()
}

async fn models(State(worker): State<Arc<Worker>>) -> Response {
    let body = json!({"object": "list", "data": [{"id": worker.model, "object": "model",
        "owned_by": "kvpick-sim", "max_model_len": worker.config.num_gpu_blocks * worker.config.block_size}]});
    (
        StatusCode::OK,
        [("content-type", "application/json")],
        body.to_string(),
    )
        .into_response()
}

/// LoRA state of one rank for `vllm:lora_requests_info`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoraInfo {
    pub max_loras: u32,
    /// Adapters with in-flight requests, sorted.
    pub running: Vec<String>,
}

/// `vllm:*` metrics, one sample per rank (`engine` label), like a vLLM DP deployment; with
/// `lora` (one per rank), also `vllm:lora_requests_info` (value: the Unix time, as vLLM does).
pub fn metrics_text(
    model: &str,
    config: &EngineConfig,
    ranks: &[EngineStats],
    lora: Option<&[LoraInfo]>,
) -> String {
    let mut s = String::new();
    let mut family =
        |name: &str, kind: &str, help: &str, value: &dyn Fn(&EngineStats) -> String| {
            s.push_str(&format!("# HELP {name} {help}\n# TYPE {name} {kind}\n"));
            for (i, r) in ranks.iter().enumerate() {
                s.push_str(&format!(
                    "{name}{{engine=\"{i}\",model_name=\"{model}\"}} {}\n",
                    value(r)
                ));
            }
        };
    family(
        "vllm:num_requests_running",
        "gauge",
        "Number of requests in model execution batches.",
        &|r| r.running.to_string(),
    );
    family(
        "vllm:num_requests_waiting",
        "gauge",
        "Number of requests waiting to be processed.",
        &|r| r.waiting.to_string(),
    );
    family(
        "vllm:kv_cache_usage_perc",
        "gauge",
        "KV-cache usage. 1 means 100 percent usage.",
        &|r| format!("{}", r.kv_usage),
    );
    family(
        "vllm:prefix_cache_queries_total",
        "counter",
        "Prefix cache queries, in terms of number of queried tokens.",
        &|r| r.prefix_cache_queries.to_string(),
    );
    family(
        "vllm:prefix_cache_hits_total",
        "counter",
        "Prefix cache hits, in terms of number of cached tokens.",
        &|r| r.prefix_cache_hits.to_string(),
    );
    family(
        "vllm:num_preemptions_total",
        "counter",
        "Cumulative number of preemptions.",
        &|r| r.preemptions.to_string(),
    );
    s.push_str(&format!(
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n\
         # TYPE vllm:cache_config_info gauge\n\
         vllm:cache_config_info{{block_size=\"{}\",enable_prefix_caching=\"True\",num_gpu_blocks=\"{}\",model_name=\"{model}\"}} 1.0\n",
        config.block_size, config.num_gpu_blocks
    ));
    if let Some(lora) = lora {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        s.push_str(
            "# HELP vllm:lora_requests_info Running stats on lora requests.\n\
             # TYPE vllm:lora_requests_info gauge\n",
        );
        for (i, info) in lora.iter().enumerate() {
            s.push_str(&format!(
                "vllm:lora_requests_info{{engine=\"{i}\",max_lora=\"{}\",running_lora_adapters=\"{}\",waiting_lora_adapters=\"\"}} {now}\n",
                info.max_loras,
                info.running.join(",")
            ));
        }
    }
    s
}

async fn metrics(State(worker): State<Arc<Worker>>) -> Response {
    let stats: Vec<EngineStats> = worker.ranks.iter().map(|r| *r.stats.lock()).collect();
    let lora: Option<Vec<LoraInfo>> = (!worker.lora.is_empty()).then(|| {
        worker
            .ranks
            .iter()
            .map(|r| LoraInfo {
                max_loras: worker.max_loras,
                running: r.adapters.lock().keys().cloned().collect(),
            })
            .collect()
    });
    (
        StatusCode::OK,
        [("content-type", "text/plain; version=0.0.4")],
        metrics_text(&worker.model, &worker.config, &stats, lora.as_deref()),
    )
        .into_response()
}
