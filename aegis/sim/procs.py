"""Process-tree helpers: torchrun starts workers in their own sessions, so killing an agent's
process group leaves them running; these walk /proc instead."""

from __future__ import annotations

import contextlib
import os
import signal
import time

__all__ = ["children", "descendants", "kill_tree", "state", "wait_gone"]


def _per_thread(pid: int, name: str) -> list[str]:
    """The contents of ``/proc/<pid>/task/<tid>/<name>`` for each thread still there."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    out: list[str] = []
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/{name}") as f:
                out.append(f.read())
        except OSError:  # that thread is gone
            continue
    return out


def children(pid: int) -> list[int]:
    return [int(x) for text in _per_thread(pid, "children") for x in text.split()]


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


def _exiting(pid: int) -> bool:
    """True while any thread of ``pid`` has not finished exiting.

    The thread-group leader turns zombie as soon as its own thread is done, while another
    thread may still be unmapping the process's memory, before the kernel closes its files:
    measured here (``bench/exit_order.py``), a SIGKILLed process holding 0.1-4 GiB showed 'Z'
    after 0.15-6 ms and its TCP peer saw the connection end 16-118 ms later (more memory, later).
    A caller that removes the node's network on 'Z' lost that FIN (issue 25: a killed node's
    process never declared by the liveness service). Threads that finished are gone from
    ``task/``; the leader stays, as a zombie."""
    return any(st not in (None, "Z") for st in map(_state, _per_thread(pid, "stat")))


def _state(stat: str) -> str | None:
    """The state letter ('R', 'S', 'Z', ...) in the text of a ``/proc/.../stat`` file."""
    fields = stat.rsplit(")", 1)[1].split() if ")" in stat else []
    return fields[0] if fields else None


def state(pid: int) -> str | None:
    """The state letter of process ``pid`` (its leader thread: 'Z' once that thread is done,
    see ``_exiting``), None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return _state(f.read())
    except OSError:
        return None


def wait_gone(pids: list[int], timeout: float = 10.0) -> bool:
    """True once every thread of every one of ``pids`` has exited, so that the processes' files
    are closed (their sockets' ends sent). A zombie counts as gone: nobody may reap it here."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(_exiting(p) for p in pids):
            return True
        time.sleep(0.01)
    return False
