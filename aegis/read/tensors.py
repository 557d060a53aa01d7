"""Full tensors out of verified chunks, through DCP with no process group.

:class:`ChunkReader` is a DCP ``StorageReader`` over chunks already read and checked
(:meth:`aegis.read.locations.AegisCopy.read_chunks`): it serves each storage item from the
chunks that hold it, so a read holds the chunks of one batch of entries and nothing else (no
shard-sized mapping, no temporary file). :func:`dcp_load` runs ``dcp.load`` with
:class:`~aegis.read.dcp_meta.CollectPlanner` into a flat state dict of full tensors. Callers:
:class:`aegis.read.api.Snapshot` (which decides the batches and where each chunk comes from).
"""

from __future__ import annotations

import bisect
import contextlib
import io
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from aegis.read.dcp_meta import CollectPlanner
from aegis.read.errors import ReadError
from aegis.snapshot.manifest import ItemRecord, Manifest, ShardLocation, dtype_from_name

__all__ = ["ChunkReader", "dcp_load", "quiet"]


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """DCP warns that it runs without a process group: that is the point here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed.*")
        warnings.filterwarnings("ignore", message=".*process group.*")
        warnings.filterwarnings("ignore", message=".*non-writable.*")  # frombuffer over bytes
        yield


def _narrow(t: torch.Tensor, offsets: Any, lengths: Any) -> torch.Tensor:
    for dim, (o, n) in enumerate(zip(offsets, lengths, strict=True)):
        t = t.narrow(dim, o, n)
    return t


class ChunkReader(StorageReader):
    """DCP ``StorageReader`` over verified raw chunks of an aegis snapshot.

    ``chunks`` maps shard rank -> chunk index -> the chunk's bytes; it must hold every chunk
    that the items of the load plan touch (:func:`aegis.read.locations.needed_chunks`). The
    bytes are trusted: check them before (the copies do)."""

    def __init__(self, manifest: Manifest, chunks: Mapping[int, Mapping[int, bytes]]) -> None:
        super().__init__()
        self.manifest = manifest
        self.chunks = chunks
        self._items: dict[tuple[int, str, tuple[int, ...] | None], ItemRecord] = {
            (s.rank, i.fqn, i.offset): i for s in manifest.shards for i in s.items
        }
        self._starts = {s.rank: [c.offset for c in s.chunks] for s in manifest.shards}
        self._metadata: Metadata | None = None

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata is None:
            self._metadata = self.manifest.to_dcp_metadata()
        return self._metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        self.storage_data: dict[MetadataIndex, ShardLocation] = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def item_pieces(self, rank: int, offset: int, length: int) -> list[memoryview]:
        """Bytes [offset, offset + length) of the shard of ``rank``: views of the chunks that
        hold them, in order (one view when one chunk holds them all)."""
        if length == 0:
            return [memoryview(b"")]
        shard = self.manifest.shard(rank)
        have = self.chunks.get(rank, {})
        i = max(bisect.bisect_right(self._starts[rank], offset) - 1, 0)
        pieces: list[memoryview] = []
        pos, end = offset, offset + length
        while pos < end:
            c = shard.chunks[i]
            data = have.get(i)
            if data is None:
                raise ReadError(f"step {self.manifest.step}, rank {rank}: chunk {i} was not read "
                                "(a bug in aegis: please report it)")
            lo = pos - c.offset
            hi = min(end, c.offset + c.length) - c.offset
            pieces.append(memoryview(data)[lo:hi])
            pos = c.offset + hi
            i += 1
        return pieces

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        for req in plan.items:
            loc = self.storage_data[req.storage_index]
            offset = req.storage_index.offset
            rec = self._items[(loc.rank, req.storage_index.fqn, tuple(offset) if offset is not None else None)]
            self._read_item(loc.rank, req, rec, planner)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read_item(self, rank: int, req: ReadItem, rec: ItemRecord, planner: LoadPlanner) -> None:
        pieces = self.item_pieces(rank, rec.file_offset, rec.length)
        if req.type == LoadItemType.BYTE_IO:
            planner.load_bytes(req, io.BytesIO(b"".join(pieces)))
            return
        dtype = dtype_from_name(rec.dtype or "uint8")
        shape = tuple(rec.shape or ())
        target = planner.resolve_tensor(req).detach()
        if tuple(target.size()) != tuple(req.lengths):
            raise ValueError(
                f"size mismatch for {req.storage_index.fqn}: snapshot chunk "
                f"{tuple(req.lengths)} vs destination {tuple(target.size())}"
            )
        whole = all(o == 0 for o in req.storage_offsets) and tuple(req.lengths) == shape
        with warnings.catch_warnings():  # read-only bytes: the tensors are only read
            warnings.simplefilter("ignore", UserWarning)
            if len(pieces) > 1 and whole and target.is_contiguous():
                # an item across chunk boundaries, copied piece by piece (boundaries are 64-byte
                # aligned, so whole elements): no joined copy of the item
                flat = target.view(-1)
                at = 0
                for p in pieces:
                    n = len(p) // dtype.itemsize
                    flat[at:at + n].copy_(torch.frombuffer(p, dtype=dtype, count=n))
                    at += n
            else:
                data = pieces[0] if len(pieces) == 1 else memoryview(b"".join(pieces))
                if rec.length == 0:
                    stored = torch.empty(shape, dtype=dtype)
                else:
                    stored = torch.frombuffer(data, dtype=dtype, count=rec.length // dtype.itemsize).view(shape)
                target.copy_(_narrow(stored, req.storage_offsets, req.lengths))
        planner.commit_tensor(req, target)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False


def checkpoint_error(e: CheckpointException) -> str:
    failures = getattr(e, "failures", {}) or {}
    parts = []
    for rank, wrapped in sorted(failures.items()):
        exc = wrapped[0] if isinstance(wrapped, tuple) else wrapped
        parts.append(f"{type(exc).__name__}: {exc}" + (f" (rank {rank})" if len(failures) > 1 else ""))
    return "; ".join(parts) or str(e)


def dcp_load(sd: dict[str, Any], reader: StorageReader, *, step: int | None, unpickle: bool = False,
             weights_only: bool = True, on_tensor: Callable[[int], None] | None = None) -> dict[str, bytes]:
    """``dcp.load`` of the flat state dict ``sd`` (full tensors, in place; non-tensor leaves are
    replaced by their values only with ``unpickle``) with no process group. Returns the
    serialized bytes of every non-tensor item read. DCP's failures become one ReadError."""
    planner = CollectPlanner(unpickle=unpickle, weights_only=weights_only, on_tensor=on_tensor)
    with quiet():
        try:
            dcp.load(sd, storage_reader=reader, planner=planner)
        except CheckpointException as e:  # a BaseException: one line, no traceback
            raise ReadError(f"loading step {step} failed: {checkpoint_error(e)}") from None
    return planner.raw
