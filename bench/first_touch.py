#!/usr/bin/env python
"""What writing a restore into fresh memory costs, and what reusing freed memory saves.

Two parts, each in fresh subprocesses, arms alternating ``--repeats`` times:

* ``copy``: a restore's copy of 1 GB (``preadv`` out of a tmpfs file in 1 MiB blocks, crc32c of
  each block, as ``aegis.snapshot.stream_read`` does) into a destination that is ``fresh``
  (``torch.empty``: every page faulted in by the copy), ``populated`` first
  (``madvise(MADV_POPULATE_WRITE)``, timed apart) or ``reused`` (written once before);
* ``restore``: an in-process survivor's restore, modelled: a world-2 snapshot of TinyGPT
  (``--layers`` blocks of dim 768, AdamW) saved by two ranks into one node store, then in one new
  process a round's state freed (1 GB of 4.5 MiB tensors written, then dropped, as a round's
  teardown frees its model), the model and optimizer built and ``Manager.restore()`` at world 1,
  with (``retain``) and without (``plain``) ``hostmem.retain_freed_memory()`` called at the
  start, as ``run_in_process`` does.

    .venv/bin/python bench/first_touch.py
    .venv/bin/python bench/first_touch.py --repeats 5 --layers 24
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

from _common import RESULTS, ROOT, new_doc, write_doc  # noqa: E402 - bench/ is on sys.path

NAME = "first_touch"

COPY = textwrap.dedent("""
    import json, os, sys, time
    import crc32c, torch
    from aegis.snapshot import hostmem
    arm, path = sys.argv[1], sys.argv[2]
    n, block = os.path.getsize(path), 1 << 20
    fd = os.open(path, os.O_RDONLY)
    def load(dst):
        v = memoryview(dst.numpy()).cast("B")
        for off in range(0, n, block):
            os.preadv(fd, [v[off:off + block]], off)
            crc32c.crc32c(v[off:off + block])
    dst = torch.empty(n, dtype=torch.uint8)
    if arm == "reused":
        load(dst)
    t0 = time.perf_counter()
    if arm == "populated":
        hostmem.populate(dst, write=True)
    t1 = time.perf_counter()
    load(dst)
    t2 = time.perf_counter()
    print(json.dumps({"prepare_s": t1 - t0, "copy_s": t2 - t1, "total_s": t2 - t0}))
""")

MODEL = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, os.path.join(sys.argv[1], "examples"))
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from train_fsdp import GPTConfig, build_model, init_weights
    from aegis import Manager, ModelOptimizerState
    LAYERS, STORE = int(sys.argv[2]), sys.argv[3]
    def cfg():
        return GPTConfig(vocab_size=2048, dim=768, n_layers=LAYERS, n_heads=12, seq_len=64)
""")

SAVE = MODEL + textwrap.dedent("""
    def rank_main(rank):
        dist.init_process_group("gloo", rank=rank, world_size=2)
        model = build_model(cfg(), mesh=init_device_mesh("cpu", (2,)), init=False)
        init_weights(model, 0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        model(torch.randint(0, 2048, (1, 64))).float().mean().backward()
        opt.step()
        mgr = Manager("first-touch", {"model": ModelOptimizerState(model, opt)}, store_dir=STORE,
                      verbose=False)
        mgr.save(1)
        mgr.close()
        dist.destroy_process_group()
    if __name__ == "__main__":
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[4], AEGIS_NODE_ID="n0")
        import multiprocessing as mp
        ps = [mp.get_context("fork").Process(target=rank_main, args=(r,)) for r in range(2)]
        [p.start() for p in ps]
        [p.join() for p in ps]
        assert all(p.exitcode == 0 for p in ps), [p.exitcode for p in ps]
        print("{}")
""")

RESTORE = MODEL + textwrap.dedent("""
    import json, time
    from aegis.snapshot import hostmem
    arm = sys.argv[5]
    applied = hostmem.retain_freed_memory() if arm == "retain" else None
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[4], AEGIS_NODE_ID="n0")
    dist.init_process_group("gloo", rank=0, world_size=1)
    old = [torch.ones(1179648) for _ in range(228)]  # the ended round's state: 1 GB, freed
    del old
    t0 = time.perf_counter()
    model = build_model(cfg(), mesh=init_device_mesh("cpu", (1,)), init=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    mgr = Manager("first-touch", {"model": ModelOptimizerState(model, opt)}, store_dir=STORE,
                  verbose=False)
    t1 = time.perf_counter()
    step = mgr.restore()
    t2 = time.perf_counter()
    assert step == 1, step
    print(json.dumps({"applied": applied, "build_s": t1 - t0, "restore_s": t2 - t1,
                      "timings": mgr.last_restore.timings}))
    mgr.close()
""")


def _run(code: str, *argv: str, timeout: float) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                         timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1",
                                               "PYTHONWARNINGS": "ignore"}, cwd=ROOT)
    if out.returncode != 0:
        raise RuntimeError(f"exit {out.returncode}: {out.stderr[-2000:]}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def _summary(rows: list[dict[str, Any]], key: str) -> dict[str, Any]:
    vals = [r[key] for r in rows]
    return {"median_s": statistics.median(vals), "min_s": min(vals), "max_s": max(vals),
            "runs_s": vals}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--layers", type=int, default=24, help="TinyGPT blocks (24: 2 GB of state)")
    p.add_argument("--parts", default="copy,restore")
    p.add_argument("--work-dir", type=Path, default=Path("/dev/shm/aegis-first-touch"))
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--out", type=Path, default=RESULTS / f"{NAME}.json")
    args = p.parse_args(argv)
    doc = new_doc(NAME, __file__, argv, args)
    parts = args.parts.split(",")
    shutil.rmtree(args.work_dir, ignore_errors=True)
    args.work_dir.mkdir(parents=True)
    try:
        if "copy" in parts:
            src = args.work_dir / "src"
            with open(src, "wb") as f:
                block = os.urandom(1 << 20)
                for _ in range(1024):
                    f.write(block)
            runs: dict[str, list[dict[str, Any]]] = {}
            for _ in range(args.repeats):
                for arm in ("fresh", "populated", "reused"):
                    runs.setdefault(arm, []).append(_run(COPY, arm, str(src), timeout=args.timeout))
            doc["copy_1gb"] = {arm: {"total": _summary(rows, "total_s"),
                                     "prepare": _summary(rows, "prepare_s"),
                                     "copy": _summary(rows, "copy_s")} for arm, rows in runs.items()}
            src.unlink()
        if "restore" in parts:
            store = str(args.work_dir / "store")
            _run(SAVE, str(ROOT), str(args.layers), store, "29631", timeout=args.timeout)
            rruns: dict[str, list[dict[str, Any]]] = {}
            for _ in range(args.repeats):
                for arm in ("plain", "retain"):
                    r = _run(RESTORE, str(ROOT), str(args.layers), store, "29632", arm,
                             timeout=args.timeout)
                    r["load_s"] = r["timings"]["load_s"]
                    rruns.setdefault(arm, []).append(r)
            doc["restore_world1"] = {arm: {"restore": _summary(rows, "restore_s"),
                                           "load": _summary(rows, "load_s"),
                                           "applied": [r["applied"] for r in rows],
                                           "runs": rows} for arm, rows in rruns.items()}
    finally:
        shutil.rmtree(args.work_dir, ignore_errors=True)
    for key in ("copy_1gb", "restore_world1"):
        for arm, v in doc.get(key, {}).items():
            main_key = "total" if key == "copy_1gb" else "restore"
            extra = (f"  (copy {v['copy']['median_s']:.3f}, prepare {v['prepare']['median_s']:.3f})"
                     if key == "copy_1gb" else f"  (load {v['load']['median_s']:.3f})")
            print(f"{key:15s} {arm:10s} median {v[main_key]['median_s']:.3f} s  "
                  f"min {v[main_key]['min_s']:.3f}  max {v[main_key]['max_s']:.3f}{extra}")
    write_doc(doc, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
