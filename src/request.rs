//! Parsing of OpenAI-style request bodies into what routing needs (model, stream flag, salt).
//! Shared by every host; it never mutates the body (the echoed body stays byte-identical).

use serde::Deserialize;

/// What a request body tells the router.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedBody {
    pub model: String,
    pub stream: bool,
    pub cache_salt: Option<String>,
    pub prompt: Prompt,
}

/// The prompt part of a body, as precisely as the body allows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prompt {
    /// `/v1/completions` with `prompt: [int]`: the engine's own token ids.
    TokenIds(Vec<u32>),
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
}

impl Envelope<'_> {
    fn prompt(&self) -> Prompt {
        if let Some(raw) = self.prompt {
            if let Ok(ids) = serde_json::from_str::<Vec<u32>>(raw.get()) {
                return Prompt::TokenIds(ids);
            }
            if let Ok(text) = serde_json::from_str::<String>(raw.get()) {
                return Prompt::Text(text.into_bytes());
            }
            return Prompt::Text(raw.get().as_bytes().to_vec());
        }
        // Tools render before the conversation in chat templates, so they lead the prefix too.
        let parts = [self.tools, self.instructions, self.messages, self.input];
        let mut text = Vec::new();
        for raw in parts.into_iter().flatten() {
            text.extend_from_slice(raw.get().as_bytes());
            text.push(0);
        }
        if text.is_empty() {
            Prompt::Absent
        } else {
            Prompt::Text(text)
        }
    }
}

/// Parses a request body. `Ok(None)` means "nothing to parse" (empty body, or a content type
/// that is not JSON, such as multipart audio): route on load alone.
pub fn parse_request_body(
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
    let prompt = envelope.prompt();
    let model = match envelope.model {
        None | Some(serde_json::Value::Null) => return Err(BodyError::MissingModel),
        Some(serde_json::Value::String(s)) if !s.is_empty() => s,
        Some(_) => return Err(BodyError::InvalidModel),
    };
    let stream = matches!(envelope.stream, Some(serde_json::Value::Bool(true)));
    let cache_salt = envelope
        .cache_salt
        .and_then(|raw| serde_json::from_str::<String>(raw.get()).ok());
    Ok(Some(ParsedBody {
        model,
        stream,
        cache_salt,
        prompt,
    }))
}

/// serde_json's message without echoing client input: its errors only carry a category and a
/// position, which is what we keep.
fn short_json_error(e: &serde_json::Error) -> String {
    let mut msg = e.to_string();
    msg.truncate(120);
    msg
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extracts_model_stream_and_salt() {
        let body = br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,"cache_salt":"s"}"#;
        let parsed = parse_request_body(Some("application/json"), body)
            .unwrap()
            .unwrap();
        assert_eq!(parsed.model, "m");
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
    fn non_json_and_empty_bodies_are_not_parsed() {
        assert_eq!(parse_request_body(None, b"").unwrap(), None);
        assert_eq!(
            parse_request_body(Some("multipart/form-data; boundary=x"), b"--x").unwrap(),
            None
        );
    }
}
