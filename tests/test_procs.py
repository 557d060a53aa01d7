"""The simulator's process helpers: a process counts as gone only when it can no longer hold a
connection open (the node's network is removed right after; issue 25)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time

from aegis.sim.procs import state, wait_gone

# the main thread leaves (its task turns zombie at once) while a second thread holds a
# connection: the state a SIGKILLed process is in while its memory is still being unmapped
_LEADER_GONE_FIRST = r"""
import ctypes, socket, sys, threading, time
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
threading.Thread(target=lambda: time.sleep(600)).start()
print("ready", flush=True)
ctypes.CDLL(None).pthread_exit(None)
"""


def test_a_zombie_leader_whose_threads_still_run_is_not_gone() -> None:
    with socket.create_server(("127.0.0.1", 0)) as srv:
        p = subprocess.Popen([sys.executable, "-c", _LEADER_GONE_FIRST,
                              str(srv.getsockname()[1])], stdout=subprocess.PIPE)
        try:
            conn, _ = srv.accept()
            assert p.stdout is not None and p.stdout.readline() == b"ready\n"
            deadline = time.monotonic() + 10
            while state(p.pid) != "Z" and time.monotonic() < deadline:
                time.sleep(0.01)  # the leader's task turns zombie right after pthread_exit
            assert state(p.pid) == "Z"
            # its connection is still open, so it is not gone
            assert not wait_gone([p.pid], timeout=0.3)
            conn.settimeout(0.1)
            with contextlib.suppress(TimeoutError):  # nothing to read: still open
                assert conn.recv(1) != b"", "the connection ended while the process held it"
            os.kill(p.pid, signal.SIGKILL)
            assert wait_gone([p.pid], timeout=10)
            # gone means its files are closed: the end of the connection is there to read
            conn.settimeout(5)
            assert conn.recv(1) == b""
            conn.close()
        finally:
            p.kill()
            p.wait()
