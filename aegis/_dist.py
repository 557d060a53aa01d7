"""Collectives on aegis' own process group, with one error for the whole job.

Every call here is collective: all ranks of the group call it, in the same order. A phase run
through :meth:`Group.run_all` catches each rank's exception, gathers them, and raises the same
:class:`CollectiveError` on every rank, so no rank is left waiting for one that failed.

``pg=None`` means a single process without torch.distributed: every collective is local.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from aegis import errors
from aegis.errors import AegisError, CollectiveError, SnapshotTimeoutError

T = TypeVar("T")

__all__ = ["Group", "arrive", "creation_timeout", "new_snapshot_group", "node_id"]

_SAME_TYPE: dict[str, type[AegisError]] = {
    c.__name__: c
    for c in (
        errors.ConfigError,
        errors.ManifestError,
        errors.StoreFullError,
        errors.StateMismatchError,
        errors.NoSnapshotError,
        errors.SnapshotTimeoutError,
        errors.PerRankStateError,
        errors.StepOrderError,
        errors.IncompatibleSnapshotError,
    )
}


def node_id() -> str:
    """This node's id: ``AEGIS_NODE_ID`` when set (simulated nodes), else the hostname."""
    import os

    return os.environ.get("AEGIS_NODE_ID") or socket.gethostname()


# gloo waits this many times a group's timeout for a pair's first connection (its tcp pair's
# waitUntil, "a longer timeout when waiting for initial connect"). Measured here (torch 2.13): a
# group created with a 2 s timeout, whose peer had published its address and then died, failed
# after 10.0 s; a snapshot group created with a 6 s timeout held a chaos campaign's survivors
# for 30 s (seed 17, fault 12).
GLOO_CONNECT_WAITS = 5


def creation_timeout(bound: timedelta) -> timedelta:
    """The timeout to create a gloo group with, so that its creation ends within ``bound`` even
    when a member published its address and died before connecting (no fence can end that
    wait: there is no socket yet to shut down). At least 1 s: the members' addresses are
    exchanged under it too, after :func:`arrive`."""
    return max(bound / GLOO_CONNECT_WAITS, timedelta(seconds=1))


def arrive(store: Any, key: str, world: int, timeout: timedelta) -> None:
    """Wait until ``world`` processes arrived at ``key`` (a counter in ``store``), for at most
    ``timeout``; raises the store's error otherwise. Before a group is created in an in-process
    round: the members then create it together, so a member lost before it arrives is waited
    for here, on a store connection a fence shuts down (the next round forms at once), not in
    the group's connects, which nothing can end before their timeout. Two requests and one wait
    per process, whatever the world size (the last to arrive sets the key the others wait
    for)."""
    if int(store.add(key, 1)) >= world:
        store.set(f"{key}/all", b"1")
    store.wait([f"{key}/all"], timeout)


def new_snapshot_group(timeout: timedelta, create_timeout: timedelta | None = None
                       ) -> dist.ProcessGroup | None:
    """A dedicated gloo group for snapshot traffic. Collective: every rank calls it once.

    Snapshot traffic never shares the training group: DCP on the default group was measured to
    corrupt concurrent training collectives. ``create_timeout`` (in-process recovery): the ranks
    first :func:`arrive` together (on the default group's store, fenced), then create the group
    with :func:`creation_timeout`, so that its creation ends within ``create_timeout`` whoever is
    lost meanwhile; its collectives then get ``timeout``.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None
    if create_timeout is None:
        return dist.new_group(backend="gloo", timeout=timeout)
    from torch.distributed.distributed_c10d import _set_pg_timeout, _world

    store = _default_store()
    if store is not None:  # the next group's number: the same on every rank (torch names it so)
        arrive(store, f"aegis/create/{_world.group_count}", dist.get_world_size(),
               create_timeout)
    pg = dist.new_group(backend="gloo", timeout=min(creation_timeout(create_timeout), timeout))
    _set_pg_timeout(timeout, pg)
    return pg


def _is_timeout(e: BaseException) -> bool:
    text = str(e).lower()
    return "timed out" in text or "timeout" in text


def _default_store() -> Any:
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no store: the timeout message names no ranks
        return None


class Group:
    def __init__(self, pg: dist.ProcessGroup | None) -> None:
        self.pg = pg
        self.rank = dist.get_rank(pg) if pg is not None else 0
        self.world = dist.get_world_size(pg) if pg is not None else 1
        self._seq = 0  # collectives called on this group; the same on every rank that keeps up

    def _guard(self, what: str, fn: Callable[[], T]) -> T:
        self._seq += 1
        try:
            return fn()
        except AegisError:
            raise
        except Exception as e:  # gloo raises RuntimeError on timeouts and lost peers
            if _is_timeout(e):
                raise SnapshotTimeoutError(
                    f"aegis {what}: a peer did not answer within the snapshot timeout ({e}); "
                    + self._who_arrived(what)
                ) from e
            raise AegisError(f"aegis {what}: collective failed ({e}); a peer is likely gone") from e

    def _who_arrived(self, what: str, wait_s: float = 1.0) -> str:
        """After a timeout: which ranks were waiting at this same collective. Each rank that
        times out here says so through the job's store and looks for the others for
        ``wait_s``: ranks that called it together time out together. Costs nothing unless a
        collective times out."""
        store = _default_store()
        if store is None or self.pg is None or self.world > 4096:
            return "it is frozen or dead, or did not call the same collective"
        prefix = f"aegis/timeout/{getattr(self.pg, 'group_name', '')}/{self._seq}/{what}"
        arrived: list[int] = []
        try:
            store.set(f"{prefix}/{self.rank}", "1")
            deadline = time.monotonic() + wait_s
            while True:
                arrived = [r for r in range(self.world) if store.check([f"{prefix}/{r}"])]
                if len(arrived) == self.world or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
        except Exception:  # noqa: BLE001 - the store may be gone with the peer
            return "it is frozen or dead, or did not call the same collective"
        missing = [r for r in range(self.world) if r not in arrived]
        return (
            f"rank(s) {arrived} of aegis' group waited at '{what}', rank(s) {missing} did not arrive: "
            "they are frozen or dead, or did not call the same aegis method (every rank must call "
            "save(step), restore() and close() together, with the same step)"
        )

    def all_gather(self, obj: T, what: str = "all_gather") -> list[T]:
        if self.pg is None:
            return [obj]
        out: list[Any] = [None] * self.world
        self._guard(what, lambda: dist.all_gather_object(out, obj, group=self.pg))
        return out

    def gather(self, obj: T, what: str = "gather") -> list[T] | None:
        if self.pg is None:
            return [obj]
        out: list[Any] | None = [None] * self.world if self.rank == 0 else None
        dst = dist.get_global_rank(self.pg, 0)
        self._guard(what, lambda: dist.gather_object(obj, out, dst=dst, group=self.pg))
        return out

    def broadcast(self, obj: T | None, what: str = "broadcast", src: int = 0) -> T:
        """``obj`` from group rank ``src`` to every rank."""
        if self.pg is None:
            assert obj is not None
            return obj
        box = [obj]
        src = dist.get_global_rank(self.pg, src)
        self._guard(what, lambda: dist.broadcast_object_list(box, src=src, group=self.pg))
        return box[0]  # type: ignore[return-value]

    def scatter(self, objs: list[T] | None, what: str = "scatter") -> T:
        if self.pg is None:
            assert objs is not None
            return objs[0]
        out: list[Any] = [None]
        src = dist.get_global_rank(self.pg, 0)
        self._guard(
            what,
            lambda: dist.scatter_object_list(out, objs if self.rank == 0 else None, src=src, group=self.pg),
        )
        return out[0]

    def all_reduce_max(self, values: list[int], what: str = "all_reduce") -> list[int]:
        if self.pg is None:
            return list(values)
        t = torch.tensor(values, dtype=torch.int64)
        self._guard(what, lambda: dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.pg))
        return [int(x) for x in t.tolist()]

    def barrier(self, what: str = "barrier") -> None:
        if self.pg is not None:
            self.all_reduce_max([0], what)

    def run_all(self, phase: str, fn: Callable[[], T]) -> list[T]:
        """Run ``fn`` on every rank; return all results, or raise one error on every rank."""
        local: Exception | None = None
        try:
            result: tuple[bool, Any] = (True, fn())
        except Exception as e:  # noqa: BLE001 - reported to every rank below
            result = (False, (type(e).__name__, str(e)))
            local = e
        results = self.all_gather(result, phase)
        failures = {r: value for r, (ok, value) in enumerate(results) if not ok}
        if not failures:
            return [value for _, value in results]
        if self.world == 1 and local is not None:
            raise local
        kinds = {kind for kind, _ in failures.values()}
        error = CollectiveError(phase, {r: msg for r, (_, msg) in failures.items()})
        # Keep the error's type when every failing rank agrees on a plain aegis error type, so
        # callers can catch e.g. StoreFullError the same way on every rank.
        cls = _SAME_TYPE.get(kinds.pop()) if len(kinds) == 1 else None
        if cls is not None:
            raise cls(str(error)) from local
        raise error from local
