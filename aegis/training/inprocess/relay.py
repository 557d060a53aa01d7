"""A node's heartbeat relay (issue 40): the processes of one node beat through one of them, so
the membership store serves O(nodes) requests per beat, not O(ranks).

Each process of the node posts, at every beat, a small file in a directory of the node's tmpfs
(``<root>/<node>/in-<uid>.json``: its counter, the keys it reads, the death log it follows,
when). The process that holds the directory's ``flock`` (the first to take it; the kernel hands
it to another when its holder dies) is the node's relay: at its beat it reads every fresh post,
writes the posters' counters with one ``multi_set``, reads the union of their keys with one
``multi_get`` and writes the values to ``out.json``; every process takes its values from there.

What a watcher sees is unchanged: a process's counter moves only while that process posts (a
frozen process's post goes stale and its counter stops, whoever relays). A process falls back
to its own two requests (the heartbeat's direct beat) whenever the relay's output is older than
``stale_s`` or has not seen its recent posts: a frozen relay, one whose store requests failed,
a node whose tmpfs is full. The relay adds at most one beat to what a watcher reads, so a
silence is still declared within ``dead_after_s`` + 3 beats of the last one; a watcher whose
successor has been silent for ``dead_after_s`` less two beats reads it directly until it is
declared (the heartbeat's ``_suspect``), which keeps detection as it was without the relay.

Costs: per node per beat 2 store requests (plus a check or an append when a process watches a
new key or follows a new round); per process per beat one file written and one read (a few
hundred bytes, tmpfs); the relay reads one post per local process. Store requests in all per
beat: O(nodes); bytes per request O(local ranks x watched keys).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["NodeRelay", "relay_root"]


def _safe(name: str) -> str:
    """A file-name part for ``name`` (uids and node names hold '/')."""
    keep = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
    return f"{keep[:64]}-{hashlib.sha1(name.encode()).hexdigest()[:8]}"


def relay_root(store_addr: str, base: str = "/dev/shm") -> Path:
    """The relay directories of the job whose membership store is ``store_addr`` (host:port):
    one per job on a machine, so two jobs (or two simulated clusters) never share a relay."""
    return Path(base) / f"aegis-relay-{_safe(store_addr)}"


def _write(path: Path, doc: dict[str, Any]) -> None:
    """Whole or not at all: a reader never sees a torn file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    with open(tmp, "w") as fh:
        fh.write(json.dumps(doc, separators=(",", ":")))
    os.replace(tmp, path)


def _read(path: Path) -> dict[str, Any] | None:
    try:
        with open(path) as fh:
            doc = json.load(fh)
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


class NodeRelay:
    """One process's end of its node's relay (see the module docstring)."""

    def __init__(self, root: str | os.PathLike[str], node: str, uid: str, *, stale_s: float) -> None:
        self.dir = Path(root) / _safe(node)
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.uid = uid
        self.stale_s = stale_s
        self._post = self.dir / f"in-{_safe(uid)}.json"
        self._out = self.dir / "out.json"
        self._lock_fd: int | None = os.open(self.dir / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        self.leading = False
        self.batches = 0  # batches this process ran as the relay

    # -- every process ------------------------------------------------------------------------

    def post(self, counter: int, keys: list[str], also: list[str], log: str | None) -> None:
        _write(self._post, {"uid": self.uid, "pid": os.getpid(), "counter": counter,
                            "keys": keys, "also": also, "log": log, "t": time.monotonic()})

    def lead(self) -> bool:
        """Whether this process relays for the node (takes the lock when it is free)."""
        if not self.leading and self._lock_fd is not None:
            try:
                fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self.leading = True
            except OSError:
                pass
        return self.leading

    def result(self) -> dict[str, Any] | None:
        """The relay's last output if it is fresh (read within ``stale_s``) and ok, else None."""
        out = _read(self._out)
        if out is None or not out.get("ok") or time.monotonic() - float(out.get("t", 0)) > self.stale_s:
            return None
        return out

    # -- the relay ----------------------------------------------------------------------------

    def posts(self) -> list[dict[str, Any]]:
        """The fresh posts of the node's processes (a post older than ``stale_s`` is left out:
        its process stopped beating, and its counter must stop too); posts of processes that
        are gone are removed."""
        out = []
        now = time.monotonic()
        for path in self.dir.glob("in-*.json"):
            doc = _read(path)
            if doc is None:
                continue
            if now - float(doc.get("t", 0)) > self.stale_s:
                pid = int(doc.get("pid", 0))
                if pid and not _alive(pid):
                    with contextlib.suppress(OSError):
                        path.unlink()
                continue
            out.append(doc)
        return out

    def publish(self, out: dict[str, Any]) -> None:
        self.batches += 1
        _write(self._out, out)

    def close(self) -> None:
        """Leave the relay: the post removed, the lock released (another process relays); the
        last process of the node removes the directory (a process starting meanwhile makes it
        again; two relays for a moment cost requests, never a wrong value)."""
        with contextlib.suppress(OSError):
            self._post.unlink()
        if self._lock_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._lock_fd)  # releases the lock: another process relays
            self._lock_fd = None
        self.leading = False
        with contextlib.suppress(OSError):
            if not any(self.dir.glob("in-*.json")):
                for name in ("out.json", "lock"):
                    with contextlib.suppress(FileNotFoundError):
                        (self.dir / name).unlink()
                self.dir.rmdir()
                self.dir.parent.rmdir()  # the job's root, once its last node is gone


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True
