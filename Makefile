# `make demo` runs the embedding service demo; `make test` runs every check CI runs.
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
# torch pinned exactly, in the same pip command as the extras that need it, so pip
# takes the CPU build on this machine and never resolves a newer torch with CUDA packages
TORCH   = torch==2.13.0

.PHONY: demo test lint typecheck unit bench bench-tensors bench-suite bench-scheduling bench-scaleout bench-soak bench-soak-deadlines bench-generation clean

# the real model over HTTP, regular vs batched: the table, benchmarks/results/demo.{json,png}
demo: $(VENV)/.installed-demo
	$(BIN)/python examples/demo.py

test: lint typecheck unit

lint: $(VENV)/.installed-dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(VENV)/.installed-dev
	$(BIN)/mypy --strict batchproxy

unit: $(VENV)/.installed-dev
	$(BIN)/python -m pytest

bench: $(VENV)/.installed
	$(BIN)/python benchmarks/overhead.py

bench-tensors: $(VENV)/.installed-dev
	HF_HUB_OFFLINE=1 $(BIN)/python benchmarks/length_aware.py

# batchproxy beside the peers that install here (batched), on every workload
bench-suite: $(VENV)/.installed-dev
	HF_HUB_OFFLINE=1 $(BIN)/python benchmarks/suite.py

# scheduling policies on a virtual clock, and the scheduler's cost on a real one
bench-scheduling: $(VENV)/.installed-dev
	$(BIN)/python benchmarks/scheduling.py

# a GIL-bound model on one thread, two worker processes and two Ray actors; dispatch cost
bench-scaleout: $(VENV)/.installed-dev
	$(BIN)/python benchmarks/scaleout.py

# a million requests with cancellations, deadlines, errors and reconfigurations: RSS, leaks, accounting
bench-soak: $(VENV)/.installed
	$(BIN)/python benchmarks/soak.py

# every call with a deadline and a 10 KB result, the queue never empty (issue 16): live requests, RSS
bench-soak-deadlines: $(VENV)/.installed
	$(BIN)/python benchmarks/soak.py --deadlines

# a GPT-2 (random weights) with no batching, static and continuous batching: tokens/s, TTFT
bench-generation: $(VENV)/.installed-dev
	HF_HUB_OFFLINE=1 $(BIN)/python benchmarks/generation.py

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.installed: pyproject.toml | $(VENV)/bin/python
	$(BIN)/python -m pip install --quiet -e .
	touch $@

$(VENV)/.installed-demo: pyproject.toml Makefile | $(VENV)/bin/python
	$(BIN)/python -m pip install --quiet -e '.[models,serve,prometheus,demo]' '$(TORCH)'
	touch $@ $(VENV)/.installed

$(VENV)/.installed-dev: pyproject.toml Makefile | $(VENV)/bin/python
	$(BIN)/python -m pip install --quiet -e '.[dev,models,serve,otel,prometheus,demo,bench,ray]' '$(TORCH)'
	touch $@ $(VENV)/.installed $(VENV)/.installed-demo

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis
