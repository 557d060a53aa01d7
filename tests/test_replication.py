"""Placement (pure) and replication between simulated nodes on real gloo ranks."""

from __future__ import annotations

import filecmp
import os
from pathlib import Path

import pytest

from aegis.snapshot.node_store import NodeStore
from aegis.snapshot.placement import Placement
from tests.dist_utils import run_ranks
from tests.models import build, train_step


@pytest.mark.quick
def test_ring_placement_same_local_rank_next_nodes() -> None:
    nodes = ["a", "a", "b", "b", "c", "c"]
    p = Placement.build(nodes, None, 1)
    assert [p.targets(r) for r in range(6)] == [[2], [3], [4], [5], [0], [1]]
    assert p.sources(0) == [4] and p.sources(3) == [1]
    p2 = Placement.build(nodes, None, 2)
    assert p2.targets(0) == [2, 4] and p2.targets(4) == [0, 2]
    # more replicas than other nodes: capped
    assert Placement.build(["a", "b"], None, 5).targets(0) == [1]
    assert Placement.build(["a"], None, 1).targets(0) == []


@pytest.mark.quick
def test_placement_skips_own_failure_domain_while_others_exist() -> None:
    nodes = ["a", "b", "c", "d"]
    domains = ["rack1", "rack1", "rack2", "rack2"]
    p = Placement.build(nodes, domains, 1)
    assert p.targets(0) == [2]  # b shares a's rack: skipped for c
    assert p.targets(1) == [2]
    assert p.targets(2) == [0]
    p2 = Placement.build(nodes, domains, 3)
    assert p2.targets(0) == [2, 3, 1]  # other racks first, then the same rack


def node_env(rank: int, per_node: int) -> str:
    node = f"node{rank // per_node}"
    os.environ["AEGIS_NODE_ID"] = node
    return node


def _replicate(rank: int, world: int, root: str, per_node: int) -> str:
    from aegis import Manager, ModelOptimizerState

    node = node_env(rank, per_node)
    model, opt, sched = build(world)
    mgr = Manager("rep", {"model": ModelOptimizerState(model, opt), "sched": sched},
                  store_dir=f"{root}/{node}", replicas=1, keep=1, verbose=False)
    for step in range(1, 4):
        train_step(model, opt, sched, step, rank)
        mgr.save(step)
    result = mgr.wait()
    assert result is not None and result.committed and result.replica_bytes > 0
    mgr.close()
    return node


def test_each_shard_is_replicated_to_the_next_node_and_committed_everywhere(store_dir: Path) -> None:
    nodes = run_ranks(4, _replicate, str(store_dir), 2)
    assert nodes == ["node0", "node0", "node1", "node1"]
    stores = {n: NodeStore(store_dir / n, "rep") for n in ("node0", "node1")}
    for store in stores.values():
        infos = store.steps()
        assert [(s.step, s.committed) for s in infos] == [(3, True)], infos
        assert infos[0].shard_ranks == (0, 1, 2, 3)  # own two + two replicas
        m = store.read_manifest(3)  # format 4: assembled from the shards held here
        assert [rec.node for rec in m.shards] == ["node0", "node0", "node1", "node1"]
        for rec in m.shards:
            store.verify_shard(3, rec)  # the replica verifies against its owner's record
    for r in range(4):
        a = stores["node0"].shard_path(3, r)
        b = stores["node1"].shard_path(3, r)
        assert filecmp.cmp(a, b, shallow=False)
