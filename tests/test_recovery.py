"""Recovery across simulated nodes on real gloo ranks: a lost node's shards come from peers,
the world can shrink, and corrupt replicas are detected and replaced by another source."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from aegis.snapshot.node_store import NodeStore
from tests.dist_utils import run_ranks
from tests.models import build, full_state, train_step
from tests.test_manager import _tensors, assert_bitwise_equal, flip_byte

JOB = "t"


def _mgr(root: str, node: str, model, opt, sched, **kw):  # type: ignore[no-untyped-def]
    from aegis import Manager, ModelOptimizerState

    os.environ["AEGIS_NODE_ID"] = node
    return Manager(JOB, {"model": ModelOptimizerState(model, opt), "sched": sched},
                   store_dir=f"{root}/{node}", verbose=False, **kw)


def _save(rank: int, world: int, root: str, nodes: list[str], replicas: int, keep: int = 1) -> Any:
    model, opt, sched = build(world)
    mgr = _mgr(root, nodes[rank], model, opt, sched, replicas=replicas, keep=keep)
    for step in range(1, 4):
        train_step(model, opt, sched, step, rank)
        mgr.save(step)
    mgr.wait()
    full = _tensors(full_state(model, opt))
    mgr.close()
    return full if rank == 0 else None


def _restore(rank: int, world: int, root: str, nodes: list[str], replicas: int,
             kw: dict[str, Any] | None = None) -> Any:
    """Restore on ``nodes`` (one per rank) with a fresh model; the outcome, or the error text.
    ``kw``: more Manager arguments (tests/test_parity.py: parity groups, the durable tier)."""
    model, opt, sched = build(world, seed=99)
    mgr = _mgr(root, nodes[rank], model, opt, sched, replicas=replicas, **(kw or {}))
    try:
        step = mgr.restore()
    except Exception as e:  # noqa: BLE001
        mgr.close()
        return f"{type(e).__name__}: {e}"
    res = mgr.last_restore
    assert res is not None
    full = _tensors(full_state(model, opt))
    mgr.close()
    return {"step": step, "sources": res.sources, "skipped": res.skipped,
            "full": full if rank == 0 else None, "fetched": res.bytes_fetched,
            "timings": res.timings, "page_faults": res.page_faults}


def lose(root: Path, node: str) -> None:
    shutil.rmtree(root / node)


def test_replacement_node_restores_from_peer_memory(store_dir: Path) -> None:
    saved = run_ranks(4, _save, str(store_dir), ["a", "a", "b", "b"], 1)[0]
    lose(store_dir, "b")
    out = run_ranks(4, _restore, str(store_dir), ["a", "a", "c", "c"], 1)
    assert [o["step"] for o in out] == [3] * 4
    assert_bitwise_equal(saved, out[0]["full"])
    # ranks 2 and 3 (the new node) read their own shards, fetched from node a (into a file: both
    # read parts of each, restore_direct needs one reader)
    for r in (2, 3):
        tiers = {s["shard"]: (s["source"], s["node"], s.get("in_place")) for s in out[r]["sources"]}
        assert tiers[r] == ("peer", "a", None), tiers
        assert out[r]["fetched"] > 0
    for r in (0, 1):
        tiers = {s["shard"]: s["source"] for s in out[r]["sources"]}
        assert tiers[r] == "local"
    # the replacement node now holds the committed step
    assert NodeStore(store_dir / "c", JOB).steps()[0].committed
    # page faults per phase, one count for each timed phase (the restore event's page_faults)
    for o in out:
        assert set(o["page_faults"]) == {k[:-2] for k in o["timings"] if k != "total_s"}, o
        assert all(isinstance(n, int) and n >= 0 for n in o["page_faults"].values()), o


@pytest.mark.parametrize("damage", [False, True])
def test_a_replacement_nodes_one_rank_receives_its_shard_into_its_state(store_dir: Path, damage: bool) -> None:
    """One rank per node: the replacement's rank is the only reader of its shard there, so the
    peer's copy goes straight into its tensors (restore_direct), every chunk checked after; a
    copy damaged on the sender is caught by that check and the next copy is used."""
    saved = run_ranks(3, _save, str(store_dir), ["a", "b", "c"], 2)[0]
    lose(store_dir, "b")
    if damage:
        flip_byte(store_dir / "a", 3, 1, 2000)  # a's replica of rank 1's shard (c's is intact)
    out = run_ranks(3, _restore, str(store_dir), ["a", "d", "c"], 2)
    assert [o["step"] for o in out] == [3, 3, 3]
    assert_bitwise_equal(saved, out[0]["full"])
    src = {s["shard"]: s for s in out[1]["sources"]}[1]
    assert src["source"] == "peer" and src.get("in_place") is True, src
    if damage:
        assert src["node"] == "c", src
        assert any("rank 1, chunk 0" in x and "'a'" in x for x in out[1]["skipped"]), out[1]["skipped"]


def test_a_rejected_local_copy_is_removed_once_the_shard_came_from_elsewhere(store_dir: Path) -> None:
    """A node's file for the step that fails its check (here: another size, as a split round's
    file of the same step number had) is loaded from a peer instead, into the state, and then
    removed: the node never again vouches for it (found by bench/recovery.py at 1 GB per rank:
    a node kept such a file, wrote the step's manifest beside it, and a later restore on that
    node alone found the step broken)."""
    saved = run_ranks(2, _save, str(store_dir), ["a", "b"], 1)[0]
    path = NodeStore(store_dir / "a", JOB).shard_path(3, 0)
    path.write_bytes(b"x" * 1000)
    # 2 -> 3 ranks: rank 0 (node a) reads part of shard 0, fetched as byte ranges from b
    out = run_ranks(3, _restore, str(store_dir), ["a", "b", "c"], 1)
    assert [o["step"] for o in out] == [3, 3, 3]
    assert_bitwise_equal(saved, out[0]["full"])
    src = {s["shard"]: s for s in out[0]["sources"]}[0]
    assert (src["source"], src["node"]) == ("peer", "b"), src
    assert any("a (local copy)" in x and "1000 bytes" in x for x in out[0]["skipped"]), out[0]["skipped"]
    assert not path.exists()


def _restore_and_list(rank: int, world: int, root: str, nodes: list[str]) -> Any:
    """Restore; this node's step directories right after it, then what its store directory
    holds once the Manager is closed."""
    model, opt, sched = build(world, seed=99)
    mgr = _mgr(root, nodes[rank], model, opt, sched, replicas=1, keep=2)
    step = mgr.restore()
    after = [i.step for i in NodeStore(Path(root) / nodes[rank], JOB).steps()]
    mgr.close()
    return step, after, sorted(os.listdir(Path(root) / nodes[rank] / JOB))


def test_steps_a_restore_drops_are_deleted_after_it_and_a_dead_processs_leftovers_too(
        store_dir: Path) -> None:
    """The steps a restore drops (here step 3, uncommitted on every node) leave the inventory at
    once and are deleted on a thread (the restore no longer waits for the pages to be freed):
    gone once the Manager is closed. A directory a process lost mid-deletion left behind (a
    dead pid's ``.removed-...``) is deleted by the next restore."""
    run_ranks(2, _save, str(store_dir), ["a", "b"], 1, 2)
    for node in ("a", "b"):
        NodeStore(store_dir / node, JOB).uncommit(3)
    stale = store_dir / "a" / JOB / ".removed-step-00000001-999999999-0"
    stale.mkdir()
    (stale / "rank-00000.shard").write_bytes(b"x" * 4096)
    out = run_ranks(2, _restore_and_list, str(store_dir), ["a", "b"])
    assert [o[0] for o in out] == [2, 2]
    for _step, after, listed in out:
        assert after == [2], after
        assert not [n for n in listed if n.startswith((".removed-", "step-00000003"))], listed
    assert not stale.exists()


def test_shrink_to_the_surviving_node(store_dir: Path) -> None:
    saved = run_ranks(4, _save, str(store_dir), ["a", "a", "b", "b"], 1)[0]
    lose(store_dir, "b")
    out = run_ranks(2, _restore, str(store_dir), ["a", "a"], 1)
    assert [o["step"] for o in out] == [3, 3]
    assert_bitwise_equal(saved, out[0]["full"])
    assert all(s["source"] == "local" for o in out for s in o["sources"])  # a held b's replicas


def test_corrupt_replica_is_detected_and_another_source_used(store_dir: Path) -> None:
    nodes = ["a", "b", "c"]
    saved = run_ranks(3, _save, str(store_dir), nodes, 2)[0]
    lose(store_dir, "a")
    flip_byte(store_dir / "b", 3, 0)  # b's replica of rank 0's shard
    out = run_ranks(3, _restore, str(store_dir), ["d", "b", "c"], 2)
    assert [o["step"] for o in out] == [3, 3, 3]
    assert_bitwise_equal(saved, out[0]["full"])
    src = {s["shard"]: s for s in out[0]["sources"]}[0]
    assert (src["source"], src["node"]) == ("peer", "c")
    assert any("rank 0" in x and "chunk 0" in x for x in out[0]["skipped"]), out[0]["skipped"]


def test_a_damaged_own_copy_found_while_streaming_is_loaded_again_from_a_peer(store_dir: Path) -> None:
    """A rank's own shard is streamed into the state with each chunk checked as it lands
    (stream_read): a flipped byte there is found during the load, after bytes were written; the
    shard is fetched from a replica and every byte loaded again."""
    nodes = ["a", "b", "c"]
    saved = run_ranks(3, _save, str(store_dir), nodes, 2)[0]
    flip_byte(store_dir / "b", 3, 1)  # b's own copy of rank 1's shard
    out = run_ranks(3, _restore, str(store_dir), nodes, 2)
    assert [o["step"] for o in out] == [3, 3, 3]
    assert_bitwise_equal(saved, out[0]["full"])
    src = {s["shard"]: s for s in out[1]["sources"]}[1]
    assert src["source"] == "peer" and src["node"] in ("a", "c"), src
    assert any("b (local copy)" in x and "rank 1, chunk 0" in x for x in out[1]["skipped"]), out[1]["skipped"]
    assert all(s["source"] == "local" for r in (0, 2) for s in out[r]["sources"])


def test_a_damaged_own_copy_beside_a_lost_node_is_fetched_again_and_named_once(store_dir: Path) -> None:
    """A lost node (its rank's shard fetched from a peer) and, on an intact node, an own copy
    with a damaged chunk (its size and index intact, so it passes the verdict and is found as
    the load streams it): that shard is fetched from a replica and every byte loaded again;
    the restore's notes name the damaged copy once, with one "(local copy)" (it was said twice,
    the second time as "a (local copy): a (local copy): ...")."""
    saved = run_ranks(3, _save, str(store_dir), ["a", "b", "c"], 2)[0]
    lose(store_dir, "b")
    flip_byte(store_dir / "a", 3, 0)  # a's own copy of rank 0's shard (c holds a replica)
    out = run_ranks(3, _restore, str(store_dir), ["a", "d", "c"], 2)
    assert [o["step"] for o in out] == [3, 3, 3]
    assert_bitwise_equal(saved, out[0]["full"])
    src = {s["shard"]: s for s in out[0]["sources"]}[0]
    assert (src["source"], src["node"]) == ("peer", "c"), src
    notes = [x for x in out[0]["skipped"] if "rank 0, chunk 0" in x]
    assert len(notes) == 1 and notes[0].startswith("a (local copy): crc32c mismatch"), notes


def test_no_intact_source_left_names_step_rank_and_what_was_tried(store_dir: Path) -> None:
    run_ranks(3, _save, str(store_dir), ["a", "b", "c"], 1)
    lose(store_dir, "a")
    flip_byte(store_dir / "b", 3, 0)  # the only other copy of rank 0's shard
    out = run_ranks(3, _restore, str(store_dir), ["d", "b", "c"], 1)
    for rank, e in enumerate(out):
        assert isinstance(e, str) and e.startswith("CorruptShardError"), e
        assert "step 3: no intact copy of the shard of rank 0" in e
        assert "'b'" in e or "b (local copy)" in e or "b:" in e
        # d's one rank received b's damaged copy of its shard into its state: it says so
        if rank == 0:
            assert "partly overwritten by shards of step 3 received into it" in e, e
        else:
            assert "Nothing was loaded" in e, e


def test_a_reshard_fetches_only_the_bytes_it_reads(store_dir: Path) -> None:
    """4 nodes -> 3 (one lost): a new rank that reads a third of another node's shard fetches
    those byte ranges (issue 24; before, the whole chunks holding them), each with the crc32c
    its sender computed after checking the chunks against the manifest; bitwise."""
    saved = run_ranks(4, _save, str(store_dir), ["a", "b", "c", "d"], 2)[0]
    lose(store_dir, "d")
    out = run_ranks(3, _restore, str(store_dir), ["a", "b", "c"], 2)
    assert [o["step"] for o in out] == [3, 3, 3], out
    assert_bitwise_equal(saved, out[0]["full"])
    peer = [s for o in out for s in o["sources"] if s["source"] == "peer"]
    assert peer and all(s["fetch_bytes"] <= 1.5 * s["bytes_read"] for s in peer), peer
    ranged = [s for s in peer if s["fetch_bytes"] <= 1.02 * s["bytes_read"]]
    assert ranged, peer  # at least one fetch moved the bytes read and no more


def _ranged_from_a_damaged_copy(rank: int, world: int, root: str) -> Any:
    from aegis.training import recovery

    nodes = ["a", "b"]
    model, opt, sched = build(world, seed=3)
    mgr = _mgr(root, nodes[rank], model, opt, sched, replicas=1)
    store = mgr.store
    m = NodeStore(f"{root}/a", JOB).read_manifest(3)
    rec = m.shard(1)  # held by b (its own) and a (the replica, damaged below)
    ids = {0}
    spans = [(rec.items[0].file_offset, rec.items[0].file_offset + 64)]
    out = recovery._run_transfers(store, mgr.group, mgr.transport, m,
                                  [(1, "a", "b", (ids, spans))], lambda n, s: nodes.index(n))
    mgr.close()
    return out


def test_a_sender_never_vouches_for_a_damaged_copy(store_dir: Path) -> None:
    """A ranged fetch from a copy whose chunk fails its crc32c on the sender: the sender sends
    no checksum for it and the receiver rejects it (the next source is tried)."""
    run_ranks(2, _save, str(store_dir), ["a", "b"], 1)
    flip_byte(store_dir / "a", 3, 1)  # a's replica of rank 1's shard, in its first chunk
    out = run_ranks(2, _ranged_from_a_damaged_copy, str(store_dir))
    [(shard, src, dst, err, _, _, part)] = out[1]
    assert (shard, src, dst, part) == (1, "a", "b", True)
    assert err is not None and "failed its check" in err, err
    assert not NodeStore(store_dir / "b", JOB).partial_path(3, 1).exists()
