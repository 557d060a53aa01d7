"""Run a function on N real gloo ranks (separate processes) and collect the results.

Like torchsnapshot's ``run_with_pet``: every rank is a fresh process with its own
``torch.distributed`` gloo group on loopback; exceptions come back with the rank's traceback.

Ranks are forked from a multiprocessing fork server that has imported torch and aegis once (a
spawned interpreter spends ~2 CPU-seconds importing torch; the suite starts hundreds of ranks
on two cores). The server itself never initializes a process group, threads or CUDA. Each rank
takes the test process's environment as it is at ``run_ranks`` (as a spawned one would), not
the server's, and its stdout/stderr go to files that ``run_ranks`` copies to its own fds 1 and 2
when the ranks are done (a forked rank would otherwise write wherever the server's were, and
``capfd`` would not see a rank's console output).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import queue as queue_mod
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint", "aegis",
            "aegis.training.manager", "tests.models"]
_ctx: Any = None


def _context() -> Any:
    """The fork-server context (started once per test process, with torch and aegis loaded)."""
    global _ctx
    if _ctx is None:
        _ctx = mp.get_context("forkserver")
        _ctx.set_forkserver_preload(_PRELOAD)
    return _ctx


def _worker(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple[Any, ...],
            env: dict[str, str], queue: Any, parent_env: dict[str, str] | None = None,
            stdio: tuple[str, str] | None = None) -> None:
    if stdio is not None:  # this rank's console output, for run_ranks to pass on
        for fd, path in zip((1, 2), stdio, strict=True):
            f = os.open(path, os.O_WRONLY | os.O_APPEND)
            os.dup2(f, fd)
            os.close(f)
    if parent_env is not None:  # the caller's environment now, not the fork server's
        os.environ.clear()
        os.environ.update(parent_env)
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1",
    )
    import faulthandler

    import torch
    import torch.distributed as dist

    # A crashed rank (a segfault) prints its threads' Python stacks into its stderr, which the
    # test shows; a hung rank prints every thread's stack before the test gives up on it.
    faulthandler.enable()
    faulthandler.dump_traceback_later(float(env.get("AEGIS_TEST_DUMP_AFTER", "100")), exit=False)
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        result = fn(rank, world, *args)
        # Plain pickle bytes: torch's queue reducers share tensors through fds that vanish
        # when this process exits.
        queue.put((rank, True, pickle.dumps(result)))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        queue.put((rank, False, pickle.dumps(f"{type(e).__name__}: {e}\n{traceback.format_exc()}")))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(world: int, fn: Callable[..., Any], *args: Any, timeout: float = 120.0,
              env: dict[str, str] | None = None) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` ranks; return results by rank, or raise."""
    ctx = _context()
    queue = ctx.Queue()
    port = free_port()
    parent_env = dict(os.environ)
    stdio = []
    for r in range(world):
        pair = []
        for what in ("out", "err"):
            fd, path = tempfile.mkstemp(prefix=f"aegis-rank{r}-", suffix=f".{what}")
            os.close(fd)
            pair.append(path)
        stdio.append((pair[0], pair[1]))
    procs = [
        ctx.Process(target=_worker, args=(r, world, port, fn, args, env or {}, queue, parent_env,
                                          stdio[r]), daemon=True)
        for r in range(world)
    ]
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
            dead = [r for r, p in enumerate(procs) if r not in results and p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"rank(s) {dead} died with exit codes {[procs[r].exitcode for r in dead]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"ranks {sorted(set(range(world)) - results.keys())} did not finish in {timeout} s")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
        for pair in stdio:
            for fd, path in zip((1, 2), pair, strict=True):
                with contextlib.suppress(OSError):
                    with open(path, "rb") as f:
                        data = f.read()
                    if data:
                        with open(fd, "wb", closefd=False) as out:
                            out.write(data)
                    os.unlink(path)
    failures = {r: v for r, (ok, v) in results.items() if not ok}
    if failures:
        raise RuntimeError("\n".join(f"rank {r} failed: {v}" for r, v in sorted(failures.items())))
    return [results[r][1] for r in range(world)]
