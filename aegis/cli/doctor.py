"""``aegis doctor``: what a durable store URL supports, and what aegis does without it.

Registered by the ``aegis`` group (``cli.add_command``); JSON schema ``aegis.doctor/1``
(docs/guides/cli.md).
"""

from __future__ import annotations

from typing import Any

import click
from rich.table import Table
from rich.text import Text

from aegis.cli._common import (
    EXIT_OK,
    CliError,
    emit_json,
    json_option,
    show,
    stdout_console,
)
from aegis.errors import AegisError

__all__ = ["doctor_cmd"]


@click.command("doctor")
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
        emit_json({"schema": "aegis.doctor/1", "uri": store.url, "capabilities": caps,
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
