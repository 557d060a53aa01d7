"""Where snapshots live: a URI resolved to the places that hold one job's steps.

A URI resolves to one or more :class:`Location` objects, one per job:

* a node store directory (``/dev/shm/aegis`` holding job directories, or one job directory):
  tier ``memory``;
* a durable root, ``file:///path`` or ``s3://bucket/prefix`` (the root holding job prefixes, or
  one job's prefix): tier ``durable``; a plain path with the durable layout works too;
* a plain DCP checkpoint directory (holding ``.metadata``), or a directory of them
  (``step-100/``, ``step-200/`` ...): tier ``dcp``.

A :class:`Copy` is one step at one location: its entries (tensors and non-tensor objects), and
the means to read its bytes. An aegis copy (node store, durable tier) hands out verified raw
chunks (:meth:`AegisCopy.read_chunks`): node store chunks are read from the shard file and their
crc32c checked on the bytes read (after the shard's own index was checked against the
manifest); durable chunks are downloaded, their stored crc32c checked, decoded and their raw
crc32c checked (:func:`fetch_chunk`: the checks of restore's
:func:`aegis.snapshot.durable.fetch_chunks`). A plain DCP copy
is read by DCP. Nothing here unpickles an object, and nothing here knows about the ``aegis``
command: errors are :mod:`aegis.errors` / :mod:`aegis.read.errors`.

Callers: :mod:`aegis.read.api` (which reads a step from several locations, the next copy when
one is damaged) and the ``aegis`` command (``ls``, ``verify``, ``prune`` work per location).
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import json
import mmap
import os
import re
import threading
from collections.abc import Callable, Collection, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
)
from torch.distributed.checkpoint.storage import StorageReader

from aegis.errors import AegisError, CorruptShardError, ManifestError, NoSnapshotError
from aegis.read.dcp_meta import SafeFileSystemReader, read_dcp_metadata
from aegis.read.errors import SourceError
from aegis.snapshot.codec import decode
from aegis.snapshot.durable import (
    chunk_key,
    list_steps,
    read_manifest,
    retention_victims,
)
from aegis.snapshot.durable import prune as durable_prune
from aegis.snapshot.manifest import BytesEntry, Manifest, ShardRecord, TensorEntry
from aegis.snapshot.node_store import NodeStore, PartialManifestError
from aegis.snapshot.objstore import ObjectNotFound, ObjectStore, open_store
from aegis.snapshot.retry import RetryPolicy
from aegis.snapshot.shard import (
    FOOTER_SIZE,
    check_index_matches,
    chunks_for_ranges,
    crc32c,
    decode_footer,
    decode_index,
    verify_chunks,
)

__all__ = [
    "TIER_MEMORY",
    "TIER_DURABLE",
    "TIER_DCP",
    "StepRow",
    "Failure",
    "VerifyResult",
    "Location",
    "NodeStoreLocation",
    "DurableLocation",
    "DcpLocation",
    "Copy",
    "AegisCopy",
    "DcpCopy",
    "STATE_KINDS_FILE",
    "DECODE_FACTOR",
    "needed_chunks",
    "resolve",
    "pick",
]

TIER_MEMORY = "memory"
TIER_DURABLE = "durable"
TIER_DCP = "dcp"

# Beside a DCP export (``aegis export --format dcp``), which dcp.load ignores: which entries are
# per rank.
STATE_KINDS_FILE = "aegis_state.json"

_STEP_DIR = re.compile(r"^step-(\d{8})$")
_RANK_DIR = re.compile(r"^rank-\d{5}$")
_RANK_SHARD = re.compile(r"^rank-\d{5}\.shard$")
_JOB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$")
_DURABLE_KEY = re.compile(
    r"^(?:(?P<pre>.+)/)?step-(?P<step>\d{8})/(?:manifest\.json|rank-\d{5}/chunk-\d{4}\.zst)$"
)
_TRAILING_INT = re.compile(r"(?:^|[-_.]|step)(\d+)$")  # step-100, checkpoint_100, global_step100, 100
_DISTCP_RANK = re.compile(r"^__(\d+)_\d+\.distcp$")

# Peak bytes one durable download thread holds, per byte of chunk: the stored object, the decoded
# chunk, and the codec's temporaries (codec._f32_join widens every byte plane of a float32
# chunk to uint32: measured 8-9x the chunk).
DECODE_FACTOR = 10

Progress = Callable[[int], None]
ChunkKey = tuple[int, int]  # (shard rank, chunk index)


def _nop(n: int) -> None:
    pass


@dataclass
class StepRow:
    """One step on one location (``aegis ls``)."""

    uri: str
    tier: str
    job: str | None
    step: int | None
    committed: bool
    world_size: int | None = None
    shards: int | None = None  # shards (or DCP files) present on this location
    raw_bytes: int | None = None
    stored_bytes: int | None = None
    created: float | None = None
    error: str | None = None


@dataclass
class Failure:
    """One thing that did not verify."""

    job: str | None
    step: int | None
    rank: int | None
    chunk: int | None
    tier: str
    uri: str
    error: str


@dataclass
class VerifyResult:
    chunks: int = 0
    bytes: int = 0
    failures: list[Failure] = field(default_factory=list)


# -- locations -----------------------------------------------------------------------------------


class Location(abc.ABC):
    """The steps of one job in one place (one tier)."""

    tier: str
    uri: str
    job: str | None

    @abc.abstractmethod
    def rows(self) -> list[StepRow]:
        """Every step, newest first (committed or not)."""

    @abc.abstractmethod
    def committed(self) -> list[int]:
        """Committed steps, ascending."""

    @abc.abstractmethod
    def _open(self, step: int) -> Copy:
        ...

    def open(self, step: int | None) -> Copy:
        """The newest committed step, or ``step``. NoSnapshotError when it is not committed,
        ManifestError when its manifest cannot be read."""
        steps = self.committed()
        if not steps:
            raise NoSnapshotError(f"{self.uri}: no committed step")
        if step is None:
            step = steps[-1]
        elif step not in steps:
            shown = ", ".join(str(s) for s in steps[-10:])
            raise NoSnapshotError(
                f"step {step} is not committed in {self.uri} (committed: "
                f"{'... ' if len(steps) > 10 else ''}{shown})"
            )
        return self._open(step)

    def all_steps(self) -> list[int | None]:
        """What ``verify --all`` checks, ascending."""
        return list(self.committed())

    @abc.abstractmethod
    def verify_bytes(self, step: int | None) -> int:
        """Bytes ``verify`` reads for ``step`` (progress bar total)."""

    @abc.abstractmethod
    def verify(self, step: int | None, progress: Progress) -> VerifyResult:
        """Check every chunk of ``step``; failures are collected, never raised."""

    def prune(self, keep_last: int, keep_every: int, *, dry_run: bool) -> list[int]:
        raise SourceError(f"{self.uri}: prune works on aegis node stores and durable roots, not on "
                          f"{self.tier} checkpoints")

    def close(self) -> None:  # noqa: B027 - optional
        pass

    def _failure(self, step: int | None, rank: int | None, chunk: int | None, error: str) -> Failure:
        return Failure(self.job, step, rank, chunk, self.tier, self.uri, error)


class Copy(abc.ABC):
    """One step of one location, opened for reading."""

    location: Location
    step: int | None
    entries: Mapping[str, TensorEntry | BytesEntry]
    object_sizes: dict[str, int]
    metadata: Metadata
    planner_data: Mapping[str, tuple[str | int, ...]]
    state_kinds: Mapping[str, str]
    manifest: Manifest | None = None

    @property
    def job(self) -> str | None:
        return self.location.job

    @property
    def tier(self) -> str:
        return self.location.tier

    @property
    def uri(self) -> str:
        return self.location.uri

    @abc.abstractmethod
    def summary(self) -> dict[str, Any]:
        """world_size, created, mesh, timings, format_version, shards (``inspect``)."""

    def entry_bytes(self, name: str) -> int:
        e = self.entries[name]
        return e.nbytes if isinstance(e, TensorEntry) else self.object_sizes.get(name, 0)


# -- aegis snapshots (node store and durable tier) ------------------------------------------------


def _redundancy_summary(m: Manifest) -> dict[str, Any]:
    """The scheme that protects the snapshot in memory, and which node holds what."""
    if m.redundancy is None:
        return {"scheme": "replica",
                "copies": min((len(s.replicas) for s in m.shards), default=0)}
    nodes = m.nodes()
    red = m.redundancy
    return {"scheme": red.scheme, "groups": [
        {"members": list(g.members), "nodes": [nodes[r] for r in g.members],
         "parity_bytes_per_member": g.stored, "survives_losses": red.parity}
        for g in red.groups]} | ({"parity": red.parity, "ec_type": red.ec_type} if red.scheme == "rs" else {})


def needed_chunks(manifest: Manifest, names: Collection[str] | None) -> dict[int, set[int]]:
    """shard rank -> chunk indices holding the items of ``names`` (None: every chunk)."""
    out: dict[int, set[int]] = {}
    wanted = None if names is None else set(names)
    for shard in manifest.shards:
        if wanted is None:
            out[shard.rank] = set(range(len(shard.chunks)))
            continue
        ranges = [(i.file_offset, i.length) for i in shard.items if i.fqn in wanted]
        if ranges:
            out[shard.rank] = chunks_for_ranges(shard.chunks, ranges)
    return out


class AegisCopy(Copy):
    """A step of an aegis snapshot (node store or durable tier): the manifest, and its chunks."""

    manifest: Manifest

    def __init__(self, location: Location, manifest: Manifest) -> None:
        self.location = location
        self.manifest = manifest
        self.step = manifest.step
        self.entries = manifest.entries
        self.metadata = manifest.to_dcp_metadata()
        self.planner_data = manifest.planner_data
        self.state_kinds = manifest.state_kinds
        sizes: dict[str, int] = {}
        for shard in manifest.shards:
            for item in shard.items:
                if not item.is_tensor:
                    sizes[item.fqn] = sizes.get(item.fqn, 0) + item.length
        self.object_sizes = sizes

    def summary(self) -> dict[str, Any]:
        m = self.manifest
        return {
            "world_size": m.world_size,
            "created": m.created or None,
            "format_version": m.format_version,
            "state_kinds": dict(m.state_kinds),
            "mesh": dict(m.mesh),
            "timings": dict(m.timings),
            "shards": [
                {
                    "rank": s.rank,
                    "node": s.node,
                    "size": s.size,
                    "chunks": len(s.chunks),
                    "raw_bytes": s.data_bytes,
                    "stored_bytes": (sum(c.stored_length or 0 for c in s.chunks)
                                     if s.chunks and s.chunks[0].stored_length is not None else s.size),
                    "replicas": list(s.replicas),
                }
                for s in m.shards
            ],
            "redundancy": _redundancy_summary(m),
        }

    @abc.abstractmethod
    def has_shard(self, rank: int) -> bool:
        """Whether this copy holds the shard of ``rank`` at all (a node store holds its node's
        shards and replicas only; the durable tier holds every shard of a committed step)."""

    @abc.abstractmethod
    def read_chunks(self, wanted: Mapping[int, Collection[int]], progress: Progress = _nop,
                    threads: int = 8) -> tuple[dict[ChunkKey, bytes], dict[ChunkKey, AegisError]]:
        """The raw bytes of the chunks ``wanted`` (rank -> chunk indices), each checked against
        its crc32c; and, per chunk that could not be read intact, the error (never raised)."""

    def where(self) -> str:
        return f"{self.tier} {self.uri}"


class NodeStoreLocation(Location):
    tier = TIER_MEMORY

    def __init__(self, root: Path, job: str) -> None:
        self.store = NodeStore(root, job)
        self.job = job
        self.uri = str(self.store.dir)
        # step -> rank -> records read from the other opened copies (format-4 steps are put
        # together from their shards' indexes, which a multi-node job spreads over its nodes)
        self.pool: dict[int, dict[int, ShardRecord]] = {}

    def records(self, step: int) -> dict[int, ShardRecord]:
        """Records of the shards of ``step`` this store holds intact (from their own indexes)."""
        out: dict[int, ShardRecord] = {}
        info = next((i for i in self.store.steps() if i.step == step), None)
        for r in info.shard_ranks if info is not None else ():
            with contextlib.suppress(OSError, AegisError):
                out[r] = self.store.shard_record(step, r)
        return out

    def rows(self) -> list[StepRow]:
        out = []
        for info in self.store.steps():
            row = StepRow(self.uri, self.tier, self.job, info.step, info.committed,
                          shards=len(info.shard_ranks))
            if info.committed:
                try:
                    m = self.store.read_manifest(info.step, allow_missing=True)
                except (ManifestError, CorruptShardError) as e:
                    row.error = str(e)
                else:
                    present = set(info.shard_ranks)
                    row.world_size = m.world_size
                    row.raw_bytes = sum(s.data_bytes for s in m.shards if s.rank in present)
                    row.stored_bytes = sum(s.size for s in m.shards if s.rank in present)
                    row.created = m.created or None
            out.append(row)
        return out

    def committed(self) -> list[int]:
        return sorted(i.step for i in self.store.steps() if i.committed)

    def _open(self, step: int) -> Copy:
        return NodeStoreCopy(self, self.store.read_manifest(step, extra=self.pool.get(step),
                                                            allow_missing=True))

    def verify_bytes(self, step: int | None) -> int:
        assert step is not None
        try:
            m = self.store.read_manifest(step, allow_missing=True)
        except (ManifestError, CorruptShardError):
            return 0
        return sum(s.data_bytes for s in m.shards)

    def verify(self, step: int | None, progress: Progress) -> VerifyResult:
        assert step is not None
        res = VerifyResult()
        try:
            m = self.store.read_manifest(step, extra=self.pool.get(step))
        except PartialManifestError:  # a multi-node job: check the shards held here
            m = self.store.read_manifest(step, allow_missing=True)
            m = dataclasses.replace(m, shards=tuple(s for s in m.shards if s.chunks or s.size))
        except CorruptShardError as e:
            res.failures.append(self._failure(step, e.rank, None, str(e)))
            return res
        except ManifestError as e:
            res.failures.append(self._failure(step, None, None, f"manifest unreadable: {e}"))
            return res
        for rec in m.shards:
            path = self.store.shard_path(step, rec.rank)
            try:
                f = open(path, "rb")  # noqa: SIM115 - closed below
            except FileNotFoundError:
                res.failures.append(self._failure(
                    step, rec.rank, None, f"shard of rank {rec.rank} is not in this node store ({path})"))
                progress(rec.data_bytes)
                continue
            with f:
                size = os.fstat(f.fileno()).st_size
                if size != rec.size:
                    res.failures.append(self._failure(
                        step, rec.rank, None,
                        f"shard file {path} has {size} bytes, the manifest says {rec.size}"))
                if size == 0:
                    progress(rec.data_bytes)
                    continue
                m_ = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
                try:
                    for i, c in enumerate(rec.chunks):
                        try:
                            verify_chunks(m_, rec.chunks, step=step, rank=rec.rank, where=f"node store {self.uri}",
                                          only=[i])
                        except CorruptShardError as e:
                            res.failures.append(self._failure(step, rec.rank, i, str(e)))
                        res.chunks += 1
                        res.bytes += c.length
                        progress(c.length)
                    if size >= FOOTER_SIZE:
                        try:
                            start, icrc = decode_footer(m_[size - FOOTER_SIZE:], size=size, where=str(path))
                            if icrc != rec.index_crc32c:
                                res.failures.append(self._failure(
                                    step, rec.rank, None,
                                    f"shard index of rank {rec.rank} does not match the manifest "
                                    "(index crc32c differs)"))
                            else:  # the shard's own index must describe what the manifest says
                                index = decode_index(m_[start:size - FOOTER_SIZE], crc=icrc, size=size,
                                                     where=str(path))
                                check_index_matches(index, rec, step=step, where=f"node store {self.uri}")
                        except (ManifestError, CorruptShardError) as e:
                            res.failures.append(self._failure(step, rec.rank, None, str(e)))
                finally:
                    m_.close()
        # parity held here: every parity file against its recorded size and crc32c
        # (a member's parity lives next to its own shard)
        info = next((i for i in self.store.steps() if i.step == step), None)
        here = set(info.parity_ranks + info.shard_ranks) if info is not None else set()
        red = m.redundancy
        for g in red.groups if red is not None else ():
            assert red is not None
            for r, crc in zip(g.members, g.parity_crc32c, strict=True):
                if r in here:
                    try:
                        self.store.verify_parity(step, r, g.stored, crc, red.scheme)
                    except CorruptShardError as e:
                        res.failures.append(self._failure(step, r, None, str(e)))
                    res.bytes += g.stored
        return res

    def prune(self, keep_last: int, keep_every: int, *, dry_run: bool) -> list[int]:
        victims = retention_victims(self.committed(), keep_last, keep_every)
        if not dry_run:
            for step in victims:
                self.store.remove_step(step)  # manifest first: never half-committed
        return victims


class NodeStoreCopy(AegisCopy):
    """A step in a node store. Chunks are read from the shard files (``pread``) and checked on
    the bytes read, so a slot that a running job reuses while it is read shows up as damage
    (and is named as an eviction), never as wrong tensors."""

    location: NodeStoreLocation

    def __init__(self, location: NodeStoreLocation, manifest: Manifest) -> None:
        super().__init__(location, manifest)
        self._index_checked: dict[int, AegisError | None] = {}

    @property
    def store(self) -> NodeStore:
        return self.location.store

    def has_shard(self, rank: int) -> bool:
        return self.store.shard_path(self.manifest.step, rank).exists()

    def shard_path(self, rank: int) -> Path:
        return self.store.shard_path(self.manifest.step, rank)

    def _where(self) -> str:
        return f"node store {self.uri}"

    def _check_index(self, rank: int) -> AegisError | None:
        """The shard's footer and own index against the manifest's record (once per rank)."""
        if rank in self._index_checked:
            return self._index_checked[rank]
        step, rec = self.manifest.step, self.manifest.shard(rank)
        err: AegisError | None = None
        try:
            index, size, icrc = self.store.read_shard_index(step, rank)
            if size != rec.size:
                raise CorruptShardError(
                    f"shard of rank {rank} at step {step} in {self._where()} has {size} bytes, the "
                    f"manifest says {rec.size}", step=step, rank=rank, where=self._where())
            if icrc != rec.index_crc32c:
                raise CorruptShardError(
                    f"shard index of rank {rank} at step {step} in {self._where()} does not match the "
                    "manifest (index crc32c differs)", step=step, rank=rank, where=self._where())
            check_index_matches(index, rec, step=step, where=self._where())
        except FileNotFoundError:
            err = CorruptShardError(f"shard of rank {rank} at step {step} is missing from {self._where()}",
                                    step=step, rank=rank, where=self._where())
        except CorruptShardError as e:
            err = e
        except (ManifestError, OSError) as e:
            err = CorruptShardError(f"shard of rank {rank} at step {step}: {e}", step=step, rank=rank,
                                    where=self._where())
        self._index_checked[rank] = err
        return err

    def _evicted(self) -> bool:
        return not self.store.manifest_path(self.manifest.step).exists()

    def read_chunks(self, wanted: Mapping[int, Collection[int]], progress: Progress = _nop,
                    threads: int = 8) -> tuple[dict[ChunkKey, bytes], dict[ChunkKey, AegisError]]:
        ok: dict[ChunkKey, bytes] = {}
        bad: dict[ChunkKey, AegisError] = {}
        step = self.manifest.step
        for rank, ids in sorted(wanted.items()):
            rec = self.manifest.shard(rank)
            err = self._check_index(rank)
            if err is not None:
                bad.update({(rank, i): err for i in ids})
                continue
            try:
                fd = os.open(self.shard_path(rank), os.O_RDONLY)
            except OSError as e:
                bad.update({(rank, i): CorruptShardError(
                    f"shard of rank {rank} at step {step} in {self._where()}: {e.strerror or e}",
                    step=step, rank=rank, where=self._where()) for i in ids})
                continue
            try:
                for i in sorted(ids):
                    c = rec.chunks[i]
                    data = os.pread(fd, c.length, c.offset)
                    end = c.offset + c.length
                    got = crc32c(data) if len(data) == c.length else None
                    if got == c.crc32c:
                        ok[(rank, i)] = data
                        progress(c.length)
                        continue
                    if got is None:
                        msg = (f"shard of rank {rank} at step {step} ({self._where()}) is truncated: "
                               f"chunk {i} ends at byte {end}")
                    else:
                        msg = (f"crc32c mismatch in step {step}, rank {rank}, chunk {i} (bytes "
                               f"{c.offset}..{end}) of {self._where()}: expected {c.crc32c:#010x}, "
                               f"got {got:#010x}")
                    if self._evicted():
                        msg += (f"; step {step} was evicted from this node store while it was read "
                                "(by a running job?): read it again, or read its durable copy")
                    bad[(rank, i)] = CorruptShardError(msg, step=step, rank=rank, chunk=i, where=self._where())
            finally:
                os.close(fd)
        return ok, bad


class DurableLocation(Location):
    tier = TIER_DURABLE

    def __init__(self, store: ObjectStore, job: str) -> None:
        self.store = store
        self.job = job
        self.name = job  # str, for the durable helpers
        self.uri = f"{store.url}/{job}"
        self._listing: tuple[list[int], list[int]] | None = None

    def _steps(self) -> tuple[list[int], list[int]]:
        if self._listing is None:
            self._listing = list_steps(self.store, self.name)
        return self._listing

    def rows(self) -> list[StepRow]:
        committed, partial = self._steps()
        out = [StepRow(self.uri, self.tier, self.job, s, False) for s in partial]
        for step in committed:
            row = StepRow(self.uri, self.tier, self.job, step, True)
            try:
                m = read_manifest(self.store, self.name, step)
            except AegisError as e:
                row.error = str(e)
            else:
                row.world_size = m.world_size
                row.shards = m.world_size
                row.raw_bytes = sum(c.length for s in m.shards for c in s.chunks)
                row.stored_bytes = sum(c.stored_length or 0 for s in m.shards for c in s.chunks)
                row.created = m.created or None
            out.append(row)
        out.sort(key=lambda r: r.step or 0, reverse=True)
        return out

    def committed(self) -> list[int]:
        return self._steps()[0]

    def manifest(self, step: int) -> Manifest:
        try:
            return read_manifest(self.store, self.name, step)
        except ObjectNotFound as e:
            raise ManifestError(str(e)) from e

    def _open(self, step: int) -> Copy:
        return DurableCopy(self, self.manifest(step))

    def verify_bytes(self, step: int | None) -> int:
        assert step is not None
        try:
            m = read_manifest(self.store, self.name, step)
        except AegisError:
            return 0
        return sum(s.data_bytes for s in m.shards)

    def verify(self, step: int | None, progress: Progress) -> VerifyResult:
        assert step is not None
        res = VerifyResult()
        try:
            m = read_manifest(self.store, self.name, step)
        except AegisError as e:
            res.failures.append(self._failure(step, None, None, f"manifest unreadable: {e}"))
            return res
        lock = threading.Lock()

        def one(rank: int, i: int) -> None:
            c = m.shard(rank).chunks[i]
            key = chunk_key(self.name, step, rank, i)
            where = f"{self.store.url}/{key}"
            err = None
            try:
                blob = self.store.get(key)
                got = crc32c(blob)
                if len(blob) != c.stored_length:
                    err = (f"object {where} of step {step}, rank {rank}, chunk {i} has {len(blob)} "
                           f"bytes, the manifest says {c.stored_length}")
                elif got != c.stored_crc32c:
                    err = (f"crc32c mismatch in step {step}, rank {rank}, chunk {i}: object {where}: "
                           f"expected {c.stored_crc32c:#010x}, got {got:#010x}")
                else:
                    raw = decode(blob, c.codec, c.length, where=where)
                    if crc32c(raw) != c.crc32c:
                        err = (f"crc32c mismatch in step {step}, rank {rank}, chunk {i} after decoding "
                               f"{where}")
            except ObjectNotFound:
                err = f"{where} is missing"
            except CorruptShardError as e:
                err = f"step {step}, rank {rank}, chunk {i}: {e}"
            except AegisError as e:
                err = f"step {step}, rank {rank}, chunk {i}: {e}"
            with lock:
                if err is not None:
                    res.failures.append(self._failure(step, rank, i, err))
                res.chunks += 1
                res.bytes += c.length
            progress(c.length)

        with ThreadPoolExecutor(max_workers=8) as pool:
            futures = [pool.submit(one, s.rank, i) for s in m.shards for i in range(len(s.chunks))]
            for fut in futures:
                fut.result()
        res.failures.sort(key=lambda f: (f.rank or 0, f.chunk or 0))
        return res

    def prune(self, keep_last: int, keep_every: int, *, dry_run: bool) -> list[int]:
        victims = durable_prune(self.store, self.name, keep_last, keep_every, dry_run=dry_run)
        self._listing = None
        return victims

    def close(self) -> None:
        self.store.close()


def fetch_chunk(store: ObjectStore, job: str, manifest: Manifest, rank: int, i: int) -> bytes:
    """One durable chunk, downloaded, verified and decoded in the calling thread: the checks and
    messages of :func:`aegis.snapshot.durable.fetch_chunks` (stored size and crc32c, a decode
    bounded to the chunk, raw crc32c), returning the bytes instead of writing them into a
    shard-sized buffer from a thread pool of its own."""
    c = manifest.shard(rank).chunks[i]
    step = manifest.step
    key = chunk_key(job, step, rank, i)
    where = f"{store.url}/{key}"
    try:
        blob = store.get(key)
    except ObjectNotFound as e:
        raise CorruptShardError(f"{where} is missing", step=step, rank=rank, chunk=i, where=where) from e
    if len(blob) != c.stored_length or crc32c(blob) != c.stored_crc32c:
        raise CorruptShardError(
            f"crc32c mismatch in step {step}, rank {rank}, chunk {i}: object {where} is "
            f"truncated or corrupt ({len(blob)} bytes, manifest says {c.stored_length})",
            step=step, rank=rank, chunk=i, where=where)
    try:
        raw = decode(blob, c.codec, c.length, where=where)
    except MemoryError as e:  # a zstd frame header may declare any size; decoding allocates it
        raise CorruptShardError(
            f"{where}: cannot decode (a compressed frame declares more bytes than the chunk's "
            f"{c.length}); the object is damaged or forged", step=step, rank=rank, chunk=i,
            where=where) from e
    del blob
    if crc32c(raw) != c.crc32c:
        raise CorruptShardError(f"crc32c mismatch in step {step}, rank {rank}, chunk {i} after "
                                f"decoding {where}", step=step, rank=rank, chunk=i, where=where)
    return bytes(raw)


class DurableCopy(AegisCopy):
    """A step on the durable tier: chunks are downloaded, verified (stored crc32c, decode, raw
    crc32c) and decoded as restore does (:func:`fetch_chunk`), ``threads`` at a time (one: in
    the calling thread). Each decoding thread holds the chunk's stored and decoded bytes and the
    codec's temporaries: up to :data:`DECODE_FACTOR` times the chunk's length."""

    location: DurableLocation

    def has_shard(self, rank: int) -> bool:
        return any(s.rank == rank for s in self.manifest.shards)  # committed: every chunk is there

    def read_chunks(self, wanted: Mapping[int, Collection[int]], progress: Progress = _nop,
                    threads: int = 8) -> tuple[dict[ChunkKey, bytes], dict[ChunkKey, AegisError]]:
        m = self.manifest
        loc = self.location
        ok: dict[ChunkKey, bytes] = {}
        bad: dict[ChunkKey, AegisError] = {}
        lock = threading.Lock()

        def one(rank: int, i: int) -> None:
            try:
                data = fetch_chunk(loc.store, loc.name, m, rank, i)
            except AegisError as e:
                with lock:
                    bad[(rank, i)] = e
                return
            with lock:
                ok[(rank, i)] = data
            progress(len(data))

        pairs = [(r, i) for r, ids in sorted(wanted.items()) for i in sorted(ids)]
        if threads <= 1 or len(pairs) == 1:
            for r, i in pairs:  # in the calling thread: no new thread's malloc arena to grow
                one(r, i)
        else:
            with ThreadPoolExecutor(max_workers=min(threads, len(pairs))) as pool:
                for fut in [pool.submit(one, r, i) for r, i in pairs]:
                    fut.result()
        return ok, bad


# -- plain DCP checkpoints -----------------------------------------------------------------------


class DcpLocation(Location):
    """One plain DCP checkpoint directory, or a directory of them (``step-N``-like names)."""

    tier = TIER_DCP

    def __init__(self, uri: str, checkpoints: list[tuple[int | None, Path]], *, unsafe: bool) -> None:
        self.uri = uri
        self.job = None
        self.checkpoints = sorted(checkpoints, key=lambda c: (c[0] is not None, c[0] or 0))
        self.unsafe = unsafe
        self._md: dict[Path, Metadata] = {}

    def metadata(self, path: Path) -> Metadata:
        if path not in self._md:
            self._md[path] = read_dcp_metadata(path, unsafe=self.unsafe)
        return self._md[path]

    def rows(self) -> list[StepRow]:
        out = []
        for step, path in reversed(self.checkpoints):
            row = StepRow(str(path), self.tier, None, step, True)
            try:
                md = self.metadata(path)
            except ManifestError as e:
                row.error = str(e)
            else:
                snap = DcpCopy(self, step, path, md)
                row.world_size = snap.world_size()
                row.shards = len(snap.files())
                row.raw_bytes = sum(snap.entry_bytes(n) for n in snap.entries)
                row.stored_bytes = sum((path / f).stat().st_size for f in snap.files() if (path / f).exists())
                row.created = (path / ".metadata").stat().st_mtime
            out.append(row)
        return out

    def committed(self) -> list[int]:
        return [s for s, _ in self.checkpoints if s is not None]

    def open(self, step: int | None) -> Copy:
        if step is None:
            s, path = self.checkpoints[-1]
            return DcpCopy(self, s, path, self.metadata(path))
        for s, path in self.checkpoints:
            if s == step:
                return DcpCopy(self, s, path, self.metadata(path))
        steps = ", ".join(str(s) for s in self.committed()) or "none: its name has no step number"
        raise NoSnapshotError(f"step {step} is not in {self.uri} (steps: {steps})")

    def _open(self, step: int) -> Copy:
        return self.open(step)

    def _path(self, step: int | None) -> Path:
        for s, path in self.checkpoints:
            if s == step:
                return path
        raise NoSnapshotError(f"step {step} is not in {self.uri}")

    def all_steps(self) -> list[int | None]:
        return [s for s, _ in self.checkpoints]

    def verify_bytes(self, step: int | None) -> int:
        path = self._path(step)
        try:
            snap = DcpCopy(self, step, path, self.metadata(path))
        except ManifestError:
            return 0
        return sum(info.length for info in snap.storage_infos().values())

    def verify(self, step: int | None, progress: Progress) -> VerifyResult:
        """DCP keeps no checksums: check that every item's bytes exist in its file."""
        res = VerifyResult()
        path = self._path(step)
        try:
            snap = DcpCopy(self, step, path, self.metadata(path))
        except ManifestError as e:
            res.failures.append(Failure(None, step, None, None, self.tier, str(path), str(e)))
            return res
        sizes: dict[str, int | None] = {}
        for n, (index, info) in enumerate(snap.storage_infos().items()):
            rel = info.relative_path
            if rel not in sizes:
                try:
                    sizes[rel] = (path / rel).stat().st_size
                except OSError:
                    sizes[rel] = None
            rank_m = _DISTCP_RANK.match(rel)
            rank = int(rank_m.group(1)) if rank_m else None
            size = sizes[rel]
            if size is None:
                res.failures.append(Failure(None, step, rank, n, self.tier, str(path),
                                            f"{index.fqn}: file {rel} is missing"))
            elif info.offset + info.length > size:
                res.failures.append(Failure(None, step, rank, n, self.tier, str(path),
                                            f"{index.fqn}: {rel} is truncated ({size} bytes, the item "
                                            f"ends at {info.offset + info.length})"))
            res.chunks += 1
            res.bytes += info.length
            progress(info.length)
        return res


class DcpCopy(Copy):
    """A plain DCP checkpoint directory. Its ``state_kinds`` come from ``aegis_state.json`` when
    it is an aegis export (``aegis export --format dcp``), else they are empty."""

    location: DcpLocation

    def __init__(self, location: DcpLocation, step: int | None, path: Path, md: Metadata) -> None:
        self.location = location
        self.step = step
        self.path = path
        self.metadata = md
        self.entries = Manifest.entries_from_dcp(md)
        self.planner_data = {k: tuple(v) for k, v in (md.planner_data or {}).items()}
        sizes: dict[str, int] = {}
        for index, info in self.storage_infos().items():
            if isinstance(md.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
                sizes[index.fqn] = sizes.get(index.fqn, 0) + int(getattr(info, "length", 0))
        self.object_sizes = sizes
        self.state_kinds = self._state_kinds()

    def _state_kinds(self) -> dict[str, str]:
        try:
            doc = json.loads((self.path / STATE_KINDS_FILE).read_text())
            kinds = doc["state_kinds"]
        except (OSError, ValueError, KeyError, TypeError):
            return {}
        if not isinstance(kinds, dict):
            return {}
        return {str(k): str(v) for k, v in kinds.items() if isinstance(v, str)}

    def storage_infos(self) -> dict[MetadataIndex, Any]:
        data = self.metadata.storage_data
        return dict(data) if isinstance(data, Mapping) else {}

    def files(self) -> list[str]:
        return sorted({info.relative_path for info in self.storage_infos().values()})

    def world_size(self) -> int | None:
        ranks = {int(m.group(1)) for f in self.files() if (m := _DISTCP_RANK.match(f))}
        return len(ranks) or None

    def summary(self) -> dict[str, Any]:
        try:
            created: float | None = (self.path / ".metadata").stat().st_mtime
        except OSError:
            created = None
        return {
            "world_size": self.world_size(),
            "created": created,
            "format_version": getattr(self.metadata, "version", None),
            "mesh": {},
            "timings": {},
            "shards": [
                {"file": f, "size": (self.path / f).stat().st_size if (self.path / f).exists() else None}
                for f in self.files()
            ],
        }

    @contextlib.contextmanager
    def reader(self) -> Iterator[StorageReader]:
        yield SafeFileSystemReader(self.path, unsafe=self.location.unsafe)


# -- resolving a URI -----------------------------------------------------------------------------


def _dir_kind(d: Path, default: str) -> str | None:
    """TIER_MEMORY / TIER_DURABLE when ``d`` is a job directory, else None. Shard files say node
    store, chunk directories say durable; a directory of manifests only gets ``default``."""
    try:
        names = os.listdir(d)
    except OSError:
        return None
    steps = sorted((n for n in names if _STEP_DIR.match(n)), reverse=True)
    if not steps:
        return TIER_MEMORY if ".slots" in names else None
    for s in steps:
        try:
            inner = list(os.scandir(d / s))
        except OSError:
            continue
        for e in inner:
            if _RANK_DIR.match(e.name) and e.is_dir():
                return TIER_DURABLE
            if _RANK_SHARD.match(e.name):
                return TIER_MEMORY
    return default


def _step_of(path: Path) -> int | None:
    m = _TRAILING_INT.search(path.name)
    return int(m.group(1)) if m else None


def _read_store(url: str) -> ObjectStore:
    """An object store for reading: few, short retries (a person is waiting)."""
    opts: dict[str, Any] = {}
    if url.startswith("s3://"):
        opts = {"retry": RetryPolicy(max_attempts=3, max_total_s=30.0), "connect_timeout_s": 5.0}
    try:
        return open_store(url, **opts)
    except AegisError as e:
        raise SourceError(str(e)) from e


def _local(path: Path, display: str, *, unsafe: bool, default: str = TIER_MEMORY) -> list[Location]:
    if not path.exists():
        raise SourceError(f"{display}: no such file or directory")
    if not path.is_dir():
        raise SourceError(f"{display}: not a directory (give a node store, a durable root or a DCP "
                          "checkpoint directory)")
    path = path.resolve()
    if (path / ".metadata").is_file():
        return [DcpLocation(str(path), [(_step_of(path), path)], unsafe=unsafe)]
    kind = _dir_kind(path, default)
    if kind is not None:
        if not _JOB_NAME.match(path.name):
            raise SourceError(f"{display}: {path.name!r} is not a valid aegis job name")
        return [_make(kind, path.parent, path.name)]
    sources: list[Location] = []
    dcps: list[tuple[int | None, Path]] = []
    try:
        children = sorted(path.iterdir())
    except OSError as e:
        raise SourceError(f"{display}: {e.strerror or e}") from e
    for child in children:
        if not child.is_dir():
            continue
        if (child / ".metadata").is_file():
            dcps.append((_step_of(child), child))
            continue
        if _JOB_NAME.match(child.name) and (kind := _dir_kind(child, default)) is not None:
            sources.append(_make(kind, path, child.name))
    if dcps:
        sources.append(DcpLocation(str(path), dcps, unsafe=unsafe))
    if not sources:
        raise SourceError(
            f"{display}: no aegis snapshots or DCP checkpoints here (expected <job>/step-NNNNNNNN/ "
            "directories, a .metadata file, or directories holding one)"
        )
    return sources


def _make(kind: str, root: Path, job: str) -> Location:
    if kind == TIER_DURABLE:
        return DurableLocation(_read_store(f"file://{root}"), job)
    return NodeStoreLocation(root, job)


def _s3(url: str) -> list[Location]:
    parsed = urlparse(url)
    base = f"s3://{parsed.netloc}"
    prefix = parsed.path.strip("/")
    store = _read_store(url)
    found: set[str] = set()
    try:
        store.check()  # names a missing bucket or missing credentials in one line
        for obj in store.list(""):
            m = _DURABLE_KEY.match(obj.key)
            if m:
                found.add(m.group("pre") or "")
    except AegisError as e:
        raise SourceError(str(e)) from e
    finally:
        store.close()
    if not found:
        raise SourceError(f"{url}: no aegis snapshots here (expected <job>/step-NNNNNNNN/manifest.json)")
    sources: list[Location] = []
    for pre in sorted(found):
        if pre == "":  # the URL is one job's prefix
            if not prefix:
                raise SourceError(f"{url}: steps at the bucket root; aegis keeps them under <root>/<job>/")
            parent, _, job = prefix.rpartition("/")
        else:
            sub, _, job = pre.rpartition("/")
            parent = "/".join(p for p in (prefix, sub) if p)
        if not _JOB_NAME.match(job):
            continue
        sources.append(DurableLocation(_read_store(f"{base}/{parent}" if parent else base), job))
    if not sources:
        raise SourceError(f"{url}: no aegis job prefixes here")
    return sources


def resolve(uri: str | os.PathLike[str], *, unsafe: bool = False) -> list[Location]:
    """Every job's location at ``uri`` (see the module docstring). SourceError, in one line,
    for a URI of the wrong kind."""
    uri = os.fspath(uri)
    if "://" in uri:
        parsed = urlparse(uri)
        if parsed.scheme == "file":
            if parsed.netloc not in ("", "localhost"):
                raise SourceError(f"{uri}: use file:///absolute/path")
            return _local(Path(parsed.path), uri, unsafe=unsafe, default=TIER_DURABLE)
        if parsed.scheme == "s3":
            if not parsed.netloc:
                raise SourceError(f"{uri}: missing bucket (s3://bucket/prefix)")
            return _s3(uri)
        raise SourceError(f"{uri}: unsupported scheme {parsed.scheme!r}; use a directory, file:///path "
                          "or s3://bucket/prefix")
    return _local(Path(uri), uri, unsafe=unsafe)


def pick(locations: list[Location], job: str | None, uri: str, *, how: str = "job=") -> Location:
    """The one location of ``job`` (or the only one) among ``locations``; ``how`` is how the
    caller chooses a job (``--job`` for the command)."""
    if job is not None:
        chosen = [s for s in locations if s.job == job]
        if not chosen:
            jobs = ", ".join(sorted({s.job for s in locations if s.job})) or "none"
            raise SourceError(f"{uri}: no job {job!r} here (jobs: {jobs})")
        locations = chosen
    if len(locations) > 1:
        jobs = ", ".join(s.job or f"{s.tier} checkpoints" for s in locations)
        raise SourceError(f"{uri} holds several jobs ({jobs}); choose one with {how}")
    return locations[0]
