"""JSON for files nobody vouches for: strict parsing (a key given twice, nesting too deep, text
that is not JSON: :class:`~aegis.errors.ManifestError`), and documents that carry the crc32c of
their own canonical body as their first field, checked before any field is used (a manifest,
a layout, a step record). Pure: no I/O.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

import crc32c as _crc32c

from aegis.errors import IncompatibleSnapshotError, ManifestError

__all__ = ["load_json", "body_checksum", "dumps_with_checksum", "text_checksum_ok", "check_checksum"]


def load_json(text: str | bytes, *, what: str, where: str) -> Any:
    """``json.loads`` for bytes nobody vouches for: a key given twice (which ``json.loads`` would
    silently resolve to the last one) and nesting too deep for the decoder are
    :class:`ManifestError`, like any text that is not JSON."""
    try:
        return json.loads(text, object_pairs_hook=_unique_keys)
    except _DuplicateKey as e:
        raise ManifestError(
            f"{where}: {what} has the duplicate key {e.key!r}; a writer never repeats a key, so the "
            "file is damaged or forged"
        ) from None
    except RecursionError:
        raise ManifestError(f"{where}: {what} is nested too deep to be a real one; the file is damaged") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ManifestError(f"{where}: {what} is not valid JSON ({e}); the file is damaged") from e


class _DuplicateKey(Exception):
    def __init__(self, key: str) -> None:
        self.key = key


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(k)
        out[k] = v
    return out


def body_checksum(doc: Mapping[str, Any]) -> str:
    """``crc32c:<8 hex digits>`` of the canonical JSON of ``doc`` without its ``checksum``."""
    body = {k: v for k, v in doc.items() if k != "checksum"}
    text = json.dumps(body, separators=(",", ":"), sort_keys=True).encode()
    return f"crc32c:{_crc32c.crc32c(text):08x}"


def dumps_with_checksum(body: Mapping[str, Any]) -> str:
    """The canonical JSON of ``body`` with its :func:`body_checksum` added, encoded once: the
    checksum is spliced in before the body's first key (``checksum`` sorts before every key a
    manifest, layout or step record has; else the document is encoded again). Byte for byte
    what ``json.dumps({**body, "checksum": ...}, sort_keys=True)`` writes, at half the cost
    (a parity scheme's whole manifest is written at every step: ~10 ms for 6 ranks idle)."""
    text = json.dumps(body, separators=(",", ":"), sort_keys=True)
    tag = f"crc32c:{_crc32c.crc32c(text.encode()):08x}"
    if not body or min(body) <= "checksum":
        return json.dumps({**body, "checksum": tag}, separators=(",", ":"), sort_keys=True)
    return '{"checksum":' + json.dumps(tag) + "," + text[1:]


_SUM_PREFIX = b'{"checksum":"crc32c:'


_HEX8 = re.compile(rb"[0-9a-f]{8}")


def text_checksum_ok(text: str | bytes) -> bool:
    """True when ``text`` is a document as :func:`dumps_with_checksum` writes it (the checksum
    first, then the canonical body) and the checksum matches the body's bytes as they are:
    verified at C speed, without encoding the parsed document again (a restore reads every
    step's manifest on every node). False: not in that form, or not matching; the caller checks
    the parsed document the usual way (:func:`check_checksum`), which names what is wrong."""
    b = text if isinstance(text, bytes) else text.encode()
    n = len(_SUM_PREFIX)
    if not b.startswith(_SUM_PREFIX) or b[n + 8:n + 10] != b'",' or not _HEX8.fullmatch(b[n:n + 8]):
        return False
    return _crc32c.crc32c(memoryview(b)[n + 10:], _crc32c.crc32c(b"{")) == int(b[n:n + 8], 16)


def check_checksum(d: dict[str, Any], where: str) -> None:
    """Raise ManifestError unless ``d`` carries the checksum of its own canonical body."""
    got = d.get("checksum")
    if got is None:
        version = d.get("format_version")
        if version == 1:
            from aegis.snapshot.manifest import FORMAT_VERSION  # the reader's, for the message

            raise IncompatibleSnapshotError(
                f"{where}: written by an older aegis (format version 1, before manifests carried a "
                f"checksum); this aegis reads format {FORMAT_VERSION}. Restore or export it with the "
                "aegis that wrote it, or start a new job name"
            )
        raise ManifestError(f"{where}: manifest has no checksum; the file is damaged or forged")
    try:
        want = body_checksum(d)
    except (TypeError, ValueError) as e:  # a doc that did not come from JSON text
        raise ManifestError(f"{where}: manifest is not a JSON document ({e})") from None
    if got != want:
        raise ManifestError(
            f"{where}: manifest fails its checksum ({got!r} recorded, {want!r} computed): it was "
            "damaged after it was written; this copy is not used"
        )
