//! Parsing of request bodies (OpenAI chat, completions, responses, embeddings; Anthropic
//! messages; SGLang `/generate`) into what routing needs (model, stream flag, salt, prompt).
//! The host (`kvpick`'s ext_proc stream) reads every body through it; it never mutates the body
//! (the echoed body stays byte-identical).

#![warn(clippy::arithmetic_side_effects)]

use std::borrow::Cow;

use serde::Deserialize;

pub mod layout;
pub mod scan;

/// Which API a body was sent to.
pub use crate::endpoint::Endpoint;

/// What a request body tells the router.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedBody {
    /// `None` only for SGLang's `/generate`, whose bodies name no model: any partition.
    pub model: Option<String>,
    pub stream: bool,
    pub cache_salt: Option<String>,
    pub prompt: Prompt,
}

/// The prompt part of a body, as precisely as the body allows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prompt {
    /// `/v1/completions` with `prompt: [int]`: the engine's own token ids.
    TokenIds(Vec<u32>),
    /// Token ids of a multimodal prompt as the tokenizer made them (placeholders expanded) and
    /// the images' spans (`tokenize::media`).
    MediaTokenIds {
        ids: Vec<u32>,
        media: Vec<kvpick_core::hash::MediaSpan>,
    },
    /// The prompt-bearing JSON (messages + tools, prompt text, responses input), byte for byte as
    /// sent: stable across turns that append to a conversation.
    Text(Vec<u8>),
    /// No prompt field found.
    Absent,
}

/// Why a body was refused; every variant is a client error (400).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BodyError {
    #[error("malformed JSON body: {0}")]
    Malformed(String),
    #[error("request body must be a JSON object")]
    NotAnObject,
    #[error("missing `model` in request body")]
    MissingModel,
    #[error("`model` must be a non-empty string")]
    InvalidModel,
}

#[derive(Deserialize)]
struct Envelope<'a> {
    #[serde(default)]
    model: Option<serde_json::Value>,
    #[serde(default)]
    stream: Option<serde_json::Value>,
    #[serde(default, borrow)]
    cache_salt: Option<&'a serde_json::value::RawValue>,
    #[serde(default, borrow)]
    prompt: Option<&'a serde_json::value::RawValue>,
    #[serde(default, borrow)]
    messages: Option<&'a serde_json::value::RawValue>,
    #[serde(default, borrow)]
    tools: Option<&'a serde_json::value::RawValue>,
    #[serde(default, borrow)]
    instructions: Option<&'a serde_json::value::RawValue>,
    #[serde(default, borrow)]
    input: Option<&'a serde_json::value::RawValue>,
    #[serde(default, borrow)]
    system: Option<&'a serde_json::value::RawValue>,
    #[serde(default, borrow)]
    text: Option<&'a serde_json::value::RawValue>,
    #[serde(default, borrow)]
    input_ids: Option<&'a serde_json::value::RawValue>,
}

/// A prompt-bearing field as it was read: its raw JSON, or the token ids of a field that is a flat
/// JSON array of u32 (what [`token_ids`] returns for that raw JSON), which the streaming scanner
/// ([`scan`]) reads as they arrive instead of keeping the text.
#[derive(Debug)]
pub(crate) enum RawField<'a> {
    Json(Cow<'a, [u8]>),
    Ids(Vec<u32>),
}

impl RawField<'_> {
    fn into_token_ids(self) -> Result<Vec<u32>, Self> {
        match self {
            RawField::Ids(ids) => Ok(ids),
            RawField::Json(raw) => token_ids(&raw).ok_or(RawField::Json(raw)),
        }
    }
}

/// The envelope's fields, however the body was read (serde over the whole body, or the
/// streaming scanner): `model` and `stream` as serde values, the rest as raw JSON (borrowed from
/// the body, or copied out of its chunks). A field sent as `null` is absent, as serde reads an
/// `Option`.
#[derive(Debug, Default)]
pub(crate) struct Fields<'a> {
    pub(crate) model: Option<serde_json::Value>,
    pub(crate) stream: Option<serde_json::Value>,
    pub(crate) cache_salt: Option<Cow<'a, [u8]>>,
    pub(crate) prompt: Option<RawField<'a>>,
    pub(crate) messages: Option<Cow<'a, [u8]>>,
    pub(crate) tools: Option<Cow<'a, [u8]>>,
    pub(crate) instructions: Option<Cow<'a, [u8]>>,
    pub(crate) input: Option<RawField<'a>>,
    pub(crate) system: Option<Cow<'a, [u8]>>,
    pub(crate) text: Option<RawField<'a>>,
    pub(crate) input_ids: Option<RawField<'a>>,
}

/// Token ids as sent, or the first list of a batch of them.
fn token_ids_or_first(raw: RawField<'_>) -> Result<Vec<u32>, Cow<'_, [u8]>> {
    match raw.into_token_ids() {
        Ok(ids) => Ok(ids),
        Err(RawField::Json(raw)) => serde_json::from_slice::<Vec<Vec<u32>>>(&raw)
            .ok()
            .and_then(|batch| batch.into_iter().next())
            .ok_or(raw),
        // `into_token_ids` gives ids back as `Ok`.
        Err(RawField::Ids(ids)) => Ok(ids),
    }
}

/// A prompt field that is text to tokenize (or token ids): ids, the string, or the raw JSON.
fn text_or_ids(raw: RawField<'_>) -> Prompt {
    match token_ids_or_first(raw) {
        Ok(ids) => Prompt::TokenIds(ids),
        Err(raw) => text_or_raw(raw),
    }
}

/// A JSON string's text, or the raw JSON when it is not a string.
fn text_or_raw(raw: Cow<'_, [u8]>) -> Prompt {
    match serde_json::from_slice::<String>(&raw) {
        Ok(text) => Prompt::Text(text.into_bytes()),
        Err(_) => Prompt::Text(raw.into_owned()),
    }
}

/// The prompt-bearing fields in the order they render, each ended by NUL. One field copied out
/// of the chunks already is the text (no second copy).
fn joined<const N: usize>(parts: [Option<Cow<'_, [u8]>>; N]) -> Prompt {
    let len: usize = parts
        .iter()
        .flatten()
        .map(|p| p.len().saturating_add(1))
        .sum();
    let mut present = parts.into_iter().flatten();
    let (Some(first), second) = (present.next(), present.next()) else {
        return Prompt::Absent;
    };
    let mut text = match (first, &second) {
        (Cow::Owned(only), None) => only,
        (first, _) => {
            let mut text = Vec::with_capacity(len);
            text.extend_from_slice(&first);
            text
        }
    };
    text.push(0);
    for part in second.into_iter().chain(present) {
        text.extend_from_slice(&part);
        text.push(0);
    }
    Prompt::Text(text)
}

/// Whether the streaming scanner may read this field of a body sent to `endpoint` as ids (a
/// flat u32 array): only where the prompt logic below asks for ids before anything else. Every
/// other field stays raw JSON.
pub(crate) fn reads_as_ids(endpoint: Endpoint, field: &str) -> bool {
    matches!(
        (endpoint, field),
        (Endpoint::Generate, "prompt")
            | (Endpoint::Embeddings, "input")
            | (Endpoint::SglangGenerate, "input_ids")
    )
}

/// The raw JSON of a field [`reads_as_ids`] never reads as ids.
fn json_of(field: Option<RawField<'_>>) -> Option<Cow<'_, [u8]>> {
    match field {
        Some(RawField::Json(raw)) => Some(raw),
        Some(RawField::Ids(_)) | None => None,
    }
}

impl Fields<'_> {
    fn prompt_for(self, endpoint: Endpoint) -> Prompt {
        match endpoint {
            Endpoint::Generate => self.prompt(),
            // Anthropic: tools and system render before the conversation.
            Endpoint::Messages => joined([self.tools, self.system, self.messages]),
            Endpoint::Embeddings => self.input.map_or(Prompt::Absent, text_or_ids),
            Endpoint::SglangGenerate => {
                let ids = self
                    .input_ids
                    .filter(|raw| !matches!(raw, RawField::Json(j) if **j == *b"null"));
                match ids.or(self.text) {
                    Some(raw) => text_or_ids(raw),
                    None => Prompt::Absent,
                }
            }
        }
    }

    fn prompt(self) -> Prompt {
        if let Some(raw) = self.prompt {
            return match raw.into_token_ids() {
                Ok(ids) => Prompt::TokenIds(ids),
                Err(RawField::Json(raw)) => text_or_raw(raw),
                Err(RawField::Ids(ids)) => Prompt::TokenIds(ids),
            };
        }
        // Tools render before the conversation in chat templates, so they lead the prefix too.
        let input = json_of(self.input);
        joined([self.tools, self.instructions, self.messages, input])
    }

    /// What the body tells the router, or the client error it is.
    pub(crate) fn into_parsed(self, endpoint: Endpoint) -> Result<ParsedBody, BodyError> {
        let model = match &self.model {
            // SGLang's native API names no model: the request goes to any partition.
            None | Some(serde_json::Value::Null) if endpoint == Endpoint::SglangGenerate => None,
            None | Some(serde_json::Value::Null) => return Err(BodyError::MissingModel),
            Some(serde_json::Value::String(s)) if !s.is_empty() => Some(s.clone()),
            Some(_) => return Err(BodyError::InvalidModel),
        };
        let stream = matches!(self.stream, Some(serde_json::Value::Bool(true)));
        let cache_salt = self
            .cache_salt
            .as_deref()
            .and_then(|raw| serde_json::from_slice::<String>(raw).ok());
        let prompt = self.prompt_for(endpoint);
        Ok(ParsedBody {
            model,
            stream,
            cache_salt,
            prompt,
        })
    }
}

impl<'a> Envelope<'a> {
    fn into_fields(self) -> Fields<'a> {
        let raw = |v: Option<&'a serde_json::value::RawValue>| {
            v.map(|r| Cow::Borrowed(r.get().as_bytes()))
        };
        let field = |v: Option<&'a serde_json::value::RawValue>| raw(v).map(RawField::Json);
        Fields {
            model: self.model,
            stream: self.stream,
            cache_salt: raw(self.cache_salt),
            prompt: field(self.prompt),
            messages: raw(self.messages),
            tools: raw(self.tools),
            instructions: raw(self.instructions),
            input: field(self.input),
            system: raw(self.system),
            text: field(self.text),
            input_ids: field(self.input_ids),
        }
    }
}

/// A JSON array of u32 token ids, parsed directly: on long prompts serde's generic sequence path
/// is most of a request's CPU. `raw` is already valid JSON (it came out of the envelope); whatever
/// this loop does not recognise (signs, fractions, exponents, overflow, non-numbers) goes to
/// serde, so the result is always exactly `serde_json::from_str::<Vec<u32>>(raw).ok()`.
fn token_ids(raw: &[u8]) -> Option<Vec<u32>> {
    fast_token_ids(raw).or_else(|| serde_json::from_slice::<Vec<u32>>(raw).ok())
}

fn fast_token_ids(bytes: &[u8]) -> Option<Vec<u32>> {
    let skip_ws = |mut i: usize| {
        while i < bytes.len() && matches!(bytes[i], b' ' | b'\t' | b'\n' | b'\r') {
            i = i.saturating_add(1);
        }
        i
    };
    let mut i = skip_ws(0);
    if bytes.get(i) != Some(&b'[') {
        return None;
    }
    i = skip_ws(i.saturating_add(1));
    // Token ids average a few digits: a byte-length estimate avoids regrowing.
    let mut ids = Vec::with_capacity(bytes.len() / 4);
    if bytes.get(i) == Some(&b']') {
        return (skip_ws(i.saturating_add(1)) == bytes.len()).then_some(ids);
    }
    loop {
        let start = i;
        let mut value: u64 = 0;
        while i < bytes.len() && bytes[i].is_ascii_digit() {
            let digit = u64::from(bytes[i].wrapping_sub(b'0'));
            value = value.checked_mul(10)?.checked_add(digit)?;
            if value > u32::MAX as u64 {
                return None;
            }
            i = i.saturating_add(1);
        }
        // No digits, or a leading zero (not JSON): serde decides.
        if i == start || (bytes[start] == b'0' && i.saturating_sub(start) > 1) {
            return None;
        }
        ids.push(value as u32);
        i = skip_ws(i);
        match bytes.get(i) {
            Some(b',') => i = skip_ws(i.saturating_add(1)),
            Some(b']') => return (skip_ws(i.saturating_add(1)) == bytes.len()).then_some(ids),
            _ => return None,
        }
    }
}

/// Parses a request body. `Ok(None)` means "nothing to parse" (empty body, or a content type
/// that is not JSON, such as multipart audio): route on load alone.
pub fn parse_request_body(
    content_type: Option<&str>,
    body: &[u8],
) -> Result<Option<ParsedBody>, BodyError> {
    parse_request_body_for(Endpoint::Generate, content_type, body)
}

/// [`parse_request_body`] for a body sent to `endpoint` (from the request `:path`).
pub fn parse_request_body_for(
    endpoint: Endpoint,
    content_type: Option<&str>,
    body: &[u8],
) -> Result<Option<ParsedBody>, BodyError> {
    if body.is_empty() {
        return Ok(None);
    }
    if let Some(ct) = content_type {
        if !ct.to_ascii_lowercase().contains("json") {
            return Ok(None);
        }
    }
    let first = body.iter().find(|b| !b.is_ascii_whitespace());
    if first.is_some_and(|&b| b != b'{') {
        // Still validate that it is JSON at all, so the error says which.
        return match serde_json::from_slice::<serde::de::IgnoredAny>(body) {
            Ok(_) => Err(BodyError::NotAnObject),
            Err(e) => Err(BodyError::Malformed(short_json_error(&e))),
        };
    }
    let envelope: Envelope<'_> =
        serde_json::from_slice(body).map_err(|e| BodyError::Malformed(short_json_error(&e)))?;
    envelope.into_fields().into_parsed(endpoint).map(Some)
}

/// serde_json's message without echoing client input: its errors only carry a category and a
/// position, which is what we keep.
fn short_json_error(e: &serde_json::Error) -> String {
    let mut msg = e.to_string();
    msg.truncate(120);
    msg
}

#[allow(clippy::arithmetic_side_effects)]
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_id_fast_path_agrees_with_serde() {
        use rand::{Rng, SeedableRng};
        let cases = [
            "[]",
            "[ ]",
            " [1,2,3] ",
            "[0]",
            "[4294967295]",
            "[4294967296]",
            "[1.0]",
            "[1e3]",
            "[-1]",
            "[1,]",
            "[,1]",
            "[1 2]",
            "[\"1\"]",
            "[1,[2]]",
            "[1]x",
            "[\n1\r,\t2\n]",
            "[00]",
            "[18446744073709551616]",
            "",
            "[",
            "]",
            "[1,2",
            "{}",
        ];
        for raw in cases {
            assert_eq!(
                token_ids(raw.as_bytes()),
                serde_json::from_str::<Vec<u32>>(raw).ok(),
                "{raw:?}"
            );
        }
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        let alphabet = b"0123456789 ,[]-.e\n\"";
        for _ in 0..20_000 {
            let len = rng.random_range(0..24);
            let raw: String = (0..len)
                .map(|_| alphabet[rng.random_range(0..alphabet.len())] as char)
                .collect();
            let raw = format!("[{raw}]");
            assert_eq!(
                token_ids(raw.as_bytes()),
                serde_json::from_str::<Vec<u32>>(&raw).ok(),
                "{raw:?}"
            );
        }
    }

    #[test]
    fn extracts_model_stream_and_salt() {
        let body = br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,"cache_salt":"s"}"#;
        let parsed = parse_request_body(Some("application/json"), body)
            .unwrap()
            .unwrap();
        assert_eq!(parsed.model.as_deref(), Some("m"));
        assert!(parsed.stream);
        assert_eq!(parsed.cache_salt.as_deref(), Some("s"));
        assert_eq!(
            parsed.prompt,
            Prompt::Text(b"[{\"role\":\"user\",\"content\":\"hi\"}]\0".to_vec())
        );
    }

    #[test]
    fn prompt_shapes() {
        let p = |body: &[u8]| parse_request_body(None, body).unwrap().unwrap().prompt;
        assert_eq!(
            p(br#"{"model":"m","prompt":[1,2,3]}"#),
            Prompt::TokenIds(vec![1, 2, 3])
        );
        assert_eq!(
            p(br#"{"model":"m","prompt":"abc"}"#),
            Prompt::Text(b"abc".to_vec())
        );
        assert_eq!(
            p(br#"{"model":"m","prompt":["a","b"]}"#),
            Prompt::Text(br#"["a","b"]"#.to_vec())
        );
        assert_eq!(p(br#"{"model":"m"}"#), Prompt::Absent);
        // A later turn of a conversation extends the earlier turn's prompt bytes.
        let t1 = p(br#"{"model":"m","messages":[{"role":"user","content":"a"}]}"#);
        let t2 = p(br#"{"model":"m","messages":[{"role":"user","content":"a"},{"role":"assistant","content":"b"}]}"#);
        let (Prompt::Text(t1), Prompt::Text(t2)) = (t1, t2) else {
            panic!()
        };
        let shared = t1.iter().zip(&t2).take_while(|(a, b)| a == b).count();
        assert!(shared >= t1.len() - 2, "only the closing bracket differs");
    }

    #[test]
    fn client_errors() {
        let cases: [(&[u8], BodyError); 4] = [
            (br#"{"messages":[]}"#, BodyError::MissingModel),
            (br#"{"model":5}"#, BodyError::InvalidModel),
            (br#"{"model":""}"#, BodyError::InvalidModel),
            (b"[1,2]", BodyError::NotAnObject),
        ];
        for (body, expected) in cases {
            assert_eq!(parse_request_body(None, body).unwrap_err(), expected);
        }
        for bad in [&b"{\"model\":"[..], b"not json", b"{\"model\":\"\xff\"}"] {
            assert!(matches!(
                parse_request_body(None, bad).unwrap_err(),
                BodyError::Malformed(_)
            ));
        }
    }

    #[test]
    fn deep_nesting_is_an_error_not_a_crash() {
        let mut body = b"{\"model\":\"m\",\"x\":".to_vec();
        body.extend(std::iter::repeat_n(b'[', 100_000));
        assert!(matches!(
            parse_request_body(None, &body).unwrap_err(),
            BodyError::Malformed(_)
        ));
    }

    #[test]
    fn anthropic_sglang_and_embeddings_prompts() {
        let p = |path: &str, body: &[u8]| {
            parse_request_body_for(Endpoint::from_path(path), None, body)
                .unwrap()
                .unwrap()
        };
        // Anthropic: tools, then system, then messages lead the pseudo-token prefix.
        let m = p(
            "/v1/messages",
            br#"{"model":"m","max_tokens":8,"messages":[{"role":"user","content":"q"}],"system":"S","tools":[]}"#,
        );
        assert_eq!(
            m.prompt,
            Prompt::Text(b"[]\0\"S\"\0[{\"role\":\"user\",\"content\":\"q\"}]\0".to_vec())
        );
        assert_eq!(m.model.as_deref(), Some("m"));
        // The same system prompt is a shared prefix across different questions.
        let a = p(
            "/v1/messages",
            br#"{"model":"m","system":"long shared","messages":[{"role":"user","content":"a"}]}"#,
        );
        let b = p(
            "/v1/messages",
            br#"{"model":"m","system":"long shared","messages":[{"role":"user","content":"b"}]}"#,
        );
        let (Prompt::Text(a), Prompt::Text(b)) = (a.prompt, b.prompt) else {
            panic!()
        };
        assert!(a.starts_with(b"\"long shared\"\0") && b.starts_with(b"\"long shared\"\0"));
        // SGLang /generate: no model needed; ids win; a batch routes on its first prompt.
        let g = p("/generate", br#"{"input_ids":[1,2,3],"text":"ignored","rid":"r","stream":true,"sampling_params":{"max_new_tokens":4}}"#);
        assert_eq!(g.model, None);
        assert!(g.stream);
        assert_eq!(g.prompt, Prompt::TokenIds(vec![1, 2, 3]));
        assert_eq!(
            p("/generate", br#"{"input_ids":[[4,5],[6]]}"#).prompt,
            Prompt::TokenIds(vec![4, 5])
        );
        assert_eq!(
            p("/generate?x=1", br#"{"text":"hello","input_ids":null}"#).prompt,
            Prompt::Text(b"hello".to_vec())
        );
        assert_eq!(
            p("/generate", br#"{"model":"m","text":["a","b"]}"#),
            ParsedBody {
                model: Some("m".into()),
                stream: false,
                cache_salt: None,
                prompt: Prompt::Text(br#"["a","b"]"#.to_vec())
            }
        );
        assert_eq!(p("/generate", br#"{"rid":"r"}"#).prompt, Prompt::Absent);
        assert_eq!(
            parse_request_body_for(Endpoint::SglangGenerate, None, br#"{"model":5}"#).unwrap_err(),
            BodyError::InvalidModel
        );
        // Only /generate may omit the model.
        assert_eq!(
            parse_request_body_for(Endpoint::Messages, None, br#"{"messages":[]}"#).unwrap_err(),
            BodyError::MissingModel
        );
        // Embeddings: token ids route exactly, text by its bytes.
        assert_eq!(
            p("/v1/embeddings", br#"{"model":"m","input":[7,8]}"#).prompt,
            Prompt::TokenIds(vec![7, 8])
        );
        assert_eq!(
            p("/v1/embeddings", br#"{"model":"m","input":[[9],[10]]}"#).prompt,
            Prompt::TokenIds(vec![9])
        );
        assert_eq!(
            p("/v1/embeddings", br#"{"model":"m","input":"some text"}"#).prompt,
            Prompt::Text(b"some text".to_vec())
        );
        assert_eq!(
            p("/v1/embeddings", br#"{"model":"m"}"#).prompt,
            Prompt::Absent
        );
    }

    #[test]
    fn non_json_and_empty_bodies_are_not_parsed() {
        assert_eq!(parse_request_body(None, b"").unwrap(), None);
        assert_eq!(
            parse_request_body(Some("multipart/form-data; boundary=x"), b"--x").unwrap(),
            None
        );
    }
}
