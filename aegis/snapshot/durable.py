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

Retention runs apart from uploads, in a thread of its own on rank 0 (:class:`_Retention`): after
each commit the uploader only asks for a pass; the pass has its own bounded retries, a failure
is a console warning (once per cause) naming the steps it could not delete, and nothing an
upload or a catch-up waits for ever waits on it.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import os
import queue
import re
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from aegis import _fault
from aegis._dist import Group
from aegis.errors import AegisError, CorruptShardError, ManifestError
from aegis.snapshot.codec import Codec, decode_into
from aegis.snapshot.manifest import ChunkRecord, Commit, Manifest
from aegis.snapshot.node_manifest import assemble
from aegis.snapshot.node_store import NodeStore
from aegis.snapshot.objstore import ObjectNotFound, ObjectStore, PreconditionFailed
from aegis.snapshot.retry import RetryPolicy
from aegis.snapshot.shard import crc32c

__all__ = [
    "chunk_key",
    "manifest_key",
    "list_steps",
    "read_manifest",
    "retention_victims",
    "prune",
    "RetentionError",
    "clean_uncommitted",
    "Uploader",
    "UploadResult",
    "fetch_chunk",
    "fetch_chunk_into",
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


class RetentionError(AegisError):
    """Retention could not delete some steps; ``steps`` are those, ``cause`` the first error."""

    def __init__(self, message: str, *, steps: list[int], removed: list[int], cause: str) -> None:
        super().__init__(message)
        self.steps = steps
        self.removed = removed
        self.cause = cause


def prune(store: ObjectStore, job: str, keep_last: int, keep_every: int, *, dry_run: bool = False
          ) -> list[int]:
    """Apply retention; manifests go first, so a half-deleted step is never committed.

    A step that cannot be deleted is skipped (the others still go) and :class:`RetentionError`
    names every such step afterwards."""
    committed, _ = list_steps(store, job)
    victims = retention_victims(committed, keep_last, keep_every)
    if dry_run:
        return victims
    removed: list[int] = []
    failed: dict[int, str] = {}
    for step in victims:
        try:
            store.delete([manifest_key(job, step)])
            store.delete(o.key for o in store.list(step_prefix(job, step)))
            removed.append(step)
        except AegisError as e:
            failed[step] = str(e)
    if failed:
        cause = next(iter(failed.values()))
        raise RetentionError(
            f"could not delete step(s) {', '.join(map(str, failed))} of job {job!r} from {store.url}: "
            f"{cause}", steps=sorted(failed), removed=removed, cause=cause)
    return removed


def _default_warn(message: str) -> None:
    print(f"[aegis] warning: {message}", file=sys.stderr, flush=True)


def clean_uncommitted(store: ObjectStore, job: str, *, older_than_s: float = 0.0,
                      warn: Callable[[str], None] | None = None) -> list[int]:
    """Remove half-uploaded steps (objects without a manifest) and abort stale multipart uploads;
    return the steps removed.

    Call when no upload of this job is running (at job start), on one rank. A half-uploaded step
    is not a step (no manifest), so one that cannot be removed is a warning, never a reason not
    to start; so is an endpoint that cannot abort stale uploads."""
    say = warn or _default_warn
    _, uncommitted = list_steps(store, job)
    removed = []
    for step in uncommitted:
        try:
            store.delete(o.key for o in store.list(step_prefix(job, step)))
            removed.append(step)
        except AegisError as e:
            say(f"could not remove the half-uploaded step {step} (objects without a manifest: not a "
                f"committed step, never restored) from {store.url}: {e}")
    try:
        store.abort_stale_uploads(f"{job}/", older_than_s)
    except AegisError as e:
        say(f"could not abort stale multipart uploads under {store.url}/{job}/: {e}")
    return removed


def _cause_key(message: str) -> str:
    """What stays the same when the same problem strikes other steps: keys and numbers out."""
    return re.sub(r"\S+://\S+|[0-9]+", "", message)


class _Retention:
    """Rank 0's retention thread: passes requested by the uploader, run one at a time, each
    with its own bounded retries; the uploader never waits on it."""

    def __init__(self, store: ObjectStore, job: str, keep_last: int, keep_every: int,
                 warn: Callable[[str], None], policy: RetryPolicy) -> None:
        self.store, self.job, self.keep_last, self.keep_every = store, job, keep_last, keep_every
        self.warn = warn
        self.policy = policy
        self._cv = threading.Condition()
        self._wanted = False
        self._running = False
        self._stop = False
        self._warned: set[str] = set()
        self.removed: list[int] = []  # since the last take()
        self.error: str | None = None
        self._thread = threading.Thread(target=self._run, name="aegis-retention", daemon=True)
        self._thread.start()

    def request(self) -> None:
        with self._cv:
            self._wanted = True
            self._cv.notify_all()

    def take(self) -> tuple[list[int], str | None]:
        """What passes removed, and the last error, since the last call (for upload events)."""
        with self._cv:
            out, self.removed, err, self.error = self.removed, [], self.error, None
        return out, err

    def wait_idle(self, timeout: float | None) -> bool:
        with self._cv:
            return self._cv.wait_for(lambda: not self._wanted and not self._running, timeout)

    def close(self, timeout: float) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout)  # a pass stuck in a request holds only a daemon thread

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._wanted or self._stop)
                if not self._wanted:
                    return
                self._wanted, self._running = False, True
            try:
                self._pass()
            except BaseException as e:  # noqa: BLE001 - the thread must live on; never silent
                with contextlib.suppress(Exception):
                    self.warn(f"durable retention failed: {type(e).__name__}: {e}")
            finally:
                with self._cv:
                    self._running = False
                    self._cv.notify_all()

    def _pass(self) -> None:
        done: list[int] = []

        def once() -> None:
            try:
                done.extend(prune(self.store, self.job, self.keep_last, self.keep_every))
            except RetentionError as e:
                done.extend(e.removed)
                raise

        try:
            self.policy.call(once, retryable=lambda e: isinstance(e, AegisError))
        except AegisError as e:
            steps = e.steps if isinstance(e, RetentionError) else []
            cause = e.cause if isinstance(e, RetentionError) else f"{type(e).__name__}: {e}"
            with self._cv:
                self.removed += done
                self.error = f"{type(e).__name__}: {e}"
            key = _cause_key(cause)
            if key not in self._warned:  # once per cause: the next passes fail the same way
                self._warned.add(key)
                what = (f"step(s) {', '.join(map(str, steps))}" if steps else "old steps")
                self.warn(f"durable retention (keep_last={self.keep_last}, keep_every={self.keep_every}) "
                          f"could not delete {what} from {self.store.url} after "
                          f"{self.policy.max_attempts} attempts: {cause}. They stay (uploads go on; "
                          "retention tries again after the next upload); said once per cause")
            return
        with self._cv:
            self.removed += done


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
        warn: Callable[[str], None] | None = None,
        retention_retry: RetryPolicy | None = None,
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
        self._queue: queue.Queue[Commit | None] = queue.Queue()
        self._pending = 0
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self.last_error: BaseException | None = None
        self.last_result: UploadResult | None = None
        # Console warnings: the Manager passes its event log's; by default rank 0 prints.
        self.warn = warn or (_default_warn if group.rank == 0 else (lambda message: None))
        self._retention = _Retention(
            store, self.job, keep_last, keep_every, self.warn,
            retention_retry or RetryPolicy(max_attempts=3, max_total_s=120.0, initial_s=0.5,
                                           max_backoff_s=5.0),
        ) if group.rank == 0 else None
        self._say_notes()  # what the start check learned about the endpoint
        self._thread = threading.Thread(target=self._run, name=f"aegis-upload-r{group.rank}", daemon=True)
        self._thread.start()

    def _say_notes(self) -> None:
        """Degraded guarantees the store learned (a missing optional operation): once each."""
        for note in self.store.take_notes():
            with contextlib.suppress(Exception):
                self.warn(note)

    @property
    def pending(self) -> int:
        with self._lock:
            return self._pending

    def submit(self, commit: Commit) -> None:
        """Queue the upload of a committed step (every rank, same order). The step stays pinned
        in the node store until its upload is done."""
        self.pin(commit.step)
        with self._lock:
            self._pending += 1
        self._queue.put(commit)

    def wait(self, timeout: float | None = None) -> None:
        """Block until every queued upload is finished, then (within what is left of ``timeout``)
        until a retention pass in progress is done; a slow retention raises nothing."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._idle:
            while self._pending:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise AegisError(f"{self._pending} durable upload(s) still pending after {timeout} s")
                self._idle.wait(remaining)
        if self._retention is not None:
            self._retention.wait_idle(None if deadline is None else max(0.0, deadline - time.monotonic()))

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
        if self._retention is not None:  # the pass asked for by the last upload still runs
            self._retention.close(timeout=30 if timeout is None else max(1.0, timeout))
        return abandoned  # a stuck request holds only a daemon thread

    def abort(self) -> int:
        """In-process recovery: drop the queued uploads (their steps stay unpinned, simply not on
        the durable tier) and stop after the one running; no collective is started for them.
        Returns how many were dropped. Measured before: a survivor's teardown waited up to 5 s
        for queued uploads, and every other survivor waited for it."""
        dropped = 0
        while True:
            try:
                manifest = self._queue.get_nowait()
            except queue.Empty:
                break
            if manifest is None:
                continue
            dropped += 1
            with contextlib.suppress(Exception):
                self.unpin(manifest.step)
            with self._idle:
                self._pending -= 1
                self._idle.notify_all()
        self._queue.put(None)
        return dropped

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

    def _upload(self, commit: Commit) -> UploadResult:
        t0 = time.perf_counter()
        rank = self.group.rank
        step = commit.step
        result = UploadResult(step, rank)
        before = dataclasses.replace(self.store.stats, retry_reasons=dict(self.store.stats.retry_reasons))
        record = commit.whole.shard(rank) if commit.whole is not None else commit.record
        if record is None:
            raise AegisError(f"step {step}: this rank has no shard record to upload")
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
        # a format-4 step: rank 0 puts the durable tier's whole manifest together from every
        # rank's own record (O(world) per upload, as the durable manifest itself)
        own = record if commit.whole is None else None
        reports = self.group.gather((step, chunks, err, own), "durable gather")
        outcome: tuple[bool, str] | None = None
        if rank == 0:
            assert reports is not None
            failures = {r: e for r, (_, _, e, _) in enumerate(reports) if e is not None}
            failures.update({r: f"uploaded step {s}, not {step}" for r, (s, _, _, _) in enumerate(reports)
                             if s != step})
            if failures:
                outcome = (False, "; ".join(f"rank {r}: {e}" for r, e in sorted(failures.items())))
            else:
                try:
                    if commit.whole is not None:
                        base = commit.whole
                    else:
                        assert commit.layout is not None and commit.step_manifest is not None
                        base = assemble(commit.layout, commit.step_manifest,
                                        {r: rep[3] for r, rep in enumerate(reports)
                                         if rep[3] is not None},
                                        where=f"step {step} for the durable tier")
                    durable = dataclasses.replace(base, shards=tuple(
                        dataclasses.replace(s, chunks=tuple(reports[s.rank][1] or ()), replicas=())
                        for s in base.shards
                    ))
                    _fault.hit("upload", step, rank)
                    self._commit(durable)
                    outcome = (True, "")
                except Exception as e:  # noqa: BLE001 - sent to every rank
                    outcome = (False, f"rank 0 commit: {type(e).__name__}: {e}")
                if outcome[0] and self._retention is not None:
                    # Retention runs on its own thread: it never holds up this or the next upload.
                    result.pruned, result.prune_error = self._retention.take()
                    self._retention.request()
        ok, message = self.group.broadcast(outcome, "durable commit")
        self._say_notes()
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
        fd = os.open(path, os.O_RDONLY)
        try:
            def one(i: int) -> ChunkRecord:
                c = chunks[i]
                t = time.perf_counter()
                # pread: the kernel's copy out of tmpfs; a mapping's slice faulted in every page
                raw = os.pread(fd, c.length, c.offset)
                # the node store copy changed under us: never upload it
                if len(raw) != c.length or crc32c(raw) != c.crc32c:
                    raise CorruptShardError(f"step {step}, rank {rank}, chunk {i}: crc32c mismatch in "
                                            "the node store before upload", step=step, rank=rank, chunk=i)
                blob, desc = self.codec.encode(raw, c.dtype)
                enc = time.perf_counter() - t
                stored_crc = c.crc32c if desc == "raw" else crc32c(blob)  # raw: checked above
                # the store checks the bytes it received against it (S3's CRC32C checksum)
                self.store.put_unsynced(chunk_key(self.job, step, rank, i), blob, crc32c=stored_crc)
                with self._lock:
                    result.encode_s += enc
                    result.raw_bytes += c.length
                    result.stored_bytes += len(blob)
                    result.chunks += 1
                return dataclasses.replace(c, codec=desc, stored_length=len(blob), stored_crc32c=stored_crc)

            # bounded memory: at most max_inflight chunks encoded and in flight at once
            with ThreadPoolExecutor(max_workers=self.max_inflight) as pool:
                done = list(pool.map(one, range(len(chunks))))
            # durable before this rank reports them: rank 0 commits the step's manifest only then
            self.store.sync()
            return done
        finally:
            os.close(fd)

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


def fetch_chunk(store: ObjectStore, job: str, manifest: Manifest, shard: int, i: int
                ) -> tuple[bytes, int]:
    """One chunk of ``shard``, downloaded, verified and decoded: (its raw bytes, the stored
    bytes downloaded). The reading layer (``aegis.read.durable``) reads through it; a restore
    decodes in place (:func:`fetch_chunk_into`): both check the same things."""
    out = bytearray(manifest.shard(shard).chunks[i].length)
    stored = fetch_chunk_into(store, job, manifest, shard, i, memoryview(out))
    return bytes(out), stored


def fetch_chunk_into(store: ObjectStore, job: str, manifest: Manifest, shard: int, i: int,
                     out: memoryview) -> int:
    """Download chunk ``i`` of ``shard``, verify it and decode it into ``out`` (exactly the
    chunk's length); returns the stored bytes downloaded. Stored size and crc32c are checked
    before decoding (a decode bounded to the chunk's length), the raw crc32c after, over ``out``;
    CorruptShardError names the object key (``out`` then holds no trusted bytes)."""
    c = manifest.shard(shard).chunks[i]
    if len(out) != c.length:
        raise AegisError(f"internal: a {len(out)}-byte destination for the {c.length}-byte chunk "
                         f"{chunk_key(job, manifest.step, shard, i)}")
    data, stored = _verified_chunk(store, job, manifest, shard, i, out)
    if data is not out:
        out[:] = data
    return stored


def _verified_chunk(store: ObjectStore, job: str, manifest: Manifest, shard: int, i: int,
                    scratch: memoryview, blob: bytearray | None = None) -> tuple[memoryview, int]:
    """Chunk ``i`` of ``shard`` downloaded and verified into ``scratch`` (the chunk's length):
    (its raw bytes, the stored bytes downloaded). A raw chunk is read straight into ``scratch``
    and checked once there (its stored crc32c is its raw crc32c); another is read into ``blob``
    (a new buffer when None or smaller than its stored size; never resized: a view of it may
    still be held by an exception's frames), checked, decoded into ``scratch`` and its raw
    crc32c checked there. The object is read into memory this function
    owns (``store.get_into``): no object-sized ``bytes`` is built and copied again."""
    c = manifest.shard(shard).chunks[i]
    step = manifest.step
    key = chunk_key(job, step, shard, i)
    where = f"{store.url}/{key}"
    if c.stored_length is None or c.stored_crc32c is None:
        raise CorruptShardError(f"{where}: the manifest records no stored size or crc32c for it "
                                "(not a durable-tier manifest)", step=step, rank=shard, chunk=i,
                                where=where)
    raw = c.codec == "raw" and c.stored_length == c.length and c.stored_crc32c == c.crc32c
    if raw:
        into = scratch
    else:
        if blob is None or len(blob) < c.stored_length:
            blob = bytearray(c.stored_length)
        into = memoryview(blob)[:c.stored_length]
    try:
        size = store.get_into(key, into)
    except ObjectNotFound as e:
        raise CorruptShardError(f"{where} is missing", step=step, rank=shard, chunk=i, where=where) from e
    if size != c.stored_length or crc32c(into) != c.stored_crc32c:
        raise CorruptShardError(
            f"crc32c mismatch in step {step}, rank {shard}, chunk {i}: object {where} is "
            f"truncated or corrupt ({size} bytes, manifest says {c.stored_length})",
            step=step, rank=shard, chunk=i, where=where)
    if raw:
        return scratch, size  # the bytes just checked are the chunk's raw bytes
    try:
        decode_into(into, c.codec, scratch, where=where)
    except MemoryError as e:  # a zstd frame header may declare any size; decoding allocates it
        raise CorruptShardError(
            f"{where}: cannot decode (a compressed frame declares more bytes than the chunk's "
            f"{c.length}); the object is damaged or forged", step=step, rank=shard, chunk=i,
            where=where) from e
    if crc32c(scratch) != c.crc32c:
        raise CorruptShardError(f"crc32c mismatch in step {step}, rank {shard}, chunk {i} after "
                                f"decoding {where}", step=step, rank=shard, chunk=i, where=where)
    return scratch, size


Piece = tuple[int, int, memoryview]
"""``(start, end, dst)``: the shard's bytes [start, end) go to ``dst`` (writable, end - start
bytes)."""


def fetch_chunks(store: ObjectStore, job: str, manifest: Manifest, shard: int, ids: Iterable[int],
                 out: memoryview | int | Sequence[Piece], *, threads: int = 4) -> int:
    """Download, verify and decode chunks of one shard, ``threads`` at a time, into ``out``: a
    view of the whole shard; the file descriptor of its file (written with ``pwrite``: into a
    fresh tmpfs file 1.6x as fast as through a mapping, whose every page faulted in; measured
    here); or ``pieces`` (sorted, disjoint, covering the chunks): a restore's destination
    tensors and scratch buffers (``restore_direct``). Each chunk is verified before any of its
    bytes is written: nothing unverified reaches ``out``. A raw chunk is copied from the
    downloaded object, any other decoded into its thread's own buffer first. Returns the stored
    bytes downloaded."""
    rec = manifest.shard(shard)
    local = threading.local()
    pieces = None if isinstance(out, (int, memoryview)) else list(out)
    starts = [p[0] for p in pieces or ()]

    def one(i: int) -> int:
        c = rec.chunks[i]
        buf = getattr(local, "buf", None)
        if buf is None or len(buf) < c.length:
            buf = local.buf = bytearray(c.length)
        blob = getattr(local, "blob", None)
        if c.codec != "raw" and c.stored_length is not None and (blob is None or len(blob) < c.stored_length):
            blob = local.blob = bytearray(c.stored_length)
        data, stored = _verified_chunk(store, job, manifest, shard, i, memoryview(buf)[:c.length],
                                       blob)
        lo, hi = c.offset, c.offset + c.length
        if pieces is not None:
            pos = lo
            k = max(0, bisect.bisect_right(starts, lo) - 1)
            while pos < hi and k < len(pieces):
                a, b, dst = pieces[k]
                k += 1
                if b <= pos:
                    continue
                if a > pos:
                    break
                end = min(b, hi)
                dst[pos - a:end - a] = data[pos - lo:end - lo]
                pos = end
            if pos < hi:
                raise AegisError(f"internal: bytes {pos}..{hi} of chunk {i} of the shard of rank "
                                 f"{shard} have no destination")
        elif isinstance(out, int):
            done = 0
            while done < c.length:
                done += os.pwrite(out, data[done:], lo + done)
        elif isinstance(out, memoryview):
            out[lo:hi] = data
        return stored

    with ThreadPoolExecutor(max_workers=threads) as pool:
        return sum(pool.map(one, sorted(ids)))
