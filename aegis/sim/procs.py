"""Process-tree helpers: torchrun starts workers in their own sessions, so killing an agent's
process group leaves them running; these walk /proc instead."""

from __future__ import annotations

import contextlib
import os
import signal
import time

__all__ = ["children", "descendants", "kill_tree", "wait_gone"]


def children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out.extend(int(x) for x in f.read().split())
        except OSError:
            continue
    return out


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (depth first), not including ``pid``."""
    out: list[int] = []
    stack = children(pid)
    while stack:
        p = stack.pop()
        out.append(p)
        stack.extend(children(p))
    return out


def kill_tree(pid: int, sig: int = signal.SIGKILL) -> list[int]:
    """Send ``sig`` to ``pid`` and all its descendants, workers first; return the pids hit.

    The tree is read before any signal is sent: a killed agent's children are re-parented and
    would no longer be found under it.
    """
    victims = descendants(pid)
    for p in [*reversed(victims), pid]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, sig)
    return [pid, *victims]


def wait_gone(pids: list[int], timeout: float = 10.0) -> bool:
    """True once none of ``pids`` is alive (zombies count as gone)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = []
        for p in pids:
            try:
                with open(f"/proc/{p}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
                if state != "Z":
                    alive.append(p)
            except OSError:  # gone (FileNotFoundError, or ProcessLookupError mid-read)
                continue
        if not alive:
            return True
        time.sleep(0.05)
    return False
