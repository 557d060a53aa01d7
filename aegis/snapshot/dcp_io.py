"""DCP ``StorageWriter``/``StorageReader`` over shard files in a node store.

The writer is split in two halves so the engine can run them apart:

* :func:`stage` - the blocking half: copy every tensor of the rank's final save plan straight to
  its planned offset in a mapped slot, and serialize the (small) non-tensor items.
* :func:`complete` - the background half: crc32c per chunk, bytes region, index and footer.

:class:`ShardWriter` runs both in ``write_data`` so that plain ``dcp.save(...,
storage_writer=ShardWriter(...))`` works too (all ranks on one node). :class:`ShardReader` serves
``dcp.load`` from the shard files of any rank, which is what resharding and DCP's de-duplication
(an item saved by one rank, needed by all) require.
"""

from __future__ import annotations

import contextlib
import io
import mmap
import os
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
)
from torch.distributed.checkpoint.planner_helpers import (
    _create_read_items,
    create_read_items_for_chunk_list,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.distributed.tensor import DTensor
from torch.futures import Future

from aegis import _fault
from aegis.errors import AegisError
from aegis.snapshot import hostmem
from aegis.snapshot.manifest import (
    ChunkRecord,
    ItemRecord,
    Manifest,
    ShardLocation,
    ShardRecord,
    dtype_from_name,
)
from aegis.snapshot.node_store import NodeStore, Slot
from aegis.snapshot.shard import (
    ShardIndex,
    ShardLayout,
    crc32c,
    encode_tail,
    finish_layout,
    plan_layout,
    zero_gaps,
)
from aegis.snapshot.staging import CopyBarrier, Stager
from aegis.snapshot.stream_read import Received, byte_view, stream_chunks

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "StagedShard",
    "stage",
    "complete",
    "ShardWriter",
    "ShardReader",
    "SafeLoadPlanner",
]

DEFAULT_CHUNK_BYTES = 16 << 20


def _narrow(t: torch.Tensor, offsets: Any, lengths: Any) -> torch.Tensor:
    """The hypercube [offsets, offsets + lengths) of ``t`` (DCP's resharding read)."""
    for dim, (off, length) in enumerate(zip(offsets, lengths, strict=True)):
        if off != 0 or length != t.size(dim):
            t = t.narrow(dim, off, length)
    return t


@dataclass
class StagedShard:
    """A rank's shard after the blocking copy, waiting for :func:`complete`."""

    step: int
    rank: int
    layout: ShardLayout
    slot: Slot
    payloads: list[bytes]
    copy_s: float
    tail: bytes = b""  # after complete(): the bytes region, index and footer
    barrier: CopyBarrier | None = None  # staging="async": the copies still in flight (wait before crc)


def stage(step: int, rank: int, layout: ShardLayout, slot: Slot,
          resolve: Callable[[WriteItem], Any], stager: Stager | None = None) -> StagedShard:
    """Copy the rank's state into ``slot``. The only part of a save that blocks training.

    Tensors land at their planned offsets (one copy, no intermediate buffer); byte items are
    serialized (DCP's ``torch.save`` of small objects). ``resolve`` is the planner's
    ``resolve_data`` or the engine's cached equivalent. With a ``stager`` in
    ``pinned`` or ``async`` mode, device tensors go ``non_blocking`` into the (registered) slot,
    and in ``async`` mode the tensors the optimizers update are left to the returned shard's
    ``barrier`` (see :mod:`aegis.snapshot.staging`).
    """
    t0 = time.perf_counter()
    stager = stager or Stager("sync")
    views = slot.item_views(layout)
    if slot.clean is not layout:  # padding zeroed once per slot and layout (ShardLayout.gaps)
        zero_gaps(slot.view, layout)
        slot.clean = layout
    pairs = []
    for t, dst in zip(layout.tensors, views, strict=True):
        src = resolve(t.item)
        assert isinstance(src, torch.Tensor)
        pairs.append((dst, src))
    split = stager.split(pairs)
    half = len(split.now) // 2
    stager.copy_now(split.now[:half], slot.pinned)
    _fault.hit("stage", step, rank)
    stager.copy_now(split.now[half:], slot.pinned)
    barrier = stager.begin_deferred(split.later, slot.pinned) if stager.mode == "async" else None
    payloads = []
    for item in layout.byte_items:
        data = resolve(item)
        assert isinstance(data, io.BytesIO)
        payloads.append(data.getvalue())
    return StagedShard(step, rank, layout, slot, payloads, time.perf_counter() - t0, barrier=barrier)


def complete(staged: StagedShard, *, job: str, node: str) -> ShardRecord:
    """Checksum the staged shard and write its bytes region, index and footer."""
    layout = staged.layout
    records, chunk_ranges, offsets, data_end = finish_layout(layout, staged.payloads)
    region = bytearray(data_end - layout.tensor_end)
    for off, payload in zip(offsets, staged.payloads, strict=True):
        start = off - layout.tensor_end
        region[start:start + len(payload)] = payload
    mem = staged.slot.memory
    chunks = []
    for off, length, dtype in chunk_ranges:
        if off < layout.tensor_end:
            crc = crc32c(mem[off:off + length])
        else:
            start = off - layout.tensor_end
            crc = crc32c(memoryview(region)[start:start + length])
        chunks.append(ChunkRecord(off, length, crc, dtype))
    mem.release()
    _fault.hit("complete", staged.step, staged.rank)
    index = ShardIndex(job=job, step=staged.step, rank=staged.rank, chunks=tuple(chunks), items=tuple(records))
    tail, icrc = encode_tail(index)
    payload_writes = [(layout.tensor_end, bytes(region))] if region else []
    size = staged.slot.write_tail(payload_writes, tail, data_end)
    staged.tail = bytes(region) + tail
    return ShardRecord(
        rank=staged.rank,
        node=node,
        size=size,
        index_crc32c=icrc,
        chunks=index.chunks,
        items=index.items,
    )


def _refusal_reason(e: BaseException) -> str:
    """The line of torch's refusal that names what was refused (not its advice to retry with
    weights_only=False, which is exactly what must not be done with a hostile snapshot)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    skip = ("Weights only load failed", "Check the documentation", "Please file an issue")
    return next((line for line in lines if not line.startswith(skip)), lines[0] if lines else "")


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, but non-tensor items never execute code from the snapshot:
    they are loaded with ``torch.load(weights_only=True)``; and its local plan reuses the local
    chunk of every DTensor of the same mesh, placements and shapes (:func:`_dtensor_chunks`)."""

    def create_local_plan(self) -> LoadPlan:
        """DCP's ``create_default_local_load_plan``, item for item, with the DTensor's local
        chunk memoized: DTensor computes it per tensor (``compute_local_shape_and_global_offset``,
        0.07 s of a 2 GB restore's 0.5 s here, for 879 tensors of ~20 distinct shapes)."""
        assert self.metadata is not None
        if not self.metadata.state_dict_metadata.keys() >= self.state_dict.keys():
            # keys the snapshot lacks: DCP's own handling (pre-2.4 key names, partial loads);
            # keys only the snapshot has (other ranks' per-rank state) are not read, as in DCP
            return super().create_local_plan()
        requests: list[ReadItem] = []
        strict = not self.allow_partial_load
        for fqn, obj in self.state_dict.items():
            if fqn not in self.metadata.state_dict_metadata:
                if strict:
                    raise RuntimeError(f"Missing key in checkpoint state_dict: {fqn}.")
                continue
            md = self.metadata.state_dict_metadata[fqn]
            if isinstance(md, TensorStorageMetadata) and getattr(obj, "size", None) is not None \
                    and md.size != obj.size():
                raise ValueError(f"Size mismatch between saved {md.size} and current: {obj.size()} for {fqn}")
            if isinstance(md, BytesStorageMetadata):
                requests += _create_read_items(fqn, md, obj)
            elif isinstance(obj, DTensor) and type(obj._local_tensor) is torch.Tensor:
                if obj.device_mesh.get_coordinate() is not None:
                    requests += create_read_items_for_chunk_list(fqn, md, _dtensor_chunks(obj))
            elif isinstance(obj, DTensor) and obj.device_mesh.get_coordinate() is None:
                continue
            else:
                requests += _create_read_items(fqn, md, obj)
        return LoadPlan(requests)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            # weights_only=True given explicitly: TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD cannot undo it
            obj = torch.load(value, weights_only=True)
        except Exception as e:  # noqa: BLE001 - whatever torch refuses, the item is not loaded
            reason = _refusal_reason(e)
            raise AegisError(
                f"non-tensor item {fqn!r} of the snapshot was refused by torch.load(weights_only=True) "
                f"and not loaded; nothing in it was executed ({type(e).__name__}: {reason[:300]}). "
                "The snapshot was damaged or forged, or the item holds an object of a type that "
                "cannot be loaded safely: keep non-tensor state to tensors and plain Python values "
                "(dict, list, str, int, float, bool, None)"
            ) from e
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


# (mesh shape, this rank's coordinate, placements, global shape, local shape) -> the local
# chunk: everything DTensor's computation of it reads. Not keyed by the mesh object: meshes
# re-formed in place compare equal to the old ones while this process's coordinate changed.
_chunk_memo: dict[tuple[Any, ...], list[ChunkStorageMetadata]] = {}


def _dtensor_chunks(t: DTensor) -> list[ChunkStorageMetadata]:
    """``t.__create_chunk_list__()``, memoized on what decides it."""
    mesh = t.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return t.__create_chunk_list__()
    key = (tuple(mesh.shape), tuple(coordinate), tuple(t.placements), tuple(t.shape),
           tuple(t._local_tensor.shape))
    got = _chunk_memo.get(key)
    if got is None:
        if len(_chunk_memo) > 65536:
            _chunk_memo.clear()
        got = _chunk_memo[key] = t.__create_chunk_list__()
    return got


class ShardWriter(StorageWriter):
    """Plain DCP ``StorageWriter`` writing one shard per rank into a node store.

    Collective use, as with any DCP writer: every rank calls ``dcp.save(state,
    storage_writer=ShardWriter(store, step))``. ``finish`` (coordinator only) reads each rank's
    shard index back from the node store, so this path needs every rank on one node; the
    :class:`~aegis.snapshot.engine.SnapshotEngine` gathers shard records over its own group.
    """

    def __init__(self, store: NodeStore, step: int, *, node: str = "local",
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        super().__init__()
        self.store = store
        self.step = step
        self.node = node
        self.chunk_bytes = chunk_bytes
        self.rank = 0
        self.is_coordinator = False
        self.started = time.time()

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.started = time.time()

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank", 0))
        self.store.create()

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        layout = plan_layout(plan.items, chunk_bytes=self.chunk_bytes)
        path = self.store.shard_path(self.step, self.rank)
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        slot = Slot(path)
        try:
            slot.ensure(layout.tensor_end)
            record = complete(stage(self.step, self.rank, layout, slot, planner.resolve_data),
                              job=self.store.job,
                              node=self.node)
        finally:
            slot.close()
        by_key = {(i.fqn, i.offset): i for i in record.items}
        results = []
        for item in plan.items:
            offset = tuple(item.index.offset) if item.index.offset is not None else None
            rec = by_key[(item.index.fqn, offset)]
            results.append(
                WriteResult(
                    index=item.index,
                    size_in_bytes=rec.length,
                    storage_data=ShardLocation(self.rank, rec.file_offset, rec.length),
                )
            )
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        shards = []
        for rank in range(len(results)):
            index, size, icrc = self.store.read_shard_index(self.step, rank)
            shards.append(ShardRecord(rank, self.node, size, icrc, index.chunks, index.items))
        manifest = Manifest(
            job=self.store.job,
            step=self.step,
            world_size=len(results),
            shards=tuple(shards),
            entries=Manifest.entries_from_dcp(metadata),
            planner_data={k: tuple(v) for k, v in (metadata.planner_data or {}).items()},
            created=self.started,
        )
        self.store.write_manifest(manifest)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=str(self.store.step_dir(self.step)))

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False


def plain_span(rec: ItemRecord, req: ReadItem, target: torch.Tensor) -> tuple[int, int] | None:
    """The stored bytes [start, end) that land unchanged in ``target``: the item read whole, or
    a run of its rows (a resharded read along the first dimension), of ``target``'s dtype. None
    when the read needs more than a byte copy."""
    if rec.dtype is None or rec.shape is None:
        return None
    dtype = dtype_from_name(rec.dtype)
    if target.dtype != dtype:
        return None
    shape = tuple(rec.shape)
    offs, lens = tuple(req.storage_offsets), tuple(req.lengths)
    if len(offs) != len(shape) or any(o != 0 or n != d for o, n, d in zip(offs[1:], lens[1:], shape[1:], strict=True)):
        return None
    if not shape:
        start, end = rec.file_offset, rec.file_offset + rec.length
    else:
        row = rec.length // shape[0] if shape[0] else 0
        start, end = rec.file_offset + offs[0] * row, rec.file_offset + (offs[0] + lens[0]) * row
    if end - start != target.numel() * target.element_size():
        return None
    return start, end


class ShardReader(StorageReader):
    """DCP ``StorageReader`` over local shard files of one committed snapshot.

    ``paths`` maps each rank of the snapshot to a local file holding that rank's shard (own
    store, or a copy fetched from a peer or the durable tier). Verify the shards before loading:
    the reader trusts the bytes it maps. A shard is mapped with its pages populated at once
    (one bulk fault-in, cheaper than a fault per page), except the ranks in ``sparse``, of which
    this rank reads a small part (a few replicated items): populating a whole shard to read a
    few KB of it cost 30 ms per 0.5 GB here.

    The ranks in ``verify`` (rank -> the indices of the chunks this rank's plan reads) are not
    verified yet: their files are streamed (:mod:`aegis.snapshot.stream_read`): the bytes of
    every item whose destination is a contiguous CPU tensor of the stored dtype are read
    straight into it and each chunk's crc32c is computed as they land, in one pass; the other
    items (resharded along a later dimension, non-tensor, on a GPU) are read from a mapping once
    every chunk they touch has been checked. A bad chunk raises CorruptShardError.

    The ranks in ``received`` came from a peer straight into the state, verified
    (:mod:`aegis.training.restore_direct`): their items in place are committed as they are,
    the others are copied out of the received scratch bytes.
    """

    def __init__(self, manifest: Manifest, paths: Mapping[int, str | os.PathLike[str]],
                 *, sparse: Collection[int] = (), maps: dict[str, mmap.mmap] | None = None,
                 verify: Mapping[int, Collection[int]] | None = None,
                 received: Mapping[int, Received] | None = None) -> None:
        super().__init__()
        self.manifest = manifest
        self.paths = {r: Path(p) for r, p in paths.items()}
        self.sparse = frozenset(sparse)
        self.verify = dict(verify or {})
        self.received = dict(received or {})
        self._streamed: set[int] = set()
        self._given = maps if maps is not None else {}  # path -> a mapping made by the verify
        self._items: dict[tuple[int, str, tuple[int, ...] | None], ItemRecord] = {
            (s.rank, i.fqn, i.offset): i for s in manifest.shards for i in s.items
        }
        self._maps: dict[int, mmap.mmap] = {}
        self._pinned: dict[int, torch.Tensor] = {}  # rank -> registered mapping of its tensor region
        self._device_copies = False  # non_blocking host-to-device copies issued, not yet waited
        self.bytes_read = 0
        self.bytes_by_rank: dict[int, int] = {}
        self.seconds_by_rank: dict[int, float] = {}

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        pass

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self.manifest.to_dcp_metadata()

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        self.storage_data: dict[MetadataIndex, ShardLocation] = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def _map(self, rank: int) -> mmap.mmap:
        m = self._maps.get(rank)
        if m is None:
            path = self.paths.get(rank)
            if path is None:
                raise FileNotFoundError(
                    f"shard of rank {rank} for step {self.manifest.step} is not available locally"
                )
            m = self._given.pop(str(path), None)  # the verify's mapping of these bytes
            if m is None:
                with open(path, "rb") as f:
                    # Read-only, shared, populated at once: the pages are the node store's own
                    # (tmpfs), mapped without the page faults of a private copy-on-write mapping.
                    # (a streamed shard's mapping serves the few items left: never populated)
                    sparse = rank in self.sparse or rank in self._streamed
                    m = hostmem.map_file(f.fileno(), 0, write=False, populate=not sparse)
            self._maps[rank] = m
            kept = hostmem.lookup(str(path))
            if kept is not None and kept.pinned:  # this process registered it: copies run at DMA speed
                self._pinned[rank] = kept.view
        return m

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_rank: dict[int, list[tuple[ReadItem, ItemRecord]]] = {}
        for req in plan.items:
            loc = self.storage_data[req.storage_index]
            offset = req.storage_index.offset
            rec = self._items[(loc.rank, req.storage_index.fqn,
                               tuple(offset) if offset is not None else None)]
            per_rank.setdefault(loc.rank, []).append((req, rec))
        try:
            for rank, reqs in sorted(per_rank.items()):
                t0 = time.perf_counter()
                if rank in self.received:
                    for req, rec in reqs:
                        self._from_received(self.received[rank], rank, req, rec, planner)
                    reqs = []
                elif rank in self.verify:
                    reqs = self._stream(rank, reqs, planner)  # what it could not stream
                if reqs:
                    m = self._map(rank)
                    for req, rec in reqs:
                        self._read_item(m, rank, req, rec, planner)
                self.seconds_by_rank[rank] = time.perf_counter() - t0
            if self._device_copies:  # the mappings must outlive the copies that read them
                torch.cuda.synchronize()
        finally:
            self.close()
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _stream(self, rank: int, reqs: list[tuple[ReadItem, ItemRecord]], planner: LoadPlanner
                ) -> list[tuple[ReadItem, ItemRecord]]:
        """Read, and check, the chunks of ``rank``'s shard this rank needs, the items with a
        plain destination straight into it; return the items left for the mapped path."""
        path = self.paths.get(rank)
        if path is None:
            raise FileNotFoundError(f"shard of rank {rank} for step {self.manifest.step} is not available locally")
        plain: list[tuple[int, int, memoryview, ReadItem, ItemRecord, torch.Tensor]] = []
        rest: list[tuple[ReadItem, ItemRecord]] = []
        for req, rec in reqs:
            span = view = None
            if req.type != LoadItemType.BYTE_IO:
                target = planner.resolve_tensor(req).detach()
                span = plain_span(rec, req, target)
                view = byte_view(target) if span is not None else None
            if span is None or view is None or len(view) != span[1] - span[0]:
                rest.append((req, rec))
            else:
                plain.append((span[0], span[1], view, req, rec, target))
        plain.sort(key=lambda x: x[0])
        keep: list[tuple[int, int, memoryview]] = []
        direct: list[tuple[ReadItem, torch.Tensor, int]] = []
        for a, b, view, req, rec, target in plain:
            if keep and a < keep[-1][1]:  # bytes another destination takes too: copied after
                rest.append((req, rec))
                continue
            keep.append((a, b, view))
            direct.append((req, target, b - a))
        self._streamed.add(rank)
        fd = os.open(path, os.O_RDONLY)
        try:
            stream_chunks(fd, self.manifest.shard(rank).chunks, sorted(self.verify.pop(rank)), keep,
                          step=self.manifest.step, rank=rank, where=f"node store file {path}")
        finally:
            os.close(fd)
        for req, target, n in direct:
            planner.commit_tensor(req, target)
            self._count(rank, n)
        return rest

    def _from_received(self, got: Received, rank: int, req: ReadItem, rec: ItemRecord,
                       planner: LoadPlanner) -> None:
        whole = (rec.file_offset, rec.file_offset + rec.length)
        if req.type == LoadItemType.BYTE_IO:
            data = got.bytes_at(rec.file_offset, rec.length).numpy().tobytes()
            planner.load_bytes(req, io.BytesIO(data))
            self._count(rank, rec.length)
            return
        target = planner.resolve_tensor(req).detach()
        if whole in got.direct and plain_span(rec, req, target) == whole:  # already in place
            planner.commit_tensor(req, target)
            self._count(rank, rec.length)
            return
        dtype = dtype_from_name(rec.dtype or "uint8")
        stored = got.bytes_at(rec.file_offset, rec.length).view(dtype).view(rec.shape or ())
        src = _narrow(stored, req.storage_offsets, req.lengths)
        if target.size() != src.size():
            raise ValueError(f"size mismatch for {req.storage_index.fqn}: snapshot chunk "
                             f"{tuple(src.size())} vs destination {tuple(target.size())}")
        target.copy_(src)
        planner.commit_tensor(req, target)
        self._count(rank, src.numel() * src.element_size())

    def _read_item(self, m: mmap.mmap, rank: int, req: ReadItem, rec: ItemRecord,
                   planner: LoadPlanner) -> None:
        if req.type == LoadItemType.BYTE_IO:
            planner.load_bytes(req, io.BytesIO(m[rec.file_offset:rec.file_offset + rec.length]))
            self._count(rank, rec.length)
            return
        dtype = dtype_from_name(rec.dtype or "uint8")
        count = rec.length // dtype.itemsize
        pinned = self._pinned.get(rank)
        if pinned is not None and rec.file_offset + rec.length <= pinned.numel():
            region = pinned[rec.file_offset:rec.file_offset + rec.length]
            stored = region.view(dtype)
        else:
            pinned = None
            stored = hostmem.tensor_of(m, dtype, count=count, offset=rec.file_offset)  # read-only: only read
        stored = stored.view(rec.shape or ())
        src = _narrow(stored, req.storage_offsets, req.lengths)
        target = planner.resolve_tensor(req).detach()
        if target.size() != src.size():
            raise ValueError(
                f"size mismatch for {req.storage_index.fqn}: snapshot chunk "
                f"{tuple(src.size())} vs destination {tuple(target.size())}"
            )
        if target.is_cuda and pinned is not None:  # registered memory: an async DMA
            target.copy_(src, non_blocking=True)
            self._device_copies = True
        else:
            target.copy_(src)
        planner.commit_tensor(req, target)
        self._count(rank, src.numel() * src.element_size())

    def _count(self, rank: int, n: int) -> None:
        self.bytes_read += n
        self.bytes_by_rank[rank] = self.bytes_by_rank.get(rank, 0) + n

    def close(self) -> None:
        for m in [*self._maps.values(), *self._given.values()]:
            with contextlib.suppress(BufferError):
                m.close()
        self._maps.clear()
        self._given.clear()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False
