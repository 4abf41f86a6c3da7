"""Writes tests/fixtures/vllm-model/: the tokenizer files of the real-engine tier's model
(e2e/vllm/make_model.py, same seed; no weights) and reference.json, the token ids vLLM 0.32
computes for a set of chat and completions bodies, as transformers gives them:

- chat: `apply_chat_template(messages, add_generation_prompt=..., tokenize=True)` (vLLM renders
  the template with the tokenizer's special tokens, then encodes with add_special_tokens=False);
- completions: `tokenizer(prompt, add_special_tokens=...).input_ids` (vLLM's default: True).

`cargo test --test tokenize_model_dir` checks kvpick's ids against reference.json, for the
directory as is and for the same files in transformers' other layouts.

Regenerate (the vLLM venv has transformers and tokenizers; any Python with transformers>=5 does):
    .vllm-venv/bin/python e2e/vllm/tokenizer_fixture.py [OUT_DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import make_model  # noqa: E402

MODEL = "tiny"
DEFAULT_OUT = os.path.join(HERE, "..", "..", "tests", "fixtures", "vllm-model")


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(make_model.WORDS) for _ in range(n))


def chat_bodies() -> list[dict]:
    rng = random.Random(44)
    long_history = []
    for turn in range(6):
        long_history.append({"role": "user", "content": words(rng, 60) + f" turn {turn}?"})
        long_history.append({"role": "assistant", "content": words(rng, 40) + "."})
    long_history.append({"role": "user", "content": "and now: " + words(rng, 30)})
    return [
        {"messages": [{"role": "system", "content": "You are a router."},
                      {"role": "user", "content": "route this request"}]},
        {"messages": [{"role": "system", "content": "You are a router."},
                      {"role": "user", "content": "hello"},
                      {"role": "assistant", "content": "hi, which engine?"},
                      {"role": "user", "content": "the one with the cache"}]},
        {"messages": [{"role": "user", "content": "no generation prompt"}],
         "add_generation_prompt": False},
        {"messages": [{"role": "user", "content": "finish this"},
                      {"role": "assistant", "content": "finished"}],
         "add_generation_prompt": False},
        {"messages": [{"role": "user",
                       "content": "unicode é ü 名前 🚀\n\tindented\n\n  spaces  and <s> and </s> inline"}]},
        {"messages": [{"role": "system", "content": words(rng, 200)}] + long_history},
    ]


def completion_bodies() -> list[dict]:
    rng = random.Random(45)
    return [
        {"prompt": "hello world"},
        {"prompt": "kernel cache block prefix route 12345.\nsecond line\n\nthird"},
        {"prompt": "unicode é ü 名前 🚀 and a literal <s> in text"},
        {"prompt": "no special tokens here", "add_special_tokens": False},
        {"prompt": words(rng, 400)},
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", nargs="?", default=DEFAULT_OUT)
    ap.add_argument("--seed", type=int, default=7, help="make_model.py's seed (its default)")
    args = ap.parse_args()
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    make_model.make_tokenizer(out, args.seed)
    # Compact JSON: the same tokenizer in about 40% of the bytes.
    path = os.path.join(out, "tokenizer.json")
    with open(path) as f:
        tokenizer = json.load(f)
    with open(path, "w") as f:
        json.dump(tokenizer, f, separators=(",", ":"), ensure_ascii=False)

    import transformers
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    cases = []
    for body in chat_bodies():
        agp = body.get("add_generation_prompt", True)
        ids = tok.apply_chat_template(body["messages"], add_generation_prompt=agp,
                                      tokenize=True, return_dict=False)
        cases.append({"body": {"model": MODEL, **body}, "ids": list(ids)})
    for body in completion_bodies():
        ids = tok(body["prompt"], add_special_tokens=body.get("add_special_tokens", True)).input_ids
        cases.append({"body": {"model": MODEL, **body}, "ids": list(ids)})
    reference = {
        "generated_by": "e2e/vllm/tokenizer_fixture.py",
        "transformers": transformers.__version__,
        "cases": cases,
    }
    # One case per line, so a regenerated file diffs case by case.
    head = {k: v for k, v in reference.items() if k != "cases"}
    lines = ",\n".join(json.dumps(c, ensure_ascii=False) for c in cases)
    with open(os.path.join(out, "reference.json"), "w") as f:
        f.write(json.dumps(head, ensure_ascii=False)[:-1] + ', "cases": [\n' + lines + "\n]}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
