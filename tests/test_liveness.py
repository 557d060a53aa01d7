"""The store host's liveness service (``aegis.training.inprocess.liveness``), against a real
c10d TCPStore and real processes: a process whose connection ends without a goodbye (SIGKILL)
is named in the newest round's death log at once; one that says goodbye, or whose job is done,
is not; a restarted server is found again; the link never shows up among a round's sockets."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from aegis.training.inprocess import _sockets
from aegis.training.inprocess.liveness import PORT_KEY, Link, LivenessServer, published_port

pytestmark = pytest.mark.timeout(120)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture()
def store() -> Iterator[tuple[Any, int]]:
    port = _free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=10), use_libuv=True)
    yield server, port
    del server


def _client(port: int) -> Any:
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))


def _serve(port: int, client: Any) -> LivenessServer:
    """A liveness service for the store at ``port``, its port published there."""
    srv = LivenessServer(lambda: _client(port), host="127.0.0.1")
    srv.publish(client)
    return srv


@pytest.fixture()
def service(store: tuple[Any, int]) -> Iterator[tuple[Any, LivenessServer, int]]:
    """(a store client, a published liveness service, the store's port); closed afterwards."""
    _, port = store
    c = _client(port)
    srv = _serve(port, c)
    yield c, srv, port
    srv.close()


def _member(port: int, uid: str, then: str = "time.sleep(600)") -> subprocess.Popen[str]:
    """A process holding a Link to the service the store at ``port`` publishes."""
    code = textwrap.dedent(f"""
        import time
        from datetime import timedelta
        import torch.distributed as dist
        from aegis.training.inprocess.liveness import Link, published_port
        c = dist.TCPStore("127.0.0.1", {port}, is_master=False, timeout=timedelta(seconds=10))
        link = Link({uid!r}, "127.0.0.1", lambda: published_port(c), retry_s=0.2)
        while not link.connected:
            time.sleep(0.01)
        print("connected", flush=True)
        {then}
    """)
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.stdout is not None and p.stdout.readline().strip() == "connected"
    return p


def _dead(client: Any, r: int) -> list[str]:
    key = f"aegis/round/{r}/dead"
    return client.get(key).decode().split() if client.check([key]) else []


def _wait_for(pred: Any, timeout: float = 10.0) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if pred():
            return time.monotonic() - t0
        time.sleep(0.01)
    raise AssertionError("not within the timeout")


def test_a_killed_process_is_declared_in_the_newest_round_at_once(
        service: tuple[Any, LivenessServer, int]) -> None:
    c, srv, port = service
    assert published_port(c) == srv.port
    for r in (0, 1, 2):  # round 2 is the newest formed; round 3 is only being formed
        c.set(f"aegis/round/{r}/members", "{}")
    c.add("aegis/round/3/count", 1)
    p = _member(port, "node-1/0/111")
    _wait_for(lambda: "node-1/0/111" in srv.connected)
    t0 = time.monotonic()
    p.send_signal(signal.SIGKILL)
    p.wait()
    took = _wait_for(lambda: "node-1/0/111" in _dead(c, 2))
    print(f"declared {took * 1e3:.0f} ms after the kill")
    assert time.monotonic() - t0 < 2.0  # not a heartbeat's dead_after_s
    assert _dead(c, 0) == _dead(c, 1) == _dead(c, 3) == []
    assert [u for u, _, _ in srv.declared] == ["node-1/0/111"]
    assert "node-1/0/111" not in srv.connected


def test_a_goodbye_or_a_finished_job_declares_nobody(service: tuple[Any, LivenessServer, int]) -> None:
    c, srv, port = service
    c.set("aegis/round/0/members", "{}")
    polite = _member(port, "node-1/0/1", then="link.leave(); time.sleep(600)")
    _wait_for(lambda: "node-1/0/1" not in srv.connected and srv.connected == {}, 10)
    polite.kill()
    polite.wait()
    # a process that gives up leaves without a goodbye: declared at once
    quitter = _member(port, "node-1/0/2", then="link.leave(bye=False); time.sleep(600)")
    _wait_for(lambda: "node-1/0/2" in _dead(c, 0))
    quitter.kill()
    quitter.wait()
    c.set("aegis/round/0/done", "1")
    late = _member(port, "node-1/0/3")
    late.kill()
    late.wait()
    time.sleep(1.0)
    assert _dead(c, 0) == ["node-1/0/2"]
    assert [u for u, _, _ in srv.declared] == ["node-1/0/2"]


def test_before_any_round_nobody_is_declared_and_a_restarted_server_is_found_again(
        store: tuple[Any, int]) -> None:
    _, port = store
    c = _client(port)
    srv = _serve(port, c)
    p = _member(port, "node-2/0/7")
    try:
        srv.close()  # the store's host restarted: every connection ends, nobody is declared
        srv = _serve(port, c)
        _wait_for(lambda: "node-2/0/7" in srv.connected, 10)
        p.kill()
        p.wait()
        time.sleep(0.5)
        assert srv.declared == []  # no round formed yet: nobody waits for its death
        assert not c.check(["aegis/round/0/dead"])
    finally:
        srv.close()
        if p.poll() is None:
            p.kill()


def test_a_child_the_process_forked_does_not_hide_its_death(
        service: tuple[Any, LivenessServer, int]) -> None:
    """A child forked after the link connected (a DataLoader worker) shares none of it: the
    process SIGKILLed while its child lives on is declared at once. Held in the process's own
    file table, the connection was the child's too and stayed open until the child exited."""
    c, srv, port = service
    c.set("aegis/round/0/members", "{}")
    p = _member(port, "node-1/0/5", then=textwrap.dedent("""
        import os
        child = os.fork()
        if child == 0:
            time.sleep(600)
            os._exit(0)
        print(child, flush=True)
        time.sleep(600)
    """).replace("\n", "\n        "))
    assert p.stdout is not None
    child = int(p.stdout.readline())
    try:
        p.send_signal(signal.SIGKILL)
        p.wait()
        _wait_for(lambda: "node-1/0/5" in _dead(c, 0))
        os.kill(child, 0)  # the child still lives
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)


def test_the_others_are_told_of_a_declared_death_at_once(
        service: tuple[Any, LivenessServer, int]) -> None:
    """A declaration is pushed to every other linked process (``dead``): its ``on_death`` is
    called (the in-process loop pokes its heartbeat thread, which reads the death log now,
    not at its next beat); the process told stays linked and is not declared."""
    c, srv, port = service
    c.set("aegis/round/0/members", "{}")
    told = _member(port, "node-2/0/8", then=textwrap.dedent("""
        link.on_death = lambda: print("told", flush=True)
        time.sleep(600)
    """).replace("\n", "\n        "))
    victim = _member(port, "node-1/0/9")
    try:
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        assert told.stdout is not None and told.stdout.readline().strip() == "told"
        assert _dead(c, 0) == ["node-1/0/9"]
        assert "node-2/0/8" in srv.connected
    finally:
        told.kill()
        told.wait()


@pytest.mark.quick
def test_the_connection_is_held_in_a_file_table_of_its_own(
        service: tuple[Any, LivenessServer, int]) -> None:
    """The holder thread's table is its own: the connection is in that thread's table, not in
    the process's (what /proc/<pid>/fd lists, and what a fork or an exec'd child inherits)."""
    c, srv, _ = service
    link = Link("me/0/3", "127.0.0.1", lambda: published_port(c))
    try:
        _wait_for(lambda: link.connected and "me/0/3" in srv.connected)
        assert link.private is True
        ours = {os.fstat(conn.fileno()).st_ino for conn in srv._conns}  # the server's ends

        def sockets(d: str) -> set[int]:
            out = set()
            for fd in os.listdir(d):
                with contextlib.suppress(OSError):
                    t = os.readlink(f"{d}/{fd}")
                    if t.startswith("socket:["):
                        out.add(int(t[8:-1]))
            return out

        holder = link._holder.native_id
        mine = sockets(f"/proc/self/task/{holder}/fd") - sockets("/proc/self/fd")
        # its connection and its end of the control pair, nothing else of the process's
        assert len(mine) == 2 and not (mine & ours)
        assert len(sockets(f"/proc/self/task/{holder}/fd")) == 2
    finally:
        link.leave()
    _wait_for(lambda: "me/0/3" not in srv.connected)
    assert srv.declared == []
    assert not link._holder.is_alive() and not link._thread.is_alive()


@pytest.mark.quick
def test_the_link_is_never_among_the_sockets_a_round_publishes_or_cuts(
        service: tuple[Any, LivenessServer, int]) -> None:
    c, srv, _ = service
    before = set(_sockets.my_sockets())
    link = Link("me/0/1", "127.0.0.1", lambda: published_port(c))
    _wait_for(lambda: link.connected)
    _wait_for(lambda: "me/0/1" in srv.connected)
    # (the server's end of the link lives in this process too, here only)
    server_end = {os.fstat(conn.fileno()).st_ino for conn in srv._conns}
    assert set(_sockets.my_sockets()) - server_end == before  # not published, not cut
    assert link.connected and "me/0/1" in srv.connected
    link.leave()
    _wait_for(lambda: "me/0/1" not in srv.connected)
    assert srv.declared == []


@pytest.mark.quick
def test_without_a_service_the_link_gives_up_at_once(store: tuple[Any, int]) -> None:
    _, port = store
    c = _client(port)
    assert not c.check([PORT_KEY])
    link = Link("me/0/2", "127.0.0.1", lambda: published_port(c))
    _wait_for(lambda: not link._thread.is_alive(), 5)
    assert not link.connected and link.connects == 0


def test_after_a_store_restart_the_reseeded_round_is_where_the_dead_are_named(
        service: tuple[Any, LivenessServer, int]) -> None:
    """A store restarted empty holds only what the members wrote back (the running round's
    record and ``aegis/base_round``: ``storeclient.reseed``), not round 0: the round to declare
    in is found from there (the chaos campaign's kills after a store restart went undeclared
    until this was so, and waited for the heartbeats' dead_after_s)."""
    c, srv, port = service
    c.set("aegis/round/5/members", "{}")
    c.set("aegis/base_round", "5")
    p = _member(port, "node-4/1/55")
    _wait_for(lambda: "node-4/1/55" in srv.connected)
    p.kill()
    p.wait()
    _wait_for(lambda: "node-4/1/55" in _dead(c, 5), 5)
    assert not c.check(["aegis/round/0/dead"])
