#!/usr/bin/env python
"""The first training step after a round change: what a new mesh costs torch, apart from aegis.

In-process recovery rebuilds the mesh, the FSDP model and the optimizer in ``train(world)``;
the chaos campaigns' phases (``python -m tests.chaos.phases``) showed the first step after a
round at ~3x a steady step. This isolates it: ``--world`` gloo ranks train the reference
trainer's TinyGPT (FSDP2) a few steps on a mesh of all ranks, then on a new mesh of the same
ranks (a new model and optimizer: what a round at an unchanged world does), then on a mesh of
one rank each (new shard shapes: what a shrink does). Printed and written: every step's seconds
per arm, rank 0.

    .venv/bin/python bench/first_step.py
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

from _common import (  # noqa: E402 - bench/ is on sys.path as a script
    RESULTS,
    build_gpt,
    gpt_shape,
    gpt_train_step,
    new_doc,
    run_ranks,
    text_table,
    trainer_module,
    write_doc,
)

NAME = "first_step"


def _rank(rank: int, world: int, state_mb: float, steps: int) -> dict[str, list[float]]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    shape = gpt_shape(state_mb)
    data = trainer_module().SyntheticTokens(shape["vocab_size"], shape["seq_len"], seed=0)
    out: dict[str, list[float]] = {}

    def arm(name: str, mesh: Any, w: int) -> None:
        model, opt, _ = build_gpt(shape, mesh=mesh)
        times = []
        for s in range(1, steps + 1):
            t = time.perf_counter()
            gpt_train_step(model, opt, data, s, 2, rank if w > 1 else 0, w)
            times.append(time.perf_counter() - t)
        out[name] = times

    arm("first mesh (process warm-up)", init_device_mesh("cpu", (world,)), world)
    arm("new mesh, same world", init_device_mesh("cpu", (world,)), world)
    singles = [dist.new_group([r], backend="gloo") for r in range(world)]
    arm("new world: mesh of 1, new shard shapes", DeviceMesh.from_group(singles[rank], "cpu"), 1)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--state-mb", type=float, default=2.0)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", type=Path, default=RESULTS / f"{NAME}.json")
    args = p.parse_args(argv)
    doc = new_doc(NAME, __file__, argv, args)
    ranks = run_ranks(args.world, _rank, args.state_mb, args.steps, timeout=600)
    doc["rank0"] = ranks[0]
    rows = [[k, *(f"{x:.3f}" for x in v)] for k, v in ranks[0].items()]
    print(text_table(["arm (rank 0)", *(f"step {i + 1} s" for i in range(args.steps))], rows))
    write_doc(doc, args.out)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
