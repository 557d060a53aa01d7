"""The durable tier: snapshots uploaded to an object store, compressed and verified.

Layout::

    <root>/<job>/step-<8 digits>/rank-<5 digits>/chunk-<4 digits>.zst
    <root>/<job>/step-<8 digits>/manifest.json        written last, If-None-Match: *

A step exists on the durable tier only once its manifest does. Each chunk object is one chunk
of a shard, encoded by :mod:`aegis.snapshot.codec`; the manifest records per chunk the raw
crc32c, the codec descriptor and the stored object's length and crc32c.

:class:`Uploader` runs in a background thread of every rank: each rank uploads its own shard from
its node store, then rank 0 gathers the chunk records over a dedicated group and commits the
manifest. Every rank processes the same uploads in the same order (rank 0 decides which
committed steps are uploaded and the decision is broadcast with the commit), so the gather always
pairs up.
"""

from __future__ import annotations

import contextlib
import dataclasses
import mmap
import queue
import re
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from aegis import _fault
from aegis._dist import Group
from aegis.errors import AegisError, CorruptShardError, ManifestError
from aegis.snapshot.codec import Codec, decode
from aegis.snapshot.manifest import ChunkRecord, Manifest
from aegis.snapshot.node_store import NodeStore
from aegis.snapshot.objstore import ObjectNotFound, ObjectStore, PreconditionFailed
from aegis.snapshot.shard import crc32c

__all__ = [
    "chunk_key",
    "manifest_key",
    "list_steps",
    "read_manifest",
    "retention_victims",
    "prune",
    "clean_uncommitted",
    "Uploader",
    "UploadResult",
    "fetch_chunks",
]

_STEP_RE = re.compile(r"step-([0-9]{8})/")  # ASCII digits: "\d" takes any Unicode digit


def step_prefix(job: str, step: int) -> str:
    return f"{job}/step-{step:08d}/"


def chunk_key(job: str, step: int, rank: int, chunk: int) -> str:
    return f"{job}/step-{step:08d}/rank-{rank:05d}/chunk-{chunk:04d}.zst"


def manifest_key(job: str, step: int) -> str:
    return f"{job}/step-{step:08d}/manifest.json"


def list_steps(store: ObjectStore, job: str) -> tuple[list[int], list[int]]:
    """(committed steps, steps with objects but no manifest), each ascending."""
    seen: set[int] = set()
    committed: set[int] = set()
    for obj in store.list(f"{job}/"):
        m = _STEP_RE.match(obj.key[len(job) + 1:])
        if not m:
            continue
        step = int(m.group(1))
        seen.add(step)
        if obj.key.endswith("/manifest.json"):
            committed.add(step)
    return sorted(committed), sorted(seen - committed)


def read_manifest(store: ObjectStore, job: str, step: int) -> Manifest:
    key = manifest_key(job, step)
    where = f"{store.url}/{key}"
    manifest = Manifest.from_json(store.get(key), where=where)
    if manifest.job != job:
        raise ManifestError(f"{where} belongs to job {manifest.job!r}, not {job!r}")
    if manifest.step != step:
        raise ManifestError(f"{where} says step {manifest.step}")
    for shard in manifest.shards:
        for i, c in enumerate(shard.chunks):
            if c.stored_length is None or c.stored_crc32c is None:
                raise ManifestError(f"{where}: chunk {i} of rank {shard.rank} has no stored size/crc32c")
    return manifest


def retention_victims(committed: Iterable[int], keep_last: int, keep_every: int) -> list[int]:
    """Committed steps that retention removes: all but the last ``keep_last`` and the multiples
    of ``keep_every``. The newest committed step is never a victim."""
    steps = sorted(committed)
    if not steps:
        return []
    keep = set(steps[-max(keep_last, 1):])
    if keep_every > 0:
        keep |= {s for s in steps if s % keep_every == 0}
    keep.add(steps[-1])
    return [s for s in steps if s not in keep]


def prune(store: ObjectStore, job: str, keep_last: int, keep_every: int, *, dry_run: bool = False
          ) -> list[int]:
    """Apply retention; manifests go first, so a half-deleted step is never committed."""
    committed, _ = list_steps(store, job)
    victims = retention_victims(committed, keep_last, keep_every)
    if not dry_run:
        for step in victims:
            store.delete([manifest_key(job, step)])
            store.delete(o.key for o in store.list(step_prefix(job, step)))
    return victims


def clean_uncommitted(store: ObjectStore, job: str, *, older_than_s: float = 0.0) -> list[int]:
    """Remove half-uploaded steps (objects without a manifest) and abort stale multipart uploads.

    Call when no upload of this job is running (at job start)."""
    _, uncommitted = list_steps(store, job)
    for step in uncommitted:
        store.delete(o.key for o in store.list(step_prefix(job, step)))
    store.abort_stale_uploads(f"{job}/", older_than_s)
    return uncommitted


@dataclass
class UploadResult:
    step: int
    rank: int
    committed: bool = False
    raw_bytes: int = 0
    stored_bytes: int = 0
    chunks: int = 0
    seconds: float = 0.0
    encode_s: float = 0.0
    requests: int = 0
    retries: int = 0
    retry_reasons: dict[str, int] = field(default_factory=dict)
    pruned: list[int] = field(default_factory=list)
    prune_error: str | None = None
    error: str | None = None


class Uploader:
    """Background uploads of committed in-memory snapshots. See the module docstring."""

    def __init__(
        self,
        store: ObjectStore,
        node_store: NodeStore,
        group: Group,
        *,
        codec: Codec,
        keep_last: int,
        keep_every: int,
        pin: Callable[[int], None],
        unpin: Callable[[int], None],
        on_result: Callable[[UploadResult], None] | None = None,
        max_inflight: int = 4,
    ) -> None:
        self.store = store
        self.node_store = node_store
        self.group = group
        self.codec = codec
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.pin = pin
        self.unpin = unpin
        self.on_result = on_result
        self.max_inflight = max_inflight
        self.job = node_store.job
        self._queue: queue.Queue[Manifest | None] = queue.Queue()
        self._pending = 0
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self.last_error: BaseException | None = None
        self.last_result: UploadResult | None = None
        self._thread = threading.Thread(target=self._run, name=f"aegis-upload-r{group.rank}", daemon=True)
        self._thread.start()

    @property
    def pending(self) -> int:
        with self._lock:
            return self._pending

    def submit(self, manifest: Manifest) -> None:
        """Queue the upload of a committed step (every rank, same order). The step stays pinned
        in the node store until its upload is done."""
        self.pin(manifest.step)
        with self._lock:
            self._pending += 1
        self._queue.put(manifest)

    def wait(self, timeout: float | None = None) -> None:
        """Block until every queued upload is finished."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._idle:
            while self._pending:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise AegisError(f"{self._pending} durable upload(s) still pending after {timeout} s")
                self._idle.wait(remaining)

    def close(self, timeout: float | None = None) -> int:
        """Finish the queued uploads, waiting at most ``timeout`` seconds; return how many were
        still pending and are abandoned (their steps are simply not on the durable tier)."""
        abandoned = 0
        try:
            self.wait(timeout)
        except AegisError:
            abandoned = self.pending
        self._queue.put(None)
        if not abandoned:
            self._thread.join(timeout=30)
        return abandoned  # a stuck request holds only a daemon thread

    # -- background ----------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            manifest = self._queue.get()
            if manifest is None:
                return
            result = UploadResult(manifest.step, self.group.rank)
            try:
                result = self._upload(manifest)
                self.last_result = result
            except BaseException as e:  # noqa: BLE001 - kept for wait()/events; never silent
                self.last_error = e
                result.error = f"{type(e).__name__}: {e}"
            finally:
                try:
                    self.unpin(manifest.step)
                except Exception as e:  # noqa: BLE001 - the thread must live on
                    result.error = result.error or f"releasing step {manifest.step}: {e}"
                if self.on_result:
                    with contextlib.suppress(Exception):
                        self.on_result(result)
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()

    def _upload(self, manifest: Manifest) -> UploadResult:
        t0 = time.perf_counter()
        rank = self.group.rank
        step = manifest.step
        result = UploadResult(step, rank)
        before = dataclasses.replace(self.store.stats, retry_reasons=dict(self.store.stats.retry_reasons))
        record = manifest.shard(rank)
        # A step already committed on the durable tier is never overwritten (its chunks would
        # no longer match its manifest): rank 0 looks, everyone hears.
        exists: bool | None = None
        if rank == 0:
            try:
                self.store.get_range(manifest_key(self.job, step), 0, 1)
                exists = True
            except ObjectNotFound:
                exists = False
            except Exception:  # noqa: BLE001 - unknown: upload, the conditional put decides
                exists = False
        if self.group.broadcast(exists, "durable exists"):
            result.error = f"step {step} is already committed on {self.store.url}; not uploaded again"
            return result
        chunks: list[ChunkRecord] | None = None
        err: str | None = None
        try:
            chunks = self._upload_shard(step, rank, record.chunks, result)
        except Exception as e:  # noqa: BLE001 - reported to rank 0, then raised
            err = f"{type(e).__name__}: {e}"
        reports = self.group.gather((step, chunks, err), "durable gather")
        outcome: tuple[bool, str] | None = None
        if rank == 0:
            assert reports is not None
            failures = {r: e for r, (_, _, e) in enumerate(reports) if e is not None}
            failures.update({r: f"uploaded step {s}, not {step}" for r, (s, _, _) in enumerate(reports)
                             if s != step})
            if failures:
                outcome = (False, "; ".join(f"rank {r}: {e}" for r, e in sorted(failures.items())))
            else:
                try:
                    durable = dataclasses.replace(manifest, shards=tuple(
                        dataclasses.replace(s, chunks=tuple(reports[s.rank][1] or ()), replicas=())
                        for s in manifest.shards
                    ))
                    _fault.hit("upload", step, rank)
                    self._commit(durable)
                    outcome = (True, "")
                except Exception as e:  # noqa: BLE001 - sent to every rank
                    outcome = (False, f"rank 0 commit: {type(e).__name__}: {e}")
                if outcome[0]:
                    try:  # retention problems never turn a committed upload into a failed one
                        result.pruned = prune(self.store, self.job, self.keep_last, self.keep_every)
                    except Exception as e:  # noqa: BLE001
                        result.prune_error = f"{type(e).__name__}: {e}"
        ok, message = self.group.broadcast(outcome, "durable commit")
        stats = self.store.stats
        result.requests = stats.requests - before.requests
        result.retries = stats.retries - before.retries
        result.retry_reasons = {k: v - before.retry_reasons.get(k, 0) for k, v in stats.retry_reasons.items()
                                if v - before.retry_reasons.get(k, 0)}
        result.seconds = time.perf_counter() - t0
        if not ok:
            raise AegisError(f"durable upload of step {step} failed: {message}")
        result.committed = True
        return result

    def _upload_shard(self, step: int, rank: int, chunks: tuple[ChunkRecord, ...],
                      result: UploadResult) -> list[ChunkRecord]:
        path = self.node_store.shard_path(step, rank)
        with open(path, "rb") as f:
            m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            def one(i: int) -> ChunkRecord:
                c = chunks[i]
                t = time.perf_counter()
                raw = m[c.offset:c.offset + c.length]
                if crc32c(raw) != c.crc32c:  # the node store copy changed under us: never upload it
                    raise CorruptShardError(f"step {step}, rank {rank}, chunk {i}: crc32c mismatch in "
                                            "the node store before upload", step=step, rank=rank, chunk=i)
                blob, desc = self.codec.encode(raw, c.dtype)
                enc = time.perf_counter() - t
                self.store.put(chunk_key(self.job, step, rank, i), blob)
                with self._lock:
                    result.encode_s += enc
                    result.raw_bytes += c.length
                    result.stored_bytes += len(blob)
                    result.chunks += 1
                return dataclasses.replace(c, codec=desc, stored_length=len(blob),
                                           stored_crc32c=crc32c(blob))

            # bounded memory: at most max_inflight chunks encoded and in flight at once
            with ThreadPoolExecutor(max_workers=self.max_inflight) as pool:
                return list(pool.map(one, range(len(chunks))))
        finally:
            m.close()

    def _commit(self, manifest: Manifest) -> None:
        key = manifest_key(self.job, manifest.step)
        body = manifest.to_json().encode()
        try:
            self.store.put(key, body, if_absent=True)
        except PreconditionFailed:
            # Already committed: by an earlier attempt of ours whose response was lost (fine if
            # identical), or by another run (never overwritten).
            existing = self.store.get(key)
            if existing != body:
                raise AegisError(
                    f"{self.store.url}/{key} already holds a different manifest; not overwritten"
                ) from None


def fetch_chunks(store: ObjectStore, job: str, manifest: Manifest, shard: int, ids: Iterable[int],
                 out: memoryview, *, threads: int = 4) -> int:
    """Download, verify and decode chunks of one shard into ``out`` (a view of the whole shard).

    Stored crc32c is checked before decoding and the raw crc32c after; CorruptShardError names
    the object key. Returns the stored bytes downloaded."""
    rec = manifest.shard(shard)
    step = manifest.step

    def one(i: int) -> int:
        c = rec.chunks[i]
        key = chunk_key(job, step, shard, i)
        where = f"{store.url}/{key}"
        try:
            blob = store.get(key)
        except ObjectNotFound as e:
            raise CorruptShardError(f"{where} is missing", step=step, rank=shard, chunk=i, where=where) from e
        if len(blob) != c.stored_length or crc32c(blob) != c.stored_crc32c:
            raise CorruptShardError(
                f"crc32c mismatch in step {step}, rank {shard}, chunk {i}: object {where} is "
                f"truncated or corrupt ({len(blob)} bytes, manifest says {c.stored_length})",
                step=step, rank=shard, chunk=i, where=where)
        try:
            raw = decode(blob, c.codec, c.length, where=where)
        except MemoryError as e:  # a zstd frame header may declare any size; decoding allocates it
            raise CorruptShardError(
                f"{where}: cannot decode (a compressed frame declares more bytes than the chunk's "
                f"{c.length}); the object is damaged or forged", step=step, rank=shard, chunk=i,
                where=where) from e
        if crc32c(raw) != c.crc32c:
            raise CorruptShardError(f"crc32c mismatch in step {step}, rank {shard}, chunk {i} after "
                                    f"decoding {where}", step=step, rank=shard, chunk=i, where=where)
        out[c.offset:c.offset + c.length] = raw
        return len(blob)

    with ThreadPoolExecutor(max_workers=threads) as pool:
        return sum(pool.map(one, sorted(ids)))

