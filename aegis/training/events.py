"""Events: one JSON line per snapshot and per restore per rank, plus a human line on rank 0."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["EventLog"]


class EventLog:
    """Appends JSON lines to ``<dir>/rank-<5 digits>.jsonl``; thread-safe (the snapshot
    background thread emits too)."""

    def __init__(self, directory: Path, *, job: str, rank: int, verbose: bool) -> None:
        self.path = directory / f"rank-{rank:05d}.jsonl"
        self.job = job
        self.rank = rank
        self.verbose = verbose and rank == 0
        self._lock = threading.Lock()
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)

    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        record = {"time": time.time(), "event": event, "job": self.job, "rank": self.rank, **fields}
        line = json.dumps(record, default=str, separators=(",", ":"))
        with self._lock, open(self.path, "a") as f:
            f.write(line + "\n")
        return record

    def say(self, message: str) -> None:
        if self.verbose:
            print(f"[aegis] {message}", file=sys.stderr, flush=True)

    def warn(self, message: str) -> None:
        """Printed on rank 0 even when not verbose: something degraded but training goes on."""
        if self.rank == 0:
            print(f"[aegis] warning: {message}", file=sys.stderr, flush=True)


def read_events(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
