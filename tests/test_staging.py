"""Staging modes (issue 23): ``sync``, ``pinned`` and ``async`` on real gloo ranks, CPU state.

The CUDA parts (registration with cudaHostRegister, side-stream copies, the current stream
waiting on the copies' event) need a GPU: ``bench/gpu_check.py`` runs them. What a CPU state
shows here is the same contract through the same code: in ``async`` mode the tensors the
optimizers update are copied by the background worker after ``save()`` returned (slowed down on
purpose with the ``deferred`` fault delay), and the next ``optimizer.step()`` waits for them, so
the snapshot is bitwise the state at ``save()``; buffers that a forward updates in place are
copied before ``save()`` returns; every mode writes the same bytes; slot mappings outlive a
Manager in the same process (what keeps a CUDA registration across in-process rounds).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from aegis import ConfigError, Manager, ModelOptimizerState
from aegis.snapshot.node_store import NodeStore
from tests.dist_utils import run_ranks
from tests.models import build, full_state, train_step
from tests.test_manager import _tensors, assert_bitwise_equal

JOB = "stg"
DELAY = {"AEGIS_FAIL_AT": "0:3:deferred,1:3:deferred", "AEGIS_FAIL_MODE": "delay:1.0"}


def _mgr(store: str, model: Any, opt: Any, sched: Any, staging: str) -> Manager:
    return Manager(JOB, {"model": ModelOptimizerState(model, opt), "sched": sched},
                   store_dir=store, verbose=False, staging=staging, replicas=1)


def _async_optimizer_waits(rank: int, world: int, store: str) -> dict[str, Any]:
    import time

    model, opt, sched = build(world, seed=0)
    mgr = _mgr(store, model, opt, sched, "async")
    assert mgr.restore() == 0
    for step in range(1, 4):
        train_step(model, opt, sched, step, rank)
        if step == 3:  # what the step-3 snapshot must hold, gathered before save(3): step 4
            saved = _tensors(full_state(model, opt))  # starts the moment save(3) returns
        mgr.save(step)
    t0 = time.perf_counter()
    train_step(model, opt, sched, 4, rank)  # its optimizer step overwrites params and moments
    step4_s = time.perf_counter() - t0
    mgr.close()
    model2, opt2, sched2 = build(world, seed=7)
    mgr2 = _mgr(store, model2, opt2, sched2, "async")
    assert mgr2.restore() == 3
    restored = _tensors(full_state(model2, opt2))
    mgr2.close()
    if rank == 0:
        assert_bitwise_equal(saved, restored)
    return {"step4_s": step4_s}


def test_async_the_next_optimizer_step_waits_for_the_deferred_copies(store_dir: Path) -> None:
    """The deferred copies of step 3 sleep 1 s before they start; training's step 4 begins at
    once and its optimizer step must wait for them: the restored step 3 is bitwise the state at
    save(3), not a mix with step 4's update."""
    res = run_ranks(2, _async_optimizer_waits, str(store_dir), env=DELAY)
    print(f"step 4 (its optimizer step waited for step 3's copies): "
          f"{[round(r['step4_s'], 2) for r in res]} s")
    # the copies start 1 s after save(3) submitted them, and step 4 began as save(3) returned:
    # its optimizer step waited most of that second (without the hook a step takes ~20 ms;
    # the bitwise check on rank 0 is the proof, this shows the wait; issue 37: measured from
    # after a gather, under load, the wait had read 0.67-0.89 s against a 0.9 s bound)
    assert all(r["step4_s"] >= 0.5 for r in res), res


class _BN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.bn = nn.BatchNorm1d(32)
        self.out = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.bn(self.inp(x))))


def _buffers_copied_at_save(rank: int, world: int, store: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    def make(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        m = _BN()
        fully_shard(m, mesh=init_device_mesh("cpu", (world,)))
        return m, torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)

    model, opt = make(0)
    mgr = Manager(JOB, {"model": ModelOptimizerState(model, opt)}, store_dir=store, verbose=False,
                  staging="async", replicas=1)
    mgr.restore()
    g = torch.Generator().manual_seed(5)  # the same data on every rank: equal BN statistics
    for step in range(1, 4):
        model(torch.randn(64, 16, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        mgr.save(step)
    saved = _tensors(full_state(model, opt))
    # the next forward updates the running statistics in place while the deferred copies sleep
    model(torch.randn(64, 16, generator=g) * 5 + 3).square().mean().backward()
    opt.step()
    mgr.close()
    model2, opt2 = make(1)
    mgr2 = Manager(JOB, {"model": ModelOptimizerState(model2, opt2)}, store_dir=store,
                   verbose=False, staging="async", replicas=1)
    assert mgr2.restore() == 3
    restored = _tensors(full_state(model2, opt2))
    mgr2.close()
    assert_bitwise_equal(saved, restored)
    return {"buffers": sorted(k for k in saved if "running" in k)}


def test_async_buffers_a_forward_updates_are_copied_before_save_returns(store_dir: Path) -> None:
    res = run_ranks(2, _buffers_copied_at_save, str(store_dir), env=DELAY)
    assert res[0]["buffers"], "the model has no running statistics to check"


def _train_mode(rank: int, world: int, store: str, staging: str) -> list[list[Any]]:
    model, opt, sched = build(world, seed=0)
    mgr = _mgr(store, model, opt, sched, staging)
    mgr.restore()
    for step in range(1, 5):
        train_step(model, opt, sched, step, rank)
        mgr.save(step)
    mgr.close()
    import crc32c

    ns = NodeStore(store, JOB)
    m = ns.read_manifest(4)
    data = ns.shard_path(4, rank).read_bytes()
    # every tensor item but the RNG states (python's differs between runs: reseeded at fork);
    # not byte items (torch.save writes a random serialization id)
    return [[i.fqn, crc32c.crc32c(data[i.file_offset:i.file_offset + i.length])]
            for i in m.shards[rank].items if i.dtype is not None and not i.fqn.startswith("rng.")]


def test_every_mode_writes_the_same_bytes(tmp_path: Path) -> None:
    import shutil

    crcs = {}
    for mode in ("sync", "pinned", "async"):
        root = tmp_path / mode
        crcs[mode] = run_ranks(2, _train_mode, str(root), mode)
        shutil.rmtree(root)
    assert len(crcs["sync"][0]) > 10
    assert crcs["sync"] == crcs["pinned"] == crcs["async"]


def _saved_twice(rank: int, world: int, store: str, staging: str) -> tuple[Any, Any, Any, Manager]:
    """A model, its optimizer and scheduler, and a Manager that saved steps 1 and 2 of them."""
    model, opt, sched = build(world, seed=0)
    mgr = _mgr(store, model, opt, sched, staging)
    mgr.restore()
    for step in (1, 2):
        train_step(model, opt, sched, step, rank)
        mgr.save(step)
    mgr.wait()
    return model, opt, sched, mgr


def _kept_across_managers(rank: int, world: int, store: str) -> dict[str, Any]:
    from aegis.snapshot import hostmem

    model, opt, sched, mgr = _saved_twice(rank, world, store, "pinned")
    mgr.abort(begin=True)  # what an in-process round's teardown does: no close, no collectives
    mgr.abort(begin=False)
    kept_after_abort = hostmem.stats()["kept"]
    before = hostmem.stats()["reused"]
    mgr2 = _mgr(store, model, opt, sched, "pinned")
    assert mgr2.restore() == 2
    for step in (3, 4, 5):
        train_step(model, opt, sched, step, rank)
        mgr2.save(step)
    mgr2.close()
    stale = [e.path for e in hostmem._kept.values() if not os.path.exists(e.path)]
    return {"kept_after_abort": kept_after_abort, "reused": hostmem.stats()["reused"] - before,
            "stale": stale, "kept_at_end": hostmem.stats()["kept"]}


def test_slot_mappings_outlive_a_manager_in_the_same_process(store_dir: Path) -> None:
    """An aborted Manager (an in-process round's teardown) hands its own slots' mappings to the
    process; the next Manager's slots take them back instead of mapping (on a GPU: registering)
    again, and mappings of files that evictions removed are released."""
    res = run_ranks(2, _kept_across_managers, str(store_dir))
    for r in res:
        assert r["kept_after_abort"] >= 2, r  # the committed step's slot and the free one
        assert r["reused"] >= 1, r
        assert r["stale"] == [], r


def _freed_after_abort(rank: int, world: int, store: str) -> dict[str, Any]:
    from aegis.snapshot import node_store
    from aegis.snapshot.node_store import await_frees

    model, opt, sched, mgr = _saved_twice(rank, world, store, "sync")
    slots = NodeStore(store, JOB).slots_dir

    def mine() -> list[str]:  # this rank's pool files and this process's trash (one node store)
        return sorted(f.name for f in slots.iterdir()
                      if f"-{rank:05d}." in f.name or f.name.startswith(f"trash-{os.getpid()}-"))

    before = mine()
    mgr.abort(begin=True)
    mgr.abort(begin=False)
    # at once: no spare left in any pool (renamed out, its pages freed on a thread)
    pooled = [n for n in mine() if not n.startswith("trash-")]
    handed = len(node_store._frees)  # the freeing was handed to a thread, not done in abort
    # which waits for the next restore (the next round's rebuild and restore keep the cores)
    deferred = len(node_store._deferred)
    trashed = [n for n in mine() if n.startswith("trash-")]
    mgr2 = _mgr(store, model, opt, sched, "sync")
    restored = mgr2.restore()
    started = len(node_store._deferred)
    await_frees()
    left = [n for n in mine() if n.startswith("trash-")]
    for step in (3, 4):
        train_step(model, opt, sched, step, rank)
        mgr2.save(step)
    mgr2.close()
    return {"before": before, "pooled": pooled, "left": left, "restored": restored,
            "handed": handed, "deferred": deferred, "trashed": trashed, "started": started}


def test_an_aborted_engine_frees_its_spare_slots_off_the_teardown(store_dir: Path) -> None:
    """A teardown renames the aborted engine's spare slot files out of the pools and frees them
    on a thread (their pages took most of a 1 GB-per-rank teardown) that starts once the next
    restore is done: none is left in a pool when abort returns, the files wait (renamed) until
    that restore, none is left once the releases are done, and the next Manager of the
    process restores and saves as before."""
    for r in run_ranks(2, _freed_after_abort, str(store_dir)):
        assert r["before"], r  # there were spares to free
        assert r["pooled"] == [] and r["left"] == [], r
        assert r["handed"] >= 1 and r["restored"] == 2, r
        assert r["deferred"] >= 1 and r["trashed"] and r["started"] == 0, r


def _replica_slots_stocked(rank: int, world: int, store: str) -> dict[str, Any]:
    os.environ["AEGIS_NODE_ID"] = f"n{rank}"  # two nodes: each holds the other's replica
    model, opt, sched = build(world, seed=0)
    mgr = Manager(JOB, {"model": ModelOptimizerState(model, opt), "sched": sched},
                  store_dir=f"{store}/n{rank}", verbose=False, replicas=1, keep=1)
    mgr.restore()
    engine, peer = mgr.engine, 1 - rank
    inodes, got = [], []
    for step in (1, 2, 3):
        train_step(model, opt, sched, step, rank)
        mgr.save(step)
        mgr.wait()
        got.append(os.stat(engine.store.shard_path(step, peer)).st_ino)
        engine._executor.submit(lambda: None).result()  # the commit's follow-up work is done
        inodes.append([(os.stat(s.path).st_ino, s.capacity, s.mapped) for s in engine.slots._replica])
    files = sorted(f.name for f in engine.store.slots_dir.iterdir() if f.name.startswith("replica-"))
    mgr.close()
    return {"inodes": inodes, "got": got, "pool_files": files,
            "size": os.path.getsize(NodeStore(f"{store}/n{rank}", JOB).shard_path(3, peer))}


def test_the_next_saves_replica_slot_is_made_before_it(store_dir: Path) -> None:
    """After a commit the engine's thread makes (and pre-faults) the replica slot the next save
    receives into, so no save after the first allocates a replica's pages while its peer waits
    (1 GB: 0.3-1 s of the commit). The pool does not grow past keep + 1 replicas."""
    for r in run_ranks(2, _replica_slots_stocked, str(store_dir)):
        after_first = r["inodes"][0]
        assert len(after_first) == 1, r  # made after the first commit, mapped: the tensor region
        ino, cap, mapped = after_first[0]
        assert mapped and 0 < cap < r["size"], r
        assert r["got"][1] == ino, r  # the second save received into it
        assert r["got"][2] == r["got"][0], r  # the third into the first's, freed by eviction
        assert all(len(x) == 1 for x in r["inodes"]), r
        assert len(r["pool_files"]) <= 1, r


@pytest.mark.quick
def test_a_replica_slot_stocked_after_the_pools_are_gone_is_dropped(tmp_path: Path) -> None:
    """A replica slot the engine's thread is still making when the engine is aborted never
    joins a pool (a later engine of the rank would adopt a file still being sized) and leaves
    no file behind."""
    import threading

    from aegis.snapshot.slot_pools import SlotPools

    ns = NodeStore(str(tmp_path), JOB)
    ns.create()
    pools = SlotPools(ns, 0, pins=False, lock=threading.RLock())
    assert pools.stock_replicas([8192, 8192]) == 2
    assert pools.stock_replicas([8192]) == 0  # the pool holds one of that size already
    made = sorted(p.name for p in ns.free_slots(0, "replica"))
    assert len(made) == 2 and all(n.startswith("replica-") for n in made), made
    _, trashed = pools.trash_spares()
    assert pools.stock_replicas([8192]) == 0
    assert sorted(f for f in ns.slots_dir.iterdir()) == sorted(trashed)


@pytest.mark.quick
def test_trash_of_a_dead_process_is_removed_and_a_live_ones_kept(tmp_path: Path) -> None:
    import subprocess
    import sys

    from aegis.snapshot.slot_pools import TRASH, remove_trash

    ns = NodeStore(str(tmp_path), JOB)
    ns.create()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], check=True,
                          capture_output=True, text=True).stdout.strip()
    (ns.slots_dir / f"{TRASH}{dead}-0.1").write_bytes(b"x")
    (ns.slots_dir / f"{TRASH}{os.getpid()}-0.2").write_bytes(b"x")
    (ns.slots_dir / "rank-00000.3").write_bytes(b"x")
    assert remove_trash(ns) == 1
    assert sorted(f.name for f in ns.slots_dir.iterdir()) == sorted(
        [f"{TRASH}{os.getpid()}-0.2", "rank-00000.3"])


@pytest.mark.quick
def test_staging_mode_is_checked(store_dir: Path) -> None:
    from aegis.training.config import ManagerConfig

    with pytest.raises(ConfigError, match="staging='fast'"):
        ManagerConfig(job="j", staging="fast")
    os.environ["AEGIS_STAGING"] = "async"
    try:
        assert ManagerConfig(job="j").staging == "async"
    finally:
        del os.environ["AEGIS_STAGING"]


def _replaced_tensors(rank: int, world: int, store: str) -> dict[str, Any]:
    model, opt, sched = build(world, seed=0)
    mgr = _mgr(store, model, opt, sched, "sync")
    mgr.restore()
    for step in (1, 2):
        train_step(model, opt, sched, step, rank)
        mgr.save(step)
    # the cached state dict must not survive these: a parameter's storage replaced, and an
    # optimizer state tensor replaced by another object
    p = next(model.parameters())
    with torch.no_grad():
        p.data = p.data.clone() * 3
    st = opt.state[next(iter(opt.state))]
    st["exp_avg"] = st["exp_avg"].clone() + 1
    mgr.save(3)
    saved = _tensors(full_state(model, opt))
    mgr.close()
    model2, opt2, sched2 = build(world, seed=9)
    mgr2 = _mgr(store, model2, opt2, sched2, "sync")
    assert mgr2.restore() == 3
    restored = _tensors(full_state(model2, opt2))
    mgr2.close()
    assert_bitwise_equal(saved, restored)
    return {}


def test_replaced_parameters_and_optimizer_state_are_snapshotted(store_dir: Path) -> None:
    """ModelOptimizerState reuses its state dict only while every tensor is the same object
    over the same storage: a parameter whose ``.data`` was replaced and a new optimizer state
    tensor are in the next snapshot (both fail when the reuse ignores them)."""
    run_ranks(2, _replaced_tensors, str(store_dir))


_CLOSED_UNDER_A_VIEW = """
import sys
from pathlib import Path
from aegis.snapshot.node_store import Slot
slot = Slot(Path(sys.argv[1]))
slot.ensure(1 << 20)
view = slot.view[4096:8192]  # e.g. a buffer a gloo transfer still holds after a failure
slot.close()
view.fill_(7)
print(int(view.sum()))
"""


@pytest.mark.quick
def test_a_slot_closed_while_a_view_lives_is_unmapped_only_after_it(tmp_path: Path) -> None:
    """Closing a slot (an abort, a failed restore) while a tensor over its mapping lives leaves
    the mapping in place until that tensor dies: before, ``torch.frombuffer`` took no buffer
    export, the close unmapped the pages under the live view, and its next touch killed the
    process with SIGSEGV (run in a child, so that this failing is an assertion, not a crash)."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", _CLOSED_UNDER_A_VIEW, str(tmp_path / "slot")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (r.returncode, r.stderr[-3000:])
    assert r.stdout.strip() == str(7 * 4096)
