"""Abandoning a round's process groups without collectives: one seam, one implementation per
backend.

A round ends when a peer is lost (dead, frozen, cut off) or when joiners are admitted. Either
way no collective can be trusted to finish, so a process leaves the round's groups on its own,
and must make sure that no peer stays blocked on it, and that it is not blocked on a silent
peer. What that takes depends on the backend:

* **gloo** (:class:`GlooAbandon`): destroying or aborting a gloo group leaves its TCP
  connections open (measured, torch 2.13), and a collective waiting on a stopped peer cannot be
  abandoned. So each process *publishes* the sockets it opened for the round's groups, *fences*
  a silent member by shutting down its own connections with that member's sockets (the pending
  collective fails at once), and when it *leaves* shuts down its connections to every listener
  of the round, then destroys the groups.
* **NCCL** (:class:`NcclAbandon`): communicators must be aborted (``ncclCommAbort``) before the
  groups are destroyed (``destroy_process_group`` flushes, and hangs on a broken job since torch
  2.6); an aborted collective does not raise by itself, it leaves garbage. So *fence* aborts
  every NCCL communicator of the round, marks the round failed (``Manager.save`` and the commit
  refuse to go on) and raises :class:`~.round.PeerLost` in the round's thread; *leave* aborts
  them (all at once, inside one NCCL group call) and destroys the groups within a bound, else
  the process restarts. aegis' own groups are gloo in every case, so the NCCL implementation
  runs the gloo one too (:class:`Composite`).

Who calls what: the round loop calls :meth:`Abandon.begin` before it creates the round's
default group, :meth:`Abandon.rendezvous` with the connection that creation goes through,
:meth:`Abandon.publish` after (and every Manager after creating its groups),
:meth:`Abandon.leave` after the round ended; the heartbeat thread calls :meth:`Abandon.fence`
for a member silent for ``dead_after_s`` (while the groups are created: for
``membership.CREATING_SILENT_S``). Every implementation passes
``tests/test_abandon.py``.
"""

from __future__ import annotations

import abc
import contextlib
import ctypes
import json
import threading
import time
from typing import Any

import torch.distributed as dist

from aegis.training.inprocess import _sockets
from aegis.training.inprocess.round import PeerLost, RecoveryGaveUp, Round

__all__ = ["Abandon", "GlooAbandon", "NcclAbandon", "Composite", "for_backend",
           "destroy_all"]


class Abandon(abc.ABC):
    """How this process gives up the round's process groups (see the module docstring)."""

    name = "abstract"

    def begin(self, store: Any, r: int, uid: str) -> None:  # noqa: B027 - optional
        """Round ``r`` is about to create its groups (``store``: the membership store)."""

    def publish(self) -> None:  # noqa: B027 - optional
        """Groups were created (the default group, a Manager's): record what peers need to fence
        this process off."""

    def rendezvous(self, inodes: frozenset[int]) -> None:  # noqa: B027 - optional
        """``inodes``: this process's connections to the store through which the round's groups
        rendezvous. A fence shuts them down too: a group creation that waits there for a lost
        member's address (it never comes) fails now, not at ``create_timeout``."""

    @abc.abstractmethod
    def fence(self, uid: str) -> int:
        """``uid`` (a member of the running round) has been silent for ``dead_after_s``: make
        every collective of this process that waits on it fail now. ``uid`` may be this
        process's own: its peers declared it dead (it was frozen or cut off, and the round went
        on without it), so every collective of its round must fail now, whichever peer it waits
        on (one of its own node that left without closing the connection, say). Called from the
        heartbeat thread while the round's thread may be blocked in a collective. Returns how
        many connections or communicators were cut; raises if it could not tell what to cut yet
        (the membership store unreachable): the heartbeat fences again at its next beat."""

    @abc.abstractmethod
    def leave(self, members: list[str]) -> None:
        """The round ended: leave its groups so that no peer (of ``members``) stays blocked on
        this process, then destroy every process group. Called from the round loop's thread,
        after the round's thread returned; bounded."""


def destroy_all(bound_s: float = 10.0) -> None:
    """``destroy_process_group()`` of every group, in a thread, for at most ``bound_s``: it may
    flush a broken communicator forever. Past the bound: :class:`RecoveryGaveUp` (restart)."""
    if not dist.is_initialized():
        return
    done = threading.Event()

    def run() -> None:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
        done.set()

    threading.Thread(target=run, name="aegis-destroy", daemon=True).start()
    if not done.wait(bound_s):
        raise RecoveryGaveUp(f"destroy_process_group() did not return within {bound_s:.0f} s after "
                             "the round's groups were abandoned; restarting the process")


class GlooAbandon(Abandon):
    """gloo: sockets shut down (see the module docstring)."""

    name = "gloo"

    def __init__(self) -> None:
        self.store: Any = None
        self.r = -1
        self.uid = ""
        self.baseline: frozenset[int] = frozenset()
        self.rdv: frozenset[int] = frozenset()
        self.mine: dict[str, Any] = {}  # what this process last published for the round

    def begin(self, store: Any, r: int, uid: str) -> None:
        self.store, self.r, self.uid = store, r, uid
        self.baseline = frozenset(_sockets.my_sockets())
        self.rdv = frozenset()
        self.mine = {}

    def rendezvous(self, inodes: frozenset[int]) -> None:
        self.rdv = inodes

    def _key(self, uid: str) -> str:
        return f"aegis/round/{self.r}/ports/{uid}"

    def publish(self) -> None:
        """Publish this process's sockets opened since the round began (so that a server or
        client of the script's own is never touched): the ports its gloo groups listen on (a
        leaving process shuts its connections to them down) and the local ends of the
        connections it holds (a peer fencing this process off shuts those down)."""
        if self.store is None:
            return
        self.mine = _sockets.opened_since(self.baseline)
        with contextlib.suppress(Exception):
            self.store.set(self._key(self.uid), json.dumps(self.mine))

    def _info(self, uid: str, *, strict: bool = False) -> dict[str, Any] | None:
        """``uid``'s published sockets of this round; None if it published none. The store
        unreachable: None, or (``strict``) the error."""
        try:
            if not self.store.check([self._key(uid)]):
                return None
            info = json.loads(self.store.get(self._key(uid)).decode())
        except Exception:  # noqa: BLE001 - the store away: the group's timeout remains
            if strict:
                raise
            return None
        return info if isinstance(info, dict) else None

    def fence(self, uid: str) -> int:
        """Shut down this process's established connections with ``uid``'s sockets of this
        round (its listeners, and the connections it opened, as it published them), and its
        connection to the round's rendezvous (a creation of groups waiting for ``uid``'s
        address, the default group's or a later one's, fails now: the round is over anyway)."""
        cut = _sockets.shutdown_where_inode(self.rdv) if self.rdv else 0
        if uid == self.uid:  # declared dead itself: off the whole round, from what it keeps here
            return cut + self._cut_mine()
        try:
            info = self._info(uid, strict=True) if self.store is not None else None
        except Exception:  # noqa: BLE001 - the store unreachable: as if it published nothing
            info = None
        if info is None:
            # its sockets unknown: it never published them, or the store lost them (restarted
            # empty: a frozen member fenced 10 s late in the chaos campaign, when it woke up).
            # The round is over for this process anyway: shut down its own connections of it
            return cut + self._cut_mine()
        listen = [_sockets.split(e) for e in info.get("listen_eps", [])]
        local = {_sockets.split(e) for e in info.get("local", [])}

        def match(_lep: str, rep: str) -> bool:
            rip, rport = _sockets.split(rep)
            return (rip, rport) in local or any(
                rport == port and (ip == rip or _sockets.any_ip(ip)) for ip, port in listen)

        return cut + _sockets.shutdown_where(match)

    def _cut_mine(self) -> int:
        """Shut down this process's own connections of the round, as it last published them
        (the connections it opened, and those accepted on its listening ports), from what it
        keeps here: no store needed."""
        local = set(self.mine.get("local", []))
        listen = set(self.mine.get("listen", []))
        if not local and not listen:
            return 0
        return _sockets.shutdown_where(
            lambda lep, rep: lep in local or _sockets.split(lep)[1] in listen)

    def _round_ports(self, members: list[str]) -> set[int]:
        ports: set[int] = set()
        if self.store is None:
            return ports
        for uid in members:
            info = self._info(uid)
            if info is not None:
                ports.update(info.get("listen", []))
        return ports

    def cut(self, members: list[str]) -> int:
        """Shut down this process's connections from or to any listener of the round."""
        ports = self._round_ports(members)
        return _sockets.shutdown_where(
            lambda lep, rep: _sockets.split(lep)[1] in ports or _sockets.split(rep)[1] in ports)

    def leave(self, members: list[str]) -> None:
        with contextlib.suppress(Exception):
            self.cut(members)
        with contextlib.suppress(Exception):  # and its own, should the store have lost them
            self._cut_mine()
        if dist.is_initialized():
            from torch.distributed.distributed_c10d import _world

            for pg in list(_world.pg_map):  # close the connections now, so peers fail at once
                with contextlib.suppress(Exception):
                    pg.abort()
        destroy_all()


def _nccl_backends() -> list[Any]:
    """The NCCL backends of every live process group (the default group's CUDA half included)."""
    if not dist.is_initialized():
        return []
    import torch
    from torch.distributed.distributed_c10d import _world

    try:
        from torch.distributed import ProcessGroupNCCL
    except ImportError:  # a build without NCCL
        return []
    out = []
    for pg in list(_world.pg_map):
        with contextlib.suppress(Exception):
            b = pg._get_backend(torch.device("cuda"))
            if isinstance(b, ProcessGroupNCCL):
                out.append(b)
    return out


def abort_nccl() -> int:
    """Abort every NCCL communicator of this process, inside one NCCL group call (so that the
    aborts of different communicators cannot wait on each other; pytorch#119797). Returns how
    many backends were aborted."""
    backends = _nccl_backends()
    if not backends:
        return 0
    with contextlib.suppress(Exception):
        backends[0]._group_start()
    n = 0
    for b in backends:
        with contextlib.suppress(Exception):
            b.abort()
            n += 1
    with contextlib.suppress(Exception):
        backends[0]._group_end()
    return n


def raise_in(thread: threading.Thread | None, exc: type[BaseException]) -> bool:
    """Raise ``exc`` in ``thread`` at its next Python instruction (CPython's async exception; a
    thread blocked in C sees it when the call returns: after an abort, it does)."""
    if thread is None or thread.ident is None or not thread.is_alive():
        return False
    n = ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(exc))
    return n == 1


class NcclAbandon(Abandon):
    """NCCL: communicators aborted (see the module docstring). Not verified on a multi-GPU
    machine yet: world-1 NCCL runs in ``bench/gpu_check.py``."""

    name = "nccl"

    def __init__(self, *, destroy_bound_s: float = 10.0) -> None:
        self.destroy_bound_s = destroy_bound_s
        self.aborted = False
        self.uid = ""

    def begin(self, store: Any, r: int, uid: str) -> None:
        self.aborted = False
        self.uid = uid

    def fence(self, uid: str) -> int:
        who = ("this process was declared dead by its peers" if uid == self.uid
               else f"member {uid} of round {Round.r} went silent")
        Round.failed = f"{who}; the round's NCCL communicators were aborted"
        n = abort_nccl()
        self.aborted = True
        raise_in(Round.thread, PeerLost)
        return n

    def leave(self, members: list[str]) -> None:
        t0 = time.monotonic()
        if not self.aborted:
            abort_nccl()
            self.aborted = True
        destroy_all(max(1.0, self.destroy_bound_s - (time.monotonic() - t0)))


class Composite(Abandon):
    """Several implementations, in order (NCCL first: a collective blocked on a communicator
    must be freed before the gloo sockets are shut)."""

    def __init__(self, *parts: Abandon) -> None:
        self.parts = parts
        self.name = "+".join(p.name for p in parts)

    def begin(self, store: Any, r: int, uid: str) -> None:
        for p in self.parts:
            p.begin(store, r, uid)

    def publish(self) -> None:
        for p in self.parts:
            p.publish()

    def rendezvous(self, inodes: frozenset[int]) -> None:
        for p in self.parts:
            p.rendezvous(inodes)

    def fence(self, uid: str) -> int:
        return sum(p.fence(uid) for p in self.parts)

    def leave(self, members: list[str]) -> None:
        # every part cuts first, the first part that destroys the groups ends them for all
        gloo = [p for p in self.parts if isinstance(p, GlooAbandon)]
        for p in self.parts:
            if isinstance(p, NcclAbandon) and not p.aborted:
                abort_nccl()
                p.aborted = True
        for p in gloo:
            with contextlib.suppress(Exception):
                p.cut(members)
        self.parts[-1].leave(members)


def for_backend(backend: str) -> Abandon:
    """The implementation for a ``init_process_group`` backend string: ``"gloo"``,
    ``"nccl"``, ``"cpu:gloo,cuda:nccl"``... aegis' own groups are gloo, so every job runs the
    gloo part; a backend naming NCCL adds the NCCL part."""
    names = {part.split(":")[-1].strip().lower() for part in backend.split(",")}
    unknown = names - {"gloo", "nccl"}
    if unknown:
        from aegis.errors import ConfigError

        raise ConfigError(f"run_in_process(backend={backend!r}): in-process recovery knows how to "
                          f"abandon gloo and NCCL groups, not {sorted(unknown)}")
    if "nccl" in names:
        return Composite(NcclAbandon(), GlooAbandon())
    return GlooAbandon()
