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
* ``parity_rebuild``: ``--rebuild-worlds`` ranks, one per node, in parity groups (XOR of 5
  members, Reed-Solomon 4+2 of 6) save; the middle node's store is lost and a replacement node
  restores, rebuilding its rank's shard from the group's survivors (issue 40: reduced along a
  chain): the bytes the rebuilding rank received over the shard's size, and the restore time.
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
               steps: int, per_node: int = 8, kw: dict[str, Any] | None = None) -> dict[str, Any]:
    import os

    import torch.distributed as dist

    import aegis
    from aegis._dist import Group

    node = f"node-{rank // per_node}"
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
                        keep=steps + 1, store_dir=store_dir, verbose=False, rng=False,
                        **(kw or {"replicas": 0}))
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


PARITY_META = {"xor": {"redundancy": "xor", "group_size": 4},
               "rs": {"redundancy": "rs", "group_size": 6, "parity": 2}}


def parity_metadata_section(worlds: list[int], *, layers: int = 64, dim: int = 32, steps: int = 3,
                            timeout: float = 900.0) -> dict[str, Any]:
    """Per world size, parity scheme and format: what a snapshot step writes per node with
    parity groups (one rank per simulated node, as parity groups take one rank per node)."""
    import warnings

    rows = []
    for scheme, kw in PARITY_META.items():
        for world in worlds:
            for whole in ((True, False) if scheme == "xor" else (False,)):
                root = tempfile.mkdtemp(prefix="aegis-scale-pmeta-", dir="/dev/shm")
                t0 = time.time()
                try:
                    with warnings.catch_warnings():  # RS on 2 nodes falls back to XOR: says so
                        warnings.simplefilter("ignore")
                        res = run_ranks(world, _meta_rank, root, layers, dim, whole, steps, 1, kw,
                                        timeout=timeout)
                finally:
                    shutil.rmtree(root, ignore_errors=True)
                row = {
                    "scheme": scheme, "world": world,
                    "format": "whole (3)" if whole else "split (4)",
                    "manifest_bytes_per_node_per_step": max(r["manifest_bytes"] for r in res),
                    "manifest_bytes_min": min(r["manifest_bytes"] for r in res),
                    "gathered_bytes_rank0_per_step": sum(r["gather_bytes"] for r in res),
                    "broadcast_bytes_per_rank_per_step": max(r["broadcast_bytes"] for r in res),
                    "commit_s_median": statistics.median(r["commit_s"] for r in res),
                    "wall_s": time.time() - t0,
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
    return {"layers": layers, "dim": dim, "rows": rows}


def section_parity_metadata(args: Any) -> dict[str, Any]:
    worlds = [int(x) for x in args.meta_worlds.split(",") if x]
    res = parity_metadata_section(worlds, layers=args.meta_layers)
    return parity_metadata_result(res["rows"], {"worlds": worlds, "layers": res["layers"],
                                                "dim": res["dim"], "groups": PARITY_META})


def parity_metadata_result(rows: list[dict[str, Any]], params: dict[str, Any]) -> dict[str, Any]:
    """The parity_metadata section's series, table and notes from its measured rows."""
    series = []
    for scheme in dict.fromkeys(r["scheme"] for r in rows):
        for fmt, label in (("split", "format 4 (issue 40)"), ("whole", "whole manifest (before)")):
            rs = [r for r in rows if r["scheme"] == scheme and r["format"].startswith(fmt)]
            if not rs:
                continue
            for key, panel, per in (
                    ("manifest_bytes_per_node_per_step",
                     "parity groups: metadata written per node per step", "per node per step"),
                    ("broadcast_bytes_per_rank_per_step",
                     "parity groups: commit bytes every rank receives per step", "per rank per step")):
                series.append({"panel": panel, "label": f"{scheme.upper()} {label}",
                               "x": [r["world"] for r in rs], "y": [float(r[key]) for r in rs],
                               "unit": "bytes", "project": True, "per": per})
    headers = ["scheme", "ranks", "format", "manifest B/node/step (max)", "(min)",
               "gathered B (rank 0)/step", "broadcast B/rank/step", "commit s"]
    table = [[r["scheme"].upper(), str(r["world"]), r["format"],
              f"{r['manifest_bytes_per_node_per_step']:,}", f"{r['manifest_bytes_min']:,}",
              f"{r['gathered_bytes_rank0_per_step']:,}", f"{r['broadcast_bytes_per_rank_per_step']:,}",
              f"{r['commit_s_median']:.3f}"] for r in rows]
    split = {(r["scheme"], r["world"]): r["manifest_bytes_per_node_per_step"]
             for r in rows if r["format"].startswith("split")}
    ratios = []
    for scheme in dict.fromkeys(s for s, _ in split):
        ws = sorted(w for s, w in split if s == scheme)
        if len(ws) > 1:
            ratios.append(f"{scheme.upper()} {split[(scheme, ws[-1])] / split[(scheme, ws[0])]:.2f}x "
                          f"from {ws[0]} to {ws[-1]} ranks")
    notes = [
        f"Real gloo ranks, one per simulated node (parity groups take one rank per node), the "
        f"metadata section's model ({params['layers']} Linear layers of width {params['dim']}, "
        "AdamW), a snapshot every step; XOR groups of 4 and RS 4+2 groups of 6 (2 ranks: one group "
        "of 2, where RS falls back to XOR). 'whole' is the whole format-3 manifest every node "
        "wrote at every step before issue 40; 'split' is format 4: the constant step record plus "
        "the node's own parity groups (members, each member's parity crc32c, shard size and index "
        "start: O(group size) per local rank).",
        "Metadata per node per step, format 4: " + ("; ".join(ratios) or "-") + " (bound 1.3x). "
        "The commit broadcast still carries every group's numbers (O(world) small integers, "
        "~40 bytes per rank) where the whole manifest was O(world x tensors).",
        _OVERSUBSCRIBED]
    return {"title": "Parity groups: per-step metadata", "params": params, "rows": rows,
            "series": series, "table": {"headers": headers, "rows": table}, "notes": notes}


def rebuild_parity_metadata(sec: dict[str, Any]) -> dict[str, Any]:
    return parity_metadata_result(sec["rows"], sec["params"])


def _trained_fsdp(world: int, mb: float) -> tuple[Any, Any]:
    """A stack of 256-wide Linear layers of about ``mb`` MB of state (AdamW included), FSDP2 over
    ``world`` ranks, after one optimizer step (the same on every run: seed 0)."""
    import math

    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

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
    return model, opt


def _restore_rank(rank: int, world: int, root: str, mb: float, phase: str, lost: int
                  ) -> dict[str, Any]:
    import os

    import aegis

    # saving: rank r on node r; restoring: the survivors keep their nodes (node ``lost`` is gone)
    node = rank if phase == "save" else [n for n in range(world + 1) if n != lost][rank]
    os.environ["AEGIS_NODE_ID"] = f"node-{node}"
    model, opt = _trained_fsdp(world, mb)
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
        remote = [x for x in r.sources if x["source"] != "local"]
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


SCHEMES = {"xor": {"redundancy": "xor", "group_size": 5},
           "rs": {"redundancy": "rs", "group_size": 6, "parity": 2}}


def _rebuild_rank(rank: int, world: int, root: str, mb: float, phase: str, lost: int,
                  scheme: str) -> dict[str, Any]:
    import os

    import aegis

    # restoring: the same world, node ``lost`` replaced by a new node (its shard is rebuilt)
    node = rank if phase == "save" or rank != lost else world
    os.environ["AEGIS_NODE_ID"] = f"node-{node}"
    model, opt = _trained_fsdp(world, mb)
    mgr = aegis.Manager("rbd", {"model": aegis.ModelOptimizerState(model, opt)}, every=1, keep=1,
                        store_dir=f"{root}/node-{node}", verbose=False, **SCHEMES[scheme])
    step = mgr.restore()
    out: dict[str, Any] = {"rank": rank}
    if phase == "save":
        mgr.save(1)
        mgr.wait()
    else:
        r = mgr.last_restore
        assert r is not None and step == 1
        rebuilt = [x for x in r.sources if x["source"] == "rebuild"]
        out.update(rebuilt=[(x["shard"], x.get("fetch_bytes", 0)) for x in rebuilt],
                   seconds=r.timings.get("total_s", 0.0))
    mgr.close()
    return out


def rebuild_section(worlds: dict[str, list[int]], *, mb: float = 16.0, timeout: float = 900.0
                    ) -> dict[str, Any]:
    """Per scheme and world size: the middle node replaced, its shard rebuilt from parity."""
    from aegis.snapshot.node_store import NodeStore

    rows = []
    for scheme, sizes in worlds.items():
        for world in sizes:
            root = tempfile.mkdtemp(prefix="aegis-scale-rebuild-", dir="/dev/shm")
            try:
                run_ranks(world, _rebuild_rank, root, mb, "save", -1, scheme, timeout=timeout)
                lost = world // 2
                shard = NodeStore(Path(root) / "node-0", "rbd").read_manifest(1).shard(lost).size
                shutil.rmtree(Path(root) / f"node-{lost}", ignore_errors=True)
                res = run_ranks(world, _rebuild_rank, root, mb, "restore", lost, scheme,
                                timeout=timeout)
            finally:
                shutil.rmtree(root, ignore_errors=True)
            got = dict(x for r in res for x in r["rebuilt"])
            if lost not in got:
                raise RuntimeError(f"{scheme} x {world}: shard {lost} was not rebuilt: {res}")
            d = SCHEMES[scheme]["group_size"] - SCHEMES[scheme].get("parity", 1)
            row = {"scheme": scheme, "world": world, "state_mb": mb, "shard_bytes": shard,
                   "rebuilder_received": got[lost], "received_over_shard": got[lost] / shard,
                   "gather_over_shard": float(d), "restore_s_max": max(r["seconds"] for r in res)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return {"rows": rows}


# -- the sections in bench/scale.py's contract (series, table, notes) -----------------------------


def section_metadata(args: Any) -> dict[str, Any]:
    worlds = [int(x) for x in args.meta_worlds.split(",") if x]
    res = metadata_section(worlds, layers=args.meta_layers)
    return metadata_result(res["rows"], {"worlds": worlds, "layers": res["layers"],
                                         "dim": res["dim"], "ranks_per_node": res["ranks_per_node"]})


# Times measured with more ranks than this machine has cores (2) grow with the ranks sharing
# them, not with anything a job's ranks would do: plotted, never projected.
_OVERSUBSCRIBED = ("Times (commit, plan, restore) are measured with every rank a process on this "
                   "machine's 2 cores: from 4 ranks on they grow with the ranks sharing the cores, "
                   "so they are plotted but not projected; the bytes are what a job moves.")


def metadata_result(rows: list[dict[str, Any]], params: dict[str, Any]) -> dict[str, Any]:
    """The metadata section's series, table and notes from its measured rows (also used to
    rebuild them from ``scale.json``)."""
    res = {"layers": params["layers"], "dim": params["dim"],
           "ranks_per_node": params.get("ranks_per_node", 8)}

    def pick(fmt: str, key: str) -> tuple[list[int], list[float]]:
        rs = [r for r in rows if r["format"].startswith(fmt)]
        return [r["world"] for r in rs], [float(r[key]) for r in rs]

    series = []
    for fmt, label in (("split", "format 4 (issue 24)"), ("whole", "whole manifest (before)")):
        for key, panel, unit, per in (
                ("manifest_bytes_per_node_per_step", "snapshot metadata written per node per step",
                 "bytes", "per node per step"),
                ("gathered_bytes_rank0_per_step", "commit: bytes gathered on rank 0 per step",
                 "bytes", "rank 0 per step"),
                ("broadcast_bytes_per_rank_per_step", "commit: bytes every rank receives per step",
                 "bytes", "per rank per step"),
                ("commit_s_median", "commit time per snapshot (s)", "s", "per step")):
            x, y = pick(fmt, key)
            series.append({"panel": panel, "label": label, "x": x, "y": y, "unit": unit,
                           "project": unit != "s", "per": per})
    x, y = pick("split", "layout_bytes_per_node_per_plan")
    series.append({"panel": "snapshot metadata written per node per step", "label":
                   "format 4 layout (once per plan)", "x": x, "y": y, "unit": "bytes",
                   "project": True, "per": "per node per plan"})
    headers = ["ranks", "format", "nodes", "manifest B/node/step", "layout B/node/plan",
               "shard index B/rank/step", "gathered B (rank 0)/step", "broadcast B/rank/step",
               "commit s", "plan s"]
    table = [[str(r["world"]), r["format"], str(r["nodes"]),
              f"{r['manifest_bytes_per_node_per_step']:,}",
              f"{r['layout_bytes_per_node_per_plan']:,}" if r["format"].startswith("split") else "-",
              f"{r['index_bytes_per_rank_per_step']:,}", f"{r['gathered_bytes_rank0_per_step']:,}",
              f"{r['broadcast_bytes_per_rank_per_step']:,}", f"{r['commit_s_median']:.3f}",
              f"{r['plan_s']:.2f}"] for r in rows]
    split = {r["world"]: r for r in rows if r["format"].startswith("split")}
    ratio = (split[8]["manifest_bytes_per_node_per_step"] / split[2]["manifest_bytes_per_node_per_step"]
             if 2 in split and 8 in split else None)
    notes = [
        f"Real gloo ranks on this machine, {res['ranks_per_node']} ranks per simulated node (each "
        f"node a node store of its own), an FSDP2 model of {res['layers']} Linear layers of width "
        f"{res['dim']} with AdamW (many small tensors), a snapshot every step, no replicas. Both "
        "formats in the same run: 'whole' writes the whole manifest every step as before issue "
        "24 (the engine's comparison switch), 'split' is format 4.",
        "Per node per step, format 4 writes a step record of constant size; its layout is "
        "written once per plan (reported apart, it grows with the world as DCP's entries do); "
        "each shard's own index (in the shard file's tail, per rank per step) holds the rank's "
        "records in both formats."
        + (f" Written per node with 8 ranks over 2 ranks: {ratio:.3f}x (format 4)." if ratio else ""),
        "The commit gathers each rank's (size, index crc32c) on rank 0: about 50 bytes per rank "
        "per step, O(world) on rank 0 alone; every rank receives a constant-size step record.",
        _OVERSUBSCRIBED,
    ]
    return {"title": "Per-step snapshot metadata against the world size", "params": params,
            "rows": rows, "series": series, "table": {"headers": headers, "rows": table},
            "notes": notes}


def section_restore(args: Any) -> dict[str, Any]:
    worlds = [int(x) for x in args.restore_worlds.split(",") if x]
    res = restore_section(worlds, mb=args.restore_mb)
    return restore_result(res["rows"], {"worlds": worlds, "state_mb": args.restore_mb})


def restore_result(rows: list[dict[str, Any]], params: dict[str, Any]) -> dict[str, Any]:
    """The restore section's series, table and notes from its measured rows."""
    series = [
        {"panel": "restore after a node loss: bytes fetched / bytes read per rank",
         "label": "worst rank", "x": [r["world"] for r in rows],
         "y": [r["fetched_over_read_max"] for r in rows], "unit": "x", "project": True,
         "per": "per rank per failure", "bound": 1.5},
        {"panel": "restore after a node loss: bytes fetched / bytes read per rank",
         "label": "median rank", "x": [r["world"] for r in rows],
         "y": [r["fetched_over_read_median"] for r in rows], "unit": "x", "project": True,
         "per": "per rank per failure", "bound": 1.5},
        {"panel": "restore after a node loss (s)", "label": "slowest rank",
         "x": [r["world"] for r in rows], "y": [r["restore_s_max"] for r in rows], "unit": "s",
         "project": False, "per": "per failure"},
    ]
    headers = ["ranks", "survivors", "state MB", "read B/rank (max)", "fetched B/rank (max)",
               "fetched/read (worst rank)", "fetched/read (median)", "restore s (max)"]
    table = [[str(r["world"]), str(r["survivors"]), f"{r['state_mb']:g}",
              f"{r['read_bytes_per_rank_max']:,}", f"{r['fetched_bytes_per_rank_max']:,}",
              f"{r['fetched_over_read_max']:.3f}", f"{r['fetched_over_read_median']:.3f}",
              f"{r['restore_s_max']:.2f}"] for r in rows]
    notes = [
        "One rank per simulated node, one replica each; a snapshot, then the middle node is lost "
        "and the survivors (world - 1) restore it, resharding; 'fetched/read' is, per rank, "
        "the bytes it received from other nodes over the bytes its load read of the shards it "
        "did not hold (issue 24: byte ranges, not whole chunks). Bound: 1.5x.",
        _OVERSUBSCRIBED]
    return {"title": "Restore traffic after a world change", "params": params, "rows": rows,
            "series": series, "table": {"headers": headers, "rows": table}, "notes": notes}


def section_parity_rebuild(args: Any) -> dict[str, Any]:
    worlds: dict[str, list[int]] = {}
    for part in args.rebuild_worlds.split(";"):
        name, _, sizes = part.partition(":")
        worlds[name] = [int(x) for x in sizes.split(",") if x]
    res = rebuild_section(worlds, mb=args.rebuild_mb)
    return parity_rebuild_result(res["rows"], {"worlds": args.rebuild_worlds,
                                               "state_mb": args.rebuild_mb})


def parity_rebuild_result(rows: list[dict[str, Any]], params: dict[str, Any]) -> dict[str, Any]:
    """The parity_rebuild section's series, table and notes from its measured rows."""
    series = [{"panel": "parity rebuild: bytes the rebuilder receives / shard",
               "label": s.upper(), "x": [r["world"] for r in rows if r["scheme"] == s],
               "y": [r["received_over_shard"] for r in rows if r["scheme"] == s], "unit": "x",
               "project": True, "per": "per rebuild", "bound": 1.5}
              for s in dict.fromkeys(r["scheme"] for r in rows)]
    headers = ["scheme", "ranks", "state MB", "shard B", "rebuilder received B",
               "received / shard", "gather (before) / shard", "restore s (max)"]
    table = [[r["scheme"].upper() + (" 4+2" if r["scheme"] == "rs" else " 5"), str(r["world"]),
              f"{r['state_mb']:g}", f"{r['shard_bytes']:,}", f"{r['rebuilder_received']:,}",
              f"{r['received_over_shard']:.3f}", f"{r['gather_over_shard']:.0f}",
              f"{r['restore_s_max']:.2f}"] for r in rows]
    notes = [
        "One rank per simulated node, in parity groups (XOR of 5, RS 4+2 of 6); a snapshot, the "
        "middle node's store deleted, a replacement node restores the same world and rebuilds "
        "that rank's shard (issue 40): each piece is reduced along a chain of the survivors "
        "holding its parts, so the rebuilder receives the rebuilt bytes once; before, it "
        "gathered every survivor's piece (d = N-k times the bytes: the 'gather (before)' column). Bound: 1.5x.",
        _OVERSUBSCRIBED]
    return {"title": "Parity rebuild traffic", "params": params, "rows": rows, "series": series,
            "table": {"headers": headers, "rows": table}, "notes": notes}


def rebuild_parity_rebuild(sec: dict[str, Any]) -> dict[str, Any]:
    return parity_rebuild_result(sec["rows"], sec["params"])


def rebuild_metadata(sec: dict[str, Any]) -> dict[str, Any]:
    return metadata_result(sec["rows"], sec["params"])


def rebuild_restore(sec: dict[str, Any]) -> dict[str, Any]:
    return restore_result(sec["rows"], sec["params"])
