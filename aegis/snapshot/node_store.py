"""The node store: a per-node tmpfs directory that outlives the training processes.

Layout under ``<root>/<job>/``::

    step-00000012/rank-00000.shard     this node's shards (own and replicas) of step 12
    step-00000012/parity-00000.xor     XOR parity of rank 0's stripe (parity groups, issue 16)
    step-00000012/parity-00000.rs      or rank 0's Reed-Solomon parity pieces
    step-00000012/manifest.json        written last: the step is committed on this node
    .slots/rank-00000.1                free, pre-faulted slot files kept for reuse

Shard files of the engine are *slots*: files that are mapped once, pre-faulted, and moved
between a step directory and the free pool by ``rename`` (same inode, pages stay resident), so
a save copies into memory that already exists. Only this module touches paths.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import itertools
import mmap
import os
import re
import shutil
import stat
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import crc32c
import torch

from aegis.errors import (
    ConfigError,
    CorruptShardError,
    IncompatibleSnapshotError,
    ManifestError,
    StoreFullError,
)
from aegis.snapshot import hostmem
from aegis.snapshot.manifest import EncodedManifest, Manifest, ShardRecord
from aegis.snapshot.node_manifest import (
    Layout,
    StepManifest,
    assemble,
    load_node_manifest,
    parse_layout,
    remember_layout,
)
from aegis.snapshot.shard import (
    FOOTER_SIZE,
    ShardIndex,
    check_index_matches,
    decode_footer,
    decode_index,
    verify_chunks,
)

__all__ = ["NodeStore", "Slot", "StepInfo", "PartialManifestError", "default_store_root", "is_store_full",
           "await_frees", "free_later", "start_frees"]

# Pages freed on daemon threads (freeing 1 GB of tmpfs takes ~0.1-0.8 s of a core here, off the
# recovery's path): a restore's dropped steps (NodeStore.remove_step(later=True), renamed first
# to this prefix so no inventory sees them) and an aborted engine's slots (engine.abort, deferred:
# started by start_frees() once the next restore is done). await_frees() starts what is deferred
# and waits for all of them: a snapshot's free-space check and an engine's close.
_REMOVED = ".removed-"
_frees: list[threading.Thread] = []
_deferred: list[threading.Thread] = []  # in _frees too, not started yet
_frees_lock = threading.Lock()
_removal_ids = itertools.count()


def free_later(fn: Callable[[], object], name: str, *, defer: bool = False) -> None:
    """Run ``fn`` (a deletion, an unmap) on a daemon thread :func:`await_frees` waits for;
    ``defer``: not before :func:`start_frees` (or :func:`await_frees`) is called."""
    t = threading.Thread(target=fn, name=name, daemon=True)
    with _frees_lock:
        _frees.append(t)
        if defer:
            _deferred.append(t)
            return
    t.start()


def start_frees() -> None:
    """Start the deferred :func:`free_later` calls (a restore is done: the cores are free)."""
    with _frees_lock:  # started under the lock: no await_frees() can join one not started yet
        for t in _deferred:
            t.start()
        _deferred.clear()


def await_frees() -> None:
    """Wait until every :func:`free_later` made before this call is done (the deferred ones
    started first)."""
    with _frees_lock:
        for t in _deferred:
            t.start()
        _deferred.clear()
        pending = list(_frees)
    for t in pending:
        t.join()
    with _frees_lock:
        _frees[:] = [t for t in _frees if t not in pending]


def _remove_later(path: Path) -> None:
    free_later(lambda: shutil.rmtree(path, ignore_errors=True), "aegis-step-removal")


# Names this module wrote itself and nothing else: ASCII digits only (``\d`` would take any
# Unicode digit, "step-٠٠٠٠٠٠٠٧" too), matched in full (``$`` would allow a trailing newline).
_STEP_RE = re.compile(r"step-([0-9]{8})")
_SHARD_RE = re.compile(r"rank-([0-9]{5})\.shard")
_PARITY_RE = re.compile(r"parity-([0-9]{5})\.(?:xor|rs)")
MANIFEST = "manifest.json"


def default_store_root() -> Path:
    return Path(os.environ.get("AEGIS_STORE_DIR", "/dev/shm/aegis"))


_JOB_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}")


def is_store_full(e: BaseException) -> bool:
    """A full tmpfs (or quota): the snapshot is skipped, not the training run."""
    if isinstance(e, StoreFullError):
        return True
    return isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)


def check_job_name(job: str) -> str:
    if not isinstance(job, str) or not _JOB_RE.fullmatch(job) or ".." in job:
        raise ConfigError(
            f"job={job!r} is not a valid job name: use 1-128 letters, digits, '_', '-' or '.', "
            "starting with a letter or digit (it becomes a directory and an object-key prefix)"
        )
    return job


@dataclass(frozen=True)
class StepInfo:
    """What a node store holds for one step."""

    step: int
    committed: bool  # a manifest is present
    shard_ranks: tuple[int, ...]
    parity_ranks: tuple[int, ...] = ()  # members whose parity stripe this node holds


class NodeStore:
    """One node's store for one job. Safe to share between the ranks of a node: every rank only
    writes its own shard files, and only one rank per node writes manifests."""

    def __init__(self, root: str | os.PathLike[str], job: str) -> None:
        self.root = Path(root)
        self.job = check_job_name(job)
        self.dir = self.root / job
        self.slots_dir = self.dir / ".slots"

    def create(self) -> None:
        # Private to the user running the job: snapshots hold the full training state. mkdir's
        # mode is masked by the umask, never widened by it, so 0o700 holds under any umask.
        for d in (self.root, self.dir):
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
        # The job's directory may predate this run: it must be ours, and only ours.
        st = os.stat(self.dir)
        if st.st_uid != os.geteuid():
            raise ConfigError(
                f"node store directory {self.dir} belongs to another user (uid {st.st_uid}, this "
                f"process runs as uid {os.geteuid()}): snapshots must not go where others can read "
                "or replace them; remove it or use another AEGIS_STORE_DIR or job name"
            )
        if stat.S_IMODE(st.st_mode) != 0o700:
            os.chmod(self.dir, 0o700)
        self.slots_dir.mkdir(mode=0o700, exist_ok=True)

    # -- paths ---------------------------------------------------------------------------------

    def step_dir(self, step: int) -> Path:
        return self.dir / f"step-{step:08d}"

    def shard_path(self, step: int, rank: int) -> Path:
        return self.step_dir(step) / f"rank-{rank:05d}.shard"

    def partial_path(self, step: int, rank: int) -> Path:
        """Some chunks of a shard, fetched for one restore; never counted as a shard."""
        return self.step_dir(step) / f".partial-rank-{rank:05d}"

    def parity_path(self, step: int, rank: int, scheme: str = "xor") -> Path:
        """The parity file of ``rank`` (a member of a parity group), on its node: XOR, the
        parity of its stripe; RS (``scheme="rs"``), its parity pieces."""
        return self.step_dir(step) / f"parity-{rank:05d}.{scheme}"

    def manifest_path(self, step: int) -> Path:
        return self.step_dir(step) / MANIFEST

    @property
    def layouts_dir(self) -> Path:
        return self.dir / "layouts"

    def layout_path(self, digest: str) -> Path:
        return self.layouts_dir / f"layout-{digest}.json"

    # -- inventory -----------------------------------------------------------------------------

    def steps(self) -> list[StepInfo]:
        """Every step directory, newest first."""
        out: list[StepInfo] = []
        if not self.dir.is_dir():
            return out
        for entry in os.scandir(self.dir):
            m = _STEP_RE.fullmatch(entry.name)
            if not m or not entry.is_dir():
                continue
            ranks = []
            parity = []
            committed = False
            try:
                files = list(os.scandir(entry.path))
            except FileNotFoundError:  # removed by another rank's cleanup meanwhile
                continue
            for f in files:
                if f.name == MANIFEST:
                    committed = True
                elif sm := _SHARD_RE.fullmatch(f.name):
                    ranks.append(int(sm.group(1)))
                elif pm := _PARITY_RE.fullmatch(f.name):
                    parity.append(int(pm.group(1)))
            out.append(StepInfo(int(m.group(1)), committed, tuple(sorted(ranks)), tuple(sorted(parity))))
        out.sort(key=lambda s: s.step, reverse=True)
        return out

    def read_node_manifest(self, step: int) -> Manifest | StepManifest:
        """This node's ``manifest.json`` of ``step`` as written: a whole manifest (formats 2 and
        3) or a format-4 step record (see :func:`aegis.snapshot.node_manifest.assemble`)."""
        path = self.manifest_path(step)
        try:
            text = path.read_bytes()
        except OSError as e:
            raise ManifestError(f"cannot read {path}: {e}") from e
        manifest = load_node_manifest(text, where=str(path))
        if manifest.job != self.job:
            raise IncompatibleSnapshotError(
                f"{path} belongs to job {manifest.job!r}, not {self.job!r}: a store directory "
                "must not be shared between jobs; move it away or use another job name"
            )
        if manifest.step != step:
            raise ManifestError(f"{path} says step {manifest.step} but lives in step {step}'s directory")
        return manifest

    def read_layout(self, digest: str, notes: list[str] | None = None) -> Layout:
        """The layout named ``digest``: its first intact copy (every node keeps two, since every
        step of a plan needs it); a damaged copy passed over is named in ``notes``."""
        first: ManifestError | None = None
        for path in (self.layout_path(digest), _second(self.layout_path(digest))):
            try:
                try:
                    text = path.read_bytes()
                except OSError as e:
                    raise ManifestError(f"cannot read the layout {path}: {e}") from e
                layout = parse_layout(text, digest, where=str(path))
                if layout.job != self.job:
                    raise IncompatibleSnapshotError(
                        f"{path} belongs to job {layout.job!r}, not {self.job!r}")
            except IncompatibleSnapshotError:
                raise
            except ManifestError as e:
                first = first or e
                continue
            if first is not None and notes is not None:
                notes.append(f"layout copy skipped: {first}")
            return layout
        assert first is not None
        raise first

    def shard_record(self, step: int, rank: int) -> ShardRecord:
        """The record of this node's shard file of ``rank`` at ``step``, from the shard's own
        index (crc-checked) and footer; its node and replicas are not known here."""
        index, size, icrc = self.read_shard_index(step, rank)
        return ShardRecord(rank, "", size, icrc, index.chunks, index.items)

    def read_manifest(self, step: int, *, extra: Mapping[int, ShardRecord] | None = None,
                      allow_missing: bool = False) -> Manifest:
        """The whole manifest of a step committed on this node. A format-4 step is put together
        from its layout and the records of its shards: from the indexes of the shards this node
        holds, else from ``extra`` (records read elsewhere: another node's store, the durable
        tier), all checked against the step's digest. A shard here whose index is damaged is a
        :class:`CorruptShardError` naming it; ranks with no record are a
        :class:`PartialManifestError` (a multi-node job: the other ranks' shards are on other
        nodes), or with ``allow_missing`` placeholder records (size 0, no chunks or items:
        nothing of them can be read, and nothing is checked against the digest)."""
        m = self.read_node_manifest(step)
        if isinstance(m, Manifest):
            return m
        layout = self.read_layout(m.layout)
        records: dict[int, ShardRecord] = {}
        for r in range(m.world_size):
            if self.shard_path(step, r).exists():
                try:
                    records[r] = self.shard_record(step, r)
                except (OSError, ManifestError) as e:
                    if extra is not None and r in extra:
                        continue
                    if allow_missing:
                        continue
                    raise CorruptShardError(
                        f"the index of rank {r}'s shard at step {step} in node store {self.dir} is "
                        f"damaged ({e}); a format-4 manifest takes each rank's records from its "
                        "shard's index", step=step, rank=r, where=f"node store {self.dir}") from e
        for r, rec in (extra or {}).items():
            records.setdefault(r, rec)
        missing = [r for r in range(m.world_size) if r not in records]
        if missing and allow_missing:
            stub = {r: ShardRecord(r, layout.nodes[r], 0, 0, (), ()) for r in missing}
            return Manifest(job=m.job, step=m.step, world_size=m.world_size,
                            shards=tuple(dataclasses.replace(records.get(r) or stub[r],
                                                             node=layout.nodes[r])
                                         for r in range(m.world_size)),
                            entries=layout.entries, planner_data=layout.planner_data,
                            mesh=layout.mesh, timings=m.timings, created=m.created,
                            state_kinds=layout.state_kinds, redundancy=m.parity, format_version=4)
        if missing:
            raise PartialManifestError(
                f"{self.manifest_path(step)}: this node store holds intact shards of "
                f"{m.world_size - len(missing)} of {m.world_size} rank(s) of step {step} (not "
                f"{missing[:8]}{' ...' if len(missing) > 8 else ''}); a format-4 manifest is put "
                "together from the shards' own indexes: open the other nodes' stores too, or the "
                "durable tier", missing=missing)
        return assemble(layout, m, records, where=str(self.manifest_path(step)))

    def write_layout(self, layout: Layout) -> None:
        """Write ``layout`` once (a file named by its digest; present already: nothing to do)."""
        path = self.layout_path(layout.digest)
        if path.exists() and _second(path).exists():
            return
        self.layouts_dir.mkdir(mode=0o700, exist_ok=True)
        data = layout.to_json().encode()
        _atomic_write(path, data)
        _atomic_write(_second(path), data)  # every step of the plan needs it: two copies
        remember_layout(data, layout)  # this process's restores read it without parsing it

    def prune_layouts(self) -> int:
        """Remove layouts no step directory's manifest names (run by the node leader when a new
        plan's layout is written): O(steps held)."""
        if not self.layouts_dir.is_dir():
            return 0
        used: set[str] = set()
        for info in self.steps():
            with contextlib.suppress(Exception):
                m = self.read_node_manifest(info.step)
                if isinstance(m, StepManifest):
                    used.add(m.layout)
        n = 0
        for f in self.layouts_dir.iterdir():
            name = f.name.removesuffix(".2")
            if name.startswith("layout-") and name.endswith(".json") and name[7:-5] not in used:
                with contextlib.suppress(OSError):
                    f.unlink()
                    n += 1
        return n

    def write_manifest(self, manifest: Manifest | StepManifest | EncodedManifest,
                       layout: Layout | None = None) -> None:
        """Commit ``manifest.step`` on this node: an atomic rename, after the shards exist (and
        after its layout, written first when given)."""
        if layout is not None:
            self.write_layout(layout)
        data = manifest.text if isinstance(manifest, EncodedManifest) else manifest.to_json().encode()
        _atomic_write(self.manifest_path(manifest.step), data)

    def uncommit(self, step: int) -> None:
        """Remove a step's manifest first, so a crash mid-eviction never leaves it committed."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.manifest_path(step))

    def remove_step(self, step: int, *, later: bool = False) -> None:
        """Uncommit ``step``, then delete its directory. ``later``: the directory is renamed out
        of the inventory (``.removed-...``: no step's name) and deleted on a daemon thread that
        :func:`await_frees` waits for (a restore's cleanup: freeing 1 GB of tmpfs pages
        takes ~0.1 s here, which the restore no longer waits for; a snapshot's free-space
        check waits for it)."""
        self.uncommit(step)
        path = self.step_dir(step)
        if later:
            gone = self.dir / f"{_REMOVED}{path.name}-{os.getpid()}-{next(_removal_ids)}"
            try:
                os.rename(path, gone)
            except FileNotFoundError:
                return
            except OSError:  # not renamed: deleted now
                shutil.rmtree(path, ignore_errors=True)
                return
            _remove_later(gone)
            return
        shutil.rmtree(path, ignore_errors=True)

    def sweep_removed(self) -> None:
        """Delete (later) what a process lost before its :meth:`remove_step` ended left behind."""
        with contextlib.suppress(OSError):
            for entry in os.scandir(self.dir):
                if entry.name.startswith(_REMOVED) and entry.is_dir(follow_symlinks=False):
                    gone = Path(entry.path)
                    mine = gone.name.rsplit("-", 2)[-2] == str(os.getpid())
                    if not mine:  # this process's own are being deleted already
                        _remove_later(gone)

    def remove_shard(self, step: int, rank: int) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.shard_path(step, rank))
        self.remove_dir_if_empty(step)

    def remove_dir_if_empty(self, step: int) -> None:
        with contextlib.suppress(OSError):
            os.rmdir(self.step_dir(step))

    def read_shard_index(self, step: int, rank: int) -> tuple[ShardIndex, int, int]:
        """The index stored at the end of a shard file, the file's size and the index crc32c."""
        path = self.shard_path(step, rank)
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < FOOTER_SIZE:
                raise ManifestError(f"{path}: shard is truncated ({size} bytes)")
            f.seek(size - FOOTER_SIZE)
            start, crc = decode_footer(f.read(FOOTER_SIZE), size=size, where=str(path))
            f.seek(start)
            body = f.read(size - FOOTER_SIZE - start)
        index = decode_index(body, crc=crc, size=size, where=str(path))
        if index.job != self.job:
            raise ManifestError(
                f"{path} belongs to job {index.job!r}, not {self.job!r}: a store directory must not be "
                "shared between jobs; move it away or use another job name"
            )
        if (index.step, index.rank) != (step, rank):
            raise ManifestError(
                f"{path} holds the shard of rank {index.rank} at step {index.step}, not of rank {rank} "
                f"at step {step}; the file was moved or forged"
            )
        return index, size, crc

    def verify_shard(self, step: int, record: ShardRecord, chunks: set[int] | None = None, *,
                     keep: dict[str, mmap.mmap] | None = None, check_chunks: bool = True) -> None:
        """Check a local shard file against its manifest record: size, every chunk's crc32c (or
        those in ``chunks``), and the index crc32c. Raises CorruptShardError naming step, rank
        and chunk. With ``keep``, the file's read-only shared mapping is not closed but left
        there under its path, for a load that reads the verified bytes next (one mapping, its
        pages populated at once when every chunk is checked). With ``check_chunks=False`` only
        the size and the index (read, not mapped): a restore that streams the file into the
        state checks each chunk's crc32c as it reads it (:mod:`aegis.snapshot.stream_read`)."""
        path = self.shard_path(step, record.rank)
        where = f"node store {self.dir}"
        try:
            f = open(path, "rb")  # noqa: SIM115 - closed by the with below
        except FileNotFoundError as e:
            raise CorruptShardError(f"shard of rank {record.rank} at step {step} is missing from {where}",
                                    step=step, rank=record.rank, where=where) from e
        with f:
            size = os.fstat(f.fileno()).st_size
            if size != record.size:
                raise CorruptShardError(
                    f"shard of rank {record.rank} at step {step} in {where} has {size} bytes, the "
                    f"manifest says {record.size}", step=step, rank=record.rank, where=where)
            if size < FOOTER_SIZE:
                raise CorruptShardError(f"shard of rank {record.rank} at step {step} is truncated",
                                        step=step, rank=record.rank, where=where)
            if not check_chunks:
                tail = os.pread(f.fileno(), min(size, FOOTER_SIZE), size - FOOTER_SIZE)
                self._check_index(f.fileno(), tail, size, record, step, where, path)
                return
            whole = chunks is None or len(chunks) >= len(record.chunks)
            m = hostmem.map_file(f.fileno(), 0, write=False, populate=whole)
            kept = False
            try:
                verify_chunks(m, record.chunks, step=step, rank=record.rank, where=where, only=chunks)
                self._check_index(f.fileno(), m[size - FOOTER_SIZE:], size, record, step, where, path)
                if keep is not None:  # only a copy that passed every check
                    keep[str(path)] = m
                    kept = True
            finally:
                if not kept:
                    m.close()

    @staticmethod
    def _check_index(fd: int, footer: bytes, size: int, record: ShardRecord, step: int, where: str,
                     path: Path) -> None:
        """The shard's footer and index (crc-checked) against the manifest's record: what is
        loaded is located by the manifest, and either may be the damaged one."""
        try:
            start, icrc = decode_footer(footer, size=size, where=str(path))
            if icrc != record.index_crc32c:
                raise CorruptShardError(
                    f"shard index of rank {record.rank} at step {step} in {where} does not "
                    "match the manifest (index crc32c differs)", step=step, rank=record.rank,
                    where=where)
            body = os.pread(fd, size - FOOTER_SIZE - start, start)
            index = decode_index(body, crc=icrc, size=size, where=str(path))
        except ManifestError as e:
            raise CorruptShardError(f"shard of rank {record.rank} at step {step}: {e}",
                                    step=step, rank=record.rank, where=where) from e
        check_index_matches(index, record, step=step, where=where)

    def verify_parity(self, step: int, rank: int, size: int, crc: int, scheme: str = "xor") -> None:
        """Check the parity file of ``rank`` against its size and crc32c (manifest)."""
        path = self.parity_path(step, rank, scheme)
        where = f"node store {self.dir}"
        what = f"{scheme.upper()} parity of rank {rank} at step {step}"
        try:
            data = path.read_bytes()
        except FileNotFoundError as e:
            raise CorruptShardError(f"{what} is missing from {where}",
                                    step=step, rank=rank, where=where) from e
        got = int(crc32c.crc32c(data))
        if len(data) != size or got != crc:
            raise CorruptShardError(
                f"{what} in {where} has {len(data)} bytes and "
                f"crc32c {got:#010x}, the manifest says {size} bytes and {crc:#010x}: it is corrupt "
                "and cannot rebuild a lost shard", step=step, rank=rank, where=where)

    # -- space ---------------------------------------------------------------------------------

    def free_bytes(self) -> int:
        st = os.statvfs(self.root if self.root.exists() else self.root.parent)
        return st.f_bavail * st.f_frsize

    # -- slots ---------------------------------------------------------------------------------

    def slot_path(self, rank: int, k: int, kind: str = "rank") -> Path:
        """A free slot of ``rank``: kind "rank" for its own shards, "replica" for replicas it
        receives (their sizes differ, so they are pooled apart)."""
        return self.slots_dir / f"{kind}-{rank:05d}.{k}"

    def free_slots(self, rank: int, kind: str = "rank") -> Iterator[Path]:
        if self.slots_dir.is_dir():
            prefix = f"{kind}-{rank:05d}."
            for f in sorted(os.listdir(self.slots_dir)):
                if f.startswith(prefix):
                    yield self.slots_dir / f


def _second(path: Path) -> Path:
    return path.with_name(path.name + ".2")


class PartialManifestError(ManifestError):
    """A format-4 step whose shards are not all in this node store (see ``read_manifest``)."""

    def __init__(self, message: str, *, missing: list[int]) -> None:
        super().__init__(message)
        self.missing = missing


def _atomic_write(path: Path, data: bytes) -> None:
    """temp file, fsync, rename: the file is there whole or not at all."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb", opener=_private) as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):  # e.g. ENOSPC: leave no half-written file behind
            os.unlink(tmp)
        raise


def _private(path: str, flags: int) -> int:
    """``opener`` for files of the store: created 0o600 whatever the umask (open's default is
    0o666 minus the umask: world-readable with umask 0)."""
    fd = os.open(path, flags, 0o600)
    os.fchmod(fd, 0o600)  # a leftover file of the same name keeps its mode otherwise
    return fd


class Slot:
    """A shard file whose tensor region is mapped once and reused across snapshots.

    The file moves between the free pool and step directories by rename; the mapping (and the
    resident pages) stay with the inode. With ``keep`` (device staging) the mapping also
    outlives this object: :meth:`close_map` hands it to the process (:mod:`.hostmem`), and a
    Slot opened later on the same file takes it back, registered as pinned memory if it was
    (:meth:`pin`), instead of mapping and registering again.
    """

    def __init__(self, path: Path, kind: str = "rank", *, keep: bool = False) -> None:
        self.path = path
        self.kind = kind  # "rank" (own shards), "replica" or "parity": the pool it returns to
        self.keep = keep
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        self.capacity = 0
        self.pinned = False  # registered with the device runtime (hostmem.register)
        self._map: mmap.mmap | None = None
        self._view: torch.Tensor | None = None
        self._views: tuple[int, Any, list[torch.Tensor]] | None = None  # see item_views
        # the ShardLayout whose padding this slot's mapping holds as zeros (shard.zero_gaps)
        self.clean: Any = None
        self._ensuring = threading.Lock()

    def ensure(self, nbytes: int, *, prefault: bool = True) -> None:
        """Map exactly ``nbytes``; with ``prefault`` the pages are allocated now, not on the
        first copy (without it the file stays sparse: only what is written takes memory)."""
        with self._ensuring:  # the engine's thread pre-faults a spare the next save may take
            self._ensure(max(nbytes, 1), prefault)

    def _ensure(self, cap: int, prefault: bool) -> None:
        # exactly: the file grows past it on every save, never shrinks into it
        if cap == self.capacity and self._map is not None:
            return
        self.close_map(keep=False)
        kept = hostmem.take(self.fd, cap)
        if kept is not None:  # this process mapped (and maybe registered) the file before
            self._map, self._view, self.capacity, self.pinned = kept.mm, kept.view, cap, kept.pinned
            return
        os.ftruncate(self.fd, cap)
        if prefault:
            try:  # tmpfs allocates (and zeroes) the pages here
                os.posix_fallocate(self.fd, 0, cap)
            except OSError as e:
                if e.errno == errno.ENOSPC:
                    os.ftruncate(self.fd, 0)
                    raise StoreFullError(
                        f"node store full: cannot allocate {cap} bytes for {self.path}; free space on "
                        "its tmpfs, lower keep, or point AEGIS_STORE_DIR at a larger tmpfs"
                    ) from e
                # EOPNOTSUPP/EINVAL: no fallocate here; pages are faulted on first touch
        # page tables filled now, with the GIL released (hostmem.map_file)
        self._map = hostmem.map_file(self.fd, cap, write=True, populate=prefault)
        self.capacity = cap
        self._view = hostmem.tensor_of(self._map)  # holds the mapping open: see there

    @property
    def view(self) -> torch.Tensor:
        assert self._view is not None, "slot is not mapped"
        return self._view

    @property
    def mapped(self) -> bool:
        return self._map is not None

    def item_views(self, layout: Any) -> list[torch.Tensor]:
        """Typed views of the slot at each tensor item's planned offset (``layout``: a
        :class:`~aegis.snapshot.shard.ShardLayout`), made once per mapping and layout: a save
        then spends nothing per item on slicing."""
        key = id(layout)
        if self._views is None or self._views[0] != key or self._views[1] is not layout:
            view = self.view
            self._views = (key, layout, [
                view[t.file_offset:t.file_offset + t.nbytes].view(t.dtype).view(t.shape)
                for t in layout.tensors])
        return self._views[2]

    def pin(self) -> float | None:
        """Register the mapping as pinned memory for device copies (once: a no-op when it is);
        the seconds it took, or None when nothing was registered now (no device, refused, or
        pinned already)."""
        if self.pinned or self._view is None:
            return None
        seconds = hostmem.register(int(self._view.data_ptr()), self.capacity)
        self.pinned = seconds is not None
        return seconds

    @property
    def memory(self) -> memoryview:
        assert self._map is not None
        return memoryview(self._map)

    def move(self, path: Path) -> None:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.replace(self.path, path)
        self.path = path

    def write_tail(self, payloads: list[tuple[int, bytes]], tail: bytes,
                   tail_offset: int) -> int:
        """Write the bytes region and index after the mapped tensor region; size the file."""
        size = tail_offset + len(tail)
        assert size >= self.capacity, "the tail must start after the mapped tensor region"
        os.ftruncate(self.fd, size)
        for off, payload in payloads:
            os.pwrite(self.fd, payload, off)
        os.pwrite(self.fd, tail, tail_offset)
        return size

    def detach_map(self) -> mmap.mmap:
        """Hand the current mapping to the caller (who closes it) and forget it: e.g. a shard
        just received and verified, read next by a load through the same pages."""
        assert self._map is not None
        m = self._map
        self._map, self._view, self._views, self.capacity = None, None, None, 0
        self.clean = None
        return m

    def close_map(self, *, keep: bool | None = None) -> None:
        """Unmap (and unregister), or with ``keep`` (default: the Slot's) hand the mapping to
        the process for a later Slot on the same file."""
        keep = self.keep if keep is None else keep
        self._views = None
        self.clean = None
        if self._map is not None and self._view is not None and keep:
            ino = os.fstat(self.fd)
            hostmem.keep(hostmem.Kept(self._map, self._view, self.capacity, self.pinned,
                                      str(self.path), (ino.st_dev, ino.st_ino)))
        elif self._map is not None:
            if self.pinned and self._view is not None:
                hostmem.unregister(int(self._view.data_ptr()), self.capacity)
            self._view = None
            with contextlib.suppress(BufferError):
                self._map.close()
        self._view = None
        self._map = None
        self.pinned = False
        self.capacity = 0

    def close(self, *, keep: bool | None = None) -> None:
        self.close_map(keep=keep)
        with contextlib.suppress(OSError):
            os.close(self.fd)
