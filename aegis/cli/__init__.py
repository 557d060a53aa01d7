"""The ``aegis`` command: list, inspect, verify, diff, export and prune snapshots.

A thin face over the reading layer, :mod:`aegis.read` (which Python code uses directly:
``aegis.open(uri).latest().load_into(model)``): this package parses options, draws tables and
progress bars, writes JSON and maps errors to exit codes.

URIs: a node store directory (the store root holding job directories, or one job directory),
a durable root (``file:///path`` or ``s3://bucket/prefix``, the root or one job's prefix; S3
through boto3's usual configuration and ``AWS_ENDPOINT_URL``), or a plain DCP checkpoint
directory (or a directory of them). ``--job`` chooses when a root holds several jobs.

Commands::

    aegis ls [URI ...]                           steps per tier, newest first
    aegis inspect URI [--step N] [--tensor NAME] manifest summary and entries, or one tensor's stats
    aegis verify URI [--step N | --all]          crc32c of every chunk
    aegis diff URI --step A --step B             per entry: unchanged / changed, max |a-b|, rel. norm
    aegis diff URI_A URI_B [--step A [--step B]]
    aegis export URI OUT --format dcp|torch|safetensors [--step N]
    aegis prune URI --keep-last N [--keep-every K] [--dry-run]
    aegis doctor URL                             what a durable store supports, and the fallbacks
    aegis plan --nodes N (--mtbf-node-hours H | --failures-per-day F) [costs]
                                                 snapshot intervals, goodput, cost of failures

Exit codes: 0 success; 1 verification failed, bytes are corrupt, (``diff``) the snapshots
differ, or (``prune``) the store refused to delete some steps; 2 bad input (URI, step, option, unreadable manifest); 3 internal error (a bug: run with
``AEGIS_DEBUG=1`` for the traceback). Errors are one line on stderr: ``aegis: error: ...``.

Nothing is unpickled unless ``--unsafe-load-objects`` is given: aegis shards hold raw tensor
bytes; non-tensor entries are shown by name and size, compared and exported as their serialized
bytes. A plain DCP directory's ``.metadata`` is read with an unpickler that admits only DCP's
metadata classes, and its tensor payloads by DCP with ``torch.load(weights_only=True)``.

JSON (``--json``): one document on stdout with ``"schema": "aegis.<command>/1"``; fields are only
ever added within a schema version; an error is ``{"schema": "aegis.error/1", "error": str,
"exit_code": int}``. Every schema, field by field, is in ``docs/guides/cli.md`` (its one copy).
"""

from __future__ import annotations

import os
import sys
import time
import traceback
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import click
from rich.table import Table
from rich.text import Text

from aegis.cli._common import (
    EXIT_FAILED,
    EXIT_INTERNAL,
    EXIT_OK,
    EXIT_USAGE,
    Bar,
    CliError,
    emit_json,
    fmt_age,
    fmt_bytes,
    fmt_shape,
    job_option,
    json_number,
    json_option,
    open_one,
    show,
    snap_ref,
    snapshot_of,
    stdout_console,
    unsafe_option,
)
from aegis.errors import AegisError, CorruptShardError
from aegis.read.errors import ReadError

if TYPE_CHECKING:
    from aegis.read.api import Snapshot
    from aegis.read.locations import TIER_DCP, Failure, StepRow, pick, resolve
    from aegis.snapshot.node_store import default_store_root

__all__ = ["cli", "main"]

_LIGHT = {"plan", "doctor"}  # commands that never read a snapshot: no torch import (seconds)


def _load_heavy() -> None:
    """Bind the snapshot readers (they import torch) for the commands that read snapshots."""
    from aegis.read import locations
    from aegis.snapshot.node_store import default_store_root

    globals().update(TIER_DCP=locations.TIER_DCP, Failure=locations.Failure,
                     StepRow=locations.StepRow, pick=locations.pick, resolve=locations.resolve,
                     default_store_root=default_store_root)

_TIER_ORDER = {"memory": 0, "durable": 1, "dcp": 2}


def _age(created: float | None) -> float | None:
    return None if created is None else max(0.0, time.time() - created)


def _ratio(raw: int | None, stored: int | None) -> float | None:
    return raw / stored if raw is not None and stored else None


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="aegis", prog_name="aegis")
@click.pass_context
def cli(ctx: click.Context) -> None:
    """List, inspect, verify, diff, export and prune aegis snapshots (and plain DCP checkpoints).

    URI: a node store directory (/dev/shm/aegis, or /dev/shm/aegis/JOB), a durable root
    (file:///path, s3://bucket/prefix), or a DCP checkpoint directory.
    Exit codes: 0 ok, 1 verification failed / snapshots differ, 2 bad input, 3 internal error.
    """
    if ctx.invoked_subcommand not in _LIGHT:
        _load_heavy()


# -- ls ------------------------------------------------------------------------------------------


@cli.command("ls")
@click.argument("uris", nargs=-1, metavar="[URI]...")
@job_option
@json_option
def ls_cmd(uris: tuple[str, ...], job: str | None, as_json: bool) -> int:
    """Steps per tier with world size, bytes raw and stored, compression ratio and age; newest
    first. Several URIs (a node store and a durable root) are listed together. Without a URI:
    this node's store ($AEGIS_STORE_DIR or /dev/shm/aegis)."""
    if not uris:
        uris = (str(default_store_root()),)
    rows: list[StepRow] = []
    for uri in uris:
        sources = resolve(uri)
        if job is not None:
            sources = [pick(sources, job, uri)]
        for src in sources:
            try:
                rows.extend(src.rows())
            except AegisError as e:
                raise CliError(f"{src.uri}: {e}") from e
            finally:
                src.close()
    rows.sort(key=lambda r: (-(r.step if r.step is not None else -1), _TIER_ORDER.get(r.tier, 9), r.job or ""))
    if as_json:
        emit_json({"schema": "aegis.ls/1", "steps": [
            {"uri": r.uri, "tier": r.tier, "job": r.job, "step": r.step, "committed": r.committed,
             "world_size": r.world_size, "shards": r.shards, "raw_bytes": r.raw_bytes,
             "stored_bytes": r.stored_bytes, "ratio": json_number(_ratio(r.raw_bytes, r.stored_bytes)),
             "created": r.created, "age_s": _age(r.created), "error": r.error}
            for r in rows
        ]})
        return EXIT_OK
    console = stdout_console()
    if not rows:
        console.print(f"no steps in {', '.join(uris)}")
        return EXIT_OK
    jobs = {r.job for r in rows}
    wheres = {r.uri for r in rows}
    table = Table(title=None, box=None, header_style="bold", pad_edge=False)
    if len(jobs) > 1:
        table.add_column("job")
    for name in ("step", "tier", "state", "world", "shards", "raw", "stored", "ratio", "age"):
        table.add_column(name, justify="right" if name not in ("tier", "state") else "left")
    if len(wheres) > 1:
        table.add_column("where", overflow="fold")
    for r in rows:
        state = "error" if r.error else ("committed" if r.committed else "partial")
        ratio = _ratio(r.raw_bytes, r.stored_bytes)
        cells: list[str | Text] = [str(r.step) if r.step is not None else "-", r.tier,
                 Text(state, style="red" if r.error else ("" if r.committed else "yellow")),
                 str(r.world_size or "-"), str(r.shards if r.shards is not None else "-"),
                 fmt_bytes(r.raw_bytes), fmt_bytes(r.stored_bytes),
                 f"{ratio:.2f}x" if ratio else "-", fmt_age(_age(r.created))]
        if len(jobs) > 1:
            cells.insert(0, r.job or "-")
        if len(wheres) > 1:
            cells.append(r.uri)
        table.add_row(*cells)
    show(console, table)
    for r in rows:
        if r.error:
            click.echo(f"aegis: warning: step {r.step} in {r.uri}: {r.error}", err=True)
    return EXIT_OK


# -- inspect -------------------------------------------------------------------------------------


def _summary_table(snap: Snapshot, summary: dict[str, Any]) -> Table:
    t = Table(show_header=False, box=None, pad_edge=False)
    t.add_column(style="bold")
    t.add_column(overflow="fold")
    t.add_row("uri", snap.uri)
    t.add_row("tier", snap.tier)
    if snap.job:
        t.add_row("job", snap.job)
    t.add_row("step", str(snap.step) if snap.step is not None else "-")
    t.add_row("world size", str(summary["world_size"] or "-"))
    if summary["mesh"]:
        t.add_row("mesh", ", ".join(f"{k}={v}" for k, v in summary["mesh"].items()))
    created = summary["created"]
    if created:
        t.add_row("created", time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(created))
                  + f" ({fmt_age(_age(created))} ago)")
    if summary["timings"]:
        t.add_row("timings", ", ".join(
            f"{k.removesuffix('_s')}={v * 1e3:.1f} ms" if k.endswith("_s") or "_s_" in k else f"{k}={v:g}"
            for k, v in summary["timings"].items()))
    shards = summary["shards"]
    if shards and "rank" in shards[0]:
        raw = sum(s["raw_bytes"] for s in shards)
        stored = sum(s["stored_bytes"] for s in shards)
        t.add_row("shards", f"{len(shards)} ({fmt_bytes(raw)} raw, {fmt_bytes(stored)} stored, "
                  f"{sum(s['chunks'] for s in shards)} chunks; nodes: "
                  f"{', '.join(sorted({s['node'] for s in shards}))})")
    elif shards:
        t.add_row("files", f"{len(shards)} ({fmt_bytes(sum(s['size'] or 0 for s in shards))})")
    red = summary.get("redundancy")
    if red and red["scheme"] == "replica":
        t.add_row("redundancy", f"whole replicas ({red['copies']} per shard)")
    elif red:
        k = red["groups"][0]["survives_losses"] if red["groups"] else 1
        what = "XOR parity" if red["scheme"] == "xor" else f"Reed-Solomon parity ({red.get('ec_type')})"
        t.add_row("redundancy", f"{what}, survives {k} lost node{'s' if k > 1 else ''} per group: " + "; ".join(
            f"ranks {g['members']} on {', '.join(g['nodes'])} ({fmt_bytes(g['parity_bytes_per_member'])} "
            "parity each)" for g in red["groups"]))
    n_t = len(snap.keys())
    t.add_row("entries", f"{n_t} tensors, {len(snap.entries) - n_t} objects")
    kinds = summary.get("state_kinds") or {}
    if kinds:  # per_rank entries are stored under per_rank.rankNNNNN.<name>, one copy per rank
        t.add_row("state", ", ".join(f"{name} ({kind.replace('_', '-')})" for name, kind in kinds.items()))
    return t


def _entry_rows(snap: Snapshot, values: dict[str, Any] | None) -> list[dict[str, Any]]:
    out = []
    for name, e in snap.entries.items():
        if e.kind == "tensor":
            out.append({"name": name, "kind": "tensor", "dtype": e.dtype, "shape": list(e.shape or ()),
                        "shards": e.shards, "bytes": e.nbytes})
        else:
            row: dict[str, Any] = {"name": name, "kind": "object", "dtype": None, "shape": None,
                                   "shards": None, "bytes": e.nbytes}
            if values is not None and name in values:
                row["value"] = _short_repr(values[name], 200)
            out.append(row)
    return out


def _short_repr(v: Any, n: int) -> str:
    r = repr(v)
    return r if len(r) <= n else r[: n - 3] + "..."


def _resolve_name(snap: Snapshot, name: str) -> str:
    if name in snap.entries:
        return name
    import difflib

    close = difflib.get_close_matches(name, list(snap.entries), n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    raise CliError(f"no entry {name!r} in step {snap.step} of {snap.uri}{hint}")


@cli.command("inspect")
@click.argument("uri")
@click.option("--step", type=int, default=None, help="The step (default: the newest committed).")
@click.option("--tensor", "tensor_name", default=None, metavar="NAME",
              help="Statistics of one tensor: min, max, mean, norm, NaN/Inf counts.")
@job_option
@unsafe_option
@json_option
def inspect_cmd(uri: str, step: int | None, tensor_name: str | None, job: str | None, unsafe: bool,
                as_json: bool) -> int:
    """Manifest summary (job, step, world, mesh, timings) and one row per entry: name, dtype,
    global shape, number of shards, bytes. Non-tensor entries by name and size."""
    src = open_one(uri, job, unsafe=unsafe)
    try:
        snap = snapshot_of(src, step)
        summary = snap.summary()
        values: dict[str, Any] | None = None
        if unsafe:
            values = snap.objects(unpickle=True, weights_only=False, progress=False)
        stats: dict[str, Any] | None = None
        if tensor_name is not None:
            name = _resolve_name(snap, tensor_name)
            if snap.entries[name].kind != "tensor":
                raise CliError(f"{name!r} is not a tensor (a non-tensor object of "
                               f"{snap.entries[name].nbytes} bytes)")
            from aegis.cli._tensors import tensor_stats

            with Bar(f"reading {name}", snap.bytes_to_read([name]) + snap.entry_bytes(name)) as bar:
                t = snap.tensor(name, progress=bar.advance)
            stats = {"name": name, **tensor_stats(t)}
    finally:
        src.close()
    entries = _entry_rows(snap, values)
    if as_json:
        doc = {"schema": "aegis.inspect/1", **snap_ref(snap), "world_size": summary["world_size"],
               "created": summary["created"], "age_s": _age(summary["created"]),
               "format_version": summary["format_version"], "mesh": summary["mesh"],
               "timings": summary["timings"], "shards": summary["shards"], "entries": entries,
               "state_kinds": summary.get("state_kinds") or {},
               "redundancy": summary.get("redundancy")}
        if stats is not None:
            doc["tensor"] = {k: json_number(v) if isinstance(v, float) else v for k, v in stats.items()}
        emit_json(doc)
        return EXIT_OK
    console = stdout_console()
    show(console, _summary_table(snap, summary))
    console.print()
    if stats is not None:
        t2 = Table(show_header=False, box=None, pad_edge=False)
        t2.add_column(style="bold")
        t2.add_column(overflow="fold")

        def num(v: Any) -> str:
            return "-" if v is None else (f"{v:.6g}" if isinstance(v, float) else str(v))

        t2.add_row("tensor", stats["name"])
        t2.add_row("dtype", stats["dtype"])
        t2.add_row("shape", fmt_shape(stats["shape"]))
        t2.add_row("elements", str(stats["numel"]))
        for key in ("min", "max", "mean", "norm"):
            t2.add_row(key, num(stats[key]))
        t2.add_row("NaN", str(stats["nan"]))
        t2.add_row("Inf", str(stats["inf"]))
        show(console, t2)
        return EXIT_OK
    table = Table(box=None, header_style="bold", pad_edge=False)
    table.add_column("name", overflow="fold")
    table.add_column("dtype")
    table.add_column("shape")
    table.add_column("shards", justify="right")
    table.add_column("bytes", justify="right")
    if values is not None:
        table.add_column("value", overflow="fold")
    for row in entries:
        cells = [row["name"], row["dtype"] or "object", fmt_shape(row["shape"]),
                 str(row["shards"]) if row["shards"] is not None else "-", fmt_bytes(row["bytes"])]
        if values is not None:
            cells.append(row.get("value", ""))
        table.add_row(*cells)
    show(console, table)
    return EXIT_OK


# -- verify --------------------------------------------------------------------------------------


def _failure_doc(f: Failure) -> dict[str, Any]:
    return {"uri": f.uri, "tier": f.tier, "job": f.job, "step": f.step, "rank": f.rank,
            "chunk": f.chunk, "error": f.error}


@cli.command("verify")
@click.argument("uri")
@click.option("--step", type=int, default=None, help="The step (default: the newest committed).")
@click.option("--all", "all_steps", is_flag=True, help="Every committed step.")
@job_option
@json_option
def verify_cmd(uri: str, step: int | None, all_steps: bool, job: str | None, as_json: bool) -> int:
    """Check the crc32c of every chunk. Exit code 0 only if everything verified; each failure
    names step, rank, chunk and tier."""
    if step is not None and all_steps:
        raise click.UsageError("give --step or --all, not both")
    src = open_one(uri, job)
    try:
        available = src.all_steps()
        if all_steps:
            steps = available
            if not steps:
                raise CliError(f"{src.uri}: no committed step")
        elif step is not None:
            if step not in available:
                src.open(step)  # raises the one-line "not committed" error (NoSnapshotError)
            steps = [step]
        else:
            if not available:
                raise CliError(f"{src.uri}: no committed step")
            steps = [available[-1]]
        total = sum(src.verify_bytes(s) for s in steps)
        results = []
        with Bar(f"verifying {len(steps)} step(s)", total) as bar:
            for s in steps:
                results.append((s, src.verify(s, bar.advance)))
    finally:
        src.close()
    failures = [f for _, r in results for f in r.failures]
    ok = not failures
    if as_json:
        emit_json({
            "schema": "aegis.verify/1", "ok": ok, "checksums": src.tier != TIER_DCP,
            "steps": [{"uri": src.uri, "tier": src.tier, "job": src.job, "step": s, "ok": not r.failures,
                       "chunks": r.chunks, "bytes": r.bytes, "failures": len(r.failures)}
                      for s, r in results],
            "failures": [_failure_doc(f) for f in failures],
        })
        return EXIT_OK if ok else EXIT_FAILED
    console = stdout_console()
    table = Table(box=None, header_style="bold", pad_edge=False)
    for col in ("step", "tier", "chunks", "bytes", "result"):
        table.add_column(col, justify="right" if col in ("step", "chunks", "bytes") else "left")
    for s, r in results:
        table.add_row(str(s) if s is not None else "-", src.tier, str(r.chunks), fmt_bytes(r.bytes),
                      Text("ok", style="green") if not r.failures
                      else Text(f"FAILED ({len(r.failures)})", style="bold red"))
    show(console, table)
    if failures:
        ft = Table(box=None, header_style="bold red", pad_edge=False, title_justify="left")
        for col in ("step", "rank", "chunk", "tier", "error"):
            ft.add_column(col, overflow="fold" if col == "error" else "ellipsis")
        for f in failures:
            ft.add_row(str(f.step) if f.step is not None else "-", str(f.rank) if f.rank is not None else "-",
                       str(f.chunk) if f.chunk is not None else "-", f.tier, f.error)
        console.print()
        show(console, ft)
        bad_steps = sorted({f.step for f in failures}, key=lambda s: -1 if s is None else s)
        click.echo(f"aegis: verify failed: {len(failures)} failure(s) in step(s) "
                   f"{', '.join(str(s) for s in bad_steps)} of {src.uri}", err=True)
    if src.tier == TIER_DCP:
        console.print("note: plain DCP checkpoints carry no checksums: verify checked that every "
                      "item's bytes are present, and cannot detect flipped bytes", highlight=False)
    return EXIT_OK if ok else EXIT_FAILED


# one module per command beyond these: `aegis diff|export|prune|doctor|plan|store`
from aegis.cli.diff import diff_cmd  # noqa: E402 - the group above must exist first
from aegis.cli.doctor import doctor_cmd  # noqa: E402
from aegis.cli.export import export_cmd  # noqa: E402
from aegis.cli.prune import prune_cmd  # noqa: E402

for _cmd in (diff_cmd, export_cmd, prune_cmd, doctor_cmd):
    cli.add_command(_cmd)
# `aegis plan` (aegis/cli/plan.py): how often to snapshot and what failures cost.
from aegis.cli.plan import plan as _plan  # noqa: E402 - the group above must exist first

cli.add_command(_plan)
from aegis.cli.store import store as _store  # noqa: E402 - `aegis store serve|ping` (aegis/cli/store.py)

cli.add_command(_store)


# -- entry point ---------------------------------------------------------------------------------


def _fail(message: str, code: int, as_json: bool) -> int:
    click.echo(f"aegis: error: {message}", err=True)
    if as_json:
        emit_json({"schema": "aegis.error/1", "error": message, "exit_code": code})
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """Console-script entry point; returns the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    as_json = "--json" in args
    warnings.filterwarnings("ignore", module=r"torch\.distributed.*")
    debug = bool(os.environ.get("AEGIS_DEBUG"))
    try:
        rv = cli.main(args=args, prog_name="aegis", standalone_mode=False)
        return int(rv) if isinstance(rv, int) else EXIT_OK
    except click.exceptions.Abort:
        click.echo("aegis: aborted", err=True)
        return 130
    except CliError as e:
        return _fail(e.format_message(), e.exit_code, as_json)
    except click.UsageError as e:
        e.show()
        return EXIT_USAGE
    except click.ClickException as e:
        return _fail(e.format_message(), EXIT_USAGE, as_json)
    except (CorruptShardError, ReadError) as e:  # bytes that do not verify, a read that failed
        return _fail(str(e), EXIT_FAILED, as_json)
    except AegisError as e:  # SourceError, NoSnapshotError, ManifestError, ...: bad input
        return _fail(str(e), EXIT_USAGE, as_json)
    except OSError as e:
        where = f"{e.filename}: " if e.filename else ""
        return _fail(f"{where}{e.strerror or e}", EXIT_USAGE, as_json)
    except KeyboardInterrupt:
        click.echo("aegis: interrupted", err=True)
        return 130
    except Exception as e:  # noqa: BLE001 - a bug: one line unless AEGIS_DEBUG asks for more
        if debug:
            traceback.print_exc()
        return _fail(f"internal error: {type(e).__name__}: {e} (set AEGIS_DEBUG=1 for the traceback; "
                     "please report it)", EXIT_INTERNAL, as_json)
