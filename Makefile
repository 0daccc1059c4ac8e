# Developer entry points. `make install` once, then `make test` or `make demo`.
#   make install TORCH_INDEX=https://download.pytorch.org/whl/cu128   # pick the torch wheel index yourself

PYTHON ?= python3
VENV := .venv
VENV_PY := $(VENV)/bin/python
VENV_PIP := $(VENV_PY) -m pip
STAMP := $(VENV)/.installed

# Must match the torch pin in pyproject.toml (tests/test_deploy.py checks it).
TORCH_VERSION := 2.13.0
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
# Empty: CUDA wheel from PyPI when nvidia-smi is present, otherwise a CPU-only wheel.
TORCH_INDEX ?=

BENCH_VENV := .venv-bench
BENCH_PY := $(BENCH_VENV)/bin/python
BENCH_STAMP := $(BENCH_VENV)/.installed
TRL_PINS := trl==1.12.0 accelerate==1.15.0 datasets==5.2.0

# Two workers, a test file each: every process of the suite runs one torch thread (tests/conftest.py) and a test
# mostly waits on one process at a time, so a single worker leaves the second core idle. The files go out in the
# order tests/conftest.py sets (--no-loadscope-reorder keeps it): the second worker runs the files that need no
# embedded build while the first builds it. PYTEST_WORKERS=0 runs the suite in one process.
PYTEST_WORKERS ?= 2
PYTEST_FLAGS ?= -q -ra --durations=15 $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder)

# pip compiles every installed module to bytecode one file at a time, about half of the install's CPU time; the
# installs skip that and compileall then does it on every core. torch's tests' helpers are left out: one of them is
# written for a newer Python than some users run, and nothing here imports them. A file that does not compile only
# loses its cached bytecode (Python compiles it at import), so that is reported, not fatal.
PIP_INSTALL_FLAGS ?= --no-compile
COMPILE_BYTECODE = $(1) -m compileall -q -j 0 -x '/torch/testing/_internal/' \
	"$$($(1) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
	|| echo "compileall: the files above stay without cached bytecode; Python compiles them when imported"

.PHONY: install demo test protos lint clean clean-all bench-env bench

# INSTALL_TORCH(python): torch goes first so that pip never resolves the pinned torch to a CUDA build on a CPU-only machine:
# plain `pip install` is used only when its dry run pulls in no nvidia-* packages (as with a local CPU wheel
# from pip's configured find-links, or on macOS); otherwise the CPU index is used.
define INSTALL_TORCH
	@if $(1) -c 'import sys, torch; sys.exit(torch.__version__.split("+")[0] != "$(TORCH_VERSION)")' 2>/dev/null; then \
		echo "torch $(TORCH_VERSION) already installed"; \
	elif [ -n "$(TORCH_INDEX)" ]; then \
		set -x; $(1) -m pip install $(PIP_INSTALL_FLAGS) --index-url "$(TORCH_INDEX)" torch==$(TORCH_VERSION); \
	elif command -v nvidia-smi >/dev/null 2>&1; then \
		set -x; $(1) -m pip install $(PIP_INSTALL_FLAGS) torch==$(TORCH_VERSION); \
	elif $(1) -m pip install --dry-run --quiet --report - torch==$(TORCH_VERSION) 2>/dev/null | $(1) -c \
		'import json, sys; sys.exit(any(p["metadata"]["name"].startswith("nvidia-") for p in json.load(sys.stdin)["install"]))'; then \
		set -x; $(1) -m pip install $(PIP_INSTALL_FLAGS) torch==$(TORCH_VERSION); \
	else \
		set -x; $(1) -m pip install $(PIP_INSTALL_FLAGS) --index-url $(TORCH_CPU_INDEX) torch==$(TORCH_VERSION); \
	fi
endef

# Create .venv and install torch, then the package with its dev extra; redone only when pyproject.toml changes.
install: $(STAMP)

$(VENV_PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(VENV_PY)
	$(call INSTALL_TORCH,$(VENV_PY))
	$(VENV_PIP) install $(PIP_INSTALL_FLAGS) -e '.[dev]'
	$(call COMPILE_BYTECODE,$(VENV_PY))
	@touch $@

# End-to-end demo: starts critic and reward servers on loopback, trains the actor, stops the servers.
demo: install
	$(VENV_PY) -m actor.demo $(ARGS)

# The test suite, as CI runs it (.ci/run).
test: install
	$(VENV_PY) -m pytest $(PYTEST_FLAGS) $(ARGS)

# The side-by-side benchmark against TRL's PPO (bench/trl_ppo.py; not part of `make test`) has its own environment,
# .venv-bench: torch first as above, then this package and trl==1.12.0 (the last release with
# trl.experimental.ppo.PPOTrainer) with the accelerate and datasets versions it resolved to; nothing else gets trl.
bench-env: $(BENCH_STAMP)

$(BENCH_PY):
	$(PYTHON) -m venv $(BENCH_VENV)

$(BENCH_STAMP): pyproject.toml | $(BENCH_PY)
	$(call INSTALL_TORCH,$(BENCH_PY))
	$(BENCH_PY) -m pip install -e . $(TRL_PINS)
	@touch $@

# One timed run at a time on this machine (flock, where there is one); e.g. make bench ARGS="--workload W1".
bench: bench-env
	$(if $(shell command -v flock),flock /tmp/bench.lock) $(BENCH_PY) -m bench.trl_ppo $(ARGS)

# Regenerate the gRPC stubs in ppo_services/ from proto/ (needs the dev extra's grpcio-tools).
protos: install
	$(VENV_PY) scripts/gen_protos.py

# ruff (pinned in the dev extra).
lint:
	@if [ -x $(VENV)/bin/ruff ]; then $(VENV)/bin/ruff check .; \
	elif command -v ruff >/dev/null 2>&1; then ruff check .; \
	else echo "ruff is not installed: skipping lint"; fi

# Remove build outputs and caches; keeps .venv (see clean-all).
clean:
	rm -rf build dist *.egg-info .pytest_cache .ruff_cache $(STAMP)
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -exec rm -rf {} +

# Also remove the virtual environments.
clean-all: clean
	rm -rf $(VENV) $(BENCH_VENV)
