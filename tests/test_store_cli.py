"""``aegis store serve`` / ``aegis store ping`` (issue 25, part 6): the membership store as a
command a cluster user runs. A real server process, real clients writing the membership keys in
the layout of :mod:`aegis.training.inprocess.membership` (a round of two members, one that stops
beating, one that registers to join), the log lines that say so, the health probes, SIGTERM."""

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


@pytest.mark.timeout(180)
def test_serve_logs_members_answers_probes_and_stops_on_sigterm(tmp_path: Path) -> None:
    port, hport = free_port(), free_port()
    log = tmp_path / "store.log"
    with open(log, "wb") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "aegis.cli", "store", "serve", "--host", "127.0.0.1", "--port",
             str(port), "--health-port", str(hport), "--poll", "0.1", "--dead-after", "0.6"],
            stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    stop = threading.Event()
    try:
        _wait_line(log, "ready on")
        ping = _cli("store", "ping", f"127.0.0.1:{port}")
        assert ping.returncode == 0 and "answered" in ping.stdout, ping
        assert _healthz(hport) == (200, {"ok": True, "round": None, "members": [], "joining": 0})

        # two members form round 0 the way aegis.run_in_process does (slots, then the proposal)
        a, b = "node-0/0/101", "node-1/0/102"
        s = TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                     timeout=timedelta(seconds=10))
        beating = {a: True, b: True}

        def beat() -> None:
            c = TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                         timeout=timedelta(seconds=10))
            while not stop.is_set():
                for uid, on in list(beating.items()):
                    if on:
                        c.add(f"aegis/hb/{uid}", 1)
                stop.wait(0.1)

        threading.Thread(target=beat, daemon=True).start()
        for uid in (a, b):
            i = s.add("aegis/round/0/count", 1)
            s.set(f"aegis/round/0/slot/{i}", uid)
        s.compare_set("aegis/round/0/members", "", json.dumps({"members": [a, b], "admitted": 0}))
        _wait_line(log, f"round 0: {b} joined (slot 2)")
        _wait_line(log, f"round 0 formed: 2 member(s), in rank order ['{a}', '{b}']")
        code, doc = _healthz(hport)
        assert code == 200 and doc["round"] == 0 and doc["members"] == [a, b]

        # b stops beating (lost): a line says it left; a new process registers to join
        beating[b] = False
        _wait_line(log, f"{b} left (no heartbeat for")
        c = "node-1/0/103"
        beating[c] = True
        j = s.add("aegis/join/count", 1)
        s.set(f"aegis/join/slot/{j}", c)
        _wait_line(log, f"{c} registered to join the running job (join slot 1)")
        ping = _cli("store", "ping", f"127.0.0.1:{port}", "--json")
        doc = json.loads(ping.stdout)
        assert ping.returncode == 0 and doc["ok"] and doc["round"] == 0 and doc["joining"] == 1, doc
        # the survivors admit it into round 1
        s.set("aegis/admitted", "1")
        for uid in (a, c):
            i = s.add("aegis/round/1/count", 1)
            s.set(f"aegis/round/1/slot/{i}", uid)
        s.compare_set("aegis/round/1/members", "", json.dumps({"members": [a, c], "admitted": 1}))
        _wait_line(log, "join slots 1..1 admitted")
        _wait_line(log, f"round 1 formed: 2 member(s), in rank order ['{a}', '{c}']")
        beating[b] = True  # the lost one beats again (a frozen process woken up)
        _wait_line(log, f"{b} is back")
        s.set("aegis/round/1/done", "1")
        _wait_line(log, "round 1 done: the job finished")
        del s
    finally:
        stop.set()
        server.send_signal(signal.SIGTERM)
        rc = server.wait(timeout=30)
    assert rc == 0, log.read_text()
    assert _wait_line(log, "stopped")
    down = _cli("store", "ping", f"127.0.0.1:{port}", "--timeout", "1")
    assert down.returncode == 1 and "did not answer" in down.stderr, down


def test_ping_rejects_an_address_without_a_port() -> None:
    out = _cli("store", "ping", "localhost")
    assert out.returncode == 2 and "HOST:PORT" in out.stderr, out
