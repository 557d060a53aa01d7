"""A job's snapshots in one or more places (:class:`Source`, :func:`open`): the steps each
tier holds, and the step a reader asks for, checked to be the same data in every copy
(:mod:`.api` is the entry point and re-exports these names).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import warnings
from collections.abc import Sequence
from typing import Any

from aegis.errors import (
    IncompatibleSnapshotError,
    ManifestError,
    NoSnapshotError,
)
from aegis.read.errors import DamagedCopyWarning, SourceError
from aegis.read.locations import (
    TIER_DCP,
    AegisCopy,
    Copy,
    DurableLocation,
    Location,
    NodeStoreLocation,
    StepRow,
    pick,
    resolve,
)
from aegis.read.snapshot import (
    Snapshot,
)
from aegis.snapshot.manifest import Manifest

__all__ = ["open", "Source"]


def open(*uris: str | os.PathLike[str], job: str | None = None,  # noqa: A001 - aegis.open
         unsafe_load_objects: bool = False) -> Source:
    """The snapshots of one job at ``uris``: node store directories (``/dev/shm/aegis`` or
    ``/dev/shm/aegis/<job>``), durable roots (``file:///path``, ``s3://bucket/prefix``, or one
    job's prefix), or a plain DCP checkpoint directory (or a directory of them).

    Several URIs must hold the same job; each step is then read from every place that holds it
    (memory before durable, then in the order given).

    Args:
        uris: the places, one job's.
        job: the job, when a root holds several.
        unsafe_load_objects: unpickle a plain DCP checkpoint's ``.metadata`` with plain pickle
            instead of the allow-list of DCP's classes (only for checkpoints you trust).

    Returns:
        A :class:`Source` (close it, or use it as a context manager).

    Raises:
        SourceError: a URI of the wrong kind, or URIs of different jobs, in one line.
    """
    if not uris:
        raise SourceError("aegis.open: give at least one URI (a node store directory, file:///path, "
                          "s3://bucket/prefix or a DCP checkpoint directory)")
    locations: list[Location] = []
    try:
        for uri in uris:
            text = os.fspath(uri)
            locations.append(pick(resolve(text, unsafe=unsafe_load_objects), job, text))
        return Source(locations)
    except BaseException:
        for loc in locations:
            loc.close()
        raise


def _same_data(a: Manifest, b: Manifest) -> str | None:
    """Why two manifests do not describe the same bytes (None: they do). A node store's and the
    durable tier's manifest of one step differ only in stored sizes, codecs and replicas."""
    if (a.job, a.step, a.world_size) != (b.job, b.step, b.world_size):
        return f"job/step/world size {a.job}/{a.step}/{a.world_size} vs {b.job}/{b.step}/{b.world_size}"
    if dict(a.entries) != dict(b.entries):
        return "the entries differ"
    for sa, sb in zip(sorted(a.shards, key=lambda s: s.rank), sorted(b.shards, key=lambda s: s.rank), strict=True):
        if sa.rank != sb.rank or sa.items != sb.items or [
                (c.offset, c.length, c.crc32c, c.dtype) for c in sa.chunks] != [
                (c.offset, c.length, c.crc32c, c.dtype) for c in sb.chunks]:
            return f"the shard of rank {sa.rank} differs"
    return None


class Source:
    """One job's snapshots in one or more places. Made by :func:`aegis.open`.

    ``steps`` are the committed steps anywhere, ascending; ``steps_by_tier`` the same per tier
    (``memory``, ``durable``, ``dcp``); ``locations`` the places themselves. Close it (or use it
    as a context manager) to release S3 clients.

    Args:
        locations: the places, one job's (what :func:`aegis.open` resolved the URIs to).
    """

    def __init__(self, locations: Sequence[Location]) -> None:
        if not locations:
            raise SourceError("a Source needs at least one location")
        jobs = {loc.job for loc in locations}
        if len(jobs) > 1:
            raise SourceError("the URIs hold different jobs (" + ", ".join(
                f"{loc.uri}: {loc.job or 'plain DCP'}" for loc in locations) + "); open one job at a time")
        if len(locations) > 1 and any(loc.tier == TIER_DCP for loc in locations):
            raise SourceError("a plain DCP checkpoint cannot be opened together with other URIs "
                              "(it has no job to match them by); open it alone")
        order = {"memory": 0, "durable": 1, "dcp": 2}
        self.locations: tuple[Location, ...] = tuple(sorted(locations, key=lambda loc: order.get(loc.tier, 9)))
        self.job: str | None = self.locations[0].job

    # -- what is there ---------------------------------------------------------------------------

    @property
    def uri(self) -> str:
        return ", ".join(loc.uri for loc in self.locations)

    @property
    def tier(self) -> str:
        """The tier of the first location (memory before durable)."""
        return self.locations[0].tier

    @property
    def steps(self) -> list[int]:
        return sorted({s for loc in self.locations for s in loc.committed()})

    @property
    def steps_by_tier(self) -> dict[str, list[int]]:
        out: dict[str, set[int]] = {}
        for loc in self.locations:
            out.setdefault(loc.tier, set()).update(loc.committed())
        return {tier: sorted(steps) for tier, steps in out.items()}

    def rows(self) -> list[StepRow]:
        """Every step in every location (committed or not), newest first."""
        rows = [r for loc in self.locations for r in loc.rows()]
        return sorted(rows, key=lambda r: -(r.step if r.step is not None else -1))

    # -- one step --------------------------------------------------------------------------------

    def step(self, step: int) -> Snapshot:
        """Step ``step``, read from every location that has it committed. NoSnapshotError names
        the committed steps when it is in none; ManifestError when no copy's manifest reads.

        Args:
            step: the committed step.
        """
        return self._open(step)

    def latest(self, *, skip_damaged: bool = True) -> Snapshot:
        """The newest committed step. With ``skip_damaged`` (the default, as restore does), a
        step whose manifest reads in no location, or whose shards are not all in the opened
        locations, is passed over for the next older one (named in ``notes``); without it, the
        newest committed step or its error.

        Args:
            skip_damaged: pass over a step that cannot be read whole, as restore does.
        """
        if any(loc.tier == TIER_DCP for loc in self.locations):
            return Snapshot(self, [self.locations[0].open(None)], [])
        steps = self.steps
        if not steps:
            raise NoSnapshotError(f"{self.uri}: no committed step")
        if not skip_damaged:
            return self._open(steps[-1])
        skipped: list[str] = []
        for step in reversed(steps):
            try:
                snap = self._open(step)
            except IncompatibleSnapshotError:
                raise
            except ManifestError as e:
                skipped.append(f"step {step} passed over: {e}")
                continue
            lacking = snap.missing_shards()
            if lacking:
                skipped.append(f"step {step} passed over: the shards of rank(s) "
                               f"{', '.join(map(str, lacking))} are in none of {self.uri}")
                continue
            snap.notes[:0] = skipped
            for note in skipped:
                warnings.warn(note, DamagedCopyWarning, stacklevel=2)
            return snap
        raise NoSnapshotError(f"no committed step of {self.uri} can be read: " + "; ".join(skipped))

    def _open(self, step: int) -> Snapshot:
        holders = [loc for loc in self.locations if step in loc.committed()]
        if not holders:
            if len(self.locations) == 1:
                return Snapshot(self, [self.locations[0].open(step)], [])  # its own message
            steps = self.steps
            shown = ", ".join(str(s) for s in steps[-10:]) or "none"
            raise NoSnapshotError(f"step {step} is not committed in any of {self.uri} (committed: "
                                  f"{'... ' if len(steps) > 10 else ''}{shown})")
        copies: list[Copy] = []
        notes: list[str] = []
        errors: list[ManifestError] = []
        _pool_records(self.locations, step)
        for loc in holders:
            try:
                copy = loc.open(step)
            except IncompatibleSnapshotError:
                raise
            except ManifestError as e:
                errors.append(e)
                notes.append(f"step {step}: the manifest in {loc.tier} {loc.uri} is unreadable ({e})")
                continue
            if copies and isinstance(copy, AegisCopy) and isinstance(copies[0], AegisCopy):
                why = _same_data(copies[0].manifest, copy.manifest)
                if why is not None:
                    notes.append(f"step {step} in {loc.tier} {loc.uri} is another snapshot than in "
                                 f"{copies[0].tier} {copies[0].uri} ({why}); not used")
                    continue
            copies.append(copy)
        if not copies:
            raise errors[0]
        if errors:
            notes.append(f"step {step}: read from {copies[0].tier} {copies[0].uri}")
        for note in notes:
            warnings.warn(note, DamagedCopyWarning, stacklevel=3)
        return Snapshot(self, copies, notes)

    # -- lifetime --------------------------------------------------------------------------------

    def close(self) -> None:
        """Release the locations' clients (S3 connections)."""
        for loc in self.locations:
            loc.close()

    def __enter__(self) -> Source:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        tiers = ", ".join(f"{t}: {len(s)} steps" for t, s in self.steps_by_tier.items())
        return f"<aegis.Source job={self.job!r} {self.uri} ({tiers})>"


def _pool_records(locations: Sequence[Any], step: int) -> None:
    """A format-4 step in node stores is put together from its shards' own indexes, which a
    multi-node job spreads over its nodes: every opened node store gets the records the others
    (and the durable tier's whole manifest, whose records carry the same sizes and index
    crc32c) hold, so that each can put the step together whole."""
    stores = [loc for loc in locations if isinstance(loc, NodeStoreLocation)]
    if not stores:
        return
    pool: dict[int, Any] = {}
    for loc in stores:
        for r, rec in loc.records(step).items():
            pool.setdefault(r, rec)
    for loc in locations:
        if isinstance(loc, DurableLocation) and step in loc.committed():
            with contextlib.suppress(Exception):
                for rec in loc.manifest(step).shards:
                    pool.setdefault(rec.rank, dataclasses.replace(rec, chunks=tuple(
                        dataclasses.replace(c, codec="raw", stored_length=None, stored_crc32c=None)
                        for c in rec.chunks)))
    for loc in stores:
        loc.pool[step] = pool
