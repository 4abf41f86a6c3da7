//! Anthropic Messages bodies (`/v1/messages`) as the chat prompt vLLM renders for them
//! (ARCHITECTURE.md §8). vLLM's Anthropic endpoint converts the request to an OpenAI chat request
//! and renders that with the model's chat template; this module does the same conversion, then
//! hands each message to the chat path's preprocessing ([`super::chat`]), so a `/v1/messages`
//! prompt tokenizes to the ids the engine computes. It reads bodies only: it owns the conversion
//! and nothing about templates, tokenizers or routing.
//!
//! The conversion, block by block: `system` (a string, or `text` blocks concatenated; Claude
//! Code's `x-anthropic-billing-header` block dropped) and the text of `role: "system"` items of
//! `messages` become one leading system message; `text` blocks become content parts (one part: a
//! string); `thinking` becomes the assistant's `reasoning` (and `reasoning_content`, as vLLM's chat
//! parser copies it); `tool_use` becomes an assistant tool call with `input` as its arguments;
//! `tool_result` in a user turn becomes a `tool` message placed before that turn's remaining
//! text; `redacted_thinking` and `tool_reference` blocks are skipped. `tools` become OpenAI
//! function tools (`description` null when absent, `input_schema` with `type: object` added when
//! missing). `image` blocks with a source become image parts where they stand, and a user
//! `tool_result`'s images a user message of image parts after its tool message (placed by the chat
//! path, identified by `super::media`). What the engine cannot render token-exactly from the body
//! (a `tool_use` without an id, which it names by the clock; a list `tool_result` in an assistant
//! turn, which it renders as a Python repr) is [`Unsupported`]: load-only routing.

use super::chat::{chat_message, ChatPrompt, ContentFormat, Message, PromptSpec, Unsupported};
use super::json::Json;

/// Claude Code's per-request attribution block; vLLM drops it so the prefix stays cacheable.
const BILLING_HEADER: &str = "x-anthropic-billing-header";

/// The chat prompt of an Anthropic Messages body (already known to be a JSON object).
pub fn prompt_spec(body: &Json, format: ContentFormat) -> Result<PromptSpec, Unsupported> {
    let items = match body.get("messages") {
        Some(Json::Array(items)) => items.as_slice(),
        Some(_) => return Err(Unsupported("`messages` is not a list")),
        None => return Ok(PromptSpec::None),
    };
    let mut system = system_text(body.get("system"))?;
    let mut converted = Vec::with_capacity(items.len());
    for item in items {
        let role = role_of(item)?;
        let content = item
            .get("content")
            .ok_or(Unsupported("an Anthropic message without content"))?;
        if role == "system" {
            system.push_str(&inline_system_text(content)?);
            continue;
        }
        convert_message(role, content, &mut converted)?;
    }
    let mut messages = Vec::with_capacity(converted.len().saturating_add(1));
    if !system.is_empty() {
        messages.push(Message::new(Json::object(vec![
            ("role", Json::String("system".into())),
            ("content", Json::String(system)),
        ])));
    }
    for m in converted {
        messages.push(Message::new(chat_message(&m, format)?));
    }
    let kwargs = match body.get("chat_template_kwargs") {
        Some(Json::Object(entries)) => entries.clone(),
        _ => Vec::new(),
    };
    // vLLM builds the chat request with its defaults: a generation prompt, no special tokens
    // added (the template renders its own), nothing continued.
    Ok(PromptSpec::Chat(ChatPrompt {
        messages,
        tools: tools(body.get("tools"))?,
        add_generation_prompt: true,
        continue_final_message: false,
        kwargs,
        add_special_tokens: false,
    }))
}

/// A message's role; Claude Code's non-standard `ctx` and `msg` are user turns (as in vLLM).
fn role_of(item: &Json) -> Result<&'static str, Unsupported> {
    match item.get("role").and_then(Json::as_str) {
        Some("user" | "ctx" | "msg") => Ok("user"),
        Some("assistant") => Ok("assistant"),
        Some("system") => Ok("system"),
        Some(_) => Err(Unsupported("unknown Anthropic message role")),
        None => Err(Unsupported("an Anthropic message without role")),
    }
}

/// The top-level `system`: a string, or the text of its `text` blocks concatenated.
fn system_text(system: Option<&Json>) -> Result<String, Unsupported> {
    match system {
        None | Some(Json::Null) => Ok(String::new()),
        Some(Json::String(s)) => Ok(s.clone()),
        Some(Json::Array(blocks)) => blocks_text(blocks),
        Some(_) => Err(Unsupported("`system` must be a string or a list of blocks")),
    }
}

/// The text of an inline `role: "system"` message (a string as sent; blocks as for `system`).
fn inline_system_text(content: &Json) -> Result<String, Unsupported> {
    match content {
        Json::String(s) => Ok(s.clone()),
        Json::Array(blocks) => blocks_text(blocks),
        _ => Err(Unsupported("message content must be a string or a list")),
    }
}

fn blocks_text(blocks: &[Json]) -> Result<String, Unsupported> {
    let mut text = String::new();
    for block in blocks {
        if block_type(block)? == "text" {
            let t = opt_str(block, "text")?.unwrap_or_default();
            if !t.starts_with(BILLING_HEADER) {
                text.push_str(t);
            }
        }
    }
    Ok(text)
}

/// A block's `type`, one of those vLLM's protocol accepts.
fn block_type(block: &Json) -> Result<&str, Unsupported> {
    if !matches!(block, Json::Object(_)) {
        return Err(Unsupported("a content block is not an object"));
    }
    match block.get("type").and_then(Json::as_str) {
        Some(
            t @ ("text" | "image" | "tool_use" | "tool_result" | "tool_reference" | "thinking"
            | "redacted_thinking"),
        ) => Ok(t),
        Some(_) => Err(Unsupported("unknown Anthropic content block type")),
        None => Err(Unsupported("a content block without type")),
    }
}

/// An optional string field: absent or null is `None`, any other non-string is malformed.
fn opt_str<'a>(block: &'a Json, key: &'static str) -> Result<Option<&'a str>, Unsupported> {
    match block.get(key) {
        None | Some(Json::Null) => Ok(None),
        Some(Json::String(s)) => Ok(Some(s)),
        Some(_) => Err(Unsupported("a content block field has the wrong type")),
    }
}

/// What one message's blocks add up to.
#[derive(Default)]
struct Converted {
    /// Text and image parts, in order (an image as an `image_url` part without its URL: the
    /// conversion only places it; `media::items` identifies it from the body).
    parts: Vec<Json>,
    tool_calls: Vec<Json>,
    reasoning: Option<String>,
}

/// One user or assistant message as chat messages, appended to `out` (tool results first).
fn convert_message(role: &str, content: &Json, out: &mut Vec<Json>) -> Result<(), Unsupported> {
    let mut message = vec![("role", Json::String(role.into()))];
    let blocks = match content {
        Json::String(s) => {
            message.push(("content", Json::String(s.clone())));
            out.push(Json::object(message));
            return Ok(());
        }
        Json::Array(blocks) => blocks,
        _ => return Err(Unsupported("message content must be a string or a list")),
    };
    let mut c = Converted::default();
    for block in blocks {
        convert_block(role, block, &mut c, out)?;
    }
    // vLLM's chat parser keeps reasoning and tool calls on assistant turns only.
    if role == "assistant" {
        if let Some(reasoning) = c.reasoning {
            message.push(("reasoning", Json::String(reasoning.clone())));
            message.push(("reasoning_content", Json::String(reasoning)));
        }
        if !c.tool_calls.is_empty() {
            message.push(("tool_calls", Json::Array(c.tool_calls)));
        }
    }
    let has_content = !c.parts.is_empty();
    if has_content {
        // One text part is a string; more stay a part list (the chat path joins or keeps it).
        let content = match <[Json; 1]>::try_from(c.parts) {
            Ok([part]) if part.get("type").and_then(Json::as_str) == Some("text") => {
                part.get("text").cloned().unwrap_or(Json::Null)
            }
            Ok([part]) => Json::Array(vec![part]),
            Err(parts) => Json::Array(parts),
        };
        message.push(("content", content));
    }
    // A user turn of tool results only leaves no user message behind.
    if role == "assistant" || has_content {
        out.push(Json::object(message));
    }
    Ok(())
}

fn convert_block(
    role: &str,
    block: &Json,
    c: &mut Converted,
    out: &mut Vec<Json>,
) -> Result<(), Unsupported> {
    match block_type(block)? {
        "text" => {
            if let Some(text) = opt_str(block, "text")?.filter(|t| !t.is_empty()) {
                c.parts.push(text_part(text.to_string()));
            }
        }
        "image" => {
            if matches!(block.get("source"), Some(Json::Object(s)) if !s.is_empty()) {
                c.parts.push(Json::object(vec![(
                    "type",
                    Json::String("image_url".into()),
                )]));
            }
        }
        "thinking" => {
            if let Some(thinking) = opt_str(block, "thinking")? {
                c.reasoning
                    .get_or_insert_with(String::new)
                    .push_str(thinking);
            }
        }
        "tool_use" => c.tool_calls.push(tool_call(block)?),
        "tool_result" if role == "user" => {
            let (message, images) = tool_message(block)?;
            out.push(message);
            // vLLM follows the tool message with a user message of the result's images.
            if images > 0 {
                let part = Json::object(vec![("type", Json::String("image_url".into()))]);
                out.push(Json::object(vec![
                    ("role", Json::String("user".into())),
                    ("content", Json::Array(vec![part; images])),
                ]));
            }
        }
        "tool_result" => {
            let text = match block.get("content") {
                None | Some(Json::Null) => "",
                Some(Json::String(s)) => s,
                Some(_) => return Err(Unsupported("a list tool_result in an assistant turn")),
            };
            c.parts.push(text_part(format!("Tool result: {text}")));
        }
        // "redacted_thinking" (opaque) and "tool_reference" (expanded inside tool results only).
        _ => {}
    }
    Ok(())
}

fn text_part(text: String) -> Json {
    Json::object(vec![
        ("type", Json::String("text".into())),
        ("text", Json::String(text)),
    ])
}

/// A `tool_use` block as an OpenAI tool call. vLLM serializes `input` to a JSON string and its
/// chat parser parses it back into the object the template sees: `input` itself.
fn tool_call(block: &Json) -> Result<Json, Unsupported> {
    let id = opt_str(block, "id")?
        .filter(|id| !id.is_empty())
        .ok_or(Unsupported("tool_use without an id"))?;
    let arguments = match block.get("input") {
        None | Some(Json::Null) => Json::Object(Vec::new()),
        Some(input @ Json::Object(_)) => input.clone(),
        Some(_) => return Err(Unsupported("tool_use `input` must be an object")),
    };
    let name = opt_str(block, "name")?.unwrap_or_default();
    Ok(Json::object(vec![
        ("id", Json::String(id.into())),
        ("type", Json::String("function".into())),
        (
            "function",
            Json::object(vec![
                ("name", Json::String(name.into())),
                ("arguments", arguments),
            ]),
        ),
    ]))
}

/// A user turn's `tool_result` block as a `tool` message: string content as sent, a list's text
/// items joined with `\n`; and how many images (with a source) the list holds, which vLLM puts in
/// a user message after it.
fn tool_message(block: &Json) -> Result<(Json, usize), Unsupported> {
    let mut images = 0;
    let text = match block.get("content") {
        None | Some(Json::Null) => String::new(),
        Some(Json::String(s)) => s.clone(),
        Some(Json::Array(items)) => {
            let mut texts = Vec::new();
            for item in items {
                if !matches!(item, Json::Object(_)) {
                    return Err(Unsupported("a tool_result content item is not an object"));
                }
                match item.get("type").and_then(Json::as_str) {
                    Some("text") => match item.get("text") {
                        None => texts.push(""),
                        Some(Json::String(s)) => texts.push(s),
                        Some(_) => return Err(Unsupported("tool_result text is not a string")),
                    },
                    Some("image") => {
                        if matches!(item.get("source"), Some(Json::Object(s)) if !s.is_empty()) {
                            images += 1;
                        }
                    }
                    Some("tool_reference") => {
                        return Err(Unsupported("tool_reference in a tool_result"))
                    }
                    _ => {}
                }
            }
            texts.join("\n")
        }
        Some(_) => {
            return Err(Unsupported(
                "tool_result content must be a string or a list",
            ))
        }
    };
    let id = opt_str(block, "tool_use_id")?.unwrap_or_default();
    let message = Json::object(vec![
        ("role", Json::String("tool".into())),
        ("content", Json::String(text)),
        ("tool_call_id", Json::String(id.into())),
    ]);
    Ok((message, images))
}

/// Anthropic tools as the OpenAI function tools vLLM hands the template (its tool models dumped:
/// `description` is null when absent, `defer_loading` only when set).
fn tools(tools: Option<&Json>) -> Result<Option<Json>, Unsupported> {
    let items = match tools {
        None | Some(Json::Null) => return Ok(None),
        Some(Json::Array(items)) if items.is_empty() => return Ok(None),
        Some(Json::Array(items)) => items,
        Some(_) => return Err(Unsupported("`tools` must be a list")),
    };
    let mut out = Vec::with_capacity(items.len());
    for tool in items {
        let name = tool
            .get("name")
            .and_then(Json::as_str)
            .ok_or(Unsupported("a tool without a string `name`"))?;
        let description = match tool.get("description") {
            None | Some(Json::Null) => Json::Null,
            Some(d @ Json::String(_)) => d.clone(),
            Some(_) => return Err(Unsupported("a tool `description` must be a string")),
        };
        let mut schema = match tool.get("input_schema") {
            Some(s @ Json::Object(_)) => s.clone(),
            _ => return Err(Unsupported("a tool without an object `input_schema`")),
        };
        if schema.get("type").is_none() {
            schema.set("type", Json::String("object".into()));
        }
        let mut function = vec![
            ("name", Json::String(name.into())),
            ("description", description),
            ("parameters", schema),
        ];
        match tool.get("defer_loading") {
            None | Some(Json::Null) => {}
            Some(b @ Json::Bool(_)) => function.push(("defer_loading", b.clone())),
            Some(_) => return Err(Unsupported("a tool `defer_loading` must be a boolean")),
        }
        out.push(Json::object(vec![
            ("type", Json::String("function".into())),
            ("function", Json::object(function)),
        ]));
    }
    Ok(Some(Json::Array(out)))
}

#[cfg(test)]
#[path = "anthropic_tests.rs"]
mod tests;
