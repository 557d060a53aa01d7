"""One tensor at a time from a snapshot (:meth:`~.snapshot.Snapshot.lazy`): a mapping of
names to tensors that reads each on access, with a bounded cache of verified chunks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

import torch

from aegis.read._base import ChunkKey

if TYPE_CHECKING:
    from aegis.read.snapshot import Snapshot, SnapshotEntry

__all__ = ["LazyTensors"]


class LazyTensors(Mapping[str, torch.Tensor]):
    """``safe_open``-like access to a snapshot's tensors: ``keys()`` from the manifest, each
    tensor read (only its chunks, verified) when it is looked up. Names are relative to
    ``prefix`` when one was given."""

    def __init__(self, snapshot: Snapshot, prefix: str | None = None, *, cache_bytes: int = 64 << 20) -> None:
        self.snapshot = snapshot
        self.prefix = prefix or ""
        self._cache = _ChunkCache(cache_bytes)
        names = snapshot.keys()
        self._names = [n[len(self.prefix):] for n in names if n.startswith(self.prefix)]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self.prefix + key in self.snapshot.entries and \
            self.snapshot.entries[self.prefix + key].kind == "tensor"

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self:
            raise KeyError(key)
        return self.snapshot._tensor(self.prefix + key, progress=False, cache=self._cache)

    def get_tensor(self, key: str) -> torch.Tensor:
        return self[key]

    def entry(self, key: str) -> SnapshotEntry:
        return self.snapshot.entries[self.prefix + key]

    def __enter__(self) -> LazyTensors:
        return self

    def __exit__(self, *exc: object) -> None:
        self._cache.clear()


class _ChunkCache:
    """The verified chunks read last, up to ``limit`` bytes (least recently used out first)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.size = 0
        self._data: OrderedDict[ChunkKey, bytes] = OrderedDict()

    def get(self, key: ChunkKey) -> bytes | None:
        data = self._data.get(key)
        if data is not None:
            self._data.move_to_end(key)
        return data

    def put(self, key: ChunkKey, data: bytes) -> None:
        if key in self._data or len(data) > self.limit:
            return
        self._data[key] = data
        self.size += len(data)
        while self.size > self.limit:
            _, old = self._data.popitem(last=False)
            self.size -= len(old)

    def clear(self) -> None:
        self._data.clear()
        self.size = 0
