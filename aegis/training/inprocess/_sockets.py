"""This process's TCP sockets, read from ``/proc`` (Linux), and shutdown(2) on chosen ones: the
tools of the gloo implementation of :class:`~.abandon.Abandon`.

Measured here (torch 2.13): a gloo group destroyed (or aborted, or shut down) by a process that
lives on keeps its TCP connections open, so a peer blocked in a collective with it waits for the
group's timeout; and gloo cannot abandon a collective waiting on a stopped peer
(``ProcessGroup.abort()`` does not unblock it). Shutting the connections down (both ways) ends
the pending receives at once, on both sides, as if the process had died. Elsewhere than Linux
nothing is found, and the group's timeout remains.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["keep", "my_sockets", "endpoints", "listening_ports", "opened_since", "shutdown_where",
           "split", "connected_to", "shutdown_where_inode"]

TCP_ESTABLISHED, TCP_LISTEN = "01", "0A"


# Sockets no round may publish or cut (inodes): the liveness link (its end is a death to the
# store host, and a round's fences and leave shut down what the round published)
KEEP: set[int] = set()


def keep(sock: socket.socket) -> None:
    """Keep ``sock`` out of :func:`my_sockets` (so out of every round's published and cut sets)."""
    KEEP.add(os.fstat(sock.fileno()).st_ino)


def my_sockets() -> dict[int, int]:
    """inode -> fd of this process's sockets (but those kept, :func:`keep`)."""
    out = {}
    with contextlib.suppress(OSError):
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                link = os.readlink(f"/proc/self/fd/{fd}")
                if link.startswith("socket:[") and int(link[8:-1]) not in KEEP:
                    out[int(link[8:-1])] = int(fd)
    return out


def endpoints() -> list[tuple[str, str, str, int]]:
    """(local "ip:port", remote "ip:port", state, inode) of every TCP socket of this network
    namespace, addresses as /proc writes them (hex)."""
    rows = []
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(name) as fh:
            next(fh, None)
            for line in fh:
                f = line.split()
                if len(f) > 9:
                    rows.append((f[1], f[2], f[3], int(f[9])))
    return rows


def split(ep: str) -> tuple[str, int]:
    """("hex ip", port) of a /proc endpoint."""
    ip, port = ep.rsplit(":", 1)
    return ip, int(port, 16)


def any_ip(ip: str) -> bool:
    return set(ip) <= {"0"}


def listening_ports() -> list[int]:
    mine = my_sockets()
    return sorted({split(lep)[1] for lep, _, st, ino in endpoints()
                   if st == TCP_LISTEN and ino in mine})


def opened_since(baseline: Iterable[int]) -> dict[str, Any]:
    """This process's sockets that are not in ``baseline`` (inodes): the endpoints it listens on
    and the local ends of its established connections, as published for a round."""
    base = set(baseline)
    mine = my_sockets()
    rows = [(lep, st) for lep, _, st, ino in endpoints() if ino in mine and ino not in base]
    listen = sorted({lep for lep, st in rows if st == TCP_LISTEN})
    local = sorted({lep for lep, st in rows if st == TCP_ESTABLISHED})
    return {"listen": sorted({split(e)[1] for e in listen}),
            "listen_eps": listen, "local": local}


def connected_to(port: int, inodes: Iterable[int]) -> frozenset[int]:
    """Which of ``inodes`` (this process's sockets) are established connections to ``port``."""
    want = set(inodes)
    return frozenset(ino for _, rep, st, ino in endpoints()
                     if ino in want and st == TCP_ESTABLISHED and split(rep)[1] == port)


def shutdown_where(match: Callable[[str, str], bool]) -> int:
    """Shut down (both ways) this process's established connections for which
    ``match(local "ip:port", remote "ip:port")`` is true; return how many."""
    mine = my_sockets()
    n = 0
    for lep, rep, st, ino in endpoints():
        if st != TCP_ESTABLISHED or ino not in mine or not match(lep, rep):
            continue
        n += _shutdown(mine[ino])
    return n


def shutdown_where_inode(inodes: Iterable[int]) -> int:
    """Shut down (both ways) those of this process's sockets whose inode is in ``inodes`` (and
    that are still open); return how many."""
    mine = my_sockets()
    n = 0
    for ino in set(inodes):
        if ino in mine:
            n += _shutdown(mine[ino])
    return n


def _shutdown(fd: int) -> int:
    """shutdown(2) both ways on ``fd`` (through a duplicate: the owner keeps its descriptor);
    1 if done."""
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return 0
    try:
        sock.shutdown(socket.SHUT_RDWR)
        return 1
    except OSError:
        return 0
    finally:
        sock.close()
