"""The membership protocol (``aegis/training/inprocess/membership.py``, issue 24) against a real
c10d TCPStore, apart from any training: members are threads of this process (or of a child
process that is SIGKILLed or SIGSTOPped for real), each with its own store clients, the
heartbeat thread of production and the round formation of production; what the round loop
does between them (follow the round, end it when a member is fenced, admit joiners at a
snapshot) is done here in a few lines.

What is checked: a member's store load per heartbeat does not grow with the world (2 requests);
a lost node, a frozen member, two losses at once, three ring neighbours at once (more than the
two that watch each member), a lost proposer and a joiner; a thousand members form a round and
agree on the next one after a loss."""

from __future__ import annotations

import contextlib
import os
import queue as queue_mod
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from aegis.training.inprocess.membership import (
    CountingStore,
    Excluded,
    Heartbeat,
    Membership,
    ring,
    successors,
)
from aegis.training.inprocess.round import Round, joiners_registered, joiners_waiting

INTERVAL = 0.2  # run_in_process' defaults
DEAD_AFTER = 1.0


class _Member:
    """One process of the job as the round loop drives it: a heartbeat (own client), a
    Membership (own client), a fence callback that ends the running round."""

    def __init__(self, port: int, uid: str, *, interval: float = INTERVAL,
                 dead_after: float = DEAD_AFTER, form_timeout: float = 60.0,
                 start: bool = True) -> None:
        def client() -> CountingStore:
            return CountingStore(dist.TCPStore("127.0.0.1", port, is_master=False,
                                               wait_for_workers=False,
                                               timeout=timedelta(seconds=form_timeout)))

        self.uid = uid
        self.in_round = False
        self.member_set: set[str] = set()
        self.fenced: dict[str, float] = {}
        self.failed = threading.Event()
        self.hb_store = client()
        self.store = client()
        self.hb = Heartbeat(uid, interval, timedelta(seconds=form_timeout), dead_after_s=dead_after,
                            fence=self._fence, fenceable=self._fenceable, store=self.hb_store,
                            start=start)
        self.m = Membership(self.store, uid, self.hb, dead_after_s=dead_after,
                            form_timeout_s=form_timeout, min_world=1)
        self.members: list[str] = []
        self.r = -1
        self.admitted = 0

    def _fenceable(self, u: str) -> bool:
        return self.in_round and u in self.member_set

    def _fence(self, u: str) -> int:
        self.fenced.setdefault(u, time.time())
        self.failed.set()  # the round's collective fails (gloo: its connections shut)
        return 0

    def enter(self, r: int, previous: list[str] | None, expected: int, join_slot: int = 0) -> list[str]:
        """form() then follow(), as run_in_process does."""
        self.in_round = False
        self.hb.round_ended()
        members, admitted = self.m.form(r, previous, expected, join_slot=join_slot)
        self.members, self.member_set, self.r, self.admitted = members, set(members), r, admitted
        self.failed.clear()
        self.hb.follow(members, r)
        self.in_round = True
        return members

    def round_failed(self) -> bool:
        return self.failed.is_set() or self.uid in self.hb.declared()


def _all(fn: Callable[[Any], Any], items: list[Any]) -> list[Any]:
    """``fn`` on every item at once (one thread each), results in order; re-raises."""
    with ThreadPoolExecutor(max_workers=max(1, len(items))) as pool:
        return list(pool.map(fn, items))


@pytest.fixture
def store() -> Iterator[dist.TCPStore]:
    s = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                      timeout=timedelta(seconds=60))
    yield s
    del s


def _members(port: int, uids: list[str], **kw: Any) -> list[_Member]:
    # in parallel: a c10d connect looks the store's address up in reverse DNS, and this
    # sandbox's resolver leaves one lookup in ~20 unanswered for 5 s
    return _all(lambda u: _Member(port, u, **kw), uids)


def _stop(ms: list[_Member]) -> None:
    for m in ms:
        m.hb.stop()


def _first_round(ms: list[_Member], expected: int | None = None) -> list[str]:
    lists = _all(lambda m: m.enter(0, None, expected or len(ms)), ms)
    assert all(x == lists[0] for x in lists)
    return lists[0]


def _per_tick(ms: list[_Member], c0: list[tuple[int, int]]) -> float:
    """Heartbeat requests per beat over all members since ``c0`` (a snapshot taken in the middle
    of a beat is off by one request for that member: the sum over all of them is not)."""
    reqs = sum(m.hb_store.requests - c for m, (c, _) in zip(ms, c0, strict=True))
    ticks = sum(m.hb.ticks - t for m, (_, t) in zip(ms, c0, strict=True))
    return reqs / max(1, ticks)


def _wait(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


# -- a node in a child process (SIGKILL / SIGSTOP for real) -------------------------------------

def _node_main(port: int, uids: list[str], expected: int, q: Any) -> None:
    """A child "node": its members form round 0 with the others, then stay in it; a member whose
    round failed (fenced someone, or finds itself declared dead: it was frozen) forms the next
    round, and if that one was formed without it, joins the running job and waits to be
    admitted, as run_in_process does."""

    def run(uid: str) -> None:
        m = _Member(port, uid)
        q.put(("formed", uid, m.enter(0, None, expected)))
        while not m.round_failed():
            time.sleep(0.02)
        q.put(("failed", uid, m.r))
        try:
            m.enter(m.r + 1, m.members, expected)
            q.put(("next", uid, m.members))
        except Excluded:
            q.put(("excluded", uid, m.r + 1))
            r, previous, slot = m.m.join(timeout_s=60)
            q.put(("admitted", uid, r))
            q.put(("rejoined", uid, m.enter(r, previous, expected, join_slot=slot)))
        while True:
            time.sleep(1)

    for u in uids:
        threading.Thread(target=run, args=(u,), daemon=True).start()
    while True:
        time.sleep(1)


def _child(port: int, uids: list[str], expected: int) -> tuple[Any, Any]:
    from tests.dist_utils import _context

    ctx = _context()
    q = ctx.Queue()
    p = ctx.Process(target=_node_main, args=(port, uids, expected, q), daemon=True)
    p.start()
    return p, q


def _take(q: Any, kind: str, n: int, timeout: float) -> list[tuple[Any, ...]]:
    out: list[tuple[Any, ...]] = []
    deadline = time.monotonic() + timeout
    while len(out) < n:
        try:
            e = q.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue_mod.Empty:
            raise AssertionError(f"{len(out)} of {n} {kind!r} from the child in {timeout} s") from None
        if e[0] == kind:
            out.append(e)
    return out


# -- tests --------------------------------------------------------------------------------------

@pytest.mark.quick
def test_ring_interleaves_nodes_and_watchers_cover_a_lost_node() -> None:
    uids = [f"n{n}/{lr}/1{n}{lr}" for n in range(4) for lr in range(3)]
    order = ring(uids)
    assert order[:4] == ["n0/0/100", "n1/0/110", "n2/0/120", "n3/0/130"]
    for u in uids:  # every member of a node is watched by 2 members of other nodes
        watchers = [w for w in uids if u in successors(uids, w, 2)]
        assert len(watchers) == 2 and all(w.split("/")[0] != u.split("/")[0] for w in watchers)
    assert successors(["a/0/1"], "a/0/1", 2) == []
    assert successors(["a/0/1", "b/0/1"], "c/0/1", 2) == ["a/0/1", "b/0/1"]  # a joiner's sample


def test_a_members_store_load_does_not_grow_with_the_world() -> None:
    """2 requests per heartbeat (its counter; one multi_get of 2 neighbours' counters and the
    death log) whatever the world size, and a handful to form a round; the protocol before
    issue 24 read every member's counter at every beat (W requests) and every slot of the round
    at every 10 ms poll while forming one (W requests per poll)."""
    rates: dict[int, float] = {}
    forming: dict[int, list[int]] = {}
    for world in (4, 48):  # one job (one store) each
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=60))
        ms = _members(store.port, [f"n{i}/0/{i}" for i in range(world)], interval=0.1)
        try:
            before = [m.store.requests for m in ms]
            _first_round(ms)
            forming[world] = [m.store.requests - b for m, b in zip(ms, before, strict=True)]
            time.sleep(0.5)  # the first beats of a new ring check that its counters exist
            t0, c0 = time.monotonic(), [(m.hb_store.requests, m.hb.ticks) for m in ms]
            time.sleep(1.5)
            dt = time.monotonic() - t0
            assert _per_tick(ms, c0) == pytest.approx(2.0, abs=0.1)
            rates[world] = sum(m.hb_store.requests - c for m, (c, _) in zip(ms, c0, strict=True)) / dt / world
            assert not any(m.hb.declarations for m in ms)
        finally:
            _stop(ms)
    assert rates[48] < 1.3 * rates[4], rates
    for world, reqs in forming.items():
        # the proposer polls the count while the others join; the others: append, compare_set,
        # add, wait, get (+1 wait slice on a loaded machine)
        assert sorted(reqs)[-2] <= 7, (world, sorted(reqs))


@pytest.mark.timeout(120)
def test_a_lost_node_is_fenced_on_every_process_and_the_survivors_agree(store: dist.TCPStore) -> None:
    """A node of two members (a child process) SIGKILLed: the survivors that watch them declare
    them in the round's death log, every survivor (most of them watch neither) fences both
    through the one key it polls, within dead_after_s + 1 s, and they agree on the next round
    without them, in the previous order."""
    lost = ["nk/0/1", "nk/1/1"]
    local = [f"n{i}/{lr}/1" for i in range(3) for lr in range(2)]
    ms = _members(store.port, local)
    child, q = _child(store.port, lost, len(local) + len(lost))
    try:
        members = _first_round(ms, len(local) + len(lost))
        assert set(members) == set(local) | set(lost)
        assert {e[2] == members for e in _take(q, "formed", 2, 30)} == {True}
        time.sleep(0.5)
        t_kill = time.time()
        os.kill(child.pid, signal.SIGKILL)
        _wait(lambda: all(set(lost) <= set(m.fenced) for m in ms), DEAD_AFTER + 5, "fenced")
        detect = {m.uid: max(m.fenced[u] for u in lost) - t_kill for m in ms}
        assert max(detect.values()) <= DEAD_AFTER + 1.0, detect
        declarers = {m.uid for m in ms if m.hb.declarations}
        watchers = {w for w in local if set(successors(members, w, 2)) & set(lost)}
        assert declarers <= watchers and len(declarers) >= 1
        assert len(watchers) < len(local)  # the others learnt it from the death log
        t0 = time.time()
        nxt = _all(lambda m: m.enter(1, members, 0), ms)
        assert all(x == [u for u in members if u not in lost] for x in nxt), nxt[0]
        assert time.time() - t0 < 2.0
        assert sum(m.m.proposed.count(1) for m in ms) == 1  # one proposal for round 1
    finally:
        child.kill()
        _stop(ms)


@pytest.mark.timeout(180)
def test_a_frozen_member_is_fenced_then_finds_itself_excluded_and_rejoins(store: dist.TCPStore) -> None:
    """A member in a child process SIGSTOPped: its watchers declare it, everyone fences it, the
    survivors form round 1 without it. SIGCONT: it reads itself in the death log (its round is
    over), finds round 1 formed without it (Excluded), registers, and the survivors admit it at
    their next "snapshot" (admit + form round 2, as run_in_process does after a Regroup): every
    member of round 2, the woken one too, has the same list, with its join slot admitted."""
    frozen = "nf/0/1"
    local = [f"n{i}/0/1" for i in range(4)]
    ms = _members(store.port, local)
    child, q = _child(store.port, [frozen], 5)
    try:
        members = _first_round(ms, 5)
        _take(q, "formed", 1, 30)
        time.sleep(0.5)
        t_stop = time.time()
        os.kill(child.pid, signal.SIGSTOP)
        _wait(lambda: all(frozen in m.fenced for m in ms), DEAD_AFTER + 5, "fenced")
        assert max(m.fenced[frozen] for m in ms) - t_stop <= DEAD_AFTER + 1.0
        r1 = _all(lambda m: m.enter(1, members, 0), ms)
        assert all(x == local for x in r1)
        os.kill(child.pid, signal.SIGCONT)
        _take(q, "excluded", 1, 30)
        # the survivors' next snapshot: the vote sees a registration (join/count > admitted)
        _wait(lambda: int(store.add("aegis/join/count", 0)) > ms[0].admitted, 30, "registered")
        registered = int(store.add("aegis/join/count", 0))
        previous = _all(lambda m: m.m.admit(2, m.members, m.admitted, registered), ms)
        assert all(p == local + [frozen] for p in previous)
        r2 = _all(lambda mp: mp[0].enter(2, mp[1], 0), list(zip(ms, previous, strict=True)))
        back = _take(q, "rejoined", 1, 30)[0][2]
        assert all(x == local + [frozen] for x in r2) and back == r2[0]
        assert all(m.admitted == registered for m in ms)
    finally:
        os.kill(child.pid, signal.SIGCONT)
        child.kill()
        _stop(ms)


def test_two_losses_at_once_and_three_ring_neighbours_at_once(store: dist.TCPStore) -> None:
    """Two members of different nodes lost together: both declared and fenced everywhere, one
    next round without both. Then three members next to each other on the ring (more than the
    two that watch each member): the third has no live watcher, so nobody declares it, but the
    round fails on the other two and the proposer, watching the previous members that have not
    joined, leaves it out dead_after_s later."""
    uids = [f"n{i}/0/1" for i in range(10)]
    ms = _members(store.port, uids)
    by = {m.uid: m for m in ms}
    try:
        members = _first_round(ms)
        time.sleep(0.5)
        gone = [members[1], members[6]]
        t0 = time.time()
        _stop([by[u] for u in gone])
        live = [m for m in ms if m.uid not in gone]
        _wait(lambda: all(set(gone) <= set(m.fenced) for m in live), DEAD_AFTER + 5, "fenced")
        assert max(m.fenced[u] for m in live for u in gone) - t0 <= DEAD_AFTER + 1.0
        r1 = _all(lambda m: m.enter(1, members, 0), live)
        assert all(x == [u for u in members if u not in gone] for x in r1)

        order = ring(r1[0])
        run = order[2:5]  # ring positions 2, 3, 4: 4's watchers are 2 and 3
        time.sleep(0.5)
        _stop([by[u] for u in run])
        live2 = [m for m in live if m.uid not in run]
        _wait(lambda: any(m.round_failed() for m in live2), DEAD_AFTER + 5, "a loss seen")
        _wait(lambda: all(m.round_failed() for m in live2), 2, "every survivor's round failed")
        t1 = time.time()
        r2 = _all(lambda m: m.enter(2, m.members, 0), live2)
        assert all(x == [u for u in r1[0] if u not in run] for x in r2)
        declared = {u for m in live2 for u, _s, _t in m.hb.declarations}
        assert set(run[:2]) <= declared and run[2] not in declared
        assert time.time() - t1 <= DEAD_AFTER + 1.5  # judged by the proposer itself
    finally:
        _stop(ms)


class _SlowReads:
    """A store client whose multi_get takes ``delay`` s (a loaded store, or many counters)."""

    def __init__(self, store: Any, delay: float) -> None:
        self.store, self.delay = store, delay

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    def multi_get(self, keys: list[str]) -> Any:
        time.sleep(self.delay)
        return self.store.multi_get(keys)


def test_watching_anew_keeps_the_readings_of_a_beat_in_flight(store: dist.TCPStore) -> None:
    """A proposer re-watches the previous members still missing every interval while its
    heartbeat reads their counters. A watch() call used to throw away the readings of the beat
    in flight; with reads slower than the re-watching (bench/scale.py at 2,048 members on 2
    cores: ~2,000 counters per read), no reading ever landed, every missing member looked
    silent for dead_after_s, and round 2 formed with 779 of 2,032 survivors."""
    peer = _Member(store.port, "np/0/1")  # beats every 0.2 s
    client = dist.TCPStore("127.0.0.1", store.port, is_master=False, wait_for_workers=False,
                           timeout=timedelta(seconds=30))
    hb = Heartbeat("nw/0/1", 0.1, timedelta(seconds=30), store=_SlowReads(client, 0.3))
    stop = threading.Event()

    def rewatch() -> None:
        while not stop.is_set():  # as a proposer whose missing list changes
            hb.watch(["np/0/1", "nx/0/1"])
            time.sleep(0.05)
            hb.watch(["np/0/1"])
            time.sleep(0.05)

    t = threading.Thread(target=rewatch)
    try:
        hb.watch(["np/0/1"])
        t.start()
        # the event: readings of the peer's counter land while it is re-watched (with the bug
        # none ever did, and the member looked silent for as long as it was watched)
        counts: set[int] = set()
        worst = 0.0
        deadline = time.monotonic() + 60
        while len(counts) < 3 and time.monotonic() < deadline:
            c = hb.count("np/0/1")[0]
            if c is not None:
                counts.add(c)
            worst = max(worst, hb.silent_for("np/0/1"))
            time.sleep(0.02)
        assert len(counts) >= 3, f"no reading of the peer's beats landed (counts seen: {counts})"
        print(f"longest silence seen: {worst:.2f} s")
    finally:
        stop.set()
        t.join()
        hb.stop()
        peer.hb.stop()


def test_a_starved_observer_takes_nobody_for_silent(store: dist.TCPStore) -> None:
    """Silence is what this process saw between its reads, not wall time since its last read:
    an observer whose heartbeat did not run for longer than dead_after_s (its host starved:
    bench/scale.py's 4,096 members on 2 cores, where a proposer left 2,395 beating members out
    of a round) must not take a member it has not looked at since for silent. One it looks at
    and finds unmoved is silent, and a member that never beat is silent from its watch on."""
    peer = _Member(store.port, "np/0/1")  # beats every 0.2 s
    client = dist.TCPStore("127.0.0.1", store.port, is_master=False, wait_for_workers=False,
                           timeout=timedelta(seconds=30))
    hb = Heartbeat("no/0/1", 0.1, timedelta(seconds=30), store=client, start=False)
    try:
        hb.watch(["np/0/1", "never/0/1"])
        assert hb.tick()
        time.sleep(1.5)  # no beat of the observer: it looked at nothing
        assert hb.silent_for("np/0/1") < 0.5
        assert hb.tick()  # the peer moved meanwhile
        assert hb.silent_for("np/0/1") < 0.5
        assert hb.silent_for("never/0/1") >= 1.4  # looked twice, 1.5 s apart: no counter
        peer.hb.stop()
        time.sleep(0.3)
        assert hb.tick()
        time.sleep(1.2)
        assert hb.tick()  # unmoved between two reads 1.2 s apart
        assert hb.silent_for("np/0/1") >= 1.0
    finally:
        hb.stop()
        peer.hb.stop()


def test_a_watcher_declares_only_in_its_running_round_or_after_it(store: dist.TCPStore) -> None:
    """A watcher that has followed a round but is not running it yet (still starting, while the
    member it watches is held back by its own start: gc.collect() holding the GIL for a second
    under load, seen in test_inprocess' replacement test) declares nobody: a declaration stays
    for the whole round. Running the round, or once the round has ended, it declares."""
    client = dist.TCPStore("127.0.0.1", store.port, is_master=False, wait_for_workers=False,
                           timeout=timedelta(seconds=30))
    running = threading.Event()
    watcher = Heartbeat("nw/0/1", 0.1, timedelta(seconds=30), dead_after_s=0.5, store=client,
                        fence=lambda u: 0, fenceable=lambda u: running.is_set(), start=False)
    quiet = Heartbeat("nq/0/1", 0.1, timedelta(seconds=30), store=client, start=False)  # no beats
    try:
        watcher.follow(["nw/0/1", "nq/0/1"], 0)
        for _ in range(3):
            assert watcher.tick()
            time.sleep(0.4)
        assert not watcher.declarations and "nq/0/1" not in watcher.declared()
        running.set()  # in the round now: it declares, and fences
        assert watcher.tick()
        assert [d[0] for d in watcher.declarations] == ["nq/0/1"]
        assert [f[0] for f in watcher.fences] == ["nq/0/1"]
        watcher.follow(["nw/0/1", "nq/0/1"], 1)  # the next round, not running it yet
        running.clear()
        for _ in range(3):
            assert watcher.tick()
            time.sleep(0.4)
        assert len(watcher.declarations) == 1
        watcher.round_ended()  # it ended: the next round's proposer needs the dead named
        assert watcher.tick()
        assert "nq/0/1" in watcher.declared() and len(watcher.declarations) == 2
    finally:
        watcher.stop()
        quiet.stop()


def test_a_silent_member_is_declared_at_dead_after_s_not_at_the_next_beat(store: dist.TCPStore) -> None:
    """The watcher looks once more when a silent successor reaches dead_after_s: with beats
    every 0.5 s and dead_after_s = 1.2 s, looks at beats alone would find it silent for 1.5 s
    first (the chaos campaign's freezes waited up to a beat, a tenth of a second on average,
    for their declaration)."""
    def client() -> dist.TCPStore:
        return dist.TCPStore("127.0.0.1", store.port, is_master=False, wait_for_workers=False,
                             timeout=timedelta(seconds=30))

    member = Heartbeat("nq/0/9", 0.1, timedelta(seconds=30), store=client())
    watcher = Heartbeat("nw/0/9", 0.5, timedelta(seconds=30), dead_after_s=1.2, store=client(),
                        fence=lambda u: 0, fenceable=lambda u: True)
    try:
        watcher.follow(["nw/0/9", "nq/0/9"], 0)
        time.sleep(1.2)
        member.stop()  # silent from now on
        deadline = time.monotonic() + 5
        while not watcher.declarations and time.monotonic() < deadline:
            time.sleep(0.02)
        assert [d[0] for d in watcher.declarations] == ["nq/0/9"]
        silent = watcher.declarations[0][1]
        # looks at beats alone declare at 1.5 s (the first beat past 1.2 s): anything below is
        # the extra look; the margin above 1.2 s is the machine's (a liveness bound, issue 37)
        assert 1.2 <= silent < 1.5, silent
        assert watcher.ticks < 2 * 5 + 4  # one extra look, not a look every few milliseconds
    finally:
        watcher.stop()
        member.stop()


def test_a_fence_that_cannot_reach_the_store_is_tried_again_and_creation_waits_longer(
        store: dist.TCPStore) -> None:
    """A fence needs the dead member's published sockets, from the store; right after a store
    restart that read can fail, and the fence was then never tried again (the chaos campaign: a
    frozen member fenced 11 s late, at the collective's timeout). Now the heartbeat tries again
    at its next beat. And while the round's groups are created a silent member is declared only
    after CREATING_SILENT_S (2 s), not dead_after_s."""
    from aegis.training.inprocess.membership import CREATING_SILENT_S

    client = dist.TCPStore("127.0.0.1", store.port, is_master=False, wait_for_workers=False,
                           timeout=timedelta(seconds=30))
    tries: list[float] = []

    def fence(u: str) -> int:
        tries.append(time.monotonic())
        if len(tries) == 1:
            raise ConnectionError("the membership store is unreachable (synthetic)")
        return 1

    creating = threading.Event()
    creating.set()
    watcher = Heartbeat("nw/0/2", 0.1, timedelta(seconds=30), dead_after_s=0.5, store=client,
                        fence=fence, fenceable=lambda u: True, creating=creating.is_set,
                        start=False)
    quiet = Heartbeat("nq/0/2", 0.1, timedelta(seconds=30), store=client, start=False)  # no beats
    try:
        watcher.follow(["nw/0/2", "nq/0/2"], 0)
        t0 = time.monotonic()
        while not watcher.declarations:
            assert watcher.tick()
            assert time.monotonic() - t0 < 10
            time.sleep(0.1)
        assert watcher.declarations[0][1] >= CREATING_SILENT_S, watcher.declarations
        assert len(tries) == 1 and not watcher.fences  # the first fence failed
        assert watcher.tick()
        assert len(tries) == 2 and [f[0] for f in watcher.fences] == ["nq/0/2"]
        assert watcher.tick()
        assert len(tries) == 2  # fenced once it worked, not again
    finally:
        watcher.stop()
        quiet.stop()


def test_a_member_whose_beats_pause_is_fenced_but_stays_in_the_next_round(
        store: dist.TCPStore) -> None:
    """A member's heartbeat held back for longer than dead_after_s (a GC pause) while another
    member dies: both are declared and fenced, the round fails; the paused one joins the next
    round, and the proposer, watching it because it is declared, keeps it once its counter
    moves again (it used to leave every declared member out: a second's pause cost a rejoin)."""
    uids = [f"n{i}/0/1" for i in range(5)]
    ms = _members(store.port, uids)
    by = {m.uid: m for m in ms}
    try:
        members = _first_round(ms)
        time.sleep(0.5)
        dead, paused = by[members[4]], by[members[1]]
        real = paused.hb.tick
        pause = threading.Event()

        def held_back() -> bool:
            if pause.is_set():
                pause.clear()
                time.sleep(DEAD_AFTER + 0.5)
            return real()

        paused.hb.tick = held_back  # type: ignore[method-assign]
        pause.set()
        _stop([dead])
        live = [m for m in ms if m is not dead]
        _wait(lambda: all(m.round_failed() for m in live if m is not paused), DEAD_AFTER + 5,
              "the loss seen")
        _wait(lambda: any(paused.uid in m.hb.declared() for m in live if m is not paused),
              DEAD_AFTER + 3, "the paused member declared")  # before anyone proposes
        # another member proposes (the first to claim the key does; a proposer never suspects
        # itself), and the paused one has joined when it looks
        lead = by[members[2]]
        store.compare_set("aegis/round/1/proposer", "", lead.uid)
        box: dict[str, list[str]] = {}
        t = threading.Thread(target=lambda: box.setdefault("m", paused.enter(1, members, 0)))
        t.start()
        _wait(lambda: int(store.add("aegis/round/1/count", 0)) >= 1, 5, "the paused one joined")
        r1 = _all(lambda m: m.enter(1, members, 0), [m for m in live if m is not paused])
        t.join(10)
        r1.append(box["m"])
        declared = {d[0] for m in live for d in m.hb.declarations}
        assert {dead.uid, paused.uid} <= declared  # both went silent for dead_after_s
        assert all(x == [u for u in members if u != dead.uid] for x in r1), r1[0]
    finally:
        _stop(ms)


def test_a_member_that_finds_itself_declared_dead_fences_itself_off_its_round(
        store: dist.TCPStore) -> None:
    """A member silent for dead_after_s (here its beats held back, as a SIGSTOP or a cut link
    would) is declared and fenced by the others; when it looks again and reads its own name in
    the round's death log, it fences itself: off its whole round (gloo: every connection of its
    own shut down), so that a collective it is blocked in fails whichever peer it waits on. A
    chaos campaign found a thawed worker blocked for good in an all-gather with its own node's
    other worker, which had left the round without closing that connection."""
    uids = [f"n{i}/0/1" for i in range(3)]
    ms = _members(store.port, uids)
    try:
        _first_round(ms)
        time.sleep(0.5)
        paused = ms[1]
        real = paused.hb.tick
        pause = threading.Event()
        pause.set()

        def held_back() -> bool:
            if pause.is_set():
                pause.clear()
                time.sleep(DEAD_AFTER + 0.5)
            return real()

        paused.hb.tick = held_back  # type: ignore[method-assign]
        others = [m for m in ms if m is not paused]
        _wait(lambda: all(paused.uid in m.fenced for m in others), DEAD_AFTER + 5, "fenced")
        _wait(lambda: paused.uid in paused.fenced, DEAD_AFTER + 5, "fenced itself")
        assert not any(m.uid in m.fenced for m in others)  # nobody else declared itself
    finally:
        _stop(ms)


def test_a_proposer_that_stops_is_replaced(store: dist.TCPStore) -> None:
    """The member that won the proposer key of a round stops (its heartbeat too) before it
    proposes: the others take the key over once its counter did not move for a wait slice,
    and the round forms without it."""
    uids = [f"n{i}/0/1" for i in range(5)]
    ms = _members(store.port, uids, dead_after=0.5)
    try:
        members = _first_round(ms)
        lead = ms[2]
        hold = threading.Event()

        def frozen_propose(*_a: Any, **_k: Any) -> None:
            lead.hb.stop()
            hold.wait(60)

        lead.m._propose = frozen_propose  # type: ignore[method-assign]
        def lead_forms() -> None:
            with contextlib.suppress(Excluded):  # once released: the round formed without it
                lead.enter(1, members, 0)

        threading.Thread(target=lead_forms, daemon=True).start()
        _wait(lambda: store.check(["aegis/round/1/proposer"]), 10, "proposer key")
        assert store.get("aegis/round/1/proposer").decode() == lead.uid
        others = [m for m in ms if m is not lead]
        t0 = time.time()
        r1 = _all(lambda m: m.enter(1, members, 0), others)
        assert all(x == [u for u in members if u != lead.uid] for x in r1)
        assert store.get("aegis/round/1/proposer").decode() != lead.uid
        assert time.time() - t0 < 15
        hold.set()
    finally:
        _stop(ms)


def test_a_joiner_joins_a_round_being_formed_directly(store: dist.TCPStore) -> None:
    """A process that registers while the survivors of a loss form the next round joins that
    round directly (it counts as a member, not as a proposer) and gets the same list. Its join
    slot is admitted by that round for good: the round after the next loss does not count it
    as waiting again (which made its members end a round at their next snapshot to admit a
    process already among them: an empty round after each such loss)."""
    uids = [f"n{i}/0/1" for i in range(4)]
    ms = _members(store.port, uids)
    new = _Member(store.port, "nx/0/1")
    try:
        members = _first_round(ms)
        _stop([ms[3]])
        live = ms[:3]
        _wait(lambda: all(m.round_failed() for m in live), DEAD_AFTER + 5, "loss seen")
        box: dict[str, Any] = {}

        def joiner() -> None:
            r, previous, slot = new.m.join(timeout_s=30)
            box["joined"] = (r, previous)
            box["slot"] = slot
            box["members"] = new.enter(r, previous, 0, join_slot=slot)

        # the joiner finds round 1 being formed: the survivors are held until it has joined
        t = threading.Thread(target=joiner)
        slow = live[0]
        started = threading.Event()
        real = slow.m.form

        def late_form(*a: Any, **k: Any) -> Any:
            started.wait(30)
            return real(*a, **k)

        slow.m.form = late_form  # type: ignore[method-assign]
        out: list[Any] = []
        th = threading.Thread(target=lambda: out.extend(_all(lambda m: m.enter(1, members, 0), live)))
        th.start()
        _wait(lambda: int(store.add("aegis/round/1/count", 0)) >= 2, 10, "survivors forming")
        t.start()
        _wait(lambda: "joined" in box, 10, "joiner sees the forming round")
        time.sleep(0.3)
        started.set()
        th.join(30)
        t.join(30)
        assert box["joined"] == (1, members)
        assert all(x == box["members"] for x in out)
        assert box["members"] == [u for u in members if u != ms[3].uid] + ["nx/0/1"]
        slot = box["slot"]
        assert slot >= 1 and all(m.admitted >= slot for m in [*live, new])
        # the next loss: the round the survivors form still counts the joiner's slot admitted
        _stop([live[1]])
        rest = [live[0], live[2], new]
        _wait(lambda: all(m.round_failed() for m in rest), DEAD_AFTER + 5, "second loss seen")
        lists = _all(lambda m: m.enter(2, box["members"], 0), rest)
        assert all(x == lists[0] for x in lists) and live[1].uid not in lists[0]
        assert [m.admitted for m in rest] == [slot] * 3, [m.admitted for m in rest]
        assert int(store.add("aegis/admitted", 0)) == slot
    finally:
        _stop([*ms, new])


STORE_MAIN = """
import sys
from datetime import timedelta
from torch.distributed import TCPStore
s = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=300))
print(s.port, flush=True)
sys.stdin.read()
"""
# c10d looks the store's address up in reverse DNS at every connect; this sandbox's resolver
# leaves lookups unanswered for 5 s: the processes of the thousand-member test give up after 1 s
QUIET_DNS = {"RES_OPTIONS": "timeout:1 attempts:1", "TORCH_CPP_LOG_LEVEL": "ERROR"}


def _host_main(port: int, uids: list[str], world: int, interval: float, dead_after: float,
               q: Any) -> None:
    """Members of the thousand-member test in one process: each with its own clients, forming
    rounds in a thread of its own; their heartbeats beaten in turn by two threads (a thread per
    member would leave hundreds of threads queueing for this process's GIL: a cost of running
    many members in one process, not of the protocol)."""
    os.environ.update(QUIET_DNS)
    threading.stack_size(256 << 10)
    ms = _all(lambda u: _Member(port, u, interval=interval, dead_after=dead_after, start=False), uids)
    stop = threading.Event()

    def drive(mine: list[_Member]) -> None:
        due = time.monotonic()
        while not stop.is_set():
            for m in mine:
                m.hb.tick()
            due = max(due + interval, time.monotonic() - interval)
            stop.wait(max(0.0, due - time.monotonic()))

    for k in range(2):
        threading.Thread(target=drive, args=(ms[k::2],), daemon=True).start()
    _all(lambda m: m.enter(0, None, world), ms)
    q.put(("formed", ms[0].members))
    time.sleep(1.0)
    c0 = [(m.hb_store.requests, m.hb.ticks) for m in ms]
    time.sleep(2.0)
    q.put(("steady", _per_tick(ms, c0), sum(len(m.hb.declarations) for m in ms)))

    def next_round(m: _Member) -> tuple[float, float, list[str], int]:
        m.failed.wait()
        t_learnt = time.time()
        req0 = m.store.requests
        m.enter(1, m.members, 0)
        return t_learnt, time.time(), m.members, m.store.requests - req0

    q.put(("next", _all(next_round, ms), [d for m in ms for d in m.hb.declarations]))
    while True:
        time.sleep(1)


@pytest.mark.timeout(240)
def test_a_thousand_members_form_a_round_and_agree_after_a_lost_node() -> None:
    """1,000 members (four processes of 248 and a node of 8 in a fifth) on 125 nodes of 8, a store
    server of its own: they form a first round, beat at 2 requests a beat with no false
    declaration, and after the node's process is SIGKILLed every survivor learns it from the
    death log and they agree on the next round, with 5 requests each (the proposer: a few
    dozen), the record a diff of the previous round (the times are printed; bench/scale.py
    measures them)."""
    import subprocess
    import sys

    from tests.dist_utils import _context

    # dead_after 3 s, not the default's 1 s: here 248 members share one process's GIL and beat
    # from two threads, and a process of them stalled past 1 s on an idle CI machine (run 41: the
    # 8-member process declared 12 live members); a second of silence in this packing is the
    # simulation's, not the protocol's. The kill below is declared after dead_after of silence
    # (this store has no liveness service), the others learn it from the death log as before.
    n_nodes, per, interval, dead_after = 125, 8, 0.2, 3.0
    uids = [f"node-{n:03d}/{lr}/{1000 + n}" for n in range(n_nodes) for lr in range(per)]
    lost = [u for u in uids if u.startswith("node-061/")]
    rest = [u for u in uids if u not in lost]
    server = subprocess.Popen([sys.executable, "-c", STORE_MAIN], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env={**os.environ, **QUIET_DNS})
    assert server.stdout is not None
    port = int(server.stdout.readline())
    ctx = _context()
    qs = [ctx.Queue() for _ in range(5)]
    parts = [rest[k::4] for k in range(4)] + [lost]
    procs = [ctx.Process(target=_host_main, args=(port, part, len(uids), interval, dead_after, q),
                         daemon=True) for part, q in zip(parts, qs, strict=True)]
    try:
        t0 = time.monotonic()
        for p in procs:
            p.start()
        formed = [q.get(timeout=120) for q in qs]
        assert all(f[0] == "formed" and f[1] == formed[0][1] for f in formed)
        members = formed[0][1]
        assert sorted(members) == sorted(uids)
        first_s = time.monotonic() - t0
        steady = [q.get(timeout=60) for q in qs]
        assert all(s[1] == pytest.approx(2.0, abs=0.1) for s in steady), steady
        assert sum(s[2] for s in steady) == 0, "a false declaration in the steady state"
        t_kill = time.time()
        os.kill(procs[4].pid, signal.SIGKILL)
        out = [q.get(timeout=60) for q in qs[:4]]
        rows = [row for o in out for row in o[1]]
        declared = [d for o in out for d in o[2] if d[0] in lost]
        assert len(rows) == len(rest)
        assert all(row[2] == [u for u in members if u not in lost] for row in rows)
        published = min(d[2] for d in declared)
        learnt = max(row[0] for row in rows) - t_kill
        agree = max(row[1] for row in rows) - published
        reqs = sorted(row[3] for row in rows)
        print(f"1,000 members: start + first round {first_s:.1f} s; after the SIGKILL every "
              f"survivor knew in {learnt:.2f} s, first death record -> every survivor has the next "
              f"round {agree:.2f} s; requests to form it {reqs[0]}-{reqs[-2]} (proposer {reqs[-1]})")
        # the times are printed, not bounded: on 2 cores shared by 1,000 members they are the
        # machine's (CI run 25: agreement 1.13 s where runs before gave under 1 s); the bounds
        # are measured in bench/scale.py. What is checked: every survivor learnt of the loss
        # and agreed on the same round without the lost node, with O(1) requests each.
        assert learnt > 0 and agree > 0
        assert reqs[-2] <= 6
    finally:
        for p in procs:
            p.kill()
        assert server.stdin is not None
        server.stdin.close()
        server.wait(10)


def test_after_a_store_restart_members_not_back_yet_are_not_declared() -> None:
    """The store restarted empty: a watcher whose client is back first finds no counter for a
    member that has not reconnected yet. That member counts as just seen (dead only after
    dead_after_s + BLIND_GRACE_S of looks), not as silent since its last beat before the
    outage: it was declared at once (the chaos campaign: 3 live members declared together
    right after a restart, and the next round took 12 s to form)."""
    from aegis.training.inprocess.membership import BLIND_GRACE_S
    from tests.servers import RestartingClient as Client
    from tests.servers import tcp_store_server as server

    old = server()
    wc, mc = Client(old), Client(old)
    watcher = Heartbeat("nw/0/3", 0.1, timedelta(seconds=30), dead_after_s=0.5, store=wc,
                        fence=lambda u: 0, fenceable=lambda u: True, start=False)
    member = Heartbeat("nm/0/3", 0.1, timedelta(seconds=30), store=mc, start=False)
    try:
        watcher.follow(["nw/0/3", "nm/0/3"], 0)
        for _ in range(5):
            member.tick()
            watcher.tick()
            time.sleep(0.1)
        time.sleep(1.0)  # the store is down: nobody beats
        new = server()
        wc.restart(new)
        mc.restart(new)
        assert not watcher.tick()  # finds the restart
        t0 = time.monotonic()
        while time.monotonic() - t0 < 0.5 + BLIND_GRACE_S - 0.5:  # the member is not back yet
            watcher.tick()
            time.sleep(0.1)
        assert not watcher.declarations, watcher.declarations
        member.tick()  # back (its first beat finds the restart)
        for _ in range(5):
            member.tick()
            watcher.tick()
            time.sleep(0.1)
        assert not watcher.declarations, watcher.declarations
        for _ in range(12):  # now it stops for good: declared after dead_after_s
            watcher.tick()
            time.sleep(0.1)
        assert [d[0] for d in watcher.declarations] == ["nm/0/3"]
    finally:
        watcher.stop()
        member.stop()


@pytest.mark.quick
def test_a_full_round_votes_to_admit_nobody_and_a_round_with_room_only_what_fits() -> None:
    """``max_world``: the joiners a snapshot's vote counts are capped by the round's room (the
    same on every member), so a full round admits nobody (the processes wait as spares) and a
    round with room for one admits the first slot only."""
    saved = (Round.members, Round.admitted, Round.joiners, Round.max_world)
    try:
        Round.members, Round.admitted, Round.joiners = ["a", "b", "c"], 2, lambda: 5
        Round.max_world = None
        assert joiners_registered() == 5 and joiners_waiting(joiners_registered())
        Round.max_world = 3
        assert joiners_registered() == 2 and not joiners_waiting(joiners_registered())
        Round.max_world = 4
        assert joiners_registered() == 3 and joiners_waiting(joiners_registered())
        Round.members = ["a", "b"]  # a loss: room for two
        assert joiners_registered() == 4
    finally:
        Round.members, Round.admitted, Round.joiners, Round.max_world = saved


@pytest.mark.quick
def test_a_round_formed_full_leaves_the_last_joiner_out_as_a_spare(store: dist.TCPStore) -> None:
    """A first round of four processes with ``max_world=3``: three are members (uid order) and
    the fourth is told it is a spare (``Excluded.spare``), not that it missed a round."""
    uids = [f"n{i}/0/1" for i in range(4)]
    ms = _members(store.port, uids)
    try:
        for m in ms:
            m.m.max_world = 3
        results = _all(lambda m: _outcome(lambda: m.enter(0, None, 4)), ms)
        assert results[:3] == [uids[:3]] * 3
        assert isinstance(results[3], Excluded) and results[3].spare
    finally:
        _stop(ms)


def _outcome(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Excluded as e:
        return e


@pytest.mark.quick
def test_a_max_world_below_min_world_is_refused_before_anything_starts() -> None:
    import aegis
    from aegis.errors import ConfigError

    with pytest.raises(ConfigError, match="max_world .* must be at least min_world"):
        aegis.run_in_process(lambda w: None, min_world=3, max_world=2)
