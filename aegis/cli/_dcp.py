"""The DCP plumbing moved to :mod:`aegis.read.dcp_meta` (the reading layer below the command);
these names stay importable from here."""

from aegis.read.dcp_meta import CollectPlanner, CopyPlanner, SafeFileSystemReader, read_dcp_metadata

__all__ = ["SafeFileSystemReader", "read_dcp_metadata", "CollectPlanner", "CopyPlanner"]
