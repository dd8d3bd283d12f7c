#!/usr/bin/env bash
# benchmarks/gpu.py on a lent GPU machine that has no network: the wheels it lacks
# (.whl/: FastAPI, uvicorn, pydantic, pytest-asyncio, ...) and the MiniLM tokenizer's
# files (.carry/tokenizer/) travel with the working tree; results go to $OUT (or
# benchmarks/results/runs/). Extra arguments go to gpu.py.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-benchmarks/results/runs}"
mkdir -p "$out"
nvidia-smi -L
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH="$PWD:/tmp/site" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export BATCHPROXY_TOKENIZER_DIR="$PWD/.carry/tokenizer"
python3 benchmarks/gpu.py --device cuda --out "$out" "$@" 2>&1 | tee "$out/gpu.log"
