"""One step of a job's snapshots, read from Python (:class:`Snapshot`; :mod:`.api` is the
entry point: ``aegis.open(uri).latest()``): entries, verified chunks from every copy that holds
them, tensors assembled through DCP a batch at a time within ``max_bytes``, ``load_into`` a
model, objects as data, ``verify``, ``export``; :class:`LazyTensors` for one tensor at a time.
"""

from __future__ import annotations

import builtins
import contextlib
import os
import re
import tempfile
import warnings
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from aegis.errors import (
    AegisError,
    CorruptShardError,
    StateMismatchError,
)
from aegis.read._base import ChunkKey
from aegis.read.errors import DamagedCopyWarning, SourceError
from aegis.read.lazy import LazyTensors, _ChunkCache
from aegis.read.locations import (
    DECODE_FACTOR,
    AegisCopy,
    Copy,
    DcpCopy,
    DurableCopy,
    Failure,
    NodeStoreCopy,
    needed_chunks,
)
from aegis.read.progress import ProgressArg, progress_bar
from aegis.read.tensors import ChunkReader, dcp_load
from aegis.snapshot.manifest import Manifest, TensorEntry, dtype_from_name
from aegis.snapshot.shard import chunks_for_ranges

if TYPE_CHECKING:
    from aegis.read.source import Source

__all__ = ["Snapshot", "SnapshotEntry", "LoadResult", "VerifyReport", "LazyTensors", "DEFAULT_MAX_BYTES"]


DEFAULT_MAX_BYTES = 512 << 20


_PER_RANK = re.compile(r"^per_rank\.rank(\d+)\.([^.]+)(?:\.|$)")


_RNG = re.compile(r"^rng\.rank(\d+)(?:\.|$)")


def by_bytes(names: Sequence[str], size: Callable[[str], int], max_bytes: int) -> Iterator[list[str]]:
    """``names`` in order, cut into groups of at most ``max_bytes`` by ``size`` (at least one
    name each)."""
    group: list[str] = []
    total = 0
    for name in names:
        n = size(name)
        if group and total + n > max_bytes:
            yield group
            group, total = [], 0
        group.append(name)
        total += n
    if group:
        yield group


@dataclass(frozen=True)
class SnapshotEntry:
    """One entry of a snapshot, as data.

    Attributes:
        name: the flat key (``app.model.model.head.weight``).
        kind: ``"tensor"`` or ``"object"`` (a serialized non-tensor item).
        dtype: a tensor's dtype name (None for an object).
        shape: a tensor's full shape (None for an object).
        nbytes: the full tensor's bytes, or the object's serialized bytes.
        shards: how many stored pieces a tensor is cut into.
        state: the Manager state entry it belongs to (``model``, ``sched``; ``rng`` for the RNG
            states).
        state_kind: that entry's kind (``sharded``, ``per_rank``, ``replicated``; None when
            unknown).
        rank: the rank whose copy it is, for per-rank entries.
    """

    name: str
    kind: str
    dtype: str | None
    shape: tuple[int, ...] | None
    nbytes: int
    shards: int | None
    state: str | None
    state_kind: str | None
    rank: int | None

    @property
    def torch_dtype(self) -> torch.dtype | None:
        return None if self.dtype is None else dtype_from_name(self.dtype)


@dataclass
class LoadResult:
    """What :meth:`Snapshot.load_into` did: the snapshot ``prefix`` the target's keys were found
    under, the target keys ``loaded``, those ``missing`` from the snapshot, and the snapshot's
    tensors under the prefix that the target has no key for (``unexpected``)."""

    prefix: str
    loaded: list[str]
    missing: list[str]
    unexpected: list[str]


@dataclass
class VerifyReport:
    """What :meth:`Snapshot.verify` found. ``failures`` is every damage found in the first copy;
    ``ok`` is True when every chunk can be read intact from some opened copy (``notes`` say which
    copy covers which damage). ``checksums`` is False for a plain DCP checkpoint (DCP keeps none:
    only presence and sizes were checked)."""

    step: int | None
    ok: bool
    checksums: bool
    chunks: int
    bytes: int
    failures: list[Failure] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


class Snapshot:
    """One step of a :class:`Source`, readable from one or more copies (``copies``, in the
    order they are tried). Made by :meth:`Source.step` / :meth:`Source.latest`.

    Args:
        source: the Source it belongs to.
        copies: the step's copies, in the order they are tried.
        notes: what was passed over to find it (damaged steps, missing shards).
    """

    def __init__(self, source: Source, copies: list[Copy], notes: list[str]) -> None:
        self.source = source
        self.copies = copies
        self.notes = notes
        primary = copies[0]
        self.step: int | None = primary.step
        self.job: str | None = primary.job
        self.tier: str = primary.tier
        self.uri: str = primary.uri
        self.manifest: Manifest | None = primary.manifest if isinstance(primary, AegisCopy) else None
        self.metadata = primary.metadata
        self.planner_data = primary.planner_data
        self.state_kinds: dict[str, str] = dict(primary.state_kinds)
        self.object_sizes = primary.object_sizes
        self.entries: dict[str, SnapshotEntry] = {n: self._entry(n) for n in primary.entries}
        self._chunk_keys: dict[str, frozenset[ChunkKey]] | None = None

    # -- what it holds ---------------------------------------------------------------------------

    def _entry(self, name: str) -> SnapshotEntry:
        raw = self.copies[0].entries[name]
        state: str | None = None
        kind: str | None = None
        rank: int | None = None
        if (m := _PER_RANK.match(name)) is not None:
            rank, state = int(m.group(1)), m.group(2)
            kind = self.state_kinds.get(state, "per_rank")
        elif (m := _RNG.match(name)) is not None:
            rank, state, kind = int(m.group(1)), "rng", "per_rank"
        elif name.startswith("app."):
            state = name.split(".")[1]
            kind = self.state_kinds.get(state)
        if isinstance(raw, TensorEntry):
            return SnapshotEntry(name, "tensor", raw.dtype, tuple(raw.size), raw.nbytes, len(raw.chunks),
                                 state, kind, rank)
        return SnapshotEntry(name, "object", None, None, self.object_sizes.get(name, 0), None, state, kind, rank)

    def keys(self) -> list[str]:
        """The names of the tensor entries, in the snapshot's order."""
        return [n for n, e in self.entries.items() if e.kind == "tensor"]

    def summary(self) -> dict[str, Any]:
        """world_size, created, format_version, state_kinds, mesh, timings, shards, redundancy:
        what ``aegis inspect`` shows (of the first copy)."""
        return self.copies[0].summary()

    def entry_bytes(self, name: str) -> int:
        """The full bytes of entry ``name`` (a tensor's, or an object's serialized bytes).

        Args:
            name: the entry's flat name.
        """
        return self.entries[name].nbytes

    def bytes_to_read(self, names: Sequence[str] | None = None) -> int:
        """Bytes read from the copies to serve ``names`` (None: every entry): whole chunks for
        aegis snapshots, the entries' own bytes for DCP checkpoints.

        Args:
            names: entry names (None: every entry).
        """
        names = list(self.entries) if names is None else list(names)
        if self.manifest is None:
            return sum(self.entry_bytes(n) for n in names)
        m = self.manifest
        return sum(m.shard(r).chunks[i].length for r, ids in needed_chunks(m, names).items() for i in ids)

    def missing_shards(self) -> list[int]:
        """Ranks whose shard no copy holds (a node store holds only its node's shards and the
        replicas it keeps); empty for the durable tier and DCP checkpoints."""
        if self.manifest is None:
            return []
        return [s.rank for s in self.manifest.shards
                if not any(isinstance(c, AegisCopy) and c.has_shard(s.rank) for c in self.copies)]

    def _select(self, keys: str | Sequence[str] | None, prefix: str | None, kind: str) -> list[str]:
        """Entry names of ``kind`` named by ``keys`` (exact names, or prefixes ending at a dot) and
        under ``prefix``; KeyError (with near misses) for a key that names nothing."""
        if isinstance(keys, str):
            keys = [keys]
        pool = [n for n, e in self.entries.items() if e.kind == kind and (prefix is None or n.startswith(prefix))]
        if keys is None:
            return pool
        chosen: dict[str, None] = {}
        for k in keys:
            full = k if prefix is None or k.startswith(prefix) else prefix + k
            hits = [n for n in pool if n == full or n.startswith(full.rstrip(".") + ".")]
            if not hits:
                import difflib

                close = difflib.get_close_matches(full, pool, n=3, cutoff=0.5)
                hint = f"; did you mean {', '.join(close)}?" if close else ""
                raise KeyError(f"no {kind} entry {full!r} in step {self.step} of {self.uri}{hint}")
            chosen.update(dict.fromkeys(hits))
        return list(chosen)

    # -- fetching chunks from the copies ---------------------------------------------------------

    def _chunks_of(self, name: str) -> frozenset[ChunkKey]:
        if self._chunk_keys is None:
            assert self.manifest is not None
            acc: dict[str, set[ChunkKey]] = {}
            for shard in self.manifest.shards:
                by_fqn: dict[str, list[tuple[int, int]]] = {}
                for item in shard.items:
                    by_fqn.setdefault(item.fqn, []).append((item.file_offset, item.length))
                for fqn, ranges in by_fqn.items():
                    acc.setdefault(fqn, set()).update((shard.rank, i) for i in chunks_for_ranges(shard.chunks, ranges))
            self._chunk_keys = {k: frozenset(v) for k, v in acc.items()}
        return self._chunk_keys.get(name, frozenset())

    def _batches(self, names: list[str], max_bytes: int) -> Iterator[list[str]]:
        """``names`` cut into groups whose reads hold at most ``max_bytes`` (at least one name
        each): whole chunks for aegis snapshots (names ordered by where they are stored, so a
        group shares chunks), the entries' bytes for DCP checkpoints."""
        if self.manifest is None:
            yield from by_bytes(names, self.entry_bytes, max_bytes)
            return
        m = self.manifest
        lengths = {(s.rank, i): c.length for s in m.shards for i, c in enumerate(s.chunks)}
        ordered = sorted(names, key=lambda n: min(self._chunks_of(n), default=(-1, -1)))
        group: list[str] = []
        held: set[ChunkKey] = set()
        size = 0
        for name in ordered:
            keys = self._chunks_of(name)
            extra = sum(lengths[k] for k in keys - held)
            if group and size + extra > max_bytes:
                yield group
                group, held, size = [], set(), 0
                extra = sum(lengths[k] for k in keys)
            group.append(name)
            held |= keys
            size += extra
        if group:
            yield group

    def _plan(self, max_bytes: int) -> tuple[int, int]:
        """(download threads, bytes of chunks per batch) for a read within ``max_bytes``. With a
        durable copy among the copies, each download thread's decoding (``DECODE_FACTOR`` times
        the largest chunk) is taken from the budget first, for at most half of it; at least one
        thread and one chunk are always allowed."""
        if self.manifest is None:
            return 1, max_bytes
        biggest = max((c.length for s in self.manifest.shards for c in s.chunks), default=1)
        if not any(isinstance(c, DurableCopy) for c in self.copies):
            return 1, max(max_bytes, 1)
        decode = DECODE_FACTOR * biggest
        threads = max(1, min(8, max_bytes // max(1, 2 * decode)))
        return threads, max(biggest, max_bytes - threads * decode)

    def _fetch(self, wanted: Mapping[int, Sequence[int] | set[int]], progress: Any = None,
               threads: int = 8, copies: Sequence[Copy] | None = None,
               cache: _ChunkCache | None = None) -> dict[int, dict[int, bytes]]:
        """Verified raw chunks ``wanted`` (rank -> chunk indices), each from the first copy that
        holds it intact; damage in one copy read around in the next is noted. CorruptShardError
        when no copy has a chunk intact; SourceError when no opened copy holds a shard at all."""
        assert self.manifest is not None
        step = self.manifest.step
        tell = progress if progress is not None else (lambda n: None)
        todo: set[ChunkKey] = {(r, i) for r, ids in wanted.items() for i in ids}
        got: dict[int, dict[int, bytes]] = {}
        if cache is not None:
            for key in list(todo):
                hit = cache.get(key)
                if hit is not None:
                    got.setdefault(key[0], {})[key[1]] = hit
                    todo.discard(key)
        damage: dict[ChunkKey, list[tuple[AegisCopy, AegisError]]] = {}
        for copy in copies if copies is not None else self.copies:
            if not todo or not isinstance(copy, AegisCopy):
                continue
            ask: dict[int, set[int]] = {}
            for r, i in todo:
                if copy.has_shard(r):
                    ask.setdefault(r, set()).add(i)
            if not ask:
                continue
            ok, bad = copy.read_chunks(ask, tell, threads)
            repaired: dict[tuple[AegisCopy, int], list[int]] = {}
            for (r, i), data in ok.items():
                got.setdefault(r, {})[i] = data
                todo.discard((r, i))
                if cache is not None:
                    cache.put((r, i), data)
                for was, _ in damage.get((r, i), []):
                    repaired.setdefault((was, r), []).append(i)
            for key, err in bad.items():
                damage.setdefault(key, []).append((copy, err))
            for (was, r), ids in sorted(repaired.items(), key=lambda kv: (kv[0][1], kv[0][0].uri)):
                first = next(err for c, err in damage[(r, min(ids))] if c is was)
                note = (f"step {step}, rank {r}: chunk(s) {', '.join(map(str, sorted(ids)))} damaged in "
                        f"{was.where()} ({first}); read from {copy.where()} instead")
                self.notes.append(note)
                warnings.warn(note, DamagedCopyWarning, stacklevel=4)
        if todo:
            r, i = min(todo)
            errs = damage.get((r, i))
            if not errs:
                lacking = sorted({rk for rk, ck in todo if not damage.get((rk, ck))})
                holders = ", ".join(c.uri for c in self.copies)
                raise SourceError(
                    f"the shard(s) of rank(s) {', '.join(map(str, lacking))} at step {step} are in none of "
                    f"the opened copies ({holders}; node {self.manifest.nodes().get(lacking[0], '?')} holds "
                    f"rank {lacking[0]}): open that node's store or the durable tier too, "
                    "aegis.open(uri, other_uri)")
            if len(errs) == 1:
                raise errs[0][1]
            raise CorruptShardError(
                f"no intact copy of step {step}, rank {r}, chunk {i}: "
                + "; ".join(f"{c.where()}: {e}" for c, e in errs), step=step, rank=r, chunk=i,
                where=", ".join(c.uri for c, _ in errs))
        return got

    # -- reading tensors -------------------------------------------------------------------------

    def _load_batches(self, names: list[str], *, max_bytes: int, progress: Any,
                      targets: Mapping[str, torch.Tensor] | None = None,
                      cache: _ChunkCache | None = None) -> Iterator[dict[str, torch.Tensor]]:
        """Full tensors of ``names``, one batch at a time (into ``targets`` when given)."""
        threads, chunk_bytes = self._plan(max_bytes)
        for group in self._batches(names, chunk_bytes):
            sd: dict[str, Any] = {}
            for n in group:
                if targets is not None:
                    sd[n] = targets[n]
                else:
                    raw = self.copies[0].entries[n]
                    assert isinstance(raw, TensorEntry)
                    sd[n] = torch.empty(raw.size, dtype=dtype_from_name(raw.dtype))
            self._dcp_load(sd, group, progress=progress, threads=threads, cache=cache)
            yield sd

    def _dcp_load(self, sd: dict[str, Any], group: list[str], *, progress: Any, threads: int = 8,
                  unpickle: bool = False, weights_only: bool = True,
                  cache: _ChunkCache | None = None) -> dict[str, bytes]:
        primary = self.copies[0]
        on_tensor = progress
        if isinstance(primary, DcpCopy):
            with primary.reader() as reader:
                return dcp_load(sd, reader, step=self.step, unpickle=unpickle, weights_only=weights_only,
                                on_tensor=on_tensor)
        assert self.manifest is not None
        unknown = [s.rank for s in self.manifest.shards if not s.chunks and not s.items]
        if unknown:  # a format-4 step missing the indexes (so the items) of these ranks' shards
            raise SourceError(
                f"the shard(s) of rank(s) {', '.join(map(str, unknown))} at step {self.step} are in "
                f"none of the opened copies ({', '.join(c.uri for c in self.copies)}; node "
                f"{self.manifest.nodes().get(unknown[0], '?')} holds rank {unknown[0]}): open that "
                "node's store or the durable tier too, aegis.open(uri, other_uri)")
        chunks = self._fetch(needed_chunks(self.manifest, group), progress, threads, cache=cache)
        try:
            return dcp_load(sd, ChunkReader(self.manifest, chunks), step=self.step, unpickle=unpickle,
                            weights_only=weights_only, on_tensor=on_tensor)
        finally:
            chunks.clear()

    def tensors(self, keys: str | Sequence[str] | None = None, *, prefix: str | None = None,
                dtype: torch.dtype | None = None, device: str | torch.device = "cpu",
                max_bytes: int = DEFAULT_MAX_BYTES, progress: ProgressArg = None
                ) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, full tensor)`` pairs, read a batch at a time: the read holds at most
        ``max_bytes`` of chunks (half of it for the batch's tensors in their stored dtype when
        ``dtype``/``device`` convert them) plus the tensors of the current batch. Names are
        as stored, less ``prefix`` when given.

        Args:
            keys: entry names, or prefixes ending at a dot (None: every tensor).
            prefix: only entries under it, yielded without it.
            dtype: convert each tensor to it (None: as stored).
            device: where the tensors go.
            max_bytes: the most chunk bytes held at once.
            progress: a progress callback or bar (None: a bar on a terminal's stderr, else none).
        """
        names = self._select(keys, prefix, "tensor")
        convert = dtype is not None or torch.device(device).type != "cpu"
        budget = max(1, max_bytes // 2) if convert else max_bytes
        total = self.bytes_to_read(names) + sum(self.entry_bytes(n) for n in names)
        with progress_bar(progress, f"reading step {self.step}", total) as bar:
            for sd in self._load_batches(names, max_bytes=budget, progress=bar.advance):
                for n in list(sd):
                    t = sd.pop(n)
                    if convert:
                        t = t.to(device=device, dtype=dtype or t.dtype)
                    yield (n[len(prefix):] if prefix else n), t

    def load(self, keys: str | Sequence[str] | None = None, *, prefix: str | None = None,
             dtype: torch.dtype | None = None, device: str | torch.device = "cpu",
             max_bytes: int = DEFAULT_MAX_BYTES, progress: ProgressArg = None) -> dict[str, torch.Tensor]:
        """Full (unsharded) tensors as a flat state dict, in the snapshot's order.

        ``keys``: entry names, or prefixes ending at a dot (None: every tensor); ``prefix``:
        only entries under it, returned without it (``prefix="app.model.model."`` gives what
        ``model.load_state_dict`` takes). Read a batch at a time, holding at most ``max_bytes``
        of chunks besides the result; ``dtype``/``device`` convert each batch as it is read.

        Args:
            keys: entry names, or prefixes ending at a dot (None: every tensor).
            prefix: only entries under it, returned without it.
            dtype: convert each tensor to it (None: as stored).
            device: where the tensors go.
            max_bytes: the most chunk bytes held at once besides the result.
            progress: a progress callback or bar (None: a bar on a terminal's stderr, else none).
        """
        out = dict(self.tensors(keys, prefix=prefix, dtype=dtype, device=device, max_bytes=max_bytes,
                                progress=progress))
        names = self._select(keys, prefix, "tensor")
        order = [n[len(prefix):] if prefix else n for n in names]
        return {n: out[n] for n in order}

    def tensor(self, name: str, *, dtype: torch.dtype | None = None, device: str | torch.device = "cpu",
               progress: ProgressArg = None) -> torch.Tensor:
        """One full tensor, reading only the chunks that hold it.

        Args:
            name: the entry's flat name.
            dtype: convert it to this dtype (None: as stored).
            device: where it goes.
            progress: a progress callback or bar (None: a bar on a terminal's stderr, else none).
        """
        return self._tensor(name, dtype=dtype, device=device, progress=progress)

    def _tensor(self, name: str, *, dtype: torch.dtype | None = None, device: str | torch.device = "cpu",
                progress: ProgressArg = None, cache: _ChunkCache | None = None) -> torch.Tensor:
        if name not in self.entries or self.entries[name].kind != "tensor":
            self._select([name], None, "tensor")  # KeyError with near misses
            raise KeyError(f"{name!r} is not a tensor entry of step {self.step} of {self.uri} "
                           "(read objects with objects())")
        total = self.bytes_to_read([name]) + self.entry_bytes(name)
        with progress_bar(progress, f"reading {name}", total) as bar:
            [sd] = list(self._load_batches([name], max_bytes=1 << 62, progress=bar.advance, cache=cache))
        t = sd[name]
        return t.to(device=device, dtype=dtype or t.dtype) if dtype is not None or device != "cpu" else t

    def lazy(self, *, prefix: str | None = None, cache_bytes: int = 64 << 20) -> LazyTensors:
        """A read-only mapping of name -> tensor that reads each tensor when it is looked up
        (``safe_open``-like: ``keys()``, ``get_tensor(name)``, ``m[name]``). The verified chunks
        it read last (up to ``cache_bytes``) are kept: small tensors share chunks.

        Args:
            prefix: only entries under it, named without it.
            cache_bytes: verified chunk bytes kept for later lookups.
        """
        return LazyTensors(self, prefix, cache_bytes=cache_bytes)

    def load_into(self, target: nn.Module | MutableMapping[str, torch.Tensor], *, prefix: str | None = None,
                  strict: bool = True, max_bytes: int = DEFAULT_MAX_BYTES,
                  progress: ProgressArg = None) -> LoadResult:
        """Copy the snapshot's tensors into a plain (non-FSDP) module's parameters and buffers,
        or into the tensors of a state dict, in place and a batch at a time (at most
        ``max_bytes`` of chunks on top of the target).

        The target's keys are found under ``prefix`` (None: the one prefix under which the most
        target keys exist, e.g. ``app.model.model.`` for a ``ModelOptimizerState`` entry named
        ``model``). ``strict``: StateMismatchError when the target has keys the snapshot lacks or
        the snapshot has tensors under the prefix the target lacks; shapes must always match
        (dtypes are converted, as ``load_state_dict`` does).

        Args:
            target: a plain ``nn.Module`` or a mapping of name -> tensor, written in place.
            prefix: where the target's keys are in the snapshot (None: found as above).
            strict: refuse missing or unexpected keys (StateMismatchError).
            max_bytes: the most chunk bytes held at once on top of the target.
            progress: a progress callback or bar (None: a bar on a terminal's stderr, else none).
        """
        module = target if isinstance(target, nn.Module) else None
        sd: MutableMapping[str, Any] = module.state_dict(keep_vars=False) if module is not None else target  # type: ignore[assignment]
        tensors: dict[str, torch.Tensor] = {}
        for k, v in sd.items():
            if not isinstance(v, torch.Tensor):
                if strict:
                    raise StateMismatchError(f"load_into loads tensors; {k!r} holds a {type(v).__name__} "
                                             "(read it with objects() and set it yourself, or strict=False)")
                continue
            _check_plain(k, v)
            tensors[k] = v
        if prefix is None:
            prefix = self._find_prefix(list(tensors))
        names = {k: prefix + k for k in tensors}
        present = {k: n for k, n in names.items() if n in self.entries and self.entries[n].kind == "tensor"}
        missing = [k for k in tensors if k not in present]
        wanted = set(present.values())
        unexpected = [n[len(prefix):] for n in self.keys() if n.startswith(prefix) and n not in wanted]
        if strict and (missing or unexpected):
            raise StateMismatchError(
                f"step {self.step} of {self.uri} under {prefix!r} does not match the target: "
                + "; ".join(part for part in (
                    f"missing from the snapshot: {_some(missing)}" if missing else "",
                    f"not in the target: {_some(unexpected)}" if unexpected else "") if part)
                + " (pass strict=False to load what matches, or prefix=)")
        wrong = [f"{k}: snapshot {self.entries[n].shape}, target {tuple(tensors[k].shape)}"
                 for k, n in present.items() if tuple(tensors[k].shape) != self.entries[n].shape]
        if wrong:
            raise StateMismatchError(f"shapes differ between step {self.step} of {self.uri} and the target: "
                                     + _some(wrong))
        targets = {n: tensors[k] for k, n in present.items()}
        order = list(targets)
        total = self.bytes_to_read(order) + sum(self.entry_bytes(n) for n in order)
        with torch.no_grad(), progress_bar(progress, f"loading step {self.step}", total) as bar:
            for _ in self._load_batches(order, max_bytes=max_bytes, progress=bar.advance, targets=targets):
                pass
            if module is not None:  # in place already; this runs the module's own load hooks
                module.load_state_dict({k: tensors[k] for k in present}, strict=False)
        return LoadResult(prefix, list(present), missing, unexpected)

    def _find_prefix(self, keys: list[str]) -> str:
        """The prefix under which the most of ``keys`` are tensor entries (exactly one best)."""
        by_suffix: dict[str, list[str]] = {}
        for n in self.keys():
            by_suffix.setdefault(n, []).append("")
            for i, ch in enumerate(n):
                if ch == ".":
                    by_suffix.setdefault(n[i + 1:], []).append(n[:i + 1])
        counts: dict[str, int] = {}
        for k in keys:
            for p in by_suffix.get(k, []):
                counts[p] = counts.get(p, 0) + 1
        if not counts:
            sample = ", ".join(repr(k) for k in keys[:2])
            raise StateMismatchError(
                f"none of the target's keys ({sample}, ...) is a tensor of step {self.step} of {self.uri} "
                f"under any prefix; its tensors look like {', '.join(repr(n) for n in self.keys()[:2])}")
        best = max(counts.values())
        tops = sorted(p for p, c in counts.items() if c == best)
        if len(tops) > 1:
            raise StateMismatchError(f"the target's keys are under several prefixes of step {self.step} "
                                     f"({', '.join(map(repr, tops))}); choose one with prefix=")
        return tops[0]

    # -- objects and per-entry state -------------------------------------------------------------

    def objects(self, keys: str | Sequence[str] | None = None, *, prefix: str | None = None,
                unpickle: bool = False, weights_only: bool = True,
                progress: ProgressArg = None) -> dict[str, Any]:
        """The non-tensor entries: their serialized bytes (``torch.save`` format) as stored; with
        ``unpickle``, ``torch.load(weights_only=weights_only)`` of them. ``weights_only=False``
        runs code from the snapshot (the command's --unsafe-load-objects): only for snapshots
        you trust.

        Args:
            keys: entry names, or prefixes ending at a dot (None: every object).
            prefix: only entries under it, returned without it.
            unpickle: give the loaded objects instead of their bytes.
            weights_only: ``torch.load``'s ``weights_only`` when unpickling.
            progress: a progress callback or bar (None: a bar on a terminal's stderr, else none).
        """
        names = self._select(keys, prefix, "object")
        if not names:
            return {}
        sd: dict[str, Any] = dict.fromkeys(names, 0)  # a non-tensor leaf: DCP plans a bytes read
        with progress_bar(progress, f"reading objects of step {self.step}", self.bytes_to_read(names)) as bar:
            raw = self._dcp_load(sd, names, progress=bar.advance, unpickle=unpickle, weights_only=weights_only)
        out = {n: (sd[n] if unpickle else raw[n]) for n in names}
        return {(n[len(prefix):] if prefix else n): v for n, v in out.items()}

    def state(self, name: str, *, rank: int | None = None, unpickle: bool = False, weights_only: bool = True,
              max_bytes: int = DEFAULT_MAX_BYTES) -> dict[Any, Any]:
        """One entry of the Manager's state as the nested dict it saved: full tensors, and the
        non-tensor values as bytes (or unpickled: see :meth:`objects`). A per-rank entry (and
        ``rng``) gives ``{rank: state}``, or one rank's state with ``rank``.

        Args:
            name: the Manager state entry (``model``, ``sched``, ``rng``, ...).
            rank: one rank's copy of a per-rank entry (None: every rank's).
            unpickle: give the non-tensor values loaded instead of as bytes.
            weights_only: ``torch.load``'s ``weights_only`` when unpickling.
            max_bytes: the most chunk bytes held at once.
        """
        from torch.distributed.checkpoint._nested_dict import unflatten_state_dict

        per_rank = name == "rng" or self.state_kinds.get(name) == "per_rank" or any(
            e.state == name and e.rank is not None for e in self.entries.values())
        if per_rank:
            ranks = sorted({e.rank for e in self.entries.values() if e.state == name and e.rank is not None})
            if rank is not None and rank not in ranks:
                raise KeyError(f"no rank {rank} in the per-rank entry {name!r} (ranks: {ranks})")
            bases = {r: ("rng", f"rank{r:05d}") if name == "rng" else ("per_rank", f"rank{r:05d}", name)
                     for r in ([rank] if rank is not None else ranks)}
        else:
            bases = {-1: ("app", name)}
        out: dict[Any, Any] = {}
        for r, base in bases.items():
            dotted = ".".join(base)
            names = [n for n in self.entries if n == dotted or n.startswith(dotted + ".")]
            if not names:
                known = sorted({e.state for e in self.entries.values() if e.state})
                raise KeyError(f"no state entry {name!r} in step {self.step} of {self.uri} (entries: "
                               f"{', '.join(known)})")
            flat: dict[str, Any] = {}
            tensors = [n for n in names if self.entries[n].kind == "tensor"]
            if tensors:
                flat.update(self.load(tensors, max_bytes=max_bytes, progress=False))
            objs = [n for n in names if self.entries[n].kind == "object"]
            if objs:
                flat.update(self.objects(objs, unpickle=unpickle, weights_only=weights_only, progress=False))
            mapping = {k: tuple(self.planner_data.get(k, tuple(k.split(".")))) for k in flat}
            nested: Any = unflatten_state_dict(flat, mapping)  # type: ignore[arg-type]
            for part in base:
                nested = nested[part]
            out[r] = nested
        return out if per_rank and rank is None else out[next(iter(out))]

    # -- checks and exports ----------------------------------------------------------------------

    def verify(self, *, progress: ProgressArg = None) -> VerifyReport:
        """Check every chunk of the first copy (what ``aegis verify`` checks); damage there that
        another opened copy holds intact is covered (``notes``), so ``ok`` says whether the whole
        snapshot can be read.

        Args:
            progress: a progress callback or bar (None: a bar on a terminal's stderr, else none).
        """
        primary = self.copies[0]
        loc = primary.location
        with progress_bar(progress, f"verifying step {self.step}", loc.verify_bytes(self.step)) as bar:
            res = loc.verify(self.step, bar.advance)
        notes: list[str] = []
        uncovered = 0
        for f in res.failures:
            others = self.copies[1:]
            if f.rank is None or self.manifest is None or not others:
                uncovered += 1
                continue
            ids = [f.chunk] if f.chunk is not None else list(range(len(self.manifest.shard(f.rank).chunks)))
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", DamagedCopyWarning)
                    self._fetch({f.rank: ids}, copies=others)
            except AegisError as e:
                uncovered += 1
                notes.append(f"rank {f.rank}" + (f", chunk {f.chunk}" if f.chunk is not None else "")
                             + f": no other copy has it intact ({e})")
            else:
                notes.append(f"rank {f.rank}" + (f", chunk {f.chunk}" if f.chunk is not None else "")
                             + f": damaged in {primary.tier} {primary.uri}, intact in "
                             + ", ".join(f"{c.tier} {c.uri}" for c in others))
        return VerifyReport(self.step, uncovered == 0, not isinstance(primary, DcpCopy), res.chunks, res.bytes,
                            res.failures, notes)

    @contextlib.contextmanager
    def local_files(self, *, progress: ProgressArg = None, max_bytes: int = DEFAULT_MAX_BYTES
                    ) -> Iterator[dict[int, Path]]:
        """Local files laid out like the shards, holding every verified chunk, per shard rank:
        a node store's own shard files when every chunk checks out there (checked again
        afterwards: a running job may reuse them), else sparse temporary files (``$TMPDIR``)
        filled from the copies, ``max_bytes`` at a time.

        Args:
            progress: a progress callback or bar (None: a bar on a terminal's stderr, else none).
            max_bytes: the most chunk bytes fetched at a time.
        """
        m = self.manifest
        if m is None:
            raise SourceError(f"{self.uri} is a plain DCP checkpoint: it has no aegis shards")
        tell = progress if callable(progress) else (lambda n: None)
        primary = self.copies[0]
        in_place: list[int] = []
        threads, chunk_budget = self._plan(max_bytes)
        with tempfile.TemporaryDirectory(prefix="aegis-read-") as tmp:
            paths: dict[int, Path] = {}
            for shard in m.shards:
                rank = shard.rank
                if isinstance(primary, NodeStoreCopy) and primary.has_shard(rank):
                    try:
                        primary.store.verify_shard(m.step, shard)
                    except CorruptShardError:
                        pass  # filled chunk by chunk below: damage read around and named
                    else:
                        paths[rank] = primary.shard_path(rank)
                        in_place.append(rank)
                        tell(shard.data_bytes)
                        continue
                path = Path(tmp) / f"rank-{rank:05d}.shard"
                with builtins.open(path, "wb") as f:
                    f.truncate(max(shard.size, 1))
                ids = list(range(len(shard.chunks)))
                step_ids = max(1, chunk_budget // max(1, max((c.length for c in shard.chunks), default=1)))
                with builtins.open(path, "r+b") as f:
                    for at in range(0, len(ids), step_ids):
                        part = ids[at:at + step_ids]
                        got = self._fetch({rank: part}, tell, threads).get(rank, {})
                        for i in part:
                            f.seek(shard.chunks[i].offset)
                            f.write(got[i])
                        got.clear()
                paths[rank] = path
            yield paths
        for rank in in_place:  # a running job reuses the files of evicted steps
            assert isinstance(primary, NodeStoreCopy)
            try:
                primary.store.verify_shard(m.step, m.shard(rank))
            except CorruptShardError as e:
                raise CorruptShardError(
                    f"step {m.step} changed while it was read (evicted by a running job?): {e}; read it "
                    "again, or read its durable copy", step=m.step, rank=rank) from e

    def export(self, out: str | os.PathLike[str], format: str, *, flat: bool = False,  # noqa: A002
               unpickle: bool = False, progress: ProgressArg = None) -> dict[str, Any]:
        """Write the snapshot for tools that have never heard of aegis: ``format="dcp"`` (a
        plain DCP checkpoint directory, sharding kept, non-tensor items copied as bytes),
        ``"torch"`` (one ``torch.save`` file of full tensors, nested like the training state or
        ``flat``; non-tensor entries only with ``unpickle``, which unpickles them with
        weights_only=False) or ``"safetensors"`` (tensors only). Returns counts.

        Args:
            out: the directory (``dcp``) or file (``torch``, ``safetensors``) to write.
            format: ``"dcp"``, ``"torch"`` or ``"safetensors"``.
            flat: ``torch`` only: one flat dict instead of the nested training state.
            unpickle: ``torch`` only: include the non-tensor entries, unpickled (trusted snapshots only).
            progress: a progress callback or bar (None: a bar on a terminal's stderr, else none).
        """
        from aegis.read import export as _export

        if format not in ("dcp", "torch", "safetensors"):
            raise ValueError(f"format={format!r}: use 'dcp', 'torch' or 'safetensors'")
        path = Path(out)
        total = (self.bytes_to_read() if format == "dcp"
                 else self.bytes_to_read() + sum(self.entry_bytes(n) for n in self.keys()))
        with progress_bar(progress, f"exporting step {self.step}", total) as bar:
            if format == "dcp":
                return _export.export_dcp(self, path, progress=bar.advance)
            if format == "torch":
                return _export.export_torch(self, path, flat=flat, unpickle=unpickle, progress=bar.advance)
            return _export.export_safetensors(self, path, progress=bar.advance)

    def __repr__(self) -> str:
        n_t = len(self.keys())
        return (f"<aegis.Snapshot job={self.job!r} step={self.step} {self.tier} {self.uri} "
                f"({n_t} tensors, {len(self.entries) - n_t} objects, {len(self.copies)} cop"
                f"{'y' if len(self.copies) == 1 else 'ies'})>")


def _some(items: list[str], n: int = 5) -> str:
    return ", ".join(items[:n]) + (f" and {len(items) - n} more" if len(items) > n else "")


def _check_plain(key: str, t: torch.Tensor) -> None:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        raise StateMismatchError(
            f"load_into takes a plain (non-FSDP) model or state dict: {key!r} is a DTensor. Inside a "
            "job, Manager.restore() loads sharded state; here, load into an unsharded copy of the model")
    if t.device.type == "meta":
        raise StateMismatchError(f"{key!r} is on the meta device: allocate the model first "
                                 "(module.to_empty(device='cpu'))")
