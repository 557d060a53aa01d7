"""Recovery, step 3: moving shards to the nodes that need them: from a peer node over the
transport (whole shards, or only the byte ranges read), from the durable tier, verified on
arrival (crc32c of every chunk).
"""

from __future__ import annotations

import contextlib
import functools
import mmap
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from aegis._dist import Group
from aegis.errors import (
    AegisError,
    CorruptShardError,
    ManifestError,
)
from aegis.snapshot import hostmem
from aegis.snapshot.durable import fetch_chunks
from aegis.snapshot.manifest import (
    ChunkRecord,
    Manifest,
)
from aegis.snapshot.node_store import NodeStore, Slot
from aegis.snapshot.objstore import ObjectStore
from aegis.snapshot.shard import (
    FOOTER_SIZE,
    check_blob,
    check_index_matches,
    crc32c,
    decode_footer,
    decode_index,
    verify_chunks,
)
from aegis.snapshot.transport import Recv, Send, Transport
from aegis.training.restore_direct import ChunkCheck, Direct, Received, pieces


def _fixed(view: torch.Tensor) -> Callable[[list[int]], list[torch.Tensor]]:
    """A Recv allocator that receives into ``view``."""
    return lambda sizes: [view]


def _runs(chunks: list[ChunkRecord], ids: set[int], *, size: int | None = None) -> list[tuple[int, int]]:
    """Byte ranges [start, end) covering the chunks ``ids``, contiguous chunks merged; with
    ``size`` (the shard's size) also the index and footer after the last chunk."""
    spans = [(chunks[i].offset, chunks[i].offset + chunks[i].length) for i in sorted(ids)]
    if size is not None:
        spans.append((chunks[-1].offset + chunks[-1].length if chunks else 0, size))
    out: list[tuple[int, int]] = []
    for a, b in spans:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def _check_partial(mem: memoryview, rec: Any, step: int, ids: set[int], where: str) -> None:
    """A partial copy: the chunks it holds, and its own index, which must match the manifest."""
    verify_chunks(mem, rec.chunks, step=step, rank=rec.rank, where=where, only=ids)
    size = len(mem)
    try:
        start, icrc = decode_footer(bytes(mem[size - FOOTER_SIZE:]), size=size, where=where)
        index = decode_index(bytes(mem[start:size - FOOTER_SIZE]), crc=icrc, size=size, where=where)
    except ManifestError as e:
        raise CorruptShardError(f"shard of rank {rec.rank} at step {step}: {e}", step=step,
                                rank=rec.rank, where=where) from e
    if icrc != rec.index_crc32c:
        raise CorruptShardError(f"copy of the shard of rank {rec.rank} from {where} does not match "
                                "the manifest (index crc32c differs)", step=step, rank=rec.rank, where=where)
    check_index_matches(index, rec, step=step, where=where)


def _run_transfers(
    store: NodeStore,
    group: Group,
    transport: Transport,
    manifest: Manifest,
    transfers: list[tuple[int, str, str, Any]],
    worker: Callable[[str, int], int],
    *,
    maps: dict[str, mmap.mmap] | None = None,
    targets: Mapping[int, Mapping[tuple[int, int], torch.Tensor]] | None = None,
    received: dict[int, Received] | None = None,
) -> list[tuple[int, str, str, str | None, int, float, bool]]:
    """One round of copies between nodes: a whole shard (ids None), the chunks a node needs
    (a set of chunk ids: their byte runs, the index and footer), or only the byte ranges it
    reads ((ids, spans): the sender checks those chunks against the manifest first and sends
    the spans with a crc32c of each, which the receiver checks). Receivers verify what arrives
    before it is used. A whole shard received and verified keeps its mapping in ``maps`` (under
    its final path) for the load. A :class:`Direct` transfer goes straight into the receiving
    rank's ``targets`` (restore_direct); what it received is put in ``received``."""
    step = manifest.step
    sends: list[Send] = []
    recvs: list[Recv] = []
    opened: list[mmap.mmap] = []
    incoming: dict[int, tuple[Slot, str, str, set[int] | None]] = {}
    spans_in: dict[int, tuple[Slot, str, str, list[tuple[int, int]], list[torch.Tensor]]] = {}
    t0 = time.perf_counter()
    direct = [t for t in transfers if isinstance(t[3], Direct)]
    ranged = [t for t in transfers if isinstance(t[3], tuple)]
    transfers = [t for t in transfers if not isinstance(t[3], (tuple, Direct))]
    into: dict[int, tuple[str, str, Direct, list[tuple[int, int, torch.Tensor]], ChunkCheck]] = {}
    for s, src, dst, d in direct:
        sender = worker(src, s)
        rec = manifest.shard(s)
        cut = pieces(_runs(list(rec.chunks), d.ids), d.ranges)
        if sender == group.rank:
            try:
                with open(store.shard_path(step, s), "rb") as f:
                    if os.fstat(f.fileno()).st_size != rec.size:
                        raise ValueError("size differs from the manifest")
                    # populated message by message (ready), while the previous one is sent
                    m = hostmem.map_file(f.fileno(), 0, write=False, populate=False)
                opened.append(m)
                whole = hostmem.tensor_of(m)  # read-only mapping: the transport only reads it
            except (OSError, ValueError):  # as many bytes, which the receiver's check rejects
                whole = torch.zeros(rec.size, dtype=torch.uint8)
            for i in range(0, len(cut), 4):
                span = whole[cut[i][0]:cut[min(i + 4, len(cut)) - 1][1]]
                sends.append(Send(d.rank, [whole[a:b] for a, b, _ in cut[i:i + 4]],
                                  ready=functools.partial(hostmem.populate, span)))
        if d.rank == group.rank:
            mine = (targets or {}).get(s, {})
            got = [(a, b, mine[(a, b)] if is_direct else torch.empty(b - a, dtype=torch.uint8))
                   for a, b, is_direct in cut]
            check = ChunkCheck(rec.chunks, sorted(d.ids), step=step, rank=s, where=f"copy from node {src!r}")
            into[s] = (src, dst, d, got, check)
            for i in range(0, len(got), 4):  # each message checked as it lands
                recvs.append(Recv(sender, _fixed_many([x[2] for x in got[i:i + 4]]),
                                  done=functools.partial(check.feed, got[i:i + 4])))
    for s, src, dst, (ids, spans) in ranged:
        sender, receiver = worker(src, s), worker(dst, s)
        rec = manifest.shard(s)
        total = sum(b - a for a, b in spans)
        if sender == group.rank:
            crcs = torch.full((len(spans),), -1, dtype=torch.int64)
            data = torch.zeros(total, dtype=torch.uint8)
            try:
                with open(store.shard_path(step, s), "rb") as f:
                    if os.fstat(f.fileno()).st_size != rec.size:
                        raise ValueError("size differs from the manifest")
                    m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
                try:
                    verify_chunks(m, rec.chunks, step=step, rank=s, where=f"node {src!r}", only=ids)
                    whole = hostmem.tensor_of(m)  # read-only mapping, only read
                    view = memoryview(m)
                    pos = 0
                    for i, (a, b) in enumerate(spans):
                        data[pos:pos + b - a].copy_(whole[a:b])
                        crcs[i] = crc32c(view[a:b])
                        pos += b - a
                    del whole, view
                finally:
                    with contextlib.suppress(BufferError):
                        m.close()
            except (OSError, ValueError, CorruptShardError):
                crcs.fill_(-1)  # the receiver rejects it and tries the next source
            sends.append(Send(receiver, [data, crcs.view(torch.uint8)]))
        if receiver == group.rank:
            store.step_dir(step).mkdir(mode=0o700, parents=True, exist_ok=True)
            slot = Slot(store.partial_path(step, s))
            slot.ensure(rec.size, prefault=False)  # sparse: only the spans are written
            bufs = [torch.empty(total, dtype=torch.uint8), torch.empty(8 * len(spans), dtype=torch.uint8)]
            spans_in[s] = (slot, src, dst, spans, bufs)
            recvs.append(Recv(sender, _fixed_many(bufs)))
    for s, src, dst, ids in transfers:
        sender, receiver = worker(src, s), worker(dst, s)
        rec = manifest.shard(s)
        runs = [(0, rec.size)] if ids is None else _runs(list(rec.chunks), ids, size=rec.size)
        if sender == receiver:
            raise AegisError("internal: a node fetching from itself")
        if sender == group.rank:
            try:
                with open(store.shard_path(step, s), "rb") as f:
                    size = os.fstat(f.fileno()).st_size
                    if size != rec.size:
                        raise ValueError(f"{size} bytes, the manifest says {rec.size}")
                    # shared and read-only, populated at once (a private copy-on-write mapping
                    # faulted each page in as the transport read it)
                    m = hostmem.map_file(f.fileno(), 0, write=False, populate=ids is None)
                opened.append(m)
                whole = hostmem.tensor_of(m)  # read-only mapping: the transport only reads it
            except (OSError, ValueError):
                # The receiver has posted its receives: send as many bytes, which its checks
                # then reject, so it moves on to the next source instead of waiting out a timeout.
                whole = torch.zeros(rec.size, dtype=torch.uint8)
            sends.extend(Send(receiver, [whole[a:b]]) for a, b in runs)
        if receiver == group.rank:
            store.step_dir(step).mkdir(mode=0o700, parents=True, exist_ok=True)
            path = (store.step_dir(step) / f".recv-rank-{s:05d}.shard" if ids is None
                    else store.partial_path(step, s))
            slot = Slot(path)
            # a whole shard is pre-faulted; a partial one stays sparse
            slot.ensure(rec.size, prefault=ids is None)
            incoming[s] = (slot, src, dst, ids)
            for a, b in runs:
                recvs.append(Recv(sender, _fixed(slot.view[a:b])))
    try:
        transport.exchange(sends, recvs)
    except BaseException:
        for slot in [x[0] for x in incoming.values()] + [x[0] for x in spans_in.values()]:
            slot.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(slot.path)
        raise
    finally:
        for m in opened:
            with contextlib.suppress(BufferError):
                m.close()
    secs = time.perf_counter() - t0
    results = []
    for s, (slot, src, dst, ids) in sorted(incoming.items()):
        rec = manifest.shard(s)
        err = None
        where = f"copy from node {src!r}"
        try:
            with slot.memory as mem:
                if ids is None:
                    index, icrc = check_blob(mem, step=step, rank=s, where=where)
                    if icrc != rec.index_crc32c:
                        raise CorruptShardError(f"copy of the shard of rank {s} from node {src!r} "
                                                "does not match the manifest", step=step, rank=s)
                    check_index_matches(index, rec, step=step, where=where)
                else:
                    _check_partial(mem, rec, step, ids, where)
        except CorruptShardError as e:
            err = str(e)
        if err is None and ids is None and maps is not None:
            maps[str(store.shard_path(step, s))] = slot.detach_map()  # the load reads it next
        slot.close()
        nbytes = sum(b - a for a, b in ([(0, rec.size)] if ids is None
                                        else _runs(list(rec.chunks), ids, size=rec.size)))
        if err is None and ids is None:
            os.replace(slot.path, store.shard_path(step, s))
        elif err is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(slot.path)
        results.append((s, src, dst, err, nbytes, secs, ids is not None))
    for s, (src, dst, d, got, check) in sorted(into.items()):
        err = None
        try:
            check.finish()
            if received is not None:
                received[s] = Received({(a, b) for a, b, _ in got if (a, b) in set(d.ranges)},
                                       [(a, b, buf) for a, b, buf in got if (a, b) not in set(d.ranges)])
        except CorruptShardError as e:
            err = str(e)
        # "part": no whole file of the shard was written on the receiving node
        results.append((s, src, dst, err, sum(b - a for a, b, _ in got), secs, True))
    for s, (slot, src, dst, spans, bufs) in sorted(spans_in.items()):
        data, crcs = bufs[0], bufs[1].view(torch.int64)
        err = None
        pos = 0
        for i, (a, b) in enumerate(spans):
            piece = data[pos:pos + b - a]
            if int(crcs[i]) < 0:
                err = f"node {src!r}'s copy of the shard of rank {s} failed its check"
                break
            if crc32c(memoryview(piece.numpy())) != int(crcs[i]):  # type: ignore[arg-type]
                err = f"bytes {a}..{b} of the shard of rank {s} from node {src!r} arrived damaged"
                break
            slot.view[a:b].copy_(piece)
            pos += b - a
        slot.close()
        if err is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(slot.path)
        results.append((s, src, dst, err, data.numel() + crcs.numel() * 8, secs, True))
    return results


def _fixed_many(bufs: list[torch.Tensor]) -> Callable[[list[int]], list[torch.Tensor]]:
    """A Recv allocator that receives the announced parts into ``bufs`` (sizes must match)."""
    def alloc(sizes: list[int]) -> list[torch.Tensor]:
        if sizes != [b.numel() for b in bufs]:
            raise AegisError(f"expected parts of {[b.numel() for b in bufs]} bytes, announced {sizes}")
        return bufs
    return alloc


DURABLE = "durable"


REBUILD = "rebuild"


def _map_local(path: os.PathLike[str] | str) -> tuple[torch.Tensor | None, mmap.mmap | None]:
    """A private read mapping of a node-store file as uint8 (None when it cannot be read)."""
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size == 0:
                return torch.zeros(0, dtype=torch.uint8), None
            m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    except OSError:
        return None, None
    return hostmem.tensor_of(m), m


def _fetch_durable(store: NodeStore, durable: ObjectStore | None, manifest: Manifest, s: int,
                   dst: str, ids: set[int] | Direct | None, *,
                   targets: Mapping[int, Mapping[tuple[int, int], torch.Tensor]] | None = None,
                   received: dict[int, Received] | None = None,
                   ) -> tuple[int, str, str, str | None, int, float, bool]:
    """Download the chunks of shard ``s`` that node ``dst`` needs into a sparse local file, or,
    for a :class:`Direct` fetch, into this rank's ``targets`` (restore_direct: each chunk
    verified, then copied into the destination tensors and scratch pieces it covers; what it
    received goes into ``received``)."""
    assert durable is not None
    t0 = time.perf_counter()
    rec = manifest.shard(s)
    err, nbytes = None, 0
    if isinstance(ids, Direct):
        mine = (targets or {}).get(s, {})
        got = [(a, b, mine[(a, b)] if is_direct else torch.empty(b - a, dtype=torch.uint8))
               for a, b, is_direct in pieces(_runs(list(rec.chunks), ids.ids), ids.ranges)]
        try:
            nbytes = fetch_chunks(durable, store.job, manifest, s, ids.ids,
                                  [(a, b, memoryview(t.numpy())) for a, b, t in got])  # type: ignore[arg-type]
            if received is not None:
                direct = set(ids.ranges)
                received[s] = Received({(a, b) for a, b, _ in got if (a, b) in direct},
                                       [(a, b, t) for a, b, t in got if (a, b) not in direct])
        except Exception as e:  # noqa: BLE001 - an unreachable store too: reported, never raised alone
            err = str(e) if isinstance(e, CorruptShardError) else f"{type(e).__name__}: {e}"
        return (s, DURABLE, dst, err, nbytes, time.perf_counter() - t0, True)
    wanted = set(range(len(rec.chunks))) if ids is None else ids
    store.step_dir(manifest.step).mkdir(mode=0o700, parents=True, exist_ok=True)
    path = store.partial_path(manifest.step, s)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.ftruncate(fd, rec.size)  # sparse: only the chunks fetched take memory
        nbytes = fetch_chunks(durable, store.job, manifest, s, wanted, fd)
    except Exception as e:  # noqa: BLE001 - an unreachable store too: reported, never raised alone
        err = str(e) if isinstance(e, CorruptShardError) else f"{type(e).__name__}: {e}"
    finally:
        os.close(fd)
    if err is not None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    return (s, DURABLE, dst, err, nbytes, time.perf_counter() - t0, True)
