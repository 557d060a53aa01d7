"""Shared pieces of the ``aegis`` command: errors with exit codes, formatting, progress bars
(:class:`~aegis.read.progress.Bar`, from the reading layer)."""

from __future__ import annotations

import json
import math
import os
from typing import TYPE_CHECKING, Any

import click
from rich.console import Console

from aegis.read.progress import Bar  # the reading layer's bars (rich only, no torch)

if TYPE_CHECKING:
    from aegis.read.api import Snapshot
    from aegis.read.locations import Location

__all__ = [
    "EXIT_OK",
    "EXIT_FAILED",
    "EXIT_USAGE",
    "EXIT_INTERNAL",
    "CliError",
    "FailedError",
    "Bar",
    "stdout_console",
    "show",
    "stderr_console",
    "fmt_bytes",
    "fmt_age",
    "fmt_shape",
    "json_number",
    "emit_json",
    "open_one",
    "snapshot_of",
    "snap_ref",
    "json_option",
    "job_option",
    "unsafe_option",
]

EXIT_OK = 0
EXIT_FAILED = 1  # verification failed, corrupt bytes, or (diff) the snapshots differ
EXIT_USAGE = 2  # bad URI, missing step, unreadable manifest, bad option
EXIT_INTERNAL = 3  # a bug in aegis: please report it


class CliError(click.ClickException):
    """A one-line error for bad input (exit code 2): ``aegis: error: <message>``."""

    exit_code = EXIT_USAGE

    def show(self, file: Any = None) -> None:
        click.echo(f"aegis: error: {self.format_message()}", err=True)


class FailedError(CliError):
    """Data that does not verify (exit code 1)."""

    exit_code = EXIT_FAILED


def _width() -> int | None:
    # Rich falls back to 80 columns when stdout is not a terminal; tables of long tensor names
    # are easier to read (and grep) wider.
    env = os.environ.get("COLUMNS")
    if env and env.isdigit():
        return int(env)
    return None


def stdout_console() -> Console:
    c = Console(highlight=False, markup=False, soft_wrap=False, width=_width())
    if not c.is_terminal and _width() is None:
        c.width = 160
    return c


def show(console: Console, renderable: Any) -> None:
    """Print a table; off a terminal without the trailing blanks rich pads rows with."""
    if console.is_terminal:
        console.print(renderable)
        return
    with console.capture() as cap:
        console.print(renderable)
    text = "\n".join(line.rstrip() for line in cap.get().splitlines())
    console.file.write(text + "\n")
    console.file.flush()


def stderr_console() -> Console:
    return Console(stderr=True, highlight=False, markup=False)


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError


def fmt_age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h {s % 3600 // 60:02d}m"
    return f"{s // 86400}d {s % 86400 // 3600:02d}h"


def fmt_shape(shape: tuple[int, ...] | list[int] | None) -> str:
    if shape is None:
        return "-"
    return "(" + ", ".join(str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"


def json_number(x: float | None) -> float | None:
    """JSON has no NaN or infinity: those become null."""
    if x is None or not math.isfinite(x):
        return None
    return x


def emit_json(doc: dict[str, Any]) -> None:
    """One ``--json`` document on stdout (no NaN or infinity: ``json_number`` first)."""
    click.echo(json.dumps(doc, indent=2, allow_nan=False))


def open_one(uri: str, job: str | None, *, unsafe: bool = False) -> Location:
    """The one location of ``uri`` (``--job`` picks among several jobs)."""
    from aegis.read.locations import pick, resolve  # imports torch: only commands that read

    return pick(resolve(uri, unsafe=unsafe), job, uri, how="--job")


def snapshot_of(loc: Location, step: int | None) -> Snapshot:
    """``step`` (default: the newest committed) of one location, or its one-line error."""
    from aegis.read.api import Source

    src = Source([loc])
    return src.step(step) if step is not None else src.latest(skip_damaged=False)


def snap_ref(snap: Snapshot) -> dict[str, Any]:
    return {"uri": snap.uri, "tier": snap.tier, "job": snap.job, "step": snap.step}


json_option = click.option("--json", "as_json", is_flag=True, help="One JSON document on stdout.")
job_option = click.option("--job", default=None, help="The job, when the URI holds several.")
unsafe_option = click.option(
    "--unsafe-load-objects", "unsafe", is_flag=True,
    help="Unpickle non-tensor entries (torch.load(weights_only=False)): runs code from the "
         "snapshot. Only for snapshots you trust.")
