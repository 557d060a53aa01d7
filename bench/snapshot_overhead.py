#!/usr/bin/env python
"""How long a snapshot blocks training: aegis vs. a plain memcpy vs. DCP save / async_save.

Spawns ``--world`` ranks (separate processes, a real gloo group on loopback). Every rank holds
an FSDP2 model (a stack of ``Linear`` layers, ``fully_shard`` per layer and at the root) and
its AdamW optimizer after a real step, sized so that the rank's local params + exp_avg +
exp_avg_sq are at least ``--mb-per-rank`` MiB. For that same state it times, per rank:

==================  ==========================================================================
floor               copy of every local tensor shard of the state dict into one preallocated,
                    pre-touched anonymous buffer: the memcpy a snapshot cannot avoid
floor_shm           (diagnostic) the same copy into a pre-faulted MAP_SHARED tmpfs mapping,
                    the kind of memory an aegis slot is
get_state_dict      (diagnostic) ``get_state_dict(model, opt)`` alone
aegis_blocking      ``Manager.save(step)`` (includes its ``get_state_dict``)
aegis_background    ``SnapshotResult.background_s``: crc32c, index, commit
aegis_total         blocking + background
dcp_save            ``get_state_dict`` + ``dcp.save`` into a directory (tmpfs by default)
dcp_async_blocking  ``get_state_dict`` + ``dcp.async_save(..., THREAD)`` until it returns
dcp_async_total     ... until ``future.result()`` returns
==================  ==========================================================================

Each case runs 1 warm-up + ``--repeats`` timed repetitions, with an untimed training step
(forward, backward, ``optimizer.step``) before each one, as in a real loop. Background work of
one save is always finished before the next one starts. Per repetition the slowest rank counts
(it is the one that blocks training); the table shows median and min over repetitions.

    .venv/bin/python bench/snapshot_overhead.py              # 2 ranks x 200 MiB, 5 repeats
    .venv/bin/python bench/snapshot_overhead.py --mb-per-rank 50 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import math
import mmap
import os
import platform
import shlex
import shutil
import socket
import statistics
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from _machine import machine_basics  # noqa: E402 - bench/ is on sys.path as a script
from torch import nn

ALL_CASES = ("floor", "floor_shm", "get_state_dict", "aegis", "dcp_save", "dcp_async_save")
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "snapshot_overhead.json"
_ALIGN = 64


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2, help="ranks (processes); default 2")
    p.add_argument("--mb-per-rank", type=float, default=200.0,
                   help="minimum MiB of params + exp_avg + exp_avg_sq per rank; default 200")
    p.add_argument("--dim", type=int, default=1024, help="Linear width; default 1024")
    p.add_argument("--batch", type=int, default=8, help="training batch rows; default 8")
    p.add_argument("--repeats", type=int, default=5, help="timed repetitions per case")
    p.add_argument("--warmup", type=int, default=1, help="untimed repetitions first")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads / OMP_NUM_THREADS per rank; default 1")
    p.add_argument("--cases", default=",".join(ALL_CASES),
                   help=f"comma-separated subset of {','.join(ALL_CASES)}")
    p.add_argument("--work-dir", default="/dev/shm",
                   help="parent of the run's aegis store and DCP checkpoints (default /dev/shm, "
                   "a tmpfs, so that disk speed does not dominate DCP)")
    p.add_argument("--keep-files", action="store_true", help="leave the run's files behind")
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds for the whole run")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON results ({DEFAULT_OUT})")
    args = p.parse_args(argv)
    cases = [c for c in args.cases.split(",") if c]
    unknown = sorted(set(cases) - set(ALL_CASES))
    if unknown:
        p.error(f"--cases: unknown {unknown}; choose from {list(ALL_CASES)}")
    args.cases = cases
    if args.world < 1 or args.repeats < 1 or args.warmup < 0 or args.threads < 1:
        p.error("--world, --repeats and --threads must be >= 1, --warmup >= 0")
    if args.dim % args.world:
        p.error(f"--dim {args.dim} must be divisible by --world {args.world} (even shards)")
    return args


# -- one rank --------------------------------------------------------------------------------


class _Stack(nn.Module):
    def __init__(self, dim: int, n_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(n_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _local_tensors(sd: dict[str, Any]) -> list[torch.Tensor]:
    """Every tensor of a nested state dict, DTensors as their local shard."""
    from torch.distributed.tensor import DTensor

    out: list[torch.Tensor] = []

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


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _views(buf: torch.Tensor, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    views, off = [], 0
    for t in tensors:
        n = t.numel() * t.element_size()
        views.append(buf[off:off + n].view(t.dtype).view(t.shape))
        off += (n + _ALIGN - 1) // _ALIGN * _ALIGN
    return views


def _buffer_bytes(tensors: list[torch.Tensor]) -> int:
    return sum((t.numel() * t.element_size() + _ALIGN - 1) // _ALIGN * _ALIGN for t in tensors)


def _copy(views: list[torch.Tensor], tensors: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for dst, src in zip(views, tensors, strict=True):
            dst.copy_(src)


def _rank_main(rank: int, world: int, args: argparse.Namespace, root: str, dcp_root: str
               ) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import aegis

    dim = args.dim
    per_layer = 3 * 4 * (dim * dim + dim) // world  # params + exp_avg + exp_avg_sq, fp32
    n_layers = max(1, math.ceil(args.mb_per_rank * 2**20 / per_layer))
    torch.manual_seed(0)
    model = _Stack(dim, n_layers)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    gen = torch.Generator().manual_seed(1234 + rank)

    def train_step() -> None:
        x = torch.randn(args.batch, dim, generator=gen)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    train_step()  # optimizer state exists from here on
    sd_model, sd_optim = get_state_dict(model, opt)
    tensors = _local_tensors({"model": sd_model, "optim": sd_optim})
    state_bytes = sum(t.numel() * t.element_size() for t in tensors)
    del sd_model, sd_optim

    raw: dict[str, list[float]] = {}
    extra: dict[str, Any] = {}
    step = 0

    def run(case: str, fn: Callable[[int], dict[str, float]]) -> None:
        nonlocal step
        for i in range(args.warmup + args.repeats):
            train_step()
            step += 1
            dist.barrier()
            m = fn(step)
            dist.barrier()
            if i >= args.warmup:
                for k, v in m.items():
                    raw.setdefault(k, []).append(v)
            else:
                for k, v in m.items():
                    extra.setdefault("warmup", {}).setdefault(k, []).append(v)

    # 1. floor: memcpy into pre-touched anonymous memory.
    if "floor" in args.cases:
        buf = torch.zeros(_buffer_bytes(tensors), dtype=torch.uint8)
        views = _views(buf, tensors)

        def floor(_: int) -> dict[str, float]:
            msd, osd = get_state_dict(model, opt)
            src = _local_tensors({"model": msd, "optim": osd})
            t0 = time.perf_counter()
            _copy(views, src)
            return {"floor": time.perf_counter() - t0}

        run("floor", floor)
        del buf, views

    # 1b. the same copy into a pre-faulted shared tmpfs mapping (what an aegis slot is).
    if "floor_shm" in args.cases:
        path = Path(root) / f"floor-shm-rank{rank}"
        nbytes = _buffer_bytes(tensors)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(fd, nbytes)
        os.posix_fallocate(fd, 0, nbytes)
        mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                       prot=mmap.PROT_READ | mmap.PROT_WRITE)
        shm = torch.frombuffer(mm, dtype=torch.uint8)
        shm.zero_()
        views = _views(shm, tensors)

        def floor_shm(_: int) -> dict[str, float]:
            msd, osd = get_state_dict(model, opt)
            src = _local_tensors({"model": msd, "optim": osd})
            t0 = time.perf_counter()
            _copy(views, src)
            return {"floor_shm": time.perf_counter() - t0}

        run("floor_shm", floor_shm)
        del views, shm
        mm.close()
        os.close(fd)
        path.unlink()

    if "get_state_dict" in args.cases:
        def gsd(_: int) -> dict[str, float]:
            t0 = time.perf_counter()
            get_state_dict(model, opt)
            return {"get_state_dict": time.perf_counter() - t0}

        run("get_state_dict", gsd)

    # 2. aegis
    if "aegis" in args.cases:
        store_dir = str(Path(root) / "aegis-store")
        job = "bench"
        mgr = aegis.Manager(job, {"model": aegis.ModelOptimizerState(model, opt)}, every=1,
                            keep=1, store_dir=store_dir, verbose=False)
        results: list[dict[str, float]] = []

        def aegis_save(s: int) -> dict[str, float]:
            t0 = time.perf_counter()
            mgr.save(s)
            blocking = time.perf_counter() - t0
            r = mgr.wait()
            assert r is not None and r.committed, r
            fields = {k: getattr(r, k) for k in (
                "blocking_s", "wait_s", "copy_s", "plan_s", "background_s", "commit_s")}
            fields["staging_gbps"] = r.staging_gbps
            fields["tensor_bytes"] = r.tensor_bytes
            fields["shard_bytes"] = r.shard_bytes
            results.append(fields)
            return {"aegis_blocking": blocking, "aegis_background": r.background_s,
                    "aegis_total": blocking + r.background_s,
                    "aegis_engine_blocking": r.blocking_s, "aegis_copy": r.copy_s,
                    "aegis_outside_engine": blocking - r.blocking_s}

        run("aegis", aegis_save)
        extra["aegis_results"] = results
        # Sanity: the last snapshot restores into a fresh Manager, bit for bit.
        last = step
        p = next(model.parameters())
        ref_param = _local(p).clone()
        ref_avg = _local(opt.state[p]["exp_avg"]).clone()
        mgr.close()
        train_step()  # move the live state away from the snapshot
        step += 1
        diverged = not torch.equal(_local(p), ref_param)
        manifest = Path(store_dir) / job / f"step-{last:08d}" / "manifest.json"
        mgr2 = aegis.Manager(job, {"model": aegis.ModelOptimizerState(model, opt)}, every=1,
                             keep=1, store_dir=store_dir, verbose=False)
        restored = mgr2.restore()
        p = next(model.parameters())
        extra["restore_check"] = {
            "step_saved": last,
            "step_restored": restored,
            "manifest_exists": manifest.is_file(),
            "state_diverged_before_restore": diverged,
            "param_equal": torch.equal(_local(p), ref_param),
            "exp_avg_equal": torch.equal(_local(opt.state[p]["exp_avg"]), ref_avg),
        }
        mgr2.close()
        dist.barrier()
        if rank == 0:
            shutil.rmtree(store_dir, ignore_errors=True)

    # 3. dcp.save
    if "dcp_save" in args.cases:
        def dcp_save(s: int) -> dict[str, float]:
            ckpt = Path(dcp_root) / f"save-{s:08d}"
            t0 = time.perf_counter()
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt)
            t = time.perf_counter() - t0
            dist.barrier()
            if rank == 0:
                shutil.rmtree(ckpt)
            return {"dcp_save": t}

        run("dcp_save", dcp_save)

    # 4. dcp.async_save, thread mode, on its own gloo group
    if "dcp_async_save" in args.cases:
        async_pg = dist.new_group(backend="gloo")

        def dcp_async(s: int) -> dict[str, float]:
            ckpt = Path(dcp_root) / f"async-{s:08d}"
            t0 = time.perf_counter()
            msd, osd = get_state_dict(model, opt)
            fut = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=ckpt,
                                 process_group=async_pg,
                                 async_checkpointer_type=AsyncCheckpointerType.THREAD)
            t1 = time.perf_counter()
            upload: Any = getattr(fut, "upload_completion", fut)  # AsyncSaveResponse or Future
            upload.result()
            t2 = time.perf_counter()
            dist.barrier()
            if rank == 0:
                shutil.rmtree(ckpt)
            return {"dcp_async_blocking": t1 - t0, "dcp_async_total": t2 - t0}

        run("dcp_async_save", dcp_async)
        dist.destroy_process_group(async_pg)

    return {
        "rank": rank,
        "state_bytes": state_bytes,
        "n_tensors": len(tensors),
        "n_layers": n_layers,
        "params_local": sum(_local(p).numel() for p in model.parameters()),
        "raw_s": raw,
        **extra,
    }


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, root: str,
            dcp_root: str, queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      OMP_NUM_THREADS=str(args.threads))
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        queue.put((rank, True, _rank_main(rank, world, args, root, dcp_root)))
    except BaseException as e:  # noqa: BLE001 - reported by the launcher
        queue.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# -- launcher --------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _machine() -> dict[str, Any]:
    basics = machine_basics(("MemTotal", "MemAvailable", "Shmem"))
    mem = {k: v for k, v in basics.items() if k.endswith("_kib")}
    cpu = basics["cpu_model"]
    thp = {}
    for name in ("enabled", "shmem_enabled"):
        p = Path("/sys/kernel/mm/transparent_hugepage") / name
        thp[name] = p.read_text().strip() if p.exists() else None
    return {"cpu_count": os.cpu_count(), "cpu_model": cpu, **mem, "thp": thp,
            "torch": torch.__version__, "python": platform.python_version(),
            "platform": platform.platform(), "device": "cpu"}


def _launch(args: argparse.Namespace, root: str, dcp_root: str) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, args.world, port, args, root, dcp_root, queue),
                         daemon=True) for r in range(args.world)]
    for p in procs:
        p.start()
    results: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + args.timeout
    try:
        while len(results) < args.world:
            rank, ok, value = queue.get(timeout=max(1.0, deadline - time.monotonic()))
            results[rank] = (ok, value)
            if not ok:
                break  # the others would wait forever in a collective
    finally:
        for p in procs:
            p.join(timeout=30 if len(results) == args.world else 1)
            if p.is_alive():
                p.kill()
    failures = {r: v for r, (ok, v) in results.items() if not ok}
    if failures:
        raise RuntimeError("\n".join(f"rank {r} failed: {v}" for r, v in sorted(failures.items())))
    return [results[r][1] for r in range(args.world)]


# Rows of the table: (name, raw key, what it is).
_ROWS = [
    ("floor", "floor", "memcpy into anonymous memory"),
    ("floor_shm", "floor_shm", "memcpy into a tmpfs mapping (diagnostic)"),
    ("get_state_dict", "get_state_dict", "get_state_dict alone (diagnostic)"),
    ("aegis_blocking", "aegis_blocking", "Manager.save(step)"),
    ("  engine.save", "aegis_engine_blocking", "SnapshotResult.blocking_s"),
    ("  copy (stage)", "aegis_copy", "SnapshotResult.copy_s"),
    ("  outside engine", "aegis_outside_engine", "Manager.save - engine (get_state_dict, rng)"),
    ("aegis_background", "aegis_background", "SnapshotResult.background_s"),
    ("aegis_total", "aegis_total", "blocking + background"),
    ("dcp_save", "dcp_save", "get_state_dict + dcp.save"),
    ("dcp_async_blocking", "dcp_async_blocking", "get_state_dict + async_save returns"),
    ("dcp_async_total", "dcp_async_total", "... future.result() returns"),
]


def _summarize(ranks: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per repetition the slowest rank; then median and min over repetitions."""
    state_bytes = max(r["state_bytes"] for r in ranks)
    out = {}
    for key in ranks[0]["raw_s"]:
        per_rep = [max(vals) for vals in zip(*(r["raw_s"][key] for r in ranks), strict=True)]
        med = statistics.median(per_rep)
        out[key] = {"median_ms": med * 1e3, "min_ms": min(per_rep) * 1e3,
                    "gbps": state_bytes / med / 1e9 if med > 0 else 0.0,
                    "per_rep_max_ms": [v * 1e3 for v in per_rep]}
    floor = out.get("floor", {}).get("median_ms")
    for v in out.values():
        v["x_floor"] = v["median_ms"] / floor if floor else None
    return out


def _table(summary: dict[str, dict[str, float]]) -> str:
    lines = [f"{'case':<20} {'median ms':>10} {'min ms':>10} {'GB/s':>8} {'x floor':>8}  what",
             "-" * 100]
    for name, key, what in _ROWS:
        s = summary.get(key)
        if s is None:
            continue
        xf = f"{s['x_floor']:.2f}" if s["x_floor"] is not None else "n/a"
        lines.append(f"{name:<20} {s['median_ms']:>10.1f} {s['min_ms']:>10.1f} "
                     f"{s['gbps']:>8.2f} {xf:>8}  {what}")
    return "\n".join(lines)


def _targets(summary: dict[str, dict[str, float]]) -> list[dict[str, Any]]:
    def med(key: str) -> float | None:
        return summary[key]["median_ms"] if key in summary else None

    checks = []
    for name, key, ref, factor in (
        ("aegis blocking <= 1.5 x floor", "aegis_blocking", "floor", 1.5),
        ("aegis blocking <= 0.5 x dcp.async_save blocking", "aegis_blocking",
         "dcp_async_blocking", 0.5),
    ):
        a, b = med(key), med(ref)
        ok = None if a is None or b is None else a <= factor * b
        checks.append({"check": name, "value_ms": a, "limit_ms": None if b is None else factor * b,
                       "ratio": None if a is None or not b else a / b,
                       "result": {True: "PASS", False: "FAIL", None: "n/a"}[ok]})
    return checks


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # inherited by the spawned ranks
    root = tempfile.mkdtemp(prefix=f"aegis-bench-{uuid.uuid4().hex[:6]}-", dir=args.work_dir)
    dcp_root = str(Path(root) / "dcp")
    os.makedirs(dcp_root, exist_ok=True)
    load_before = os.getloadavg()
    t0 = time.time()
    try:
        ranks = _launch(args, root, dcp_root)
    finally:
        if not args.keep_files:
            shutil.rmtree(root, ignore_errors=True)
    elapsed = time.time() - t0
    summary = _summarize(ranks)
    checks = _targets(summary)
    r0 = ranks[0]
    print(f"aegis snapshot overhead: {args.world} ranks x {r0['state_bytes'] / 2**20:.1f} MiB of "
          f"local state ({r0['n_tensors']} tensors; {r0['n_layers']} x Linear({args.dim}, "
          f"{args.dim}), {r0['params_local'] / 1e6:.2f} M params/rank + AdamW), "
          f"{args.repeats} repeats after {args.warmup} warm-up, {args.threads} thread(s)/rank, "
          f"{os.cpu_count()} cores")
    print(f"files under {root} ({'tmpfs' if root.startswith('/dev/shm') else 'not tmpfs'}); "
          "per repetition the slowest rank; GB/s = rank state bytes / median")
    print(_table(summary))
    for c in checks:
        ratio = f"{c['ratio']:.2f}x" if c["ratio"] is not None else "n/a"
        print(f"target: {c['check']:<48} {c['result']}  ({ratio})")
    for r in ranks:
        if "restore_check" in r:
            rc = r["restore_check"]
            ok = (rc["step_restored"] == rc["step_saved"] and rc["manifest_exists"]
                  and rc["param_equal"] and rc["exp_avg_equal"])
            print(f"restore check rank {r['rank']}: {'OK' if ok else 'FAILED'} {rc}")
    first = [r["aegis_results"][0] for r in ranks if r.get("aegis_results")]
    if first and args.warmup:
        print("aegis first save (plans, pre-faults keep + 1 = 2 slots; warm-up, not in table): "
              f"blocking {max(f['blocking_s'] for f in first) * 1e3:.0f} ms, of which plan "
              f"{max(f['plan_s'] for f in first) * 1e3:.0f} ms (slowest rank)")
    print(f"total {elapsed:.0f} s; 1-minute load average {load_before[0]:.2f} before, "
          f"{os.getloadavg()[0]:.2f} after (other work on the machine distorts timings)")
    doc = {
        "bench": "snapshot_overhead",
        "command": shlex.join([sys.executable, *sys.argv]),
        "argv": sys.argv[1:] if argv is None else list(argv),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "work_dir": root,
        "work_dir_is_tmpfs": root.startswith("/dev/shm"),
        "machine": _machine(),
        # Other work on the machine distorts these numbers: 1-minute load before and after.
        "loadavg_1m": {"before": load_before[0], "after": os.getloadavg()[0]},
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "elapsed_s": elapsed,
        "summary": summary,
        "targets": checks,
        "ranks": ranks,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, args.out)
    print(f"wrote {args.out}")
    restore_ok = all(
        r["restore_check"]["param_equal"] and r["restore_check"]["exp_avg_equal"]
        for r in ranks if "restore_check" in r)
    return 0 if restore_ok else 1


if __name__ == "__main__":
    sys.exit(main())
