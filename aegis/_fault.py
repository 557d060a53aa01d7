"""Fault injection for tests: die (SIGKILL) at a named phase of a given rank and step.

Set ``AEGIS_FAIL_AT="<rank>:<step>:<phase>"`` (several separated by ``,``) in the environment of
the training processes. Phases: ``stage`` (halfway through the blocking copy), ``complete``
(after the checksums, before the shard's index is written), ``commit`` (on the node leader,
right before the manifest is written). A no-op when the variable is unset.
"""

from __future__ import annotations

import os
import signal

__all__ = ["PHASES", "fail_at", "hit"]

PHASES = ("stage", "complete", "replicate", "commit", "restore")


def _parse(spec: str) -> set[tuple[int, int, str]]:
    out = set()
    for part in filter(None, (p.strip() for p in spec.split(","))):
        rank, step, phase = part.split(":")
        if phase not in PHASES:
            raise ValueError(f"AEGIS_FAIL_AT: unknown phase {phase!r}; use one of {PHASES}")
        out.add((int(rank), int(step), phase))
    return out


_SPEC = _parse(os.environ.get("AEGIS_FAIL_AT", ""))


def fail_at(rank: int, step: int, phase: str) -> str:
    """The environment value that makes ``rank`` die at ``phase`` of ``step``."""
    if phase not in PHASES:
        raise ValueError(phase)
    return f"{rank}:{step}:{phase}"


def hit(phase: str, step: int, rank: int) -> None:
    if _SPEC and (rank, step, phase) in _SPEC:
        os.kill(os.getpid(), signal.SIGKILL)
