"""Bytes, stores and formats: the node store, the shard format, the manifest, DCP I/O and the
snapshot engine. Knows nothing about training loops."""

from aegis.snapshot.dcp_io import SafeLoadPlanner, ShardReader, ShardWriter
from aegis.snapshot.engine import SnapshotEngine, SnapshotHandle, SnapshotResult
from aegis.snapshot.manifest import FORMAT_VERSION, Manifest
from aegis.snapshot.node_store import NodeStore

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
