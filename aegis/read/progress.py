"""Progress bars for long reads: rich, on stderr, only on a terminal and only when the work takes
longer than a second. Used by :mod:`aegis.read` (``progress=None``: automatic) and the ``aegis``
command. Imports rich only (``aegis plan`` imports this module without torch)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from types import TracebackType
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

__all__ = ["Bar", "ProgressArg", "progress_bar"]

# What the reading API's ``progress=`` takes: None (a bar when stderr is a terminal), False
# (none), True (a bar even off a terminal, e.g. in a notebook), or a callable told byte counts.
ProgressArg = bool | Callable[[int], None] | None


class Bar:
    """A progress bar on stderr that appears only when the work takes longer than ``delay_s`` and
    stderr is a terminal (or ``force``). ``advance`` is thread-safe. ``AEGIS_NO_PROGRESS=1``
    turns every bar off."""

    def __init__(self, description: str, total: float | None, *, unit: str = "bytes",
                 delay_s: float = 1.0, console: Console | None = None, force: bool = False) -> None:
        self.description = description
        self.total = total
        self.unit = unit
        self.delay_s = delay_s
        self.console = console or Console(stderr=True, highlight=False, markup=False)
        self.enabled = ((self.console.is_terminal or self.console.is_jupyter or force)
                        and not os.environ.get("AEGIS_NO_PROGRESS"))
        self.done = 0.0
        self._lock = threading.Lock()
        self._progress: Progress | None = None
        self._task: Any = None
        self._timer: threading.Timer | None = None

    def __enter__(self) -> Bar:
        if self.enabled:
            self._timer = threading.Timer(self.delay_s, self._start)
            self._timer.daemon = True
            self._timer.start()
        return self

    def _start(self) -> None:
        with self._lock:
            if self._progress is not None or not self.enabled:
                return
            counter = (
                [DownloadColumn(binary_units=True), TransferSpeedColumn()] if self.unit == "bytes" else [MofNCompleteColumn()]
            )
            self._progress = Progress(
                TextColumn("{task.description}"), BarColumn(), *counter, TimeRemainingColumn(),
                console=self.console, transient=True,
            )
            self._progress.start()
            self._task = self._progress.add_task(self.description, total=self.total, completed=int(self.done))

    def advance(self, n: float = 1) -> None:
        with self._lock:
            self.done += n
            if self._progress is not None:
                self._progress.update(self._task, completed=self.done)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        with self._lock:
            self.enabled = False
            if self._progress is not None:
                self._progress.stop()
                self._progress = None


class _Callback:
    """A caller's callable in Bar's clothes."""

    def __init__(self, fn: Callable[[int], None]) -> None:
        self.advance = fn

    def __enter__(self) -> _Callback:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def progress_bar(progress: ProgressArg, description: str, total: float | None) -> Bar | _Callback:
    """What a reading call reports to: the caller's callable, or a :class:`Bar` (None: on a
    terminal only; True: always; False: never)."""
    if callable(progress):
        return _Callback(progress)
    bar = Bar(description, total, force=progress is True)
    if progress is False:
        bar.enabled = False
    return bar
