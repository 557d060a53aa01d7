"""``aegis prune``: the durable tier's retention by hand (the newest committed step never goes).

Registered by the ``aegis`` group (``cli.add_command``); JSON schema ``aegis.prune/1``
(docs/guides/cli.md).
"""

from __future__ import annotations

import click
from rich.table import Table
from rich.text import Text

from aegis.cli._common import (
    EXIT_OK,
    FailedError,
    emit_json,
    job_option,
    json_option,
    open_one,
    show,
    stdout_console,
)

__all__ = ["prune_cmd"]


@click.command("prune")
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

    src = open_one(uri, job)
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
        emit_json({"schema": "aegis.prune/1", "uri": src.uri, "tier": src.tier, "job": src.job,
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
