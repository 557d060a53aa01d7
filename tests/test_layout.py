"""Format 4 in a real job (issue 24): per step a node store writes a step record of constant size
(the layout once per plan; each shard's own index holds its records), restores put the manifest
together from the shards' indexes, and node stores written before format 4 still restore."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from aegis.snapshot.node_manifest import StepManifest
from aegis.snapshot.node_store import NodeStore
from tests.dist_utils import run_ranks
from tests.models import build, full_state, train_step
from tests.test_manager import _manager, _tensors, assert_bitwise_equal

JOB = "t"


def _train(rank: int, world: int, store: str, steps: int) -> dict[str, Any]:
    model, opt, sched = build(world, seed=0)
    mgr = _manager(store, model, opt, sched, replicas=0, keep=2)
    mgr.restore()
    for step in range(1, steps + 1):
        train_step(model, opt, sched, step, rank)
        mgr.save(step)
    mgr.wait()
    saved = _tensors(full_state(model, opt))
    mgr.close()
    return saved if rank == 0 else {}


def _restore(rank: int, world: int, store: str) -> dict[str, Any]:
    model, opt, sched = build(world, seed=5)
    mgr = _manager(store, model, opt, sched, replicas=0)
    step = mgr.restore()
    got = _tensors(full_state(model, opt))
    mgr.close()
    return {"step": step, "state": got if rank == 0 else {}}


def test_per_step_metadata_does_not_grow_with_the_world(tmp_path: Path) -> None:
    """Same model, one node, 2 and 4 ranks: the step record is the same size (the whole
    manifest of format 2 grew by about 15 KB per rank), one layout per plan."""
    sizes = {}
    for world in (2, 4):
        root = tmp_path / f"w{world}"
        run_ranks(world, _train, str(root), 4)
        ns = NodeStore(root, JOB)
        step_bytes = [ns.manifest_path(s).stat().st_size for s in (3, 4)]
        m = ns.read_node_manifest(4)
        assert isinstance(m, StepManifest) and m.world_size == world
        layouts = sorted(p.name for p in ns.layouts_dir.iterdir())
        assert len(layouts) == 2 and layouts[1] == layouts[0] + ".2", layouts  # one, two copies
        whole = len(ns.read_manifest(4).to_json())
        sizes[world] = {"step": max(step_bytes), "layout": ns.layout_path(m.layout).stat().st_size,
                        "whole_format2": whole}
    print(json.dumps(sizes))
    assert sizes[4]["step"] <= sizes[2]["step"] + 8, sizes  # digits of timings may differ
    assert sizes[4]["whole_format2"] > sizes[2]["whole_format2"] * 1.3, sizes


def test_node_stores_written_before_format_4_still_restore(tmp_path: Path) -> None:
    """A node store of whole (format 2) manifests, as an older aegis wrote them: restored
    bitwise, and a new snapshot on top of it is format 4."""
    root = tmp_path / "old"
    saved = run_ranks(2, _train, str(root), 3)[0]
    ns = NodeStore(root, JOB)
    for info in ns.steps():
        whole = ns.read_manifest(info.step)
        ns.manifest_path(info.step).write_text(whole.to_json())
    for f in ns.layouts_dir.iterdir():
        f.unlink()
    assert json.loads(ns.manifest_path(3).read_text())["format_version"] == 2
    out = run_ranks(2, _restore, str(root))
    assert out[0]["step"] == 3
    assert_bitwise_equal(saved, out[0]["state"])


def _parity_step() -> StepManifest:
    from aegis.snapshot.erasure import stripe_layout
    from aegis.snapshot.manifest import ParityGroup, Redundancy

    sizes = {0: 1000, 1: 1200, 2: 900, 3: 1100, 4: 1000, 5: 800}
    groups = []
    for members in ((0, 2, 4), (1, 3, 5)):
        seg = stripe_layout([sizes[m] for m in members], 1).segment_size
        groups.append(ParityGroup(members, seg, tuple(100 + m for m in members)))
    return StepManifest(job="j", step=7, world_size=6, layout="0123456789abcdef",
                        shards_digest="sha256:00", total_bytes=sum(sizes.values()),
                        parity=Redundancy("xor", tuple(groups)),
                        members={r: (size, size - 100) for r, size in sizes.items()})


def test_a_parity_step_record_keeps_its_nodes_groups_and_round_trips() -> None:
    """Issue 40: with parity groups a node keeps the constant step record plus its own groups'
    numbers (each member's size and index start), not the whole manifest."""
    from aegis.snapshot.node_manifest import load_node_manifest, merge_parity

    whole = _parity_step()
    mine = whole.for_ranks([1])  # the node of rank 1: only group (1, 3, 5)
    assert mine.parity is not None and [g.members for g in mine.parity.groups] == [(1, 3, 5)]
    assert set(mine.members) == {1, 3, 5}
    back = load_node_manifest(mine.to_json(), where="t")
    assert back == mine
    # the nodes' records pooled give every group once
    red, members = merge_parity([whole.for_ranks([0]), whole.for_ranks([3]), whole.for_ranks([1])])
    assert red is not None and sorted(g.members for g in red.groups) == [(0, 2, 4), (1, 3, 5)]
    assert members == whole.members


def test_a_damaged_parity_step_record_is_refused() -> None:
    import pytest

    from aegis.errors import ManifestError
    from aegis.snapshot.manifest import dumps_with_checksum
    from aegis.snapshot.node_manifest import load_node_manifest

    good = json.loads(_parity_step().to_json())
    for damage in ("short", "start", "segment", "alone"):
        d = json.loads(json.dumps(good))
        d.pop("checksum")
        if damage == "short":
            d["parity_shards"] = d["parity_shards"][:-1]
        elif damage == "start":
            d["parity_shards"][0] = [10, 20]  # the index after the shard's end
        elif damage == "segment":
            d["parity"]["groups"][0]["segment_size"] += 64
        else:
            d.pop("parity_shards")
        with pytest.raises(ManifestError):
            load_node_manifest(dumps_with_checksum(d), where="t")
