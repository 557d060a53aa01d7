"""A training script that gathers full tensors between saves (evaluation, logging, an EMA):
``get_state_dict(full_state_dict=True)`` and ``DTensor.full_tensor()`` run collectives on the
default group in the training thread while aegis' background thread checksums, replicates and
commits the step just saved on aegis' own gloo group (issue 37: a rank once died there with
``pybind11_object_dealloc(): Tried to deallocate unregistered instance!``).

Each rank is its own simulated node (its own node store), so every save also sends a replica
to a peer while the training thread gathers. Checked: no rank fails, every gather is complete
and the same on every rank, and the state gathered right after ``save(step)`` (while its commit
ran) is bitwise the state a fresh job restores from that step."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from aegis import Manager, ModelOptimizerState
from tests.dist_utils import run_ranks
from tests.models import build, train_step
from tests.test_manager import _tensors

JOB = "gather"
STEPS = 40


def _digest(state: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for k in sorted(state):
        h.update(k.encode())
        h.update(state[k].contiguous().view(torch.uint8).numpy().tobytes()
                 if state[k].dim() else state[k].numpy().tobytes())
    return h.hexdigest()


def _full_state(model: Any, opt: Any) -> dict[str, torch.Tensor]:
    """Full model and optimizer state on every rank (no cpu_offload: rank 0 alone would get it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    return _tensors({"model": msd, "optim": osd})


def _manager(root: str, model: Any, opt: Any, sched: Any) -> Manager:
    return Manager(JOB, {"model": ModelOptimizerState(model, opt), "sched": sched},
                   store_dir=root, verbose=False, keep=2, replicas=1)


def _gather_between_saves(rank: int, world: int, root: str) -> dict[str, Any]:
    os.environ["AEGIS_NODE_ID"] = f"n{rank}"
    store = f"{root}/n{rank}"
    model, opt, sched = build(world)
    mgr = _manager(store, model, opt, sched)
    assert mgr.restore() == 0
    digests: dict[int, str] = {}
    gathered: dict[int, dict[str, torch.Tensor]] = {}
    for step in range(1, STEPS + 1):
        train_step(model, opt, sched, step, rank)
        mgr.save(step)  # returns with the commit still running in the background
        state = _full_state(model, opt)
        # plain DTensor gathers too, as an EMA or a logging hook does
        for name, p in model.named_parameters():
            assert torch.equal(p.full_tensor(), state[f"model.{name}"]), name
        digests[step] = _digest(state)
        if step >= STEPS - 1:
            gathered[step] = state
    mgr.close()
    # a fresh job (other initial weights) restores the newest step: what was gathered beside
    # its commit is what was committed
    model2, opt2, sched2 = build(world, seed=9)
    mgr2 = _manager(store, model2, opt2, sched2)
    got = mgr2.restore()
    restored = _full_state(model2, opt2)
    mgr2.close()
    same = got in gathered and gathered[got].keys() == restored.keys() and all(
        torch.equal(gathered[got][k], restored[k]) for k in restored)
    return {"digests": digests, "restored": got, "same": same}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3])
def test_full_state_gathers_between_saves_while_the_commit_runs(store_dir: Path, world: int) -> None:
    out = run_ranks(world, _gather_between_saves, str(store_dir), timeout=240)
    for o in out:
        assert sorted(o["digests"]) == list(range(1, STEPS + 1))
        assert o["digests"] == out[0]["digests"]  # every rank gathered the same full state
        assert o["restored"] == STEPS
        assert o["same"], "the state gathered beside the commit differs from the restored one"
    # training moved the state at every step: the gathers are not one stale copy
    assert len(set(out[0]["digests"].values())) == STEPS
