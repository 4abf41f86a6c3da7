//! Which API a request body was sent to (from the request `:path`): both the host's body reader
//! (`kvpick::request`) and this crate's prompt reader tell bodies apart by it. It owns only that
//! type; it reads no body.

/// Which API a body was sent to, as far as reading its prompt cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Endpoint {
    /// Chat, completions or responses: told apart by the body's fields.
    #[default]
    Generate,
    /// `/v1/embeddings`: `input` is text to tokenize, not a responses conversation.
    Embeddings,
    /// Anthropic `/v1/messages` (and `/v1/messages/count_tokens`), converted as vLLM does.
    Messages,
    /// SGLang's native `/generate`: `text` or `input_ids`.
    SglangGenerate,
}

impl Endpoint {
    /// From the request `:path`.
    pub fn from_path(path: &str) -> Self {
        let path = path.split('?').next().unwrap_or_default();
        if path.ends_with("/embeddings") {
            Endpoint::Embeddings
        } else if path.ends_with("/v1/messages") || path.ends_with("/v1/messages/count_tokens") {
            Endpoint::Messages
        } else if path == "/generate" {
            Endpoint::SglangGenerate
        } else {
            Endpoint::Generate
        }
    }
}
