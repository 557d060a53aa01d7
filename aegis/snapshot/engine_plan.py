"""The snapshot engine's plan cache and its worker thread (:mod:`.engine` uses them).

A save plan (DCP's local plan -> global plan with de-duplication -> final plan, and the shard
layout aegis derives from it) is reused while the state dict's structure is unchanged: a
fingerprint of names, dtypes, shapes and sharding (:func:`_fingerprint`) keys a small
process-wide cache (:data:`_plans`, ``_PLAN_CACHE_SIZE`` plans, most recently used last), so a
Manager made again in the same process (in-process recovery: one per round) plans once per
structure. :class:`_Flattener` flattens the nested state dict, once for entries whose object
is stable; :func:`_resolver` hands DCP each write item's tensor. :class:`_DaemonWorker` runs a
snapshot's background work on a daemon thread (one that is stuck never blocks the exit).
"""

from __future__ import annotations

import hashlib
import io
import os
import queue
import sys
import threading
import traceback
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._traverse import get_element
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType
from torch.distributed.tensor import DTensor

from aegis.snapshot.shard import ShardLayout


def _fp(k: str, v: Any) -> tuple[Any, ...]:
    if isinstance(v, DTensor):
        local = v._local_tensor
        return (k, "d", v.dtype, tuple(v.shape), tuple(local.shape), v.device_mesh.size(),
                tuple(v.placements))
    if isinstance(v, torch.Tensor):
        return (k, "t", v.dtype, tuple(v.shape))
    return (k, "o")


def _fingerprint(flat: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(_fp(k, v) for k, v in flat.items())


# Plans kept across engines (in-process recovery builds a new Manager every round): a process
# that saves again at a world size, as a rank, with a state it planned before reuses that plan
# when every rank does (see Engine._cached_plan). Key: (job, world size, rank, chunk size, the
# state's fingerprint digest); value: (the digest of every rank's fingerprint digest at that
# plan, the shard layout, rank 0's entries and planner data, the redundancy scheme's extras for
# this rank: Scheme.plan_extras). One per plan held: O(tensors) on every rank, O(world x
# tensors) on rank 0. The key ends with the scheme's plan_key (what its extras depend on).
_PLAN_CACHE_SIZE = 4

CachedPlan = tuple[int, ShardLayout, dict[str, Any], dict[str, Any], Any]

_plans: dict[tuple[Any, ...], CachedPlan] = {}


def _fp_digest(fingerprint: tuple[Any, ...]) -> bytes:
    """A digest of a fingerprint that is the same in every process (``hash()`` of a string is
    not): it names what one rank planned, for the cross-round plan cache."""
    return hashlib.sha256(repr(fingerprint).encode()).digest()[:16]


def _remember_plan(key: tuple[Any, ...], value: CachedPlan) -> None:
    _plans.pop(key, None)
    while len(_plans) >= _PLAN_CACHE_SIZE:
        _plans.pop(next(iter(_plans)))
    _plans[key] = value


class _Flattener:
    """DCP's ``flatten_state_dict`` of the state, with the subtrees that the owner declares
    *stable* (``stable``: (top key, entry name) pairs; the Manager's ``ModelOptimizerState``
    entries, whose ``state_dict()`` hands back the very same object while every tensor in it is
    the same live tensor) flattened once: on a later save their tensor leaves and fingerprint
    are reused, and only their non-tensor leaves (optimizer hyperparameters a scheduler changes)
    are read again through their paths. Flattening and fingerprinting a 384-parameter model's
    state every save cost about 5 ms here."""

    def __init__(self, stable: Iterable[tuple[str, str]] = ()) -> None:
        self.stable: set[tuple[str, str]] = set(stable)
        self._cache: dict[tuple[str, str], tuple[Any, list[tuple[str, tuple[Any, ...], Any]],
                                                 list[tuple[Any, ...]]]] = {}

    def flatten(self, sd: dict[str, Any]) -> tuple[dict[str, Any], tuple[Any, ...]]:
        flat: dict[str, Any] = {}
        fp: list[tuple[Any, ...]] = []
        for top, sub in sd.items():
            if not isinstance(sub, dict):
                part, _ = flatten_state_dict({top: sub})
                flat.update(part)
                fp.extend(_fp(k, v) for k, v in part.items())
                continue
            for name, val in sub.items():
                key = (top, name)
                hit = self._cache.get(key) if key in self.stable else None
                if hit is not None and hit[0] is val:
                    fresh = self._refresh(sd, hit[1])
                    if fresh is not None:
                        flat.update(fresh)
                        fp.extend(hit[2])
                        continue
                part, paths = flatten_state_dict({top: {name: val}})
                flat.update(part)
                prints = [_fp(k, v) for k, v in part.items()]
                fp.extend(prints)
                if key in self.stable:
                    self._cache[key] = (val, [(k, tuple(paths[k]), v) for k, v in part.items()],
                                        prints)
        return flat, tuple(fp)

    @staticmethod
    def _refresh(sd: dict[str, Any], items: list[tuple[str, tuple[Any, ...], Any]]
                 ) -> dict[str, Any] | None:
        out: dict[str, Any] = {}
        for k, path, v in items:
            if isinstance(v, torch.Tensor):
                out[k] = v
                continue
            try:
                now = get_element(sd, path)
            except Exception:  # noqa: BLE001 - the structure changed: flatten again
                return None
            if isinstance(now, torch.Tensor):
                return None
            out[k] = now
        return out


def _resolver(flat: dict[str, Any]) -> Callable[[WriteItem], Any]:
    """``DefaultSavePlanner.resolve_data`` for a state of DTensors, tensors and objects, without
    DCP's per-item lookups (``to_local()`` goes through autograd, about 10 us an item): a
    DTensor's local tensor, a tensor itself, an object ``torch.save``d into a buffer."""

    def resolve(item: WriteItem) -> Any:
        obj = flat[item.index.fqn]
        if item.type == WriteItemType.BYTE_IO:
            buf = io.BytesIO()
            torch.save(obj, buf)
            return buf
        if isinstance(obj, DTensor):
            return obj._local_tensor
        return obj

    return resolve


def _fast_resolvable(flat: dict[str, Any], layout: ShardLayout) -> bool:
    """Every tensor item is a DTensor or a plain tensor (one chunk each): what :func:`_resolver`
    handles exactly like DCP; anything else (a ShardedTensor) goes through the planner."""
    return all(type(flat.get(t.item.index.fqn)) is DTensor or (
        isinstance(flat.get(t.item.index.fqn), torch.Tensor)
        and not isinstance(flat.get(t.item.index.fqn), DTensor)
        and not hasattr(flat.get(t.item.index.fqn), "__get_tensor_shard__"))
        for t in layout.tensors)


class _DaemonWorker:
    """One background thread running submitted calls in order, returning futures.

    A daemon, unlike ThreadPoolExecutor's workers: when training has already failed (a peer
    died), a transfer blocked in gloo must not keep the process alive until its timeout, so
    torchrun can restart the job at once."""

    def __init__(self, name: str) -> None:
        self._queue: queue.Queue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        future: Future[Any] = Future()
        self._queue.put((future, fn, args))
        return future

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            future, fn, args = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - delivered through the future
                future.set_exception(e)

    def shutdown(self, wait: bool = True, timeout: float | None = None) -> None:
        self._queue.put(None)
        if wait:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def where(self) -> str | None:
        """:func:`thread_where` of its thread."""
        return thread_where(self._thread)


def thread_where(thread: threading.Thread, depth: int = 5) -> str | None:
    """Where ``thread`` is now: its innermost ``depth`` frames, innermost first (``file:line
    function``), or None when it has ended. For a teardown that gave up waiting on it."""
    frame = sys._current_frames().get(thread.ident or -1)
    if frame is None:
        return None
    stack = traceback.extract_stack(frame)[-depth:]
    return " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in reversed(stack))
