"""A tiny LLaVA-1.5-shaped model directory for the multimodal tests (no weights: vLLM serves it with
`--load-format dummy`). Its tokenizer is the e2e text model's (tests/fixtures/vllm-model) with
`<image>` added as token 4096; the vision tower is a 2-layer CLIP at 112 px with 14 px patches, so
vLLM expands each image to (112 / 14)^2 = 64 placeholder tokens (CLS dropped by the `default`
feature strategy), what kvpick reads from config.json.

    python e2e/vllm/tiny_llava.py OUT_DIR
"""

import json
import shutil
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "tests/fixtures/vllm-model"
IMAGE_TOKEN = 4096


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tok = json.loads((SRC / "tokenizer.json").read_text())
    tok["added_tokens"].append({"id": IMAGE_TOKEN, "content": "<image>", "single_word": False,
                                "lstrip": False, "rstrip": False, "normalized": False,
                                "special": True})
    (out / "tokenizer.json").write_text(json.dumps(tok))
    cfg = json.loads((SRC / "tokenizer_config.json").read_text())
    cfg["added_tokens_decoder"] = {str(IMAGE_TOKEN): {"content": "<image>", "special": True,
                                   "lstrip": False, "rstrip": False, "normalized": False,
                                   "single_word": False}}
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    for name in ["special_tokens_map.json", "generation_config.json"]:
        if (SRC / name).exists():
            shutil.copy(SRC / name, out / name)
    text = {"model_type": "llama", "vocab_size": 4160, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
            "num_key_value_heads": 2, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False,
            "bos_token_id": 1, "eos_token_id": 2}
    vision = {"model_type": "clip_vision_model", "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 2, "image_size": 112,
              "patch_size": 14, "projection_dim": 64, "num_channels": 3, "hidden_act": "quick_gelu",
              "layer_norm_eps": 1e-5}
    config = {"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava",
              "image_token_index": IMAGE_TOKEN, "vision_feature_select_strategy": "default",
              "vision_feature_layer": -2, "projector_hidden_act": "gelu",
              "text_config": text, "vision_config": vision, "torch_dtype": "bfloat16",
              "tie_word_embeddings": False}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    mean, std = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
    pre = {"image_processor_type": "CLIPImageProcessor", "processor_class": "LlavaProcessor",
           "do_resize": True, "size": {"shortest_edge": 112}, "do_center_crop": True,
           "crop_size": {"height": 112, "width": 112}, "do_normalize": True, "image_mean": mean,
           "image_std": std, "do_rescale": True, "rescale_factor": 1 / 255, "resample": 3,
           "do_convert_rgb": True}
    (out / "preprocessor_config.json").write_text(json.dumps(pre, indent=2))
    proc = {"processor_class": "LlavaProcessor", "patch_size": 14,
            "vision_feature_select_strategy": "default", "image_token": "<image>",
            "num_additional_image_tokens": 1}
    (out / "processor_config.json").write_text(json.dumps(proc, indent=2))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
