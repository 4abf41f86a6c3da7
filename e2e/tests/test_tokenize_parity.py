"""Token parity: kvpick's in-process tokenization (tokenizers crate + minijinja chat template,
through its prefix cache) must produce exactly the ids of the reference implementations (PyPI
`tokenizers` + `jinja2` with HF semantics) on a real 128k BPE tokenizer, for a corpus of chat,
completions and responses bodies; and its render client must take ids from a server that behaves
like vLLM's render endpoints, falling back to load-only routing when it misbehaves."""

from __future__ import annotations

import json
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tokenize_ref import reference as ref


def kvpick_tokenize(kvpick_bin, config, bodies: list[dict], path: str | None = None) -> list[dict]:
    stdin = "".join(json.dumps(b, ensure_ascii=False) + "\n" for b in bodies)
    args = [str(kvpick_bin), "tokenize", "--tokenizer-config", str(config)]
    if path:
        args += ["--path", path]
    done = subprocess.run(args, input=stdin.encode(), capture_output=True, timeout=600)
    assert done.returncode == 0, done.stderr.decode()
    answers = [json.loads(line) for line in done.stdout.decode().splitlines()]
    assert len(answers) == len(bodies), done.stderr.decode()
    return answers


def first_difference(a: list[int], b: list[int]) -> str:
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"first difference at token {i}: kvpick {a[i:i + 8]} vs reference {b[i:i + 8]}"


def test_corpus_ids_equal_the_reference(kvpick_bin, tmp_path):
    config = ref.write_config(tmp_path)
    bodies = ref.corpus()
    answers = kvpick_tokenize(kvpick_bin, config, bodies)
    for body, answer in zip(bodies, answers):
        expected = ref.reference_ids(body)
        assert "ids" in answer, (answer, body)
        assert answer["ids"] == expected, (first_difference(answer["ids"], expected), body)
    sources = {a["source"] for a in answers}
    assert sources <= {"ok", "cached"}, sources


def test_growing_conversations_through_the_prefix_cache_equal_cold_reference(kvpick_bin, tmp_path):
    config = ref.write_config(tmp_path)
    # Two agents interleaved, 12 turns each, conversations of ~10-30k tokens.
    a = ref.growing_conversation(seed=1, turns=12)
    b = ref.growing_conversation(seed=2, turns=12)
    bodies = [x for pair in zip(a, b) for x in pair]
    answers = kvpick_tokenize(kvpick_bin, config, bodies)
    for body, answer in zip(bodies, answers):
        expected = ref.reference_ids(body)
        assert answer["ids"] == expected, first_difference(answer["ids"], expected)
    assert [x["source"] for x in answers[2:]] == ["cached"] * (len(bodies) - 2), \
        "every turn after the first of each agent resumes from the prefix cache"


def test_anthropic_messages_ids_equal_vllms_conversion_rendered_by_the_reference(kvpick_bin,
                                                                                 tmp_path):
    config = ref.write_config(tmp_path)
    bodies = ref.anthropic_corpus()
    answers = kvpick_tokenize(kvpick_bin, config, bodies, path="/v1/messages")
    for body, answer in zip(bodies, answers):
        expected = ref.reference_ids_at("/v1/messages", body)
        assert "ids" in answer, (answer, body)
        assert answer["ids"] == expected, (first_difference(answer["ids"], expected), body)
    # The corpus reaches every conversion the test claims to cover.
    flat = json.dumps(bodies)
    for needle in ('"tool_use"', '"tool_result"', '"thinking"', '"redacted_thinking"',
                   ref.BILLING, '"role": "system"', '"input_schema": {"properties"'):
        assert needle in flat, needle
    # A growing Claude Code-like session resumes from the prefix cache every turn.
    session = ref.anthropic_conversation(__import__("random").Random(3), 1)
    session["system"] = "You are a coding agent.\n" + "Follow the repository rules.\n" * 300
    turns = []
    for t in range(4):
        turns.append(json.loads(json.dumps(session)))
        session["messages"].append({"role": "assistant", "content": [
            {"type": "text", "text": f"Step {t} done."},
            {"type": "tool_use", "id": f"toolu_g{t}", "name": "read_file", "input": {"path": f"f{t}.rs"}}]})
        session["messages"].append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": f"toolu_g{t}", "content": "fn main() {}\n" * 50}]})
    answers = kvpick_tokenize(kvpick_bin, config, turns, path="/v1/messages")
    for body, answer in zip(turns, answers):
        assert answer["ids"] == ref.reference_ids_at("/v1/messages", body)
    assert [a["source"] for a in answers[1:]] == ["cached"] * 3


def test_sglang_generate_ids_equal_the_reference(kvpick_bin, tmp_path):
    config = ref.write_config(tmp_path)
    bodies = ref.generate_corpus()
    answers = kvpick_tokenize(kvpick_bin, config, bodies, path="/generate")
    for body, answer in zip(bodies, answers):
        assert answer.get("ids") == ref.reference_ids_at("/generate", body), (answer, body)
    assert [a["source"] for a in answers] == ["ok", "ok", "body", "body"]


def test_anthropic_bodies_vllm_cannot_render_exactly_fall_back(kvpick_bin, tmp_path):
    config = ref.write_config(tmp_path)
    bodies = [
        {"model": ref.MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA"}},
            {"type": "text", "text": "what is this?"}]}]},
        {"model": ref.MODEL, "max_tokens": 8, "messages": "not a list"},
        {"model": ref.MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "audio"}]}]},
    ]
    answers = kvpick_tokenize(kvpick_bin, config, bodies, path="/v1/messages")
    assert all("fallback" in a for a in answers), answers


def test_template_errors_and_bad_bodies_fall_back(kvpick_bin, tmp_path):
    config = ref.write_config(tmp_path)
    bodies = [
        {"model": ref.MODEL, "messages": [{"role": "wizard", "content": "x"}]},   # raise_exception
        {"model": ref.MODEL, "messages": "not a list"},
        {"model": ref.MODEL, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:"}}]}]},
    ]
    answers = kvpick_tokenize(kvpick_bin, config, bodies)
    assert all("fallback" in a for a in answers), answers
    assert "Unknown role: wizard" in answers[0]["fallback"]


class _Render(BaseHTTPRequestHandler):
    """vLLM-like render endpoints: POST /v1/chat/completions/render and /v1/completions/render
    answer the prompt's token ids (computed by the reference), or misbehave on request."""

    mode = "ok"
    paths: list[str] = []

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        type(self).paths.append(self.path)
        if self.mode == "error":
            self.send_response(500)
            self.send_header("content-length", "0")
            self.end_headers()
            return
        try:
            ids = ref.reference_ids(body)
        except Exception:  # noqa: BLE001 - the reference rejects the body, as vLLM would
            self.send_response(400)
            self.send_header("content-length", "0")
            self.end_headers()
            return
        if self.path == "/v1/chat/completions/render":
            answer = {"request_id": "r", "token_ids": ids}
        elif self.path == "/v1/completions/render":
            answer = [{"prompt_token_ids": ids}]
        else:
            self.send_response(404)
            self.send_header("content-length", "0")
            self.end_headers()
            return
        data = json.dumps(answer).encode()
        if self.mode == "garbage":
            data = b"<html>not json</html>"
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def render_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Render)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _Render.paths = []
    yield server
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("mode", ["ok", "error", "garbage"])
def test_render_client_against_a_vllm_like_server(kvpick_bin, tmp_path, render_server, mode):
    _Render.mode = mode
    url = f"http://127.0.0.1:{render_server.server_address[1]}"
    config = ref.write_config(tmp_path, render_url=url, local=False)
    bodies = [b for b in ref.corpus(seed=99, n=6)]
    bodies.append({"model": ref.MODEL, "prompt": "plain completion text"})
    answers = kvpick_tokenize(kvpick_bin, config, bodies)
    if mode == "ok":
        for body, answer in zip(bodies, answers):
            assert answer == {"ids": ref.reference_ids(body), "source": "render"}
        assert "/v1/completions/render" in _Render.paths
        assert "/v1/chat/completions/render" in _Render.paths
    else:
        assert all("fallback" in a for a in answers), answers


def test_anthropic_bodies_render_remotely_as_their_converted_chat(kvpick_bin, tmp_path,
                                                                   render_server):
    _Render.mode = "ok"
    url = f"http://127.0.0.1:{render_server.server_address[1]}"
    config = ref.write_config(tmp_path, render_url=url, local=False)
    bodies = ref.anthropic_corpus(seed=8, n=12)
    answers = kvpick_tokenize(kvpick_bin, config, bodies, path="/v1/messages")
    for body, answer in zip(bodies, answers):
        assert answer == {"ids": ref.reference_ids_at("/v1/messages", body), "source": "render"}
    assert set(_Render.paths) == {"/v1/chat/completions/render"}


def test_render_is_asked_only_when_local_tokenization_fails(kvpick_bin, tmp_path, render_server):
    _Render.mode = "ok"
    url = f"http://127.0.0.1:{render_server.server_address[1]}"
    config = ref.write_config(tmp_path, render_url=url)
    good = ref.corpus(seed=5, n=1)[0]
    answers = kvpick_tokenize(kvpick_bin, config, [good])
    assert answers[0]["source"] in ("ok", "cached")
    assert _Render.paths == []
    # The local template raises: kvpick asks the engine, which rejects it too -> load-only.
    bad = {"model": ref.MODEL, "messages": [{"role": "wizard", "content": "x"}]}
    answers = kvpick_tokenize(kvpick_bin, config, [bad])
    assert _Render.paths == ["/v1/chat/completions/render"]
    assert "fallback" in answers[0]


def test_bad_config_fails_with_a_message_naming_model_and_field(kvpick_bin, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(json.dumps({"tokenizers": [{"model": "m", "tokenizer_json": "/nope.json"}]}))
    done = subprocess.run([str(kvpick_bin), "tokenize", "--tokenizer-config", str(bad)],
                          input=b"", capture_output=True, timeout=60)
    assert done.returncode == 2
    assert 'model "m"' in done.stderr.decode() and "tokenizer_json" in done.stderr.decode()
    bad.write_text(json.dumps({"tokenizers": [{"model": "m", "tokenizer_jsn": "x"}]}))
    done = subprocess.run([str(kvpick_bin), "tokenize", "--tokenizer-config", str(bad)],
                          input=b"", capture_output=True, timeout=60)
    assert done.returncode == 2 and "tokenizer_jsn" in done.stderr.decode()
