#!/usr/bin/env python
"""Case 1: how long a snapshot blocks training, across state sizes: aegis vs ``dcp.save`` vs
``dcp.async_save`` (thread and process modes) vs the memcpy floor, side by side in one run.

Spawns ``--world`` ranks (separate processes, a real gloo group on loopback). For every size in
``--sizes-mib`` (MiB of params + exp_avg + exp_avg_sq per rank, times ``--size``) every rank
builds an FSDP2 model (a stack of ``Linear`` layers, ``fully_shard`` per layer and at the root)
and its AdamW optimizer after a real step, and times, per rank, on that same state:

==================  ==========================================================================
floor               copy of every local tensor shard into one preallocated, pre-touched buffer
                    (on CUDA: device-to-host into pinned memory): the copy a snapshot cannot avoid
aegis               ``Manager.save(step)`` until it returns (its ``get_state_dict``, the copy into
                    the node store); its background part (crc32c, index, commit) is reported too
dcp_save            ``get_state_dict`` + ``dcp.save`` into a directory (tmpfs by default)
dcp_async_thread    ``get_state_dict`` + ``dcp.async_save(..., THREAD)`` until it returns
dcp_async_process   the same with ``AsyncCheckpointerType.PROCESS`` (a checkpoint daemon process
                    per rank, its own gloo group; started in the warm-up repetition)
==================  ==========================================================================

For the async modes the time until the checkpoint is complete (``future.result()``) is recorded
as ``*_total``. Each case runs 1 warm-up + ``--repeats`` timed repetitions, each after an
untimed training step (forward, backward, ``optimizer.step``); background work of one save
finishes before the next begins. Per repetition the slowest rank counts (it blocks training);
tables show the median over repetitions. A case that fails (e.g. a mode this torch or device
does not support) is reported as not available, with its error.

    .venv/bin/python bench/snapshot_overhead.py                 # 8, 32, 128 MiB per rank
    .venv/bin/python bench/snapshot_overhead.py --size 4        # 32, 128, 512 MiB per rank
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _common import (  # noqa: E402 - bench/ is on sys.path as a script
    RESULTS,
    aligned_nbytes,
    aligned_views,
    f,
    md_table,
    new_doc,
    plt,
    run_ranks,
    size_arg,
    text_table,
    write_doc,
)

NAME = "snapshot_overhead"
CASES = ("floor", "aegis", "dcp_save", "dcp_async_thread", "dcp_async_process")
LABELS = {
    "floor": "memcpy floor",
    "aegis": "aegis save()",
    "dcp_save": "dcp.save (dir)",
    "dcp_async_thread": "dcp.async_save thread",
    "dcp_async_process": "dcp.async_save process",
}


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2, help="ranks (processes); default 2")
    p.add_argument("--sizes-mib", default="8,32,128",
                   help="MiB of params + exp_avg + exp_avg_sq per rank; default 8,32,128")
    size_arg(p)
    p.add_argument("--dim", type=int, default=1024, help="Linear width; default 1024")
    p.add_argument("--batch", type=int, default=8, help="training batch rows; default 8")
    p.add_argument("--repeats", type=int, default=3, help="timed repetitions per case")
    p.add_argument("--warmup", type=int, default=1, help="untimed repetitions first")
    p.add_argument("--cases", default=",".join(CASES), help=f"subset of {','.join(CASES)}")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: cuda when available (then 1 rank per GPU)")
    p.add_argument("--work-dir", default="/dev/shm",
                   help="parent of the aegis store and DCP directories (default /dev/shm, a "
                   "tmpfs, so that disk speed does not dominate DCP)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds for the whole run")
    p.add_argument("--out", type=Path, default=RESULTS / f"{NAME}.json")
    args = p.parse_args(argv)
    args.cases = [c for c in args.cases.split(",") if c]
    if set(args.cases) - set(CASES):
        p.error(f"--cases: choose from {CASES}")
    args.sizes = [float(x) * args.size for x in args.sizes_mib.split(",") if x]
    import torch

    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda":
        args.world = min(args.world, torch.cuda.device_count())  # NCCL: one rank per GPU
    if args.dim % args.world:
        p.error(f"--dim {args.dim} must be divisible by --world {args.world} (even shards)")
    return args


# -- one rank --------------------------------------------------------------------------------


def _local_tensors(sd: Any) -> list[Any]:
    """Every tensor of a nested state dict, DTensors as their local shard."""
    import torch
    from torch.distributed.tensor import DTensor

    out: list[Any] = []

    def walk(v: Any) -> None:
        if isinstance(v, DTensor):
            out.append(v.to_local())
        elif isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)

    walk(sd)
    return out


def _one_size(rank: int, world: int, args: argparse.Namespace, mib: float, root: Path
              ) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch import nn
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import aegis

    cuda = args.device == "cuda"
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    dim = args.dim
    per_layer = 3 * 4 * (dim * dim + dim) // world  # params + exp_avg + exp_avg_sq, fp32
    n_layers = max(1, math.ceil(mib * 2**20 / per_layer))
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(dim, dim), nn.Tanh())
                            for _ in range(n_layers))).to(dev)
    mesh = init_device_mesh(args.device, (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    gen = torch.Generator(device=dev).manual_seed(1234 + rank)

    def train_step() -> None:
        x = torch.randn(args.batch, dim, generator=gen, device=dev)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    train_step()  # optimizer state exists from here on
    tensors = _local_tensors(get_state_dict(model, opt))
    state_bytes = sum(t.numel() * t.element_size() for t in tensors)
    raw: dict[str, list[float]] = {}
    errors: dict[str, str] = {}
    extra: dict[str, Any] = {}
    step = 0

    def run(case: str, fn: Callable[[int], dict[str, float]]) -> None:
        nonlocal step
        for i in range(args.warmup + args.repeats):
            train_step()
            step += 1
            sync()
            dist.barrier()
            try:
                m, err = fn(step), ""
            except Exception as e:  # noqa: BLE001 - agreed on below, reported as not available
                m, err = {}, f"{type(e).__name__}: {e}"
            # Every rank learns whether any failed, so none waits in a collective of a dead case.
            flag = torch.tensor([1 if err else 0])
            dist.all_reduce(flag)
            if int(flag):
                errors[case] = err or "failed on another rank"
                for k in [k for k in raw if k.startswith(case)]:
                    del raw[k]
                return
            dist.barrier()
            if i >= args.warmup:
                for k, v in m.items():
                    raw.setdefault(k, []).append(v)

    if "floor" in args.cases:
        buf = torch.zeros(aligned_nbytes(tensors), dtype=torch.uint8, pin_memory=cuda)
        views = aligned_views(buf, tensors)

        def floor(_: int) -> dict[str, float]:
            src = _local_tensors(get_state_dict(model, opt))
            t0 = time.perf_counter()
            with torch.no_grad():
                for dst, s in zip(views, src, strict=True):
                    dst.copy_(s, non_blocking=cuda)
            sync()
            return {"floor": time.perf_counter() - t0}

        run("floor", floor)
        del buf, views

    if "aegis" in args.cases:
        store_dir = root / f"aegis-{mib:g}"
        mgr = aegis.Manager("bench", {"model": aegis.ModelOptimizerState(model, opt)}, every=1,
                            keep=1, replicas=0, store_dir=str(store_dir), verbose=False)
        results: list[dict[str, float]] = []

        def aegis_save(s: int) -> dict[str, float]:
            t0 = time.perf_counter()
            mgr.save(s)
            blocking = time.perf_counter() - t0
            r = mgr.wait()
            assert r is not None and r.committed, r
            results.append({"copy_s": r.copy_s, "plan_s": r.plan_s, "blocking_s": r.blocking_s,
                            "staging_gbps": r.staging_gbps})
            return {"aegis": blocking, "aegis_background": r.background_s,
                    "aegis_copy": r.copy_s}

        run("aegis", aegis_save)
        extra["aegis_results"] = results
        # The benchmark would be worthless if the snapshot were wrong: restore the last one
        # into a fresh Manager, bit for bit.
        last = step
        p = next(model.parameters())
        ref = p.to_local().detach().clone()
        mgr.close()
        train_step()  # move the live state away from the snapshot
        mgr2 = aegis.Manager("bench", {"model": aegis.ModelOptimizerState(model, opt)}, every=1,
                             keep=1, replicas=0, store_dir=str(store_dir), verbose=False)
        restored = mgr2.restore()
        extra["restore_check"] = {"step_saved": last, "step_restored": restored,
                                  "param_equal": bool(torch.equal(p.to_local(), ref))}
        mgr2.close()
        dist.barrier()
        if rank == 0:
            shutil.rmtree(store_dir, ignore_errors=True)

    if "dcp_save" in args.cases:
        def dcp_save(s: int) -> dict[str, float]:
            ckpt = root / "dcp" / f"save-{s:08d}"
            t0 = time.perf_counter()
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt)
            t = time.perf_counter() - t0
            dist.barrier()
            if rank == 0:
                shutil.rmtree(ckpt)
            return {"dcp_save": t}

        run("dcp_save", dcp_save)

    for case, kind in (("dcp_async_thread", AsyncCheckpointerType.THREAD),
                       ("dcp_async_process", AsyncCheckpointerType.PROCESS)):
        if case not in args.cases:
            continue
        async_pg = dist.new_group(backend="gloo")  # the checkpoint's collectives off the main PG

        def dcp_async(s: int, case: str = case, kind: Any = kind, pg: Any = async_pg
                      ) -> dict[str, float]:
            ckpt = root / "dcp" / f"{case}-{s:08d}"
            t0 = time.perf_counter()
            msd, osd = get_state_dict(model, opt)
            fut = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=ckpt,
                                 process_group=pg, async_checkpointer_type=kind)
            t1 = time.perf_counter()
            getattr(fut, "upload_completion", fut).result()
            t2 = time.perf_counter()
            dist.barrier()
            if rank == 0:
                shutil.rmtree(ckpt)
            return {case: t1 - t0, f"{case}_total": t2 - t0}

        run(case, dcp_async)
        dist.destroy_process_group(async_pg)

    return {"mib_target": mib, "state_bytes": state_bytes, "n_tensors": len(tensors),
            "n_layers": n_layers, "raw_s": raw, "errors": errors, **extra}


def _rank_main(rank: int, world: int, args: argparse.Namespace, root: str) -> list[dict[str, Any]]:
    out = []
    for mib in args.sizes:
        out.append(_one_size(rank, world, args, mib, Path(root)))
        gc.collect()  # the previous size's model and closures, before the next one is built
    return out


# -- results ---------------------------------------------------------------------------------


def summarize(ranks: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per size: per key, per repetition the slowest rank; median and min over repetitions."""
    out = []
    for i, r0 in enumerate(ranks[0]):
        per_size = [r[i] for r in ranks]
        cases: dict[str, Any] = {}
        for key in r0["raw_s"]:
            per_rep = [max(v) for v in zip(*(r["raw_s"][key] for r in per_size), strict=True)]
            cases[key] = {"median_ms": statistics.median(per_rep) * 1e3,
                          "min_ms": min(per_rep) * 1e3, "per_rep_ms": [v * 1e3 for v in per_rep]}
        floor = cases.get("floor", {}).get("median_ms")
        for v in cases.values():
            v["x_floor"] = v["median_ms"] / floor if floor else None
        errors = {}
        for r in per_size:
            for k, v in r["errors"].items():
                if v != "failed on another rank" or k not in errors:
                    errors[k] = v
        out.append({"mib_target": r0["mib_target"],
                    "state_bytes_per_rank": max(r["state_bytes"] for r in per_size),
                    "n_layers": r0["n_layers"], "cases": cases, "not_available": errors,
                    "restore_check": [r.get("restore_check") for r in per_size]})
    return out


def _cell(size: dict[str, Any], key: str) -> str:
    c = size["cases"].get(key)
    if c is None:
        return "n/a" if key.split("_total")[0] in size["not_available"] else "-"
    return f"{c['median_ms']:.1f}"


def report(doc: dict[str, Any]) -> str:
    sizes = doc["sizes"]
    headers = ["case (median ms, slowest rank)",
               *(f"{s['state_bytes_per_rank'] / 2**20:.0f} MiB/rank" for s in sizes), "x floor"]
    rows = []
    for key in ("floor", "aegis", "aegis_background", "dcp_save", "dcp_async_thread",
                "dcp_async_thread_total", "dcp_async_process", "dcp_async_process_total"):
        label = LABELS.get(key) or (LABELS[key.removesuffix("_total")] + " (until complete)"
                                    if key.endswith("_total") else "aegis background")
        xf = sizes[-1]["cases"].get(key, {}).get("x_floor")
        rows.append([label, *(_cell(s, key) for s in sizes), f(xf)])
    lines = [text_table(headers, rows)]
    for s in sizes:
        for k, v in s["not_available"].items():
            lines.append(f"not available at {s['mib_target']:g} MiB: {k}: {v.splitlines()[0]}")
    return "\n".join(lines)


def summary_md(doc: dict[str, Any]) -> str:
    sizes = doc["sizes"]
    big = sizes[-1]
    headers = ["snapshot blocking, ms (slowest rank, median)",
               *(f"{s['state_bytes_per_rank'] / 2**20:.0f} MiB/rank" for s in sizes),
               f"x floor at {big['state_bytes_per_rank'] / 2**20:.0f} MiB"]
    rows = []
    for key in ("floor", "aegis", "dcp_save", "dcp_async_thread", "dcp_async_process"):
        xf = big["cases"].get(key, {}).get("x_floor")
        rows.append([LABELS[key], *(_cell(s, key) for s in sizes),
                     f(xf) if xf is not None else "n/a"])
    notes = sorted({f"{LABELS[k]}: {v.splitlines()[0][:160]}" for s in sizes
                    for k, v in s["not_available"].items()})
    out = md_table(headers, rows)
    if notes:
        out += "\n\nNot available: " + "; ".join(notes)
    return out


def plot(doc: dict[str, Any], path: Path) -> None:
    pyplot = plt()
    fig, ax = pyplot.subplots(figsize=(7, 4.5))
    sizes = doc["sizes"]
    for key, marker in zip(CASES, "o^sDv", strict=True):
        pts = [(s["state_bytes_per_rank"], s["cases"][key]["median_ms"]) for s in sizes
               if key in s["cases"]]
        if pts:
            ax.plot([p[0] / 2**20 for p in pts], [p[1] for p in pts], marker=marker,
                    label=LABELS[key], linestyle="--" if key == "floor" else "-")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks([s["state_bytes_per_rank"] / 2**20 for s in sizes])
    ax.set_xticklabels([f"{s['state_bytes_per_rank'] / 2**20:.0f}" for s in sizes])
    ax.minorticks_off()
    ax.set_xlabel("state per rank (MiB: params + AdamW moments)")
    ax.set_ylabel("training blocked per snapshot (ms, slowest rank)")
    m = doc["machine"]
    ax.set_title(f"Snapshot blocking time, {doc['args']['world']} ranks, {m['device']}, "
                 f"{m['cpu_count']} cores", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot.close(fig)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parse(argv)
    doc = new_doc(NAME, __file__, argv, args)
    root = tempfile.mkdtemp(prefix=f"aegis-bench-{uuid.uuid4().hex[:6]}-", dir=args.work_dir)
    doc["work_dir_is_tmpfs"] = root.startswith("/dev/shm")
    print(f"{NAME}: {args.world} ranks, {', '.join(f'{s:g}' for s in args.sizes)} MiB per rank, "
          f"{args.repeats} repeats after {args.warmup} warm-up, device {args.device}", flush=True)
    env = {"BENCH_DEVICE": args.device}
    try:
        ranks = run_ranks(args.world, _rank_main, args, root, timeout=args.timeout, env=env)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    doc["sizes"] = summarize(ranks)
    doc["ranks"] = ranks
    print(report(doc))
    bad = [c for s in doc["sizes"] for c in s["restore_check"]
           if c and not (c["param_equal"] and c["step_restored"] == c["step_saved"])]
    if bad:
        doc["errors"]["restore_check"] = f"aegis snapshot did not restore bit for bit: {bad}"
        print(f"ERROR: {doc['errors']['restore_check']}")
    write_doc(doc, args.out)
    plot(doc, args.out.with_suffix(".png"))
    return 1 if bad else 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
