//! What a request body asks the engine to tokenize (ARCHITECTURE.md §2, §8): chat messages (from
//! `/v1/chat/completions`, or converted from `/v1/responses` and, in [`super::anthropic`], from
//! Anthropic `/v1/messages`), completion text (also SGLang's `/generate` `text`), or token ids.
//! Mirrors vLLM's preprocessing before the chat template (per message: [`crate::chat`]). It
//! reads bodies only; rendering and tokenization are elsewhere.

use std::sync::Arc;

use crate::chat::{chat_message, normalize_content, parse_tool_call_arguments};
pub use crate::chat::{ChatPrompt, ContentFormat, Message, PromptSpec, Unsupported};
use crate::json::Json;

/// The array field of a body that holds a conversation, one message per item.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConversationField {
    /// Chat completions `messages`.
    Messages,
    /// Responses `input` (when a list).
    Input,
}

impl ConversationField {
    pub fn key(self) -> &'static str {
        match self {
            ConversationField::Messages => "messages",
            ConversationField::Input => "input",
        }
    }

    /// Which field carries the conversation, by the precedence [`prompt_spec_for`] applies:
    /// `has` tells whether the body has a key, `input_is_list` whether `input` is a list.
    /// Only OpenAI-shaped bodies have one: an Anthropic message can become several chat
    /// messages (and its system text moves to the front), so `/v1/messages` is parsed whole.
    pub fn of(endpoint: Endpoint, has: impl Fn(&str) -> bool, input_is_list: bool) -> Option<Self> {
        if endpoint != Endpoint::Generate {
            return None;
        }
        if has("messages") {
            return Some(ConversationField::Messages);
        }
        if !has("prompt") && has("input") && input_is_list {
            return Some(ConversationField::Input);
        }
        None
    }

    /// One item of the field as a template message.
    pub fn convert(self, item: &Json, format: ContentFormat) -> Result<Json, Unsupported> {
        match self {
            ConversationField::Messages => chat_message(item, format),
            ConversationField::Input => response_item(item, format),
        }
    }
}

/// Which API a body was sent to (from the request `:path`).
pub use crate::endpoint::Endpoint;

/// Reads the prompt of a body (already known to be a JSON object).
pub fn prompt_spec(body: &Json, format: ContentFormat) -> Result<PromptSpec, Unsupported> {
    prompt_spec_for(Endpoint::Generate, body, format)
}

/// [`prompt_spec`] for a known endpoint.
pub fn prompt_spec_for(
    endpoint: Endpoint,
    body: &Json,
    format: ContentFormat,
) -> Result<PromptSpec, Unsupported> {
    prompt_spec_parsed(endpoint, body, None, format)
}

/// [`prompt_spec_for`] with the conversation's messages already converted (`items`: one per
/// item of the body's [`ConversationField`], which `body` may then hold empty).
pub fn prompt_spec_parsed(
    endpoint: Endpoint,
    body: &Json,
    items: Option<Vec<Arc<Message>>>,
    format: ContentFormat,
) -> Result<PromptSpec, Unsupported> {
    match endpoint {
        Endpoint::Messages => return crate::anthropic::prompt_spec(body, format),
        Endpoint::SglangGenerate => return sglang_generate(body),
        Endpoint::Embeddings | Endpoint::Generate => {}
    }
    if endpoint == Endpoint::Embeddings {
        let add_special_tokens = body.get("add_special_tokens").and_then(Json::as_bool);
        return Ok(match body.get("input") {
            Some(Json::String(text)) => PromptSpec::Text {
                text: text.clone(),
                add_special_tokens,
            },
            Some(input @ Json::Array(items)) => match input.as_token_ids() {
                Some(ids) if !ids.is_empty() => PromptSpec::Ids(ids),
                _ => match items.first() {
                    Some(Json::String(text)) => PromptSpec::Text {
                        text: text.clone(),
                        add_special_tokens,
                    },
                    Some(first) => match first.as_token_ids() {
                        Some(ids) if !ids.is_empty() => PromptSpec::Ids(ids),
                        _ => return Err(Unsupported("unrecognised embeddings `input`")),
                    },
                    None => PromptSpec::None,
                },
            },
            _ => PromptSpec::None,
        });
    }
    if let Some(messages) = body.get("messages") {
        let messages = match items {
            Some(items) => items,
            None => messages
                .as_array()
                .ok_or(Unsupported("`messages` is not a list"))?
                .iter()
                .map(|m| chat_message(m, format).map(Message::new))
                .collect::<Result<Vec<_>, _>>()?,
        };
        return chat_prompt(body, messages, body.get("tools").cloned());
    }
    if let Some(prompt) = body.get("prompt") {
        let add_special_tokens = body.get("add_special_tokens").and_then(Json::as_bool);
        return Ok(match prompt {
            Json::String(text) => PromptSpec::Text {
                text: text.clone(),
                add_special_tokens,
            },
            Json::Array(items) => {
                if let Some(ids) = prompt.as_token_ids() {
                    if ids.is_empty() {
                        PromptSpec::None
                    } else {
                        PromptSpec::Ids(ids)
                    }
                } else {
                    // A batch: the engine runs each prompt; route on the first.
                    match items.first() {
                        Some(Json::String(text)) => PromptSpec::Text {
                            text: text.clone(),
                            add_special_tokens,
                        },
                        Some(first) => match first.as_token_ids() {
                            Some(ids) if !ids.is_empty() => PromptSpec::Ids(ids),
                            _ => return Err(Unsupported("unrecognised `prompt` list")),
                        },
                        None => PromptSpec::None,
                    }
                }
            }
            _ => return Err(Unsupported("`prompt` must be a string or a list")),
        });
    }
    if body.get("input").is_some() || body.get("instructions").is_some() {
        let messages = responses_messages(body, items, format)?;
        let tools = body.get("tools").map(responses_tools);
        return chat_prompt(body, messages, tools);
    }
    Ok(PromptSpec::None)
}

/// SGLang's `/generate`: `input_ids` (one list, or a batch: the first routes) win over `text`
/// (a string, or a batch list); SGLang tokenizes text with the tokenizer's special tokens, which is
/// the model entry's `add_special_tokens` default. `rid`, `stream`, `sampling_params` do not
/// matter here; `input_embeds` alone leaves nothing to tokenize.
fn sglang_generate(body: &Json) -> Result<PromptSpec, Unsupported> {
    if let Some(ids) = body.get("input_ids").filter(|v| !matches!(v, Json::Null)) {
        let ids = match ids.as_token_ids() {
            Some(ids) => ids,
            None => match ids.as_array().and_then(|batch| batch.first()) {
                Some(first) => first
                    .as_token_ids()
                    .ok_or(Unsupported("`input_ids` must be a list of token ids"))?,
                None => Vec::new(),
            },
        };
        return Ok(if ids.is_empty() {
            PromptSpec::None
        } else {
            PromptSpec::Ids(ids)
        });
    }
    let text = match body.get("text") {
        Some(Json::String(text)) => text,
        Some(Json::Array(batch)) => match batch.first() {
            Some(Json::String(text)) => text,
            None => return Ok(PromptSpec::None),
            Some(_) => return Err(Unsupported("`text` list items must be strings")),
        },
        Some(Json::Null) | None => return Ok(PromptSpec::None),
        Some(_) => return Err(Unsupported("`text` must be a string or a list")),
    };
    Ok(PromptSpec::Text {
        text: text.clone(),
        add_special_tokens: None,
    })
}

fn chat_prompt(
    body: &Json,
    messages: Vec<Arc<Message>>,
    tools: Option<Json>,
) -> Result<PromptSpec, Unsupported> {
    let continue_final_message = body
        .get("continue_final_message")
        .and_then(Json::as_bool)
        .unwrap_or(false);
    let add_generation_prompt = body
        .get("add_generation_prompt")
        .and_then(Json::as_bool)
        .unwrap_or(!continue_final_message);
    if continue_final_message && add_generation_prompt {
        return Err(Unsupported(
            "continue_final_message and add_generation_prompt together",
        ));
    }
    let kwargs = match body.get("chat_template_kwargs") {
        Some(Json::Object(entries)) => entries.clone(),
        _ => Vec::new(),
    };
    let tools = match tools {
        Some(Json::Array(t)) if t.is_empty() => None,
        Some(Json::Null) | None => None,
        Some(t) => Some(t),
    };
    Ok(PromptSpec::Chat(ChatPrompt {
        messages,
        tools,
        add_generation_prompt,
        continue_final_message,
        kwargs,
        add_special_tokens: body
            .get("add_special_tokens")
            .and_then(Json::as_bool)
            .unwrap_or(false),
    }))
}

/// `/v1/responses` `instructions` + `input` as chat messages.
fn responses_messages(
    body: &Json,
    items: Option<Vec<Arc<Message>>>,
    format: ContentFormat,
) -> Result<Vec<Arc<Message>>, Unsupported> {
    let mut messages = Vec::new();
    match body.get("instructions") {
        Some(Json::String(s)) => messages.push(Message::new(Json::object(vec![
            ("role", Json::String("system".into())),
            ("content", Json::String(s.clone())),
        ]))),
        Some(Json::Null) | None => {}
        Some(_) => return Err(Unsupported("`instructions` must be a string")),
    }
    if let Some(items) = items {
        messages.extend(items);
        return Ok(messages);
    }
    match body.get("input") {
        Some(Json::String(s)) => messages.push(Message::new(Json::object(vec![
            ("role", Json::String("user".into())),
            ("content", Json::String(s.clone())),
        ]))),
        Some(Json::Array(items)) => {
            for item in items {
                messages.push(Message::new(response_item(item, format)?));
            }
        }
        Some(Json::Null) | None => {}
        Some(_) => return Err(Unsupported("`input` must be a string or a list")),
    }
    Ok(messages)
}

fn response_item(item: &Json, format: ContentFormat) -> Result<Json, Unsupported> {
    let str_of = |k: &str| Json::String(item.get(k).and_then(Json::as_str).unwrap_or("").into());
    match item.get("type").and_then(Json::as_str) {
        Some("message") | None => {
            let role = item
                .get("role")
                .and_then(Json::as_str)
                .ok_or(Unsupported("input message without role"))?;
            let content = normalize_content(item.get("content").unwrap_or(&Json::Null), format)?;
            Ok(Json::object(vec![
                ("role", Json::String(role.into())),
                ("content", content),
            ]))
        }
        Some("function_call") => {
            let call = Json::object(vec![
                ("id", str_of("call_id")),
                ("type", Json::String("function".into())),
                (
                    "function",
                    Json::object(vec![
                        ("name", str_of("name")),
                        ("arguments", str_of("arguments")),
                    ]),
                ),
            ]);
            Ok(Json::object(vec![
                ("role", Json::String("assistant".into())),
                ("content", Json::Null),
                (
                    "tool_calls",
                    Json::Array(vec![parse_tool_call_arguments(&call)]),
                ),
            ]))
        }
        Some("function_call_output") => Ok(Json::object(vec![
            ("role", Json::String("tool".into())),
            ("tool_call_id", str_of("call_id")),
            ("content", str_of("output")),
        ])),
        Some(_) => Err(Unsupported("unsupported responses input item")),
    }
}

/// Responses-style tools (`{type, name, description, parameters}`) in chat style.
fn responses_tools(tools: &Json) -> Json {
    let Some(items) = tools.as_array() else {
        return Json::Null;
    };
    let converted = items
        .iter()
        .filter(|t| t.get("type").and_then(Json::as_str) == Some("function"))
        .map(|t| {
            if t.get("function").is_some() {
                return t.clone();
            }
            let mut function = Vec::new();
            for key in ["name", "description", "parameters"] {
                if let Some(v) = t.get(key) {
                    function.push((key, v.clone()));
                }
            }
            Json::object(vec![
                ("type", Json::String("function".into())),
                ("function", Json::object(function)),
            ])
        })
        .collect();
    Json::Array(converted)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(body: &str) -> Result<PromptSpec, Unsupported> {
        prompt_spec(&serde_json::from_str(body).unwrap(), ContentFormat::String)
    }

    #[test]
    fn chat_parts_are_joined_and_tool_arguments_parsed() {
        let PromptSpec::Chat(chat) = spec(
            r#"{"messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]},
            {"role":"assistant","content":null,"tool_calls":[{"id":"1","type":"function","function":{"name":"f","arguments":"{\"x\": 1}"}}]}]}"#,
        )
        .unwrap() else {
            panic!()
        };
        assert_eq!(
            chat.messages[0].get("content"),
            Some(&Json::String("a\nb".into()))
        );
        let args = chat.messages[1]
            .get("tool_calls")
            .unwrap()
            .as_array()
            .unwrap()[0]
            .get("function")
            .unwrap()
            .get("arguments")
            .unwrap();
        assert!(matches!(args, Json::Object(_)));
        assert!(chat.add_generation_prompt);
        assert!(!chat.add_special_tokens);
    }

    #[test]
    fn completions_prompts() {
        assert_eq!(
            spec(r#"{"prompt":"hi"}"#).unwrap(),
            PromptSpec::Text {
                text: "hi".into(),
                add_special_tokens: None
            }
        );
        assert_eq!(
            spec(r#"{"prompt":["a","b"],"add_special_tokens":false}"#).unwrap(),
            PromptSpec::Text {
                text: "a".into(),
                add_special_tokens: Some(false)
            }
        );
        assert_eq!(
            spec(r#"{"prompt":[[1,2],[3]]}"#).unwrap(),
            PromptSpec::Ids(vec![1, 2])
        );
        assert!(spec(r#"{"prompt":{"x":1}}"#).is_err());
    }

    #[test]
    fn responses_become_messages() {
        let PromptSpec::Chat(chat) = spec(
            r#"{"instructions":"be brief","input":[{"role":"user","content":[{"type":"input_text","text":"q"}]},
            {"type":"function_call","call_id":"c","name":"f","arguments":"{}"},
            {"type":"function_call_output","call_id":"c","output":"42"}],
            "tools":[{"type":"function","name":"f","parameters":{}}]}"#,
        )
        .unwrap() else {
            panic!()
        };
        assert_eq!(chat.messages.len(), 4);
        assert_eq!(
            chat.messages[0].get("role").unwrap().as_str(),
            Some("system")
        );
        assert_eq!(chat.messages[1].get("content").unwrap().as_str(), Some("q"));
        assert_eq!(chat.messages[3].get("role").unwrap().as_str(), Some("tool"));
        let tools = chat.tools.unwrap();
        let tool = &tools.as_array().unwrap()[0];
        assert!(tool.get("function").is_some());
    }

    #[test]
    fn embeddings_input_is_text_not_a_conversation() {
        let body: Json = serde_json::from_str(r#"{"input":["a b","c"]}"#).unwrap();
        let e = Endpoint::from_path("/v1/embeddings?x=1");
        assert_eq!(
            prompt_spec_for(e, &body, ContentFormat::String).unwrap(),
            PromptSpec::Text {
                text: "a b".into(),
                add_special_tokens: None
            }
        );
        let body: Json = serde_json::from_str(r#"{"input":"a b"}"#).unwrap();
        assert!(matches!(
            prompt_spec_for(
                Endpoint::from_path("/v1/responses"),
                &body,
                ContentFormat::String
            ),
            Ok(PromptSpec::Chat(_))
        ));
    }

    #[test]
    fn paths_name_their_endpoints() {
        for (path, e) in [
            ("/v1/chat/completions", Endpoint::Generate),
            ("/v1/responses", Endpoint::Generate),
            ("/v1/embeddings", Endpoint::Embeddings),
            ("/v1/messages", Endpoint::Messages),
            ("/v1/messages?beta=true", Endpoint::Messages),
            ("/v1/messages/count_tokens", Endpoint::Messages),
            ("/generate", Endpoint::SglangGenerate),
            ("/generate?x=1", Endpoint::SglangGenerate),
            ("/v1/generate", Endpoint::Generate),
        ] {
            assert_eq!(Endpoint::from_path(path), e, "{path}");
        }
    }

    #[test]
    fn sglang_generate_text_and_ids() {
        let g = |body: &str| {
            prompt_spec_for(
                Endpoint::SglangGenerate,
                &serde_json::from_str(body).unwrap(),
                ContentFormat::String,
            )
        };
        assert_eq!(
            g(r#"{"text":"hi","rid":"r","stream":true,"sampling_params":{"temperature":0}}"#),
            Ok(PromptSpec::Text {
                text: "hi".into(),
                add_special_tokens: None
            })
        );
        assert_eq!(
            g(r#"{"text":["a","b"]}"#),
            Ok(PromptSpec::Text {
                text: "a".into(),
                add_special_tokens: None
            })
        );
        assert_eq!(
            g(r#"{"input_ids":[1,2],"text":"x"}"#),
            Ok(PromptSpec::Ids(vec![1, 2]))
        );
        assert_eq!(
            g(r#"{"input_ids":[[3],[4]]}"#),
            Ok(PromptSpec::Ids(vec![3]))
        );
        assert_eq!(g(r#"{"input_ids":[]}"#), Ok(PromptSpec::None));
        assert_eq!(g(r#"{"input_embeds":[[0.1]]}"#), Ok(PromptSpec::None));
        assert!(g(r#"{"input_ids":["a"]}"#).is_err());
        assert!(g(r#"{"text":5}"#).is_err());
        assert!(g(r#"{"text":[5]}"#).is_err());
        // A /generate body is never read as a chat conversation.
        assert_eq!(
            g(r#"{"messages":[{"role":"user","content":"x"}]}"#),
            Ok(PromptSpec::None)
        );
    }

    #[test]
    fn images_become_placeholders_and_other_media_is_unsupported() {
        let s = crate::media::IMAGE_SENTINEL;
        let content = |body: &str, format| {
            let PromptSpec::Chat(chat) =
                prompt_spec(&serde_json::from_str(body).unwrap(), format).unwrap()
            else {
                panic!()
            };
            chat.messages[0].get("content").cloned().unwrap()
        };
        // vLLM's `string` format: one placeholder per image in front of the joined text.
        let two = r#"{"messages":[{"role":"user","content":[{"type":"text","text":"a"},
            {"type":"image_url","image_url":{"url":"x"}},{"type":"text","text":"b"},
            {"type":"image_url","image_url":{"url":"y"}}]}]}"#;
        assert_eq!(
            content(two, ContentFormat::String),
            Json::String(format!("{s}\n{s}\na\nb"))
        );
        let only = r#"{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"x"}}]}]}"#;
        assert_eq!(content(only, ContentFormat::String), Json::String(s.into()));
        // `openai` format: `{"type": "image"}` in place.
        let Json::Array(parts) = content(two, ContentFormat::Openai) else {
            panic!()
        };
        let image = Json::object(vec![("type", Json::String("image".into()))]);
        assert_eq!((&parts[1], &parts[3]), (&image, &image));
        // Responses `input_image`.
        let responses = r#"{"input":[{"role":"user","content":[{"type":"input_image","image_url":"x"},
            {"type":"input_text","text":"a"}]}]}"#;
        assert_eq!(
            content(responses, ContentFormat::String),
            Json::String(format!("{s}\na"))
        );
        for part in [
            r#"{"type":"input_audio","input_audio":{"data":"x","format":"wav"}}"#,
            r#"{"type":"video_url","video_url":{"url":"x"}}"#,
        ] {
            let body = format!(r#"{{"messages":[{{"role":"user","content":[{part}]}}]}}"#);
            assert!(spec(&body).is_err(), "{part}");
        }
    }
}
