"""Per-rank state (issue 12, part 1): state that is not model state comes back to the rank that
saved it; replicated declarations; the world-size-change behaviour; the first-save guard.

Real gloo ranks on CPU, a tiny FSDP2 model; each test spawns its ranks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from aegis import Manager, ModelOptimizerState, per_rank, replicated
from aegis.errors import PerRankStateError, StateMismatchError, StepOrderError
from aegis.snapshot.node_store import NodeStore
from tests.dist_utils import run_ranks
from tests.models import build

JOB = "per-rank-repro"


class PerRankSampler:
    """The issue's reproduction: a position and a tensor that differ by rank."""

    def __init__(self, r: int) -> None:
        self.pos, self.t = 100 + r, torch.tensor([float(r)])

    def state_dict(self) -> dict[str, Any]:
        return {"pos": self.pos, "t": self.t, "scalar": torch.tensor(7.0)}  # 0-d too

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.pos, self.t = sd["pos"], sd["t"].clone()


class GlobalSampler:
    """Each rank reads every world-th sample of one stream; its state is its position. It can
    reshard: the global count of samples consumed is the sum over the old ranks."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world, self.pos = rank, world, 0

    def next(self) -> int:
        idx = self.pos * self.world + self.rank
        self.pos += 1
        return idx

    def state_dict(self) -> dict[str, Any]:
        return {"pos": self.pos, "rank": self.rank}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.pos = sd["pos"]

    def reshard_state_dicts(self, states: list[dict[str, Any]], rank: int, world: int) -> dict[str, Any]:
        consumed = sum(s["pos"] for s in states)
        # every old rank consumed the same count here; the new ranks go on from the global count
        return {"pos": consumed // world + (1 if rank < consumed % world else 0), "rank": rank}


def _repro(rank: int, world: int, store: str) -> dict[str, Any]:
    model, opt, _ = build(world)
    state = {"model": ModelOptimizerState(model, opt), "data": PerRankSampler(rank)}
    mgr = Manager(JOB, state, store_dir=store, verbose=False)
    assert mgr.restore() == 0
    mgr.save(1)
    mgr.close()
    state["data"].pos, state["data"].t = -1, torch.tensor([-1.0])
    mgr = Manager(JOB, state, store_dir=store, verbose=False)
    step = mgr.restore()
    kinds = dict(mgr.last_restore.manifest.state_kinds) if mgr.last_restore else {}
    mgr.close()
    return {"step": step, "pos": state["data"].pos, "t": state["data"].t.tolist(), "kinds": kinds}


def test_per_rank_state_comes_back_to_its_own_rank(tmp_path: Path) -> None:
    """The issue's reproduction: before the fix both ranks got rank 1's pos=101, t=[1.0]."""
    out = run_ranks(2, _repro, str(tmp_path))
    assert [(o["step"], o["pos"], o["t"]) for o in out] == [(1, 100, [0.0]), (1, 101, [1.0])]
    assert out[0]["kinds"] == {"model": "sharded", "data": "per_rank"}
    # the manifest keeps both ranks' copies, under their ranks
    m = NodeStore(tmp_path, JOB).read_manifest(1)
    assert {k for k in m.entries if "data" in k} == {
        f"per_rank.rank0000{r}.data.{f}" for r in (0, 1) for f in ("pos", "t", "scalar")}


def _replicated(rank: int, world: int, store: str, differ: bool) -> Any:
    model, opt, sched = build(world)
    sampler = PerRankSampler(0 if not differ else rank)  # same on every rank unless differ
    state = {"model": ModelOptimizerState(model, opt), "sched": replicated(sched),
             "data": replicated(sampler)}
    mgr = Manager(JOB, state, store_dir=store, verbose=False, debug=True)
    mgr.restore()
    try:
        mgr.save(1)
        mgr.wait()
    except StateMismatchError as e:
        mgr.close()
        return str(e)
    mgr.close()
    sampler.pos = -5
    mgr = Manager(JOB, state, store_dir=store, verbose=False)
    step = mgr.restore()
    m = mgr.last_restore.manifest if mgr.last_restore else None
    mgr.close()
    assert m is not None
    return {"step": step, "pos": sampler.pos, "kinds": dict(m.state_kinds),
            "data_keys": sorted(k for k in m.entries if ".data." in k or k.startswith("app.data"))}


def test_replicated_entries_are_saved_once_and_loaded_by_every_rank(tmp_path: Path) -> None:
    out = run_ranks(2, _replicated, str(tmp_path), False)
    assert [(o["step"], o["pos"]) for o in out] == [(1, 100), (1, 100)]
    assert out[0]["kinds"] == {"model": "sharded", "sched": "replicated", "data": "replicated"}
    assert out[0]["data_keys"] == ["app.data.pos", "app.data.scalar", "app.data.t"]  # one copy


def test_replicated_entries_that_differ_fail_the_debug_check(tmp_path: Path) -> None:
    out = run_ranks(2, _replicated, str(tmp_path), True)
    for msg in out:
        assert isinstance(msg, str) and "['data'] are declared replicated but differ" in msg, msg


def _world_change(rank: int, world: int, store: str, phase: str, mode: str) -> Any:
    model, opt, _ = build(world)
    sampler = GlobalSampler(rank, world)
    plain = PerRankSampler(rank)
    data: Any = sampler
    if mode == "fresh":
        data = per_rank(plain, on_reshard="fresh")
    elif mode == "error":
        data = plain
    elif mode == "fn":
        data = per_rank(plain, on_reshard=lambda states, r, w: {
            "pos": sum(s["pos"] for s in states) + r, "t": torch.tensor([float(w)])})
    state = {"model": ModelOptimizerState(model, opt), "data": data}
    mgr = Manager(JOB, state, store_dir=store, verbose=False)
    if phase == "save":
        mgr.restore()
        seen = []
        for step in range(1, 4):
            seen.append(sampler.next())
            mgr.save(step)
        mgr.close()
        return seen
    try:
        step = mgr.restore()
    except PerRankStateError as e:
        mgr.close()
        return str(e)
    seen = [sampler.next() for _ in range(2)]
    mgr.close()
    return {"step": step, "seen": seen, "plain": (plain.pos, plain.t.tolist())}


@pytest.mark.parametrize("mode", ["hook", "fn", "error", "fresh"])
def test_per_rank_state_into_another_world_size(tmp_path: Path, mode: str) -> None:
    saved = run_ranks(2, _world_change, str(tmp_path), "save", mode)
    out = run_ranks(3, _world_change, str(tmp_path), "load", mode)
    if mode == "error":  # a clear error on every rank, before anything is loaded
        for msg in out:
            assert isinstance(msg, str)
            assert "per-rank state ['data'] was saved by 2 rank(s) at step 3 and this job has 3" in msg
            assert "reshard_state_dicts" in msg and "on_reshard='fresh'" in msg
        return
    assert all(o["step"] == 3 for o in out)
    if mode == "hook":
        # 2 ranks read samples 0..5; the 3 new ranks go on with 6, 7, 8 and then 9, 10, 11
        assert sorted(i for s in saved for i in s) == list(range(6))
        assert sorted(i for o in out for i in o["seen"]) == list(range(6, 12))
    elif mode == "fn":
        assert [o["plain"] for o in out] == [(201 + r, [3.0]) for r in range(3)]
    else:  # fresh: the entry keeps what it had
        assert [o["plain"] for o in out] == [(100 + r, [float(r)]) for r in range(3)]


def _first_save(rank: int, world: int, store: str, how: str) -> Any:
    model, opt, sched = build(world)
    state = {"model": ModelOptimizerState(model, opt), "data": PerRankSampler(rank)}
    mgr = Manager(JOB, state, store_dir=store, verbose=False, fresh=how == "fresh")
    if how == "restore":
        mgr.restore()
    try:
        mgr.save(13 if how == "restore" else 1)
        mgr.wait()
    except StepOrderError as e:
        mgr.close()
        return str(e)
    mgr.close()
    return sorted(i.step for i in NodeStore(store, JOB).steps() if i.committed)


@pytest.mark.parametrize("how", ["forgot", "restore", "fresh"])
def test_first_save_without_restore_over_newer_snapshots(tmp_path: Path, how: str) -> None:
    run_ranks(2, _save_then_check_12, str(tmp_path))
    out = run_ranks(2, _first_save, str(tmp_path), how)
    if how == "forgot":
        for msg in out:
            assert "already has committed snapshots up to step 12" in msg and "restore()" in msg
            assert "fresh=True" in msg
        assert [i.step for i in NodeStore(tmp_path, JOB).steps()] == [12]  # nothing lost
    elif how == "restore":
        assert out[0] == [13]  # keep=1: 12 evicted once 13 committed
    else:
        assert out[0] == [1]


def _save_then_check_12(rank: int, world: int, store: str) -> None:
    model, opt, _ = build(world)
    mgr = Manager(JOB, {"model": ModelOptimizerState(model, opt), "data": PerRankSampler(rank)},
                  store_dir=store, verbose=False)
    mgr.restore()
    mgr.save(12)
    mgr.close()
