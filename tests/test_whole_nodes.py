"""Whole-node rounds (issue 38, part 1): ``run_in_process(ranks_per_node=N)`` forms rounds of
complete nodes only (local ranks 0..N-1 all present), each node's ranks contiguous and in
local-rank order; a node that lost a worker sits out whole, its other workers wait as spares,
and the node rejoins whole once its replacement worker registered. The survivors' snapshot vote
counts a node's registrations only once the node is whole, so a lone waiting worker costs them
no round.

The pure functions first, then the protocol on a real TCPStore with production heartbeats and
formation (members are threads, as in ``test_membership``), then the refusals of bad
arguments."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch.distributed as dist

from aegis.errors import ConfigError
from aegis.training.inprocess.layout import uid_order, whole_node_vote, whole_nodes
from aegis.training.inprocess.round import Round, joiners_registered, joiners_waiting
from tests.test_membership import (
    DEAD_AFTER,
    _all,
    _first_round,
    _Member,
    _members,
    _outcome,
    _stop,
    _wait,
    store,  # noqa: F401 - the fixture
)


@pytest.mark.quick
def test_new_processes_are_ordered_by_node_then_local_rank_as_numbers() -> None:
    uids = ["node-10/0/1", "node-9/1/2", "node-9/0/3", "node-2/10/4", "node-2/2/5"]
    assert sorted(uids, key=uid_order) == ["node-2/2/5", "node-2/10/4", "node-9/0/3",
                                           "node-9/1/2", "node-10/0/1"]


@pytest.mark.quick
def test_whole_nodes_keeps_complete_nodes_survivors_first_in_local_rank_order() -> None:
    joined = ["a/1/2", "b/0/3", "a/0/1", "c/1/4", "c/0/5", "d/0/6", "d/0/7", "d/1/8", "e/2/9"]
    kept, left = whole_nodes(joined, 2, first=["c/0/5", "c/1/4", "a/0/1", "a/1/2"])
    # c and a keep their order from the previous round; d is new (after them); b is missing
    # local rank 1; the second d/0 and e's local rank 2 (>= 2 per node) are left out
    assert kept == ["c/0/5", "c/1/4", "a/0/1", "a/1/2", "d/0/6", "d/1/8"]
    assert sorted(left) == ["b/0/3", "d/0/7", "e/2/9"]
    assert whole_nodes(["x/0/1"], 1) == (["x/0/1"], [])
    assert whole_nodes([], 2) == ([], [])


@pytest.mark.quick
def test_the_vote_counts_a_node_only_once_it_is_whole() -> None:
    members = ["a/0/1", "a/1/2"]
    # b's worker 0 alone: no vote; b whole at slot 8; c whole at slot 7 (completed first)
    assert whole_node_vote([(5, "b/0/3")], members, 2) is None
    pending = [(5, "b/0/3"), (6, "c/0/4"), (7, "c/1/5"), (8, "b/1/6")]
    assert whole_node_vote(pending, members, 2) == 8
    assert whole_node_vote(pending, members, 2, room_nodes=1) == 7
    assert whole_node_vote(pending, members, 2, room_nodes=0) is None
    # a registration of a node of the round, or of a local rank the node has not, counts nothing
    assert whole_node_vote([(5, "a/0/9"), (6, "z/2/1")], members, 2) is None


@pytest.mark.quick
def test_joiners_registered_reads_the_slots_and_votes_whole_nodes(store: dist.TCPStore) -> None:  # noqa: F811
    saved = (Round.store, Round.members, Round.admitted, Round.joiners, Round.max_world,
             Round.per_node)
    try:
        Round.store, Round.members, Round.admitted = store, ["a/0/1", "a/1/2"], 0
        Round.max_world, Round.per_node = None, 2
        count = [0]
        Round.joiners = lambda: count[0]

        def register(uid: str) -> None:
            count[0] = int(store.add("aegis/join/count", 1))
            store.set(f"aegis/join/slot/{count[0]}", uid)

        register("b/0/3")
        assert joiners_registered() == 0 and not joiners_waiting(joiners_registered())
        register("b/1/4")
        assert joiners_registered() == 2 and joiners_waiting(2)
        # a slot counted but not written yet (its registrant between its two writes): the node
        # it would complete is not whole yet
        count[0] = int(store.add("aegis/join/count", 1))
        Round.admitted = 2
        assert joiners_registered() == 2
        store.set("aegis/join/slot/3", "c/0/5")
        register("c/1/6")
        assert joiners_registered() == 4
        Round.max_world = 2  # the round is full: nobody
        assert joiners_registered() == 2
    finally:
        (Round.store, Round.members, Round.admitted, Round.joiners, Round.max_world,
         Round.per_node) = saved


def _whole(ms: list[_Member]) -> list[_Member]:
    for m in ms:
        m.m.per_node = 2
    return ms


@pytest.mark.timeout(120)
def test_a_lost_worker_takes_its_node_out_and_the_node_rejoins_whole(store: dist.TCPStore) -> None:  # noqa: F811
    """3 nodes x 2 (threads, production heartbeats and formation): n1's worker 1 stops. The next
    round is n0 and n2 (4 ranks, in their previous order); n1's worker 0 is told it waits as a
    spare. While one of n1's workers alone has registered, the survivors' vote admits nobody;
    once both registered (the new worker for local rank 1 first), the vote admits both and the
    round after has n1 whole, local rank 0 then 1."""
    uids = [f"n{i}/{lr}/1" for i in range(3) for lr in range(2)]
    ms = _whole(_members(store.port, uids))
    new = _whole([_Member(store.port, "n1/1/2")])[0]
    saved = (Round.store, Round.members, Round.admitted, Round.joiners, Round.max_world,
             Round.per_node)
    try:
        members = _first_round(ms)
        assert members == uids  # node order, local-rank order, whatever order they joined in
        _stop([ms[3]])
        live = [m for m in ms if m is not ms[3]]
        _wait(lambda: all(m.round_failed() for m in live), DEAD_AFTER + 5, "loss seen")
        out = _all(lambda m: _outcome(lambda: m.enter(1, members, 0)), live)
        lone = out[2]
        assert isinstance(lone, Exception) and getattr(lone, "spare", False), lone
        assert "a worker of it is missing" in str(lone)
        survivors = [m for m in live if m is not ms[2]]
        nxt = [o for m, o in zip(live, out, strict=True) if m is not ms[2]]
        assert all(x == ["n0/0/1", "n0/1/1", "n2/0/1", "n2/1/1"] for x in nxt), nxt

        # the survivors' vote, as Manager.save takes it (their view of the round)
        s0 = survivors[0]
        Round.store, Round.members, Round.admitted = store, s0.members, s0.admitted
        Round.max_world, Round.per_node = None, 2
        Round.joiners = lambda: int(store.add("aegis/join/count", 0))
        joined: dict[str, Any] = {}

        def join(m: _Member) -> None:
            r, previous, slot = m.m.join(timeout_s=60)
            joined[m.uid] = m.enter(r, previous, 0, join_slot=slot)

        # the new worker registers first (its launcher was quick), n1's worker 0 second: they
        # still take their node's ranks in local-rank order
        t_new = threading.Thread(target=join, args=(new,))
        t_new.start()
        _wait(lambda: int(store.add("aegis/join/count", 0)) >= 1, 10, "the new worker registers")
        assert joiners_registered() == s0.admitted  # its node is not whole: nobody
        t_lone = threading.Thread(target=join, args=(ms[2],))
        t_lone.start()
        _wait(lambda: int(store.add("aegis/join/count", 0)) >= 2, 10, "the lone worker registers")
        _wait(lambda: joiners_registered() == 2, 10, "the node whole in the vote")
        registered = joiners_registered()
        previous = s0.m.admit(2, s0.members, s0.admitted, registered)
        for m in survivors[1:]:
            assert m.m.admit(2, m.members, m.admitted, registered) == previous
        lists = _all(lambda m: m.enter(2, previous, 0), survivors)
        t_lone.join(30)
        t_new.join(30)
        want = ["n0/0/1", "n0/1/1", "n2/0/1", "n2/1/1", "n1/0/1", "n1/1/2"]
        assert all(x == want for x in lists), lists
        assert joined == {"n1/0/1": want, "n1/1/2": want}
    finally:
        (Round.store, Round.members, Round.admitted, Round.joiners, Round.max_world,
         Round.per_node) = saved
        _stop([*ms, new])


@pytest.mark.timeout(120)
def test_a_spare_node_waits_whole_and_steps_in_whole(store: dist.TCPStore) -> None:  # noqa: F811
    """``max_world=4``, 3 nodes x 2: the first round is n0 and n1, n2's two processes are
    spares. n1's worker 1 stops: the round formed after it is n0 and the spare node n2 (whole,
    local rank 0 then 1); n1's worker 0 is told it waits."""
    uids = [f"n{i}/{lr}/1" for i in range(3) for lr in range(2)]
    ms = _whole(_members(store.port, uids))
    try:
        for m in ms:
            m.m.max_world, m.m.min_world = 4, 4
        first = _all(lambda m: _outcome(lambda: m.enter(0, None, 6)), ms)
        assert first[:4] == [uids[:4]] * 4
        assert all(isinstance(x, Exception) and getattr(x, "spare", False) for x in first[4:])
        members = uids[:4]
        box: dict[str, Any] = {}

        def spare(m: _Member) -> None:
            r, previous, slot = m.m.join(timeout_s=60)
            box[m.uid] = m.enter(r, previous, 0, join_slot=slot)

        spares = [threading.Thread(target=spare, args=(m,)) for m in ms[4:]]
        for t in spares:
            t.start()
        _stop([ms[3]])
        live = ms[:3]
        _wait(lambda: all(m.round_failed() for m in live), DEAD_AFTER + 5, "loss seen")
        out = _all(lambda m: _outcome(lambda: m.enter(1, members, 0)), live)
        for t in spares:
            t.join(30)
        want = ["n0/0/1", "n0/1/1", "n2/0/1", "n2/1/1"]
        assert out[:2] == [want, want] and box == {"n2/0/1": want, "n2/1/1": want}, (out, box)
        assert isinstance(out[2], Exception) and getattr(out[2], "spare", False), out[2]
    finally:
        _stop(ms)


@pytest.mark.quick
@pytest.mark.parametrize("env, kw, match", [
    ({"LOCAL_RANK": "2", "WORLD_SIZE": "6"}, {"ranks_per_node": 2}, "local rank 2 is not one of"),
    ({"LOCAL_RANK": "0", "WORLD_SIZE": "5"}, {"ranks_per_node": 2}, "not whole nodes of 2"),
    ({"LOCAL_RANK": "0", "WORLD_SIZE": "6"}, {"ranks_per_node": 2, "max_world": 5},
     "max_world must be whole nodes"),
    ({"LOCAL_RANK": "0", "WORLD_SIZE": "6"}, {"ranks_per_node": 0}, "a positive integer"),
])
def test_whole_node_arguments_are_checked_before_anything_starts(
        monkeypatch: pytest.MonkeyPatch, env: dict[str, str], kw: dict[str, Any], match: str) -> None:
    import aegis

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("AEGIS_MEMBERSHIP", raising=False)
    with pytest.raises(ConfigError, match=match):
        aegis.run_in_process(lambda w: None, **kw)
