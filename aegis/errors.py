"""Errors raised by aegis.

Every error says what was wrong and what to do about it. Errors that come out of a collective
phase are raised on every rank with the same message (see :class:`CollectiveError`).
"""

from __future__ import annotations

__all__ = [
    "AegisError",
    "ConfigError",
    "ManifestError",
    "IncompatibleSnapshotError",
    "CorruptShardError",
    "StoreFullError",
    "StateMismatchError",
    "NoSnapshotError",
    "CollectiveError",
    "SnapshotTimeoutError",
    "StepOrderError",
    "PerRankStateError",
]


class AegisError(RuntimeError):
    """Base class of every error aegis raises on purpose."""


class ConfigError(AegisError, ValueError):
    """A configuration value is invalid; the message names the field and the fix."""


class ManifestError(AegisError):
    """A manifest cannot be trusted: unreadable, another job's, or from a newer format."""


class IncompatibleSnapshotError(ManifestError):
    """A manifest that is intact but not for this reader: another job's, or another format
    version. Never guessed past (unlike a damaged manifest, which recovery skips)."""


class CorruptShardError(AegisError):
    """Bytes of a shard do not match their recorded crc32c (or the shard is truncated)."""

    def __init__(self, message: str, *, step: int, rank: int, chunk: int | None = None,
                 where: str = "") -> None:
        super().__init__(message)
        self.step = step
        self.rank = rank
        self.chunk = chunk
        self.where = where


class StoreFullError(AegisError):
    """The node store has not enough free space for the snapshots it must hold."""


class StateMismatchError(AegisError):
    """The state being restored does not have the keys the snapshot has."""


class NoSnapshotError(AegisError):
    """No committed snapshot can be restored, and the caller asked for one."""


class SnapshotTimeoutError(AegisError):
    """A snapshot phase waited longer than the configured timeout (a peer stopped answering)."""


class StepOrderError(AegisError):
    """``save(step)`` was called with a step that does not follow the last one saved or
    restored, or with different steps on different ranks."""


class PerRankStateError(AegisError):
    """Per-rank state cannot be given back: the world size changed and the entry has no way to
    reshard it (see :func:`aegis.per_rank`)."""


class CollectiveError(AegisError):
    """One or more ranks failed in a collective phase; raised identically on every rank.

    ``failures`` maps rank -> that rank's error message.
    """

    def __init__(self, phase: str, failures: dict[int, str]) -> None:
        ranks = ", ".join(str(r) for r in sorted(failures))
        detail = "; ".join(f"rank {r}: {msg}" for r, msg in sorted(failures.items()))
        super().__init__(f"{phase} failed on rank(s) {ranks}: {detail}")
        self.phase = phase
        self.failures = dict(failures)
