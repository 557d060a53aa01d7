"""The membership store's own failures (issue 25, ``aegis/training/inprocess/storeclient.py``):
a broken connection while a round forms, the store restarted empty while a round runs, the
store unreachable past the bound. The store is ``aegis store serve`` in a process of its own (so
that it can be SIGKILLed, restarted and SIGSTOPped for real); members are threads of this
process with the production heartbeat and round formation behind reconnecting clients, as
``run_in_process`` builds them, or (the last test) real ``run_in_process`` processes."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from aegis.training.inprocess.membership import Heartbeat, Membership
from aegis.training.inprocess.records import decode_record
from aegis.training.inprocess.round import RecoveryGaveUp
from aegis.training.inprocess.storeclient import StoreClient, StoreUnreachable, reseed
from tests.chaos.tcp_proxy import TcpProxy
from tests.dist_utils import free_port

INTERVAL = 0.2
DEAD_AFTER = 1.0


class _Server:
    """``aegis store serve`` on a port, in a process of its own."""

    def __init__(self, port: int, log: Path) -> None:
        self.port, self.log = port, log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        start = self.log.stat().st_size if self.log.exists() else 0
        out = open(self.log, "ab")  # noqa: SIM115 - the server's stdout for its lifetime
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "aegis.cli", "store", "serve", "--host", "127.0.0.1",
             "--port", str(self.port), "--poll", "0.5"], stdout=out, stderr=subprocess.STDOUT,
            env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
        out.close()
        deadline = time.monotonic() + 120
        while b"ready on" not in self.log.read_bytes()[start:]:
            assert self.proc.poll() is None and time.monotonic() < deadline, self.log.read_text()
            time.sleep(0.05)

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.signal(signal.SIGCONT)
            self.kill()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[_Server]:
    s = _Server(free_port(), tmp_path / "store.log")
    s.start()
    yield s
    s.stop()


class _Member:
    """One process of the job, as ``run_in_process`` builds its membership: a reconnecting
    client for membership steps (retries for ``outage_s``), one for the heartbeat (once per
    beat), the store re-seeded from what it knows when the store restarted empty."""

    def __init__(self, port: int, uid: str, *, outage_s: float = 30.0, request_s: float = 5.0,
                 form_timeout: float = 60.0) -> None:
        def connect(timeout: timedelta) -> Any:
            return dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                                 timeout=timeout)

        self.uid = uid
        self.store = StoreClient(connect, timeout_s=form_timeout, request_s=request_s,
                                 outage_s=outage_s)
        self.store.seal()
        self.hb_store = StoreClient(connect, timeout_s=5.0, request_s=request_s, outage_s=None)
        self.hb_store.seal()
        self.hb_store.on_reconnect = self.store.refresh  # as run_in_process wires them
        self.members: list[str] = []
        self.r = -1
        self.admitted = 0
        self.in_round = False
        self.fenced: list[str] = []
        self.hb = Heartbeat(uid, INTERVAL, timedelta(seconds=form_timeout),
                            dead_after_s=DEAD_AFTER, fence=self._fence,
                            fenceable=lambda u: self.in_round and u in self.members,
                            store=self.hb_store,
                            on_restart=lambda st: reseed(st, self.r, self.members, self.admitted,
                                                         uid))
        self.m = Membership(self.store, uid, self.hb, dead_after_s=DEAD_AFTER,
                            form_timeout_s=form_timeout, min_world=1)

    def _fence(self, u: str) -> int:
        self.fenced.append(u)
        return 0

    def enter(self, r: int, previous: list[str] | None, expected: int) -> list[str]:
        self.in_round = False
        self.hb.round_ended()
        members, admitted = self.m.form(r, previous, expected)
        self.members, self.r, self.admitted = members, r, admitted
        self.hb.follow(members, r)
        self.in_round = True
        return members

    def close(self) -> None:
        self.hb.stop()
        self.store.close()
        self.hb_store.close()


def _all(fn: Any, items: list[Any], timeout: float = 120.0) -> list[Any]:
    """``fn`` on every item at once (a thread each); results (or the exception) in order."""
    out: list[Any] = [None] * len(items)

    def run(i: int) -> None:
        try:
            out[i] = fn(items[i])
        except BaseException as e:  # noqa: BLE001 - returned to the test
            out[i] = e

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(items))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), f"a member still runs after {timeout} s (a hang)"
    return out


def test_a_broken_connection_while_a_round_forms_is_reconnected(tmp_path: Path,
                                                                 server: _Server) -> None:
    """The partition fault of the chaos slice, reduced: every client's connection is reset
    (a forwarder in front of the store drops them all) while the survivors of a lost member
    form the next round. Before issue 25 the membership client failed with ``Broken pipe`` in
    ``form`` and every process restarted; now each client reconnects and sends again, and the
    round forms with the survivors only."""
    proxy = TcpProxy(("127.0.0.1", free_port()), ("127.0.0.1", server.port))
    proxy.up()
    try:
        ms = [_Member(proxy.listen[1], u) for u in ("n0/0/1", "n1/0/2", "n2/0/3")]
        lists = _all(lambda m: m.enter(0, None, 3), ms)
        assert all(x == lists[0] for x in lists), lists
        first = lists[0]
        a, b, c = ms
        c.hb.stop()  # lost: its counter stops; the survivors form the next round without it
        for m in (a, b):
            m.in_round = False
            m.hb.round_ended()
        forming = threading.Thread(target=lambda: box.append(_all(
            lambda m: m.m.form(1, first, 3)[0], [a, b])), daemon=True)
        box: list[Any] = []
        forming.start()
        time.sleep(0.4)  # the proposer waits for the lost member to be declared (~1 s)
        proxy.down()  # every connection reset: Broken pipe / connection reset at every client
        time.sleep(0.3)
        proxy.up()
        forming.join(90)
        assert not forming.is_alive(), "the survivors did not form round 1 (a hang)"
        got = box[0]
        assert not any(isinstance(x, BaseException) for x in got), got
        assert got[0] == got[1] == [u for u in first if u != c.uid], got
        assert a.store.reconnects + b.store.reconnects >= 1, "the break did not reach form()"
        assert a.hb_store.reconnects >= 1 and b.hb_store.reconnects >= 1
        for m in ms:
            m.close()
    finally:
        proxy.down()


def test_the_store_restarted_empty_while_a_round_runs(server: _Server) -> None:
    """The store process SIGKILLed and started again on its address, empty, while three members
    run a round: every client reconnects, finds the job's epoch gone and re-seeds the store
    from what it knows (the round's member list, the join slots admitted, the epoch); nobody is
    declared dead for the outage; a member lost afterwards is detected and the survivors form
    the next round through the new store."""
    ms = [_Member(server.port, u) for u in ("n0/0/1", "n1/0/2", "n2/0/3")]
    first = _all(lambda m: m.enter(0, None, 3), ms)
    epoch = ms[0].store.epoch
    assert epoch is not None and all(m.store.epoch == epoch for m in ms)
    server.kill()
    time.sleep(0.5)  # beats fail meanwhile
    server.start()  # the same address, no keys
    probe = dist.TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False,
                          timeout=timedelta(seconds=10))
    deadline = time.monotonic() + 20
    while not probe.check(["aegis/round/0/members"]):
        assert time.monotonic() < deadline, "no member re-seeded the restarted store"
        time.sleep(0.05)
    record = decode_record(probe.get("aegis/round/0/members"))
    assert record["members"] == first[0]
    new_epoch = probe.get("aegis/epoch").decode()  # a new epoch: later reconnects see it too
    assert new_epoch != epoch
    time.sleep(3 * DEAD_AFTER)  # long enough for a false declaration to happen
    assert not any(m.fenced for m in ms), [m.fenced for m in ms]
    assert not probe.check(["aegis/round/0/dead"]) or not probe.get("aegis/round/0/dead").strip()
    assert all(m.hb.store_restarts == 1 for m in ms), [m.hb.store_restarts for m in ms]
    assert all(m.hb_store.epoch == new_epoch for m in ms)
    # the membership clients reconnected in the background when the heartbeat's did (a
    # connect can take seconds: not at the next round's first request)
    assert all(m.store.reconnects == 1 and m.store.epoch == new_epoch for m in ms), \
        [(m.store.reconnects, m.store.epoch) for m in ms]
    a, b, c = ms
    c.hb.stop()  # now a real loss: detected through the new store
    deadline = time.monotonic() + 10
    while not (a.fenced and b.fenced):
        assert time.monotonic() < deadline, "the lost member was not fenced after the restart"
        time.sleep(0.05)
    assert a.fenced == [c.uid] and b.fenced == [c.uid]
    # the membership clients find the restart at their first request (form starts over, as
    # run_in_process does on StoreRestarted) and form the next round with the survivors
    from aegis.training.inprocess.storeclient import StoreRestarted

    def next_round(m: _Member) -> tuple[list[str], float]:
        t0 = time.monotonic()
        try:
            m.enter(1, first[0], 3)
            raise AssertionError("the restart was not reported to the membership step")
        except StoreRestarted:  # at once: the refresh found it, no connect here
            took = time.monotonic() - t0
        return m.enter(1, first[0], 3), took

    got = _all(next_round, [a, b])
    assert got[0][0] == got[1][0] == [a.uid, b.uid], got
    assert max(g[1] for g in got) < 1.0, got
    for m in ms:
        m.close()


def test_no_route_to_the_store_during_a_partition_is_retried_like_a_refused_connection(
        server: _Server) -> None:
    """A partitioned node's connect fails at once with EHOSTUNREACH ("No route to host", a plain
    OSError, not a ConnectionError) once its neighbour's ARP entry expires. It is an outage like
    a refused connection: retried until ``outage_s``, not raised (found by a 24-fault campaign:
    partitions over ~15 s made the cut-off node's workers exit and restart instead of rejoining)."""
    tries: list[float] = []

    def connect(timeout: timedelta) -> Any:
        tries.append(time.monotonic())
        if len(tries) <= 2:
            raise OSError(errno.EHOSTUNREACH, "No route to host")
        return dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timeout)

    client = StoreClient(connect, timeout_s=5.0, request_s=2.0, outage_s=30.0)
    client.call("set", "route", "back")
    assert client.call("get", "route") == b"back"
    assert len(tries) == 3, tries


def test_the_store_unreachable_past_the_bound_ends_in_a_restart(server: _Server) -> None:
    """A store that stops answering (SIGSTOP: connections stay open, requests are never
    answered; a plain c10d client waits until the store comes back, i.e. forever) while a
    round forms: the membership step gives up after ``outage_s`` with StoreUnreachable, a
    RecoveryGaveUp (run_in_process re-raises it: the process exits and its launcher restarts
    it), never a hang."""
    m = _Member(server.port, "n0/0/1", outage_s=3.0, request_s=1.0)
    server.signal(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        got = _all(lambda m: m.enter(0, None, 1), [m], timeout=60)[0]
        took = time.monotonic() - t0
    finally:
        server.signal(signal.SIGCONT)
    assert isinstance(got, StoreUnreachable) and isinstance(got, RecoveryGaveUp), got
    assert "unreachable" in str(got) and "store_outage" in str(got)
    assert took < 20.0, took  # 3 s, after a request of up to request_s found no reply
    m.close()


_TRAIN = textwrap.dedent("""
    import os, sys, time
    from datetime import timedelta
    import torch, torch.distributed as dist
    import aegis

    steps = []
    def train(world):
        while True:
            t = torch.ones(1)
            dist.all_reduce(t)
            steps.append(time.time())
            print(f"step {len(steps)} world {world.size}", flush=True)
            time.sleep(0.05)

    aegis.run_in_process(train, min_world=1, store_outage=timedelta(seconds=3),
                         collective_timeout=timedelta(seconds=10))
""")


def test_run_in_process_trains_through_a_store_outage_and_restarts_past_the_bound(
        tmp_path: Path, server: _Server) -> None:
    """Two real ``run_in_process`` processes: while the store is SIGSTOPped they go on training
    (collectives need no store); one of them SIGKILLed then, the survivor's next round cannot
    form, and past ``store_outage`` (3 s) it exits with an error that names the bound (its
    launcher restarts it) instead of hanging."""
    script = tmp_path / "train.py"
    script.write_text(_TRAIN)
    procs = []
    for rank in range(2):
        env = {**os.environ, "AEGIS_MEMBERSHIP": f"127.0.0.1:{server.port}", "WORLD_SIZE": "2",
               "LOCAL_RANK": "0", "AEGIS_NODE_ID": f"node-{rank}", "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, str(script)], env=env,
                                      stdout=open(tmp_path / f"p{rank}.log", "wb"),  # noqa: SIM115
                                      stderr=subprocess.STDOUT))
    log = [tmp_path / f"p{rank}.log" for rank in range(2)]

    def steps(i: int) -> int:
        return log[i].read_text(errors="replace").count("world 2")

    try:
        deadline = time.monotonic() + 120
        while min(steps(0), steps(1)) < 5:
            assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, \
                log[0].read_text() + log[1].read_text()
            time.sleep(0.1)
        server.signal(signal.SIGSTOP)
        before = steps(0)
        time.sleep(2.0)
        during = steps(0) - before
        assert during >= 5, f"training stalled while the store was away ({during} steps in 2 s)"
        procs[1].kill()
        t0 = time.monotonic()
        rc = procs[0].wait(timeout=90)
        took = time.monotonic() - t0
        out = log[0].read_text(errors="replace")
        assert rc != 0, out
        assert "StoreUnreachable" in out and "store_outage=3 s" in out, out[-3000:]
        assert took < 60, took
    finally:
        server.signal(signal.SIGCONT)
        for p in procs:
            if p.poll() is None:
                p.kill()
