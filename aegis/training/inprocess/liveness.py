"""A process's death seen the moment its connection closes: the store host's liveness service.

A process that crashes, is OOM-killed or SIGKILLed closes its sockets as it dies: its kernel
sends the FIN (or RST) then, once the process's memory is freed. A heartbeat cannot tell that
apart from a slow beat until ``dead_after_s`` has passed (1 s by default: a killed node cost
every survivor that second before the next round could form; issue 25). So the process that
hosts the membership store (``aegis store serve``) also listens on a second port
(:class:`LivenessServer`, its port under ``aegis/liveness/port``), and every process of an
in-process job holds one TCP connection to it for its whole life (:class:`Link`: ``hello <uid>``
when it connects, ``bye`` when ``run_in_process`` returns), held by a thread with a file table
of its own, so that it closes as that thread dies, before the dead process's memory is freed
(see :class:`Link`). A connection that ends without ``bye`` is a process gone: the server names
it in the death log of the job's newest round (:func:`~.membership.declare`, as a watcher
would), and the round's proposer and every member read that log as they already do.

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
request (``append``, after the rounds are found) per process lost, and a ``dead`` line to every
linked process per pass of the server's loop that declared anyone (O(W) sends); nothing per
step, nothing per beat. Without the service (a store hosted another way: no port key), nothing changes.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import resource
import select
import selectors
import socket
import sys
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
_CLONE_FILES = 0x00000400  # <linux/sched.h>


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
        self._tell = False  # someone was declared: tell the others (_tell_all)
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
            if self._tell:
                self._tell_all()

    def _tell_all(self) -> None:
        """``dead`` to every other process linked (once per pass of the loop, however many
        were declared in it): its heartbeat thread reads the death log now, not at its next
        beat (up to ``heartbeat_s`` later), and fences the dead off. A link whose buffer is
        full is skipped: its next beat reads the log anyway."""
        self._tell = False
        for conn, state in list(self._conns.items()):
            if state["uid"] is not None and not state["bye"]:
                with contextlib.suppress(OSError):
                    conn.send(b"dead\n")

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
                self._tell = True
                self._say(f"{uid} closed its connection without leaving: declared dead in "
                          f"round {r}")
                return
            except Exception as e:  # noqa: BLE001 - a new client, once; then the heartbeats
                self._store = None
                if attempt:
                    self._say(f"{uid} closed its connection without leaving; not declared "
                              f"({type(e).__name__}: {e}): its watchers will")


class Link:
    """This process's connection to the store host's :class:`LivenessServer`: it connects
    (``hello <uid>``), waits for the connection to end, and reconnects (after a store restart
    the new server publishes its port again, maybe another one). ``port`` reads the key: None
    (no service) on the first look ends the thread; a read that fails, or finds no key after a
    service was found (the store away or restarting), is tried again every ``retry_s``: the
    links were back within a second or two of a restarted store, where a backoff that grew over
    the outage left three processes of the chaos campaign undeclared at a kill 10 s after two
    restarts; a published port that does not answer is tried after 1, 2, 4 ... s
    (``MAX_RETRY_S`` at most). :meth:`leave` says ``bye`` and closes.

    Two daemon threads. One (``aegis-liveness-link``) reads the port and decides; the other
    (``aegis-liveness-hold``, :meth:`_hold`) holds the connection in a file table of its own
    (``unshare(CLONE_FILES)``, Linux): a killed process frees its memory before it closes its
    files (``exit_mm`` before ``exit_files``: 80 ms per GB touched here, 0.3 s for 4 GB, more
    on a loaded machine), and its shared table is closed only by its last thread, after that;
    a table of one thread is closed when that thread exits, which a SIGKILL makes it do at
    once. A child forked by the process (a DataLoader worker) does not inherit the connection
    either: before, it kept it open, and its parent's death unseen, until it exited too. The
    holder thread's sockets sit near the top of the fd numbers, out of the range the process's
    own table hands out (a finalizer of another thread's object run in this one closes a number
    there: in this table, an unused one). Where a table of its own is refused, the holder keeps
    the connection in the process's table, as before. Costs: a thread and a socket pair per
    process, nothing that grows with the world size."""

    def __init__(self, uid: str, host: str, port: Callable[[], int | None], *,
                 retry_s: float = 1.0, own_table: bool = True) -> None:
        self.uid = uid
        self._own_table = own_table  # False: in the process's table (bench/liveness_kill.py)
        self.host = host
        self._port = port
        self.retry_s = retry_s
        self._up = False
        self._stop = threading.Event()
        self.connects = 0
        self.failures = 0  # attempts that found no store or no service to connect to
        self.private: bool | None = None  # the holder's table is its own (None: not known yet)
        # called (from the link's thread) when the service says a process was declared dead
        self.on_death: Callable[[], None] | None = None
        self._ctl, theirs = socket.socketpair()
        _sockets.keep(self._ctl)  # never a round's to publish or cut
        theirs_fd = theirs.detach()
        self._ready = threading.Event()
        self._holder = threading.Thread(target=self._hold, args=(theirs_fd,),
                                        name="aegis-liveness-hold", daemon=True)
        self._holder.start()
        self._ready.wait()
        if self.private:  # the holder has its copy: this table's is not needed
            os.close(theirs_fd)
        self._rfile = self._ctl.makefile("rb")
        self._thread = threading.Thread(target=self._run, name="aegis-liveness-link", daemon=True)
        self._thread.start()

    @property
    def connected(self) -> bool:
        return self._up

    # -- the deciding thread (the process's file table) ---------------------------------------

    def _ask(self, line: str) -> str:
        """Send the holder one command; its one-line answer ("" when it is gone)."""
        try:
            self._ctl.sendall(line.encode() + b"\n")
            return self._rfile.readline().decode().strip()
        except (OSError, ValueError):
            return ""

    def _next_line(self) -> str:
        try:
            return self._rfile.readline().decode().strip()
        except (OSError, ValueError):
            return ""

    def _run(self) -> None:
        found = False  # a service was found once: it is there again after a store restart
        delay = self.retry_s
        try:
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
                if not self._holder.is_alive():
                    return
                if self._stop.is_set() or self._ask(f"connect {port}") != "up":
                    # a port published but not reachable (a firewall?): back off
                    self.failures += 1
                    self._stop.wait(delay)
                    delay = min(MAX_RETRY_S, 2 * delay)
                    continue
                found, delay = True, self.retry_s
                self._up = True
                self.connects += 1
                # the holder says "dead" when the service does, "down" at the connection's end
                # ("": it is gone)
                while self._next_line() == "dead":
                    if self.on_death is not None:
                        with contextlib.suppress(Exception):
                            self.on_death()
                self._up = False
                if not self._holder.is_alive():
                    return
                self._stop.wait(self.retry_s)
        finally:
            self._up = False
            if not self._stop.is_set():  # ended without leave(): the holder ends too
                with contextlib.suppress(OSError):
                    self._ctl.sendall(b"close\n")

    def leave(self, *, bye: bool = True) -> None:
        """Close the connection: after ``bye`` on a clean exit (the server declares nobody),
        without it when this process leaves the job on an error (declared at once, as if it
        had died: its peers need not wait for its heartbeat to go silent)."""
        self._stop.set()
        with contextlib.suppress(OSError):
            self._ctl.sendall(b"bye\n" if bye else b"close\n")
        self._holder.join(timeout=5)  # it has said bye and closed (or was gone)
        self._up = False
        with contextlib.suppress(OSError):
            self._ctl.shutdown(socket.SHUT_RDWR)  # the deciding thread's wait ends
        self._thread.join(timeout=5)
        with contextlib.suppress(OSError):
            self._rfile.close()
            self._ctl.close()

    # -- the holding thread (a file table of its own) -----------------------------------------

    def _hold(self, ctl_fd: int) -> None:
        """Connect when told (``connect <port>``: answers ``up`` or ``fail``), say ``down`` when
        the connection ends; ``bye`` or ``close`` (or the other end gone): leave and return."""
        try:
            self.private = self._own_table and _own_file_table()
            if self.private:
                # this table is a copy of the process's: its copies closed, or this thread
                # would keep the process's files open until it exits
                floor, top = _fd_range()
                mine = fcntl.fcntl(ctl_fd, fcntl.F_DUPFD_CLOEXEC, floor)
                os.closerange(3, mine)
                os.closerange(mine + 1, top)
                ctl_fd = mine
            ctl = socket.socket(fileno=ctl_fd)
        except OSError:
            self.private = False
            ctl = socket.socket(fileno=ctl_fd)
        finally:
            self._ready.set()
        conn: socket.socket | None = None
        buf = b""
        try:
            while True:
                # poll(2), not select(2): these numbers are above FD_SETSIZE
                waits = select.poll()
                for s in (ctl,) if conn is None else (ctl, conn):
                    waits.register(s, select.POLLIN)
                ready = {fd for fd, _ in waits.poll()}
                if conn is not None and conn.fileno() in ready:
                    try:
                        data = conn.recv(64)  # "dead" lines from the server; b"" at the end
                    except OSError:
                        data = b""
                    if not data:
                        with contextlib.suppress(OSError):
                            conn.close()
                        conn = None
                        ctl.sendall(b"down\n")
                        continue
                    if b"dead" in data:  # (a line split over two reads: the next beat reads it)
                        ctl.sendall(b"dead\n")
                if ctl.fileno() not in ready:
                    continue
                more = ctl.recv(256)
                if not more:
                    return  # the process side is gone
                buf += more
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    cmd, _, arg = line.decode().partition(" ")
                    if cmd == "connect":
                        conn = self._open(int(arg))
                        ctl.sendall(b"up\n" if conn is not None else b"fail\n")
                    elif cmd in ("bye", "close"):
                        if conn is not None and cmd == "bye":
                            with contextlib.suppress(OSError):
                                conn.sendall(b"bye\n")
                        return
        except OSError:
            return
        finally:
            if conn is not None:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
                with contextlib.suppress(OSError):
                    conn.close()
            with contextlib.suppress(OSError):
                ctl.close()

    def _open(self, port: int) -> socket.socket | None:
        try:
            s = socket.create_connection((self.host, port), timeout=2.0)
        except OSError:
            return None
        try:
            if self.private:
                s = socket.socket(fileno=_lift(s.detach()))
            _sockets.keep(s)
            s.settimeout(2.0)
            s.sendall(f"hello {self.uid}\n".encode())
            s.settimeout(None)
        except OSError:
            s.close()
            return None
        return s


def _own_file_table() -> bool:
    """Give the calling thread a file table of its own (``unshare(CLONE_FILES)``): what it opens
    from then on is closed the moment it exits. False where that is refused or not Linux."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.unshare(_CLONE_FILES) == 0)
    except (OSError, AttributeError):
        return False


def _fd_range() -> tuple[int, int]:
    """Where the holder's numbers go: the top 16 below the soft limit (at most 65,536), far
    above what the process's table hands out first (its lowest free number)."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    top = 65536 if soft == resource.RLIM_INFINITY or soft > 65536 else soft
    return max(3, top - 16), top


def _lift(fd: int) -> int:
    """``fd`` moved to the holder's range of its (own) table."""
    new = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, _fd_range()[0])
    os.close(fd)
    return new
