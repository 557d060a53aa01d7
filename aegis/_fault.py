"""Fault injection for tests: die, or freeze, at a named phase of a given rank and step.

``AEGIS_FAIL_AT="<rank>:<step>:<phase>"`` (several separated by ``,``; step ``*`` = any) in the
environment of the training processes. Phases: ``stage`` (halfway through the blocking copy),
``complete`` (after the checksums, before the shard's index is written), ``replicate`` (before
the shard is pushed to its peers), ``encode`` (before the XOR parity segments are exchanged),
``commit`` (on a node leader, right before its manifest is
written), ``deferred`` (``staging="async"``: on the background worker, before the deferred
copies are issued), ``group`` (in-process recovery: right before a round's process groups are
created; the "step" is the round), ``restore`` (after the restore decision, before any shard is fetched or loaded), ``upload`` (on
rank 0, after every chunk of a durable step is uploaded, before its manifest is put).

``AEGIS_FAIL_MODE``: ``kill`` (default: SIGKILL this process), ``pause`` (write a marker file
into ``AEGIS_FAULT_DIR`` and block, so that a harness can kill the whole node at exactly that
moment), or ``delay:<seconds>`` (sleep that long, then go on: a slow phase, e.g. to show that
what must wait for it does). With ``AEGIS_FAULT_DIR`` set, each fault fires once per job: the marker is created
exclusively, so a restarted worker repeating the step does not fire it again.
A no-op when ``AEGIS_FAIL_AT`` is unset.
"""

from __future__ import annotations

import json
import os
import signal
import time

__all__ = ["PHASES", "fail_at", "hit"]

PHASES = ("stage", "complete", "replicate", "encode", "commit", "restore", "upload", "deferred",
          "group")


def _parse(spec: str) -> list[tuple[int, int | None, str]]:
    out = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        rank, step, phase = part.split(":")
        if phase not in PHASES:
            raise ValueError(f"AEGIS_FAIL_AT: unknown phase {phase!r}; use one of {PHASES}")
        out.append((int(rank), None if step == "*" else int(step), phase))
    return out


_cache: tuple[str, list[tuple[int, int | None, str]]] = ("", [])


def _spec() -> list[tuple[int, int | None, str]]:
    """Read lazily: a process may set the variable after importing aegis."""
    global _cache
    raw = os.environ.get("AEGIS_FAIL_AT", "")
    if raw != _cache[0]:
        _cache = (raw, _parse(raw))
    return _cache[1]


def fail_at(rank: int, step: int | None, phase: str) -> str:
    """The ``AEGIS_FAIL_AT`` value that makes ``rank`` fail at ``phase`` of ``step``."""
    if phase not in PHASES:
        raise ValueError(phase)
    return f"{rank}:{'*' if step is None else step}:{phase}"


def hit(phase: str, step: int, rank: int) -> None:
    spec = _spec()
    if not spec:
        return
    for r, s, p in spec:
        if r == rank and p == phase and s in (None, step):
            break
    else:
        return
    fault_dir = os.environ.get("AEGIS_FAULT_DIR")
    if fault_dir:
        marker = os.path.join(fault_dir, f"{r}-{'any' if s is None else s}-{p}")
        try:
            fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        except FileExistsError:
            return  # fired already in this job
        info = {"rank": rank, "step": step, "phase": phase, "pid": os.getpid(),
                "node": os.environ.get("AEGIS_NODE_ID"), "time": time.time()}
        os.write(fd, json.dumps(info).encode())
        os.close(fd)
    mode = os.environ.get("AEGIS_FAIL_MODE", "kill")
    if mode.startswith("delay:"):
        time.sleep(float(mode.split(":", 1)[1]))
        return
    if mode == "pause":
        while True:  # frozen here until the harness kills this node
            time.sleep(3600)
    os.kill(os.getpid(), signal.SIGKILL)
