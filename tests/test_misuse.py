"""A training script that misuses the collective contract gets an error that names the misuse."""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from aegis import Manager, ModelOptimizerState
from aegis.errors import SnapshotTimeoutError
from tests.dist_utils import run_ranks
from tests.models import build


def _skip_save(rank: int, world: int, store: str) -> Any:
    model, opt, _ = build(world)
    mgr = Manager("misuse", {"model": ModelOptimizerState(model, opt)}, store_dir=store,
                  verbose=False, timeout=timedelta(seconds=3))
    mgr.restore()
    if rank == 2:  # the user bug: this rank skips save(1)
        time.sleep(8)
        return None
    try:
        mgr.save(1)
    except SnapshotTimeoutError as e:
        # rank 0 hosts this harness' store (torchrun's agent would): staying until rank 2 is
        # done keeps it up while rank 1, which may time out a little later, asks who arrived
        time.sleep(5)
        return str(e)
    return "no error"


def test_save_skipped_on_one_rank_names_who_arrived(store_dir: Path) -> None:
    out = run_ranks(3, _skip_save, str(store_dir), timeout=120)
    for msg in out[:2]:
        assert "rank(s) [0, 1] of aegis' group waited at 'save', rank(s) [2] did not arrive" in msg, msg
        assert "did not call the same aegis method" in msg


def _rollback(rank: int, world: int, store: str) -> Any:
    from aegis.errors import NoSnapshotError
    from tests.models import full_state, train_step
    from tests.test_manager import _tensors

    model, opt, sched = build(world)
    mgr = Manager("rollback", {"model": ModelOptimizerState(model, opt), "sched": sched},
                  store_dir=store, verbose=False, keep=3)
    mgr.restore()
    saved = {}
    for step in (1, 2, 3):
        train_step(model, opt, sched, step, rank)
        mgr.save(step)
        saved[step] = _tensors(full_state(model, opt))
    mgr.close()
    model2, opt2, sched2 = build(world, seed=9)
    mgr = Manager("rollback", {"model": ModelOptimizerState(model2, opt2), "sched": sched2},
                  store_dir=store, verbose=False, keep=3)
    try:
        mgr.restore(step=7)
        missing = "no error"
    except NoSnapshotError as e:
        missing = str(e)
    got = mgr.restore(step=2)
    state = _tensors(full_state(model2, opt2))
    same = all(torch.equal(state[k], saved[2][k]) for k in saved[2])
    train_step(model2, opt2, sched2, 3, rank)
    mgr.save(3)  # step 3 again: the newer snapshot was dropped from the node store
    mgr.close()
    return {"missing": missing, "got": got, "same": same}


def test_restore_a_chosen_step(store_dir: Path) -> None:
    out = run_ranks(2, _rollback, str(store_dir))
    for o in out:
        assert o["got"] == 2 and o["same"]
        assert "restore(step=7): that step cannot be restored" in o["missing"]
        assert "committed: [1, 2, 3]" in o["missing"]
