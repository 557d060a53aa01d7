"""This process's TCP sockets (its descriptors listed in ``/proc/self/fd``, Linux; each socket
asked for its endpoints and state) and shutdown(2) on chosen ones: the tools of the gloo
implementation of :class:`~.abandon.Abandon`.

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
import struct
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


def _hex(family: int, addr: tuple[Any, ...]) -> str:
    """``addr`` (ip, port, ...) as /proc/net/tcp writes an endpoint: each 32-bit word of the
    address in host order, hex; the port hex."""
    raw = socket.inet_pton(family, str(addr[0]).split("%")[0])
    words = struct.unpack(f"<{len(raw) // 4}I", raw)
    return "".join(f"{w:08X}" for w in words) + f":{int(addr[1]):04X}"


def endpoints() -> list[tuple[str, str, str, int]]:
    """(local "ip:port", remote "ip:port", state, inode) of every TCP socket of this process
    (but those kept), as /proc/net/tcp writes them (hex; state: TCP_ESTABLISHED, TCP_LISTEN...).

    Asked of each socket (getsockname, getpeername, TCP_INFO's state), not read from
    /proc/net/tcp: that walks the whole namespace's connection table, ~10 ms per file here with
    a few dozen sockets (a 262,144-bucket table), and a round's start, its fences and its
    teardown read it six times; this costs O(this process's sockets)."""
    rows = []
    for ino, fd in my_sockets().items():
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            state = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0]
            local = _hex(sock.family, sock.getsockname())
            try:
                remote = _hex(sock.family, sock.getpeername())
            except OSError:  # not connected (listening, closed)
                remote = _hex(sock.family, ("0.0.0.0" if sock.family == socket.AF_INET else "::", 0))
            rows.append((local, remote, f"{state:02X}", ino))
        except OSError:
            continue
        finally:
            sock.close()
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
