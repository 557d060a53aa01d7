#!/usr/bin/env python
"""The GPU check (issue 23): one prepared run, on one GPU, of everything a CPU machine cannot
show. Each part runs in a process of its own, with a time limit, and its result is written as
soon as it ends (merged into ``<outdir>/gpu_check.partial.json``), so a part that crashes or overruns
costs only itself; the final document is ``<outdir>/gpu_check.json`` (``--outdir`` defaults to
``bench/results``).

============  ==================================================================================
copy          device-to-host floors for each ``--sizes-gb``: pageable, pinned (torch's caching
              host allocator), and a node-store slot registered with ``cudaHostRegister``
              (``aegis.snapshot.hostmem``), with the registration's own time
save          per size, one process (world 1, FSDP2, ``cpu:gloo,cuda:nccl``, AdamW fp32): the
              pinned D2H floor of the state; ``Manager.save()`` in each staging mode (sync,
              pinned, async): first save apart, blocking median, save -> committed; restore
              onto the GPU through the registered slots (as an in-process round does) and after
              ``close()`` (pageable), both checked bitwise; ``dcp.async_save`` with
              ``FileSystemWriter(cache_staged_state_dict=True)`` on the same state
throughput    a bf16 GPT of a few hundred M params (``--tput-dim``, ``--tput-layers``), steps/s
              with no snapshot and with a snapshot every step in each staging mode
cpu_restore   a CUDA snapshot restored by 1 CPU rank and resharded to 2 CPU ranks (gloo, no GPU),
              bitwise against the full state saved with it
nccl1         ``run_in_process`` with ``cpu:gloo,cuda:nccl``, world 1: the NCCL fence (communicators
              aborted from the heartbeat thread, ``PeerLost`` raised in the round), teardown,
              a new round with working NCCL collectives and a bitwise restore
sticky        a device-side assert left in the CUDA context, then a peer failure: the process
              must restart (``RecoveryGaveUp``), not train on
inprocess     ``bench/inprocess_check.py --device cuda``: 3 processes on the GPU over gloo, one
              SIGKILLed and replaced, then freeze/thaw cycles; survivors in place, restores
              bitwise, GPU memory at round start flat
============  ==================================================================================

On a GPU machine with torch but without aegis' other dependencies and without a network, carry
the wheels (``make gpu-wheels`` here) and run ``bash bench/gpu_check.sh`` (it installs them
into /tmp/site and calls this script with ``--outdir $OUT``). Back here, put the returned
``gpu_check.json`` into ``bench/results/`` and run ``bench/gpu_check.py --render`` for the
README section. On a machine without CUDA it says so and exits 0, unless ``--device cpu`` asks
for a smoke run of the save and throughput parts on the CPU (to catch mistakes before a GPU
run, not to measure anything).
"""

from __future__ import annotations

import argparse
import json
import math
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
    RESULTS,
    ROOT,
    f,
    free_port,
    md_table,
    new_doc,
    run_ranks,
    write_doc,
)

NAME = "gpu_check"
GB = 1e9
PARTS = ("save", "copy", "nccl1", "inprocess", "throughput", "cpu_restore", "sticky")
# seconds each part may take (the whole check is planned for about 8 minutes on an H200)
LIMITS = {"copy": 60, "save": 200, "throughput": 90, "cpu_restore": 90, "nccl1": 60,
          "sticky": 40, "inprocess": 240}
README_BEGIN, README_END = "<!-- gpu:begin -->", "<!-- gpu:end -->"


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default=",".join(PARTS), help=f"subset of {','.join(PARTS)}")
    p.add_argument("--sizes-gb", default="2,8", help="state sizes for copy and save; default 2,8")
    p.add_argument("--repeats", type=int, default=5, help="timed saves per mode; default 5")
    p.add_argument("--tput-dim", type=int, default=1024)
    p.add_argument("--tput-layers", type=int, default=24)
    p.add_argument("--tput-batch", type=int, default=16)
    p.add_argument("--tput-seq", type=int, default=1024)
    p.add_argument("--tput-steps", type=int, default=20)
    p.add_argument("--cycles", type=int, default=10, help="inprocess recoveries; default 10")
    p.add_argument("--budget", type=float, default=480.0, help="seconds for all parts")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: a smoke run of save/throughput here (measures nothing)")
    p.add_argument("--outdir", type=Path, default=RESULTS)
    p.add_argument("--render", nargs="?", const=str(RESULTS / f"{NAME}.json"), default=None,
                   help="only write the README section from a result document")
    p.add_argument("--part", default=None, help=argparse.SUPPRESS)
    p.add_argument("--partdir", type=Path, default=Path(tempfile.gettempdir()) / "aegis-gpu-check",
                   help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.parts = [x for x in args.parts.split(",") if x]
    args.sizes_gb = [float(x) for x in args.sizes_gb.split(",") if x]
    return args


# -- helpers used inside parts --------------------------------------------------------------------


def _sync(dev: Any) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize()


def _init_world1(dev: Any) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        return
    store = dist.TCPStore("127.0.0.1", free_port(), 1, True, timeout=timedelta(seconds=60))
    backend = "cpu:gloo,cuda:nccl" if dev.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=0, world_size=1)


def _linear_stack(size_gb: float, dev: Any, dim: int = 4096) -> tuple[Any, Any, Any]:
    """An FSDP2 (world 1) stack of Linear layers whose fp32 params + AdamW moments take about
    ``size_gb``, after one optimizer step; and a step function."""
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    per_layer = 12 * (dim * dim + dim)
    layers = max(1, math.ceil(size_gb * GB / per_layer))
    torch.manual_seed(0)
    with torch.device(dev):
        model = nn.Sequential(*(nn.Sequential(nn.Linear(dim, dim), nn.GELU())
                                for _ in range(layers)))
    mesh = init_device_mesh(dev.type, (1,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(8, dim, device=dev)

    def step() -> None:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    return model, opt, step


def _local_tensors(model: Any, opt: Any) -> list[Any]:
    from torch.distributed.tensor import DTensor

    out = []
    for p in model.parameters():
        out.append(p._local_tensor if isinstance(p, DTensor) else p)
        for v in opt.state[p].values():
            if hasattr(v, "is_cuda") and v.dim() > 0:
                out.append(v._local_tensor if isinstance(v, DTensor) else v)
    return out


def _timed_copy(dst_views: list[Any], srcs: list[Any], dev: Any, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats + 1):
        _sync(dev)
        t0 = time.perf_counter()
        for d, s in zip(dst_views, srcs, strict=True):
            d.copy_(s, non_blocking=True)
        _sync(dev)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def _views(buf: Any, tensors: list[Any]) -> list[Any]:
    out, off = [], 0
    for t in tensors:
        n = t.numel() * t.element_size()
        out.append(buf[off:off + n].view(t.dtype).view(t.shape))
        off += (n + 63) // 64 * 64
    return out


def _nbytes(tensors: list[Any]) -> int:
    return sum((t.numel() * t.element_size() + 63) // 64 * 64 for t in tensors)


# -- parts -----------------------------------------------------------------------------------------


def part_copy(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    import torch

    from aegis.snapshot import hostmem
    from aegis.snapshot.node_store import Slot

    dev = torch.device("cuda")
    out: dict[str, Any] = {}
    for gb in args.sizes_gb:
        n = 64
        srcs = [torch.randn(int(gb * GB / 4 / n), device=dev) for _ in range(n)]
        nbytes = _nbytes(srcs)
        row: dict[str, Any] = {"bytes": nbytes}
        buf = torch.empty(nbytes, dtype=torch.uint8)
        row["pageable_s"] = _timed_copy(_views(buf, srcs), srcs, dev)
        del buf
        buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        row["pinned_s"] = _timed_copy(_views(buf, srcs), srcs, dev)
        del buf
        torch.cuda.empty_cache()
        slot = Slot(tmp / f"slot-{gb:g}", keep=False)
        t0 = time.perf_counter()
        slot.ensure(nbytes)
        row["prefault_s"] = time.perf_counter() - t0
        row["register_s"] = slot.pin()
        row["registered"] = slot.pinned
        row["registered_slot_s"] = _timed_copy(_views(slot.view, srcs), srcs, dev)
        ok = all(torch.equal(v, s.cpu()) for v, s in zip(_views(slot.view, srcs)[:2], srcs[:2], strict=True))
        row["registered_slot_equal"] = ok
        slot.close()
        (tmp / f"slot-{gb:g}").unlink(missing_ok=True)
        for k in ("pageable", "pinned", "registered_slot"):
            row[f"{k}_gbps"] = nbytes / row[f"{k}_s"] / GB
        if row["register_s"]:
            row["register_gbps"] = nbytes / row["register_s"] / GB
        out[f"{gb:g}"] = row
        print(f"copy {gb:g} GB: {json.dumps(row)}", flush=True)
        del srcs
        torch.cuda.empty_cache()
    out["hostmem"] = hostmem.stats()
    return out


def _save_mode(args: argparse.Namespace, tmp: Path, model: Any, opt: Any, step: Any, dev: Any,
               mode: str, size: float) -> dict[str, Any]:
    import torch

    import aegis
    from aegis.snapshot import hostmem

    job = f"gpu-{mode}-{size:g}".replace(".", "_")
    store = str(tmp / "store")
    mk = lambda: aegis.Manager(job, {"model": aegis.ModelOptimizerState(model, opt)},  # noqa: E731
                               every=1, keep=1, replicas=0, staging=mode, store_dir=store,
                               verbose=False)
    row: dict[str, Any] = {}
    reg0 = hostmem.stats()
    mgr = mk()
    mgr.restore()
    s = 1
    step()
    _sync(dev)
    t0 = time.perf_counter()
    mgr.save(s)
    row["first_blocking_s"] = time.perf_counter() - t0
    r = mgr.wait()
    assert r is not None and r.committed, r
    row["first_plan_s"] = r.plan_s
    row["first_committed_s"] = time.perf_counter() - t0
    row["pin_s"] = r.pin_s
    reg1 = hostmem.stats()
    row["registered_bytes"] = reg1["registered_bytes"] - reg0["registered_bytes"]
    row["register_s"] = reg1["register_s"] - reg0["register_s"]
    blocking, committed, copy, deferred = [], [], [], []
    for _ in range(args.repeats):
        s += 1
        step()
        _sync(dev)
        t0 = time.perf_counter()
        mgr.save(s)
        blocking.append(time.perf_counter() - t0)
        r = mgr.wait()
        committed.append(time.perf_counter() - t0)
        assert r is not None and r.committed, r
        copy.append(r.copy_s)
        deferred.append(r.deferred_s)
    row.update(blocking_s=statistics.median(blocking), blocking_all_s=blocking,
               committed_s=statistics.median(committed), copy_s=statistics.median(copy),
               deferred_s=statistics.median(deferred))
    # restore as an in-process round does: the Manager aborted (its registered slots kept by
    # this process), the state moved on, a new Manager restores through the kept mappings
    ref = [t.detach().clone() for t in _local_tensors(model, opt)]
    mgr.abort(begin=True)
    mgr.abort(begin=False)
    step()
    mgr2 = mk()
    _sync(dev)
    t0 = time.perf_counter()
    got = mgr2.restore()
    _sync(dev)
    row["restore_kept_s"] = time.perf_counter() - t0
    row["restore_kept_timings"] = mgr2.last_restore.timings if mgr2.last_restore else {}
    row["restore_kept_bitwise"] = got == s and all(
        torch.equal(a, b) for a, b in zip(ref, _local_tensors(model, opt), strict=True))
    mgr2.close()  # releases the mappings: the next restore reads pageable memory
    step()
    mgr3 = mk()
    _sync(dev)
    t0 = time.perf_counter()
    got = mgr3.restore()
    _sync(dev)
    row["restore_after_close_s"] = time.perf_counter() - t0
    row["restore_after_close_bitwise"] = got == s and all(
        torch.equal(a, b) for a, b in zip(ref, _local_tensors(model, opt), strict=True))
    mgr3.close()
    del ref
    shutil.rmtree(Path(store) / job, ignore_errors=True)
    return row


def _dcp_async(args: argparse.Namespace, tmp: Path, model: Any, opt: Any, step: Any,
               dev: Any) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.state_dict import get_state_dict

    root = tmp / "dcp"
    writer = FileSystemWriter(str(root / "c0"), cache_staged_state_dict=True)
    blocking, total = [], []
    for i in range(args.repeats + 1):
        step()
        _sync(dev)
        t0 = time.perf_counter()
        msd, osd = get_state_dict(model, opt)
        fut = dcp.async_save({"model": msd, "optim": osd}, storage_writer=writer,
                             checkpoint_id=str(root / f"c{i}"))
        blocking.append(time.perf_counter() - t0)
        fut.result()
        total.append(time.perf_counter() - t0)
        shutil.rmtree(root / f"c{i}", ignore_errors=True)
    shutil.rmtree(root, ignore_errors=True)
    return {"first_blocking_s": blocking[0], "blocking_s": statistics.median(blocking[1:]),
            "total_s": statistics.median(total[1:])}


def part_save(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    import torch

    dev = torch.device(args.device)
    _init_world1(dev)
    out: dict[str, Any] = {}
    for gb in args.sizes_gb:
        model, opt, step = _linear_stack(gb, dev)
        tensors = _local_tensors(model, opt)
        nbytes = _nbytes(tensors)
        res: dict[str, Any] = {"bytes": nbytes, "tensors": len(tensors)}
        if dev.type == "cuda":
            buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            res["pinned_floor_s"] = _timed_copy(_views(buf, tensors), tensors, dev)
            del buf
        del tensors
        for mode in ("sync", "pinned", "async"):
            try:
                res[mode] = _save_mode(args, tmp, model, opt, step, dev, mode, gb)
            except Exception as e:  # noqa: BLE001 - reported; the other modes still count
                res[mode] = {"error": f"{type(e).__name__}: {e}"}
            print(f"save {gb:g} GB {mode}: {json.dumps(res[mode], default=str)[:600]}", flush=True)
        try:
            res["dcp_async_save"] = _dcp_async(args, tmp, model, opt, step, dev)
        except Exception as e:  # noqa: BLE001 - torch 2.11's DefaultStager crashed when reused
            res["dcp_async_save"] = {"error": f"{type(e).__name__}: {e}"}
        print(f"save {gb:g} GB dcp.async_save: {res['dcp_async_save']}", flush=True)
        out[f"{gb:g}"] = res
        del model, opt, step
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return out


def part_throughput(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """A bf16 decoder (pre-norm attention + MLP blocks, SDPA), FSDP2 world 1, AdamW (bf16
    moments, as the parameters), one step = forward + backward + optimizer step."""
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import aegis

    dev = torch.device(args.device)
    _init_world1(dev)
    dim, layers, vocab = args.tput_dim, args.tput_layers, 32000
    heads = max(1, dim // 64)

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.n1, self.n2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
            self.qkv, self.o = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
            self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, _ = x.shape
            q, k, v = self.qkv(self.n1(x)).view(b, t, 3, heads, dim // heads).unbind(2)
            a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                               v.transpose(1, 2), is_causal=True)
            x = x + self.o(a.transpose(1, 2).reshape(b, t, dim))
            return x + self.down(F.gelu(self.up(self.n2(x))))

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(vocab, dim)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.head = nn.Linear(dim, vocab, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.emb(x)
            for b in self.blocks:
                h = b(h)
            return self.head(h)

    torch.manual_seed(0)
    with torch.device(dev):
        model = GPT().to(torch.bfloat16 if dev.type == "cuda" else torch.float32)
    mesh = init_device_mesh(dev.type, (1,))
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    params = sum(p.numel() for p in model.parameters())
    batch, seq = (args.tput_batch, args.tput_seq) if dev.type == "cuda" else (2, 32)
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randint(0, vocab, (batch, seq + 1), device=dev, generator=g)

    def step() -> None:
        logits = model(x[:, :-1])
        F.cross_entropy(logits.reshape(-1, vocab).float(), x[:, 1:].reshape(-1)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    _sync(dev)
    out: dict[str, Any] = {"params": params, "dtype": str(next(model.parameters()).dtype),
                           "batch": batch, "seq": seq, "runs": []}
    state_bytes = sum(t.numel() * t.element_size() for t in _local_tensors(model, opt))
    out["state_bytes"] = state_bytes
    n = args.tput_steps if dev.type == "cuda" else 4
    for mode in ("none", "async", "pinned", "sync", "none"):
        mgr = None
        if mode != "none":
            mgr = aegis.Manager(f"tput-{mode}", {"model": aegis.ModelOptimizerState(model, opt)},
                                every=1, keep=1, replicas=0, staging=mode, verbose=False,
                                store_dir=str(tmp / "store"), fresh=True)
            mgr.restore()
            for s in (1, 2, 3):  # planning, pre-faulting and registration before the window
                step()
                mgr.save(s)
                mgr.wait()
        _sync(dev)
        t0 = time.perf_counter()
        blocking = []
        for s in range(4, 4 + n):
            step()
            if mgr is not None:
                tb = time.perf_counter()
                mgr.save(s)
                blocking.append(time.perf_counter() - tb)
        if mgr is not None:
            mgr.wait()
        _sync(dev)
        secs = time.perf_counter() - t0
        run = {"mode": mode, "steps_per_s": n / secs}
        if blocking:
            run["blocking_s_median"] = statistics.median(blocking)
        out["runs"].append(run)
        print(f"throughput {mode}: {run}", flush=True)
        if mgr is not None:
            mgr.close()
            shutil.rmtree(tmp / "store" / f"tput-{mode}", ignore_errors=True)
    base = statistics.mean(r["steps_per_s"] for r in out["runs"] if r["mode"] == "none")
    for r in out["runs"]:
        r["relative"] = r["steps_per_s"] / base
    return out


def _cpu_restore_rank(rank: int, world: int, store: str, ref_path: str, size_gb: float
                      ) -> dict[str, Any]:
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    import aegis

    dev = torch.device("cpu")
    model, opt, _ = _linear_stack_world(size_gb, dev, world)
    mgr = aegis.Manager("gpu-xfer", {"model": aegis.ModelOptimizerState(model, opt)},
                        replicas=0, store_dir=store, verbose=False)
    step = mgr.restore()
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                cpu_offload=True))
    mgr.close()
    ok = None
    if rank == 0:
        ref = torch.load(ref_path, weights_only=True)
        ok = ref.keys() == full.keys() and all(torch.equal(ref[k], full[k]) for k in ref)
    return {"step": step, "bitwise": ok}


def _linear_stack_world(size_gb: float, dev: Any, world: int, dim: int = 1024
                        ) -> tuple[Any, Any, Any]:
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    layers = max(1, math.ceil(size_gb * GB / (12 * (dim * dim + dim))))
    torch.manual_seed(1)
    with torch.device(dev):
        model = nn.Sequential(*(nn.Sequential(nn.Linear(dim, dim), nn.GELU())
                                for _ in range(layers)))
    mesh = init_device_mesh(dev.type, (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, opt, None


def part_cpu_restore(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """Save on the GPU (world 1), restore on CPU ranks (1, then 2: resharded)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    import aegis

    size = 0.25
    dev = torch.device("cuda")
    store = str(tmp / "xfer-store")
    os.environ["AEGIS_NODE_ID"] = "gpu-check"
    _init_world1(dev)
    model, opt, _ = _linear_stack_world(size, dev, 1)
    x = torch.randn(8, 1024, device=dev)
    for _ in range(2):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    mgr = aegis.Manager("gpu-xfer", {"model": aegis.ModelOptimizerState(model, opt)},
                        replicas=0, store_dir=store, verbose=False, staging="pinned")
    mgr.restore()
    mgr.save(7)
    mgr.wait()
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                cpu_offload=True))
    ref = str(tmp / "ref.pt")
    torch.save(full, ref)
    mgr.close()
    dist.destroy_process_group()
    env = {"AEGIS_NODE_ID": "gpu-check", "CUDA_VISIBLE_DEVICES": ""}
    out: dict[str, Any] = {"bytes": int(size * GB)}
    for world in (1, 2):
        try:
            res = run_ranks(world, _cpu_restore_rank, store, ref, size, timeout=80, env=env)
            out[f"cpu_world_{world}"] = res[0]
        except Exception as e:  # noqa: BLE001 - reported
            out[f"cpu_world_{world}"] = {"error": f"{type(e).__name__}: {str(e)[:800]}"}
        print(f"cpu_restore world {world}: {out[f'cpu_world_{world}']}", flush=True)
    return out


def part_nccl1(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """World-1 run_in_process over ``cpu:gloo,cuda:nccl``: round 0 trains, saves, and is fenced
    from the heartbeat thread (NCCL's abort + PeerLost), round 1 restores and trains with NCCL
    again."""
    import threading

    import torch
    import torch.distributed as dist

    import aegis
    from aegis.training.inprocess.round import Round

    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=30))
    os.environ.update(AEGIS_MEMBERSHIP=f"127.0.0.1:{port}", WORLD_SIZE="1", LOCAL_RANK="0",
                      AEGIS_NODE_ID="nccl1", AEGIS_STORE_DIR=str(tmp / "nccl1-store"),
                      AEGIS_EVENTS_DIR=str(tmp / "nccl1-events"))
    os.environ.pop("TORCH_NCCL_ASYNC_ERROR_HANDLING", None)
    out: dict[str, Any] = {"rounds": []}
    saved: dict[int, list[Any]] = {}

    def train(world: aegis.World) -> int:
        torch.cuda.set_device(0)
        model, opt, step = _linear_stack(0.1, torch.device("cuda"), dim=1024)
        mgr = aegis.Manager("nccl1", {"model": aegis.ModelOptimizerState(model, opt)},
                            replicas=0, verbose=False, staging="pinned")
        start = mgr.restore()
        rec: dict[str, Any] = {"round": world.round, "restored": start, "timings": world.timings,
                               "cause": world.cause}
        if start:
            rec["bitwise"] = all(torch.equal(a, b) for a, b in
                                 zip(saved[start], _local_tensors(model, opt), strict=True))
        t = torch.ones(4, device="cuda")
        dist.all_reduce(t)  # NCCL, on this round's default group
        rec["nccl_all_reduce"] = float(t.sum())
        out["rounds"].append(rec)
        for s in range(start + 1, start + 6):
            step()
            mgr.save(s)
            mgr.wait()
            saved[s] = [x.detach().clone() for x in _local_tensors(model, opt)]
        if world.round == 0:
            fenced: dict[str, Any] = {}

            def fence() -> None:
                time.sleep(0.5)
                t0 = time.perf_counter()
                fenced["cut"] = Round.abandon.fence("ghost/0/0")
                fenced["fence_s"] = time.perf_counter() - t0

            threading.Thread(target=fence, daemon=True).start()
            t0 = time.perf_counter()
            while True:  # training goes on until the fence's PeerLost arrives
                step()
                torch.cuda.synchronize()
                if time.perf_counter() - t0 > 20:
                    raise RuntimeError("no PeerLost within 20 s of the fence")
        mgr.close()
        return start

    t0 = time.perf_counter()
    try:
        out["result"] = aegis.run_in_process(train, min_world=1, backend="cpu:gloo,cuda:nccl",
                                             collective_timeout=timedelta(seconds=30))
    except Exception as e:  # noqa: BLE001 - reported
        out["error"] = f"{type(e).__name__}: {e}"
    out["wall_s"] = time.perf_counter() - t0
    out["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
    out["nccl_version"] = ".".join(map(str, torch.cuda.nccl.version()))
    ev = tmp / "nccl1-events" / "rank-00000.jsonl"
    if ev.exists():
        out["recovery_events"] = [json.loads(x) for x in ev.read_text().splitlines()
                                  if '"recovery"' in x]
    del server
    return out


def part_sticky(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """A child process: a device-side assert (an out-of-range index) poisons its CUDA context,
    then its round fails like a lost peer; the teardown's CUDA check must end the process with
    RecoveryGaveUp instead of forming a new round on a broken context."""
    code = r'''
import os, sys, torch, torch.distributed as dist
from datetime import timedelta
import aegis
from aegis.training.inprocess.round import PeerLost
srv = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
os.environ.update(AEGIS_MEMBERSHIP=f"127.0.0.1:{srv.port}", WORLD_SIZE="1", LOCAL_RANK="0")
rounds = []
def train(world):
    rounds.append(world.round)
    if world.round > 0:
        print("SECOND ROUND", flush=True)
        return
    torch.cuda.set_device(0)
    x = torch.zeros(4, device="cuda")
    x[torch.tensor([1 << 20], device="cuda")] = 1.0  # device-side assert, reported later
    raise PeerLost("simulated peer loss after a device fault")
try:
    aegis.run_in_process(train, min_world=1, backend="gloo", collective_timeout=timedelta(seconds=10))
except aegis.RecoveryGaveUp as e:
    print("GAVE UP:", e, flush=True)
    sys.exit(3)
sys.exit(0)
'''
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=35,
                       env=env, cwd=str(tmp), check=False)
    return {"exit_code": p.returncode, "gave_up": "GAVE UP" in p.stdout,
            "second_round": "SECOND ROUND" in p.stdout, "stdout_tail": p.stdout[-800:],
            "stderr_tail": p.stderr[-800:]}


def part_inprocess(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    out = tmp / "inprocess_check.json"
    cmd = [sys.executable, str(ROOT / "bench" / "inprocess_check.py"), "--device", "cuda",
           "--cycles", str(args.cycles), "--staging", "pinned", "--timeout",
           str(LIMITS["inprocess"] - 20), "--out", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=LIMITS["inprocess"],
                       check=False)
    doc = json.loads(out.read_text()) if out.exists() else {}
    doc["exit_code"] = p.returncode
    doc["stdout_tail"] = p.stdout[-1500:]
    return doc


PART_FNS = {"copy": part_copy, "save": part_save, "throughput": part_throughput,
            "cpu_restore": part_cpu_restore, "nccl1": part_nccl1, "sticky": part_sticky,
            "inprocess": part_inprocess}


def run_part(args: argparse.Namespace) -> int:
    """One part in this process; its JSON goes to ``<partdir>/gpu_check.<part>.json`` (the
    orchestrator merges it into ``<outdir>/gpu_check.partial.json`` at once: the device tool
    returns at most 8 files)."""
    tmp = Path(tempfile.mkdtemp(prefix=f"aegis-gpu-{args.part}-", dir="/dev/shm"))
    doc: dict[str, Any] = {"part": args.part, "t_start": time.time()}
    try:
        doc["result"] = PART_FNS[args.part](args, tmp)
    except BaseException as e:  # noqa: BLE001 - written down, then the process ends
        import traceback

        doc["error"] = f"{type(e).__name__}: {e}"
        doc["traceback"] = traceback.format_exc()[-3000:]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    doc["wall_s"] = time.time() - doc["t_start"]
    args.partdir.mkdir(parents=True, exist_ok=True)
    (args.partdir / f"{NAME}.{args.part}.json").write_text(json.dumps(doc, indent=1, default=str))
    return 1 if "error" in doc else 0


# -- the orchestrator and the README section -------------------------------------------------------


def render(doc: dict[str, Any]) -> str:
    """The README section (between the gpu markers), from a merged result document."""
    lines = [f"Generated by `bench/gpu_check.py --render` from `bench/results/{NAME}.json` "
             f"({doc.get('created', '?')}; {doc.get('gpu', '?')}, torch {doc.get('torch', '?')}). "
             f"Command on the GPU machine: `{doc.get('command', '?')}`."]
    parts = doc.get("parts", {})
    save = parts.get("save", {}).get("result", {})
    rows = []
    for gb, res in save.items():
        floor = res.get("pinned_floor_s")
        dcp = res.get("dcp_async_save", {}).get("blocking_s")
        for mode in ("sync", "pinned", "async"):
            r = res.get(mode, {})
            if "error" in r or not r:
                rows.append([f"{gb} GB", mode] + ["error"] * 8)
                continue
            rows.append([f"{gb} GB", mode, f(r["blocking_s"] * 1e3, ".1f"),
                         f(r["blocking_s"] / floor, ".2f") if floor else "-",
                         f(r["blocking_s"] / dcp, ".3f") if dcp else "-",
                         f(r["first_blocking_s"], ".2f"), f(r["committed_s"], ".2f"),
                         f(r["restore_kept_s"], ".2f"),
                         f(r["restore_after_close_s"], ".2f"),
                         str(r["restore_kept_bitwise"] and r["restore_after_close_bitwise"])])
        rows.append([f"{gb} GB", "pinned D2H floor", f(floor * 1e3, ".1f") if floor else "-",
                     "1.00", "", "", "", "", "", ""])
        if dcp:
            rows.append([f"{gb} GB", "dcp.async_save (cached pinned)", f(dcp * 1e3, ".1f"),
                         f(dcp / floor, ".2f") if floor else "-", "1.000", "", "", "", "", ""])
    if rows:
        lines += ["", md_table(["state", "staging", "save() blocking ms", "x floor",
                                "x dcp.async_save", "first save s", "save -> committed s",
                                "restore (kept) s", "restore (after close) s", "bitwise"], rows)]
    tput = parts.get("throughput", {}).get("result", {})
    if tput.get("runs"):
        lines += ["", f"Throughput, {tput['dtype']} GPT {tput['params'] / 1e6:.0f}M params, batch "
                  f"{tput['batch']} x {tput['seq']}, a snapshot every step "
                  f"({tput['state_bytes'] / GB:.2f} GB of state):", "",
                  md_table(["staging", "steps/s", "x no snapshot", "save() blocking ms"],
                           [[r["mode"], f(r["steps_per_s"]), f(r["relative"], ".3f"),
                             f(r.get("blocking_s_median", 0) * 1e3, ".1f")]
                            for r in tput["runs"]])]
    copy = parts.get("copy", {}).get("result", {})
    crow = [[f"{gb} GB", f(r["pageable_gbps"], ".1f"), f(r["pinned_gbps"], ".1f"),
             f(r["registered_slot_gbps"], ".1f"), f(r.get("register_gbps"), ".2f")]
            for gb, r in copy.items() if isinstance(r, dict) and "pageable_gbps" in r]
    if crow:
        lines += ["", md_table(["D2H", "pageable GB/s", "pinned GB/s", "registered slot GB/s",
                                "registration GB/s"], crow)]
    other = []
    cr = parts.get("cpu_restore", {}).get("result", {})
    if cr:
        other.append(f"- CUDA snapshot restored on CPU ranks: 1 rank bitwise "
                     f"{cr.get('cpu_world_1', {}).get('bitwise')}, resharded to 2 ranks bitwise "
                     f"{cr.get('cpu_world_2', {}).get('bitwise')}.")
    ip = parts.get("inprocess", {}).get("result", {})
    if ip:
        resumes = [x["resume_s"] for x in ip.get("faults", [])]
        other.append(f"- In-process, 3 processes on the GPU over gloo: {len(resumes)} recoveries "
                     f"(1 SIGKILL + freezes), survivors kept their pids: "
                     f"{all(len(v) == 1 for v in ip.get('survivor_pids', {}).values())}, "
                     f"restores bitwise: {ip.get('restores_bitwise')} "
                     f"({ip.get('restores_checked')}), resume median "
                     f"{f(statistics.median(resumes) if resumes else None)} s, GPU memory at round "
                     f"start: {ip.get('memory_at_round_start')}; errors: {ip.get('errors')}.")
    n1 = parts.get("nccl1", {}).get("result", {})
    if n1:
        other.append(f"- NCCL world 1: rounds {n1.get('rounds')}; error: {n1.get('error')}.")
    st = parts.get("sticky", {}).get("result", {})
    if st:
        other.append(f"- Sticky CUDA error after a peer failure: process gave up (restart) "
                     f"{st.get('gave_up')}, exit code {st.get('exit_code')}, formed another round "
                     f"{st.get('second_round')}.")
    failed = [k for k, v in parts.items() if "error" in v]
    if failed:
        other.append(f"- Parts that failed: {failed} (their errors are in the JSON).")
    if other:
        lines += [""] + other
    return "\n".join(lines)


def write_readme(doc: dict[str, Any]) -> None:
    readme = ROOT / "README.md"
    text = readme.read_text()
    if README_BEGIN not in text:
        return
    head, rest = text.split(README_BEGIN, 1)
    _, tail = rest.split(README_END, 1)
    readme.write_text(f"{head}{README_BEGIN}\n{render(doc)}\n{README_END}{tail}")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parse(argv)
    if args.render:
        write_readme(json.loads(Path(args.render).read_text()))
        return 0
    if args.part:
        return run_part(args)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"{NAME}: no CUDA device here (torch {torch.__version__}, built with CUDA "
              f"{torch.version.cuda}); nothing to check. Run it on a machine with a GPU.")
        return 0
    doc = new_doc(NAME, __file__, argv, args)
    doc["torch"] = torch.__version__
    doc["gpu"] = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu (smoke run)"
    doc["parts"] = {}
    parts = args.parts if args.device == "cuda" else [p for p in args.parts
                                                       if p in ("save", "throughput")]
    t_end = time.monotonic() + args.budget
    for part in parts:
        left = t_end - time.monotonic()
        if left < min(30.0, LIMITS[part]):
            doc["parts"][part] = {"error": f"skipped: {left:.0f} s of the budget left"}
            continue
        cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--part", part]
        (args.partdir / f"{NAME}.{part}.json").unlink(missing_ok=True)
        print(f"== {part} (at most {min(LIMITS[part], left):.0f} s)", flush=True)
        t0 = time.monotonic()
        try:
            p = subprocess.run(cmd, timeout=min(LIMITS[part], left), check=False)
            code = p.returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
        res_file = args.partdir / f"{NAME}.{part}.json"
        res = json.loads(res_file.read_text()) if res_file.exists() else {}
        if code == "timeout" and "result" not in res:
            res["error"] = f"timed out after {time.monotonic() - t0:.0f} s"
        elif code not in (0, 1) and not res:
            res["error"] = f"exited with {code}"
        doc["parts"][part] = res
        args.outdir.mkdir(parents=True, exist_ok=True)
        with open(args.outdir / f"{NAME}.partial.json", "w") as fh:  # what is known so far
            json.dump(doc, fh, indent=1, default=str)
    doc["errors"] = {k: v["error"] for k, v in doc["parts"].items() if "error" in v}
    write_doc(doc, args.outdir / f"{NAME}.json")
    print(render(doc))
    return 1 if doc["errors"] else 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
