"""Errors of the reading layer (:mod:`aegis.read`), on top of :mod:`aegis.errors`.

Who raises what when a snapshot is read outside a training job:

* :class:`SourceError` (a ``ValueError``): the URI names nothing aegis can read: missing, the wrong
  kind of directory, an unsupported scheme, several jobs where one is needed, URIs of different
  jobs opened together.
* :class:`aegis.errors.NoSnapshotError`: the step asked for is not committed in any copy.
* :class:`aegis.errors.ManifestError`: a manifest (or a DCP ``.metadata``) cannot be read or
  trusted, in every copy that was opened.
* :class:`aegis.errors.CorruptShardError`: bytes fail their crc32c in every copy that holds them.
* :class:`ReadError`: reading failed after the snapshot was opened (DCP refused the plan, a file
  of a plain DCP checkpoint vanished).
* :class:`aegis.errors.StateMismatchError`: ``load_into`` got a target whose keys or shapes do not
  match the snapshot.

The ``aegis`` command maps them to its exit codes: ``CorruptShardError`` and ``ReadError`` 1,
the others 2. This module imports nothing heavy (the CLI imports it for ``aegis plan`` too).
"""

from __future__ import annotations

from aegis.errors import AegisError

__all__ = ["SourceError", "ReadError", "DamagedCopyWarning"]


class SourceError(AegisError, ValueError):
    """A URI that names no aegis snapshots or DCP checkpoints, or not the one asked for."""


class ReadError(AegisError):
    """Reading an opened snapshot failed (not a checksum: those are CorruptShardError)."""


class DamagedCopyWarning(UserWarning):
    """A copy of a snapshot was damaged and another copy was read instead (the message names
    both); also recorded in ``Snapshot.notes``."""
