"""Helpers shared by the bench scripts: spawned gloo ranks, the loopback S3 server, the reference
trainer's model, result documents, tables. Every script is ``main(argv)`` that prints a table,
writes ``bench/results/<name>.json`` and its plot (see run_all.py)."""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import queue as queue_mod
import shlex
import socket
import subprocess
import sys
import threading
import time
import traceback
import uuid
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from _machine import ROOT, load1, machine  # noqa: E402 - bench/ is on sys.path as a script

BENCH = ROOT / "bench"
RESULTS = BENCH / "results"
TRAINER = ROOT / "examples" / "train_fsdp.py"
MB = 1e6
S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- result documents ---------------------------------------------------------------------------


def python() -> str:
    """This interpreter, relative to the repository when it is the project's venv."""
    exe = Path(sys.executable)
    return str(exe.relative_to(ROOT)) if exe.is_relative_to(ROOT) else str(exe)


def new_doc(bench: str, script: str, argv: Sequence[str], args: Any) -> dict[str, Any]:
    """The header every result carries: exact command, arguments, machine, load at the start."""
    return {
        "bench": bench,
        "command": shlex.join([python(), str(Path(script).resolve().relative_to(ROOT)), *argv]),
        "cwd": str(ROOT),
        "argv": list(argv),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "machine": machine(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "loadavg_1m": {"start": load1()},
        "t_start": time.time(),
        "errors": {},
    }


def write_doc(doc: dict[str, Any], out: Path) -> None:
    """Finish ``doc`` (wall time, load at the end) and write it atomically."""
    doc["loadavg_1m"]["end"] = load1()
    doc["wall_s"] = time.time() - doc["t_start"]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    os.replace(tmp, out)
    print(f"wrote {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")


def size_arg(p: Any) -> None:
    p.add_argument("--size", type=float, default=1.0,
                   help="multiply the state sizes (default 1: fits this 2-core machine)")


# -- tables -------------------------------------------------------------------------------------


def f(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def text_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(headers)]
    out = ["  ".join(h.ljust(w) if i == 0 else h.rjust(w)
                     for i, (h, w) in enumerate(zip(headers, widths, strict=True))),
           "  ".join("-" * w for w in widths)]
    for r in rows:
        out.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                             for i, (c, w) in enumerate(zip(r, widths, strict=True))))
    return "\n".join(out)


def md_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    out = ["| " + " | ".join(headers) + " |",
           "|" + "|".join("---" if i == 0 else "---:" for i in range(len(headers))) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


# -- the reference trainer's model ----------------------------------------------------------------


def trainer_module() -> Any:
    """examples/train_fsdp.py, imported by path (importing it has no side effects)."""
    if "train_fsdp" in sys.modules:
        return sys.modules["train_fsdp"]
    spec = importlib.util.spec_from_file_location("train_fsdp", TRAINER)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["train_fsdp"] = mod
    spec.loader.exec_module(mod)
    return mod


MAX_LAYERS = 32  # deeper and a step is launch-bound: see gpt_shape


def gpt_shape(state_mb: float, *, dim: int | None = None, heads: int | None = None,
              vocab: int = 2048, seq: int = 64) -> dict[str, int]:
    """TinyGPT layers so that params x 12 bytes (fp32 param + exp_avg + exp_avg_sq) ~ state_mb
    (at least one layer: the smallest state is the embeddings plus one block).

    Without ``dim``, the narrowest width of 256, 512, 768, 1024, 1536, 2048, 3072, 4096 that
    needs at most ``MAX_LAYERS`` blocks (``heads`` = dim / 64, at least 4). With the width fixed
    at 256, a 167M-parameter model was 212 blocks of 256: each a separate FSDP unit, every step
    launch-bound (thousands of small kernels and per-unit hooks), which is why
    ``bench/throughput.py --device cuda --state-mb 2000`` did not finish 2 x 40 steps in 120 s on
    an H200 (issue 23; the states of ``make bench`` here stay at width 256)."""
    if dim is None:
        for dim in (256, 512, 768, 1024, 1536, 2048, 3072, 4096):  # noqa: B007 - kept below
            fixed = 2 * vocab * dim + seq * dim + 2 * dim
            if (state_mb * MB / 12 - fixed) / (12 * dim * dim + 13 * dim) <= MAX_LAYERS:
                break
    heads = heads if heads is not None else max(4, dim // 64)
    fixed = 2 * vocab * dim + seq * dim + 2 * dim  # tok_emb, head, pos_emb, ln_f
    per_layer = 12 * dim * dim + 13 * dim
    layers = max(1, round((state_mb * MB / 12 - fixed) / per_layer))
    params = fixed + layers * per_layer
    return {"dim": dim, "n_layers": layers, "n_heads": heads, "vocab_size": vocab,
            "seq_len": seq, "params": params, "state_bytes": 12 * params}


def gpt_config(shape: dict[str, int]) -> Any:
    mod = trainer_module()
    return mod.GPTConfig(vocab_size=shape["vocab_size"], dim=shape["dim"],
                         n_layers=shape["n_layers"], n_heads=shape["n_heads"],
                         seq_len=shape["seq_len"], lr=6e-4)


def build_gpt(shape: dict[str, int], *, mesh: Any = None, total_steps: int = 1000
              ) -> tuple[Any, Any, Any]:
    """(model, optimizer, scheduler) of the reference trainer, FSDP2-sharded over ``mesh``."""
    mod = trainer_module()
    model = mod.build_model(gpt_config(shape), seed=0, mesh=mesh)
    opt, sched = mod.build_optimizer_and_scheduler(model, lr=6e-4, total_steps=total_steps)
    return model, opt, sched


def gpt_train_step(model: Any, opt: Any, data: Any, step: int, batch: int, rank: int = 0,
                   world: int = 1, device: Any = None) -> float:
    """One step of the reference trainer's loop (forward, backward, optimizer step)."""
    import torch.nn.functional as F

    start = (step * world + rank) * batch
    x, y = data.batch(list(range(start, start + batch)))
    if device is not None:
        x, y = x.to(device), y.to(device)
    logits = model(x)
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach())


def sharded_state(model: Any, opt: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


ALIGN = 64  # the shard format's tensor alignment: the memcpy floors copy into the same layout


def aligned_nbytes(tensors: Sequence[Any]) -> int:
    """Bytes of one buffer holding ``tensors`` back to back, each at an ``ALIGN``-byte offset."""
    return sum((t.numel() * t.element_size() + ALIGN - 1) // ALIGN * ALIGN for t in tensors)


def aligned_views(buf: Any, tensors: Sequence[Any]) -> list[Any]:
    """Views of the uint8 ``buf`` shaped like ``tensors``, laid out as :func:`aligned_nbytes`."""
    views, off = [], 0
    for t in tensors:
        n = t.numel() * t.element_size()
        views.append(buf[off:off + n].view(t.dtype).view(t.shape))
        off += (n + ALIGN - 1) // ALIGN * ALIGN
    return views


def digest(sd: dict[str, Any]) -> tuple[str, int]:
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
            b = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
            crc = zlib.crc32(prefix.encode(), zlib.crc32(b.tobytes(), crc))
            nbytes += b.nbytes

    walk("", sd)
    return f"{crc:08x}", nbytes


# -- spawned ranks (the pattern of tests/dist_utils.py) --------------------------------------------


def _worker(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple[Any, ...],
            env: dict[str, str], rank_env: dict[str, str], queue: Any) -> None:
    os.environ.update(env)
    os.environ.update(rank_env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
        OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
    )
    import faulthandler
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    faulthandler.dump_traceback_later(float(env.get("BENCH_DUMP_AFTER", "900")), exit=False)
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    try:
        if torch.cuda.is_available() and os.environ.get("BENCH_DEVICE") == "cuda":
            torch.cuda.set_device(rank % torch.cuda.device_count())
            dist.init_process_group("cpu:gloo,cuda:nccl", rank=rank, world_size=world)
        else:
            dist.init_process_group("gloo", rank=rank, world_size=world)
        result = fn(rank, world, *args)
        queue.put((rank, True, pickle.dumps(result)))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        queue.put((rank, False, pickle.dumps(f"{type(e).__name__}: {e}\n{traceback.format_exc()}")))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(world: int, fn: Callable[..., Any], *args: Any, timeout: float,
              env: dict[str, str] | None = None,
              rank_env: Callable[[int], dict[str, str]] | None = None) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned gloo ranks; results by rank, or raise
    (naming the ranks) when one fails, dies or overruns ``timeout`` seconds."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, fn, args, env or {},
                                               rank_env(r) if rank_env else {}, queue),
                         daemon=False) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world:
            try:
                rank, ok, value = queue.get(timeout=0.5)
                results[rank] = (ok, pickle.loads(value))
                if not ok:
                    break  # the others would wait forever in a collective
                continue
            except queue_mod.Empty:
                pass
            dead = [r for r, p in enumerate(procs)
                    if r not in results and p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"rank(s) {dead} died: exit codes "
                                   f"{[procs[r].exitcode for r in dead]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"ranks {sorted(set(range(world)) - results.keys())} did not "
                                   f"finish in {timeout:.0f} s")
    finally:
        for p in procs:
            p.join(timeout=30 if len(results) == world else 2)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    failures = {r: v for r, (ok, v) in results.items() if not ok}
    if failures:
        raise RuntimeError("\n".join(f"rank {r} failed: {v}" for r, v in sorted(failures.items())))
    return [results[r][1] for r in range(world)]


# -- the loopback S3 server ----------------------------------------------------------------------


class MotoServer:
    """moto's S3 server as a separate process on a loopback port (as tests/conftest.py does)."""

    def __init__(self) -> None:
        self.port = free_port()
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

    def s3fs_kwargs(self) -> dict[str, Any]:
        """fsspec/s3fs options for DCP's FsspecWriter/FsspecReader against this server."""
        return s3fs_kwargs(self.endpoint)

    def bucket(self) -> str:
        """A fresh bucket; returns its name."""
        import boto3

        name = f"aegis-bench-{uuid.uuid4().hex[:10]}"
        boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                     aws_access_key_id="testing",
                     aws_secret_access_key="testing").create_bucket(Bucket=name)
        return name

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> MotoServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def s3fs_kwargs(endpoint: str) -> dict[str, Any]:
    return {"client_kwargs": {"endpoint_url": endpoint}, "key": S3_ENV["AWS_ACCESS_KEY_ID"],
            "secret": S3_ENV["AWS_SECRET_ACCESS_KEY"]}


def have_s3fs() -> str | None:
    """None when s3fs imports, else why not (DCP over S3 is then reported as not measured)."""
    try:
        import s3fs  # noqa: F401
    except ImportError as e:
        return f"s3fs is not installed ({e}); pip install -e '.[bench]'"
    return None


# -- noise ---------------------------------------------------------------------------------------


class ForeignCpu:
    """Samples, every ``interval`` s, the CPU time used by processes that are not this one or
    its descendants (other people's jobs on the machine), so each phase can say how much
    noise it had. A lower bound: a foreign process's last interval before it exits is lost."""

    def __init__(self, interval: float = 0.5) -> None:
        self.me = os.getpid()
        self.interval = interval
        self.tick = os.sysconf("SC_CLK_TCK")
        self.total = 0.0  # foreign CPU seconds since start
        self.by_cmd: dict[str, float] = {}
        self._prev: dict[int, int] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._sample(count=False)
        self._thread = threading.Thread(target=self._run, name="foreign-cpu", daemon=True)
        self._thread.start()

    def _sample(self, count: bool = True) -> None:
        procs: dict[int, tuple[int, int]] = {}
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                with open(f"/proc/{d}/stat") as fh:
                    f_ = fh.read().rsplit(")", 1)[1].split()
                procs[int(d)] = (int(f_[1]), int(f_[11]) + int(f_[12]))
            except (OSError, IndexError, ValueError):
                continue
        mine: dict[int, bool] = {}

        def is_mine(pid: int) -> bool:
            chain = []
            p = pid
            while p not in mine and p != self.me and p > 1 and p in procs:
                chain.append(p)
                p = procs[p][0]
            answer = mine.get(p, p == self.me)
            for c in chain:
                mine[c] = answer
            return answer

        with self._lock:
            for pid, (_, ticks) in procs.items():
                # every pid's previous value is kept, so a worker of ours that is re-parented
                # to init when its agent is killed only counts what it uses from then on
                delta = ticks - self._prev.get(pid, 0)
                self._prev[pid] = ticks
                if count and delta > 0 and not is_mine(pid):
                    secs = delta / self.tick
                    self.total += secs
                    try:
                        with open(f"/proc/{pid}/cmdline", "rb") as fh:
                            cmd = fh.read().replace(b"\0", b" ").decode(errors="replace")[:80]
                    except OSError:
                        cmd = str(pid)
                    self.by_cmd[cmd] = self.by_cmd.get(cmd, 0.0) + secs

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def mark(self) -> tuple[float, float, dict[str, float]]:
        with self._lock:
            return time.time(), self.total, dict(self.by_cmd)

    def since(self, m: tuple[float, float, dict[str, float]]) -> dict[str, Any]:
        now, total, by_cmd = self.mark()
        top = sorted(((v - m[2].get(k, 0.0), k) for k, v in by_cmd.items()), reverse=True)[:3]
        wall = now - m[0]
        return {"wall_s": wall, "foreign_cpu_s": total - m[1],
                "foreign_cpus": (total - m[1]) / wall if wall else 0.0,
                "top": [{"cmd": k, "cpu_s": v} for v, k in top if v > 0.05]}

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def plt() -> Any:
    """matplotlib.pyplot on the Agg backend (no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as pyplot

    return pyplot
