use super::*;

fn spec(body: serde_json::Value) -> Result<PromptSpec, Unsupported> {
    let body: Json = serde_json::from_value(body).unwrap();
    prompt_spec(&body, ContentFormat::String)
}

fn chat(body: serde_json::Value) -> ChatPrompt {
    match spec(body) {
        Ok(PromptSpec::Chat(chat)) => chat,
        other => panic!("not a chat prompt: {other:?}"),
    }
}

/// The converted messages as plain JSON, for readable comparisons.
fn messages(chat: &ChatPrompt) -> serde_json::Value {
    let list: Vec<serde_json::Value> = chat
        .messages
        .iter()
        .map(|m| serde_json::to_value(m.json()).unwrap())
        .collect();
    serde_json::Value::Array(list)
}

#[test]
fn string_content_and_system_string() {
    let c = chat(serde_json::json!({
        "model": "m", "max_tokens": 5, "system": "be brief",
        "messages": [{"role": "user", "content": "hi"}]
    }));
    assert_eq!(
        messages(&c),
        serde_json::json!([
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hi"}
        ])
    );
    assert!(c.add_generation_prompt);
    assert!(!c.continue_final_message);
    assert!(!c.add_special_tokens);
    assert_eq!(c.tools, None);
}

#[test]
fn system_blocks_concatenate_without_the_billing_header_and_inline_system_joins_them() {
    let c = chat(serde_json::json!({
        "model": "m",
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=abc"},
            {"type": "text", "text": "You are Claude Code. "},
            {"type": "text", "text": "Be careful.", "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": ""}
        ],
        "messages": [
            {"role": "user", "content": "q"},
            {"role": "system", "content": [{"type": "text", "text": " Later note."}]},
            {"role": "system", "content": "!"}
        ]
    }));
    assert_eq!(
        messages(&c),
        serde_json::json!([
            {"role": "system", "content": "You are Claude Code. Be careful. Later note.!"},
            {"role": "user", "content": "q"}
        ])
    );
    // No system text at all: no system message.
    let c = chat(serde_json::json!({"model": "m", "system": [],
        "messages": [{"role": "user", "content": "q"}]}));
    assert_eq!(messages(&c).as_array().unwrap().len(), 1);
}

#[test]
fn text_blocks_one_is_a_string_several_are_joined_by_the_chat_path() {
    let c = chat(serde_json::json!({"model": "m", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "only"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": ""},
            {"type": "text", "text": "b"}]},
        {"role": "ctx", "content": "claude code context turn"}
    ]}));
    assert_eq!(
        messages(&c),
        serde_json::json!([
            {"role": "user", "content": "only"},
            {"role": "assistant", "content": "a\nb"},
            {"role": "user", "content": "claude code context turn"}
        ])
    );
    // With the `openai` content format the part list reaches the template as a list.
    let body: Json = serde_json::from_value(serde_json::json!({"model": "m", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    ]}))
    .unwrap();
    let Ok(PromptSpec::Chat(c)) = prompt_spec(&body, ContentFormat::Openai) else {
        panic!()
    };
    assert_eq!(
        messages(&c),
        serde_json::json!([{"role": "user", "content": [
            {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
    );
}

#[test]
fn tool_use_becomes_tool_calls_and_tool_results_tool_messages_before_the_turn() {
    let c = chat(serde_json::json!({"model": "m", "messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "need ", "signature": "sig"},
            {"type": "redacted_thinking", "data": "opaque"},
            {"type": "thinking", "thinking": "a tool"},
            {"type": "text", "text": "Let me check."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Zürich", "days": 2}},
            {"type": "tool_use", "id": "toolu_2", "name": "noop"}
        ]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "20°C"},
            {"type": "tool_result", "tool_use_id": "toolu_2", "content": [
                {"type": "text", "text": "line 1"}, {"type": "text", "text": "line 2"},
                {"type": "tool_reference_unknown_is_ignored"}]},
            {"type": "text", "text": "thanks"}
        ]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_3"}]}
    ]}));
    assert_eq!(
        messages(&c),
        serde_json::json!([
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "reasoning": "need a tool", "reasoning_content": "need a tool",
             "tool_calls": [
                {"id": "toolu_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": {"city": "Zürich", "days": 2}}},
                {"id": "toolu_2", "type": "function", "function": {"name": "noop", "arguments": {}}}],
             "content": "Let me check."},
            {"role": "tool", "content": "20°C", "tool_call_id": "toolu_1"},
            {"role": "tool", "content": "line 1\nline 2", "tool_call_id": "toolu_2"},
            {"role": "user", "content": "thanks"},
            // A turn of tool results only: no user message after the tool message.
            {"role": "tool", "content": "", "tool_call_id": "toolu_3"}
        ])
    );
}

#[test]
fn assistant_side_blocks_and_user_side_thinking() {
    let c = chat(serde_json::json!({"model": "m", "messages": [
        {"role": "user", "content": [{"type": "thinking", "thinking": "dropped"}, {"type": "text", "text": "q"}]},
        {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "x"}]},
        {"role": "assistant", "content": []},
        {"role": "user", "content": [{"type": "thinking", "thinking": "no content: no message"}]}
    ]}));
    assert_eq!(
        messages(&c),
        serde_json::json!([
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "Tool result: x"},
            {"role": "assistant"}
        ])
    );
}

#[test]
fn tools_become_function_tools_as_vllm_dumps_them() {
    let c = chat(
        serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "q"}],
        "tools": [
            {"name": "get_weather", "description": "Weather", "input_schema":
                {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
            {"name": "bare", "input_schema": {"properties": {}}, "defer_loading": true,
             "cache_control": {"type": "ephemeral"}}
        ],
        "chat_template_kwargs": {"enable_thinking": false}}),
    );
    assert_eq!(
        serde_json::to_value(c.tools.as_ref().unwrap()).unwrap(),
        serde_json::json!([
            {"type": "function", "function": {"name": "get_weather", "description": "Weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
            {"type": "function", "function": {"name": "bare", "description": null,
                "parameters": {"properties": {}, "type": "object"}, "defer_loading": true}}
        ])
    );
    assert_eq!(
        c.kwargs,
        vec![("enable_thinking".to_string(), Json::Bool(false))]
    );
    let c = chat(serde_json::json!({"model": "m", "messages": [], "tools": []}));
    assert_eq!(c.tools, None);
    assert!(c.messages.is_empty());
}

#[test]
fn what_the_engine_cannot_render_exactly_is_unsupported() {
    let cases = [
        // The engine names an id-less tool call by the clock.
        serde_json::json!([{"role": "assistant", "content": [{"type": "tool_use", "name": "f", "input": {}}]}]),
        // A Python repr in the engine's prompt.
        serde_json::json!([{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t",
            "content": [{"type": "text", "text": "x"}]}]}]),
        serde_json::json!([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
            "content": [{"type": "tool_reference", "tool_name": "f"}]}]}]),
    ];
    for messages in cases {
        let body = serde_json::json!({"model": "m", "messages": messages});
        assert!(spec(body.clone()).is_err(), "{body}");
    }
    // An image block without a source is skipped, as vLLM skips it.
    let c = chat(
        serde_json::json!({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "image", "source": {}}, {"type": "text", "text": "q"}]}]}),
    );
    assert_eq!(
        messages(&c),
        serde_json::json!([{"role": "user", "content": "q"}])
    );
    // An image with a source is placed where it stands: in front of the text, one placeholder per
    // image (the chat path's `string` format), identified later from the body (`media`).
    let c = chat(
        serde_json::json!({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "q"}, {"type": "image", "source": {"type": "base64",
        "media_type": "image/png", "data": "AAAA"}}]}]}),
    );
    let placeholder = crate::media::IMAGE_SENTINEL;
    assert_eq!(
        messages(&c),
        serde_json::json!([{"role": "user", "content": format!("{placeholder}\nq")}])
    );
    // A tool result's images: a user message of them after the tool message, before the turn's
    // own content (vLLM's `_convert_user_tool_result`).
    let c = chat(
        serde_json::json!({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "http://a"}},
        {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "text", "text": "r"},
            {"type": "image", "source": {"type": "url", "url": "http://b"}}]},
        {"type": "text", "text": "q"}]}]}),
    );
    assert_eq!(
        messages(&c),
        serde_json::json!([
            {"role": "tool", "content": "r", "tool_call_id": "t"},
            {"role": "user", "content": placeholder},
            {"role": "user", "content": format!("{placeholder}\nq")}
        ])
    );
}

#[test]
fn malformed_bodies_are_clear_errors() {
    let cases = [
        (
            serde_json::json!({"messages": "x"}),
            "`messages` is not a list",
        ),
        (
            serde_json::json!({"messages": [5]}),
            "an Anthropic message without role",
        ),
        (
            serde_json::json!({"messages": [{"role": "wizard", "content": "x"}]}),
            "unknown Anthropic message role",
        ),
        (
            serde_json::json!({"messages": [{"role": "user"}]}),
            "an Anthropic message without content",
        ),
        (
            serde_json::json!({"messages": [{"role": "user", "content": 5}]}),
            "message content must be a string or a list",
        ),
        (
            serde_json::json!({"messages": [{"role": "user", "content": [5]}]}),
            "a content block is not an object",
        ),
        (
            serde_json::json!({"messages": [{"role": "user", "content": [{"text": "x"}]}]}),
            "a content block without type",
        ),
        (
            serde_json::json!({"messages": [{"role": "user", "content": [{"type": "audio"}]}]}),
            "unknown Anthropic content block type",
        ),
        (
            serde_json::json!({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}),
            "a content block field has the wrong type",
        ),
        (
            serde_json::json!({"messages": [], "system": 5}),
            "`system` must be a string or a list of blocks",
        ),
        (
            serde_json::json!({"messages": [], "tools": {}}),
            "`tools` must be a list",
        ),
        (
            serde_json::json!({"messages": [], "tools": [{"input_schema": {}}]}),
            "a tool without a string `name`",
        ),
        (
            serde_json::json!({"messages": [], "tools": [{"name": "f"}]}),
            "a tool without an object `input_schema`",
        ),
        (
            serde_json::json!({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "input": [1]}]}]}),
            "tool_use `input` must be an object",
        ),
    ];
    for (body, why) in cases {
        assert_eq!(spec(body.clone()).unwrap_err().0, why, "{body}");
    }
    assert_eq!(
        spec(serde_json::json!({"model": "m"})).unwrap(),
        PromptSpec::None
    );
}

/// Random JSON trees shaped loosely like Anthropic bodies: every one converts or is refused,
/// none panics.
#[test]
fn random_bodies_never_panic() {
    use rand::{Rng, SeedableRng};
    fn value(rng: &mut rand::rngs::StdRng, depth: u32) -> serde_json::Value {
        const KEYS: [&str; 14] = [
            "type",
            "text",
            "role",
            "content",
            "id",
            "tool_use_id",
            "name",
            "input",
            "thinking",
            "source",
            "system",
            "messages",
            "tools",
            "input_schema",
        ];
        const WORDS: [&str; 12] = [
            "text",
            "user",
            "assistant",
            "system",
            "tool_use",
            "tool_result",
            "thinking",
            "image",
            "redacted_thinking",
            "tool_reference",
            "x-anthropic-billing-header",
            "",
        ];
        match if depth == 0 {
            rng.random_range(0..4)
        } else {
            rng.random_range(0..7)
        } {
            0 => serde_json::Value::Null,
            1 => serde_json::json!(rng.random_range(-2..3)),
            2 | 3 => serde_json::json!(WORDS[rng.random_range(0..WORDS.len())]),
            4 => serde_json::Value::Bool(rng.random()),
            5 => (0..rng.random_range(0..4))
                .map(|_| value(rng, depth - 1))
                .collect(),
            _ => (0..rng.random_range(0..5))
                .map(|_| {
                    let k = KEYS[rng.random_range(0..KEYS.len())].to_string();
                    (k, value(rng, depth - 1))
                })
                .collect::<serde_json::Map<_, _>>()
                .into(),
        }
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(26);
    let mut converted = 0;
    for _ in 0..20_000 {
        let messages: Vec<serde_json::Value> = (0..rng.random_range(0..4))
            .map(|_| {
                let role = ["user", "assistant", "system"][rng.random_range(0..3)];
                serde_json::json!({"role": role, "content": value(&mut rng, 3)})
            })
            .collect();
        let body = serde_json::json!({
            "model": "m", "messages": messages, "system": value(&mut rng, 2),
            "tools": value(&mut rng, 3),
        });
        if spec(body).is_ok() {
            converted += 1;
        }
    }
    assert!(
        converted > 100,
        "the generator reaches the conversion ({converted})"
    );
}
