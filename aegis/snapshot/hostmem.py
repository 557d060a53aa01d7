"""Host memory that device copies use at full speed, registered once per process.

A device-to-host copy into pageable memory goes through the driver's bounce buffers (18 GB/s
on an H200) and blocks the host; into page-locked memory it is one DMA at the link's speed
(55 GB/s) and can be asynchronous. Node-store slots are ``MAP_SHARED`` mappings of tmpfs files
(so a snapshot survives its process); ``cudaHostRegister`` page-locks such a mapping in place,
at its exact size (torch's caching host allocator would round up to a power of two and could
not map a file). Measured in ``bench/gpu_check.py``: a registered, pre-faulted tmpfs mapping
copies at the pinned floor.

Registration costs about as much as copying the bytes once or twice (the driver pins every
page), so it is done once per slot and per process, in the background, and a registered
mapping outlives the Manager that made it: :func:`keep` hands it to this process's cache when
its :class:`~aegis.snapshot.node_store.Slot` closes (an in-process recovery round closes every
slot), and a Slot opened later on the same file (same inode) takes it back with :func:`take`,
mapped and registered. :func:`sweep` releases kept mappings whose file was deleted or replaced,
so that no deleted file's memory stays held.

ROCm builds expose the same calls under ``torch.cuda`` (HIP). Without a device nothing here
registers; the cache still keeps mappings (the CPU path uses it only when ``staging`` asks).
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any

__all__ = ["tensor_of", "available", "register", "unregister", "Kept", "keep", "take", "sweep", "stats",
           "release_all", "map_file", "retain_freed_memory"]

_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every context of the process


def available() -> bool:
    """A CUDA (or ROCm) device this process can register host memory for."""
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # noqa: BLE001 - a broken install has no device
        return False


_MADV_POPULATE_READ, _MADV_POPULATE_WRITE = 22, 23  # Linux 5.14+
_libc: list[Any] = []


def _madvise_populate(address: int, nbytes: int, *, write: bool) -> bool:
    """Fault in [address, address + nbytes) through ``madvise(MADV_POPULATE_*)``, called with
    ctypes, which releases the GIL for the call. False where the kernel lacks it."""
    try:
        if not _libc:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            libc.madvise.restype = ctypes.c_int
            _libc.append(libc)
        start = address - address % mmap.PAGESIZE
        advice = _MADV_POPULATE_WRITE if write else _MADV_POPULATE_READ
        return int(_libc[0].madvise(start, nbytes + address - start, advice)) == 0
    except (OSError, AttributeError):
        return False


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
RETAIN_MAX_BYTES = 32 << 20  # glibc refuses a larger M_MMAP_THRESHOLD on 64-bit hosts
_retained: list[bool] = []


def retain_freed_memory() -> bool:
    """Keep the memory this process frees for its own later allocations (glibc's malloc: blocks
    up to 32 MiB from its heaps, which are never trimmed), so that a later allocation reuses
    pages already faulted in instead of new ones.

    For in-process recovery (``run_in_process`` calls it once): a survivor frees its round's
    model and optimizer state at the teardown and builds the next round's, larger when the world
    shrank, which the restore then writes. By default glibc maps each block over its threshold
    (128 KiB, raised by the blocks freed) apart and unmaps it when freed, so much of the new
    state is first-touch pages, faulted in by the restore's copy: here a 1 GB copy took 1.15 s
    into fresh memory against 0.34 s into reused (``bench/first_touch.py``), and a world-1
    restore of 2 GB after 1 GB was freed 1.64 s without this call against 1.32 s with it. Cost:
    the process's resident memory stays at its peak (what it freed is kept, not returned);
    tensors over 32 MiB are still mapped and unmapped one by one. Nothing grows with the world
    size.

    Left alone (False) when the user chose for malloc (``MALLOC_MMAP_THRESHOLD_`` or
    ``MALLOC_TRIM_THRESHOLD_`` set, or ``AEGIS_RETAIN_FREED_MEMORY=0``), or where there is no
    glibc ``mallopt`` (another libc, not Linux). Idempotent."""
    if _retained:
        return _retained[0]
    ok = False
    if (os.environ.get("AEGIS_RETAIN_FREED_MEMORY", "1").strip().lower() not in ("0", "false", "no")
            and "MALLOC_MMAP_THRESHOLD_" not in os.environ
            and "MALLOC_TRIM_THRESHOLD_" not in os.environ):
        with contextlib.suppress(OSError, AttributeError):
            import platform

            if platform.libc_ver()[0] == "glibc":
                libc = ctypes.CDLL(None)
                libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
                libc.mallopt.restype = ctypes.c_int
                # the trim threshold first: a fixed M_MMAP_THRESHOLD also ends glibc's dynamic
                # adjustment of both
                ok = (libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) == 1
                      and libc.mallopt(_M_MMAP_THRESHOLD, RETAIN_MAX_BYTES) == 1)
    _retained.append(ok)
    return ok


def map_file(fd: int, length: int, *, write: bool, populate: bool) -> mmap.mmap:
    """A shared mapping of ``length`` bytes of the file ``fd`` (0: the whole file), its pages
    faulted in at once when ``populate``, with the GIL released.

    ``mmap.mmap(..., flags=MAP_POPULATE)`` holds the GIL for the whole populate: seconds for a
    GB on a loaded host (seen here: a replica slot of 0.5 GB pre-faulted on the snapshot thread
    while every other thread of the process, the membership heartbeat included, waited 2-8 s;
    a live node was declared dead). The mapping is made without it, then populated with
    ``madvise`` (ctypes drops the GIL); where the kernel lacks that, pages fault on first touch
    (in torch copies and crc32c, which run without the GIL too)."""
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if write else 0)
    m = mmap.mmap(fd, length, flags=mmap.MAP_SHARED, prot=prot)
    if populate and len(m):
        import torch

        with warnings.catch_warnings():  # a read-only mapping: only its address is taken
            warnings.simplefilter("ignore", UserWarning)
            t = torch.frombuffer(m, dtype=torch.uint8)
        try:
            _madvise_populate(int(t.data_ptr()), len(m), write=write)
        finally:
            del t
    return m


def tensor_of(buf: Any, dtype: Any = None, *, count: int = -1, offset: int = 0) -> Any:
    """A tensor over ``buf`` (an mmap; ``count`` elements of ``dtype``, default uint8, from
    byte ``offset``; -1: to the end) that keeps the buffer exported while it or any view of
    it lives, so that closing the mapping fails (``BufferError``, which every closer here
    suppresses) instead of unmapping it under them. ``torch.frombuffer`` takes no export: an
    mmap closed while its tensors live is unmapped, and their next touch (a late copy, or a
    gloo send or receive still in flight, which gloo cannot abandon) is a SIGSEGV. The export
    is numpy's, held by the array ``torch.from_numpy`` keeps. A read-only buffer gives a
    tensor that must only be read (torch's warning about it is silenced)."""
    import numpy as np
    import torch

    dtype = dtype or torch.uint8
    arr = np.frombuffer(buf, dtype=np.uint8, count=-1 if count < 0 else count * dtype.itemsize,
                        offset=offset)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        t = torch.from_numpy(arr)
    return t if dtype == torch.uint8 else t.view(dtype)


def populate(t: Any, *, write: bool = False) -> bool:
    """Fault in the pages under the tensor ``t`` (a view of a mapping), with the GIL released:
    a sender populates each message's range just before handing it to the transport, while the
    previous one is on the wire, instead of the whole mapping first. False where the kernel
    lacks it (the pages then fault as they are read)."""
    n = int(t.numel()) * int(t.element_size())
    return n == 0 or _madvise_populate(int(t.data_ptr()), n, write=write)


_lock = threading.Lock()
_stats = {"registered_bytes": 0, "register_s": 0.0, "registrations": 0, "failures": 0,
          "reused": 0, "released": 0}
_last_error: list[str] = []


def register(address: int, nbytes: int) -> float | None:
    """Page-lock ``nbytes`` at ``address`` (a mapping's start) for device copies. Returns the
    seconds it took, or None when it could not (no device, or the runtime refused: the error is
    kept in :func:`stats`, and copies stay correct at pageable speed)."""
    if nbytes <= 0 or not available():
        return None
    import torch

    t0 = time.perf_counter()
    try:
        rc = int(torch.cuda.cudart().cudaHostRegister(address, nbytes, _HOST_REGISTER_PORTABLE))
    except Exception as e:  # noqa: BLE001 - the copy falls back to pageable memory
        rc, err = -1, f"{type(e).__name__}: {e}"
    else:
        err = f"cudaHostRegister returned error {rc}"
    seconds = time.perf_counter() - t0
    with _lock:
        if rc != 0:
            _stats["failures"] += 1
            _last_error[:] = [f"{err} for {nbytes} bytes"]
            return None
        _stats["registered_bytes"] += nbytes
        _stats["register_s"] += seconds
        _stats["registrations"] += 1
    return seconds


def unregister(address: int, nbytes: int) -> None:
    if not available():
        return
    import torch

    with contextlib.suppress(Exception):
        torch.cuda.cudart().cudaHostUnregister(address)
    with _lock:
        _stats["registered_bytes"] -= nbytes


def stats() -> dict[str, Any]:
    """What this process registered: bytes now, seconds and count in all, failures, reuses."""
    with _lock:
        out: dict[str, Any] = dict(_stats)
        out["kept"] = len(_kept)
        if _last_error:
            out["last_error"] = _last_error[0]
        return out


@dataclass
class Kept:
    """A mapping of a slot file that outlives its Slot object."""

    mm: mmap.mmap
    view: Any  # torch.frombuffer over mm (uint8)
    capacity: int
    pinned: bool
    path: str  # where the file was when it was kept (a Slot that takes it may rename it)
    inode: tuple[int, int]


_kept: dict[tuple[int, int], Kept] = {}


def _inode(fd_or_path: int | str) -> tuple[int, int] | None:
    try:
        st = os.fstat(fd_or_path) if isinstance(fd_or_path, int) else os.stat(fd_or_path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def keep(entry: Kept) -> None:
    """Hand a closing Slot's mapping to the process (see the module docstring)."""
    with _lock:
        old = _kept.pop(entry.inode, None)
        _kept[entry.inode] = entry
    if old is not None and old.mm is not entry.mm:
        _release(old)


def take(fd: int, capacity: int) -> Kept | None:
    """The kept mapping of the file open as ``fd``, if it has exactly ``capacity`` bytes mapped
    (a Slot's ``ensure``); else None (a kept mapping of another size is released)."""
    ino = _inode(fd)
    if ino is None:
        return None
    with _lock:
        entry = _kept.pop(ino, None)
        if entry is not None and entry.capacity == capacity:
            _stats["reused"] += 1
            return entry
    if entry is not None:
        _release(entry)
    return None


def lookup(path: str) -> Kept | None:
    """The kept mapping of the file at ``path`` (a restore reads committed shards through it:
    registered memory copies to the device at full speed), without taking it."""
    ino = _inode(path)
    if ino is None:
        return None
    with _lock:
        return _kept.get(ino)


def _release(entry: Kept) -> None:
    if entry.pinned:
        unregister(_address(entry.view), entry.capacity)
    entry.view = None
    with contextlib.suppress(BufferError, ValueError):
        entry.mm.close()
    with _lock:
        _stats["released"] += 1


def _address(view: Any) -> int:
    return int(view.data_ptr())


def sweep() -> int:
    """Release kept mappings whose file is gone or replaced (removed by an eviction, a cleanup,
    another rank's restore): their memory would stay held by this process otherwise. Returns
    how many were released. O(kept mappings), a stat each."""
    with _lock:
        entries = list(_kept.values())
    gone = []
    for e in entries:
        if _inode(e.path) != e.inode:
            gone.append(e)
    for e in gone:
        with _lock:
            if _kept.get(e.inode) is e:
                del _kept[e.inode]
            else:
                continue
        _release(e)
    return len(gone)


def release_all() -> None:
    """Release every kept mapping (the end of training in this process)."""
    with _lock:
        entries = list(_kept.values())
        _kept.clear()
    for e in entries:
        _release(e)
