"""A step of an aegis snapshot (node store or durable tier): its entries from the manifest, and
verified raw chunks (:class:`AegisCopy`); which chunks a set of entries needs.
"""

from __future__ import annotations

import abc
from collections.abc import Collection, Mapping
from typing import Any

from aegis.errors import AegisError
from aegis.read._base import (  # noqa: F401
    ChunkKey,
    Copy,
    Location,
    Progress,
    _nop,
)
from aegis.snapshot.manifest import Manifest
from aegis.snapshot.shard import (
    chunks_for_ranges,
)

__all__ = ["needed_chunks", "AegisCopy"]


def _redundancy_summary(m: Manifest) -> dict[str, Any]:
    """The scheme that protects the snapshot in memory, and which node holds what."""
    if m.redundancy is None:
        return {"scheme": "replica",
                "copies": min((len(s.replicas) for s in m.shards), default=0)}
    nodes = m.nodes()
    red = m.redundancy
    return {"scheme": red.scheme, "groups": [
        {"members": list(g.members), "nodes": [nodes[r] for r in g.members],
         "parity_bytes_per_member": g.stored, "survives_losses": red.parity}
        for g in red.groups]} | ({"parity": red.parity, "ec_type": red.ec_type} if red.scheme == "rs" else {})


def needed_chunks(manifest: Manifest, names: Collection[str] | None) -> dict[int, set[int]]:
    """shard rank -> chunk indices holding the items of ``names`` (None: every chunk)."""
    out: dict[int, set[int]] = {}
    wanted = None if names is None else set(names)
    for shard in manifest.shards:
        if wanted is None:
            out[shard.rank] = set(range(len(shard.chunks)))
            continue
        ranges = [(i.file_offset, i.length) for i in shard.items if i.fqn in wanted]
        if ranges:
            out[shard.rank] = chunks_for_ranges(shard.chunks, ranges)
    return out


class AegisCopy(Copy):
    """A step of an aegis snapshot (node store or durable tier): the manifest, and its chunks."""

    manifest: Manifest

    def __init__(self, location: Location, manifest: Manifest) -> None:
        self.location = location
        self.manifest = manifest
        self.step = manifest.step
        self.entries = manifest.entries
        self.metadata = manifest.to_dcp_metadata()
        self.planner_data = manifest.planner_data
        self.state_kinds = manifest.state_kinds
        sizes: dict[str, int] = {}
        for shard in manifest.shards:
            for item in shard.items:
                if not item.is_tensor:
                    sizes[item.fqn] = sizes.get(item.fqn, 0) + item.length
        self.object_sizes = sizes

    def summary(self) -> dict[str, Any]:
        m = self.manifest
        return {
            "world_size": m.world_size,
            "created": m.created or None,
            "format_version": m.format_version,
            "state_kinds": dict(m.state_kinds),
            "mesh": dict(m.mesh),
            "timings": dict(m.timings),
            "shards": [
                {
                    "rank": s.rank,
                    "node": s.node,
                    "size": s.size,
                    "chunks": len(s.chunks),
                    "raw_bytes": s.data_bytes,
                    "stored_bytes": (sum(c.stored_length or 0 for c in s.chunks)
                                     if s.chunks and s.chunks[0].stored_length is not None else s.size),
                    "replicas": list(s.replicas),
                }
                for s in m.shards
            ],
            "redundancy": _redundancy_summary(m),
        }

    @abc.abstractmethod
    def has_shard(self, rank: int) -> bool:
        """Whether this copy holds the shard of ``rank`` at all (a node store holds its node's
        shards and replicas only; the durable tier holds every shard of a committed step)."""

    @abc.abstractmethod
    def read_chunks(self, wanted: Mapping[int, Collection[int]], progress: Progress = _nop,
                    threads: int = 8) -> tuple[dict[ChunkKey, bytes], dict[ChunkKey, AegisError]]:
        """The raw bytes of the chunks ``wanted`` (rank -> chunk indices), each checked against
        its crc32c; and, per chunk that could not be read intact, the error (never raised)."""

    def where(self) -> str:
        return f"{self.tier} {self.uri}"
