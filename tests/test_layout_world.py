"""A round's node layout and the device mesh a training function builds from ``World``
(issue 38, part 2): node index and count, local rank and size from the round's member list,
dimensions with one inferred, clear errors for a world the dimensions do not divide or a
within-node dimension a round would stretch across two nodes."""

from __future__ import annotations

from typing import Any

import pytest

from aegis import ConfigError, World
from aegis.training.inprocess.layout import Layout, infer_dims
from tests.dist_utils import run_ranks


def _members(*nodes: tuple[str, list[int]]) -> list[str]:
    return [f"{n}/{lr}/{1000 + 10 * i + lr}" for i, (n, lrs) in enumerate(nodes) for lr in lrs]


@pytest.mark.quick
def test_layout_of_whole_nodes() -> None:
    members = _members(("node-0", [0, 1]), ("node-1", [0, 1]), ("node-2", [0, 1]))
    seen = [(w.node_index, w.num_nodes, w.local_rank, w.local_size, w.whole_nodes)
            for w in (World(rank=r, size=6, round=0, node="", members=members) for r in range(6))]
    assert seen == [(0, 3, 0, 2, True), (0, 3, 1, 2, True), (1, 3, 0, 2, True),
                    (1, 3, 1, 2, True), (2, 3, 0, 2, True), (2, 3, 1, 2, True)]


@pytest.mark.quick
def test_layout_of_a_round_with_a_partial_node() -> None:
    # one worker of node-1 lost: the round the issue saw, 5 ranks
    members = _members(("node-0", [0, 1]), ("node-1", [0]), ("node-2", [0, 1]))
    lay = Layout.of(members, 2)
    assert (lay.node_index, lay.num_nodes, lay.local_rank, lay.local_size) == (1, 3, 0, 1)
    assert not lay.whole_nodes
    # a node whose ranks are not contiguous is not whole either
    mixed = ["a/0/1", "b/0/2", "a/1/3", "b/1/4"]
    assert not Layout.of(mixed, 0).whole_nodes
    assert Layout.of(mixed, 2).local_rank == 1


@pytest.mark.quick
def test_dimensions_with_one_inferred() -> None:
    assert infer_dims(6, {"dp_shard": -1, "tp": 2}) == {"dp_shard": 3, "tp": 2}
    assert infer_dims(4, {"dp_replicate": 2, "dp_shard": 2}) == {"dp_replicate": 2, "dp_shard": 2}
    with pytest.raises(ConfigError, match=r"a world of 5 rank\(s\) does not divide .* not a multiple of 2"):
        infer_dims(5, {"dp_shard": -1, "tp": 2})
    with pytest.raises(ConfigError, match="at most one can be -1"):
        infer_dims(4, {"a": -1, "b": -1})
    with pytest.raises(ConfigError, match="holds 4 rank.*the world has 6"):
        infer_dims(6, {"a": 2, "b": 2})
    with pytest.raises(ConfigError, match="positive size"):
        infer_dims(6, {"a": 0, "b": -1})


def _meshes(rank: int, world: int, members: list[str]) -> dict[str, Any]:
    w = World(rank=rank, size=world, round=0, node="", members=members)
    hsdp = w.mesh("cpu", dp_replicate=-1, dp_shard=2)
    tp = w.mesh("cpu", dp_shard=-1, tp=2, within_node=("tp",))
    out: dict[str, Any] = {
        "hsdp": (tuple(hsdp.shape), hsdp.mesh_dim_names, hsdp["dp_shard"].get_local_rank()),
        "tp": (tuple(tp.shape), tp.mesh_dim_names, tp["tp"].get_local_rank(),
               sorted(tp["tp"].mesh.flatten().tolist())),
    }
    try:
        w.mesh("cpu", dp_shard=-1, tp=4, within_node=("tp",))
        out["tp4"] = "built"
    except ConfigError as e:
        out["tp4"] = str(e)
    return out


def test_meshes_from_world_on_real_ranks() -> None:
    members = _members(("node-0", [0, 1]), ("node-1", [0, 1]))
    out = run_ranks(4, _meshes, members)
    for r, o in enumerate(out):
        assert o["hsdp"] == ((2, 2), ("dp_replicate", "dp_shard"), r % 2)
        # the tp group of a rank is its node's two ranks
        assert o["tp"] == ((2, 2), ("dp_shard", "tp"), r % 2, [r - r % 2, r - r % 2 + 1])
        assert "keeps ['tp'] within a node (4 rank(s) a group)" in o["tp4"]
        assert "node-0: ranks [0, 1], node-1: ranks [2, 3]" in o["tp4"]


def _timeouts(rank: int, world: int, members: list[str]) -> dict[str, Any]:
    import time
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from aegis.training.inprocess.round import Round

    Round.collective_timeout = timedelta(seconds=3)
    w = World(rank=rank, size=world, round=0, node="", members=members)
    mesh = w.mesh("cpu", dp_replicate=-1, dp_shard=2)
    out: dict[str, Any] = {d: str(mesh.get_group(d)._get_backend(torch.device("cpu")).options._timeout)
                           for d in ("dp_replicate", "dp_shard")}
    t = torch.ones(1)
    dist.all_reduce(t, group=mesh.get_group("dp_shard"))
    if rank == 0:  # its node's other rank never enters: the collective ends at the timeout
        t0 = time.monotonic()
        try:
            dist.all_reduce(t, group=mesh.get_group("dp_shard"))
            out["stuck"] = "completed"
        except RuntimeError:
            out["stuck"] = time.monotonic() - t0
    dist.barrier()
    return out


def test_a_mesh_from_world_takes_the_rounds_collective_timeout() -> None:
    """``init_device_mesh`` makes its groups with ``new_group``'s default timeout, 30 minutes,
    not the default group's: a collective on one of them that no fence ends (a thawed worker
    waiting on its node's peer, gone from the round: the chaos campaign) waited that long.
    ``World.mesh`` gives them the round's collective timeout."""
    members = _members(("node-0", [0, 1]), ("node-1", [0, 1]))
    out = run_ranks(4, _timeouts, members, timeout=90)
    assert all(o["dp_replicate"] == o["dp_shard"] == "0:00:03" for o in out), out
    assert isinstance(out[0]["stuck"], float) and out[0]["stuck"] < 20, out[0]


def _published(rank: int, world: int, members: list[str]) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_store

    from aegis.training.inprocess import _sockets
    from aegis.training.inprocess.abandon import GlooAbandon
    from aegis.training.inprocess.round import Round

    ab = GlooAbandon()
    ab.begin(_get_default_store(), 7, members[rank])  # the round's sockets: opened from here on
    Round.abandon = ab
    try:
        mesh = World(rank=rank, size=world, round=7, node="", members=members).mesh(
            "cpu", dp_replicate=-1, dp_shard=2)
        info = ab._info(members[rank])
        mine = _sockets.opened_since(ab.baseline)
        dist.barrier()
        return {"info": info, "now": mine, "dims": mesh.mesh_dim_names}
    finally:
        Round.abandon = None


def test_a_mesh_from_world_publishes_its_groups_sockets_at_once() -> None:
    """A process frozen after building its mesh and before its Manager started (which
    publishes the round's sockets) held mesh connections no fence knew of: its peers could not
    cut them, nor could it, thawed. ``World.mesh`` publishes the new groups' sockets itself."""
    members = _members(("node-0", [0, 1]), ("node-1", [0, 1]))
    out = run_ranks(4, _published, members, timeout=90)
    for o in out:
        assert o["info"] is not None, "nothing published after the mesh was built"
        # both groups' listeners (dp_replicate, dp_shard) and their connections
        assert len(o["info"]["listen"]) >= 2 and o["info"]["local"], o
        assert set(o["now"]["listen"]) <= set(o["info"]["listen"]), o


@pytest.mark.quick
def test_a_within_node_dimension_is_refused_on_a_partial_node_before_any_group() -> None:
    members = _members(("node-0", [0, 1]), ("node-1", [0]), ("node-2", [0, 1]))
    w = World(rank=0, size=5, round=1, node="node-0", members=members)
    with pytest.raises(ConfigError, match=r"a world of 5 rank\(s\) does not divide"):
        w.mesh("cpu", dp_shard=-1, tp=2, within_node=("tp",))
    # 4 ranks divide (2, 2), but nodes of 2, 1 and 1 ranks are not whole: a tp group would
    # pair node-1's rank with node-2's
    partial = World(rank=0, size=4, round=1, node="node-0",
                    members=_members(("node-0", [0, 1]), ("node-1", [0]), ("node-2", [1])))
    with pytest.raises(ConfigError, match="a group would span two nodes"):
        partial.mesh("cpu", dp_shard=-1, tp=2, within_node=("tp",))
    # whole nodes, but ranks interleaved across them
    w4 = World(rank=0, size=4, round=1, node="node-0", members=["a/0/1", "b/0/2", "a/1/3", "b/1/4"])
    with pytest.raises(ConfigError, match="a group would span two nodes"):
        w4.mesh("cpu", dp_shard=-1, tp=2, within_node=("tp",))
    with pytest.raises(ConfigError, match="must be the innermost"):
        w4.mesh("cpu", tp=2, dp_shard=-1, within_node=("tp",))
