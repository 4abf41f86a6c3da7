"""Records what a real vLLM (the tiny LLaVA of tiny_llava.py, `--load-format dummy`) publishes for
chat requests with images, for tests/multimodal_keys.rs: each request body and the KV-event
payloads its prefill produced (ZeroMQ SUB on the engine's event port), written to
tests/fixtures/kv_events/multimodal/engine.json (payloads in hex).

    python e2e/vllm/record_multimodal.py HTTP_PORT EVENT_PORT MODEL_ID
"""

import json
import sys
import time
import urllib.request
from pathlib import Path

import zmq

HERE = Path(__file__).resolve().parents[2] / "tests/fixtures/kv_events/multimodal"


def body(text, images, uuid=None):
    content = [{"type": "text", "text": text}]
    for name in images:
        b64 = (HERE / f"{name}.b64").read_text()
        part = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64}"}}
        if uuid:
            part["uuid"] = uuid
        content.append(part)
    return {"model": "llava", "max_tokens": 1, "temperature": 0,
            "messages": [{"role": "user", "content": content}]}


def main():
    http, events, model_id = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    sub = zmq.Context().socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{events}")
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    time.sleep(1.0)
    cases = [
        ("red", body("what is in this picture? describe it in detail please", ["red"])),
        ("blue", body("what is in this picture? describe it in detail please", ["blue"])),
        ("two", body("compare these two pictures", ["red", "blue"])),
        ("uuid", body("what is in this picture? describe it in detail please", ["red"], uuid="pic-42")),
    ]
    out = {"model_id": model_id, "block_size": 32, "cases": []}
    for name, b in cases:
        req = urllib.request.Request(f"http://127.0.0.1:{http}/v1/chat/completions",
                                     data=json.dumps(b).encode(),
                                     headers={"content-type": "application/json"})
        resp = json.loads(urllib.request.urlopen(req, timeout=300).read())
        time.sleep(1.0)
        payloads = []
        while sub.poll(200):
            frames = sub.recv_multipart()
            payloads.append(frames[-1].hex())
        out["cases"].append({"name": name, "body": b,
                             "prompt_tokens": resp["usage"]["prompt_tokens"],
                             "payloads": payloads})
        print(name, resp["usage"]["prompt_tokens"], len(payloads))
    (HERE / "engine.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
