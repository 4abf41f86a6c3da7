//! The chat prompt's vocabulary, shared by every body reader ([`crate::prompt`] for OpenAI
//! bodies, [`crate::anthropic`] for Anthropic ones): one template message ([`Message`]), the
//! prompt of a request ([`PromptSpec`], [`ChatPrompt`]), how content lists reach the template
//! ([`ContentFormat`]), and vLLM's per-message preprocessing ([`chat_message`]: content parts
//! joined, tool-call arguments parsed). It reads messages only; it knows no API's body layout.

use std::sync::{Arc, OnceLock};

use crate::json::Json;
use crate::media;

/// One conversation message as the template sees it (after vLLM's preprocessing), with its
/// template value made once: a message reused from an earlier request (see
/// [`super::conversation`]) costs its template no copy.
#[derive(Debug)]
pub struct Message {
    json: Json,
    value: OnceLock<minijinja::Value>,
}

impl Message {
    pub fn new(json: Json) -> Arc<Self> {
        Arc::new(Message {
            json,
            value: OnceLock::new(),
        })
    }

    pub fn json(&self) -> &Json {
        &self.json
    }

    /// The template value (made on first use; values share their strings).
    pub fn value(&self) -> minijinja::Value {
        self.value.get_or_init(|| self.json.to_value()).clone()
    }
}

impl PartialEq for Message {
    fn eq(&self, other: &Self) -> bool {
        self.json == other.json
    }
}

impl std::ops::Deref for Message {
    type Target = Json;
    fn deref(&self) -> &Json {
        &self.json
    }
}

/// How message content given as a list of parts reaches the template.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ContentFormat {
    /// Text parts joined with `\n` into one string (vLLM's "string" format; most templates).
    #[default]
    String,
    /// The part list as sent (templates that iterate `message.content`).
    Openai,
}

/// The prompt of one request.
#[derive(Debug, Clone, PartialEq)]
pub enum PromptSpec {
    /// Render `messages` (+ `tools`) with the chat template, then tokenize.
    Chat(ChatPrompt),
    /// Tokenize `text`; `add_special_tokens` from the body when it says.
    Text {
        text: String,
        add_special_tokens: Option<bool>,
    },
    /// The body already carries token ids.
    Ids(Vec<u32>),
    /// Nothing to tokenize.
    None,
}

#[derive(Debug, Clone, PartialEq)]
pub struct ChatPrompt {
    pub messages: Vec<Arc<Message>>,
    pub tools: Option<Json>,
    pub add_generation_prompt: bool,
    pub continue_final_message: bool,
    /// `chat_template_kwargs` from the body.
    pub kwargs: Vec<(String, Json)>,
    /// vLLM's chat default is false: the template renders the BOS itself.
    pub add_special_tokens: bool,
}

/// Why a body cannot be tokenized exactly (the request is then routed on load alone).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Unsupported(pub &'static str);

/// Text of a content part (`text`, `input_text`, `output_text`, or a bare string).
fn part_text(part: &Json) -> Result<&str, Unsupported> {
    if let Some(s) = part.as_str() {
        return Ok(s);
    }
    match part.get("type").and_then(Json::as_str) {
        Some("text" | "input_text" | "output_text") | None => part
            .get("text")
            .and_then(Json::as_str)
            .ok_or(Unsupported("content part without text")),
        Some(_) => Err(Unsupported("non-text content part (multimodal)")),
    }
}

/// A message's content as the template sees it. Image parts (`image_url`, `input_image`) become
/// what vLLM's chat parser makes of them: in `string` format one placeholder per image in front
/// of the joined text, separated by `\n` (`_get_full_multimodal_text_prompt` without
/// `interleave_strings`; written as [`media::IMAGE_SENTINEL`] until the model's placeholder
/// replaces it); in `openai` format a `{"type": "image"}` part in place.
pub(crate) fn normalize_content(
    content: &Json,
    format: ContentFormat,
) -> Result<Json, Unsupported> {
    match content {
        Json::Array(parts) => match format {
            ContentFormat::String => {
                let mut placeholders = Vec::new();
                let mut texts = Vec::new();
                for p in parts {
                    if media::is_image_part(p) {
                        placeholders.push(media::IMAGE_SENTINEL);
                    } else {
                        texts.push(part_text(p)?);
                    }
                }
                let text = texts.join("\n");
                if !text.is_empty() || placeholders.is_empty() {
                    placeholders.push(&text);
                }
                Ok(Json::String(placeholders.join("\n")))
            }
            ContentFormat::Openai => {
                let mut out = Vec::with_capacity(parts.len());
                for p in parts {
                    if media::is_image_part(p) {
                        out.push(Json::object(vec![("type", Json::String("image".into()))]));
                    } else {
                        part_text(p)?;
                        out.push(p.clone());
                    }
                }
                Ok(Json::Array(out))
            }
        },
        other => Ok(other.clone()),
    }
}

pub fn chat_message(message: &Json, format: ContentFormat) -> Result<Json, Unsupported> {
    let Json::Object(_) = message else {
        return Err(Unsupported("a message is not an object"));
    };
    let mut out = message.clone();
    if let Some(content) = message.get("content") {
        out.set("content", normalize_content(content, format)?);
    }
    if let Some(Json::Array(calls)) = message.get("tool_calls") {
        let calls = calls.iter().map(parse_tool_call_arguments).collect();
        out.set("tool_calls", Json::Array(calls));
    }
    Ok(out)
}

/// vLLM parses `function.arguments` (a JSON string) into an object for the template.
pub(crate) fn parse_tool_call_arguments(call: &Json) -> Json {
    let mut call = call.clone();
    if let Some(function) = call.get("function") {
        if let Some(args) = function.get("arguments").and_then(Json::as_str) {
            if let Ok(parsed @ Json::Object(_)) = serde_json::from_str::<Json>(args) {
                let mut function = function.clone();
                function.set("arguments", parsed);
                call.set("function", function);
            }
        }
    }
    call
}
