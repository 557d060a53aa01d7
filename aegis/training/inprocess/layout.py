"""Where a round's ranks sit on the nodes, and the device mesh a training function builds from it.

A round's members are uids ``"<node>/<local rank>/<pid>"`` in rank order (:mod:`.membership`).
:class:`Layout` reads the nodes out of them: this rank's node index and the node count, its
local rank (its place among its node's members in this round, in rank order) and the node's
size in this round, and whether the round is made of whole nodes (every node the same size, its
ranks contiguous). :func:`build_mesh` makes the round's ``DeviceMesh`` from named dimensions,
one of them inferred, as torchtitan's ``ParallelDims`` does with ``dp_shard=-1``, and refuses,
before any group is created, a world the dimensions do not divide or a within-node dimension
that the round's layout would stretch across two nodes.

Pure functions of the member list (no store, no collective): every rank computes the same
layout from the same list. Cost: O(world) per round, once, on each rank (the list is already
there).
"""

from __future__ import annotations

import contextlib
import functools
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from aegis.errors import ConfigError

__all__ = ["Layout", "split_uid", "uid_order", "whole_nodes", "whole_node_vote", "infer_dims",
           "build_mesh"]


def split_uid(uid: str) -> tuple[str, int]:
    """``"<node>/<local rank>/<pid>"`` -> (node, local rank as launched)."""
    node, local, _pid = uid.rsplit("/", 2)
    return node, int(local)


_DIGITS = re.compile(r"(\d+)")


@functools.lru_cache(maxsize=1 << 16)
def _natural(text: str) -> tuple[Any, ...]:
    """``"node-10"`` after ``"node-9"``: digit runs compare as numbers. Cached: a proposer
    orders a node's processes by the same node name (measured: 16,384 uids sorted in 0.27 s
    uncached, most of it here; a first round's proposer sorts them once)."""
    return tuple((0, int(t), "") if t.isdigit() else (1, 0, t) for t in _DIGITS.split(text) if t)


def uid_order(uid: str) -> tuple[Any, ...]:
    """The order of processes new to a round: by node (digit runs as numbers), then local rank
    as a number (``node-3/0`` before ``node-3/1``, ``/2`` before ``/10``), then pid."""
    parts = uid.rsplit("/", 2)
    if len(parts) != 3 or not parts[1].isdigit():
        return (_natural(uid), -1, "")
    return (_natural(parts[0]), int(parts[1]), parts[2])


def whole_nodes(uids: Sequence[str], per_node: int,
                first: Sequence[str] = ()) -> tuple[list[str], list[str]]:
    """A whole-node round from the processes that joined it: ``(kept, left)``. ``kept``: the
    processes of every node whose local ranks ``0 .. per_node - 1`` are all there, each node's
    contiguous and in local-rank order; nodes in the order of their first process in ``first``
    (the previous round: survivors keep their ranks where they can), then the others in
    :func:`uid_order`. ``left``: the rest (a node missing a worker; a local rank ``>= per_node``;
    a second process for a local rank, the one of ``first`` or the first in order staying).
    O(n log n) in the processes, on the proposer only."""
    where = {u: k for k, u in enumerate(first)}
    nodes: dict[str, dict[int, str]] = {}
    left: list[str] = []
    for u in sorted(uids, key=lambda u: (where.get(u, len(where)), uid_order(u))):
        try:
            node, local = split_uid(u)
        except ValueError:
            left.append(u)
            continue
        slots = nodes.setdefault(node, {})
        if local >= per_node or local in slots:
            left.append(u)
        else:
            slots[local] = u
    kept: list[str] = []
    for slots in nodes.values():
        if len(slots) == per_node:
            kept.extend(slots[lr] for lr in range(per_node))
        else:
            left.extend(slots.values())
    return kept, left


def whole_node_vote(pending: Sequence[tuple[int, str]], members: Sequence[str], per_node: int,
                    room_nodes: int | None = None) -> int | None:
    """The join slot up to which a whole-node round admits the processes that registered
    (``pending``: ``(slot, uid)`` of the registrations not yet admitted): the slot that
    completed the last whole node, at most ``room_nodes`` nodes (in the order they completed);
    None if no node waiting is whole. The survivors end a round to admit joiners only then: a
    node missing a worker waits without costing them a round per snapshot. A node of the round
    (``members``) is never a joiner's. O(pending)."""
    mine: set[str] = set()
    for u in members:
        with contextlib.suppress(ValueError):
            mine.add(split_uid(u)[0])
    latest: dict[str, dict[int, int]] = {}
    for slot, uid in sorted(pending):
        try:
            node, local = split_uid(uid)
        except ValueError:
            continue
        if node not in mine and 0 <= local < per_node:
            latest.setdefault(node, {})[local] = slot
    done = sorted(max(s.values()) for s in latest.values() if len(s) == per_node)
    if room_nodes is not None:
        done = done[:max(0, room_nodes)]
    return done[-1] if done else None


@dataclass(frozen=True)
class Layout:
    """The nodes of one round, as one rank sees them (see the module docstring)."""

    rank: int
    nodes: tuple[str, ...]  # in the order of their first rank
    node_of_rank: tuple[int, ...]  # rank -> index into nodes

    @classmethod
    def of(cls, members: Sequence[str], rank: int) -> Layout:
        index: dict[str, int] = {}
        node_of: list[int] = []
        for uid in members:
            node = split_uid(uid)[0]
            node_of.append(index.setdefault(node, len(index)))
        if not 0 <= rank < len(members):
            raise ValueError(f"rank {rank} is not in a round of {len(members)} members")
        return cls(rank, tuple(index), tuple(node_of))

    @property
    def node_index(self) -> int:
        return self.node_of_rank[self.rank]

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    def ranks_of(self, node_index: int) -> list[int]:
        return [r for r, n in enumerate(self.node_of_rank) if n == node_index]

    @property
    def local_rank(self) -> int:
        """This rank's place among its node's ranks in this round (rank order)."""
        return self.ranks_of(self.node_index).index(self.rank)

    @property
    def local_size(self) -> int:
        return self.node_of_rank.count(self.node_index)

    @property
    def whole_nodes(self) -> bool:
        """Every node holds the same number of ranks, and each node's ranks are contiguous."""
        sizes = {self.node_of_rank.count(n) for n in range(self.num_nodes)}
        contiguous = all(a <= b for a, b in zip(self.node_of_rank, self.node_of_rank[1:], strict=False))
        return len(sizes) == 1 and contiguous

    def describe(self) -> str:
        return ", ".join(f"{name}: ranks {self.ranks_of(i)}" for i, name in enumerate(self.nodes))


def infer_dims(size: int, dims: Mapping[str, int]) -> dict[str, int]:
    """Named mesh dimensions (outermost first) with at most one ``-1``, inferred so that their
    product is ``size``. Raises ConfigError naming the dimensions and the world."""
    if not dims:
        raise ConfigError("a device mesh needs at least one named dimension, e.g. dp_shard=-1")
    bad = {k: v for k, v in dims.items() if v == 0 or v < -1}
    if bad:
        raise ConfigError(f"mesh dimensions {bad}: each must be a positive size, or -1 (one of "
                          "them) for 'whatever the world leaves'")
    free = [k for k, v in dims.items() if v == -1]
    if len(free) > 1:
        raise ConfigError(f"mesh dimensions {dict(dims)}: at most one can be -1 (inferred), got "
                          f"{free}")
    fixed = math.prod(v for v in dims.values() if v != -1)
    if free:
        if size % fixed:
            raise ConfigError(
                f"a world of {size} rank(s) does not divide into the mesh {dict(dims)}: "
                f"{size} is not a multiple of {fixed} (the product of the fixed dimensions). "
                "Make the fixed sizes divide every world the job can shrink to, or rebuild "
                "the parallelism from the world size in train(world)")
        return {k: (size // fixed if v == -1 else v) for k, v in dims.items()}
    if fixed != size:
        raise ConfigError(f"mesh {dict(dims)} holds {fixed} rank(s), the world has {size}: give "
                          "one dimension as -1 to fit whatever world the round has")
    return dict(dims)


def build_mesh(device_type: str, layout: Layout, size: int, dims: Mapping[str, int],
               within_node: Sequence[str] = (), timeout: Any = None) -> Any:
    """``init_device_mesh(device_type, shape, mesh_dim_names=names)`` for the round, on the
    round's default group. ``within_node``: dimensions whose groups must not span two nodes
    (tensor parallel over NVLink): they must be the innermost ones, and the round must be made
    of whole nodes whose size is a multiple of their product. Every rank of the round calls it.

    ``timeout`` (a timedelta; the round's collective timeout): the mesh's groups on ``"cpu"``
    (gloo) get it too. ``init_device_mesh`` makes them with ``new_group``'s default, 30 minutes,
    not the default group's timeout: a collective on one that no fence ended (a thawed worker
    waiting on its own node's peer that had left the round, seen in the chaos campaign) waited
    that long. NCCL groups keep torch's default (their options carry more than a timeout)."""
    shape = infer_dims(size, dims)
    names = list(shape)
    inner = list(within_node)
    unknown = [d for d in inner if d not in shape]
    if unknown:
        raise ConfigError(f"within_node names {unknown}, not dimensions of the mesh {names}")
    if inner and names[-len(inner):] != sorted(inner, key=names.index):
        raise ConfigError(f"within_node dimensions {inner} must be the innermost of the mesh "
                          f"{names} (a group of an inner dimension is consecutive ranks)")
    span = math.prod(shape[d] for d in inner)
    if inner and (not layout.whole_nodes or layout.local_size % span):
        raise ConfigError(
            f"the mesh {shape} keeps {inner} within a node ({span} rank(s) a group), but this "
            f"round's nodes are {layout.describe()}: a group would span two nodes. Run with "
            "whole-node rounds, or leave within_node out to allow it")
    from torch.distributed.device_mesh import init_device_mesh

    override: dict[int | str, Any] | None = None
    if timeout is not None and device_type == "cpu":
        import torch.distributed as dist

        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        options._timeout = timeout  # aegis: private-assign (torch exposes no other way)
        override = {name: ("gloo", options) for name in names}
    return init_device_mesh(device_type, tuple(shape.values()), mesh_dim_names=tuple(names),
                            backend_override=override)
