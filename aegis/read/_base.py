"""What every location and copy of a step shares: the tiers, the rows and failures a listing or a
verification reports, and the :class:`Location` / :class:`Copy` interfaces each backend
implements (:mod:`.memory`, :mod:`.durable`, :mod:`.dcp`; :mod:`.locations` resolves a URI).
"""

from __future__ import annotations

import abc
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.checkpoint.metadata import (
    Metadata,
)

from aegis.errors import NoSnapshotError
from aegis.read.errors import SourceError
from aegis.snapshot.manifest import BytesEntry, Manifest, TensorEntry

__all__ = ["TIER_MEMORY", "TIER_DURABLE", "TIER_DCP", "STATE_KINDS_FILE", "DECODE_FACTOR", "Progress", "ChunkKey", "StepRow", "Failure", "VerifyResult", "Location", "Copy"]

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

# Peak bytes one durable download thread holds, per byte of chunk: the stored object (at most
# the chunk: a codec stores raw what does not shrink), the decoded chunk and the codec's
# temporaries (decode's peak measured with tracemalloc: 3.0x the chunk for float32 and bfloat16
# byte planes, since the joins work on bytes; 8-9x when they widened every plane to uint32).
DECODE_FACTOR = 5

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
