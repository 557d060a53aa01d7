"""Durable object stores: one small interface, chosen by URL scheme.

* ``file:///path`` (the embedded default): a local directory; writes are atomic (temporary
  file, fsync, rename) and a conditional put is an exclusive link. A batch of writes that
  only needs to be durable together (a shard's chunks, before the step's manifest) is
  flushed once: :meth:`ObjectStore.put_unsynced` then :meth:`ObjectStore.sync`.
* ``s3://bucket/prefix``: any S3-compatible endpoint through boto3 (``AWS_ENDPOINT_URL`` and
  boto3's usual configuration and credential chain); see :mod:`aegis.snapshot.s3`, the only
  module that imports boto3.

Keys are relative, ``/``-separated, and may never contain ``..`` or start with ``/``.
Credentials never go into a URL (they would end up in events and logs): boto3 finds them.
"""

from __future__ import annotations

import abc
import builtins
import contextlib
import ctypes
import os
import re
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

from aegis.errors import AegisError, ConfigError

__all__ = [
    "ObjectStore",
    "FileStore",
    "ObjectInfo",
    "PreconditionFailed",
    "ObjectNotFound",
    "StoreStats",
    "Capabilities",
    "UnsupportedOperation",
    "open_store",
    "check_key",
    "redact_url",
]


class PreconditionFailed(AegisError):
    """A conditional put found the key already present."""


class ObjectNotFound(AegisError):
    """The key does not exist."""


class UnsupportedOperation(AegisError):
    """The endpoint does not implement an operation (HTTP 501 NotImplemented) and aegis has no
    other way to do what was asked."""


# What each optional operation is for, and what aegis does without it (``aegis doctor`` prints
# these; docs/guides/durable.md has the same table).
CAPABILITY_FALLBACKS: dict[str, tuple[str, str]] = {
    "batch_delete": ("DeleteObjects (up to 1,000 keys per request)",
                     "deletes one object per request: retention and cleanup take more requests"),
    "list_multipart_uploads": ("ListMultipartUploads (find stale multipart uploads)",
                               "records each in-flight multipart upload in a marker object under "
                               ".aegis/uploads/ and aborts stale ones from those markers"),
    "conditional_put": ("PutObject with If-None-Match: * (commit a manifest at most once)",
                        "checks that the manifest is absent, puts it, then reads it back; weaker: "
                        "two runs of the same job committing the same step at the same moment are "
                        "not excluded (the last writer wins; each sees the other's manifest on "
                        "read-back and refuses to go on)"),
    "crc32c": ("S3 CRC32C checksums on uploads",
               "uploads without a transport checksum; the manifest's own crc32c of every stored "
               "object, checked at every download and by `aegis verify`, still catches damage"),
}


@dataclass
class Capabilities:
    """Which optional operations the endpoint supports: True, False (it answered 501
    NotImplemented), or None (not used yet). Learned on first use, never by retrying."""

    batch_delete: bool | None = None
    list_multipart_uploads: bool | None = None
    conditional_put: bool | None = None
    crc32c: bool | None = None

    def to_json(self) -> dict[str, bool | None]:
        return {k: getattr(self, k) for k in CAPABILITY_FALLBACKS}


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int


@dataclass
class StoreStats:
    """Counters that end up in events: requests, retries (attempts beyond the first)."""

    requests: int = 0
    retries: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    retry_reasons: dict[str, int] = field(default_factory=dict)


_KEY_RE = re.compile(r"[A-Za-z0-9._\-]+(/[A-Za-z0-9._\-]+)*")  # fullmatch: no trailing newline


def check_key(key: str) -> str:
    if not isinstance(key, str) or not _KEY_RE.fullmatch(key) or any(p in ("..", ".") for p in key.split("/")):
        raise AegisError(
            f"invalid object key {key!r}: relative, '/'-separated ASCII letters, digits, '.', '_' "
            "and '-', no '.' or '..' parts"
        )
    return key


def _mkdir_private(path: Path) -> None:
    """``mkdir -p`` with every directory it creates 0o700 (``Path.mkdir(parents=True)`` gives the
    missing parents the default mode, 0o777 minus the umask)."""
    missing = []
    while not path.is_dir():
        missing.append(path)
        if path.parent == path:
            break
        path = path.parent
    for d in reversed(missing):
        with contextlib.suppress(FileExistsError):  # another writer made it meanwhile
            d.mkdir(mode=0o700)


class ObjectStore(abc.ABC):
    """put / get / get_range / list / delete. Thread-safe: the uploader calls it from threads."""

    url: str
    stats: StoreStats
    capabilities: Capabilities = Capabilities(True, True, True, True)

    @abc.abstractmethod
    def put(self, key: str, data: bytes | memoryview, *, if_absent: bool = False) -> None:
        """Store ``data`` at ``key`` atomically (readers see all of it or nothing). With
        ``if_absent`` raise :class:`PreconditionFailed` when the key exists."""

    @abc.abstractmethod
    def get(self, key: str) -> bytes:
        """The whole object; :class:`ObjectNotFound` when missing."""

    def get_into(self, key: str, out: memoryview) -> int:
        """The whole object read into the start of ``out``; returns its size. An object larger
        than ``out`` is not read (its size says so to a caller that knows the size to expect).
        :class:`ObjectNotFound` when missing. Stores that can read straight into ``out`` do (no
        object-sized ``bytes`` built and copied); this default copies :meth:`get`'s."""
        data = self.get(key)
        if len(data) <= len(out):
            out[:len(data)] = data
        return len(data)

    @abc.abstractmethod
    def get_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of the object."""

    @abc.abstractmethod
    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every object whose key starts with ``prefix``, in key order."""

    @abc.abstractmethod
    def delete(self, keys: Iterable[str]) -> None:
        """Delete ``keys`` (missing keys are ignored)."""

    def put_unsynced(self, key: str, data: bytes | memoryview, *, crc32c: int | None = None) -> None:
        """:meth:`put`, atomic for readers, but durable only after the next :meth:`sync` (on
        stores where every put is durable when it returns, S3's, the same as :meth:`put`). The
        uploader writes a shard's chunks this way and syncs before the step's manifest.
        ``crc32c``: the data's crc32c when the caller has it already; a store that checks
        integrity on receipt (S3) sends it instead of computing it again."""
        self.put(key, data)

    def sync(self) -> None:  # noqa: B027 - optional
        """Make every :meth:`put_unsynced` of this store durable."""

    def check(self) -> None:  # noqa: B027 - optional
        """Fail now, with a clear message, when the store is unreachable or not writable."""

    def abort_stale_uploads(self, prefix: str, older_than_s: float) -> int:
        """Abort unfinished multipart uploads under ``prefix``; return how many."""
        return 0

    def probe(self) -> Capabilities:
        """Find out which optional operations the endpoint supports, by trying each once on a
        probe key (``aegis doctor``). Stores without optional operations support everything."""
        return self.capabilities

    def take_notes(self) -> builtins.list[str]:
        """Notes about degraded guarantees learned since the last call, each said once per
        store (e.g. "no conditional put: ..."): for the console."""
        return []

    def close(self) -> None:  # noqa: B027 - optional
        pass


def _syncfs() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """libc's ``syncfs(fd)`` (Linux): one flush of a whole file system; None elsewhere."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).syncfs
    except (AttributeError, OSError):
        return None
    fn.argtypes = [ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


class FileStore(ObjectStore):
    """A local directory as an object store."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.url = f"file://{self.root}"
        self.stats = StoreStats()
        self._unsynced: set[Path] = set()  # put_unsynced paths not yet made durable by sync()
        self._lock = threading.Lock()

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def check(self) -> None:
        try:
            _mkdir_private(self.root)
            probe = self.root / f".aegis-probe-{os.getpid()}"
            probe.write_bytes(b"ok")
            probe.unlink()
        except OSError as e:
            raise ConfigError(f"durable store {self.url} is not writable: {e}") from e

    def put(self, key: str, data: bytes | memoryview, *, if_absent: bool = False) -> None:
        self._put(key, data, if_absent=if_absent, synced=True)

    def put_unsynced(self, key: str, data: bytes | memoryview, *, crc32c: int | None = None) -> None:
        self._put(key, data, if_absent=False, synced=False)

    def sync(self) -> None:
        """One ``syncfs`` of the directory's file system when the platform has it (Linux): one
        journal commit for a whole shard's chunks, where a ``put`` pays two fsyncs each;
        otherwise an fsync of each file and directory written since the last sync."""
        with self._lock:
            paths, self._unsynced = self._unsynced, set()
        if not paths:
            return
        syncfs = _syncfs()
        if syncfs is not None:
            fd = os.open(self.root, os.O_RDONLY)
            try:
                if syncfs(fd) == 0:
                    return
            finally:
                os.close(fd)
        for p in sorted(paths) + sorted({p.parent for p in paths}):
            with contextlib.suppress(FileNotFoundError):
                fd = os.open(p, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)

    def _put(self, key: str, data: bytes | memoryview, *, if_absent: bool, synced: bool) -> None:
        path = self._path(key)
        _mkdir_private(path.parent)
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}-{id(data)}")
        with open(tmp, "wb", opener=lambda p, flags: os.open(p, flags, 0o600)) as f:
            f.write(data)
            f.flush()
            if synced:
                os.fsync(f.fileno())
        try:
            if if_absent:
                try:
                    os.link(tmp, path)  # atomic create-if-absent
                except FileExistsError as e:
                    raise PreconditionFailed(f"{self.url}/{key} already exists") from e
            else:
                os.replace(tmp, path)
                tmp = None  # type: ignore[assignment]
        finally:
            if tmp is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
        if not synced:
            with self._lock:
                self._unsynced.add(path)
        else:
            with contextlib.suppress(OSError):
                dfd = os.open(path.parent, os.O_RDONLY)
                os.fsync(dfd)
                os.close(dfd)
        self.stats.requests += 1
        self.stats.bytes_up += len(data)

    def get(self, key: str) -> bytes:
        try:
            data = self._path(key).read_bytes()
        except FileNotFoundError as e:
            raise ObjectNotFound(f"{self.url}/{key} does not exist") from e
        self.stats.requests += 1
        self.stats.bytes_down += len(data)
        return data

    def get_into(self, key: str, out: memoryview) -> int:
        try:
            f = open(self._path(key), "rb", buffering=0)  # noqa: SIM115 - closed below
        except FileNotFoundError as e:
            raise ObjectNotFound(f"{self.url}/{key} does not exist") from e
        with f:
            size = os.fstat(f.fileno()).st_size
            got = 0
            while size <= len(out) and got < size:
                n = f.readinto(out[got:size])
                if not n:  # shorter than it was: the caller sees the size it got
                    size = got
                    break
                got += n
        self.stats.requests += 1
        self.stats.bytes_down += got
        return size

    def get_range(self, key: str, start: int, end: int) -> bytes:
        try:
            with open(self._path(key), "rb") as f:
                f.seek(start)
                data = f.read(end - start)
        except FileNotFoundError as e:
            raise ObjectNotFound(f"{self.url}/{key} does not exist") from e
        self.stats.requests += 1
        self.stats.bytes_down += len(data)
        return data

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        base = self.root
        out = []
        if base.is_dir():
            for dirpath, _dirs, files in os.walk(base):
                for name in files:
                    if name.startswith("."):
                        continue  # temporary files of writes in progress
                    full = Path(dirpath) / name
                    key = full.relative_to(base).as_posix()
                    if key.startswith(prefix):
                        try:
                            size = full.stat().st_size
                        except FileNotFoundError:  # deleted since the walk saw it (a prune):
                            continue  # not listed, as S3 would not list it
                        out.append(ObjectInfo(key, size))
        self.stats.requests += 1
        yield from sorted(out, key=lambda o: o.key)

    def delete(self, keys: Iterable[str]) -> None:
        for key in keys:
            path = self._path(key)
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            parent = path.parent
            while parent != self.root:
                try:
                    parent.rmdir()
                except OSError:
                    break
                parent = parent.parent
            self.stats.requests += 1


def redact_url(url: str) -> str:
    """``url`` with anything that may be ``user:password@`` replaced by ``***@``: safe to print.

    Everything up to the last ``@`` goes: a secret key may hold a ``/`` (AWS secrets often do), so
    where the authority ends cannot be trusted."""
    if "@" not in url:
        return url
    scheme, sep, _ = url.partition("://")
    return (f"{scheme}{sep}" if sep else "") + "***@" + url.rpartition("@")[2]


def open_store(url: str, **options: object) -> ObjectStore:
    """The object store for ``url``: ``file:///abs/path`` or ``s3://bucket[/prefix]``."""
    parsed = urlparse(url)
    shown = redact_url(url)
    if parsed.scheme == "s3" and ("@" in url or ":" in parsed.netloc):
        raise ConfigError(
            f"durable url {shown!r}: credentials must not be part of the URL (it is written to events "
            "and logs), and a bucket name holds no '@' or ':'; give credentials to boto3 instead: "
            "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE or an instance role"
        )
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise ConfigError(
                f"durable url {shown!r}: use file:///absolute/path (a local directory: no host, no "
                "credentials)"
            )
        return FileStore(parsed.path)
    if parsed.scheme == "s3":
        from aegis.snapshot.s3 import S3Store

        if not parsed.netloc:
            raise ConfigError(f"durable url {shown!r}: missing bucket (s3://bucket/prefix)")
        return S3Store(parsed.netloc, parsed.path.strip("/"), **options)  # type: ignore[arg-type]
    raise ConfigError(f"durable url {shown!r}: unsupported scheme; use file:///path or s3://bucket/prefix")
