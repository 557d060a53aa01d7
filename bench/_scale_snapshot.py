"""The snapshot sections of ``bench/scale.py`` (issue 24): per-step metadata and restore
traffic against the world size, with real gloo ranks.

* ``metadata``: ``--meta-worlds`` ranks (8 per simulated node, each node a node store of its
  own) save a model of many small tensors (FSDP2, ``--meta-layers`` Linear layers); per world
  size and per format (``whole``: the whole manifest of format 2 every step, as before issue 24;
  ``split``: format 4) it records the bytes each node writes per step (its manifest) and once per
  plan (the layout), the bytes of each shard's own index (per rank per step, in the shard's tail,
  reported apart), the bytes gathered on rank 0 and broadcast to every rank by the commit, the
  commit time and the planning time.
* ``restore``: ``--restore-worlds`` ranks, one per node, a replica each, save; then a node is
  lost and the survivors (world - 1) restore, resharding: per rank, the bytes fetched from other
  nodes against the bytes its load actually reads.
"""

from __future__ import annotations

import json
import pickle
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import run_ranks  # noqa: E402 - bench/ is on sys.path as a script


def _many_small(world: int, layers: int, dim: int) -> tuple[Any, Any]:
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(dim, dim) for _ in range(layers)))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(4, dim)
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def _meta_rank(rank: int, world: int, root: str, layers: int, dim: int, whole: bool,
               steps: int) -> dict[str, Any]:
    import os

    import torch.distributed as dist

    import aegis
    from aegis._dist import Group

    node = f"node-{rank // 8}"
    os.environ["AEGIS_NODE_ID"] = node
    model, opt = _many_small(world, layers, dim)
    sizes: dict[str, list[int]] = {}
    real_gather, real_bcast = Group.gather, Group.broadcast

    def gather(self: Any, obj: Any, what: str = "gather") -> Any:
        if what == "commit gather":
            sizes.setdefault("gather", []).append(len(pickle.dumps(obj)))
        return real_gather(self, obj, what)

    def broadcast(self: Any, obj: Any, what: str = "broadcast", src: int = 0) -> Any:
        out = real_bcast(self, obj, what, src)
        if what == "commit broadcast":
            sizes.setdefault("broadcast", []).append(len(pickle.dumps(out)))
        return out

    Group.gather, Group.broadcast = gather, broadcast  # type: ignore[method-assign]
    store_dir = f"{root}/{node}"
    mgr = aegis.Manager("meta", {"model": aegis.ModelOptimizerState(model, opt)}, every=1,
                        keep=steps + 1, replicas=0, store_dir=store_dir, verbose=False, rng=False)
    mgr.engine.whole_manifests = whole
    mgr.restore()
    commit, plan = [], 0.0
    for s in range(1, steps + 1):
        mgr.save(s)
        r = mgr.wait()
        assert r is not None and r.committed
        plan += r.plan_s
        if s > 1:
            commit.append(r.commit_s)
    out: dict[str, Any] = {"rank": rank, "commit_s": statistics.median(commit), "plan_s": plan,
                           "gather_bytes": sizes.get("gather", [0])[-1],
                           "broadcast_bytes": sizes.get("broadcast", [0])[-1]}
    ns = mgr.store
    idx, size, _ = ns.read_shard_index(steps, rank)
    out["index_bytes"] = size - (idx.chunks[-1].offset + idx.chunks[-1].length)
    if mgr.engine.is_leader:
        out["manifest_bytes"] = ns.manifest_path(steps).stat().st_size
        layouts = [p for p in ns.layouts_dir.glob("layout-*.json")] if ns.layouts_dir.is_dir() else []
        out["layout_bytes"] = sum(p.stat().st_size for p in layouts)
    mgr.close()
    dist.barrier()
    return out


def metadata_section(worlds: list[int], *, layers: int = 64, dim: int = 32, steps: int = 3,
                     timeout: float = 900.0) -> dict[str, Any]:
    """Per world size and format: what a snapshot step writes and moves (see the module)."""
    rows = []
    for world in worlds:
        for whole in (True, False):
            root = tempfile.mkdtemp(prefix="aegis-scale-meta-", dir="/dev/shm")
            t0 = time.time()
            try:
                res = run_ranks(world, _meta_rank, root, layers, dim, whole, steps, timeout=timeout)
            finally:
                shutil.rmtree(root, ignore_errors=True)
            leaders = [r for r in res if "manifest_bytes" in r]
            row = {
                "world": world, "format": "whole (2)" if whole else "split (4)",
                "nodes": len(leaders),
                "manifest_bytes_per_node_per_step": max(r["manifest_bytes"] for r in leaders),
                "layout_bytes_per_node_per_plan": max(r["layout_bytes"] for r in leaders),
                "index_bytes_per_rank_per_step": max(r["index_bytes"] for r in res),
                "gathered_bytes_rank0_per_step": sum(r["gather_bytes"] for r in res),
                "broadcast_bytes_per_rank_per_step": max(r["broadcast_bytes"] for r in res),
                "commit_s_median": statistics.median(r["commit_s"] for r in res),
                "plan_s": max(r["plan_s"] for r in res),
                "wall_s": time.time() - t0,
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    return {"layers": layers, "dim": dim, "ranks_per_node": 8, "rows": rows}


def _restore_rank(rank: int, world: int, root: str, mb: float, phase: str, lost: int
                  ) -> dict[str, Any]:
    import math
    import os

    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import aegis

    # saving: rank r on node r; restoring: the survivors keep their nodes (node ``lost`` is gone)
    node = rank if phase == "save" else [n for n in range(world + 1) if n != lost][rank]
    os.environ["AEGIS_NODE_ID"] = f"node-{node}"
    dim = 256
    layers = max(1, math.ceil(mb * 1e6 / (12 * (dim * dim + dim))))
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(dim, dim) for _ in range(layers)))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, dim)).square().mean().backward()
    opt.step()
    mgr = aegis.Manager("rst", {"model": aegis.ModelOptimizerState(model, opt)}, every=1, keep=1,
                        replicas=1, store_dir=f"{root}/node-{node}", verbose=False)
    step = mgr.restore()
    out: dict[str, Any] = {"rank": rank}
    if phase == "save":
        mgr.save(1)
        mgr.wait()
    else:
        r = mgr.last_restore
        assert r is not None and step == 1
        remote = [x for x in r.sources if x["tier"] != "local"]
        out.update(read=r.bytes_read, fetched=r.bytes_fetched,
                   read_remote=sum(x["bytes_read"] for x in remote),
                   fetched_remote=sum(x.get("fetch_bytes", 0) for x in remote),
                   seconds=r.timings.get("total_s", 0.0))
    mgr.close()
    return out


def restore_section(worlds: list[int], *, mb: float = 32.0, timeout: float = 900.0
                    ) -> dict[str, Any]:
    """Per world size: a node lost, the survivors reshard; bytes fetched vs read per rank."""
    rows = []
    for world in worlds:
        root = tempfile.mkdtemp(prefix="aegis-scale-restore-", dir="/dev/shm")
        try:
            run_ranks(world, _restore_rank, root, mb, "save", -1, timeout=timeout)
            lost = world // 2
            shutil.rmtree(Path(root) / f"node-{lost}", ignore_errors=True)
            res = run_ranks(world - 1, _restore_rank, root, mb, "restore", lost, timeout=timeout)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        # what a rank fetched from other nodes over what it read of those shards
        ratios = [r["fetched_remote"] / r["read_remote"] for r in res if r["read_remote"]]
        row = {"world": world, "survivors": world - 1, "state_mb": mb,
               "read_bytes_per_rank_max": max(r["read"] for r in res),
               "fetched_bytes_per_rank_max": max(r["fetched"] for r in res),
               "fetched_over_read_max": max(ratios) if ratios else 0.0,
               "fetched_over_read_median": statistics.median(ratios) if ratios else 0.0,
               "restore_s_max": max(r["seconds"] for r in res)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return {"rows": rows}
