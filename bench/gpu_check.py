#!/usr/bin/env python
"""GPU checks, end to end in a few minutes, for when a CUDA device is present (on a machine
without one it says so and exits 0).

1. **staging**: a model's state on the GPU (params + AdamW moments, ``--mb`` MB) copied
   device-to-host into three kinds of host memory, timed with CUDA events (and the host time the
   copy loop blocked): pageable (``torch.empty``), pinned (``pin_memory=True``), and a node-store
   slot (a pre-faulted ``MAP_SHARED`` mapping of a tmpfs file) registered with
   ``cudaHostRegister`` - the memory an aegis snapshot lands in.
2. **overlap**: training steps (forward, backward, AdamW step) with a snapshot after every step:
   none; the copy into pinned memory on the compute stream; and the copy on a side stream
   (``torch.cuda.Stream``) that waits for the optimizer step's event while the next step's
   forward and backward run, the next optimizer step waiting for the copy's event. The staged
   bytes are checked against the live state at the end.
3. **aegis as it is**: ``Manager.save()`` blocking time on the same state (world 1, FSDP2,
   ``cpu:gloo,cuda:nccl``), next to the pinned floor, and a bitwise restore check.
4. **the case scripts on CUDA** (unless ``--no-scripts``): ``snapshot_overhead.py`` and
   ``throughput.py`` with ``--device cuda``, written apart as ``*_cuda.json`` / ``*_cuda.png``.

Results: ``bench/results/gpu_check.json`` (machine, command, load, every timing).

    .venv/bin/python bench/gpu_check.py
    .venv/bin/python bench/gpu_check.py --mb 2048 --no-scripts
"""

from __future__ import annotations

import argparse
import contextlib
import math
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from _common import (  # noqa: E402 - bench/ is on sys.path as a script
    MB,
    RESULTS,
    aligned_nbytes,
    aligned_views,
    f,
    free_port,
    md_table,
    new_doc,
    python,
    text_table,
    write_doc,
)

NAME = "gpu_check"


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=float, default=1024.0,
                   help="MB of params + AdamW moments on the GPU; default 1024")
    p.add_argument("--dim", type=int, default=4096, help="Linear width; default 4096")
    p.add_argument("--batch", type=int, default=64, help="rows per step; default 64")
    p.add_argument("--steps", type=int, default=20, help="timed steps per overlap mode")
    p.add_argument("--repeats", type=int, default=5, help="timed copies per staging kind")
    p.add_argument("--no-scripts", action="store_true", help="skip part 4")
    p.add_argument("--out", type=Path, default=RESULTS / f"{NAME}.json")
    return p.parse_args(argv)


class _Slot:
    """A node-store-like slot: a tmpfs file, pre-faulted, mapped MAP_SHARED, registered with
    CUDA (``cudaHostRegister``) so device-to-host copies into it run at pinned speed."""

    def __init__(self, path: Path, nbytes: int) -> None:
        import torch

        self.path = path
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            os.posix_fallocate(fd, 0, nbytes)
            self.mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                                prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.tensor = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.tensor.zero_()
        self.registered = False
        rc = int(torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), nbytes, 0))
        if rc != 0:
            raise RuntimeError(f"cudaHostRegister of {nbytes} bytes at {path} failed: cudaError {rc}")
        self.registered = True

    def close(self) -> None:
        import torch

        if self.registered:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self.registered = False
        del self.tensor
        with contextlib.suppress(BufferError):  # a view still alive: the mapping goes with it
            self.mm.close()
        self.path.unlink(missing_ok=True)


def _state(args: argparse.Namespace) -> tuple[Any, Any, Any, list[Any]]:
    import torch
    from torch import nn

    dim = args.dim
    per_layer = 12 * (dim * dim + dim)  # fp32 params + exp_avg + exp_avg_sq
    layers = max(1, math.ceil(args.mb * MB / per_layer))
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(dim, dim), nn.GELU())
                            for _ in range(layers))).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(args.batch, dim, device="cuda")

    def fwd_bwd() -> None:
        model(x).square().mean().backward()

    fwd_bwd()
    opt.step()
    opt.zero_grad(set_to_none=True)
    tensors = [t for p in model.parameters()
               for t in (p, opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"])]
    return model, opt, fwd_bwd, tensors


def staging(args: argparse.Namespace, tensors: list[Any], tmp: Path) -> dict[str, Any]:
    import torch

    nbytes = aligned_nbytes(tensors)
    out: dict[str, Any] = {}
    kinds: list[tuple[str, Any]] = [
        ("pageable", lambda: torch.zeros(nbytes, dtype=torch.uint8)),
        ("pinned", lambda: torch.zeros(nbytes, dtype=torch.uint8, pin_memory=True)),
        ("registered tmpfs slot", lambda: _Slot(tmp / "slot", nbytes)),
    ]
    for name, make in kinds:
        try:
            buf = make()
        except Exception as e:  # noqa: BLE001 - reported as not available
            out[name] = {"error": f"{type(e).__name__}: {e}"}
            continue
        host = buf.tensor if isinstance(buf, _Slot) else buf
        views = aligned_views(host, tensors)
        gpu_s, host_s = [], []
        for i in range(args.repeats + 1):
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            start.record()
            for v, t in zip(views, tensors, strict=True):
                v.copy_(t, non_blocking=True)
            end.record()
            t1 = time.perf_counter()
            end.synchronize()
            if i:
                gpu_s.append(start.elapsed_time(end) / 1e3)
                host_s.append(t1 - t0)
        ok = all(torch.equal(v, t.cpu()) for v, t in zip(views[:3], tensors[:3], strict=True))
        med = statistics.median(gpu_s)
        out[name] = {"gpu_s_median": med, "gbps": nbytes / med / 1e9,
                     "host_blocked_s_median": statistics.median(host_s), "copy_equal": ok}
        del views, host
        if isinstance(buf, _Slot):
            buf.close()
        del buf
    out["bytes"] = nbytes
    return out


def overlap(args: argparse.Namespace, model: Any, opt: Any, fwd_bwd: Any, tensors: list[Any]
            ) -> dict[str, Any]:
    import torch

    buf = torch.zeros(aligned_nbytes(tensors), dtype=torch.uint8, pin_memory=True)
    views = aligned_views(buf, tensors)
    side = torch.cuda.Stream()
    res: dict[str, Any] = {}

    def copy_all() -> None:
        for v, t in zip(views, tensors, strict=True):
            v.copy_(t, non_blocking=True)

    for mode in ("none", "compute stream", "side stream", "none (again)"):
        ev_copy: Any = None
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        for _ in range(args.steps):
            fwd_bwd()
            if ev_copy is not None:
                # the optimizer may only overwrite the state once the snapshot has read it
                torch.cuda.current_stream().wait_event(ev_copy)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if mode == "compute stream":
                copy_all()
            elif mode == "side stream":
                ev_step = torch.cuda.Event()
                ev_step.record()
                side.wait_event(ev_step)
                with torch.cuda.stream(side):
                    copy_all()
                    ev_copy = torch.cuda.Event()
                    ev_copy.record()
        end.record()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        res[mode] = {"ms_per_step": start.elapsed_time(end) / args.steps,
                     "wall_ms_per_step": wall * 1e3 / args.steps}
        if not mode.startswith("none"):
            # the staged bytes are the state after the last optimizer step, bit for bit
            res[mode]["staged_equal"] = all(torch.equal(v, t.cpu())
                                            for v, t in zip(views, tensors, strict=True))
    base = statistics.mean(res[m]["ms_per_step"] for m in ("none", "none (again)"))
    for m in ("compute stream", "side stream"):
        res[m]["overhead_ms"] = res[m]["ms_per_step"] - base
    res["baseline_ms_per_step"] = base
    return res


def aegis_save(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """Manager.save() on the GPU state as the library does it today (world 1, FSDP2)."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import aegis

    store = dist.TCPStore("127.0.0.1", free_port(), 1, True, timeout=timedelta(seconds=60))
    dist.init_process_group("cpu:gloo,cuda:nccl", store=store, rank=0, world_size=1)
    try:
        dim = args.dim
        layers = max(1, math.ceil(args.mb * MB / (12 * (dim * dim + dim))))
        torch.manual_seed(0)
        model = nn.Sequential(*(nn.Sequential(nn.Linear(dim, dim), nn.GELU())
                                for _ in range(layers))).cuda()
        mesh = init_device_mesh("cuda", (1,))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        x = torch.randn(args.batch, dim, device="cuda")

        def step() -> None:
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        step()
        mgr = aegis.Manager("gpu-check", {"model": aegis.ModelOptimizerState(model, opt)},
                            every=1, keep=1, replicas=0, store_dir=str(tmp / "store"),
                            verbose=False)
        blocking, copy, gbps = [], [], []
        for s in range(1, args.repeats + 2):
            step()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            mgr.save(s)
            t = time.perf_counter() - t0
            r = mgr.wait()
            if s > 1:  # the first save plans and pre-faults
                blocking.append(t)
                copy.append(r.copy_s)
                gbps.append(r.staging_gbps)
        last = args.repeats + 1
        p = next(model.parameters())
        ref = p.to_local().detach().clone()
        mgr.close()
        step()
        mgr2 = aegis.Manager("gpu-check", {"model": aegis.ModelOptimizerState(model, opt)},
                             every=1, keep=1, replicas=0, store_dir=str(tmp / "store"),
                             verbose=False)
        restored = mgr2.restore()
        ok = restored == last and bool(torch.equal(p.to_local(), ref))
        mgr2.close()
        return {"blocking_s_median": statistics.median(blocking),
                "copy_s_median": statistics.median(copy),
                "staging_gbps_median": statistics.median(gbps), "restore_bitwise": ok}
    finally:
        dist.destroy_process_group()


def run_scripts(out_dir: Path) -> dict[str, Any]:
    """The case scripts themselves on CUDA, results apart (``*_cuda.json``)."""
    res = {}
    for name, extra in (("snapshot_overhead", ["--sizes-mib", "64,256,1024"]),
                        ("throughput", ["--steps", "100", "--state-mb", "400"])):
        out = out_dir / f"{name}_cuda.json"
        cmd = [python(), f"bench/{name}.py", "--device", "cuda", *extra, "--out", str(out)]
        t0 = time.time()
        p = subprocess.run(cmd, cwd=Path(__file__).resolve().parent.parent, capture_output=True,
                           text=True, timeout=300, check=False)
        print(p.stdout[-3000:])
        res[name] = {"command": " ".join(cmd), "exit_code": p.returncode,
                     "wall_s": time.time() - t0, "stderr_tail": p.stderr[-2000:]}
    return res


def summary_md(doc: dict[str, Any]) -> str:
    st, ov, ae = doc["staging"], doc["overlap"], doc.get("aegis", {})
    rows = [[k, f(v.get("gbps"), ".1f"), f(v.get("gpu_s_median", 0) * 1e3, ".1f"),
             f(v.get("host_blocked_s_median", 0) * 1e3, ".1f")] if "error" not in v
            else [k, "n/a", "n/a", v["error"][:80]]
            for k, v in st.items() if k != "bytes"]
    if "blocking_s_median" in ae:
        rows.append(["aegis Manager.save() today", f(ae["staging_gbps_median"], ".1f"),
                     f(ae["copy_s_median"] * 1e3, ".1f"), f(ae["blocking_s_median"] * 1e3, ".1f")])
    out = md_table([f"GPU: D2H of {st['bytes'] / MB:.0f} MB", "GB/s", "copy ms",
                    "host blocked ms"], rows)
    out += "\n\n" + md_table(
        ["snapshot every step", "ms/step", "overhead ms", "staged bytes equal"],
        [[m, f(ov[m]["ms_per_step"], ".1f"), f(ov[m].get("overhead_ms"), ".1f"),
          str(ov[m].get("staged_equal", "-"))] for m in ("none", "compute stream", "side stream")])
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parse(argv)
    import torch

    if not torch.cuda.is_available():
        print(f"{NAME}: no CUDA device here (torch {torch.__version__}, built with CUDA "
              f"{torch.version.cuda}); nothing to check. Run it on a machine with a GPU.")
        return 0
    doc = new_doc(NAME, __file__, argv, args)
    tmp = Path(tempfile.mkdtemp(prefix="aegis-gpu-check-", dir="/dev/shm"))
    try:
        model, opt, fwd_bwd, tensors = _state(args)
        print(f"{NAME}: {torch.cuda.get_device_name()}, {aligned_nbytes(tensors) / MB:.0f} MB of state",
              flush=True)
        doc["staging"] = staging(args, tensors, tmp)
        print(text_table(["staging", "GB/s", "GPU ms", "host blocked ms"],
                         [[k, f(v.get("gbps"), ".1f"), f(v.get("gpu_s_median", 0) * 1e3, ".1f"),
                           f(v.get("host_blocked_s_median", 0) * 1e3, ".1f")]
                          for k, v in doc["staging"].items() if k != "bytes"]), flush=True)
        doc["overlap"] = overlap(args, model, opt, fwd_bwd, tensors)
        print(text_table(["snapshot every step", "ms/step", "overhead ms", "staged equal"],
                         [[m, f(v["ms_per_step"], ".2f"), f(v.get("overhead_ms"), ".2f"),
                           str(v.get("staged_equal", "-"))]
                          for m, v in doc["overlap"].items() if isinstance(v, dict)]), flush=True)
        del model, opt, fwd_bwd, tensors
        torch.cuda.empty_cache()
        try:
            doc["aegis"] = aegis_save(args, tmp)
            print(f"aegis Manager.save() on CUDA: {doc['aegis']}", flush=True)
        except Exception as e:  # noqa: BLE001 - reported; the other parts still count
            doc["errors"]["aegis"] = f"{type(e).__name__}: {e}"
        if not args.no_scripts:
            doc["scripts"] = run_scripts(args.out.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    bad = [m for m in ("compute stream", "side stream")
           if not doc.get("overlap", {}).get(m, {}).get("staged_equal", False)]
    if bad:
        doc["errors"]["overlap"] = f"staged bytes differ from the state: {bad}"
    print(summary_md(doc))
    write_doc(doc, args.out)
    return 1 if doc["errors"] else 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
