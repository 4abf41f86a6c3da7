"""Makes a small random-weight Llama laid out like a Hugging Face model directory, for the
real-engine tier (e2e/vllm): no model download, deterministic from its seed.

The directory holds what users point kvpick and vLLM at:
- tokenizer.json: a byte-level BPE trained here on generated text (vocabulary 4,096);
- tokenizer_config.json: bos_token, eos_token and a Llama-style chat template that uses both
  (`{{ bos_token }}` first, `{{ eos_token }}` after each assistant turn), as real model directories do;
- config.json + model.safetensors: a LlamaForCausalLM with random weights (~18M parameters: a
  3k-token prefill takes about a second cold on one CPU core and tens of ms cached, so routing
  to the rank holding the prefix matters).

Run with the vLLM venv's Python (it has torch, safetensors, tokenizers):
    .vllm-venv/bin/python e2e/vllm/make_model.py OUT_DIR
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

VOCAB = 4096
HIDDEN = 384
LAYERS = 6
HEADS = 6
INTERMEDIATE = 1536
MAX_POSITIONS = 16384

WORDS = (
    "alpha beta gamma delta kernel cache block prefix route engine token model request "
    "server agent tool call result error retry session parent child index shard event "
    "stream batch queue prefill decode latency memory budget limit window header body "
    "policy weight score rank worker pool gateway envoy proxy cluster node replica "
    "the a of to in and is for on with as by at from that this it be are was"
).split()

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}<|system|>\n{{ message['content'] }}\n"
    "{% elif message['role'] == 'user' %}<|user|>\n{{ message['content'] }}\n"
    "{% elif message['role'] == 'assistant' %}<|assistant|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

SPECIAL = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]


def corpus(seed: int, lines: int):
    rng = random.Random(seed)
    for _ in range(lines):
        n = rng.randint(5, 30)
        words = [rng.choice(WORDS) for _ in range(n)]
        words.append(str(rng.randint(0, 99999)))
        yield " ".join(words) + rng.choice([".", "?", "!", ":", ","])


def make_tokenizer(out: str, seed: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(seed, 20000), trainer=trainer)
    tok.save(os.path.join(out, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": MAX_POSITIONS,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(out, "special_tokens_map.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}, f, indent=2)
    # A completion prompt starts with BOS, as Llama tokenizers add it: a TemplateProcessing
    # post-processor, so the HF tokenizer (vLLM) and kvpick's add_special_tokens agree.
    from tokenizers import processors

    bos_id = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos_id)]
    )
    tok.save(os.path.join(out, "tokenizer.json"))


def make_weights(out: str, seed: int) -> None:
    import torch
    from safetensors.torch import save_file

    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS,
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    }
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": 2}, f)
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)

    head_dim = HIDDEN // HEADS
    tensors = {
        "model.embed_tokens.weight": rand(VOCAB, HIDDEN),
        "model.norm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16),
        "lm_head.weight": rand(VOCAB, HIDDEN),
    }
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        tensors[p + "self_attn.q_proj.weight"] = rand(HEADS * head_dim, HIDDEN)
        tensors[p + "self_attn.k_proj.weight"] = rand(HEADS * head_dim, HIDDEN)
        tensors[p + "self_attn.v_proj.weight"] = rand(HEADS * head_dim, HIDDEN)
        tensors[p + "self_attn.o_proj.weight"] = rand(HIDDEN, HEADS * head_dim)
        tensors[p + "mlp.gate_proj.weight"] = rand(INTERMEDIATE, HIDDEN)
        tensors[p + "mlp.up_proj.weight"] = rand(INTERMEDIATE, HIDDEN)
        tensors[p + "mlp.down_proj.weight"] = rand(HIDDEN, INTERMEDIATE)
        tensors[p + "input_layernorm.weight"] = torch.ones(HIDDEN, dtype=torch.bfloat16)
        tensors[p + "post_attention_layernorm.weight"] = torch.ones(HIDDEN, dtype=torch.bfloat16)
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="model directory to create (kept if already complete)")
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    done = os.path.join(args.out, ".complete")
    if os.path.exists(done):
        return 0
    os.makedirs(args.out, exist_ok=True)
    make_tokenizer(args.out, args.seed)
    make_weights(args.out, args.seed)
    open(done, "w").close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
