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

One module per backend: :mod:`.memory` (node stores), :mod:`.durable` (the durable tier),
:mod:`.dcp` (plain DCP), over the interfaces of :mod:`._base` and the aegis copy of
:mod:`.aegis_copy`; this module resolves a URI to them (:func:`resolve`, :func:`pick`) and
re-exports their names.

Callers: :mod:`aegis.read.api` (which reads a step from several locations, the next copy when
one is damaged) and the ``aegis`` command (``ls``, ``verify``, ``prune`` work per location).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from aegis.errors import AegisError
from aegis.read._base import (  # noqa: F401 - re-exported
    _DURABLE_KEY,
    _JOB_NAME,
    _RANK_DIR,
    _RANK_SHARD,
    _STEP_DIR,
    _TRAILING_INT,
    DECODE_FACTOR,
    STATE_KINDS_FILE,
    TIER_DCP,
    TIER_DURABLE,
    TIER_MEMORY,
    Copy,
    Failure,
    Location,
    StepRow,
    VerifyResult,
)
from aegis.read.aegis_copy import (  # noqa: F401 - re-exported
    AegisCopy,
    needed_chunks,
)
from aegis.read.dcp import (  # noqa: F401 - re-exported
    DcpCopy,
    DcpLocation,
)
from aegis.read.durable import (  # noqa: F401 - re-exported
    DurableCopy,
    DurableLocation,
    fetch_chunk,
)
from aegis.read.errors import SourceError
from aegis.read.memory import (  # noqa: F401 - re-exported
    NodeStoreCopy,
    NodeStoreLocation,
)
from aegis.snapshot.objstore import ObjectStore, open_store
from aegis.snapshot.retry import RetryPolicy

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
    "NodeStoreCopy",
    "DurableCopy",
    "STATE_KINDS_FILE",
    "DECODE_FACTOR",
    "needed_chunks",
    "fetch_chunk",
    "resolve",
    "pick",
]


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
