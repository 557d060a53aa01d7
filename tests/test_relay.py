"""The node heartbeat relay (issue 40, ``aegis/training/inprocess/relay.py``): the processes of a
node beat through the one holding the node's lock, so the store serves 2 requests per node per
beat; what a watcher sees is unchanged (a silent process is declared, a live one never is), and
the node's processes beat directly whenever the relay stops answering. Heartbeats with real
TCPStore clients, one per member as in a job, their relays in a temporary directory."""

from __future__ import annotations

import fcntl
import os
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from aegis.training.inprocess.heartbeat import CountingStore, Heartbeat
from aegis.training.inprocess.relay import NodeRelay, relay_root
from tests.servers import RestartingClient, tcp_store_server

NODES = {"na": ["na/0/1", "na/1/2", "na/2/3"], "nb": ["nb/0/4", "nb/1/5", "nb/2/6"]}
ALL = [u for us in NODES.values() for u in us]


@pytest.fixture
def store() -> Iterator[dist.TCPStore]:
    s = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                      timeout=timedelta(seconds=60))
    yield s
    del s


def _hb(port: int, root: Path, uid: str, *, relay: bool = True, start: bool = False,
        interval: float = 0.1, dead_after: float | None = None,
        fenced: list[str] | None = None) -> Heartbeat:
    client = CountingStore(dist.TCPStore("127.0.0.1", port, is_master=False,
                                         wait_for_workers=False, timeout=timedelta(seconds=30)))
    node = uid.split("/")[0]
    return Heartbeat(uid, interval, timedelta(seconds=30), dead_after_s=dead_after, store=client,
                     fence=(fenced.append if fenced is not None else None),  # type: ignore[arg-type]
                     fenceable=lambda u: True, start=start,
                     relay=NodeRelay(root, node, uid, stale_s=2.5 * interval) if relay else None)


def _wait(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


@pytest.mark.quick
def test_relay_root_is_per_store_and_names_are_safe(tmp_path: Path) -> None:
    assert relay_root("10.0.0.1:29500") != relay_root("10.0.0.1:29501")
    r = NodeRelay(tmp_path, "node-1/x", "node-1/x/0/12", stale_s=1.0)
    try:
        assert r.dir.parent == tmp_path and "/" not in r.dir.name
        assert r.lead() and r.lead()  # taken once, kept
        other = NodeRelay(tmp_path, "node-1/x", "node-1/x/1/13", stale_s=1.0)
        assert not other.lead()  # held by the first
        r.close()
        assert other.lead()  # released on close (and by the kernel when its holder dies)
        other.close()
    finally:
        r.close()


def test_a_node_beats_with_two_store_requests_and_every_counter_moves(
        store: dist.TCPStore, tmp_path: Path) -> None:
    hbs = [_hb(store.port, tmp_path, u) for u in ALL]
    direct = [_hb(store.port, tmp_path / "direct", u.replace("n", "d", 1), relay=False) for u in ALL]
    try:
        for h in hbs:
            h.follow(ALL, 0)
        for h in direct:
            h.follow([u.replace("n", "d", 1) for u in ALL], 0)

        def beat(group: list[Heartbeat], n: int) -> None:
            for _ in range(n):
                for h in group:
                    assert h.tick()

        beat(hbs, 3)  # warm-up: keys checked, logs created once
        beat(direct, 3)
        before = [store.add(f"aegis/hb/{u}", 0) for u in ALL]
        c0 = sum(h._store.requests for h in hbs)
        d0 = sum(h._store.requests for h in direct)
        beat(hbs, 10)
        beat(direct, 10)
        relayed = (sum(h._store.requests for h in hbs) - c0) / 10
        plain = (sum(h._store.requests for h in direct) - d0) / 10
        after = [store.add(f"aegis/hb/{u}", 0) for u in ALL]
        assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)
        assert relayed == pytest.approx(2 * len(NODES), abs=0.5), relayed  # 2 per node per beat
        assert plain == pytest.approx(2 * len(ALL), abs=0.5), plain  # 2 per process
        assert sum(h.relayed_ticks for h in hbs) >= 0.9 * 13 * len(ALL)
        assert sum(1 for h in hbs if h._relay and h._relay.batches) == len(NODES)  # one relay each
        # each member read its ring successors' counters through the relay
        assert all(h.count(u)[0] is not None for h in hbs for u in h.watched())
    finally:
        for h in hbs + direct:
            h.stop()


def test_a_silent_process_is_declared_and_a_frozen_relay_leaves_its_node_beating(
        store: dist.TCPStore, tmp_path: Path) -> None:
    """Beats from threads every 0.1 s, ``dead_after_s`` 0.6 s. A process of node na that stops
    beating (not the relay) is declared by its watchers, and only it; then the
    relay of nb stops (frozen: it keeps the lock): its node's other processes beat directly and
    are never declared, and the relay itself is."""
    fenced: list[str] = []
    hbs = {u: _hb(store.port, tmp_path, u, start=True, dead_after=0.6, fenced=fenced) for u in ALL}
    try:
        for h in hbs.values():
            h.follow(ALL, 0)
        _wait(lambda: all(h.relayed_ticks >= 3 for h in hbs.values()), 10, "relayed beats")
        lead = {n: next(u for u in us if hbs[u]._relay and hbs[u]._relay.leading) for n, us in NODES.items()}
        quiet = next(u for u in NODES["na"] if u != lead["na"])
        hbs[quiet].stop()
        t_quiet = time.monotonic()
        _wait(lambda: quiet in hbs[lead["nb"]].declared(), 10, f"{quiet} declared")
        print(f"declared {time.monotonic() - t_quiet:.2f} s after it stopped")  # bench/scale.py times it
        assert hbs[lead["nb"]].declared() == {quiet}

        frozen = lead["nb"]
        hbs[frozen]._stop.set()  # its thread stops beating; it keeps the node's lock
        hbs[frozen]._thread.join(5)  # type: ignore[union-attr]
        t_frozen = time.monotonic()
        _wait(lambda: frozen in hbs[lead["na"]].declared(), 10, f"{frozen} declared")
        others = [u for u in NODES["nb"] if u != frozen]
        direct0 = {u: hbs[u].ticks - hbs[u].relayed_ticks for u in others}
        time.sleep(1.0)  # long past dead_after_s: nb's others must still be alive
        assert all(hbs[u].ticks - hbs[u].relayed_ticks > direct0[u] for u in others)  # direct now
        assert hbs[lead["na"]].declared() == {quiet, frozen}, (hbs[lead["na"]].declared(), time.monotonic() - t_frozen)
    finally:
        for h in hbs.values():
            h.stop()


def test_a_relay_that_leaves_hands_the_node_to_another(store: dist.TCPStore, tmp_path: Path) -> None:
    hbs = [_hb(store.port, tmp_path, u) for u in NODES["na"]]
    try:
        for h in hbs:
            h.follow(NODES["na"], 0)
        for _ in range(3):
            for h in hbs:
                h.tick()
        holder = next(h for h in hbs if h._relay and h._relay.leading)
        holder.stop()  # closes its relay: the lock is free
        rest = [h for h in hbs if h is not holder]
        n0 = [h.relayed_ticks for h in rest]
        for _ in range(4):
            for h in rest:
                assert h.tick()
        assert sum(1 for h in rest if h._relay and h._relay.leading) == 1
        assert all(h.relayed_ticks > n for h, n in zip(rest, n0, strict=True))
    finally:
        for h in hbs:
            h.stop()


@pytest.mark.quick
def test_jobs_relay_by_default_from_512_processes_unless_the_environment_says() -> None:
    from aegis.training.inprocess.loop import RELAY_FROM, relay_by_default

    assert RELAY_FROM == 512
    assert not relay_by_default(6, None) and not relay_by_default(511, "")
    assert relay_by_default(512, None) and relay_by_default(16384, None)
    assert relay_by_default(6, "1") and relay_by_default(6, "yes")
    assert not relay_by_default(16384, "0") and not relay_by_default(16384, "off")


@pytest.mark.quick
def test_the_last_process_of_a_node_removes_its_relay(tmp_path: Path) -> None:
    root = tmp_path / "job"
    a = NodeRelay(root, "n", "n/0/1", stale_s=1.0)
    b = NodeRelay(root, "n", "n/1/2", stale_s=1.0)
    a.post(1, [], [], None)
    b.post(1, [], [], None)
    assert a.lead()
    a.publish({"t": 0.0, "ok": True})
    a.close()
    assert a.dir.exists()  # b still posts there
    assert b.lead()
    b.close()
    assert not root.exists()


def test_a_store_restart_under_the_relay_reseeds_every_process_and_declares_nobody(
        tmp_path: Path) -> None:
    """The store restarted empty (a synthetic restart, as in tests/test_membership.py): the
    relay's batch finds it and writes a failed output, every process of the node beats directly
    once, finds the restart through its own client and re-seeds; nobody alive is declared, and
    the relay takes over again."""
    old = tcp_store_server()
    reseeded: list[str] = []
    uids = NODES["na"] + NODES["nb"][:1]
    clients = {u: RestartingClient(old) for u in uids}
    hbs = {u: Heartbeat(u, 0.1, timedelta(seconds=30), dead_after_s=0.5, store=clients[u],
                        fence=lambda u: 0, fenceable=lambda u: True, start=False,
                        on_restart=lambda st, u=u: reseeded.append(u),  # type: ignore[misc]
                        relay=NodeRelay(tmp_path, u.split("/")[0], u, stale_s=0.25))
           for u in uids}
    try:
        for h in hbs.values():
            h.follow(uids, 0)

        def beat(n: int) -> None:
            for _ in range(n):
                for h in hbs.values():
                    h.tick()
                time.sleep(0.1)

        beat(5)
        assert all(h.relayed_ticks for h in hbs.values())
        new = tcp_store_server()
        for c in clients.values():
            c.restart(new)
        beat(2 * 12)  # past dead_after_s + BLIND_GRACE_S
        assert sorted(reseeded) == sorted(uids), reseeded  # each once, through its own client
        assert not any(h.declarations for h in hbs.values()), [h.declarations for h in hbs.values()]
        n0 = {u: h.relayed_ticks for u, h in hbs.items()}
        beat(3)
        assert all(h.relayed_ticks > n0[u] for u, h in hbs.items())  # relayed again
    finally:
        for h in hbs.values():
            h.stop()


class _KeyCounts:
    """A store client that counts ``get`` requests by key (the first round's fan-out)."""

    def __init__(self, port: int, gets: dict[str, int]) -> None:
        self.store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                                   timeout=timedelta(seconds=30))
        self.gets = gets

    def get(self, key: str) -> bytes:
        self.gets[key] = self.gets.get(key, 0) + 1
        return self.store.get(key)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


def test_a_first_round_list_is_read_from_the_store_once_per_node(
        store: dist.TCPStore, tmp_path: Path) -> None:
    """Six members on two nodes form a first round through their relays: every member gets the
    same list, and the round's record (the whole list, compressed once it is long) is read from
    the store by one process per node; the others read the node's copy."""
    from aegis.training.inprocess.membership import Membership
    from aegis.training.inprocess.records import decode_record

    # long uids: the whole list is past records.COMPRESS_FROM, so it is stored compressed
    uids = [u.replace("/", "-" + "x" * 700 + "/", 1) for u in ALL]
    gets: dict[str, int] = {}
    hbs = [_hb(store.port, tmp_path, u) for u in uids]
    ms = [Membership(_KeyCounts(store.port, gets), u, h, dead_after_s=5.0, form_timeout_s=30.0,
                     min_world=1, relay=h._relay) for u, h in zip(uids, hbs, strict=True)]
    out: dict[str, list[str]] = {}
    threads = [threading.Thread(target=lambda m=m: out.__setitem__(m.uid, m.form(0, None, 6)[0]))
               for m in ms]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(out) == 6 and all(v == sorted(uids) for v in out.values()), out
        assert gets.get("aegis/round/0/members") == 2, gets  # one per node, not one per member
        raw = store.get("aegis/round/0/members")
        assert raw[:4] == b"\x28\xb5\x2f\xfd" and decode_record(raw)["members"] == sorted(uids)
    finally:
        for h in hbs:
            h.stop()


def test_a_shared_record_is_of_its_store_epoch_and_a_frozen_fetcher_is_not_waited_for(
        tmp_path: Path) -> None:
    a = NodeRelay(tmp_path, "n", "n/0/1", stale_s=1.0)
    b = NodeRelay(tmp_path, "n", "n/1/2", stale_s=1.0)
    fetched: list[str] = []

    def fetch(v: bytes) -> Callable[[], bytes]:
        return lambda: (fetched.append(v.decode()), v)[1]

    try:
        assert a.shared("epoch-1", 3, "members", fetch(b"one")) == b"one"
        assert b.shared("epoch-1", 3, "members", fetch(b"two")) == b"one"  # the node's copy
        # the store restarted empty (a new epoch): its round 3 is read, never the old copy
        assert b.shared("epoch-2", 3, "members", fetch(b"three")) == b"three"
        assert fetched == ["one", "three"]
        # a process holding the fetch lock and not writing (frozen): read the store after wait_s
        fd = os.open(a.dir / "fetch.lock", os.O_RDWR)
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            assert b.shared("epoch-2", 4, "members", fetch(b"four"), wait_s=0.2) == b"four"
        finally:
            os.close(fd)
        # old rounds and other epochs are removed as new records are written
        a.shared("epoch-2", 9, "members", fetch(b"nine"))
        left = [p.name for p in a.dir.glob("rec-*")]
        assert len(left) == 1 and "-9-members-" in left[0], left
    finally:
        a.close()
        b.close()
    assert not tmp_path.exists() or not any(tmp_path.iterdir())
