"""Restart mode with 2-D meshes (issue 38, d): HSDP ``(dp_replicate, dp_shard)`` and FSDP + tensor
parallel ``(dp_shard, tp)`` on 2 simulated nodes x 2 ranks. A job saves, one node's store is
deleted (its shards come back from the replicas on the other node), and a new job restores into
the same layout, into the other 2-D layout, and into 1-D FSDP at 4 and 2 ranks: the full model
and optimizer state (``get_state_dict(full_state_dict=True)``) is bitwise the saved one, and a
step trained after the same-layout restore gives the loss the uninterrupted job gave."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from aegis import Manager, ModelOptimizerState
from tests.dist_utils import run_ranks
from tests.models import Tiny, train_step  # one batch per data-parallel rank: rank=dp_rank
from tests.test_manager import _tensors

JOB = "mesh2d"


def _build(layout: str, world: int, seed: int = 0) -> tuple[nn.Module, Any, Any, int]:
    """(model, optimizer, scheduler, data-parallel rank) for ``layout`` on ``world`` ranks:
    ``"fsdp"`` (1-D), ``"hsdp"`` (world/2 replicas x 2 shards) or ``"tp"`` (FSDP over world/2 x
    TP 2 within a node: the MLP's Linear layers column- then row-parallel)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.manual_seed(seed)
    model = Tiny()
    if layout == "fsdp":
        mesh = init_device_mesh("cpu", (world,))
        dp, dp_rank = mesh, mesh.get_local_rank()
    elif layout == "hsdp":
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
        dp, dp_rank = mesh, torch.distributed.get_rank()
    elif layout == "tp":
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp_shard", "tp"))
        for b in model.blocks:
            parallelize_module(b, mesh["tp"], {"1": ColwiseParallel(), "3": RowwiseParallel()})
        dp, dp_rank = mesh["dp_shard"], mesh["dp_shard"].get_local_rank()
    else:
        raise ValueError(layout)
    for b in model.blocks:
        fully_shard(b, mesh=dp)
    fully_shard(model, mesh=dp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
    return model, opt, sched, dp_rank


def _full(model: nn.Module, opt: Any) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    return _tensors({"model": msd, "optim": osd})


def _manager(root: str, rank: int, model: nn.Module, opt: Any, sched: Any) -> Manager:
    node = f"node-{rank // 2}"
    os.environ["AEGIS_NODE_ID"] = node
    return Manager(JOB, {"model": ModelOptimizerState(model, opt), "sched": sched},
                   store_dir=f"{root}/{node}", verbose=False, replicas=1)


def _save(rank: int, world: int, root: str, layout: str) -> dict[str, Any]:
    model, opt, sched, dp = _build(layout, world)
    mgr = _manager(root, rank, model, opt, sched)
    mgr.restore()
    for step in (1, 2, 3):
        train_step(model, opt, sched, step, dp)
        mgr.save(step)
    mgr.close()
    full = _full(model, opt)
    after = train_step(model, opt, sched, 4, dp)  # the uninterrupted job's next step
    return {"full": full, "loss4": after}


def _restore(rank: int, world: int, root: str, layout: str) -> dict[str, Any]:
    model, opt, sched, dp = _build(layout, world, seed=5)
    mgr = _manager(root, rank, model, opt, sched)
    step = mgr.restore()
    tiers = sorted({s["source"] for s in mgr.last_restore.sources}) if mgr.last_restore else []
    mgr.close()
    full = _full(model, opt)
    return {"step": step, "full": full, "tiers": tiers, "loss4": train_step(model, opt, sched, 4, dp)}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    if a.keys() != b.keys():
        return [f"keys differ: {sorted(a.keys() ^ b.keys())[:6]}"]
    return [k for k in a if a[k].dtype != b[k].dtype or a[k].shape != b[k].shape
            or not torch.equal(a[k], b[k])]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("saved_as", ["hsdp", "tp"])
def test_a_2d_snapshot_restores_into_every_layout_after_a_node_store_is_lost(
        tmp_path: Path, saved_as: str) -> None:
    root = tmp_path / "stores"
    saved = run_ranks(4, _save, str(root), saved_as, timeout=240)
    shutil.rmtree(root / "node-1")  # node-1 lost: its ranks' shards come from node-0's replicas
    other = "tp" if saved_as == "hsdp" else "hsdp"
    for layout, world in ((saved_as, 4), (other, 4), ("fsdp", 4), ("fsdp", 2)):
        got = run_ranks(world, _restore, str(root), layout, timeout=240)
        for r, g in enumerate(got):
            assert g["step"] == 3, (layout, world, r, g["step"])
            bad = _same(saved[0]["full"], g["full"])
            assert not bad, f"{saved_as} -> {layout} x {world}, rank {r}: {bad[:6]}"
        if layout == saved_as:
            # the lost node's shards came from a peer's replica, and training goes on exactly
            assert "peer" in got[2]["tiers"], got[2]["tiers"]
            assert [g["loss4"] for g in got] == [s["loss4"] for s in saved]
