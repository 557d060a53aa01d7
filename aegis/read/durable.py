"""The durable tier backend (tier ``durable``: ``file://`` or ``s3://``): a job's steps, chunks
downloaded, their stored crc32c checked, decoded and their raw crc32c checked
(:func:`fetch_chunk`).
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Mapping
from concurrent.futures import ThreadPoolExecutor

from aegis.errors import AegisError, CorruptShardError, ManifestError
from aegis.read._base import (  # noqa: F401
    DECODE_FACTOR,
    TIER_DURABLE,
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
from aegis.snapshot.codec import decode
from aegis.snapshot.durable import (
    chunk_key,
    list_steps,
    read_manifest,
)
from aegis.snapshot.durable import fetch_chunk as _fetch_chunk
from aegis.snapshot.durable import prune as durable_prune
from aegis.snapshot.manifest import Manifest
from aegis.snapshot.objstore import ObjectNotFound, ObjectStore
from aegis.snapshot.shard import (
    crc32c,
)

__all__ = ["DurableLocation", "fetch_chunk", "DurableCopy"]


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
    """One durable chunk, downloaded, verified and decoded in the calling thread, with restore's
    checks and messages (:func:`aegis.snapshot.durable.fetch_chunk`): its raw bytes."""
    return bytes(_fetch_chunk(store, job, manifest, rank, i)[0])


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
