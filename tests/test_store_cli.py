"""``aegis store serve`` / ``aegis store ping`` (issue 25, part 6): the membership store as a
command a cluster user runs. A real server process, real clients writing the membership keys in
the production membership protocol (:mod:`aegis.training.inprocess.membership`: three processes
form a round, one stops beating and is declared dead, the others form the next round, a new one
registers and is admitted), the log lines that say so, the health probes, SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import pytest
from torch.distributed import TCPStore

from tests.dist_utils import free_port


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "aegis.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})


def _wait_line(log: Path, text: str, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in log.read_text().splitlines() if log.exists() else []:
            if text in line:
                return line
        time.sleep(0.05)
    raise AssertionError(f"no line with {text!r} in {log}:\n{log.read_text() if log.exists() else ''}")


def _healthz(port: int) -> tuple[int, dict]:  # type: ignore[type-arg]
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


class _Process:
    """One process of a job as ``run_in_process`` drives membership: the production heartbeat
    (own client) and round formation (own client) of :mod:`aegis.training.inprocess.membership`."""

    def __init__(self, port: int, uid: str) -> None:
        from aegis.training.inprocess.membership import Heartbeat, Membership

        def client() -> TCPStore:
            return TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                            timeout=timedelta(seconds=30))

        self.uid = uid
        self.hb = Heartbeat(uid, 0.1, timedelta(seconds=30), dead_after_s=0.5, store=client())
        self.m = Membership(client(), uid, self.hb, dead_after_s=0.5, form_timeout_s=30, min_world=1)
        self.members: list[str] = []
        self.admitted = 0

    def enter(self, r: int, previous: list[str] | None, expected: int, join_slot: int = 0) -> list[str]:
        self.members, self.admitted = self.m.form(r, previous, expected, join_slot=join_slot)
        self.hb.follow(self.members, r)
        return self.members


def _all(fn, items):  # type: ignore[no-untyped-def]
    with ThreadPoolExecutor(max_workers=len(items)) as pool:
        return list(pool.map(fn, items))


@pytest.mark.timeout(180)
def test_serve_logs_members_answers_probes_and_stops_on_sigterm(tmp_path: Path) -> None:
    port, hport = free_port(), free_port()
    log = tmp_path / "store.log"
    with open(log, "wb") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "aegis.cli", "store", "serve", "--host", "127.0.0.1", "--port",
             str(port), "--health-port", str(hport), "--poll", "0.1"],
            stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    procs: list[_Process] = []
    try:
        _wait_line(log, "ready on")
        ping = _cli("store", "ping", f"127.0.0.1:{port}")
        assert ping.returncode == 0 and "answered" in ping.stdout, ping
        assert _healthz(hport) == (200, {"ok": True, "round": None, "members": 0, "joining": 0})

        # three processes form round 0 through the membership protocol
        a, b, c, d = "node-0/0/101", "node-1/0/102", "node-2/0/103", "node-1/0/104"
        procs = _all(lambda u: _Process(port, u), [a, b, c])
        members = _all(lambda p: p.enter(0, None, 3), procs)[0]
        for u in (a, b, c):
            _wait_line(log, f"round 0: {u} joined")
        _wait_line(log, f"round 0 formed: 3 member(s), in rank order {members}")
        assert _healthz(hport)[1]["members"] == 3

        # b is lost (its heartbeat stops): its watchers declare it dead; the others form round 1
        procs[1].hb.stop()
        _wait_line(log, f"{b} left: declared dead by its watchers in round 0")
        live = [procs[0], procs[2]]
        _all(lambda p: p.enter(1, members, 0), live)
        _wait_line(log, f"round 1 formed: 2 member(s), in rank order {[a, c]}; left: {[b]}")

        # a new process registers (it waits to be admitted), the survivors admit it at their
        # next snapshot and form round 2 with it
        joiner = _Process(port, d)
        plan: dict[str, object] = {}
        t = threading.Thread(target=lambda: plan.update(
            zip(("r", "previous", "slot"), joiner.m.join(timeout_s=30), strict=True)), daemon=True)
        t.start()
        _wait_line(log, f"{d} registered to join the running job (join slot 1)")
        ping = _cli("store", "ping", f"127.0.0.1:{port}", "--json")
        doc = json.loads(ping.stdout)
        assert ping.returncode == 0 and doc["ok"] and doc["round"] == 1, doc
        assert doc["members"] == [a, c] and doc["joining"] == 1, doc
        previous = _all(lambda p: p.m.admit(2, p.members, p.admitted, 1), live)[0]
        t.join(30)
        assert plan["r"] == 2, plan
        _all(lambda x: x[0].enter(2, x[1], 0, x[2]), [
            (live[0], previous, 0), (live[1], previous, 0), (joiner, plan["previous"], plan["slot"])])
        _wait_line(log, "join slots 1..1 admitted")
        _wait_line(log, f"round 2 formed: 3 member(s), in rank order {[a, c, d]}; new: {[d]}")
        procs.append(joiner)
        TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                 timeout=timedelta(seconds=10)).set("aegis/round/2/done", "1")
        _wait_line(log, "round 2 done: the job finished")
    finally:
        for p in procs:
            p.hb.stop()
        server.send_signal(signal.SIGTERM)
        rc = server.wait(timeout=30)
    assert rc == 0, log.read_text()
    assert _wait_line(log, "stopped")
    assert "membership read failed" not in log.read_text()
    down = _cli("store", "ping", f"127.0.0.1:{port}", "--timeout", "1")
    assert down.returncode == 1 and "did not answer" in down.stderr, down


def test_ping_rejects_an_address_without_a_port() -> None:
    out = _cli("store", "ping", "localhost")
    assert out.returncode == 2 and "HOST:PORT" in out.stderr, out


@pytest.mark.quick
def test_the_log_follows_a_store_the_members_re_seeded() -> None:
    """After the store restarted empty the members write back what they know (storeclient.reseed:
    round 9's members, 7 join slots admitted): the serve log follows from round 9 (before, it
    looked for round 0 and logged no round, death or registration again) and numbers new
    registrations from slot 8."""
    from aegis.cli.store import Watcher
    from aegis.training.inprocess.storeclient import reseed

    port = free_port()
    server = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                      timeout=timedelta(seconds=10))
    lines: list[str] = []
    w = Watcher(server, lines.append)
    members = ["node-1/0/11", "node-1/1/12", "node-3/0/13"]
    reseed(server, 9, members, 7, members[0])
    w.poll()
    assert lines[0] == ("re-seeded by the members after a restart: rounds from 9, join slots "
                        "1..7 admitted before"), lines
    assert lines[1] == f"round 9 formed: 3 member(s), in rank order {members}", lines
    server.set("aegis/round/9/dead", "node-3/0/13\n")
    server.add("aegis/join/count", 1)
    server.set("aegis/join/slot/8", "node-4/0/21")
    w.poll()
    assert lines[2:] == ["node-3/0/13 left: declared dead by its watchers in round 9",
                         "node-4/0/21 registered to join the running job (join slot 8)"], lines
