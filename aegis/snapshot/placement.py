"""Replica placement: pure functions of the node map, no I/O.

Nodes are ordered by node id. The rank with local index l on node i replicates to local index l
on nodes i+1 .. i+replicas (mod N), skipping nodes of its own failure domain while nodes of other
domains remain. With replicas = 1 any single node loss is recoverable from memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Placement"]


@dataclass(frozen=True)
class Placement:
    """``nodes[r]`` / ``domains[r]``: node id and failure domain of rank r."""

    nodes: tuple[str, ...]
    domains: tuple[str, ...]
    replicas: int

    @classmethod
    def build(cls, nodes: Sequence[str], domains: Sequence[str] | None, replicas: int) -> Placement:
        doms = tuple(domains) if domains is not None else tuple(nodes)
        if len(doms) != len(nodes):
            raise ValueError("one failure domain per rank")
        return cls(tuple(nodes), doms, replicas)

    @property
    def node_order(self) -> list[str]:
        return sorted(set(self.nodes))

    def ranks_of(self, node: str) -> list[int]:
        return [r for r, n in enumerate(self.nodes) if n == node]

    def local_index(self, rank: int) -> int:
        return self.ranks_of(self.nodes[rank]).index(rank)

    @property
    def effective_replicas(self) -> int:
        return max(0, min(self.replicas, len(self.node_order) - 1))

    def domain_of(self, node: str) -> str:
        return self.domains[self.nodes.index(node)]

    def target_nodes(self, rank: int) -> list[str]:
        order = self.node_order
        mine = self.nodes[rank]
        i = order.index(mine)
        ring = [order[(i + k) % len(order)] for k in range(1, len(order))]
        my_domain = self.domain_of(mine)
        other = [n for n in ring if self.domain_of(n) != my_domain]
        same = [n for n in ring if self.domain_of(n) == my_domain]
        return (other + same)[: self.effective_replicas]

    def targets(self, rank: int) -> list[int]:
        """Ranks that hold replicas of ``rank``'s shard."""
        li = self.local_index(rank)
        out = []
        for node in self.target_nodes(rank):
            ranks = self.ranks_of(node)
            out.append(ranks[li % len(ranks)])
        return out

    def sources(self, rank: int) -> list[int]:
        """Ranks whose shards ``rank`` holds replicas of (ascending)."""
        return [r for r in range(len(self.nodes)) if rank in self.targets(r)]
