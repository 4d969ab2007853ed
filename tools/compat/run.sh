#!/usr/bin/env bash
# Run the tools people already use, unchanged, against a running `pagedkv serve`.
#
#   tools/compat/run.sh [install|guidellm|vllm|lmeval|langchain|all]   (default: all = install, then every tool)
#
# Each tool lives in its own venv under $VENVS (never a dependency of pagedkv); torch is pinned to 2.13.0 in every
# venv that pulls it, so pip takes the local CPU wheel. Environment:
#   BASE   the server's root URL       (default http://127.0.0.1:8011)
#   MODEL  the served model's directory, used as the tokenizer (default ~/.cache/pagedkv/models/v2/default-llama)
#   VENVS  where the venvs go          (default /work/compat-venvs)
#   OUT    where each tool's output goes (default /tmp/pagedkv-compat)
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
BASE="${BASE:-http://127.0.0.1:8011}"
MODEL="${MODEL:-$HOME/.cache/pagedkv/models/v2/default-llama}"
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
  # lm-eval's API models import transformers (for the tokenizer) but its [api] extra does not pull it
  "$VENVS/lmeval/bin/pip" install -q transformers "$TORCH"
  # vLLM's own modules imported on the `vllm bench serve` path (found by importing vllm.benchmarks.serve)
  "$VENVS/vllm/bin/pip" install -q "oss-harmony>=0.0.11" mcp uvloop xgrammar==0.2.8 "llguidance<1.8.0,>=1.7.0" "$TORCH"
}

guidellm() {  # streaming (its default) chat completions, synthetic data, constant 1 req/s, 20 requests
  (cd "$OUT" && "$VENVS/guidellm/bin/guidellm" run \
    --backend "kind=openai_http,target=$BASE,model=default-llama" \
    --profile kind=constant,rate=1 --constraint kind=max_requests,count=20 \
    --data kind=synthetic_text,prompt_tokens=64,output_tokens=16 \
    --tokenizer "kind=huggingface_auto,model=$MODEL" \
    --output "kind=json,path=$OUT/guidellm.json" --disable-progress) 2>&1 | tee "$OUT/guidellm.out"
}

vllm_bench() {  # default backend (openai: /v1/completions, streaming), random dataset, 20 prompts at 2 req/s
  "$VENVS/vllm/bin/vllm" bench serve --base-url "$BASE" --model default-llama --tokenizer "$MODEL" \
    --dataset-name random --random-input-len 64 --random-output-len 16 --num-prompts 20 --request-rate 2 \
    2>&1 | tee "$OUT/vllm-bench.out"
}

lmeval() {  # local-completions on the tiny local tasks: multiple choice (loglikelihood) and generate_until
  local tok
  for tok in False True; do
    (cd "$HERE/lmeval" && "$VENVS/lmeval/bin/lm_eval" --model local-completions \
      --model_args "model=default-llama,base_url=$BASE/v1/completions,tokenizer=$MODEL,tokenized_requests=$tok,num_concurrent=1,max_retries=1" \
      --include_path . --tasks pagedkv_mc --output_path "$OUT/lmeval-mc-$tok") 2>&1 | tee "$OUT/lmeval-mc-$tok.out"
  done
  (cd "$HERE/lmeval" && "$VENVS/lmeval/bin/lm_eval" --model local-completions \
    --model_args "model=default-llama,base_url=$BASE/v1/completions,tokenizer=$MODEL,tokenized_requests=False,num_concurrent=1,max_retries=1" \
    --include_path . --tasks pagedkv_gen --output_path "$OUT/lmeval-gen") 2>&1 | tee "$OUT/lmeval-gen.out"
}

langchain() {
  "$VENVS/langchain/bin/python" "$HERE/langchain_check.py" "$BASE/v1" 2>&1 | tee "$OUT/langchain.out"
}

case "${1:-all}" in
  install) install ;;
  guidellm) guidellm ;;
  vllm) vllm_bench ;;
  lmeval) lmeval ;;
  langchain) langchain ;;
  all) install; guidellm; vllm_bench; lmeval; langchain ;;
  *) echo "usage: $0 [install|guidellm|vllm|lmeval|langchain|all]" >&2; exit 2 ;;
esac
