# `make demo` runs the embedding service demo; `make test` runs every check CI runs.
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
# torch pinned exactly, in the same pip command as the extras that need it, so pip
# takes the CPU build on this machine and never resolves a newer torch with CUDA packages
TORCH   = torch==2.13.0

.PHONY: demo demo-publish test lint typecheck unit unit-uvloop package test-pythons docs docs-check bench bench-tensors bench-suite bench-servers bench-servers-gpu-sim bench-lone bench-scheduling bench-scaleout bench-autoscale bench-dedup bench-soak bench-soak-deadlines bench-soak-host bench-generation bench-keys bench-fairness bench-small-first bench-sizes bench-scale bench-host bench-host-cpu bench-tune bench-ab bench-gpu bench-gpu-quick clean

# the real model over HTTP, regular vs batched: the table, and demo.{json,png} in
# benchmarks/results/runs/ (git-ignored: a run changes no tracked file)
demo: $(VENV)/.installed-demo
	$(BIN)/python examples/demo.py

# the same, replacing the published benchmarks/results/demo.{json,png} (the docs show them)
demo-publish: $(VENV)/.installed-demo
	$(BIN)/python examples/demo.py --publish

test: lint typecheck unit unit-uvloop docs package test-pythons

lint: $(VENV)/.installed-dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(VENV)/.installed-dev
	$(BIN)/mypy --strict batchproxy

# the full suite (every extra installed); --suite=full fails the run if a test is skipped
# for anything but the machine (no CUDA): tests/_suites.py
unit: $(VENV)/.installed-dev
	$(BIN)/python -m pytest --suite=full

# the full suite again on uvloop, the loop uvicorn serves on with uvicorn[standard]: here,
# where the servers and every extra are installed, since the servers are where it runs in
# production; the virtual-clock tests skip (looptime's clock needs asyncio's own loop:
# 371 of them, which run on the asyncio pass). The other Pythons stay on asyncio
unit-uvloop: $(VENV)/.installed-dev
	$(BIN)/python -m pytest --suite=full --loop=uvloop

# the wheel and sdist: built, twine-checked, the wheel's file list checked (no tests/ or
# examples/), the wheel alone in a fresh virtualenv where .ci/smoke.py must pass
package: $(VENV)/.installed-dev
	PACKAGE_PYTHON=$(BIN)/python bash .ci/package

# the core suite (no torch, Ray, transformers or servers) on the other supported Pythons,
# each in its own virtualenv (.venv-3.10, ...) with only `pip install -e '.[test]'`;
# `make test PYTHONS=3.12` to pick fewer. CPython X.Y: pythonX.Y if it runs, else pyenv's.
# -rfE: the skips (no torch here, no looptime on 3.10) are summed up by the suite check
PYTHONS ?= 3.10 3.12 3.13
find_python = $(or $(shell python$(1) -c 'import sys; print(sys.executable)' 2>/dev/null),$(lastword $(sort $(wildcard $(shell pyenv root 2>/dev/null)/versions/$(1).*/bin/python$(1)))))

test-pythons: $(PYTHONS:%=core-%)

core-%: .venv-%/.installed
	.venv-$*/bin/python -m pytest --suite=core -rfE

.PRECIOUS: .venv-%/.installed
.venv-%/.installed: pyproject.toml
	@test -n "$(call find_python,$*)" || { echo "no Python $* here: install it (pyenv install $*), or leave it out (make test PYTHONS=...)"; exit 1; }
	$(call find_python,$*) -m venv .venv-$*
	.venv-$*/bin/python -m pip install --quiet --disable-pip-version-check -e '.[test]'
	touch $@

# the documentation site, strictly (a warning fails it), into site/ (git-ignored)
docs: $(VENV)/.installed-dev
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

# the built site in headless chromium (apt-get install chromium chromium-driver): front
# page, Proxy's API page, a page with plots; saves docs/screenshot.png. Not in `test`:
# the browser is a system package that a CI machine may lack
docs-check: docs
	$(BIN)/python docs/check_site.py

bench: $(VENV)/.installed
	$(BIN)/python -m benchmarks.overhead.overhead

bench-tensors: $(VENV)/.installed-dev
	HF_HUB_OFFLINE=1 $(BIN)/python -m benchmarks.models.length_aware

# batchproxy beside the peers that install here (batched), on every workload
bench-suite: $(VENV)/.installed-dev
	HF_HUB_OFFLINE=1 $(BIN)/python -m benchmarks.models.suite

# all-MiniLM-L6-v2 over HTTP: batchproxy's kind of service, the regular way, LitServe and mosec
# (each in a virtualenv the script builds, torch pinned, in benchmarks/servers/.venvs/,
# git-ignored), the HTTP floor and the in-process ceiling; servers.{json,png} in
# benchmarks/results/ (`python -m benchmarks.servers.run --quick` by hand: a smoke run)
bench-servers: $(VENV)/.installed-dev
	HF_HUB_OFFLINE=1 $(BIN)/python -m benchmarks.servers.run

# the same stacks in front of gpu-sim, a model shaped like bert-base on a GPU (MiniLM's
# tokenizer, a GIL-bound launch, a device that takes no CPU): servers-gpu-sim.{json,png}
bench-servers-gpu-sim: $(VENV)/.installed-dev
	HF_HUB_OFFLINE=1 $(BIN)/python -m benchmarks.servers.run --model gpu-sim

# a lone client, interleaved across the regular way and batchproxy's service as the README
# shows it (and variants): speed ratios with 95 % intervals, CPU and collector passes per request
bench-lone: $(VENV)/.installed-dev
	HF_HUB_OFFLINE=1 $(BIN)/python -m benchmarks.servers.lone --kinds regular,batchproxy,batchproxy-nofreeze,batchproxy-nowatch

# scheduling policies on a virtual clock, and the scheduler's cost on a real one
bench-scheduling: $(VENV)/.installed-dev
	$(BIN)/python -m benchmarks.scheduling.scheduling

# a GIL-bound model on one thread, two worker processes and two Ray actors; dispatch cost
bench-scaleout: $(VENV)/.installed-dev
	$(BIN)/python -m benchmarks.scaleout.scaleout

# an autoscaled Ray pool under a load stepping from one replica's worth to eight and back
bench-autoscale: $(VENV)/.installed-dev
	$(BIN)/python -m benchmarks.scaleout.scaleout --autoscale

# the MiniLM embedder on a stream with 20 % repeats: batched, dedup, dedup + cache
bench-dedup: $(VENV)/.installed-dev
	HF_HUB_OFFLINE=1 $(BIN)/python -m benchmarks.models.dedup

# a million requests with cancellations, deadlines, errors and reconfigurations: RSS, leaks, accounting
bench-soak: $(VENV)/.installed
	$(BIN)/python -m benchmarks.soak.soak

# every call with a deadline and a 10 KB result, the queue never empty (issue 16): live requests, RSS
bench-soak-deadlines: $(VENV)/.installed
	$(BIN)/python -m benchmarks.soak.soak --deadlines

# the soak's mix through a model host from four client processes, the host killed and restarted
# twice and a client killed once: accounting on both sides, RSS of each process, leftovers
bench-soak-host: $(VENV)/.installed
	$(BIN)/python -m benchmarks.soak.soak_host

# a GPT-2 (random weights) with no batching, static and continuous batching: tokens/s, TTFT
bench-generation: $(VENV)/.installed-dev
	HF_HUB_OFFLINE=1 $(BIN)/python -m benchmarks.models.generation

# two adapters' calls interleaved on one model thread: key= vs a proxy per adapter vs no batching
bench-keys: $(VENV)/.installed
	$(BIN)/python -m benchmarks.scheduling.keys

# a 10x flood from one of four tenants, FIFO vs fair sharing: the others' p99 latency
bench-fairness: $(VENV)/.installed
	$(BIN)/python -m benchmarks.scheduling.fairness

# one 10,000-item inference_many among steady single calls: bulk_threshold off and on
bench-small-first: $(VENV)/.installed
	$(BIN)/python -m benchmarks.scheduling.small_first

# a static-shape engine (sizes 1..32) on the virtual clock: padding vs cutting vs any size
bench-sizes: $(VENV)/.installed
	$(BIN)/python -m benchmarks.scheduling.batch_sizes

# 100,000 distinct tenants, keys and dedup keys: time per place, memory after the drain
bench-scale: $(VENV)/.installed
	$(BIN)/python -m benchmarks.scheduling.scale

bench-host: $(VENV)/.installed
	$(BIN)/python -m benchmarks.host.host

# server CPU per HTTP request in each layout (one process; a model host and 2 web workers;
# the HTTP floor) on a model that uses no CPU, as on a GPU (issue 39); by hand:
# `python -m benchmarks.host.host_cpu --transport` (no HTTP), `--base REF` (beside a commit)
bench-host-cpu: $(VENV)/.installed-dev
	$(BIN)/python -m benchmarks.host.host_cpu

# python -m batchproxy.tune checked against the real thing: MiniLM and the GPU-shaped model
# (gpu-sim) tuned, then every setting of each one's grid run for real over the same loads: the recommendation's capacity / the best's, predicted / measured p99
bench-tune: $(VENV)/.installed-dev
	HF_HUB_OFFLINE=1 $(BIN)/python -m benchmarks.models.tune

# the hot path (overhead.py: CPU per request, the lone request's latency) against an
# earlier commit, side by side in one run: make bench-ab BASE=<git ref>
BASE ?= HEAD~1
bench-ab: $(VENV)/.installed
	$(BIN)/python -m benchmarks.overhead.ab --base $(BASE)

# on a machine with an NVIDIA GPU: BERT over HTTP (regular vs batched, the HTTP floor, in
# process), the overlap's gain, GPT-2 continuous batching, CUDA graphs, and the CUDA tests;
# gpu.json and plots in benchmarks/results/runs/. A lent machine without network runs
# benchmarks/gpu/gpu_device.sh instead (see benchmarks/gpu/gpu.py)
bench-gpu: $(VENV)/.installed-dev
	HF_HUB_OFFLINE=1 $(BIN)/python -m benchmarks.gpu.gpu --device cuda

# the same script on this CPU with tiny models: a smoke run of its code
bench-gpu-quick: $(VENV)/.installed-dev
	HF_HUB_OFFLINE=1 $(BIN)/python -m benchmarks.gpu.gpu --device cpu --quick

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
	$(BIN)/python -m pip install --quiet -e '.[dev,docs,models,serve,otel,prometheus,demo,bench,ray]' '$(TORCH)'
	touch $@ $(VENV)/.installed $(VENV)/.installed-demo

clean:
	rm -rf $(VENV) .venv-3.* dist .mypy_cache .ruff_cache .pytest_cache .hypothesis site
