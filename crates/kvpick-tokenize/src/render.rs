//! Remote tokenization through an engine's render endpoints (ARCHITECTURE.md §8, source 3): vLLM's
//! `POST /v1/chat/completions/render` and `POST /v1/completions/render` take the request body and
//! answer the prompt's token ids. One pooled HTTP/1 client per model (connections are reused),
//! a 5 s deadline per call and a 16 MiB cap on the answer. It owns the HTTP exchange and the
//! render request a body becomes ([`request_for`], [`chat_body`]); deciding what to do on failure
//! is the registry's.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;

use crate::body::layout::BodyLayout;
use crate::json::Json;
use crate::prompt::PromptSpec;

pub const RENDER_TIMEOUT: Duration = Duration::from_secs(5);
pub const RENDER_MAX_BYTES: usize = 16 << 20;

/// Which render endpoint to call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RenderKind {
    Chat,
    Completions,
}

impl RenderKind {
    fn path(self) -> &'static str {
        match self {
            RenderKind::Chat => "/v1/chat/completions/render",
            RenderKind::Completions => "/v1/completions/render",
        }
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RenderError {
    #[error("render call timed out")]
    Timeout,
    #[error("render call failed: {0}")]
    Transport(String),
    #[error("render endpoint answered HTTP {0}")]
    Status(u16),
    #[error("render answer exceeds {RENDER_MAX_BYTES} bytes")]
    TooLarge,
    #[error("render answer has no token ids: {0}")]
    BadAnswer(String),
}

/// A client for one engine base URL (`http://host:port`, optionally with a path prefix).
#[derive(Clone)]
pub struct RenderClient {
    base: String,
    client: Client<HttpConnector, Full<Bytes>>,
    timeout: Duration,
    max_bytes: usize,
}

impl std::fmt::Debug for RenderClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RenderClient")
            .field("base", &self.base)
            .finish()
    }
}

impl RenderClient {
    /// Validates `base` (plain `http://` only) and builds a pooled client.
    pub fn new(base: &str) -> Result<Self, String> {
        let base = base.trim_end_matches('/').to_string();
        let uri: hyper::Uri = base
            .parse()
            .map_err(|e| format!("render_url {base:?} is not a URL: {e}"))?;
        if uri.scheme_str() != Some("http") || uri.host().is_none() {
            return Err(format!(
                "render_url {base:?} must be http://host[:port][/prefix] (TLS is not supported)"
            ));
        }
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(RENDER_TIMEOUT));
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(60))
            .pool_max_idle_per_host(16)
            .build(connector);
        Ok(RenderClient {
            base,
            client,
            timeout: RENDER_TIMEOUT,
            max_bytes: RENDER_MAX_BYTES,
        })
    }

    /// Overrides the deadline and size cap (tests).
    pub fn with_limits(mut self, timeout: Duration, max_bytes: usize) -> Self {
        self.timeout = timeout;
        self.max_bytes = max_bytes;
        self
    }

    /// Posts `body` to the render endpoint and returns the prompt's token ids.
    pub async fn render(&self, kind: RenderKind, body: Bytes) -> Result<Vec<u32>, RenderError> {
        match tokio::time::timeout(self.timeout, self.call(kind, body)).await {
            Ok(result) => result,
            Err(_) => Err(RenderError::Timeout),
        }
    }

    async fn call(&self, kind: RenderKind, body: Bytes) -> Result<Vec<u32>, RenderError> {
        let request = hyper::Request::post(format!("{}{}", self.base, kind.path()))
            .header(hyper::header::CONTENT_TYPE, "application/json")
            .body(Full::new(body))
            .map_err(|e| RenderError::Transport(e.to_string()))?;
        let response = self
            .client
            .request(request)
            .await
            .map_err(|e| RenderError::Transport(e.to_string()))?;
        let status = response.status();
        if let Some(len) = response
            .headers()
            .get(hyper::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<usize>().ok())
        {
            if len > self.max_bytes {
                return Err(RenderError::TooLarge);
            }
        }
        let bytes = Limited::new(response.into_body(), self.max_bytes)
            .collect()
            .await
            .map_err(|e| {
                if e.downcast_ref::<http_body_util::LengthLimitError>()
                    .is_some()
                {
                    RenderError::TooLarge
                } else {
                    RenderError::Transport(e.to_string())
                }
            })?
            .to_bytes();
        if !status.is_success() {
            return Err(RenderError::Status(status.as_u16()));
        }
        token_ids_of(&bytes)
    }
}

/// Token ids from a render answer: `{"token_ids": [..]}` or `{"prompt_token_ids": [..]}`, at the
/// top level or in the first element of a list (completions render answers one per prompt).
pub fn token_ids_of(bytes: &[u8]) -> Result<Vec<u32>, RenderError> {
    let value: serde_json::Value =
        serde_json::from_slice(bytes).map_err(|e| RenderError::BadAnswer(e.to_string()))?;
    let object = match &value {
        serde_json::Value::Array(items) => items.first(),
        other => Some(other),
    }
    .ok_or_else(|| RenderError::BadAnswer("empty list".into()))?;
    for key in ["token_ids", "prompt_token_ids"] {
        if let Some(ids) = object.get(key) {
            return serde_json::from_value::<Vec<u32>>(ids.clone())
                .map_err(|e| RenderError::BadAnswer(format!("`{key}`: {e}")));
        }
    }
    Err(RenderError::BadAnswer(
        "no `token_ids` or `prompt_token_ids`".into(),
    ))
}

/// The render endpoint and body for a request: the body as sent for chat and completions;
/// `/v1/responses` is converted to a chat body. `None` for a body that is not JSON.
pub(crate) fn request_for(
    spec: Option<&PromptSpec>,
    body: &Bytes,
    layout: Option<&BodyLayout>,
) -> Option<(RenderKind, Bytes)> {
    if layout?.has("messages") {
        return Some((RenderKind::Chat, body.clone()));
    }
    if layout?.has("prompt") {
        return Some((RenderKind::Completions, body.clone()));
    }
    chat_body(spec, body, layout)
}

/// The chat render request for a converted prompt (the converted messages, tools and kwargs):
/// `/v1/responses` and `/v1/messages` bodies.
pub(crate) fn chat_body(
    spec: Option<&PromptSpec>,
    body: &[u8],
    layout: Option<&BodyLayout>,
) -> Option<(RenderKind, Bytes)> {
    let Some(PromptSpec::Chat(chat)) = spec else {
        return None;
    };
    let json = crate::body::layout::fields_of(body, layout?, &["model"]).ok()?;
    let mut entries = vec![
        ("model", json.get("model").cloned().unwrap_or(Json::Null)),
        (
            "messages",
            Json::Array(chat.messages.iter().map(|m| m.json().clone()).collect()),
        ),
        (
            "add_generation_prompt",
            Json::Bool(chat.add_generation_prompt),
        ),
    ];
    if let Some(tools) = &chat.tools {
        entries.push(("tools", tools.clone()));
    }
    if !chat.kwargs.is_empty() {
        entries.push(("chat_template_kwargs", Json::Object(chat.kwargs.clone())));
    }
    let out = serde_json::to_vec(&Json::object(entries)).ok()?;
    Some((RenderKind::Chat, Bytes::from(out)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answer_shapes() {
        assert_eq!(token_ids_of(br#"{"token_ids":[1,2]}"#), Ok(vec![1, 2]));
        assert_eq!(token_ids_of(br#"[{"prompt_token_ids":[3]}]"#), Ok(vec![3]));
        assert!(token_ids_of(br#"{"token_ids":[-1]}"#).is_err());
        assert!(token_ids_of(b"nope").is_err());
        assert!(token_ids_of(b"[]").is_err());
    }

    #[test]
    fn only_plain_http_urls() {
        assert!(RenderClient::new("http://127.0.0.1:8000").is_ok());
        assert!(RenderClient::new("https://x:1").is_err());
        assert!(RenderClient::new("not a url").is_err());
    }
}
