"""Run a function on N real gloo ranks (separate processes) and collect the results.

Like torchsnapshot's ``run_with_pet``: every rank is a spawned process with its own
``torch.distributed`` gloo group on loopback; exceptions come back with the rank's traceback.
"""

from __future__ import annotations

import os
import pickle
import queue as queue_mod
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple[Any, ...],
            env: dict[str, str], queue: Any) -> None:
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1",
    )
    import faulthandler

    import torch
    import torch.distributed as dist

    # A hung rank prints every thread's stack before the test gives up on it.
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
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world, port, fn, args, env or {}, queue), daemon=True)
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
    failures = {r: v for r, (ok, v) in results.items() if not ok}
    if failures:
        raise RuntimeError("\n".join(f"rank {r} failed: {v}" for r, v in sorted(failures.items())))
    return [results[r][1] for r in range(world)]
