#!/usr/bin/env python
"""How long a training process's other threads stall while aegis snapshots a large state.

The membership heartbeat is a thread of the training process: when it cannot run for about a
second, its node is declared dead. ``--world`` ranks (gloo, one simulated node each, 1 replica)
train the reference trainer's TinyGPT (``--state-mb`` of params + AdamW moments over all ranks)
and save after each of ``--steps`` steps; a thread in every rank wakes every 20 ms and records
each gap between wake-ups, and ``gc.callbacks`` time the collector's pauses. Printed: the
longest gaps and the phase they fell in (train, the blocking save, the wait for the background
part), per rank.

``--map-populate`` maps node-store files the way aegis did before
``hostmem.map_file``: ``mmap(MAP_POPULATE)``, for the comparison in the same conditions.

    .venv/bin/python bench/stall.py --state-mb 1024
    .venv/bin/python bench/stall.py --state-mb 1024 --map-populate
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys
import tempfile
import threading
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
    trainer_module,
    write_doc,
)

NAME = "stall"


def _old_map_file(fd: int, length: int, *, write: bool, populate: bool) -> Any:
    import mmap

    prot = mmap.PROT_READ | (mmap.PROT_WRITE if write else 0)
    flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
    return mmap.mmap(fd, length, flags=flags, prot=prot)


def _rank(rank: int, world: int, args: argparse.Namespace, store: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    from aegis import Manager, ModelOptimizerState
    from aegis.snapshot import hostmem

    if args.map_populate:
        hostmem.map_file = _old_map_file  # type: ignore[assignment]
    shape = gpt_shape(args.state_mb)
    model, opt, _ = build_gpt(shape, mesh=init_device_mesh("cpu", (world,)))
    data = trainer_module().SyntheticTokens(shape["vocab_size"], shape["seq_len"], seed=0)
    gaps: list[tuple[float, float]] = []
    pauses: list[tuple[float, float]] = []
    stop = threading.Event()
    started: dict[str, float] = {}

    def beat() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            time.sleep(0.02)
            now = time.perf_counter()
            gaps.append((now - last, now))
            last = now

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started["t"] = time.perf_counter()
        elif "t" in started:
            pauses.append((time.perf_counter() - started["t"], time.perf_counter()))

    th = threading.Thread(target=beat, daemon=True)
    th.start()
    gc.callbacks.append(on_gc)
    mgr = Manager("stall", {"model": ModelOptimizerState(model, opt)}, every=1, keep=2, replicas=1,
                  store_dir=f"{store}/node-{rank}", verbose=False)
    marks = []
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        gpt_train_step(model, opt, data, step, args.batch_size, rank, world)
        t1 = time.perf_counter()
        mgr.save(step)
        t2 = time.perf_counter()
        mgr.wait()
        marks.append((step, t0, t1, t2, time.perf_counter()))
    stop.set()
    gc.callbacks.remove(on_gc)
    mgr.close()

    def phase(t: float) -> str:
        for s, t0, t1, t2, t3 in marks:
            for name, a, b in (("train", t0, t1), ("save (blocking)", t1, t2), ("wait", t2, t3)):
                if a <= t <= b:
                    return f"step {s} {name}"
        return "other"

    return {
        "rank": rank,
        "longest_gaps": [(round(g, 3), phase(t)) for g, t in sorted(gaps, reverse=True)[:5]],
        "longest_gc": [(round(g, 3), phase(t)) for g, t in sorted(pauses, reverse=True)[:3]],
        "steps": [{"step": s, "train_s": round(t1 - t0, 3), "save_s": round(t2 - t1, 3),
                   "wait_s": round(t3 - t2, 3)} for s, t0, t1, t2, t3 in marks],
    }


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--state-mb", type=float, default=1024.0)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--map-populate", action="store_true",
                   help="map node-store files with mmap(MAP_POPULATE), as before hostmem.map_file")
    p.add_argument("--out", type=Path, default=RESULTS / f"{NAME}.json")
    args = p.parse_args(argv)
    doc = new_doc(NAME, __file__, argv, args)
    store = tempfile.mkdtemp(prefix="aegis-bench-stall-", dir="/dev/shm")
    try:
        ranks = run_ranks(args.world, _rank, args, store, timeout=1800,
                          rank_env=lambda r: {"AEGIS_NODE_ID": f"node-{r}"})
    finally:
        shutil.rmtree(store, ignore_errors=True)
    doc["ranks"] = ranks
    doc["longest_gap_s"] = max(g for r in ranks for g, _ in r["longest_gaps"])
    for r in ranks:
        print(f"rank {r['rank']}: longest gaps {r['longest_gaps']}; gc {r['longest_gc']}; steps {r['steps']}")
    print(f"longest gap of any rank: {doc['longest_gap_s']:.3f} s"
          + (" (mmap MAP_POPULATE)" if args.map_populate else " (hostmem.map_file)"))
    write_doc(doc, args.out)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
