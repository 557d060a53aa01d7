"""XOR and Reed-Solomon parity groups (issue 16) on real gloo ranks, one rank per simulated
node: each node keeps its shard plus k/(N-k) of parity, a lost node's shard is rebuilt from the
survivors (bitwise, resharded when the world shrinks), and losses beyond the parity, or a
corrupt parity, go to the durable tier or fail with an error naming the group and the lost
members."""

from __future__ import annotations

import dataclasses
import json
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from aegis.errors import ManifestError
from aegis.snapshot.erasure import xor_layout
from aegis.snapshot.manifest import Manifest, ParityGroup, Redundancy
from aegis.snapshot.node_manifest import StepManifest
from aegis.snapshot.node_store import NodeStore
from aegis.snapshot.placement import Placement, parity_groups
from tests.dist_utils import run_ranks
from tests.models import build, full_state, train_step
from tests.test_cli import inproc
from tests.test_manager import _tensors, assert_bitwise_equal
from tests.test_manifest import sample
from tests.test_recovery import _restore, lose

JOB = "t"
NODES = ["a", "b", "c", "d", "e"]


@pytest.mark.quick
def test_groups_take_one_rank_per_node_and_spread_failure_domains() -> None:
    five = Placement.build(NODES, None, 0)
    assert parity_groups(five, 5) == [(0, 1, 2, 3, 4)]
    assert parity_groups(five, 2) == [(0, 1, 2), (3, 4)]  # 5 // 2 groups, none of one member
    two_per_node = Placement.build(["a", "a", "b", "b", "c", "c"], None, 0)
    assert parity_groups(two_per_node, 3) == [(0, 2, 4), (1, 3, 5)]
    # four nodes in two racks, groups of two: every group spans both racks
    racks = Placement.build(["n1", "n2", "n3", "n4"], ["r1", "r1", "r2", "r2"], 0)
    for g in parity_groups(racks, 2):
        assert len({racks.domains[r] for r in g}) == 2, g
    with pytest.raises(ValueError, match="at least 2 nodes"):
        parity_groups(Placement.build(["a", "a"], None, 0), 2)


XOR = {"redundancy": "xor", "group_size": 5}
RS = {"redundancy": "rs", "group_size": 5, "parity": 2}  # 3+2 over the five nodes


def _mgr(root: str, node: str, model, opt, sched, **kw):  # type: ignore[no-untyped-def]
    from aegis import Manager, ModelOptimizerState

    os.environ["AEGIS_NODE_ID"] = node
    return Manager(JOB, {"model": ModelOptimizerState(model, opt), "sched": sched},
                   store_dir=f"{root}/{node}", verbose=False, **{**XOR, **kw})


def _save(rank: int, world: int, root: str, kw: dict[str, Any]) -> Any:
    model, opt, sched = build(world)
    mgr = _mgr(root, NODES[rank], model, opt, sched, **kw)
    results = []
    for step in range(1, 4):
        train_step(model, opt, sched, step, rank)
        mgr.save(step)
        results.append(mgr.wait())
        if "durable" in kw:  # the durable tier holds every step before the next one starts
            mgr.wait_durable()
        full = _tensors(full_state(model, opt))
        if rank == 0:  # what each step saved, for runs that do not get to return
            torch.save(full, f"{root}/full-{step}.pt")
    mgr.close()
    r = results[-1]
    return {"full": full if rank == 0 else None, "committed": r.committed,
            "parity_bytes": r.parity_bytes, "replica_bytes": r.replica_bytes}


def _pooled_manifest(root: Path, step: int = 3) -> Manifest:
    """The whole manifest of ``step`` from node a's format-4 step record, with every rank's
    record read from the shard's own index wherever a node store holds it (as the reading
    layer pools them); checks that each node keeps a step record with its own groups only."""
    extra = {}
    for n in NODES:
        store = NodeStore(root / n, JOB)
        if not store.dir.exists():
            continue
        for info in store.steps():
            if info.step == step:
                for r in info.shard_ranks:
                    extra.setdefault(r, store.shard_record(step, r))
                rec = store.read_node_manifest(step)
                assert isinstance(rec, StepManifest) and rec.parity is not None, rec
                mine = set(info.shard_ranks)
                assert all(mine & set(g.members) for g in rec.parity.groups), rec.parity
    return NodeStore(root / "a", JOB).read_manifest(step, extra=extra)


def _restore_xor(world: int, root: Path, nodes: list[str], kw: dict[str, Any]) -> list[Any]:
    """tests/test_recovery.py's restore on ``world`` ranks, with the parity groups of ``_mgr``."""
    return run_ranks(world, _restore, str(root), nodes, 0, {**XOR, **kw})


def test_xor_keeps_a_quarter_more_rebuilds_one_lost_node_bitwise_and_names_more_losses(store_dir: Path) -> None:
    saved = run_ranks(5, _save, str(store_dir), {})
    assert all(o["committed"] and o["replica_bytes"] == 0 and o["parity_bytes"] > 0 for o in saved)
    m = _pooled_manifest(store_dir)
    assert m.redundancy is not None and m.redundancy.scheme == "xor"
    (group,) = m.redundancy.groups
    assert group.members == (0, 1, 2, 3, 4)
    assert all(s.replicas == () for s in m.shards)
    assert Manifest.from_json(m.to_json()) == m
    for r, node in enumerate(NODES):
        store = NodeStore(store_dir / node, JOB)
        (info,) = store.steps()
        assert (info.step, info.committed, info.shard_ranks, info.parity_ranks) == (3, True, (r,), (r,))
        store.verify_parity(3, r, group.segment_size, group.parity_crc32c[r])
        # the node store holds its shard plus a quarter of the largest one, not a second copy
        held = store.shard_path(3, r).stat().st_size + store.parity_path(3, r).stat().st_size
        assert held <= 1.25 * max(s.size for s in m.shards) + 64 * 5, (held, m.shard(r).size)
    lose(store_dir, "c")
    # a replacement node: rank 2's shard is rebuilt there from the four survivors
    out = _restore_xor(5, store_dir, ["a", "b", "f", "d", "e"], {})
    assert [o["step"] for o in out] == [3] * 5, out
    assert_bitwise_equal(saved[0]["full"], out[0]["full"])
    src = {s["shard"]: s for s in out[2]["sources"]}[2]
    assert src["source"] == "rebuild" and src["fetch_bytes"] > 0, src
    # reduced along a chain of the survivors (issue 40): the rebuilder receives the rebuilt
    # bytes once, not the four survivors' segments (4x)
    assert src["fetch_bytes"] <= 1.5 * m.shard(2).size, (src, m.shard(2).size)
    # shrink to the four survivors (resharding): whoever reads rank 2's old shard rebuilds it
    lose(store_dir, "f")
    out = _restore_xor(4, store_dir, ["a", "b", "d", "e"], {})
    assert all(isinstance(o, dict) for o in out), out
    assert [o["step"] for o in out] == [3] * 4, out
    assert_bitwise_equal(saved[0]["full"], out[0]["full"])
    assert any(s["source"] == "rebuild" for o in out for s in o["sources"])
    # two more members of the group lost: more than XOR parity covers, and no durable tier
    lose(store_dir, "b")
    lose(store_dir, "d")
    out = _restore_xor(2, store_dir, ["a", "e"], {})
    assert all(isinstance(o, str) for o in out), out
    assert "CorruptShardError" in out[0] and "XOR parity group (ranks [0, 1, 2, 3, 4])" in out[0], out[0]
    # (the shrink restore above fetched only the bytes it read of rank 3's shard, issue 24:
    # no whole copy of it was left on node e, so 1, 2 and 3 are gone)
    assert "lost the shards of ranks [1, 2, 3]" in out[0], out[0]


@pytest.mark.parametrize("scheme", ["xor", "rs"])
def test_a_loss_while_encoding_then_a_corrupt_parity_resume_bitwise_from_durable(
        scheme: str, store_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # rank 2 is SIGKILLed while step 3's parity segments are exchanged: step 3 never commits
    kw: dict[str, Any] = {"durable": f"file://{tmp_path}/bucket", "durable_every": 1,
                          "timeout": timedelta(seconds=10), **(RS if scheme == "rs" else XOR)}
    with pytest.raises(RuntimeError, match="died|failed"):
        run_ranks(5, _save, str(store_dir), kw, env={"AEGIS_FAIL_AT": "2:3:encode"})
    assert [s.step for s in NodeStore(store_dir / "a", JOB).steps() if s.committed] == [2]
    lose(store_dir, "c")
    # and rank 0's parity, which rebuilding rank 2's shard needs (XOR: stripe 0), is damaged;
    # RS 3+2 reads around one damaged piece, so rank 4's is damaged too (3 losses: beyond it)
    for node, r in [("a", 0), ("e", 4)] if scheme == "rs" else [("a", 0)]:
        path = NodeStore(store_dir / node, JOB).parity_path(2, r, scheme)
        data = bytearray(path.read_bytes())
        data[5] ^= 0x10
        path.write_bytes(bytes(data))
    # the CLI shows the groups and `aegis verify` names the damaged parity
    code, text, _ = inproc(capsys, "inspect", str(store_dir / "a"), "--json")
    red = json.loads(text)["redundancy"]
    assert code == 0 and red["scheme"] == scheme and red["groups"][0]["nodes"] == NODES, red
    code, text, _ = inproc(capsys, "verify", str(store_dir / "a"), "--json")
    fails = [f for f in json.loads(text)["failures"] if "parity" in f["error"]]
    assert code == 1 and [f["rank"] for f in fails] == [0], fails
    assert f"{scheme.upper()} parity of rank 0 at step 2" in fails[0]["error"], fails
    # step 2 is restored bitwise: rank 2's shard from the durable tier, never a wrong rebuild
    out = _restore_xor(5, store_dir, ["a", "b", "f", "d", "e"], kw)
    assert [o["step"] for o in out] == [2] * 5, out
    assert_bitwise_equal(torch.load(store_dir / "full-2.pt"), out[0]["full"])
    src = {s["shard"]: s for s in out[2]["sources"]}[2]
    assert src["tier"] == "durable", src
    assert any(f"{scheme.upper()} parity of rank 0" in x and "corrupt" in x
               for x in out[2]["skipped"]), out[2]["skipped"]


@pytest.mark.quick
def test_a_damaged_parity_record_is_rejected() -> None:
    m = sample()
    seg = xor_layout([s.size for s in m.shards]).segment_size
    good = dataclasses.replace(m, redundancy=Redundancy("xor", (ParityGroup((0, 1), seg, (1, 2)),)))
    assert Manifest.from_json(good.to_json()) == good
    assert '"format_version":3' in good.to_json() and '"format_version":2' in m.to_json()
    for bad in (ParityGroup((0, 1), seg + 64, (1, 2)), ParityGroup((0, 0), seg, (1, 2)),
                ParityGroup((0, 1), seg, (1,))):
        forged = dataclasses.replace(m, redundancy=Redundancy("xor", (bad,)))
        with pytest.raises(ManifestError):
            Manifest.from_json(forged.to_json())


@pytest.mark.quick
def test_a_rebuild_on_a_node_without_the_step_reports_instead_of_raising(tmp_path: Path) -> None:
    """Seen in the XOR chaos arm: a replacement node whose only work for a step was a rebuild
    had no step directory yet; the rebuilding rank raised alone and its peers waited forever.
    Every failure of the fold is a result (here: nothing folded, so the chunks do not match)."""
    from aegis.training.recovery import REBUILD, _fold_rebuilds, _runs, _xor_ranges

    store = NodeStore(tmp_path / "new-node", "j")
    store.create()
    m = sample()
    layout = xor_layout([s.size for s in m.shards])
    m = dataclasses.replace(m, redundancy=Redundancy("xor", (ParityGroup((0, 1), layout.segment_size, (1, 2)),)))
    g = m.redundancy.groups[0]  # type: ignore[union-attr]
    rec = m.shard(1)
    ranges = _xor_ranges(layout, 1, _runs(list(rec.chunks), {0}, size=rec.size))
    plan = (1, "new-node", {0}, g, layout, ranges, None)
    # nothing arrived: every piece's sum is zeros
    nothing = [(pos, torch.zeros(parts[0][3] - parts[0][2], dtype=torch.uint8)) for pos, parts in ranges]
    out = _fold_rebuilds(store, m, [plan], {(1, "new-node"): (nothing, 0)}, lambda n, s: 0, 0, 0.0)
    assert len(out) == 1 and out[0][:3] == (1, REBUILD, "new-node") and out[0][3], out
    assert "crc32c mismatch" in out[0][3] and not store.partial_path(5, 1).exists()



def test_rs_3_plus_2_rebuilds_two_lost_nodes_bitwise_and_names_a_third(
        store_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    saved = run_ranks(5, _save, str(store_dir), RS)
    assert all(o["committed"] and o["replica_bytes"] == 0 and o["parity_bytes"] > 0 for o in saved)
    m = _pooled_manifest(store_dir)
    assert m.redundancy is not None and (m.redundancy.scheme, m.redundancy.parity) == ("rs", 2)
    (group,) = m.redundancy.groups
    assert Manifest.from_json(m.to_json()) == m
    for r, node in enumerate(NODES):
        store = NodeStore(store_dir / node, JOB)
        store.verify_parity(3, r, group.stored, group.parity_crc32c[r], "rs")
        # 2 pieces of a third of the largest shard each (+ liberasurecode's small headers)
        assert store.parity_path(3, r, "rs").stat().st_size == group.stored
        assert group.stored <= 2 / 3 * max(s.size for s in m.shards) + 2 * (64 + 4 * 80)
    code, text, _ = inproc(capsys, "inspect", str(store_dir / "a"), "--json")
    red = json.loads(text)["redundancy"]
    assert code == 0 and (red["scheme"], red["parity"]) == ("rs", 2), red
    assert red["groups"][0]["survives_losses"] == 2, red
    code, text, _ = inproc(capsys, "verify", str(store_dir / "b"), "--json")
    assert not [f for f in json.loads(text)["failures"] if "parity" in f["error"]], text
    # two nodes lost at once: their replacements rebuild both shards from the three survivors
    lose(store_dir, "c")
    lose(store_dir, "e")
    out = _restore_xor(5, store_dir, ["a", "b", "f", "d", "g"], RS)
    assert [o["step"] for o in out] == [3] * 5, out
    assert_bitwise_equal(saved[0]["full"], out[0]["full"])
    for r in (2, 4):
        src = {s["shard"]: s for s in out[r]["sources"]}[r]
        assert src["source"] == "rebuild" and src["fetch_bytes"] > 0, src
        # each holder's share of the decode summed along a chain: the rebuilder receives one
        # segment per segment rebuilt, not the d = 3 pieces the decode reads (3x)
        assert src["fetch_bytes"] <= 1.5 * m.shard(r).size, (src, m.shard(r).size)
    # shrink to the three survivors: readers of ranks 2 and 4's old shards rebuild them
    lose(store_dir, "f")
    lose(store_dir, "g")
    out = _restore_xor(3, store_dir, ["a", "b", "d"], RS)
    assert [o["step"] for o in out] == [3] * 3, out
    assert_bitwise_equal(saved[0]["full"], out[0]["full"])
    assert any(s["source"] == "rebuild" for o in out for s in o["sources"])
    # a third member lost: more than 3+2 parity covers, no durable tier: the error names it
    lose(store_dir, "b")
    out = _restore_xor(2, store_dir, ["a", "d"], RS)
    assert all(isinstance(o, str) for o in out), out
    assert "RS parity group (ranks [0, 1, 2, 3, 4])" in out[0] and "rebuilds 2 lost members" in out[0], out[0]


@pytest.mark.quick
def test_bad_redundancy_settings_are_config_errors_before_any_process_group() -> None:
    from aegis.errors import ConfigError
    from aegis.training.config import ManagerConfig

    with pytest.raises(ConfigError, match="'replica'.*'xor'.*'rs'"):
        ManagerConfig(job="j", redundancy="raid6")
    with pytest.raises(ConfigError, match="parity=0: must be an integer >= 1"):
        ManagerConfig(job="j", redundancy="rs", parity=0)
    with pytest.raises(ConfigError, match="at least parity \\+ 2 = 5 nodes"):
        ManagerConfig(job="j", redundancy="rs", group_size=4, parity=3)
    assert ManagerConfig(job="j", redundancy="rs", group_size=6, parity=2).parity == 2


@pytest.mark.parametrize("scheme", ["xor", "rs"])
def test_a_node_lost_during_recovery(scheme: str, store_dir: Path) -> None:
    """Node c is lost; while the job restores (after the decision, before any shard moves) a
    second rank is SIGKILLed: XOR, the replacement f itself (the group still lost one member),
    RS 3+2, survivor e (the second loss its parity covers). The next restore, on fresh
    replacement nodes, rebuilds every lost shard from the survivors, bitwise."""
    red = RS if scheme == "rs" else XOR
    saved = run_ranks(5, _save, str(store_dir), red)
    lose(store_dir, "c")
    victim = 4 if scheme == "rs" else 2
    with pytest.raises(RuntimeError, match="died"):
        run_ranks(5, _restore, str(store_dir), ["a", "b", "f", "d", "e"], 0,
                  {**red, "timeout": timedelta(seconds=10)}, env={"AEGIS_FAIL_AT": f"{victim}:3:restore"})
    lost = ["f", "e"] if scheme == "rs" else ["f"]
    for node in lost:
        lose(store_dir, node)
    nodes = ["a", "b", "g", "d", "h" if scheme == "rs" else "e"]
    out = _restore_xor(5, store_dir, nodes, red)
    assert [o["step"] for o in out] == [3] * 5, out
    assert_bitwise_equal(saved[0]["full"], out[0]["full"])
    for r in (2, 4) if scheme == "rs" else (2,):
        assert {s["shard"]: s for s in out[r]["sources"]}[r]["source"] == "rebuild", out[r]["sources"]


@pytest.mark.parametrize("damage", ["missing", "corrupt"])
def test_rs_rebuild_reads_around_a_missing_or_corrupt_parity_file(damage: str, store_dir: Path) -> None:
    """RS 3+2, node c lost and rank 3's parity file gone from node d, or corrupt there: still
    one loss short of the parity, so rank 2's shard is rebuilt from the other pieces, bitwise
    (the corrupt file is found by its crc32c and never read into the rebuild)."""
    saved = run_ranks(5, _save, str(store_dir), RS)
    lose(store_dir, "c")
    path = NodeStore(store_dir / "d", JOB).parity_path(3, 3, "rs")
    if damage == "missing":
        path.unlink()
    else:
        data = bytearray(path.read_bytes())
        data[len(data) // 3] ^= 0x01
        path.write_bytes(bytes(data))
    out = _restore_xor(5, store_dir, ["a", "b", "f", "d", "e"], RS)
    assert [o["step"] for o in out] == [3] * 5, out
    assert_bitwise_equal(saved[0]["full"], out[0]["full"])
    assert {s["shard"]: s for s in out[2]["sources"]}[2]["source"] == "rebuild", out[2]["sources"]


def _uneven(rank: int, world: int, root: str, in_round: bool) -> Any:
    """Ranks on nodes a, a, b (a worker of node b lost): no local index 1 on two nodes."""
    from aegis.errors import AegisError
    from aegis.training.inprocess.round import set_in_process_round

    set_in_process_round(in_round)
    model, opt, sched = build(world)
    try:
        mgr = _mgr(root, ["a", "a", "b"][rank], model, opt, sched)
    except AegisError as e:
        return {"error": str(e)}
    train_step(model, opt, sched, 1, rank)
    mgr.save(1)
    r = mgr.wait()
    out = {"scheme": mgr.engine.scheme, "degraded": mgr.engine.degraded,
           "committed": r.committed, "replica_bytes": r.replica_bytes,
           "parity_bytes": r.parity_bytes}
    mgr.close()
    return out


def test_an_uneven_world_keeps_replicas_in_a_recovery_round_and_is_refused_at_start(
        store_dir: Path) -> None:
    """Parity groups take one rank per node per local index; a world left uneven by a lost
    worker of a 2-rank node (in-process recovery keeps the node's other rank) cannot form them.
    In a round of in-process recovery the snapshots are then replicated whole for that world
    (found by the long chaos campaign: every process raised, was replaced, and raised again);
    at a job's start the same layout is still a clear error."""
    started = run_ranks(3, _uneven, str(store_dir / "start"), False)
    assert all("cannot form parity groups" in r.get("error", "") for r in started), started
    got = run_ranks(3, _uneven, str(store_dir / "round"), True)
    assert all(r.get("scheme") == "replica" and r["committed"] for r in got), got
    assert all("cannot form parity groups" in r["degraded"] for r in got), got
    assert all(r["parity_bytes"] == 0 for r in got) and any(r["replica_bytes"] > 0 for r in got), got
