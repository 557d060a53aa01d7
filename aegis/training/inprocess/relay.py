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

The same directory shares a round's whole member list (:meth:`NodeRelay.shared`): the first
process of the node to take the directory's fetch lock reads it from the store and writes it there, tagged
with the store's epoch (a record of another store, or of this one before it restarted empty, is
never taken); the others read the file. A first round's member list (O(world) bytes) is thus
read from the store once per node, not once per process. A process that finds the lock held
for ``wait_s`` (its holder frozen) reads the store itself.

Costs: per node per beat 2 store requests (plus a check or an append when a process watches a
new key or follows a new round); per process per beat one file written and one read (a few
hundred bytes, tmpfs); the relay reads one post per local process. Store requests in all per
beat: O(nodes); bytes per request O(local ranks x watched keys). Per whole list (a first
round's), one ``get`` per node (O(world) bytes, compressed) and one file read per process.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import threading
import time
from collections.abc import Callable
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
    _write_bytes(path, json.dumps(doc, separators=(",", ":")).encode())


def _write_bytes(path: Path, data: bytes) -> None:
    """``data`` to ``path`` through a temporary file and a rename (never torn)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
    os.replace(tmp, path)


def _read_bytes(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


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

    # -- a round's record, read once per node ------------------------------------------------

    def shared(self, tag: str, r: int, what: str, fetch: Callable[[], bytes], *,
               wait_s: float = 1.0) -> bytes:
        """``fetch()``'s bytes (round ``r``'s record ``what``, of the store whose epoch is
        ``tag``), read from the store by one process of the node: the first to take the fetch
        lock (exclusive) reads and writes them to the node's directory; the others block for
        the lock shared, which the kernel grants when the fetcher is done (or dead), and read
        the file. No process polls: the node's processes all wake at once when a record is
        written, and a fetch is one ``get``. One that has waited ``wait_s`` (the fetcher
        frozen) reads the store itself; so does every process when the directory cannot be
        used (its tmpfs full, removed). Whatever is returned is what the store held under that
        epoch: a file of another epoch is never read."""
        path = self.dir / f"rec-{_safe(tag)}-{r}-{_safe(what)}"
        lock = self.dir / "fetch.lock"
        deadline = time.monotonic() + wait_s
        for _ in range(8):  # a fetcher that failed hands the fetch on; a few rounds of it at most
            data = _read_bytes(path)
            if data is not None:
                return data
            try:
                fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
            except OSError:
                break
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                if not _shared_lock_within(lock, deadline - time.monotonic()):
                    break  # held past wait_s: a frozen fetcher
                continue  # the fetcher is done: its file is there (or it failed: try again)
            try:
                data = _read_bytes(path)  # written while this process opened the lock
                if data is not None:
                    return data
                data = fetch()
                with contextlib.suppress(OSError):
                    _write_bytes(path, data)
                    self._prune(tag, r)
                return data
            finally:
                os.close(fd)  # releases the lock: the node's other processes read the file
        return fetch()

    def _prune(self, tag: str, r: int) -> None:
        """Records of another epoch or of rounds before ``r - 2`` (no process reads them)."""
        keep = f"rec-{_safe(tag)}-"
        for path in self.dir.glob("rec-*"):
            name = path.name
            old = not name.startswith(keep)
            if not old:
                head = name[len(keep):].split("-", 1)[0]
                old = head.isdigit() and int(head) < r - 2
            if old:
                with contextlib.suppress(OSError):
                    path.unlink()

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
                for path in [self.dir / "out.json", self.dir / "lock", self.dir / "fetch.lock",
                             *self.dir.glob("rec-*")]:
                    with contextlib.suppress(FileNotFoundError):
                        path.unlink()
                self.dir.rmdir()
                self.dir.parent.rmdir()  # the job's root, once its last node is gone


def _shared_lock_within(lock: Path, timeout: float) -> bool:
    """Whether a shared ``flock`` on ``lock`` was granted within ``timeout`` (it is released at
    once). The blocking call runs on a thread of its own, so that a holder frozen with the lock
    costs this caller ``timeout``, not forever; that thread returns when the holder releases it
    or dies, and closes its descriptor."""
    if timeout <= 0:
        return False
    granted = threading.Event()

    def take() -> None:
        try:
            fd = os.open(lock, os.O_RDWR)
        except OSError:
            granted.set()  # removed (the node's last process left): the caller goes on
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            granted.set()
        except OSError:
            granted.set()
        finally:
            os.close(fd)

    threading.Thread(target=take, name="aegis-relay-fetch-wait", daemon=True).start()
    return granted.wait(timeout)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True
