# Every target bootstraps .venv on a fresh machine: torch's CPU build first (the one on this
# machine's disk; never a multi-GB CUDA build), then the project with its dev extra.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
export OMP_NUM_THREADS ?= 1

.PHONY: venv demo test chaos lint bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $(STAMP)

venv: $(STAMP)

demo: venv
	$(BIN)/python examples/demo.py

test: venv
	$(BIN)/python -m pytest -q

# The full chaos campaign (~30 min here): 50 seeded faults on the simulated cluster, with the
# invariant table; `make test` runs a one-fault-per-kind slice of it. Needs root for network
# namespaces and tmpfs mounts (faults it cannot inject are reported, not passed).
chaos: venv
	$(BIN)/python -m tests.chaos.campaign --seed 1 --faults 50 --out bench/results/chaos.json

lint: venv
	$(BIN)/ruff check aegis tests bench examples
	$(BIN)/mypy aegis

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
