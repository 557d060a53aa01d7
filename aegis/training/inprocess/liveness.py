"""A process's death seen the moment its connection closes: the store host's liveness service.

A process that crashes, is OOM-killed or SIGKILLed closes its sockets as it dies: its kernel
sends the FIN (or RST) at once. A heartbeat cannot tell that apart from a slow beat until
``dead_after_s`` has passed (1 s by default: a killed node cost every survivor that second
before the next round could form; issue 25). So the process that hosts the membership store
(``aegis store serve``) also listens on a second port (:class:`LivenessServer`, its port under
``aegis/liveness/port``), and every process of an in-process job holds one TCP connection to it
for its whole life (:class:`Link`: ``hello <uid>`` when it connects, ``bye`` when
``run_in_process`` returns). A connection that ends without ``bye`` is a process gone: the
server names it in the death log of the job's newest round (:func:`~.membership.declare`, as a
watcher would), and the round's proposer and every member read that log as they already do.

What it does not see, and the heartbeats still do: a machine that stops without closing
anything (power, kernel panic, a cut link: no FIN ever comes), a frozen process (its
connection stays open). What it never does: declare a live process. A connection ends without
``bye`` only when the process is gone, or when the link between it and the store host broke
(the server then restarts, or the connection resets: the client reconnects, and a process cut
off from the store host is declared by its watchers anyway); the process's own fences never
cut it (its socket is kept out of what rounds publish and cut: ``_sockets.KEEP``). A server
restart drops every connection without declaring anyone (the new server knows none of them);
the clients reconnect within about a second.

Costs against the world size W: one connection per process on the store host (the store
itself has two or three per process), one line per process when it connects, one store
request (``append``, after the rounds are found) per process lost; nothing per step, nothing
per beat. Without the service (a store hosted another way: no port key), nothing changes.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from aegis.training.inprocess import _sockets

__all__ = ["PORT_KEY", "LivenessServer", "Link", "published_port"]

PORT_KEY = "aegis/liveness/port"
_LINE_MAX = 4096
# a link that cannot reach the service tries again after 1, 2, 4 ... s, at most this long apart
# (a port that a firewall drops must not cost the store host a connect per process per second)
MAX_RETRY_S = 30.0


def published_port(store: Any) -> int | None:
    """The liveness port the store's host published (None: no service there)."""
    if not store.check([PORT_KEY]):
        return None
    return int(store.get(PORT_KEY).decode())


class LivenessServer:
    """Accepts one connection per process (``hello <uid>\\n``; ``bye\\n`` on a clean exit) and
    declares the process dead in the newest round's death log when its connection ends without
    ``bye``. ``client`` makes a store client (called in the server's thread, and again after a
    store request failed); ``say`` gets one line per declaration. :meth:`publish` writes the
    port where the processes look for it."""

    def __init__(self, client: Callable[[], Any], *, host: str = "0.0.0.0", port: int = 0,
                 say: Callable[[str], None] | None = None) -> None:
        self._client_factory = client
        self._say = say or (lambda m: None)
        self._listener = socket.create_server((host, port), backlog=1024, reuse_port=False)
        self._listener.setblocking(False)
        self.port = self._listener.getsockname()[1]
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, None)
        self._conns: dict[socket.socket, dict[str, Any]] = {}
        self._store: Any = None
        self._round = 0  # where the search for the newest round starts (rounds only grow)
        self._stop = threading.Event()
        self.declared: list[tuple[str, int, float]] = []  # (uid, round, time.time())
        self.connected: dict[str, float] = {}  # uid -> when it said hello (live connections)
        self._live: dict[str, int] = {}  # uid -> its open connections (O(1) per drop)
        self._thread = threading.Thread(target=self._run, name="aegis-liveness", daemon=True)
        self._thread.start()

    def publish(self, store: Any) -> None:
        store.set(PORT_KEY, str(self.port))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for s in list(self._conns):
            with contextlib.suppress(OSError):
                s.close()
        with contextlib.suppress(OSError):
            self._listener.close()
        self._sel.close()

    # -- the loop -----------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._sel.select(timeout=0.2):
                if key.data is None:
                    self._accept()
                else:
                    self._read(key.fileobj)  # type: ignore[arg-type]

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            conn.setblocking(False)
            state = {"buf": b"", "uid": None, "bye": False}
            self._conns[conn] = state
            self._sel.register(conn, selectors.EVENT_READ, state)

    def _read(self, conn: socket.socket) -> None:
        state = self._conns[conn]
        try:
            data = conn.recv(_LINE_MAX)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:  # reset: the process is gone as surely as with a FIN
            data = b""
        if data:
            state["buf"] += data
            while b"\n" in state["buf"]:
                line, state["buf"] = state["buf"].split(b"\n", 1)
                self._line(state, line.decode(errors="replace").strip())
            if len(state["buf"]) > _LINE_MAX:  # not one of ours: drop it, declare nobody
                self._drop(conn)
            return
        uid, bye = state["uid"], state["bye"]
        self._drop(conn)
        if uid is not None and not bye and self.connected.get(uid) is None:
            self._declare(uid)

    def _line(self, state: dict[str, Any], line: str) -> None:
        if line.startswith("hello ") and state["uid"] is None:
            uid = line[6:]
            state["uid"] = uid
            self.connected[uid] = time.time()
            self._live[uid] = self._live.get(uid, 0) + 1
        elif line == "bye":
            state["bye"] = True

    def _drop(self, conn: socket.socket) -> None:
        state = self._conns.pop(conn)
        with contextlib.suppress(Exception):
            self._sel.unregister(conn)
        with contextlib.suppress(OSError):
            conn.close()
        uid = state["uid"]
        # this uid's only connection (a process reconnects after its link broke: the new
        # connection said hello before the old one's end was read -> keep it counted)
        if uid is not None:
            self._live[uid] = self._live.get(uid, 1) - 1
            if self._live[uid] <= 0:
                self._live.pop(uid, None)
                self.connected.pop(uid, None)

    def _declare(self, uid: str) -> None:
        from aegis.training.inprocess.membership import _rk, latest_round

        for attempt in range(2):
            try:
                if self._store is None:
                    self._store = self._client_factory()
                r = latest_round(self._store, self._round)
                if not self._store.check([_rk(r, "members")]):
                    # no round formed yet (after a store restart the re-seeded store has the
                    # running round's record only, and latest_round starts there)
                    self._say(f"{uid} closed its connection before any round was formed")
                    return
                if self._store.check([_rk(r, "done")]):
                    return  # the job finished: its processes are leaving
                self._store.append(_rk(r, "dead"), f"{uid}\n")
                self._round = r
                self.declared.append((uid, r, time.time()))
                self._say(f"{uid} closed its connection without leaving: declared dead in "
                          f"round {r}")
                return
            except Exception as e:  # noqa: BLE001 - a new client, once; then the heartbeats
                self._store = None
                if attempt:
                    self._say(f"{uid} closed its connection without leaving; not declared "
                              f"({type(e).__name__}: {e}): its watchers will")


class Link:
    """This process's connection to the store host's :class:`LivenessServer`, held from a
    daemon thread: it connects (``hello <uid>``), waits for the connection to end, and
    reconnects (after a store restart the new server publishes its port again, maybe another
    one). ``port`` reads the key: None (no service) on the first look ends the thread; a read
    that fails, or finds no key after a service was found (the store away or restarting), is
    tried again every ``retry_s``: the links were back within a second or two of a restarted
    store, where a backoff that grew over the outage left three processes of the chaos
    campaign undeclared at a kill 10 s after two restarts; a published port that does not
    answer is tried after 1, 2, 4 ... s (``MAX_RETRY_S`` at most).
    :meth:`leave` says ``bye`` and closes."""

    def __init__(self, uid: str, host: str, port: Callable[[], int | None], *,
                 retry_s: float = 1.0) -> None:
        self.uid = uid
        self.host = host
        self._port = port
        self.retry_s = retry_s
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.connects = 0
        self.failures = 0  # attempts that found no store or no service to connect to
        self._thread = threading.Thread(target=self._run, name="aegis-liveness-link", daemon=True)
        self._thread.start()

    @property
    def connected(self) -> bool:
        return self._sock is not None

    def _open(self, port: int) -> socket.socket | None:
        try:
            s = socket.create_connection((self.host, port), timeout=2.0)
        except OSError:
            return None
        try:
            _sockets.keep(s)
            s.sendall(f"hello {self.uid}\n".encode())
            s.settimeout(None)
        except OSError:
            s.close()
            return None
        return s

    def _run(self) -> None:
        found = False  # a service was found once: it is there again after a store restart
        delay = self.retry_s
        while not self._stop.is_set():
            try:
                port = self._port()
            except Exception:  # noqa: BLE001 - the store away, or slow to answer: later
                port = -1
            if port is None and not found:
                return  # no service at this job's store: nothing to hold
            if port is None or port < 0:
                # the store away or restarting (its new server publishes the port once it
                # listens): again in retry_s, a read that fails at once while it is away
                self.failures += 1
                self._stop.wait(self.retry_s)
                continue
            s = self._open(port)
            if s is None:  # a port published but not reachable (a firewall?): back off
                self.failures += 1
                self._stop.wait(delay)
                delay = min(MAX_RETRY_S, 2 * delay)
                continue
            found, delay = True, self.retry_s
            with self._lock:
                if self._stop.is_set():
                    s.close()
                    return
                self._sock = s
                self.connects += 1
            with contextlib.suppress(OSError):
                while s.recv(64):  # the server sends nothing: returns at the connection's end
                    pass
            with self._lock:
                if self._sock is s:
                    self._sock = None
            with contextlib.suppress(OSError):
                s.close()
            self._stop.wait(self.retry_s)

    def leave(self, *, bye: bool = True) -> None:
        """Close the connection: after ``bye`` on a clean exit (the server declares nobody),
        without it when this process leaves the job on an error (declared at once, as if it
        had died: its peers need not wait for its heartbeat to go silent)."""
        self._stop.set()
        with self._lock:
            s, self._sock = self._sock, None
        if s is not None:
            if bye:
                with contextlib.suppress(OSError):
                    s.sendall(b"bye\n")
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                s.close()
