#!/usr/bin/env python
"""Case 2: training throughput vs snapshot interval, with and without replication and upload.

``--world`` spawned ranks, each a simulated node of its own (``AEGIS_NODE_ID=node-<rank>``, its
own node store directory on tmpfs), train the reference trainer's TinyGPT
(``examples/train_fsdp.py``; fp32 params + AdamW moments = ``--state-mb`` x ``--size`` MB over
all ranks) with FSDP2. In one run, on the same model, each configuration trains ``--steps``
steps and its wall time is measured, slowest rank:

* ``none``: no snapshots, measured before every interval's group and at the end; each
  configuration is compared with the mean of the two baselines around its group
* for every interval in ``--intervals`` (snapshot every N steps):
  ``memory`` (own node store only, ``replicas=0``), ``+replica`` (``replicas=1``) and
  ``+replica+upload`` (``replicas=1`` and a durable tier, uploaded every snapshot:
  ``durable_every=N``; ``file://`` under ``--durable-dir`` by default, because a loopback S3
  server would burn this machine's own cores, which a real object store does not).

Each configuration gets a fresh ``Manager``; its first save (DCP planning, pre-faulting the
slots) is made before the timed window, as it happens once per run. The window ends after the
last snapshot's background work and the queued uploads finished (``wait()``,
``wait_durable()``), so every interval pays for all its snapshots. Upload skips (the Manager
skips an upload while ``durable_max_pending`` are queued) are counted.

    .venv/bin/python bench/throughput.py                    # every 1, 10, 100; 100 steps each
    .venv/bin/python bench/throughput.py --intervals 1,2,5,10,20,50,100 --steps 200
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import (  # noqa: E402 - bench/ is on sys.path as a script
    MB,
    RESULTS,
    build_gpt,
    f,
    gpt_shape,
    gpt_train_step,
    md_table,
    new_doc,
    plt,
    run_ranks,
    size_arg,
    text_table,
    trainer_module,
    write_doc,
)

NAME = "throughput"
MODES = ("memory", "+replica", "+replica+upload")


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2, help="ranks = simulated nodes; default 2")
    p.add_argument("--state-mb", type=float, default=48.0,
                   help="MB of params + AdamW moments over all ranks; default 48")
    size_arg(p)
    p.add_argument("--intervals", default="1,10,100", help="snapshot every N steps; default 1,10,100")
    p.add_argument("--steps", type=int, default=100,
                   help="timed steps per configuration (a multiple of every interval); default 100")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per rank; default 4")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--modes", default=",".join(MODES), help=f"subset of {','.join(MODES)}")
    p.add_argument("--durable-dir", default=None,
                   help="directory of the file:// durable tier (default: a temp dir on disk)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--out", type=Path, default=RESULTS / f"{NAME}.json")
    args = p.parse_args(argv)
    args.intervals = [int(x) for x in args.intervals.split(",") if x]
    args.modes = [m for m in args.modes.split(",") if m]
    if set(args.modes) - set(MODES):
        p.error(f"--modes: choose from {MODES}")
    bad = [i for i in args.intervals if i < 1 or args.steps % i]
    if bad:
        p.error(f"--steps {args.steps} must be a multiple of every interval (not of {bad})")
    import torch

    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda":
        args.world = min(args.world, torch.cuda.device_count())
    return args


def _rank_main(rank: int, world: int, args: argparse.Namespace, shape: dict[str, int],
               stores: str, durable_url: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from aegis import Manager, ModelOptimizerState

    cuda = args.device == "cuda"
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    store_dir = f"{stores}/node-{rank}"  # every rank is a node with a node store of its own
    mesh = init_device_mesh(args.device, (world,))
    model, opt, _ = build_gpt(shape, mesh=mesh)
    data = trainer_module().SyntheticTokens(shape["vocab_size"], shape["seq_len"], seed=0)
    step = 0

    def train(n: int, mgr: Any = None) -> None:
        nonlocal step
        for _ in range(n):
            step += 1
            gpt_train_step(model, opt, data, step, args.batch_size, rank, world, dev)
            if mgr is not None:
                mgr.save(step)

    train(10)  # warm the allocator, the optimizer state and the caches
    out: list[dict[str, Any]] = []

    def timed(name: str, every: int | None, mode: str | None) -> None:
        nonlocal step
        mgr = None
        if every is not None:
            kw: dict[str, Any] = {"replicas": 0 if mode == "memory" else 1}
            if mode == "+replica+upload":
                kw.update(durable=durable_url, durable_every=every)
            job = f"thr-{len(out)}"
            mgr = Manager(job, {"model": ModelOptimizerState(model, opt)}, every=every, keep=1,
                          store_dir=store_dir, verbose=False, **kw)
            step = (step // every + 1) * every
            mgr.save(step)  # planning and pre-faulting: once per run, outside the window
            mgr.wait()
            if mode == "+replica+upload":
                mgr.wait_durable()
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        train(args.steps, mgr)
        if mgr is not None:
            mgr.wait()
            mgr.wait_durable()
        if cuda:
            torch.cuda.synchronize()
        secs = time.perf_counter() - t0
        rec: dict[str, Any] = {"name": name, "every": every, "mode": mode, "seconds": secs}
        if mgr is not None:
            ev = Path(mgr.config.events_root) / f"rank-{rank:05d}.jsonl"
            events = [e for e in map(json.loads, ev.read_text().splitlines()) if e["job"] == job]
            snaps = [e for e in events if e["event"] == "snapshot" and e["step"] > step - args.steps]
            rec["snapshots"] = len(snaps)
            rec["blocking_ms_median"] = (statistics.median(e["blocking_ms"] for e in snaps)
                                         if snaps else None)
            window = [e for e in events if e.get("step", 0) > step - args.steps]
            rec["uploads"] = sum(1 for e in window if e["event"] == "upload" and e["committed"])
            rec["uploads_skipped"] = sum(1 for e in window if e["event"] == "upload_skipped")
            mgr.close()
            shutil.rmtree(Path(store_dir) / job, ignore_errors=True)
        out.append(rec)

    for every in args.intervals:
        # A baseline before every interval and one at the end: each configuration is compared
        # with the runs that bracket it, so a drift of the machine's speed (other jobs, warm-up)
        # does not pass for snapshot cost.
        timed("none", None, None)
        for mode in args.modes:
            timed(f"{mode} every {every}", every, mode)
    timed("none", None, None)
    return {"rank": rank, "runs": out}


def summarize(ranks: list[dict[str, Any]], steps: int) -> list[dict[str, Any]]:
    """Slowest rank per run; each run relative to the mean of the baselines around it."""
    runs = []
    for i, r0 in enumerate(ranks[0]["runs"]):
        secs = max(r["runs"][i]["seconds"] for r in ranks)
        runs.append({**r0, "seconds": secs, "steps_per_s": steps / secs})
    base = [i for i, r in enumerate(runs) if r["every"] is None]
    for i, r in enumerate(runs):
        around = ([i] if r["every"] is None else
                  [max(b for b in base if b < i), min(b for b in base if b > i)])
        r["reference_steps_per_s"] = statistics.mean(runs[b]["steps_per_s"] for b in around)
        r["relative"] = r["steps_per_s"] / r["reference_steps_per_s"]
    return runs


def report(doc: dict[str, Any]) -> str:
    rows = []
    for r in doc["runs"]:
        rows.append([r["name"], f(r["steps_per_s"]), f(r["relative"], ".3f"),
                     str(r.get("snapshots", "-")), f(r.get("blocking_ms_median"), ".1f"),
                     str(r.get("uploads", "-")), str(r.get("uploads_skipped", "-"))])
    return text_table(["configuration", "steps/s", "x none", "snapshots", "blocking ms",
                       "uploads", "skipped"], rows)


def summary_md(doc: dict[str, Any]) -> str:
    runs = doc["runs"]
    intervals = sorted({r["every"] for r in runs if r["every"] is not None})
    modes = [m for m in MODES if any(r["mode"] == m for r in runs)]
    rows = []
    for m in modes:
        cells = []
        for i in intervals:
            r = next((r for r in runs if r["every"] == i and r["mode"] == m), None)
            cells.append(f(r["relative"], ".3f") if r else "-")
        rows.append([m, *cells])
    base = [r["steps_per_s"] for r in runs if r["every"] is None]
    return (md_table(["steps/s relative to no snapshots", *(f"every {i}" for i in intervals)],
                     rows)
            + f"\n\nNo snapshots: {min(base):.2f} to {max(base):.2f} steps/s over "
            f"{len(base)} baseline runs; each configuration is compared with the mean of the "
            "baselines run just before and just after its interval's group.")


def plot(doc: dict[str, Any], path: Path) -> None:
    pyplot = plt()
    fig, ax = pyplot.subplots(figsize=(7, 4.5))
    runs = doc["runs"]
    for m, marker in zip(MODES, "os^", strict=True):
        pts = sorted((r["every"], r["relative"]) for r in runs if r["mode"] == m)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, label=m)
    base = [r["steps_per_s"] for r in runs if r["every"] is None]
    ax.axhline(1.0, color="gray", linestyle="--", linewidth=1, label="no snapshots")
    ax.axhspan(min(base) / max(base), max(base) / min(base), color="gray", alpha=0.12,
               label="spread of the no-snapshot runs")
    ax.set_xscale("log")
    ax.set_xticks(sorted({r["every"] for r in runs if r["every"] is not None}))
    ax.get_xaxis().set_major_formatter(pyplot.matplotlib.ticker.ScalarFormatter())
    ax.set_xlabel("snapshot every N steps")
    ax.set_ylabel("training steps/s relative to no snapshots")
    m = doc["machine"]
    st = doc["model"]
    ax.set_title(f"Throughput vs snapshot interval: {doc['args']['world']} nodes, "
                 f"{st['state_bytes'] / MB:.0f} MB state, {m['device']}, {m['cpu_count']} cores",
                 fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot.close(fig)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parse(argv)
    doc = new_doc(NAME, __file__, argv, args)
    shape = gpt_shape(args.state_mb * args.size, seq=args.seq_len)
    doc["model"] = shape
    stores = tempfile.mkdtemp(prefix="aegis-bench-thr-", dir="/dev/shm")
    durable = Path(args.durable_dir or tempfile.mkdtemp(prefix="aegis-bench-thr-durable-"))
    print(f"{NAME}: {args.world} nodes, TinyGPT {shape['params'] / 1e6:.1f}M params "
          f"({shape['state_bytes'] / MB:.0f} MB state), {args.steps} steps per configuration, "
          f"intervals {args.intervals}, device {args.device}", flush=True)
    try:
        ranks = run_ranks(
            args.world, _rank_main, args, shape, stores, f"file://{durable}",
            timeout=args.timeout, env={"BENCH_DEVICE": args.device},
            rank_env=lambda r: {"AEGIS_NODE_ID": f"node-{r}",
                                "AEGIS_EVENTS_DIR": f"{stores}/events-node-{r}"})
    finally:
        shutil.rmtree(stores, ignore_errors=True)
        if args.durable_dir is None:
            shutil.rmtree(durable, ignore_errors=True)
    doc["durable"] = "file:// on " + ("a temp dir" if args.durable_dir is None else str(durable))
    doc["runs"] = summarize(ranks, args.steps)
    doc["ranks"] = ranks
    print(report(doc))
    write_doc(doc, args.out)
    plot(doc, args.out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
