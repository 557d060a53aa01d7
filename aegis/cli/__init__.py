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

JSON (``--json``): one document on stdout; every document has ``"schema": "aegis.<command>/1"``.
Fields are only ever added within a schema version. Sizes are bytes, times are Unix seconds,
``null`` means unknown or undefined (JSON has no NaN/Infinity). On an error the document is
``{"schema": "aegis.error/1", "error": str, "exit_code": int}``.

* ``aegis.ls/1``: ``{"steps": [row]}``, newest first; row: ``uri, tier ("memory" | "durable" |
  "dcp"), job, step, committed, world_size, shards, raw_bytes, stored_bytes, ratio (raw/stored),
  created, age_s, error``.
* ``aegis.inspect/1``: ``uri, tier, job, step, world_size, created, age_s, format_version, mesh,
  timings, shards: [{rank, node, size, chunks, raw_bytes, stored_bytes, replicas}] (DCP: [{file,
  size}]), entries: [{name, kind ("tensor" | "object"), dtype, shape, shards, bytes, value?}],
  state_kinds: {state name: "sharded" | "per_rank" | "replicated"}`` (per_rank entries are keyed
  ``per_rank.rankNNNNN.<name>``: one copy per rank; ``{}`` for DCP directories), redundancy:
  ``{scheme: "replica", copies}`` or ``{scheme: "xor" | "rs", groups: [{members, nodes,
  parity_bytes_per_member, survives_losses}]}`` (RS adds ``parity`` and ``ec_type``; null
  for DCP directories),
  ``tensor?: {name, dtype, shape, numel, min, max, mean, norm, nan, inf}`` (``value`` only with
  --unsafe-load-objects: its ``repr``; ``tensor`` only with --tensor).
* ``aegis.verify/1``: ``ok, checksums (false for a plain DCP directory: only presence and
  sizes can be checked), steps: [{uri, tier, job, step, ok, chunks, bytes, failures}],
  failures: [{uri, tier, job, step, rank, chunk, error}]`` (``rank``/``chunk`` null when the
  failure is not one chunk's: a missing shard, an index, a manifest).
* ``aegis.diff/1``: ``a: {uri, tier, job, step}, b: {...}, identical, counts: {unchanged,
  changed, only_a, only_b, incompatible}, entries: [{name, kind, status, dtype, shape,
  max_abs_diff, rel_norm, detail?}]`` (status: ``unchanged | changed | only_a | only_b |
  incompatible``; max_abs_diff and rel_norm = ||a-b|| / ||a|| over positions finite in both).
* ``aegis.export/1``: ``uri, tier, job, step, format, out, tensors, objects, objects_skipped,
  bytes, seconds``.
* ``aegis.prune/1``: ``uri, tier, job, dry_run, keep_last, keep_every, committed, removed,
  kept`` (lists of steps, ascending).
* ``aegis.doctor/1``: ``uri, capabilities: {batch_delete, list_multipart_uploads,
  conditional_put, crc32c: bool}, fallbacks: {operation: what aegis does without it}, notes``.
* ``aegis.plan/1``: see :mod:`aegis.cli.plan`.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
import traceback
import warnings
from collections.abc import Sequence
from pathlib import Path
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
    FailedError,
    fmt_age,
    fmt_bytes,
    fmt_shape,
    json_number,
    show,
    stdout_console,
)
from aegis.errors import AegisError, CorruptShardError
from aegis.read.errors import ReadError

if TYPE_CHECKING:
    from aegis.read.api import Snapshot, Source
    from aegis.read.locations import TIER_DCP, Failure, Location, StepRow, pick, resolve
    from aegis.snapshot.node_store import default_store_root

__all__ = ["cli", "main"]

_LIGHT = {"plan", "doctor"}  # commands that never read a snapshot: no torch import (seconds)


def _load_heavy() -> None:
    """Bind the snapshot readers (they import torch) for the commands that read snapshots."""
    from aegis.read import api, locations
    from aegis.snapshot.node_store import default_store_root

    globals().update(TIER_DCP=locations.TIER_DCP, Failure=locations.Failure, Location=locations.Location,
                     StepRow=locations.StepRow, pick=locations.pick, resolve=locations.resolve,
                     Snapshot=api.Snapshot, Source=api.Source, default_store_root=default_store_root)

_TIER_ORDER = {"memory": 0, "durable": 1, "dcp": 2}


def _emit_json(doc: dict[str, Any]) -> None:
    click.echo(json.dumps(doc, indent=2, allow_nan=False))


def _open_one(uri: str, job: str | None, *, unsafe: bool = False) -> Location:
    return pick(resolve(uri, unsafe=unsafe), job, uri, how="--job")


def _snapshot(loc: Location, step: int | None) -> Snapshot:
    """``step`` (default: the newest committed) of one location, or its one-line error."""
    src = Source([loc])
    return src.step(step) if step is not None else src.latest(skip_damaged=False)


def _snap_ref(snap: Snapshot) -> dict[str, Any]:
    return {"uri": snap.uri, "tier": snap.tier, "job": snap.job, "step": snap.step}


def _age(created: float | None) -> float | None:
    return None if created is None else max(0.0, time.time() - created)


def _ratio(raw: int | None, stored: int | None) -> float | None:
    return raw / stored if raw is not None and stored else None


json_option = click.option("--json", "as_json", is_flag=True, help="One JSON document on stdout.")
job_option = click.option("--job", default=None, help="The job, when the URI holds several.")
unsafe_option = click.option(
    "--unsafe-load-objects", "unsafe", is_flag=True,
    help="Unpickle non-tensor entries (torch.load(weights_only=False)): runs code from the "
         "snapshot. Only for snapshots you trust.")


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
        _emit_json({"schema": "aegis.ls/1", "steps": [
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
    src = _open_one(uri, job, unsafe=unsafe)
    try:
        snap = _snapshot(src, step)
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
        doc = {"schema": "aegis.inspect/1", **_snap_ref(snap), "world_size": summary["world_size"],
               "created": summary["created"], "age_s": _age(summary["created"]),
               "format_version": summary["format_version"], "mesh": summary["mesh"],
               "timings": summary["timings"], "shards": summary["shards"], "entries": entries,
               "state_kinds": summary.get("state_kinds") or {},
               "redundancy": summary.get("redundancy")}
        if stats is not None:
            doc["tensor"] = {k: json_number(v) if isinstance(v, float) else v for k, v in stats.items()}
        _emit_json(doc)
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
    src = _open_one(uri, job)
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
        _emit_json({
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


# -- diff ----------------------------------------------------------------------------------------


@cli.command("diff")
@click.argument("uris", nargs=-1, required=True, metavar="URI [URI_B]")
@click.option("--step", "steps", type=int, multiple=True,
              help="Twice with one URI (A then B); with two URIs: once for both, or once per URI.")
@job_option
@click.option("--show-unchanged", is_flag=True, help="List unchanged entries too.")
@json_option
def diff_cmd(uris: tuple[str, ...], steps: tuple[int, ...], job: str | None, show_unchanged: bool,
             as_json: bool) -> int:
    """Per entry: unchanged / changed, max absolute difference and ||a-b|| / ||a||; entries only
    on one side. Exit code 0 when identical, 1 when they differ."""
    from aegis.cli._tensors import BATCH_BYTES, batches, compare

    if len(uris) > 2:
        raise click.UsageError("give one URI with --step A --step B, or two URIs")
    if len(uris) == 1:
        if len(steps) != 2:
            raise click.UsageError("with one URI, give two steps: --step A --step B")
        src_a = src_b = _open_one(uris[0], job)
        step_a: int | None = steps[0]
        step_b: int | None = steps[1]
    else:
        if len(steps) > 2:
            raise click.UsageError("give at most two --step values")
        src_a, src_b = _open_one(uris[0], job), _open_one(uris[1], job)
        step_a = steps[0] if steps else None
        step_b = steps[-1] if steps else None
    try:
        a, b = _snapshot(src_a, step_a), _snapshot(src_b, step_b)
        names_a, names_b = list(a.entries), set(b.entries)
        both = [n for n in names_a if n in names_b]
        rows: dict[str, dict[str, Any]] = {}
        for n in names_a:
            if n not in names_b:
                rows[n] = {"status": "only_a", "max_abs_diff": None, "rel_norm": None}
        for n in b.entries:
            if n not in a.entries:
                rows[n] = {"status": "only_b", "max_abs_diff": None, "rel_norm": None}
        tensors = [n for n in both if a.entries[n].kind == b.entries[n].kind == "tensor"]
        objects = [n for n in both if a.entries[n].kind == b.entries[n].kind == "object"]
        for n in both:
            if n not in tensors and n not in objects:
                rows[n] = {"status": "incompatible", "max_abs_diff": None, "rel_norm": None,
                           "detail": "a tensor on one side, an object on the other"}
        total = sum(x.bytes_to_read(tensors) + sum(x.entry_bytes(n) for n in tensors) for x in (a, b))
        with Bar("comparing", total) as bar:
            for group in batches(a, tensors, BATCH_BYTES):  # both sides batch by batch: bounded memory
                ta = a.load(group, max_bytes=BATCH_BYTES, progress=bar.advance)
                tb = b.load(group, max_bytes=BATCH_BYTES, progress=bar.advance)
                for n in group:
                    rows[n] = compare(ta[n], tb[n])
                del ta, tb
        if objects:
            ra, rb = a.objects(objects, progress=False), b.objects(objects, progress=False)
            for n in objects:
                same = ra.get(n) == rb.get(n)
                rows[n] = {"status": "unchanged" if same else "changed", "max_abs_diff": None,
                           "rel_norm": None}
    finally:
        src_a.close()
        if src_b is not src_a:
            src_b.close()
    order = list(a.entries) + [n for n in b.entries if n not in a.entries]
    counts = {k: 0 for k in ("unchanged", "changed", "only_a", "only_b", "incompatible")}
    entries = []
    for n in order:
        r = rows[n]
        counts[r["status"]] += 1
        e = a.entries.get(n) or b.entries[n]
        is_t = e.kind == "tensor"
        doc = {"name": n, "kind": "tensor" if is_t else "object", "status": r["status"],
               "dtype": e.dtype if is_t else None,
               "shape": list(e.shape or ()) if is_t else None,
               "max_abs_diff": json_number(r["max_abs_diff"]), "rel_norm": json_number(r["rel_norm"])}
        if "detail" in r:
            doc["detail"] = r["detail"]
        entries.append(doc)
    identical = counts["unchanged"] == len(order)
    if as_json:
        _emit_json({"schema": "aegis.diff/1", "a": _snap_ref(a), "b": _snap_ref(b), "identical": identical,
                    "counts": counts, "entries": entries})
        return EXIT_OK if identical else EXIT_FAILED
    console = stdout_console()
    console.print(f"a: {a.uri} step {a.step}   b: {b.uri} step {b.step}")
    table = Table(box=None, header_style="bold", pad_edge=False)
    table.add_column("name", overflow="fold")
    table.add_column("status")
    table.add_column("dtype")
    table.add_column("shape")
    table.add_column("max |a-b|", justify="right")
    table.add_column("|a-b|/|a|", justify="right")
    styles = {"unchanged": "green", "changed": "yellow", "only_a": "cyan", "only_b": "cyan",
              "incompatible": "red"}
    for d in entries:
        if d["status"] == "unchanged" and not show_unchanged:
            continue
        table.add_row(d["name"], Text(d["status"], style=styles[d["status"]]), d["dtype"] or "object",
                      fmt_shape(d["shape"]),
                      "-" if d["max_abs_diff"] is None else f"{d['max_abs_diff']:.4g}",
                      "-" if d["rel_norm"] is None else f"{d['rel_norm']:.4g}")
    if table.row_count:
        show(console, table)
    console.print(", ".join(f"{v} {k.replace('_', ' ')}" for k, v in counts.items() if v or k == "changed")
                  + (" (identical)" if identical else ""))
    return EXIT_OK if identical else EXIT_FAILED


# -- export --------------------------------------------------------------------------------------


@cli.command("export")
@click.argument("uri")
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--format", "fmt", type=click.Choice(["dcp", "torch", "safetensors"]), required=True,
              help="dcp: a plain DCP checkpoint directory (sharding kept); torch / safetensors: one "
                   "file of full (unsharded) tensors.")
@click.option("--step", type=int, default=None, help="The step (default: the newest committed).")
@click.option("--flat", is_flag=True, help="torch: flat 'a.b.c' keys instead of the nested state dict.")
@click.option("--layout", type=click.Choice(["aegis", "torchtitan"]), default="aegis", show_default=True,
              help="dcp: torchtitan names its keys as its own DCP checkpointer does (snapshots "
                   "taken through aegis.integrations.torchtitan), so its loader reads the folder.")
@click.option("--force", is_flag=True, help="Replace OUT if it exists.")
@job_option
@unsafe_option
@json_option
def export_cmd(uri: str, out: Path, fmt: str, step: int | None, flat: bool, layout: str, force: bool,
               job: str | None, unsafe: bool, as_json: bool) -> int:
    """Write a snapshot for tools that have never heard of aegis: a plain DCP checkpoint that
    torch.distributed.checkpoint.load reads, or one torch / safetensors file of full tensors.
    Non-tensor entries go into dcp as their serialized bytes; into torch only with
    --unsafe-load-objects; never into safetensors."""
    if layout != "aegis" and fmt != "dcp":
        raise click.UsageError(f"--layout {layout} applies to --format dcp only")
    if (out.exists() or out.is_symlink()) and not force:
        raise CliError(f"{out} exists; pass --force to replace it")
    if not out.parent.is_dir():
        raise CliError(f"{out.parent}: no such directory")
    t0 = time.perf_counter()
    src = _open_one(uri, job, unsafe=unsafe)
    try:
        snap = _snapshot(src, step)
        if out.exists() or out.is_symlink():  # --force, and the snapshot is there to replace it
            if out.is_dir() and not out.is_symlink():
                shutil.rmtree(out)
            else:
                out.unlink()
        tensor_names = snap.keys()
        objects = [n for n in snap.entries if n not in set(tensor_names)]
        tensor_bytes = sum(snap.entry_bytes(n) for n in tensor_names)
        total = snap.bytes_to_read() + (0 if fmt == "dcp" else tensor_bytes)
        with Bar(f"exporting step {snap.step}", total) as bar:
            try:
                done = snap.export(out, fmt, flat=flat, unpickle=unsafe, progress=bar.advance)
                if fmt == "dcp" and layout == "torchtitan":
                    from aegis.integrations.torchtitan import to_torchtitan_dcp

                    to_torchtitan_dcp(out)
                skipped: list[str] = done["objects_skipped"]
            except BaseException:
                if fmt == "dcp" and out.is_dir():
                    shutil.rmtree(out, ignore_errors=True)
                raise
    finally:
        src.close()
    size = (sum(p.stat().st_size for p in out.rglob("*") if p.is_file()) if out.is_dir()
            else out.stat().st_size)
    secs = time.perf_counter() - t0
    if as_json:
        _emit_json({"schema": "aegis.export/1", **_snap_ref(snap), "format": fmt, "out": str(out),
                    "tensors": len(tensor_names), "objects": len(objects) - len(skipped),
                    "objects_skipped": skipped, "bytes": size, "seconds": secs})
        return EXIT_OK
    click.echo(f"exported step {snap.step} of {snap.uri} to {out} ({fmt}, {len(tensor_names)} "
               f"tensors, {len(objects) - len(skipped)} objects, {fmt_bytes(size)}, {secs:.1f} s)")
    if skipped:
        why = ("safetensors holds tensors only" if fmt == "safetensors"
               else "pass --unsafe-load-objects to include them")
        click.echo(f"left out {len(skipped)} non-tensor entries ({why}): {', '.join(skipped[:4])}"
                   + (", ..." if len(skipped) > 4 else ""), err=True)
    return EXIT_OK


# -- prune ---------------------------------------------------------------------------------------


@cli.command("prune")
@click.argument("uri")
@click.option("--keep-last", type=click.IntRange(min=1), required=True, help="Keep the newest N committed steps.")
@click.option("--keep-every", type=click.IntRange(min=0), default=0, show_default=True,
              help="Also keep every step that is a multiple of K (0: none).")
@click.option("--dry-run", is_flag=True, help="Say what would be removed; remove nothing.")
@job_option
@json_option
def prune_cmd(uri: str, keep_last: int, keep_every: int, dry_run: bool, job: str | None, as_json: bool) -> int:
    """Apply the durable tier's retention by hand: keep the last N committed steps and every K-th;
    the newest committed step is never removed. Manifests go first, so a step is never left
    half-removed and still committed. Do not prune a node store a running job is using."""
    from aegis.snapshot.durable import RetentionError
    from aegis.snapshot.objstore import ObjectStore

    src = _open_one(uri, job)
    try:
        committed = src.committed()
        removed = src.prune(keep_last, keep_every, dry_run=dry_run)
        store = getattr(src, "store", None)
        for note in store.take_notes() if isinstance(store, ObjectStore) else ():  # what it lacks
            click.echo(f"aegis: note: {note}", err=True)
    except RetentionError as e:  # the store refused: not bad input
        raise FailedError(f"{e} (removed: {', '.join(map(str, e.removed)) or 'none'}; the others "
                          "are still committed)") from e
    finally:
        src.close()
    kept = [s for s in committed if s not in set(removed)]
    if as_json:
        _emit_json({"schema": "aegis.prune/1", "uri": src.uri, "tier": src.tier, "job": src.job,
                    "dry_run": dry_run, "keep_last": keep_last, "keep_every": keep_every,
                    "committed": committed, "removed": removed, "kept": kept})
        return EXIT_OK
    console = stdout_console()
    newest = committed[-1] if committed else None
    last = set(committed[-keep_last:])
    table = Table(box=None, header_style="bold", pad_edge=False)
    table.add_column("step", justify="right")
    table.add_column("action")
    table.add_column("why")
    for s in reversed(committed):
        if s in removed:
            table.add_row(str(s), Text("would remove" if dry_run else "removed", style="yellow"), "")
        else:
            why = ["newest"] if s == newest else []
            if s in last and s != newest:
                why.append(f"last {keep_last}")
            if keep_every and s % keep_every == 0:
                why.append(f"every {keep_every}")
            table.add_row(str(s), Text("keep", style="green"), ", ".join(why))
    if committed:
        show(console, table)
    console.print(f"{'would remove' if dry_run else 'removed'} {len(removed)} of {len(committed)} committed "
                  f"step(s) in {src.uri}")
    return EXIT_OK


# -- doctor --------------------------------------------------------------------------------------


@cli.command("doctor")
@click.argument("url")
@json_option
def doctor_cmd(url: str, as_json: bool) -> int:
    """What a durable store URL supports: reachability, bucket and credentials, then each
    optional S3 operation (batch delete, ListMultipartUploads, conditional put, CRC32C), tried
    once on a probe object under .aegis/ that is removed again, and what aegis does without it."""
    from aegis.snapshot.objstore import CAPABILITY_FALLBACKS, open_store
    from aegis.snapshot.retry import RetryPolicy

    opts: dict[str, Any] = {}
    if url.startswith("s3://"):
        opts = {"retry": RetryPolicy(max_attempts=3, max_total_s=30.0), "connect_timeout_s": 5.0}
    try:
        store = open_store(url, **opts)
    except AegisError as e:
        raise CliError(str(e)) from e
    try:
        store.check()
        caps = store.probe().to_json()
        notes = store.take_notes()
    except AegisError as e:
        raise CliError(str(e)) from e
    finally:
        store.close()
    if as_json:
        _emit_json({"schema": "aegis.doctor/1", "uri": store.url, "capabilities": caps,
                    "fallbacks": {k: CAPABILITY_FALLBACKS[k][1] for k, v in caps.items() if not v},
                    "notes": notes})
        return EXIT_OK
    console = stdout_console()
    if not url.startswith("s3://"):
        console.print(f"{store.url}: a writable local directory; every operation is native")
        return EXIT_OK
    table = Table(box=None, header_style="bold", pad_edge=False)
    table.add_column("operation")
    table.add_column("supported")
    table.add_column("without it, aegis ...", overflow="fold")
    for k, ok in caps.items():
        table.add_row(CAPABILITY_FALLBACKS[k][0], Text("yes" if ok else "no", style="green" if ok else "yellow"),
                      "" if ok else CAPABILITY_FALLBACKS[k][1])
    console.print(f"{store.url}: reachable, bucket and credentials ok")
    show(console, table)
    missing = [k for k, ok in caps.items() if not ok]
    console.print("every optional operation is supported" if not missing else
                  f"{len(missing)} optional operation(s) missing: aegis works, with the costs above")
    for note in notes:
        if not any(CAPABILITY_FALLBACKS[k][0] in note for k in missing):
            click.echo(f"aegis: note: {note}", err=True)
    return EXIT_OK


# `aegis plan` (aegis/cli/plan.py): how often to snapshot and what failures cost.
from aegis.cli.plan import plan as _plan  # noqa: E402 - the group above must exist first

cli.add_command(_plan)
from aegis.cli.store import store as _store  # noqa: E402 - `aegis store serve|ping` (aegis/cli/store.py)

cli.add_command(_store)


# -- entry point ---------------------------------------------------------------------------------


def _fail(message: str, code: int, as_json: bool) -> int:
    click.echo(f"aegis: error: {message}", err=True)
    if as_json:
        _emit_json({"schema": "aegis.error/1", "error": message, "exit_code": code})
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
