#!/usr/bin/env bash
# Run the tools people already use, unchanged, against a running `pagedkv serve`.
#
#   tools/compat/run.sh [install|guidellm|vllm|lmeval|langchain|all]   (default: all = install, then every tool)
#
# Each tool lives in its own venv under $VENVS (never a dependency of pagedkv); torch is pinned to 2.13.0 in every
# venv that pulls it, so pip takes the local CPU wheel. Environment:
#   BASE   the server's root URL       (default http://127.0.0.1:8011)
#   MODEL  the served model's directory, used as the tokenizer (default ~/.cache/pagedkv/models/default-llama)
#   VENVS  where the venvs go          (default /work/compat-venvs)
#   OUT    where each tool's output goes (default /tmp/pagedkv-compat)
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
BASE="${BASE:-http://127.0.0.1:8011}"
MODEL="${MODEL:-$HOME/.cache/pagedkv/models/default-llama}"
VENVS="${VENVS:-/work/compat-venvs}"
OUT="${OUT:-/tmp/pagedkv-compat}"
PY="${PYTHON:-python3.11}"
TORCH="torch==2.13.0"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT"

venv() {  # venv NAME PIP-ARGS...: create $VENVS/NAME and pip install into it
  local name="$1"; shift
  [ -x "$VENVS/$name/bin/python" ] || "$PY" -m venv "$VENVS/$name"
  "$VENVS/$name/bin/pip" install -q "$@"
}

install() {
  venv guidellm guidellm "$TORCH"
  venv lmeval "lm-eval[api]" "$TORCH"
  venv langchain langchain-openai
  # vLLM's benchmark client without a GPU build: the wheel with --no-deps, then the pure-Python packages its
  # `vllm bench serve` path imports (torch only because `import vllm` imports it; pinned to the CPU wheel).
  venv vllm --no-deps vllm
  "$VENVS/vllm/bin/pip" install -q "$TORCH" "transformers<5.21.0,>=5.16.1" huggingface_hub tokenizers safetensors \
    aiohttp tqdm numpy regex pybase64 pillow pydantic requests cachetools psutil sentencepiece cloudpickle msgspec \
    pyzmq prometheus_client openai "fastapi<0.137.0" blake3 py-cpuinfo partial-json-parser orjson pyyaml einops \
    cbor2 ijson setproctitle python-json-logger typing_extensions filelock protobuf jsonschema
}
