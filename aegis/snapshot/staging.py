"""The copy a save blocks on, three ways (``ManagerConfig.staging``).

========  ======================================================================================
sync      every tensor copied into the slot before ``save()`` returns (the default; on a GPU the
          device-to-host copy lands in pageable memory at about a third of the pinned speed)
pinned    own slots are registered as pinned memory (:mod:`.hostmem`, in the background, once
          per process); device tensors are copied ``non_blocking`` on a side stream that waits
          for the current one, and ``save()`` waits for those copies: the same guarantees as
          ``sync``, at the pinned floor once the slot is registered
async     like ``pinned``, but ``save()`` returns once the copies are *issued*: the tensors the
          optimizers update are copied by the background worker (on a CPU state: by its
          thread, with memcpy), everything else before ``save()`` returns; the next
          ``optimizer.step()`` waits for the copies (a step pre-hook: on CUDA the current
          stream waits for the copies' event, the host does not), and so do the next
          ``save()``, ``restore()`` and ``close()``
========  ======================================================================================

What may be deferred is decided per tensor, by storage: only the tensors the optimizers update
(parameters and optimizer state; :attr:`Deferral.storages`, given by the Manager), because
their only writer is ``optimizer.step()``, which the barrier guards. Everything else (buffers that
a forward updates in place, per-rank entries, RNG states, byte items) is copied or serialized
before ``save()`` returns: on CUDA, copies of device tensors go on the *current* stream, so that
any later in-place update on that stream runs after them.

Who calls what: :func:`aegis.snapshot.dcp_io.stage` splits the rank's items with
:meth:`Stager.split` and copies the immediate ones; the engine submits :meth:`Stager.deferred`
to its background worker before the snapshot's background half, which waits on the
:class:`CopyBarrier` before checksumming; the Manager's optimizer hooks call :meth:`CopyBarrier.order`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["MODES", "CopyBarrier", "Stager", "Deferral"]

MODES = ("sync", "pinned", "async")

Pair = tuple[torch.Tensor, torch.Tensor]  # (destination in the slot, live source)


def _storage(t: torch.Tensor) -> int:
    return int(t.untyped_storage().data_ptr())


@dataclass
class Deferral:
    """What ``async`` may copy after ``save()`` returns: the storages (data pointers) of the
    tensors the optimizers update. Empty: nothing is deferred."""

    storages: frozenset[int] = frozenset()


class CopyBarrier:
    """Done when one snapshot's copies have read their sources.

    ``order()``: work issued after it (on the current CUDA stream, or by this thread on a CPU
    state) runs after the copies; on CUDA it does not block the host. ``wait()``: the host
    waits until the copies are complete (their bytes are in the slot)."""

    def __init__(self, *, cuda: bool, later: Sequence[Pair] = (), pinned: bool = False,
                 current: Any = None, start: Any = None) -> None:
        self.cuda = cuda
        self.later: list[Pair] = list(later)  # the copies still to make (run_deferred)
        self.pinned = pinned  # the slot is registered: device copies may be non_blocking
        self.current = current  # CUDA: an event of work the copies must follow, or None
        self.start = start  # CUDA: where the current stream was when the snapshot began
        self.issued = threading.Event()  # the deferred copies are issued (or failed)
        self.event: Any = None  # CUDA: recorded after the last copy
        self.error: BaseException | None = None
        self.ordered = False
        self.seconds = 0.0  # from issuing the first deferred copy to the last one completing

    def order(self) -> None:
        if self.ordered:
            return
        self.issued.wait()
        if self.cuda and self.event is not None and self.error is None:
            torch.cuda.current_stream().wait_event(self.event)  # the device waits, not the host
        self.ordered = True

    def wait(self) -> None:
        self.issued.wait()
        if self.cuda and self.event is not None:
            self.event.synchronize()
        if self.error is not None:
            raise self.error

    def done(self) -> bool:
        return self.issued.is_set() and (self.event is None or bool(self.event.query()))


@dataclass
class Split:
    """A rank's tensor items for one snapshot: copied now, or deferred (``async``)."""

    now: list[Pair] = field(default_factory=list)
    later: list[Pair] = field(default_factory=list)


class Stager:
    """Copies for one engine. The side stream and the device are made at the first CUDA copy."""

    def __init__(self, mode: str = "sync") -> None:
        if mode not in MODES:
            raise ValueError(f"staging={mode!r}: use one of {MODES}")
        self.mode = mode
        self.deferral: Callable[[], Deferral] | None = None  # set by the Manager
        self._side: Any = None
        self._device: int | None = None
        # the last split: (deferral, the sources' ids, which items were deferred)
        self._last: tuple[Deferral, list[int], list[bool]] | None = None

    @property
    def pins(self) -> bool:
        """Own slots are registered as pinned memory (and their mappings kept)."""
        return self.mode != "sync"

    def split(self, pairs: Sequence[Pair]) -> Split:
        out = Split()
        if self.mode != "async":
            out.now = list(pairs)
            return out
        deferral = self.deferral() if self.deferral is not None else Deferral()
        ids = [id(src) for _, src in pairs]
        any_cuda = any(src.is_cuda for _, src in pairs)

        def decide(src: torch.Tensor) -> bool:
            # on a CUDA state only device tensors are deferred (a CPU step counter is updated
            # by the host during the step, which a stream wait does not guard)
            return (src.is_cuda or not any_cuda) and _storage(src) in deferral.storages

        last = self._last
        if last is not None and last[0] is deferral and len(last[1]) == len(ids):
            # the same source object as at the last save: the same decision (an object's
            # storage cannot change while the deferral, built from the same tensors, is reused)
            mask = [m if a == b else decide(src) for a, b, m, (_, src)
                    in zip(ids, last[1], last[2], pairs, strict=True)]
        else:
            mask = [decide(src) for _, src in pairs]
        self._last = (deferral, ids, mask)
        for pair, later in zip(pairs, mask, strict=True):
            (out.later if later else out.now).append(pair)
        return out

    def _stream(self, device: torch.device) -> Any:
        if self._side is None or self._device != device.index:
            self._device = device.index
            with torch.cuda.device(device):
                self._side = torch.cuda.Stream()
        return self._side

    def copy_now(self, pairs: Sequence[Pair], pinned: bool) -> None:
        """Copy ``pairs`` before returning (the host-side ordering ``sync`` and ``pinned``
        promise). CUDA sources into a pinned slot go ``non_blocking`` on the side stream, which
        first waits for the current stream; the host then waits for the side stream's event.
        In ``async`` mode (the immediate part) they go on the current stream instead and the host
        does not wait: later in-place updates on that stream are ordered after them."""
        cuda = [(d, s) for d, s in pairs if s.is_cuda]
        host = [(d, s) for d, s in pairs if not s.is_cuda]
        with torch.no_grad():
            for dst, src in host:
                dst.copy_(src.detach())
            if not cuda:
                return
            if self.mode == "sync" or not pinned:
                for dst, src in cuda:  # pageable destination: copy_ blocks anyway
                    dst.copy_(src.detach())
                return
            device = cuda[0][1].device
            current = torch.cuda.current_stream(device)
            if self.mode == "async":
                for dst, src in cuda:
                    dst.copy_(src.detach(), non_blocking=True)
                self._pending_current = current.record_event()
                return
            side = self._stream(device)
            side.wait_stream(current)
            with torch.cuda.stream(side):
                for dst, src in cuda:
                    dst.copy_(src.detach(), non_blocking=True)
                    src.record_stream(side)
            side.synchronize()

    _pending_current: Any = None

    def begin_deferred(self, later: Sequence[Pair], pinned: bool) -> CopyBarrier | None:
        """Start the deferred part (``async``): returns the snapshot's barrier, or None when
        nothing is deferred and nothing is in flight on the current stream. Call on the training
        thread, right after :meth:`copy_now`: a CUDA barrier records where the current stream
        is, so the copies start after everything issued so far (the optimizer step)."""
        current_event, self._pending_current = self._pending_current, None
        if not later and current_event is None:
            return None
        cuda = any(s.is_cuda for _, s in later) or current_event is not None
        start = None
        if cuda and later:
            start = torch.cuda.current_stream(later[0][1].device).record_event()
        return CopyBarrier(cuda=cuda, later=later, pinned=pinned, current=current_event,
                           start=start)

    def run_deferred(self, barrier: CopyBarrier) -> None:
        """Issue (CUDA) or do (CPU) the deferred copies; the background worker runs it before
        the snapshot's background half. Never raises: an error is kept in the barrier and raised
        by :meth:`CopyBarrier.wait` (the background half reports it to the commit)."""
        later = barrier.later
        t0 = time.perf_counter()
        try:
            with torch.no_grad():
                if not barrier.cuda:
                    for dst, src in later:
                        dst.copy_(src.detach())
                else:
                    events = []
                    current = barrier.current
                    if later:
                        device = later[0][1].device
                        with torch.cuda.device(device):
                            side = self._stream(device)
                            side.wait_event(barrier.start)
                            with torch.cuda.stream(side):
                                for dst, src in later:
                                    dst.copy_(src.detach(), non_blocking=barrier.pinned)
                                    src.record_stream(side)
                                if current is not None:
                                    side.wait_event(current)
                                events.append(side.record_event())
                    elif current is not None:
                        events.append(current)
                    barrier.event = events[-1] if events else None
        except BaseException as e:  # noqa: BLE001 - delivered through the barrier
            barrier.error = e
        finally:
            barrier.issued.set()
            barrier.later = []
        if barrier.event is not None and barrier.error is None:
            try:
                barrier.event.synchronize()
            except BaseException as e:  # noqa: BLE001 - delivered through the barrier
                barrier.error = e
        barrier.seconds = time.perf_counter() - t0
