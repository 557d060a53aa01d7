"""The node store backend (tier ``memory``): a node store directory's jobs and steps, chunks read
from the shard files, their crc32c checked after the shard's index was checked against the
manifest.
"""

from __future__ import annotations

import contextlib
import dataclasses
import mmap
import os
from collections.abc import Collection, Mapping
from pathlib import Path

from aegis.errors import AegisError, CorruptShardError, ManifestError
from aegis.read._base import (  # noqa: F401
    TIER_MEMORY,
    ChunkKey,
    Copy,
    Location,
    Progress,
    StepRow,
    VerifyResult,
    _nop,
)
from aegis.read.aegis_copy import (  # noqa: F401
    AegisCopy,
)
from aegis.snapshot.durable import (
    retention_victims,
)
from aegis.snapshot.manifest import Manifest, ShardRecord
from aegis.snapshot.node_store import NodeStore, PartialManifestError
from aegis.snapshot.shard import (
    FOOTER_SIZE,
    check_index_matches,
    crc32c,
    decode_footer,
    decode_index,
    verify_chunks,
)

__all__ = ["NodeStoreLocation", "NodeStoreCopy"]


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
