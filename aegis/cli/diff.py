"""``aegis diff``: per entry unchanged / changed, max |a-b| and ||a-b|| / ||a||, between two steps
or two snapshots (exit code 1 when they differ).

Registered by the ``aegis`` group (``cli.add_command``); JSON schema ``aegis.diff/1``
(docs/guides/cli.md).
"""

from __future__ import annotations

from typing import Any

import click
from rich.table import Table
from rich.text import Text

from aegis.cli._common import (
    EXIT_FAILED,
    EXIT_OK,
    Bar,
    emit_json,
    fmt_shape,
    job_option,
    json_number,
    json_option,
    open_one,
    show,
    snap_ref,
    snapshot_of,
    stdout_console,
)

__all__ = ["diff_cmd"]


@click.command("diff")
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
        src_a = src_b = open_one(uris[0], job)
        step_a: int | None = steps[0]
        step_b: int | None = steps[1]
    else:
        if len(steps) > 2:
            raise click.UsageError("give at most two --step values")
        src_a, src_b = open_one(uris[0], job), open_one(uris[1], job)
        step_a = steps[0] if steps else None
        step_b = steps[-1] if steps else None
    try:
        a, b = snapshot_of(src_a, step_a), snapshot_of(src_b, step_b)
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
        emit_json({"schema": "aegis.diff/1", "a": snap_ref(a), "b": snap_ref(b), "identical": identical,
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
