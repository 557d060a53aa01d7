#!/usr/bin/env python
"""The durable tier: codec ratios and speeds, upload/download throughput, restore from S3 vs DCP.

One run measures, on this machine:

1. **training state**: the reference trainer's TinyGPT (``examples/train_fsdp.py``, loaded by
   path), sized so that fp32 params + AdamW exp_avg + exp_avg_sq are ``--mb`` MB, trained
   ``--train-steps`` steps on its synthetic tokens in this process (no FSDP). Its tensors feed
   the codec table and, loaded into an FSDP2 model on 2 ranks, the tier measurements.
2. **codec table**: per kind (fp32 weights, bf16 weights = the fp32 weights cast, exp_avg,
   exp_avg_sq) the tensors are laid end to end and cut into ``--chunk-mib`` chunks, like a shard;
   every chunk is encoded and decoded with ``Codec`` modes raw / zstd / planes (one thread,
   level ``--level``): stored fraction, ratio, encode and decode MB/s of raw bytes.
   Target (PASS/FAIL, never tuned for): bf16 weights with byte planes <= 0.70 of raw.
3. **upload**: 2 spawned ranks (gloo) with ``aegis.Manager(durable=...)`` save step 1 once and
   ``wait_durable()``, for a moto S3 server on loopback (``s3://``) and a local directory
   (``file://``); the ``upload`` events give seconds and raw/stored bytes per rank.
   For comparison the same sharded state is saved with ``torch.distributed.checkpoint.save``
   through ``FsspecWriter`` (s3fs) to the same S3 server.
4. **download**: this process fetches and decodes every chunk of both shards
   (``durable.fetch_chunks``, 4 threads, as restore does) from each store.
5. **restore after whole-job loss**: node stores deleted, fresh 2-rank processes time
   ``Manager.restore()`` from S3 (and from ``file://``), and, fresh again, ``dcp.load`` of the
   DCP copy through ``FsspecReader`` + ``set_state_dict``. Every restore is checked bitwise
   against the saved shards (crc32 of every local tensor).

MB = 1e6 bytes throughout; throughputs are raw (uncompressed) bytes per second.

    .venv/bin/python bench/durable.py                 # ~256 MB state, a few minutes on 2 cores
    .venv/bin/python bench/durable.py --mb 64 --train-steps 5
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import pickle
import platform
import queue as queue_mod
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _machine import machine_basics  # noqa: E402 - bench/ is on sys.path as a script

ROOT = Path(__file__).resolve().parent.parent
TRAINER = ROOT / "examples" / "train_fsdp.py"
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "durable.json"
MB = 1e6
TARGET_BF16_FRACTION = 0.70
JOB = "bench-durable"
S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}
KINDS = ("fp32 weights", "bf16 weights", "exp_avg (fp32)", "exp_avg_sq (fp32)")
MODES = ("raw", "zstd", "planes")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=float, default=256.0,
                   help="training state size in MB (fp32 params + 2 AdamW moments; default 256)")
    p.add_argument("--train-steps", type=int, default=20, help="training steps before measuring")
    p.add_argument("--batch-size", type=int, default=2, help="training batch size (sequences)")
    p.add_argument("--seq-len", type=int, default=64, help="training sequence length")
    p.add_argument("--chunk-mib", type=int, default=16, help="codec table chunk size (MiB)")
    p.add_argument("--level", type=int, default=3, help="zstd level (the Manager's default: 3)")
    p.add_argument("--skip-dcp", action="store_true", help="no DCP-over-S3 comparison")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per multi-rank phase")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON results ({DEFAULT_OUT})")
    return p.parse_args(argv)


# -- helpers -----------------------------------------------------------------------------------


def _trainer_module() -> Any:
    spec = importlib.util.spec_from_file_location("train_fsdp", TRAINER)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("train_fsdp", mod)
    spec.loader.exec_module(mod)
    return mod


def model_shape(state_mb: float, *, dim: int = 512, heads: int = 8, vocab: int = 2048,
                seq: int = 64) -> dict[str, int]:
    """TinyGPT layers so that params x 12 bytes (fp32 param + exp_avg + exp_avg_sq) ~ state_mb."""
    fixed = 2 * vocab * dim + seq * dim + 2 * dim  # tok_emb, head, pos_emb, ln_f
    per_layer = 12 * dim * dim + 13 * dim
    layers = max(1, round((state_mb * MB / 12 - fixed) / per_layer))
    params = fixed + layers * per_layer
    return {"dim": dim, "n_layers": layers, "n_heads": heads, "vocab_size": vocab,
            "seq_len": seq, "params": params, "state_bytes": 12 * params}


def _build(shape: dict[str, int], *, mesh: Any = None, total_steps: int = 20
           ) -> tuple[Any, Any, Any]:
    mod = _trainer_module()
    cfg = mod.GPTConfig(vocab_size=shape["vocab_size"], dim=shape["dim"],
                        n_layers=shape["n_layers"], n_heads=shape["n_heads"],
                        seq_len=shape["seq_len"], lr=6e-4)
    model = mod.build_model(cfg, seed=0, mesh=mesh)
    opt, sched = mod.build_optimizer_and_scheduler(model, lr=cfg.lr, total_steps=total_steps)
    return mod, model, (opt, sched)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _machine() -> dict[str, Any]:
    import torch

    basics = machine_basics(("MemTotal", "MemAvailable"))
    mem = {k: v for k, v in basics.items() if k.endswith("_kib")}
    cpu = basics["cpu_model"]
    versions = {}
    for name in ("boto3", "botocore", "s3fs", "aiobotocore", "fsspec", "moto", "zstandard",
                 "awscrt"):
        with contextlib.suppress(Exception):
            from importlib.metadata import version

            versions[name] = version(name)
    import aegis

    src = Path(aegis.__file__).resolve().parent
    git: dict[str, Any] = {"aegis_imported_from": str(src)}
    with contextlib.suppress(Exception):
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "aegis"],
                               capture_output=True, text=True, check=True).stdout.strip()
        git.update(repo_head=head, repo_aegis_uncommitted_changes=bool(dirty))
    return {"cpu_count": os.cpu_count(), "cpu_model": cpu, **mem, "torch": torch.__version__,
            "python": platform.python_version(), "platform": platform.platform(), "device": "cpu",
            "packages": versions, "aegis": git}


# -- the moto S3 server ------------------------------------------------------------------------


class MotoServer:
    """moto's S3 server as a separate process on a loopback port (as tests/conftest.py does)."""

    def __init__(self) -> None:
        self.port = _free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        moto = Path(sys.executable).with_name("moto_server")
        self.proc = subprocess.Popen([str(moto), "-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.stop()
                    raise RuntimeError("moto_server did not start") from None
                time.sleep(0.1)

    @property
    def env(self) -> dict[str, str]:
        return {**S3_ENV, "AWS_ENDPOINT_URL": self.endpoint}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# -- 1. training state -------------------------------------------------------------------------


def train_state(args: argparse.Namespace, shape: dict[str, int], path: Path) -> dict[str, Any]:
    """Train in this process; save {"model", "optim"} (FQN-keyed full state dicts) to ``path``."""
    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.set_num_threads(os.cpu_count() or 1)
    mod, model, (opt, sched) = _build(shape, total_steps=args.train_steps)
    data = mod.SyntheticTokens(shape["vocab_size"], shape["seq_len"], seed=0)
    t0 = time.perf_counter()
    losses = []
    for step in range(args.train_steps):
        x, y = data.batch(list(range(step * args.batch_size, (step + 1) * args.batch_size)))
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, shape["vocab_size"]),
                                                 y.reshape(-1))
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    train_s = time.perf_counter() - t0
    msd, osd = get_state_dict(model, opt)
    torch.save({"model": msd, "optim": osd}, path)
    return {"model": msd, "optim": osd, "losses": losses, "train_s": train_s}


# -- 2. codec table ----------------------------------------------------------------------------


def _chunks(tensors: list[Any], chunk: int) -> list[bytes]:
    import torch

    flat = torch.cat([t.detach().reshape(-1).contiguous().view(torch.uint8) for t in tensors])
    raw = flat.numpy().tobytes()
    return [raw[i:i + chunk] for i in range(0, len(raw), chunk)]


def codec_table(state: dict[str, Any], chunk_bytes: int, level: int) -> list[dict[str, Any]]:
    import torch

    from aegis.snapshot.codec import Codec, decode

    names = list(state["model"])
    weights = [state["model"][n].float() for n in names]
    moments = state["optim"]["state"]
    kinds: dict[str, tuple[list[Any], str]] = {
        KINDS[0]: (weights, "float32"),
        KINDS[1]: ([w.to(torch.bfloat16) for w in weights], "bfloat16"),
        KINDS[2]: ([moments[n]["exp_avg"] for n in names if n in moments], "float32"),
        KINDS[3]: ([moments[n]["exp_avg_sq"] for n in names if n in moments], "float32"),
    }
    rows = []
    for kind, (tensors, dtype) in kinds.items():
        zero_frac = sum(int((t == 0).sum()) for t in tensors) / sum(t.numel() for t in tensors)
        chunks = _chunks(tensors, chunk_bytes)
        raw_total = sum(len(c) for c in chunks)
        for mode in MODES:
            codec = Codec(mode, level)
            stored = 0
            enc_s = dec_s = 0.0
            for c in chunks:
                t = time.perf_counter()
                blob, desc = codec.encode(c, dtype)
                enc_s += time.perf_counter() - t
                t = time.perf_counter()
                out = decode(blob, desc, len(c))
                dec_s += time.perf_counter() - t
                if out != c:
                    raise RuntimeError(f"codec {mode} did not round-trip a {kind} chunk")
                stored += len(blob)
            rows.append({
                "kind": kind, "dtype": dtype, "mode": mode, "chunks": len(chunks),
                "raw_bytes": raw_total, "stored_bytes": stored,
                "stored_fraction": stored / raw_total, "ratio": raw_total / stored,
                "encode_mbps": raw_total / MB / enc_s if enc_s else None,
                "decode_mbps": raw_total / MB / dec_s if dec_s else None,
                "zero_fraction": zero_frac,
            })
    return rows


# -- multi-rank runner (the pattern of tests/dist_utils.py) ------------------------------------


def _worker(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple[Any, ...],
            env: dict[str, str], queue: Any) -> None:
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1",
    )
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        result = fn(rank, world, *args)
        queue.put((rank, True, pickle.dumps(result)))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        queue.put((rank, False, pickle.dumps(f"{type(e).__name__}: {e}\n{traceback.format_exc()}")))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(world: int, fn: Callable[..., Any], *args: Any, timeout: float,
              env: dict[str, str] | None = None) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned gloo ranks; results by rank, or raise."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, fn, args, env or {}, queue),
                         daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world:
            try:
                rank, ok, value = queue.get(timeout=0.5)
                results[rank] = (ok, pickle.loads(value))
                continue
            except queue_mod.Empty:
                pass
            dead = [r for r, p in enumerate(procs)
                    if r not in results and p.exitcode not in (None, 0)]
            if dead:
                codes = [procs[r].exitcode for r in dead]
                raise RuntimeError(f"rank(s) {dead} died: exit codes {codes}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"ranks {sorted(set(range(world)) - results.keys())} did not "
                                   f"finish in {timeout} s")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    failures = {r: v for r, (ok, v) in results.items() if not ok}
    if failures:
        raise RuntimeError("\n".join(f"rank {r} failed: {v}" for r, v in sorted(failures.items())))
    return [results[r][1] for r in range(world)]


# -- rank functions ----------------------------------------------------------------------------


def _fsdp(world: int, shape: dict[str, int]) -> tuple[Any, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    _, model, (opt, _) = _build(shape, mesh=mesh)
    return model, opt


def _sharded(model: Any, opt: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def _digest(sd: dict[str, Any]) -> tuple[str, int]:
    """(crc32 of every local tensor's bytes in key order, local tensor bytes)."""
    import torch
    from torch.distributed.tensor import DTensor

    crc, nbytes = 0, 0

    def walk(prefix: str, obj: Any) -> None:
        nonlocal crc, nbytes
        if isinstance(obj, dict):
            for k in sorted(obj, key=str):
                walk(f"{prefix}.{k}", obj[k])
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(f"{prefix}.{i}", v)
        elif isinstance(obj, torch.Tensor):
            t = obj.to_local() if isinstance(obj, DTensor) else obj
            b = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
            crc = zlib.crc32(prefix.encode(), zlib.crc32(b.tobytes(), crc))
            nbytes += b.nbytes

    walk("", sd)
    return f"{crc:08x}", nbytes


def _manager(job: str, model: Any, opt: Any, store_dir: str, url: str, events: str) -> Any:
    from aegis import Manager, ModelOptimizerState

    return Manager(job, {"model": ModelOptimizerState(model, opt)}, store_dir=store_dir,
                   durable=url, durable_every=1, events_dir=events, verbose=False)


def _rank_save(rank: int, world: int, shape: dict[str, int], state_path: str,
               targets: list[dict[str, str]], dcp_url: str | None, s3kw: dict[str, Any]
               ) -> dict[str, Any]:
    """Load the trained state into FSDP2; for each target: Manager save(1) + wait_durable();
    then (optionally) dcp.save of the same sharded state to S3 through fsspec."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    model, opt = _fsdp(world, shape)
    full = torch.load(state_path, mmap=True, weights_only=True)
    set_state_dict(model, opt, model_state_dict=full["model"], optim_state_dict=full["optim"],
                   options=StateDictOptions(full_state_dict=True))
    del full
    digest, nbytes = _digest(_sharded(model, opt))
    out: dict[str, Any] = {"digest": digest, "tensor_bytes": nbytes, "targets": {}}
    for tgt in targets:
        mgr = _manager(JOB, model, opt, tgt["store_dir"], tgt["url"], tgt["events"])
        dist.barrier()
        t0 = time.perf_counter()
        mgr.save(1)
        save_s = time.perf_counter() - t0
        mgr.wait()
        commit_s = time.perf_counter() - t0
        mgr.wait_durable()
        durable_s = time.perf_counter() - t0
        mgr.close()
        out["targets"][tgt["name"]] = {"save_blocking_s": save_s, "commit_s": commit_s,
                                       "save_to_durable_s": durable_s}
    if dcp_url is not None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        sd = _sharded(model, opt)
        dist.barrier()
        t0 = time.perf_counter()
        dcp.save(sd, storage_writer=FsspecWriter(dcp_url, **s3kw))
        dist.barrier()
        out["dcp_save_s"] = time.perf_counter() - t0
    return out


def _rank_restore(rank: int, world: int, shape: dict[str, int], how: str, url: str, store_dir: str,
                  events: str, s3kw: dict[str, Any]) -> dict[str, Any]:
    """Fresh processes after whole-job loss: restore through aegis (``how="aegis"``) or DCP."""
    import torch
    import torch.distributed as dist

    torch.manual_seed(1234 + rank)
    model, opt = _fsdp(world, shape)
    with torch.no_grad():  # a different starting point, so a no-op restore cannot pass the check
        for p in model.parameters():
            p.mul_(0.5)
    out: dict[str, Any] = {}
    if how == "aegis":
        t0 = time.perf_counter()
        mgr = _manager(JOB, model, opt, store_dir, url, events)
        out["manager_init_s"] = time.perf_counter() - t0
        dist.barrier()
        t0 = time.perf_counter()
        step = mgr.restore()
        out["restore_s"] = time.perf_counter() - t0
        res = mgr.last_restore
        out["step"] = step
        out["timings"] = dict(res.timings) if res else {}
        out["tiers"] = sorted({s["tier"] for s in res.sources}) if res else []
        out["bytes_read"] = res.bytes_read if res else 0
        mgr.close()
    else:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
        from torch.distributed.checkpoint.state_dict import set_state_dict

        dist.barrier()
        t0 = time.perf_counter()
        sd = _sharded(model, opt)
        dcp.load(sd, storage_reader=FsspecReader(url, **s3kw))
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        dist.barrier()
        out["restore_s"] = time.perf_counter() - t0
        out["step"] = 1
    out["digest"], out["tensor_bytes"] = _digest(_sharded(model, opt))
    return out


# -- 4. download -------------------------------------------------------------------------------


def download(url: str) -> dict[str, Any]:
    from aegis.snapshot.durable import fetch_chunks, list_steps, read_manifest
    from aegis.snapshot.objstore import open_store

    store = open_store(url)
    try:
        step = list_steps(store, JOB)[0][-1]
        manifest = read_manifest(store, JOB, step)
        raw = stored = 0
        t0 = time.perf_counter()
        for shard in manifest.shards:
            buf = bytearray(shard.size)
            stored += fetch_chunks(store, JOB, manifest, shard.rank, range(len(shard.chunks)),
                                   memoryview(buf))
            raw += sum(c.length for c in shard.chunks)
        secs = time.perf_counter() - t0
    finally:
        store.close()
    return {"raw_bytes": raw, "stored_bytes": stored, "seconds": secs,
            "raw_mbps": raw / MB / secs, "stored_mbps": stored / MB / secs}


# -- printing ----------------------------------------------------------------------------------


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))
    out = [line, "  ".join("-" * w for w in widths)]
    for r in rows:
        cells = zip(r, widths, strict=True)
        out.append("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(cells)))
    return "\n".join(out)


def _f(x: float | None, fmt: str = ".1f") -> str:
    return "-" if x is None else format(x, fmt)


# -- main --------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    t_start = time.perf_counter()
    load_before = os.getloadavg()
    shape = model_shape(args.mb, seq=args.seq_len)
    work = Path(tempfile.mkdtemp(prefix="aegis-bench-durable-"))
    shm = Path(tempfile.mkdtemp(prefix="aegis-bench-durable-", dir="/dev/shm"))
    moto: MotoServer | None = None
    doc: dict[str, Any] = {
        "command": shlex.join([sys.executable, *sys.argv]) if argv is None
        else shlex.join([sys.executable, str(Path(__file__)), *argv]),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "machine": _machine(),
        "model": shape,
    }
    try:
        # 1. training state
        print(f"model: TinyGPT dim {shape['dim']} x {shape['n_layers']} layers, vocab "
              f"{shape['vocab_size']}, {shape['params'] / 1e6:.1f}M params, state "
              f"{shape['state_bytes'] / MB:.0f} MB; training {args.train_steps} steps ...",
              flush=True)
        state_path = shm / "trained.pt"
        state = train_state(args, shape, state_path)
        doc["training"] = {"steps": args.train_steps, "batch_size": args.batch_size,
                           "seq_len": args.seq_len, "seconds": state["train_s"],
                           "loss_first": state["losses"][0], "loss_last": state["losses"][-1]}
        print(f"trained in {state['train_s']:.1f} s, loss {state['losses'][0]:.3f} -> "
              f"{state['losses'][-1]:.3f}", flush=True)

        # 2. codec table
        rows = codec_table(state, args.chunk_mib << 20, args.level)
        del state
        doc["codec"] = rows
        bf16 = next(r for r in rows if r["kind"] == KINDS[1] and r["mode"] == "planes")
        codec_pass = bf16["stored_fraction"] <= TARGET_BF16_FRACTION
        doc["targets"] = {"bf16_planes_stored_fraction": {
            "value": bf16["stored_fraction"], "target": f"<= {TARGET_BF16_FRACTION}",
            "pass": codec_pass}}
        print(f"\ncodec (zstd level {args.level}, {args.chunk_mib} MiB chunks, 1 thread; MB/s "
              "of raw bytes)")
        print(_table(
            ["kind", "mode", "chunks", "raw MB", "stored frac", "ratio", "enc MB/s", "dec MB/s",
             "zeros"],
            [[r["kind"], r["mode"], str(r["chunks"]), _f(r["raw_bytes"] / MB),
              _f(r["stored_fraction"], ".3f"), _f(r["ratio"], ".2f"),
              *(("-", "-") if r["mode"] == "raw" else (_f(r["encode_mbps"], ".0f"),
                                                       _f(r["decode_mbps"], ".0f"))),
              _f(r["zero_fraction"], ".3f")] for r in rows]))
        print("raw: no copy, speeds not meaningful (in the JSON only); zeros: fraction of elements "
              "exactly 0 (embedding rows no token touched yet keep zero moments)")
        print(f"target bf16 weights, byte planes: stored {bf16['stored_fraction']:.3f} of raw "
              f"(<= {TARGET_BF16_FRACTION}): {'PASS' if codec_pass else 'FAIL'}", flush=True)

        # 3. upload
        moto = MotoServer()
        os.environ.update(moto.env)
        import boto3

        bucket = f"aegis-bench-{uuid.uuid4().hex[:10]}"
        boto3.client("s3").create_bucket(Bucket=bucket)
        s3kw = {"client_kwargs": {"endpoint_url": moto.endpoint}, "key": "testing",
                "secret": "testing"}
        dcp_ok = not args.skip_dcp
        dcp_note = "skipped (--skip-dcp)" if args.skip_dcp else None
        if dcp_ok:
            try:
                import s3fs  # noqa: F401
            except ImportError as e:
                dcp_ok, dcp_note = False, f"not measured: s3fs is not installed ({e})"
        urls = {"s3": f"s3://{bucket}/aegis", "file": f"file://{work}/durable"}
        targets = [{"name": n, "url": u, "store_dir": str(shm / f"store-{n}"),
                    "events": str(work / f"events-{n}")} for n, u in urls.items()]
        dcp_url = f"s3://{bucket}/dcp" if dcp_ok else None
        print(f"\nsaving on 2 ranks to {', '.join(urls.values())}"
              + (f" and dcp.save to {dcp_url}" if dcp_url else "") + " ...", flush=True)
        saved = run_ranks(2, _rank_save, shape, str(state_path), targets, dcp_url, s3kw,
                          timeout=args.timeout, env=moto.env)
        state_path.unlink()
        digests = [r["digest"] for r in saved]
        state_bytes = sum(r["tensor_bytes"] for r in saved)
        from aegis.training.events import read_events

        upload: dict[str, Any] = {}
        for tgt in targets:
            evs = []
            for rank in range(2):
                evs += [e for e in read_events(Path(tgt["events"]) / f"rank-{rank:05d}.jsonl")
                        if e.get("event") == "upload"]
            if len(evs) != 2 or not all(e.get("committed") for e in evs):
                raise RuntimeError(f"{tgt['name']}: expected 2 committed upload events, got {evs}")
            raw = sum(e["raw_bytes"] for e in evs)
            stored = sum(e["stored_bytes"] for e in evs)
            secs = max(e["seconds"] for e in evs)
            upload[tgt["name"]] = {
                "url": tgt["url"], "raw_bytes": raw, "stored_bytes": stored,
                "stored_fraction": stored / raw, "seconds": secs, "raw_mbps": raw / MB / secs,
                "encode_s_per_rank": [e["encode_s"] for e in evs],
                "requests": sum(e["requests"] for e in evs),
                "retries": sum(e["retries"] for e in evs),
                "per_rank": [{k: e[k] for k in ("raw_bytes", "stored_bytes", "seconds", "encode_s",
                                                "requests", "retries")} for e in evs],
                "save_to_durable_s_rank0": saved[0]["targets"][tgt["name"]]["save_to_durable_s"],
                "save_blocking_s_rank0": saved[0]["targets"][tgt["name"]]["save_blocking_s"],
            }
            shutil.rmtree(tgt["store_dir"], ignore_errors=True)  # whole-job loss: node stores gone
        if dcp_ok:
            secs = saved[0]["dcp_save_s"]
            upload["dcp-s3"] = {"url": dcp_url, "raw_bytes": state_bytes, "seconds": secs,
                                "raw_mbps": state_bytes / MB / secs}
        doc["state_tensor_bytes"] = state_bytes
        doc["upload"] = upload

        # 4. download
        down = {n: download(u) for n, u in urls.items()}
        doc["download"] = down

        # 5. restore after whole-job loss
        restore: dict[str, Any] = {}
        runs = [("aegis-s3", "aegis", urls["s3"]), ("aegis-file", "aegis", urls["file"])]
        if dcp_url is not None:
            runs.append(("dcp-s3", "dcp", dcp_url))
        for name, how, url in runs:
            print(f"restoring {name} in fresh processes ...", flush=True)
            store_dir = shm / f"restore-{name}"
            res = run_ranks(2, _rank_restore, shape, how, url, str(store_dir),
                            str(work / f"events-restore-{name}"), s3kw, timeout=args.timeout,
                            env=moto.env)
            shutil.rmtree(store_dir, ignore_errors=True)
            secs = max(r["restore_s"] for r in res)
            restore[name] = {
                "url": url, "seconds": secs, "raw_mbps": state_bytes / MB / secs,
                "bitwise_equal": [r["digest"] for r in res] == digests,
                "step": res[0]["step"],
                **({"tiers": res[0]["tiers"],
                    "manager_init_s": max(r["manager_init_s"] for r in res),
                    "timings_rank0": res[0]["timings"]} if how == "aegis" else {}),
            }
        if not dcp_ok:
            restore["dcp-s3"] = {"measured": False, "why": dcp_note}
        doc["restore"] = restore

        print(f"\ndurable tier, 2 ranks, state {state_bytes / MB:.0f} MB (MB/s of raw bytes)")
        trows = []
        for n in urls:
            u, d, r = upload[n], down[n], restore[f"aegis-{n}"]
            trows.append([n, _f(u["stored_fraction"], ".3f"), _f(u["seconds"], ".2f"),
                          _f(u["raw_mbps"], ".0f"), _f(d["seconds"], ".2f"),
                          _f(d["raw_mbps"], ".0f"),
                          _f(r["seconds"], ".2f"), _f(r["raw_mbps"], ".0f"),
                          "yes" if r["bitwise_equal"] else "NO"])
        if dcp_ok:
            u, r = upload["dcp-s3"], restore["dcp-s3"]
            trows.append(["dcp over s3fs", "1 (raw)", _f(u["seconds"], ".2f"),
                          _f(u["raw_mbps"], ".0f"),
                          "-", "-", _f(r["seconds"], ".2f"), _f(r["raw_mbps"], ".0f"),
                          "yes" if r["bitwise_equal"] else "NO"])
        print(_table(["store", "stored frac", "upload s", "up MB/s", "download s", "down MB/s",
                      "restore s", "restore MB/s", "bitwise"], trows))
        if not dcp_ok:
            print(f"DCP over S3: {dcp_note}")
        r = restore["aegis-s3"]
        print("aegis restore from s3, rank 0 phases: " + ", ".join(
            f"{k} {v:.2f}" for k, v in r["timings_rank0"].items()) + f" (tiers {r['tiers']})")
        if dcp_ok:
            print(f"restore from s3: aegis {restore['aegis-s3']['seconds']:.2f} s vs dcp.load "
                  f"{restore['dcp-s3']['seconds']:.2f} s "
                  f"({restore['dcp-s3']['seconds'] / restore['aegis-s3']['seconds']:.2f}x)")
    finally:
        if moto is not None:
            moto.stop()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)

    load_after = os.getloadavg()
    doc["loadavg_1m"] = {"before": load_before[0], "after": load_after[0]}
    doc["seconds"] = time.perf_counter() - t_start
    print(f"\nload average (1 min): {load_before[0]:.2f} before, {load_after[0]:.2f} after "
          f"(other work on the machine distorts timings); total {doc['seconds']:.0f} s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
