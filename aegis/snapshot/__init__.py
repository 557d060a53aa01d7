"""Bytes, stores and formats: the node store, the shard format, the manifest, DCP I/O and the
snapshot engine. Knows nothing about training loops."""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from aegis.snapshot.dcp_io import SafeLoadPlanner, ShardReader, ShardWriter
    from aegis.snapshot.engine import SnapshotEngine, SnapshotHandle, SnapshotResult
    from aegis.snapshot.manifest import FORMAT_VERSION, Manifest
    from aegis.snapshot.node_store import NodeStore

# Imported on first use: these import torch, which the object stores (objstore, s3, retry)
# and the ``aegis`` commands that only talk to them do not need.
_LAZY = {
    "SafeLoadPlanner": "aegis.snapshot.dcp_io",
    "ShardReader": "aegis.snapshot.dcp_io",
    "ShardWriter": "aegis.snapshot.dcp_io",
    "SnapshotEngine": "aegis.snapshot.engine",
    "SnapshotHandle": "aegis.snapshot.engine",
    "SnapshotResult": "aegis.snapshot.engine",
    "FORMAT_VERSION": "aegis.snapshot.manifest",
    "Manifest": "aegis.snapshot.manifest",
    "NodeStore": "aegis.snapshot.node_store",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'aegis.snapshot' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "FORMAT_VERSION",
    "Manifest",
    "NodeStore",
    "SafeLoadPlanner",
    "ShardReader",
    "ShardWriter",
    "SnapshotEngine",
    "SnapshotHandle",
    "SnapshotResult",
]
