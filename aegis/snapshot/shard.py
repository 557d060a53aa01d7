"""The shard format: one rank's part of a snapshot as a single blob.

Layout of a shard file::

    [tensor region]  raw bytes of every tensor item, each 64-byte aligned, grouped by dtype
    [bytes region]   serialized non-tensor items, each 64-byte aligned
    [index]          JSON: chunk records (offset, length, crc32c, dtype) and item records
    [footer]         24 bytes: magic, index length, crc32c of the index

Chunks tile the data (tensor + bytes regions) without gaps; a chunk never mixes dtypes, so a
codec can choose a transform per chunk. Nothing in a shard is pickled except the bytes items,
which DCP serializes and aegis loads with ``torch.load(weights_only=True)``.

Planning (:func:`plan_layout`) is pure and done once per state-dict structure; the engine then
copies tensors straight to their planned offsets on every save.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import json
import math
import mmap
import os
import struct
import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import crc32c as _crc32c
import torch
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from aegis.errors import CorruptShardError, ManifestError
from aegis.snapshot.manifest import (
    SHARD_FORMAT_VERSION,
    ChunkRecord,
    ItemRecord,
    ShardRecord,
    _Parser,
    check_layout,
    chunk_from_doc,
    chunk_to_row,
    dtype_name,
    item_from_doc,
    item_to_doc,
    load_json,
)

__all__ = [
    "ALIGN",
    "FOOTER_SIZE",
    "TensorSlot",
    "ShardLayout",
    "ShardIndex",
    "plan_layout",
    "finish_layout",
    "encode_tail",
    "decode_footer",
    "decode_index",
    "crc32c",
    "verify_chunks",
    "check_blob",
    "check_split",
    "zero_gaps",
    "check_index_matches",
    "chunks_for_ranges",
]

ALIGN = 64
_MAGIC = b"AEGSHRD1"
_FOOTER = struct.Struct("<8sQI4x")
FOOTER_SIZE = _FOOTER.size  # 24


_PARALLEL_MIN = 64 << 20  # below this many bytes one thread is as fast
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _checksum_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1),
                                       thread_name_prefix="aegis-crc32c")
        return _pool


def crc32c_ranges(view: memoryview, ranges: Sequence[tuple[int, int]]) -> list[int]:
    """crc32c of each ``(offset, length)`` of ``view``, on up to 8 threads when there is enough
    to check (crc32c releases the GIL: measured 13.8 GB/s on one core of this 2-core machine,
    21.6 GB/s on two); a restore checks every byte it reads, so one core must not be the bound."""
    total = sum(n for _, n in ranges)
    workers = min(8, os.cpu_count() or 1)

    def one(r: tuple[int, int]) -> int:
        with view[r[0]:r[0] + r[1]] as part:
            return crc32c(part)

    if total < _PARALLEL_MIN or len(ranges) < 2 or workers < 2:
        return [one(r) for r in ranges]
    return list(_checksum_pool().map(one, ranges))


def crc32c(data: memoryview | bytes | bytearray, value: int = 0) -> int:
    """crc32c of ``data`` (hardware accelerated; releases the GIL on large buffers)."""
    return _crc32c.crc32c(data, value)


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class TensorSlot:
    """Where one tensor write item goes in the tensor region."""

    item: WriteItem
    file_offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True)
class ShardLayout:
    """The fixed part of a shard's layout, derived from a rank's final DCP save plan."""

    tensors: tuple[TensorSlot, ...]
    byte_items: tuple[WriteItem, ...]
    tensor_end: int  # 64-aligned end of the tensor region
    tensor_chunks: tuple[tuple[int, int, str], ...]  # (offset, length, dtype) tiling [0, tensor_end)
    chunk_bytes: int

    @property
    def tensor_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @functools.cached_property
    def gaps(self) -> tuple[tuple[int, int], ...]:
        """(offset, length) of the alignment padding in the tensor region: what no item writes.
        Kept zero in every slot of this layout (:func:`zero_gaps`), so that two ranks holding
        the same tensors make the same bytes (a replica built from a data-parallel copy)."""
        return tuple((t.file_offset + t.nbytes, _align(t.file_offset + t.nbytes) - t.file_offset - t.nbytes)
                     for t in self.tensors if t.nbytes % ALIGN)

    def spans(self, items: Iterable[int]) -> list[tuple[int, int]]:
        """The byte ranges [start, end) of the tensor slots ``items`` (indices into
        ``tensors``), each with its trailing padding, adjacent ones merged."""
        out: list[tuple[int, int]] = []
        for i in sorted(items):
            t = self.tensors[i]
            a, b = t.file_offset, _align(t.file_offset + t.nbytes)
            if out and out[-1][1] == a:
                out[-1] = (out[-1][0], b)
            else:
                out.append((a, b))
        return out


def zero_gaps(view: torch.Tensor, layout: ShardLayout) -> None:
    """Zero ``layout``'s padding in a slot's uint8 ``view`` (once per slot and layout: no item
    ever writes there)."""
    for off, n in layout.gaps:
        view[off:off + n].zero_()


def plan_layout(items: Sequence[WriteItem], *, chunk_bytes: int) -> ShardLayout:
    """Place every tensor item of a save plan; pure, deterministic in the plan's item order."""
    if chunk_bytes <= 0 or chunk_bytes % ALIGN:
        raise ValueError(f"chunk_bytes must be a positive multiple of {ALIGN}, got {chunk_bytes}")
    tensor_items = [i for i in items if i.type != WriteItemType.BYTE_IO]
    byte_items = tuple(i for i in items if i.type == WriteItemType.BYTE_IO)
    # Group by dtype (stable) so that every chunk holds one dtype.
    order: dict[torch.dtype, list[WriteItem]] = {}
    for it in tensor_items:
        assert it.tensor_data is not None
        order.setdefault(it.tensor_data.properties.dtype, []).append(it)
    # Small items first within a dtype: replicated scalars (which DCP saves on one rank and every
    # rank reads) then share the first chunk, so a reader fetching them pulls one chunk, not all.
    for group in order.values():
        group.sort(key=lambda it: math.prod(it.tensor_data.chunk.sizes))  # type: ignore[union-attr]
    slots: list[TensorSlot] = []
    chunks: list[tuple[int, int, str]] = []
    pos = 0
    for dtype, group in order.items():
        start = pos
        for it in group:
            assert it.tensor_data is not None
            shape = tuple(int(s) for s in it.tensor_data.chunk.sizes)
            nbytes = math.prod(shape) * dtype.itemsize
            slots.append(TensorSlot(it, pos, nbytes, dtype, shape))
            pos = _align(pos + nbytes)
        end = max(pos, start)
        for off in range(start, end, chunk_bytes):
            chunks.append((off, min(chunk_bytes, end - off), dtype_name(dtype)))
    return ShardLayout(tuple(slots), byte_items, pos, tuple(chunks), chunk_bytes)


@dataclass(frozen=True)
class ShardIndex:
    """The self-description stored at the end of a shard (and copied into the manifest)."""

    job: str
    step: int
    rank: int
    chunks: tuple[ChunkRecord, ...]
    items: tuple[ItemRecord, ...]
    format_version: int = SHARD_FORMAT_VERSION

    @property
    def data_end(self) -> int:
        return self.chunks[-1].offset + self.chunks[-1].length if self.chunks else 0


def finish_layout(
    layout: ShardLayout, payloads: Sequence[bytes]
) -> tuple[list[ItemRecord], list[tuple[int, int, str]], list[int], int]:
    """Place the bytes items after the tensor region.

    Returns (item records, chunk ranges of the whole data region, file offsets of the payloads,
    data end).
    """
    records = [
        ItemRecord(
            fqn=t.item.index.fqn,
            offset=tuple(t.item.index.offset) if t.item.index.offset is not None else None,
            file_offset=t.file_offset,
            length=t.nbytes,
            dtype=dtype_name(t.dtype),
            shape=t.shape,
        )
        for t in layout.tensors
    ]
    chunks = list(layout.tensor_chunks)
    pos = layout.tensor_end
    offsets = []
    start = pos
    for item, payload in zip(layout.byte_items, payloads, strict=True):
        offsets.append(pos)
        records.append(ItemRecord(fqn=item.index.fqn, offset=None, file_offset=pos, length=len(payload)))
        pos += len(payload)
        pos = _align(pos)
    for off in range(start, pos, layout.chunk_bytes):
        chunks.append((off, min(layout.chunk_bytes, pos - off), "bytes"))
    return records, chunks, offsets, pos


def encode_tail(index: ShardIndex) -> tuple[bytes, int]:
    """The index + footer bytes that end a shard, and the index's crc32c."""
    doc = {
        "format_version": index.format_version,
        "job": index.job,
        "step": index.step,
        "rank": index.rank,
        "chunks": [chunk_to_row(c) for c in index.chunks],
        "items": [item_to_doc(i) for i in index.items],
    }
    body = json.dumps(doc, separators=(",", ":")).encode()
    crc = crc32c(body)
    return body + _FOOTER.pack(_MAGIC, len(body), crc), crc


def decode_footer(footer: bytes, *, size: int, where: str) -> tuple[int, int]:
    """(index offset, index crc32c) from a shard's last FOOTER_SIZE bytes."""
    if len(footer) != FOOTER_SIZE:
        raise ManifestError(f"{where}: shard is truncated (no footer)")
    magic, length, crc = _FOOTER.unpack(footer)
    if magic != _MAGIC:
        raise ManifestError(f"{where}: not an aegis shard (bad magic {magic!r})")
    if length > size - FOOTER_SIZE:
        raise ManifestError(f"{where}: index length {length} exceeds the shard size {size}")
    return size - FOOTER_SIZE - length, crc


_INDEX_CACHE_SIZE = 16
_indexes: dict[tuple[bytes, int, int], ShardIndex] = {}  # (blake2b of the body, crc, size) -> index
_indexes_lock = threading.Lock()


def decode_index(body: bytes, *, crc: int, size: int, where: str) -> ShardIndex:
    """Parse the index ``body`` of a shard of ``size`` bytes, which ends with ``body`` and the
    footer; the data region (every chunk) must end where the index begins.

    Bytes this process already decoded (the same body, crc and size) are not parsed again: a
    restore reads a local shard's index to put the step's manifest together and again to check
    the copy it loads, 13 ms each for the ~2,000 items of a 1 GB shard of the bench's model
    (O(items per rank)); the blake2b of the body that keys the cache costs ~0.2 ms."""
    import hashlib

    key = (hashlib.blake2b(body, digest_size=16).digest(), crc, size)
    with _indexes_lock:  # restores, uploads and the reading layer decode from several threads
        hit = _indexes.pop(key, None)
        if hit is not None:
            _indexes[key] = hit  # most recently used last
            return hit
    index = _decode_index(body, crc=crc, size=size, where=where)
    with _indexes_lock:
        while len(_indexes) >= _INDEX_CACHE_SIZE:
            _indexes.pop(next(iter(_indexes)))
        _indexes[key] = index
    return index


def _decode_index(body: bytes, *, crc: int, size: int, where: str) -> ShardIndex:
    if crc32c(body) != crc:
        raise ManifestError(f"{where}: shard index fails its crc32c check; the shard is damaged")
    p = _Parser(where)
    d = p.obj(load_json(body, what="shard index", where=where), "shard index")
    if "format_version" not in d:
        raise p.fail("shard index is missing field(s) ['format_version']")
    version = p.int_(d["format_version"], "format_version", lo=1)
    if version > SHARD_FORMAT_VERSION:
        raise ManifestError(
            f"{where}: shard written by a newer aegis (format {version} > {SHARD_FORMAT_VERSION}); upgrade aegis"
        )
    p.fields(d, "shard index", required={"format_version", "job", "step", "rank", "chunks", "items"},
             optional=set())
    chunks = tuple(chunk_from_doc(p, c, f"chunks[{i}]") for i, c in enumerate(p.list_(d["chunks"], "chunks")))
    items = tuple(item_from_doc(p, it, f"items[{i}]") for i, it in enumerate(p.list_(d["items"], "items")))
    check_layout(p, size, chunks, items, "shard")
    index_start = size - FOOTER_SIZE - len(body)
    data_end = chunks[-1].offset + chunks[-1].length if chunks else 0
    if data_end > index_start:
        raise ManifestError(
            f"{where}: shard chunks end at byte {data_end}, which overlaps the shard index and footer "
            f"(they start at byte {index_start}); the shard is damaged or forged"
        )
    return ShardIndex(
        job=p.str_(d["job"], "job"),
        step=p.int_(d["step"], "step"),
        rank=p.int_(d["rank"], "rank"),
        chunks=chunks,
        items=items,
        format_version=version,
    )


def verify_chunks(
    data: memoryview | bytes | mmap.mmap,
    chunks: Sequence[ChunkRecord],
    *,
    step: int,
    rank: int,
    where: str,
    only: Iterable[int] | None = None,
) -> None:
    """Check the crc32c of every chunk (or of the chunks ``only`` names); raise
    :class:`CorruptShardError` naming the first bad chunk."""
    bad: tuple[int, ChunkRecord, int, int] | None = None
    indices = sorted(only) if only is not None else range(len(chunks))
    with memoryview(data) as view:
        size = len(view)
        ok = [i for i in indices if chunks[i].offset + chunks[i].length <= size]
        got_all = crc32c_ranges(view, [(chunks[i].offset, chunks[i].length) for i in ok])
        got_of = dict(zip(ok, got_all, strict=True))
        for i in indices:
            c = chunks[i]
            end = c.offset + c.length
            if i not in got_of:
                bad = (i, c, end, -1)
                break
            if got_of[i] != c.crc32c:
                bad = (i, c, end, got_of[i])
                break
    if bad is None:
        return
    i, c, end, got = bad
    if got < 0:
        raise CorruptShardError(
            f"shard of rank {rank} at step {step} ({where}) is truncated: chunk {i} ends at "
            f"byte {end}, the shard has {size}",
            step=step, rank=rank, chunk=i, where=where,
        )
    raise CorruptShardError(
        f"crc32c mismatch in step {step}, rank {rank}, chunk {i} (bytes {c.offset}..{end}) "
        f"of {where}: expected {c.crc32c:#010x}, got {got:#010x}",
        step=step, rank=rank, chunk=i, where=where,
    )


def check_index_matches(index: ShardIndex, record: ShardRecord, *, step: int, where: str) -> None:
    """The shard's own index must describe the same layout as the manifest's record of it: same
    step and rank, same chunks (offset, length, crc32c, dtype) and the same items. A manifest and
    a shard that disagree are a corrupt snapshot, whichever of the two was damaged."""
    rank = record.rank
    problem = None
    if (index.step, index.rank) != (step, rank):
        problem = f"it holds the shard of rank {index.rank} at step {index.step}"
    elif len(index.chunks) != len(record.chunks):
        problem = f"{len(index.chunks)} chunks in the shard, {len(record.chunks)} in the manifest"
    else:
        for i, (a, b) in enumerate(zip(index.chunks, record.chunks, strict=True)):
            if (a.offset, a.length, a.crc32c, a.dtype) != (b.offset, b.length, b.crc32c, b.dtype):
                problem = f"chunk {i} is {a.offset}+{a.length} in the shard, {b.offset}+{b.length} in the manifest"
                break
        else:
            mine = {(i.fqn, i.offset): i for i in index.items}
            for item in record.items:
                got = mine.get((item.fqn, item.offset))
                if got != item:
                    problem = (f"item {item.fqn!r} is at {got.file_offset}+{got.length} in the shard, "
                               f"{item.file_offset}+{item.length} in the manifest" if got is not None
                               else f"item {item.fqn!r} of the manifest is not in the shard")
                    break
            else:
                if len(mine) != len(record.items):
                    problem = f"{len(mine)} items in the shard, {len(record.items)} in the manifest"
    if problem is not None:
        raise CorruptShardError(
            f"shard of rank {rank} at step {step} ({where}) does not match the manifest: {problem}; "
            "one of the two is damaged", step=step, rank=rank, where=where)


def check_blob(data: memoryview | bytes, *, step: int, rank: int, where: str) -> tuple[ShardIndex, int]:
    """Verify a whole shard held in memory (a received replica): footer, index, every chunk.

    Returns the index and its crc32c (to compare with the owner's record).
    """
    return check_split(memoryview(b""), data, step=step, rank=rank, where=where)


def check_split(head: memoryview, tail: memoryview | bytes, *, step: int, rank: int, where: str
                ) -> tuple[ShardIndex, int]:
    """:func:`check_blob` of a shard held in two pieces: ``head``, its tensor region (mapped),
    and ``tail``, the rest (bytes region, index, footer) in private memory, as a replica built
    from a data-parallel copy holds it before the tail is written behind the head."""
    te = len(head)
    size = te + len(tail)
    try:
        if len(tail) < FOOTER_SIZE:
            raise ManifestError(f"{where}: shard is truncated ({size} bytes)")
        start, icrc = decode_footer(bytes(tail[-FOOTER_SIZE:]), size=size, where=where)
        if start < te:
            raise ManifestError(f"{where}: the index starts at {start}, inside the tensor region")
        index = decode_index(bytes(tail[start - te:len(tail) - FOOTER_SIZE]), crc=icrc, size=size,
                             where=where)
        if any(c.offset < te < c.offset + c.length for c in index.chunks):
            raise ManifestError(f"{where}: a chunk spans the end of the tensor region ({te})")
    except ManifestError as e:
        raise CorruptShardError(f"shard of rank {rank} at step {step}: {e}", step=step, rank=rank,
                                where=where) from e
    if index.step != step or index.rank != rank:
        raise CorruptShardError(
            f"{where}: expected the shard of rank {rank} at step {step}, got rank {index.rank} at "
            f"step {index.step}", step=step, rank=rank, where=where)
    n_head = sum(1 for c in index.chunks if c.offset < te)
    verify_chunks(head, index.chunks, step=step, rank=rank, where=where, only=range(n_head))
    shifted = index.chunks if not te else [dataclasses.replace(c, offset=c.offset - te)
                                           for c in index.chunks[n_head:]]
    verify_chunks(tail, shifted, step=step, rank=rank, where=where)
    return index, icrc


def chunks_for_ranges(chunks: Sequence[ChunkRecord], ranges: Iterable[tuple[int, int]]) -> set[int]:
    """Indices of the chunks overlapping any (offset, length) byte range."""
    starts = [c.offset for c in chunks]
    out: set[int] = set()
    for off, length in ranges:
        i = max(bisect.bisect_right(starts, off) - 1, 0)
        end = off + max(length, 1)
        while i < len(chunks) and chunks[i].offset < end:
            out.add(i)
            i += 1
    return out
