"""Replica placement: pure functions of the node map, no I/O.

Nodes are ordered by node id. The rank with local index l on node i replicates to local index l
on nodes i+1 .. i+replicas (mod N), skipping nodes of its own failure domain while nodes of other
domains remain. With replicas = 1 any single node loss is recoverable from memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Placement", "parity_groups"]


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


def parity_groups(placement: Placement, group_size: int) -> list[tuple[int, ...]]:
    """XOR parity groups (issue 16): one rank per node per group, ranks listed in member order.

    For each local index l, the nodes that have an l-th rank are put in an order that cycles
    through the failure domains (a, b, c, a, b, c, ...) and cut into
    ``max(1, nodes // group_size)`` consecutive runs of sizes within one of each other, so a
    group has ``group_size`` to ``2 * group_size - 1`` members and no two from one domain
    while a group is no larger than the number of domains.
    Raises ValueError when fewer than two nodes have an l-th rank (nothing to rebuild from).
    """
    if group_size < 2:
        raise ValueError(f"group_size={group_size}: a parity group needs at least 2 members")
    by_domain: dict[str, list[str]] = {}
    for node in placement.node_order:
        by_domain.setdefault(placement.domain_of(node), []).append(node)
    order: list[str] = []
    queues = [list(v) for _, v in sorted(by_domain.items())]
    while any(queues):
        for q in queues:
            if q:
                order.append(q.pop(0))
    groups: list[tuple[int, ...]] = []
    depth = max(len(placement.ranks_of(n)) for n in order)
    for li in range(depth):
        nodes = [n for n in order if len(placement.ranks_of(n)) > li]
        if len(nodes) < 2:
            raise ValueError(
                f"only {len(nodes)} node(s) have a rank with local index {li}: a parity group "
                "needs ranks on at least 2 nodes; run at least 2 nodes with the same number of "
                "ranks each, or use replicas")
        count = max(1, len(nodes) // group_size)
        start = 0
        for g in range(count):  # consecutive runs of the domain-cycling order, sizes within 1
            size = len(nodes) // count + (1 if g < len(nodes) % count else 0)
            groups.append(tuple(placement.ranks_of(n)[li] for n in nodes[start:start + size]))
            start += size
    return groups
