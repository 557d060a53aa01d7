"""The smallest complete aegis job: a model, a loop, snapshots every step, in-process recovery.

    aegis store serve --port 29400 &                       # the membership store (one per job)
    AEGIS_MEMBERSHIP=127.0.0.1:29400 python -m aegis.launch --standalone --nproc-per-node=2 \\
        examples/minimal.py --steps 50

Kill one of the two workers (``kill -9``): the other goes on in the same process, the launcher
starts a new one, and it joins at the next snapshot. Launched again (a new store) after it
finished, it resumes from the last snapshot in the node store. (The reference trainer, ``examples/train_fsdp.py``, is
the full version: data, LR schedule, durable tier, logs.)
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard

import aegis


def train(world: aegis.World, steps: int, job: str) -> int:
    # everything bound to the process group is built here: aegis calls train() again, in the same
    # process, with the next round's world after a peer is lost
    mesh = world.mesh("cpu", dp_shard=-1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(256, 64), nn.Linear(64, 256, bias=False), nn.Linear(256, 256))
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mgr = aegis.Manager(job, {"model": aegis.ModelOptimizerState(model, optimizer)}, verbose=False)
    start = mgr.restore()  # the newest committed snapshot (0: none)
    if world.rank == 0:
        print(f"[minimal] round {world.round}, world {world.size}: resumed at step {start}", flush=True)
    for step in range(start + 1, steps + 1):
        g = torch.Generator().manual_seed(step * 1000 + world.rank)
        x = torch.randint(0, 256, (8, 32), generator=g)
        loss = nn.functional.cross_entropy(model(x)[:, :-1].reshape(-1, 256), x[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        mgr.save(step)  # blocks only while this rank's shard is copied into host memory
        if world.rank == 0:
            print(f"[minimal] step {step} loss {loss.item():.4f}", flush=True)
    mgr.close()
    return steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--job", default="minimal")
    args = p.parse_args()
    aegis.run_in_process(lambda world: train(world, args.steps, args.job), min_world=1)


if __name__ == "__main__":
    main()
