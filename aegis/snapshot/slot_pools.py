"""One rank's slots in its node store: the free pools and how slots move between them.

A :class:`~aegis.snapshot.node_store.Slot` is a mapped shard file reused across snapshots (see
its docstring). A rank keeps three free pools, one per kind: its own shards (``rank``), the
replicas it holds for other ranks (``replica``) and its parity files (``parity``). A slot
leaves its pool by rename into a step directory when a snapshot fills it, and returns by
rename under a fresh pool name when that step is evicted or aborted. The
:class:`~aegis.snapshot.engine.SnapshotEngine` owns one :class:`SlotPools`; the redundancy
schemes (:mod:`.redundancy`) take their slots from it. Costs are per rank and do not grow with
the world size: keep + 1 own slots, one replica slot per source rank, one parity slot.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
from pathlib import Path

from aegis.errors import StoreFullError
from aegis.snapshot import hostmem
from aegis.snapshot.node_store import NodeStore, Slot
from aegis.snapshot.shard import ShardLayout

__all__ = ["SlotPools", "remove_trash", "TRASH"]

TRASH = "trash-"  # free slots an aborted engine renamed out of the pools, still to be removed
_trashed = itertools.count()  # trash names unique within the process


def _drop(slot: Slot) -> None:
    slot.close()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(slot.path)


def remove_trash(store: NodeStore) -> int:
    """Unlink the trashed slot files (:meth:`SlotPools.trash_spares`) in ``store``'s slot
    directory of processes that no longer exist (a live one removes its own); returns how many."""
    n = 0
    if not store.slots_dir.is_dir():
        return 0
    for name in os.listdir(store.slots_dir):
        if not name.startswith(TRASH):
            continue
        try:
            os.kill(int(name[len(TRASH):].split("-", 1)[0]), 0)
            continue  # alive (or not ours to signal): its own thread removes them
        except ProcessLookupError:
            pass
        except (ValueError, PermissionError, OverflowError):
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(store.slots_dir / name)
            n += 1
    return n


class SlotPools:
    """The free slots of one rank (``pins``: own slots keep their mappings, device staging).

    Thread-safe: the training thread takes own slots, the engine's worker thread takes replica
    and parity slots and returns every kind. ``lock`` is shared with the engine, which also
    guards its committed list with it."""

    def __init__(self, store: NodeStore, rank: int, *, pins: bool, lock: threading.RLock) -> None:
        self.store = store
        self.rank = rank
        self.pins = pins
        self.lock = lock
        self.own: list[Slot] = [Slot(p, keep=pins) for p in store.free_slots(rank)]
        self._replica: list[Slot] = [Slot(p, "replica") for p in store.free_slots(rank, "replica")]
        self._parity: list[Slot] = [Slot(p, "parity") for p in store.free_slots(rank, "parity")]
        self._next = 1 + max((int(p.path.name.rsplit(".", 1)[1]) for p in self.spares()), default=0)
        self._done = False  # the spares were unlinked or trashed: nothing joins the pools now
        remove_trash(store)  # a process that died with trashed slots left to remove

    def adopt_kept(self) -> None:
        """Free slots this process mapped (and registered) under an earlier engine, e.g. in the
        previous in-process round, possibly under another rank number: renamed into this rank's
        own pool, so that their registration is not paid again."""
        hostmem.sweep()
        mine = {p.path for p in self.own}
        for path in sorted(self.store.slots_dir.glob("rank-*")):
            if path in mine or hostmem.lookup(str(path)) is None:
                continue
            with contextlib.suppress(OSError):
                slot = Slot(path, keep=True)
                slot.move(self.name("rank"))
                self.own.append(slot)

    def name(self, kind: str) -> Path:
        """A fresh free-pool path of ``kind`` for this rank."""
        with self.lock:
            k = self._next
            self._next += 1
        return self.store.slot_path(self.rank, k, kind)

    def new_own(self) -> Slot:
        return Slot(self.name("rank"), keep=self.pins)

    def take_own(self, step: int, layout: ShardLayout) -> Slot:
        """An own slot sized for ``layout``, moved to this rank's shard path of ``step``."""
        with self.lock:
            slot = self.own.pop() if self.own else self.new_own()
        slot.ensure(layout.tensor_end)
        slot.move(self.store.shard_path(step, self.rank))
        return slot

    def take_replica(self, step: int, src: int, size: int) -> Slot:
        """A replica slot of ``size`` bytes, moved to ``src``'s shard path of ``step``: a free
        one of that size if the pool has one (no remap), else any free one, else a new one."""
        with self.lock:
            fit = [i for i, s in enumerate(self._replica) if s.capacity == size]
            slot = self._replica.pop(fit[-1] if fit else -1) if self._replica \
                else Slot(self.name("replica"), "replica")
        slot.ensure(size)
        slot.move(self.store.shard_path(step, src))
        return slot

    def stock_replicas(self, sizes: list[int]) -> int:
        """Make (and pre-fault) free replica slots so that the pool holds one of each of
        ``sizes`` (the replicas the last save received): the next save then receives into
        memory that exists, not into a new tmpfs file whose pages the receive would allocate
        (1 GB: 0.3-1 s of the commit here, more under memory pressure). Run off the training
        thread, after a commit. The capacity check already counts these (keep + 1 replicas per
        source). A full store stops the stocking (the save that needs the slot then reports
        it). Returns how many slots were made."""
        with self.lock:
            free = [s.capacity for s in self._replica]
        missing = []
        for size in sizes:
            if size in free:
                free.remove(size)
            else:
                missing.append(size)
        made = 0
        for size in missing:
            # made under a trash name, which no pool lists (a later engine of this rank must not
            # adopt a file still being sized), and removed with the trash if this process dies
            slot = Slot(self.store.slots_dir / f"{TRASH}{os.getpid()}-{self.rank}.{next(_trashed)}",
                        "replica")
            try:
                slot.ensure(size)
            except StoreFullError:
                _drop(slot)
                break
            with self.lock:
                if not self._done:
                    slot.move(self.name("replica"))
                    self._replica.append(slot)
                    made += 1
                    continue
            _drop(slot)  # the engine was aborted or closed meanwhile: its pools are gone
            break
        return made

    def take_parity(self) -> Slot:
        """A parity slot, still in the pool's directory (the scheme sizes and moves it)."""
        with self.lock:
            return self._parity.pop() if self._parity else Slot(self.name("parity"), "parity")

    def release(self, slot: Slot) -> None:
        """Back to the pool of its kind, under a fresh name."""
        with self.lock:
            slot.move(self.name(slot.kind))
            {"replica": self._replica, "parity": self._parity}.get(slot.kind, self.own).append(slot)

    def discard(self, step: int, slots: list[Slot | None]) -> None:
        """An aborted step's files go back to the pools (never left in the step directory)."""
        with contextlib.suppress(Exception):
            for slot in slots:
                if slot is not None:
                    self.release(slot)
            self.store.remove_dir_if_empty(step)

    def spares(self) -> list[Slot]:
        return [*self.own, *self._replica, *self._parity]

    def unlink_spares(self, *, keep_own: bool = False) -> None:
        """Delete the free slots' files (``keep_own``: the own pool's files stay, with their
        mappings, for the next round's engine) and forget every spare."""
        with self.lock:
            self._done = True
        for slot in (self._replica + self._parity) if keep_own else self.spares():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(slot.path)
        self.own.clear()
        self._replica.clear()
        self._parity.clear()

    def trash_spares(self) -> tuple[list[Slot], list[Path]]:
        """Rename every free slot's file out of the pools (``.slots/trash-<pid>-<n>``: no pool of
        any rank lists it, an O(1) rename each) and forget every spare; returns (every spare, to
        close, the trash paths, to unlink), for the caller to do off the critical path. A file
        already gone (another rank's engine removed it) is closed, never unlinked: its old name
        may be a new slot's by then. Freeing a 1 GB tmpfs file's pages took 0.3-0.7 s of an
        in-process teardown here (1 GB per rank)."""
        with self.lock:
            self._done = True
        spares, paths = self.spares(), []
        for slot in spares:
            with contextlib.suppress(FileNotFoundError):
                slot.move(self.store.slots_dir / f"{TRASH}{os.getpid()}-{self.rank}.{next(_trashed)}")
                paths.append(slot.path)
        self.own.clear()
        self._replica.clear()
        self._parity.clear()
        return spares, paths

    def reusable_bytes(self) -> int:
        """Bytes the own pool's files already hold (the capacity check counts them as free)."""
        return sum(os.path.getsize(s.path) for s in self.own if s.path.exists())
