"""The reference trainer's full-state digest (``examples/train_fsdp.py``'s ``state_digest``), which
the kill tests and the chaos campaigns compare across faults, is a digest of the *full* state:
the same model and optimizer state gives the same digest in 1-D FSDP at 4 and 2 ranks, HSDP
``(2, 2)`` and FSDP + TP ``(2, 2)`` (each DTensor's chunks put in place by their global offsets:
row shards, TP's column and row shards under FSDP's), and a different one after a change to one
element of one shard (of the copy it reads: a replica that drifted is the replicas' check)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.dist_utils import run_ranks

TRAINER = Path(__file__).resolve().parent.parent / "examples" / "train_fsdp.py"


def _trainer() -> Any:
    if "train_fsdp" not in sys.modules:
        spec = importlib.util.spec_from_file_location("train_fsdp", TRAINER)
        assert spec and spec.loader
        mod = importlib.util.module_from_spec(spec)
        sys.modules["train_fsdp"] = mod
        spec.loader.exec_module(mod)
    return sys.modules["train_fsdp"]


def _digests(rank: int, world: int, mesh: str) -> tuple[str, str] | None:
    t = _trainer()
    args = t.parse_args(["--mesh", mesh, "--inner", "2"])
    dp_mesh, tp_mesh, _, _ = t.build_meshes(args, world)
    model = t.build_model("tiny", seed=3, mesh=dp_mesh, tp_mesh=tp_mesh)
    opt, sched = t.build_optimizer_and_scheduler(model, lr=1e-2, total_steps=10, warmup_steps=1)
    for i, p in enumerate(model.parameters()):  # the same gradient in every layout
        p.grad = torch.full_like(p, 0.01 * (i + 1))
    opt.step()
    sampler = t.ResumableSampler(4, world_size=1, rank=0, seed=0)
    first = t.state_digest(model, opt, sched, sampler)
    # one element of the first parameter (not TP-sharded) on a rank that holds the copy the digest
    # reads of a shard other than rank 0's: replicate coordinate 0 in HSDP, TP rank 0 in FSDP + TP
    with torch.no_grad():
        p = next(model.parameters())
        if rank == {"fsdp": world - 1, "hsdp": 1, "tp": 2}[mesh]:
            p.to_local().view(-1)[0] += 1.0
    second = t.state_digest(model, opt, sched, sampler)
    return (first, second) if rank == 0 else None


@pytest.mark.parametrize("mesh,world", [("fsdp", 2), ("hsdp", 4), ("tp", 4)])
def test_the_digest_is_the_full_states_in_every_layout(mesh: str, world: int) -> None:
    (ref, _), *_ = run_ranks(4, _digests, "fsdp", timeout=180)
    (got, changed), *_ = run_ranks(world, _digests, mesh, timeout=180)
    assert got == ref, f"{mesh} x {world}: the digest of the same state differs from 1-D FSDP's"
    assert changed != got, f"{mesh} x {world}: a changed shard element left the digest unchanged"


def _init_is_the_whole_models(rank: int, world: int, mesh: str) -> list[str]:
    t = _trainer()
    args = t.parse_args(["--mesh", mesh, "--inner", "2"])
    dp_mesh, tp_mesh, _, _ = t.build_meshes(args, world)
    torch.manual_seed(123)
    model = t.build_model("tiny", seed=3, mesh=dp_mesh, tp_mesh=tp_mesh, init=False)
    assert torch.initial_seed() == 123, "build_model changed the global RNG"
    t.init_weights(model, 3)  # what the trainer calls when the restore found nothing
    torch.manual_seed(3)
    whole = t.TinyGPT(t.CONFIGS["tiny"]).state_dict()
    wrong = []
    for name, v in model.state_dict().items():
        full = v.full_tensor() if hasattr(v, "full_tensor") else v
        if not torch.equal(full, whole[name]):
            wrong.append(name)
    return wrong


@pytest.mark.parametrize("mesh,world", [("fsdp", 3), ("hsdp", 4), ("tp", 4)])
def test_a_sharded_build_has_the_whole_models_values(mesh: str, world: int) -> None:
    """The trainer builds sharded models on the meta device and copies each rank's shard out of
    a whole reference model (``init_weights``): every tensor, gathered, is the whole model's, at
    an uneven 1-D split and in both 2-D layouts."""
    for rank, wrong in enumerate(run_ranks(world, _init_is_the_whole_models, mesh, timeout=180)):
        assert not wrong, f"{mesh} x {world}, rank {rank}: values differ from the whole model: {wrong}"
