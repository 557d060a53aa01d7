"""``aegis export``: a snapshot as a DCP checkpoint, a torch file or safetensors.

Registered by the ``aegis`` group (``cli.add_command``); JSON schema ``aegis.export/1``
(docs/guides/cli.md).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import click

from aegis.cli._common import (
    EXIT_OK,
    Bar,
    CliError,
    emit_json,
    fmt_bytes,
    job_option,
    json_option,
    open_one,
    snap_ref,
    snapshot_of,
    unsafe_option,
)

__all__ = ["export_cmd"]


@click.command("export")
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
    src = open_one(uri, job, unsafe=unsafe)
    try:
        snap = snapshot_of(src, step)
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
        emit_json({"schema": "aegis.export/1", **snap_ref(snap), "format": fmt, "out": str(out),
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
