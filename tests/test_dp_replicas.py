"""Data-parallel replicas as the memory redundancy (issue 38, part 3): ``redundancy="dp"``.

HSDP's replicate dimension across nodes means a rank's twin on the next node holds the same
tensors; the replica of a shard is then built on its holder from the holder's own copy and only
the rest travels. Real gloo ranks, 2 simulated nodes x 2 ranks, the test model: the replica
bytes sent per snapshot, the node-store bytes against ``replicas=1``, a lost node restored
bitwise from the replicas so built, FSDP + TP (nothing shared: every byte sent, still correct),
and replicas that are not bitwise equal refused with an error that says so."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import aegis
from aegis import Manager, ModelOptimizerState
from aegis.errors import AegisError
from tests.dist_utils import run_ranks
from tests.models import train_step
from tests.test_mesh_2d import _build, _full, _same

JOB = "dpreplicas"


class _Scale:
    """A replicated object with a tensor of 3 floats (its slot has 52 bytes of padding)."""

    def __init__(self) -> None:
        self.t = torch.arange(3.0)

    def state_dict(self) -> dict[str, Any]:
        return {"t": self.t}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.t.copy_(sd["t"])


def _manager(root: str, rank: int, model: Any, opt: Any, sched: Any, redundancy: str,
             staging: str = "sync") -> Manager:
    node = f"node-{rank // 2}"
    os.environ["AEGIS_NODE_ID"] = node
    scale = _Scale()
    return Manager(JOB, {"model": ModelOptimizerState(model, opt), "sched": sched,
                         "scale": aegis.replicated(scale)},
                   store_dir=f"{root}/{node}", verbose=False, replicas=1, redundancy=redundancy,
                   staging=staging)


def _save(rank: int, world: int, root: str, layout: str, redundancy: str,
          diverge_at: int = 0, staging: str = "sync") -> dict[str, Any]:
    model, opt, sched, dp = _build(layout, world)
    mgr = _manager(root, rank, model, opt, sched, redundancy, staging)
    mgr.restore()
    sent, copies, error = [], [], None
    for step in (1, 2, 3):
        train_step(model, opt, sched, step, dp)
        if step == diverge_at and rank == 3:  # one replica of rank 1's shard drifts
            with torch.no_grad():
                next(model.parameters())._local_tensor.add_(1e-3)
        mgr.save(step)
        try:
            r = mgr.wait()
        except AegisError as e:
            error = str(e)
            break
        assert r is not None and r.committed, r
        sent.append(r.replica_sent_bytes)
        copies.append(r.replica_copy_s)
    if error is None:
        mgr.close()
    full = _full(model, opt)
    return {"full": full, "sent": sent, "error": error, "own": mgr.engine.rank,
            "loss4": train_step(model, opt, sched, 4, dp) if error is None else None}


def _restore(rank: int, world: int, root: str, layout: str) -> dict[str, Any]:
    model, opt, sched, dp = _build(layout, world, seed=5)
    mgr = _manager(root, rank, model, opt, sched, "dp")
    step = mgr.restore()
    sources = sorted({s["source"] for s in mgr.last_restore.sources}) if mgr.last_restore else []
    mgr.close()
    return {"step": step, "full": _full(model, opt), "sources": sources,
            "loss4": train_step(model, opt, sched, 4, dp)}


def _store_bytes(node_dir: Path) -> int:
    """Bytes of the committed steps' files in one node store (shards, replicas, manifests)."""
    return sum(f.stat().st_size for f in node_dir.glob(f"{JOB}/step-*/*") if f.is_file())


@pytest.mark.timeout(400)
@pytest.mark.parametrize("staging", ["sync", "async"])
def test_hsdp_replicas_are_built_from_the_replicate_peers_and_a_lost_node_restores_bitwise(
        tmp_path: Path, staging: str) -> None:
    """``staging="async"``: the copies of tensors an optimizer updates, the twin's share
    included, are made after save() returns, before the next optimizer step."""
    dp = run_ranks(4, _save, str(tmp_path / "dp"), "hsdp", "dp", 0, staging, timeout=240)
    whole = run_ranks(4, _save, str(tmp_path / "replica"), "hsdp", "replica", timeout=240)
    for r in range(4):
        # what travels is the rank's unshared part (15 KB of RNG states, its bytes region and
        # index): 0.10-0.14 of this test's 230 KB shards, a fixed cost that a real shard dwarfs
        assert all(0 < a * 5 < b for a, b in zip(dp[r]["sent"], whole[r]["sent"], strict=True)), \
            (r, dp[r]["sent"], whole[r]["sent"])
        assert not _same(dp[0]["full"], whole[r]["full"])  # the same training either way
    for node in ("node-0", "node-1"):  # the same files as replicas=1: no more node-store bytes
        a, b = _store_bytes(tmp_path / "dp" / node), _store_bytes(tmp_path / "replica" / node)
        assert abs(a - b) <= 0.01 * b, (node, a, b)
    shutil.rmtree(tmp_path / "dp" / "node-1")  # node-1 lost
    got = run_ranks(4, _restore, str(tmp_path / "dp"), "hsdp", timeout=240)
    for r, g in enumerate(got):
        assert g["step"] == 3
        assert not _same(dp[0]["full"], g["full"]), r
    assert "peer" in got[2]["sources"] and "peer" in got[3]["sources"], got
    assert [g["loss4"] for g in got] == [d["loss4"] for d in dp]


@pytest.mark.timeout(300)
def test_tensor_parallel_shards_are_not_replicated_so_dp_sends_them_whole(tmp_path: Path) -> None:
    """FSDP across nodes + TP within: no rank of another node holds a rank's shard, so the
    replicas of redundancy='dp' travel whole, as with 'replica', and still restore bitwise."""
    dp = run_ranks(4, _save, str(tmp_path / "dp"), "tp", "dp", timeout=240)
    whole = run_ranks(4, _save, str(tmp_path / "replica"), "tp", "replica", timeout=240)
    for r in range(4):
        assert all(a >= 0.9 * b for a, b in zip(dp[r]["sent"], whole[r]["sent"], strict=True)), \
            (r, dp[r]["sent"], whole[r]["sent"])
    shutil.rmtree(tmp_path / "dp" / "node-0")
    got = run_ranks(4, _restore, str(tmp_path / "dp"), "tp", timeout=240)
    for r, g in enumerate(got):
        assert g["step"] == 3 and not _same(dp[0]["full"], g["full"]), r
    assert "peer" in got[0]["sources"], got


@pytest.mark.timeout(300)
def test_replicas_that_are_not_bitwise_equal_fail_the_snapshot_and_keep_the_last_one(
        tmp_path: Path) -> None:
    got = run_ranks(4, _save, str(tmp_path), "hsdp", "dp", 2, timeout=240)
    for g in got:
        assert g["sent"] and len(g["sent"]) == 1, g["sent"]  # step 1 committed, step 2 failed
        assert g["error"] and "data-parallel replicas bitwise equal" in g["error"], g["error"]
    from aegis.snapshot.node_store import NodeStore

    for node in ("node-0", "node-1"):
        steps = [s.step for s in NodeStore(tmp_path / node, JOB).steps() if s.committed]
        assert steps == [1], (node, steps)


def test_a_slot_reused_for_another_layout_has_its_padding_zeroed(tmp_path: Path) -> None:
    """Two ranks must write the same bytes for the same tensors, padding included: a slot that
    held another layout (stale bytes where the new one pads) is zeroed there before the copy."""
    from torch.distributed.checkpoint.planner_helpers import _create_write_items

    from aegis.snapshot.dcp_io import stage
    from aegis.snapshot.node_store import Slot
    from aegis.snapshot.shard import plan_layout

    state = {"a": torch.arange(3.0), "b": torch.arange(5.0), "c": torch.ones(16)}
    items = [w for k, v in state.items() for w in _create_write_items(k, v)]
    layout = plan_layout(items, chunk_bytes=1 << 20)
    assert layout.gaps, "the test needs a layout with padding"
    slot = Slot(tmp_path / "slot")
    slot.ensure(layout.tensor_end)
    slot.view.fill_(0xFF)  # what another layout left behind
    stage(1, 0, layout, slot, lambda item: state[item.index.fqn])
    for off, n in layout.gaps:
        assert not slot.view[off:off + n].any(), (off, n)
    fresh = Slot(tmp_path / "fresh")
    fresh.ensure(layout.tensor_end)
    stage(1, 0, layout, fresh, lambda item: state[item.index.fqn])
    assert torch.equal(slot.view, fresh.view)
    slot.close(keep=False)
    fresh.close(keep=False)
