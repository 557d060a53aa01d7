# Every target bootstraps .venv on a fresh machine: torch's CPU build first (the one on this
# machine's disk; never a multi-GB CUDA build), then the project with its dev extra.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
export OMP_NUM_THREADS ?= 1

# tests/test_torchtitan.py: torchtitan and what it imports, without the Trainer's extras (wandb,
# tensorboard, datasets: they would pin fsspec below the bench extra's s3fs). triton only because
# torchtitan's model package imports it; nothing here replaces the CPU torch above.
TITAN_TEST_DEPS := torchdata==0.11.0 tyro==1.0.17 spmd_types==0.2.3 einops==0.8.2
TITAN_TEST_NODEPS := torchtitan==0.3.0 triton==3.9.0

.PHONY: venv demo test test-quick docs chaos chaos-inprocess chaos-xor chaos-3x2 chaos-xor-3x2 chaos-rs6 chaos-long chaos-spares chaos-2d worker-trade lint bench goodput gpu-wheels clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e ".[dev]"
	$(BIN)/python -m pip install -q $(TITAN_TEST_DEPS)
	$(BIN)/python -m pip install -q --no-deps $(TITAN_TEST_NODEPS)
	touch $(STAMP)

venv: $(STAMP)

demo: venv
	$(BIN)/python examples/demo.py

test: venv
	$(BIN)/python -m pytest -q

# The guides and the API reference (mkdocs + mkdocstrings, from the docstrings) into build/site;
# --strict: any warning (a docstring griffe cannot read, a broken link inside docs/) fails it.
docs: venv
	$(BIN)/mkdocs build --strict

# The quick tier (< 2 min here): unit and single-process tests, for edit-test loops. CI runs `make test`.
test-quick: venv
	$(BIN)/python -m pytest -q -m quick

# The full chaos campaign (~25 min here): 50 seeded faults on the simulated cluster, with the
# invariant table; `make test` runs a one-fault-per-kind slice of it. Needs root for network
# namespaces and tmpfs mounts (faults it cannot inject are reported, not passed).
chaos: venv
	$(BIN)/python -m tests.chaos.campaign --seed 1 --faults 50 --out bench/results/chaos.json

# The same campaign with in-process recovery (aegis.run_in_process): survivors never restart.
chaos-inprocess: venv
	$(BIN)/python -m tests.chaos.campaign --seed 1 --faults 50 --in-process --out bench/results/chaos_inprocess.json

# The XOR arm (issue 16): memory redundancy by XOR parity over the 3 nodes instead of replicas.
chaos-xor: venv
	$(BIN)/python -m tests.chaos.campaign --seed 1 --faults 24 --in-process --redundancy xor --out bench/results/chaos_xor.json

# Multi-rank nodes and worker kills (issue 25): 3 nodes x 2 ranks (a node's ranks share its store;
# one worker SIGKILLed, its agent, python -m aegis.launch, starts it again alone), and 6 nodes x 1
# rank with Reed-Solomon 4+2 parity (k = 2). The default mix plus worker_kill; in-process.
# The membership store's faults (store_restart, store_outage) are in the mix too.
# CHAOS_FAULTS and CHAOS_SEED for other campaigns; `make chaos-long` runs issue 25's (~55 min).
CHAOS_FAULTS ?= 50
CHAOS_SEED ?= 1
CHAOS_MIX := kill,freeze,partition,s3_outage,store_full,double_kill,worker_kill,store_restart,store_outage
chaos-3x2: venv
	$(BIN)/python -m tests.chaos.campaign --seed $(CHAOS_SEED) --faults $(CHAOS_FAULTS) --in-process --topology 3x2 --kinds $(CHAOS_MIX) --workdir /tmp/aegis-chaos-3x2-$(CHAOS_SEED) --out bench/results/chaos_3x2_seed$(CHAOS_SEED).json

chaos-xor-3x2: venv
	$(BIN)/python -m tests.chaos.campaign --seed $(CHAOS_SEED) --faults $(CHAOS_FAULTS) --in-process --topology 3x2 --redundancy xor --kinds $(CHAOS_MIX) --workdir /tmp/aegis-chaos-xor-$(CHAOS_SEED) --out bench/results/chaos_xor_3x2_seed$(CHAOS_SEED).json

chaos-rs6: venv
	$(BIN)/python -m tests.chaos.campaign --seed $(CHAOS_SEED) --faults $(CHAOS_FAULTS) --in-process --topology 6x1 --redundancy rs --kinds $(CHAOS_MIX) --workdir /tmp/aegis-chaos-rs6-$(CHAOS_SEED) --out bench/results/chaos_rs6_seed$(CHAOS_SEED).json

# Issue 25's campaigns (~55 min here): 228 faults over 9 seeds and the three schemes, 2-rank nodes
# for replica and XOR, the store faults and worker kills in the mix; then the chaos guide's table (docs/guides/chaos.md) and
# each campaign's phase breakdown (tests.chaos.phases: <result>.phases.{md,json}).
LONG := bench/results/chaos_3x2_seed11.json bench/results/chaos_xor_3x2_seed13.json \
	bench/results/chaos_rs6_seed14.json bench/results/chaos_3x2_seed12.json \
	bench/results/chaos_3x2_seed15.json bench/results/chaos_xor_3x2_seed16.json \
	bench/results/chaos_rs6_seed17.json bench/results/chaos_3x2_seed18.json \
	bench/results/chaos_3x2_seed19.json
chaos-long: venv
	$(MAKE) chaos-3x2 CHAOS_SEED=11 CHAOS_FAULTS=24
	$(MAKE) chaos-xor-3x2 CHAOS_SEED=13 CHAOS_FAULTS=24
	$(MAKE) chaos-rs6 CHAOS_SEED=14 CHAOS_FAULTS=20
	$(MAKE) chaos-3x2 CHAOS_SEED=12 CHAOS_FAULTS=24
	$(MAKE) chaos-3x2 CHAOS_SEED=15 CHAOS_FAULTS=30
	$(MAKE) chaos-xor-3x2 CHAOS_SEED=16 CHAOS_FAULTS=30
	$(MAKE) chaos-rs6 CHAOS_SEED=17 CHAOS_FAULTS=28
	$(MAKE) chaos-3x2 CHAOS_SEED=18 CHAOS_FAULTS=24
	$(MAKE) chaos-3x2 CHAOS_SEED=19 CHAOS_FAULTS=24
	$(BIN)/python -m tests.chaos.long_table $(LONG)
	for f in $(LONG); do $(BIN)/python -m tests.chaos.phases $$f --out $${f%.json}.phases.json > $${f%.json}.phases.md || exit 1; done

# Spares (run_in_process(max_world=)): one spare node waits beside the 3 x 2 job and steps in at
# the first round after a loss; the node kills and double kills that otherwise wait for a
# replacement's processes (~15 min). CHAOS_SEED picks the seed.
chaos-spares: venv
	$(BIN)/python -m tests.chaos.campaign --seed $(CHAOS_SEED) --faults $(CHAOS_FAULTS) --in-process --topology 3x2 --spares 1 --kinds kill,double_kill,freeze,partition,worker_kill --workdir /tmp/aegis-chaos-spares-$(CHAOS_SEED) --out bench/results/chaos_spares_seed$(CHAOS_SEED).json

# 2-D meshes in place (issue 38): 3 nodes x 2 ranks, HSDP (replicate across nodes x shard within
# one) then FSDP + TP 2 within a node, rounds of whole nodes (checked in every round), the 3x2 mix
# with worker kills (CHAOS_FAULTS each; ~1 min a fault here).
chaos-2d: venv
	for m in hsdp tp; do $(BIN)/python -m tests.chaos.campaign --seed $(CHAOS_SEED) --faults $(CHAOS_FAULTS) --in-process --topology 3x2 --mesh $$m --kinds $(CHAOS_MIX) --workdir /tmp/aegis-chaos-$$m-$(CHAOS_SEED) --out bench/results/chaos_$${m}_seed$(CHAOS_SEED).json || exit 1; done

# One worker killed on a 2-rank node: replace it (aegis.launch) or let its node leave the job (~5 min).
worker-trade: venv
	$(BIN)/python -m tests.chaos.worker_trade --repeats 3 --out bench/results/worker_trade.json

# The benchmark suite (< 10 min on this 2-core machine): every case side by side with DCP on the
# same state, JSON + PNG in bench/results/, bench/results/summary.md and the README's summary
# block. `make bench BENCH_SIZE=4` multiplies every state size (bigger machines). Needs the bench extra
# (s3fs, for DCP over S3).
BENCH_SIZE ?= 1
BENCH_STAMP := $(VENV)/.bench-stamp

$(BENCH_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q -e ".[dev,bench]"
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	$(BIN)/python bench/run_all.py --size $(BENCH_SIZE)

# The goodput experiment (~7 min): measured effective training time under node losses at a fixed
# rate against what `aegis plan` predicts, memory + durable and durable only.
goodput: venv
	$(BIN)/python bench/goodput.py

# Wheels of aegis' own dependencies for a GPU machine that has torch and Python 3.12 but no
# network (the lent H200): carried as .whl/ with bench/gpu_check.sh (ignored by git).
GPU_WHEELS := crc32c==2.9.post0 tenacity==9.2.1 zstandard==0.25.0
gpu-wheels:
	mkdir -p .whl .git/info
	grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
	  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
	  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl $(GPU_WHEELS)

lint: venv
	$(BIN)/ruff check aegis tests bench examples
	$(BIN)/mypy aegis

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
