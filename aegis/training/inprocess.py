"""In-process recovery: surviving ranks re-form their process groups and go on training in the
same process when a peer dies, instead of being restarted.

::

    def train(world: aegis.World) -> None:          # aegis may call it again after a failure
        mesh = init_device_mesh("cpu", (world.size,))  # everything bound to the process group
        model = build_model(); fully_shard(model, mesh=mesh)   # is built inside
        optim = torch.optim.AdamW(model.parameters())
        mgr = aegis.Manager(job, {"model": aegis.ModelOptimizerState(model, optim)})
        start = mgr.restore()
        for step in range(start + 1, total + 1):
            ...
            mgr.save(step)
        mgr.close()

    aegis.run_in_process(train, min_world=2)        # instead of init_process_group + train()

How it works (see docs/architecture.md, "In-process recovery"):

* **Membership** lives in a c10d ``TCPStore`` that no training node owns (the job's rendezvous
  store; ``AEGIS_MEMBERSHIP=host:port``). Every process beats a heartbeat counter there from a
  thread of its own. A *round* is one membership: each live process announces itself, and the
  first proposal written with ``compare_set`` is the round's member list, which every process
  adopts (the store is the single point of agreement; there is no consensus protocol here).
  A proposal waits for every member of the previous round whose heartbeat still moves; one
  whose counter has not moved for ``dead_after_s`` is dead.
* Each round gets its own default process group on ``PrefixStore("aegis/round/<r>/pg")``;
  ``train`` runs in it. A collective that fails because a peer is gone (gloo: connection closed
  or reset, or the group's timeout for a peer that stopped answering) ends the round: the
  Managers of the round are aborted without collectives, every process group is destroyed, and
  the survivors form the next round and call ``train`` again, which restores the newest
  committed snapshot from their node stores and their peers' replicas (resharding to the new
  world size) and goes on.
* Anything else raised by ``train`` (a bug in the script, an error of aegis that is not a lost
  peer) is re-raised: the process exits and torchrun restarts it, as without this wrapper.

gloo cannot abandon a collective that waits on a stopped (not dead) peer (measured here:
``ProcessGroup.abort()`` does not unblock it); such a hang ends when the training group's
timeout (``collective_timeout``) fires, so keep it short (seconds) with gloo.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from aegis._dist import node_id
from aegis.errors import AegisError, ConfigError

__all__ = ["World", "run_in_process", "RecoveryGaveUp", "Regroup", "is_peer_failure"]

_ENV_STORE = "AEGIS_MEMBERSHIP"


class Regroup(Exception):  # noqa: N818 - not an error: the round ends on purpose
    """Raised by ``Manager.save`` on every rank together, after the snapshot committed, when
    processes wait to join: the next round includes them."""

    def __init__(self, registered: int) -> None:
        super().__init__(f"{registered} process(es) registered to join")
        self.registered = registered


class RecoveryGaveUp(AegisError):
    """In-process recovery could not go on (too few members, a membership timeout); the process
    exits so that the launcher restarts it."""


@dataclass
class World:
    """What ``train`` is called with: the current membership."""

    rank: int
    size: int
    round: int
    node: str
    members: list[str]
    restarts: int = 0  # rounds this process re-entered train() after a failure
    timings: dict[str, float] = field(default_factory=dict)  # the last recovery's phases (s)
    failed_at: float | None = None  # time.time() when this process saw the last failure
    cause: str | None = None  # why the previous round ended, as this process saw it


# -- Managers of the current round: aborted (no collectives) when the round fails -------------

_live: weakref.WeakSet[Any] = weakref.WeakSet()
_active = threading.local()


def register_manager(mgr: Any) -> None:
    _live.add(mgr)


def in_process_round() -> bool:
    return bool(getattr(_active, "on", False))


def is_peer_failure(e: BaseException) -> bool:
    """A lost or silent peer, as gloo and aegis report it (not a bug in the script)."""
    from aegis.errors import CollectiveError, SnapshotTimeoutError

    if isinstance(e, SnapshotTimeoutError):
        return True
    text = f"{type(e).__name__}: {e}".lower()
    if isinstance(e, CollectiveError):
        return "peer is likely gone" in text or "timed out" in text or "connection" in text
    if isinstance(e, AegisError):
        return "peer is likely gone" in text or "collective failed" in text
    markers = ("connection closed by peer", "connection reset", "broken pipe", "timed out",
               "timeout", "socket closed", "no route to host", "connection refused",
               "read error", "write error", "gloo")
    return isinstance(e, RuntimeError | OSError) and any(m in text for m in markers)


# -- membership -------------------------------------------------------------------------------


def _store_from_env(timeout: timedelta) -> dist.TCPStore:
    addr = os.environ.get(_ENV_STORE)
    if not addr or ":" not in addr:
        raise ConfigError(
            f"{_ENV_STORE}=host:port must name a c10d TCPStore that no training node owns (the "
            "job's rendezvous store; aegis.sim starts one): in-process recovery agrees on "
            "membership through it"
        )
    host, port = addr.rsplit(":", 1)
    return dist.TCPStore(host, int(port), is_master=False, timeout=timeout, wait_for_workers=False)


class _Heartbeat:
    """A counter in the store, bumped every ``interval_s`` from a thread with its own client;
    the same thread watches the counters of the current round's members, so that when a round
    fails, how long each peer has been silent is already known (a peer that stopped with the
    failure is declared dead ``dead_after_s`` after it stopped, not after the failure was seen).
    Every process reads every member's counter: O(world) reads per process per interval, fine
    for the simulated cluster; at scale, per-node heartbeats are the next step."""

    def __init__(self, uid: str, interval_s: float, timeout: timedelta, *,
                 fence_after_s: float | None = None) -> None:
        self.key = f"aegis/hb/{uid}"
        self.interval_s = interval_s
        self.fence_after_s = fence_after_s
        self._store = _store_from_env(timeout)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._watch: list[str] = []
        self._seen: dict[str, tuple[int, float]] = {}  # uid -> (counter, when it last moved)
        self._fenced: set[str] = set()
        self.fences: list[tuple[str, float, int]] = []  # (uid, silent s, connections shut)
        self._thread = threading.Thread(target=self._run, name="aegis-heartbeat", daemon=True)
        self._thread.start()

    def watch(self, uids: list[str]) -> None:
        """Watch ``uids`` from now on. One not watched before counts as just seen: until this
        thread reads its counter, the last reading (if any) is from before it was left out
        (a frozen process that came back would look silent for as long as it was away, and a
        round would form without it; seen in CI under load). It is dead only once its counter
        has not moved for ``dead_after_s`` from now."""
        now = time.monotonic()
        with self._lock:
            for u in uids:
                if u not in self._watch:
                    self._seen[u] = (-1, now)  # no counter reads -1: the first read moves it
            self._watch = list(uids)
            self._fenced.clear()

    def silent_for(self, uid: str) -> float:
        """Seconds since ``uid``'s counter last moved (as seen here); 0 if never watched."""
        with self._lock:
            seen = self._seen.get(uid)
        return 0.0 if seen is None else time.monotonic() - seen[1]

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(Exception):  # a store hiccup is seen by the peers, not here
                self._store.add(self.key, 1)
                with self._lock:
                    watch = list(self._watch)
                for uid in watch:
                    count = self._store.add(f"aegis/hb/{uid}", 0)
                    now = time.monotonic()
                    with self._lock:
                        last = self._seen.get(uid)
                        if last is None or last[0] != count:
                            self._seen[uid] = (count, now)
                if self.fence_after_s is not None:
                    self._fence_silent(watch)
            self._stop.wait(self.interval_s)

    def _fence_silent(self, watch: list[str]) -> None:
        """A member of the running round whose heartbeat stopped (frozen, cut off, or its
        machine gone without closing its sockets) is fenced off: this process shuts down its
        own connections with it, so that a collective waiting on it fails now instead of at
        the group's timeout (gloo cannot abandon it otherwise). The member is left out of the
        next round; if it comes back, it registers and rejoins at a snapshot."""
        assert self.fence_after_s is not None
        for uid in watch:
            if uid in self._fenced or uid not in _Round.members or not in_round():
                continue
            silent = self.silent_for(uid)
            if silent < self.fence_after_s:
                continue
            self._fenced.add(uid)
            n = _fence(self._store, _Round.r, uid)
            self.fences.append((uid, silent, n))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


class _Membership:
    """Rounds of membership agreed through one TCPStore (see the module docstring)."""

    def __init__(self, store: dist.TCPStore, uid: str, hb: _Heartbeat, *, dead_after_s: float,
                 form_timeout_s: float, min_world: int) -> None:
        self.store = store
        self.uid = uid
        self.hb = hb
        self.dead_after_s = dead_after_s
        self.form_timeout_s = form_timeout_s
        self.min_world = min_world

    def _alive(self, uid: str) -> bool:
        return self.hb.silent_for(uid) < self.dead_after_s

    def _joined(self, r: int) -> list[str]:
        n = self.store.add(f"aegis/round/{r}/count", 0)
        return [self.store.get(f"aegis/round/{r}/slot/{i}").decode() for i in range(1, n + 1)]

    def form(self, r: int, previous: list[str] | None, expected_first: int) -> tuple[list[str], int]:
        """Join round ``r``; return its members in rank order and the number of join slots
        admitted so far (every caller gets the same)."""
        i = self.store.add(f"aegis/round/{r}/count", 1)
        self.store.set(f"aegis/round/{r}/slot/{i}", self.uid)
        key = f"aegis/round/{r}/members"
        deadline = time.monotonic() + self.form_timeout_s
        while True:
            if self.store.check([key]):
                break
            joined = self._joined(r)
            if previous is None:  # the first round, or a job restarted as a whole
                ready = len(joined) >= max(expected_first, self.min_world)
            else:  # survivors: every previous member still beating has joined
                waiting = [u for u in previous if u not in joined and self._alive(u)]
                ready = not waiting and len(joined) >= self.min_world
            if ready:
                order = {u: k for k, u in enumerate(previous or [])}
                proposal = sorted(set(joined), key=lambda u: (order.get(u, len(order)), u))
                self.store.compare_set(key, "", json.dumps(
                    {"members": proposal, "admitted": self._admitted(proposal)}))
                break
            if time.monotonic() > deadline:
                raise RecoveryGaveUp(
                    f"round {r}: {len(joined)} process(es) joined within {self.form_timeout_s:.0f} s "
                    f"({joined}), fewer than needed (min_world={self.min_world}"
                    + (f", first round: {expected_first}" if previous is None else "") + ")"
                )
            time.sleep(0.01)
        record = json.loads(self.store.get(key).decode())
        if self.uid not in record["members"]:
            raise _Excluded(f"round {r} was formed without this process ({self.uid})")
        return list(record["members"]), int(record["admitted"])

    def _admitted(self, members: list[str]) -> int:
        """Join slots admitted once this round forms: those admitted before, and those of any
        registered process that joins it directly (a joiner that was waiting when the round
        began to form)."""
        n = int(self.store.add("aegis/admitted", 0))
        for u in members:
            k = f"aegis/join/slot_of/{u}"
            if self.store.check([k]):
                n = max(n, int(self.store.get(k).decode()))
        return n


class _Excluded(RecoveryGaveUp):  # noqa: N818
    """A round formed without this process (it was silent: frozen, cut off, or late)."""


def _latest_round(store: Any, start: int = 0) -> int:
    r = start
    while store.check([f"aegis/round/{r + 1}/members"]):
        r += 1
    return r


# -- gloo's connections: closed on purpose ---------------------------------------------------------
#
# Measured here (torch 2.13): a gloo group destroyed (or aborted, or shut down) by a process that
# lives on keeps its TCP connections open, so a peer blocked in a collective with it waits for the
# group's timeout. A survivor that saw a failure first would leave the others blocked on it. So
# every process publishes the ports its gloo groups listen on, and a process leaving a round shuts
# down (shutdown(2), both ways) each of its TCP connections to or from such a port: its peers'
# pending receives end at once, as if it had died. Linux only (/proc); elsewhere, the timeout.

_TCP_ESTABLISHED, _TCP_LISTEN = "01", "0A"


def _my_sockets() -> dict[int, int]:
    """inode -> fd of this process's sockets."""
    out = {}
    with contextlib.suppress(OSError):
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                link = os.readlink(f"/proc/self/fd/{fd}")
                if link.startswith("socket:["):
                    out[int(link[8:-1])] = int(fd)
    return out


def _tcp_table() -> list[tuple[int, int, str, int]]:
    """(local port, remote port, state, inode) of every TCP socket in this network namespace."""
    rows = []
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(name) as fh:
            next(fh, None)
            for line in fh:
                f = line.split()
                if len(f) > 9:
                    rows.append((int(f[1].rsplit(":", 1)[1], 16), int(f[2].rsplit(":", 1)[1], 16),
                                 f[3], int(f[9])))
    return rows


def listening_ports() -> list[int]:
    mine = _my_sockets()
    return sorted({lp for lp, _, st, ino in _tcp_table() if st == _TCP_LISTEN and ino in mine})


def _endpoints() -> list[tuple[str, str, str, int]]:
    """(local "ip:port", remote "ip:port", state, inode) of every TCP socket of this namespace,
    addresses as /proc writes them (hex)."""
    rows = []
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(name) as fh:
            next(fh, None)
            for line in fh:
                f = line.split()
                if len(f) > 9:
                    rows.append((f[1], f[2], f[3], int(f[9])))
    return rows


def _split(ep: str) -> tuple[str, int]:
    ip, port = ep.rsplit(":", 1)
    return ip, int(port, 16)


def _any_ip(ip: str) -> bool:
    return set(ip) <= {"0"}


def _fence(store: Any, r: int, uid: str) -> int:
    """Shut down this process's established connections with ``uid``'s sockets of round ``r``
    (its listeners, and the connections it opened, as it published them)."""
    import socket

    key = f"aegis/round/{r}/ports/{uid}"
    try:
        if not store.check([key]):
            return 0
        info = json.loads(store.get(key).decode())
    except Exception:  # noqa: BLE001 - the store away: the group's timeout remains
        return 0
    if not isinstance(info, dict):
        return 0
    listen = [_split(e) for e in info.get("listen_eps", [])]
    local = {_split(e) for e in info.get("local", [])}
    mine = _my_sockets()
    n = 0
    for _lep, rep, st, ino in _endpoints():
        if st != _TCP_ESTABLISHED or ino not in mine:
            continue
        rip, rport = _split(rep)
        if (rip, rport) not in local and not any(
                rport == port and (ip == rip or _any_ip(ip)) for ip, port in listen):
            continue
        with contextlib.suppress(OSError):
            sock = socket.socket(fileno=os.dup(mine[ino]))
            try:
                sock.shutdown(socket.SHUT_RDWR)
                n += 1
            finally:
                sock.close()
    return n


def _shutdown_gloo(ports: set[int]) -> int:
    """Shut down this process's established TCP connections from or to ``ports``."""
    import socket

    mine = _my_sockets()
    n = 0
    for lp, rp, st, ino in _tcp_table():
        if st != _TCP_ESTABLISHED or ino not in mine or (lp not in ports and rp not in ports):
            continue
        with contextlib.suppress(OSError):
            sock = socket.socket(fileno=os.dup(mine[ino]))
            try:
                sock.shutdown(socket.SHUT_RDWR)
                n += 1
            finally:
                sock.close()
    return n


class _Round:
    """The current round, for what runs inside it (the Manager publishes its groups' ports and
    votes on joiners)."""

    store: Any = None
    r: int = -1
    uid: str = ""
    members: list[str] = []
    admitted: int = 0  # join slots admitted into a round so far
    baseline_inodes: frozenset[int] = frozenset()  # sockets the process had before the round
    active: bool = False  # train() of the round runs (not torn down)


def in_round() -> bool:
    return _Round.active


def joiners_registered() -> int:
    """How many processes have registered to join the job (``Manager.save`` votes with it)."""
    if _Round.store is None:
        return 0
    try:
        return int(_Round.store.add("aegis/join/count", 0))
    except Exception:  # noqa: BLE001 - the store away: nobody can join now
        return _Round.admitted


def joiners_waiting(registered: int) -> bool:
    return registered > _Round.admitted


def publish_ports() -> None:
    """Publish this process's sockets opened since the round began (after creating groups; so
    that a server or client of the script's own is never touched): the ports its gloo groups
    listen on (a leaving process shuts its connections to them down) and the local ends of
    the connections it holds (a peer fencing this process off shuts those down)."""
    if _Round.store is None:
        return
    with contextlib.suppress(Exception):
        mine = _my_sockets()
        rows = [(lep, st) for lep, _, st, ino in _endpoints()
                if ino in mine and ino not in _Round.baseline_inodes]
        listen = sorted({lep for lep, st in rows if st == _TCP_LISTEN})
        local = sorted({lep for lep, st in rows if st == _TCP_ESTABLISHED})
        _Round.store.set(f"aegis/round/{_Round.r}/ports/{_Round.uid}", json.dumps({
            "listen": sorted({_split(e)[1] for e in listen}), "listen_eps": listen, "local": local}))


def _round_ports() -> set[int]:
    ports: set[int] = set()
    if _Round.store is None:
        return ports
    for uid in _Round.members:
        key = f"aegis/round/{_Round.r}/ports/{uid}"
        with contextlib.suppress(Exception):
            if _Round.store.check([key]):
                info = json.loads(_Round.store.get(key).decode())
                ports.update(info["listen"] if isinstance(info, dict) else info)
    return ports


# -- the wrapper --------------------------------------------------------------------------------


def _teardown() -> None:
    """After a failed round: abort its Managers (no collectives), shut this process's gloo
    connections down so that no peer stays blocked on it, destroy every process group."""
    with contextlib.suppress(Exception):
        _shutdown_gloo(_round_ports())
    managers = list(_live)
    for m in managers:
        with contextlib.suppress(Exception):
            m.abort(begin=True)
    if dist.is_initialized():
        from torch.distributed.distributed_c10d import _world

        for pg in list(_world.pg_map):  # close the connections now, so peers fail at once
            with contextlib.suppress(Exception):
                pg.abort()
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    for m in managers:
        with contextlib.suppress(Exception):
            m.abort(begin=False)
    _clear_dtensor_caches()
    gc.collect()


def _clear_dtensor_caches() -> None:
    """DTensor's caches keyed by DeviceMesh that are not per thread hold the failed round's
    meshes, and through them its groups: drop them (see :func:`_run_round` for why each round
    runs in a thread of its own)."""
    with contextlib.suppress(Exception):
        from torch.distributed.tensor import DTensor

        sp = DTensor._op_dispatcher.sharding_propagator
        sp.propagate_op_sharding = type(sp.propagate_op_sharding)(sp.propagate_op_sharding_non_cached)
        type(sp)._propagate_tensor_meta_cached.cache_clear()
    with contextlib.suppress(Exception):
        from torch.distributed.tensor._collective_utils import MeshTopoInfo

        MeshTopoInfo.build_from_mesh.cache_clear()



def _run_round(train: Callable[[World], Any], world: World) -> Any:
    """``train(world)`` in a thread of its own, one per round. A DeviceMesh compares equal to an
    earlier round's mesh of the same shape unless it was made in another thread (equality looks
    at the rank map, layout, device type, names and the creating thread, not at the process
    group or this rank's coordinate), and DTensor caches sharding decisions by mesh, per thread.
    Measured here in one thread: a survivor whose rank changed between rounds got tensors on the
    earlier round's mesh, with its old coordinate, and planned its shards at its old rank's
    offsets (DCP: "invalid fill ... chunks-volume"). A thread per round gives each round meshes
    of its own and empty thread-local caches."""
    box: dict[str, Any] = {}

    def run() -> None:
        _active.on = True
        try:
            box["result"] = train(world)
        except BaseException as e:  # noqa: BLE001 - handed to the caller below
            box["error"] = e
        finally:
            _active.on = False

    thread = threading.Thread(target=run, name=f"aegis-round-{world.round}", daemon=True)
    thread.start()
    thread.join()
    error = box.pop("error", None)
    if error is not None:
        try:
            raise error
        finally:
            del error
    return box.get("result")


def _backoff_s(misses: int) -> float:
    """How long a process that missed ``misses`` admitted rounds in a row waits before it
    registers again: none for the first (a frozen process back), then 1, 2, 4 ... 30 s. Every
    registration makes the survivors end a round at their next snapshot; a process too slow to
    make it in (seen in the chaos campaign at a load of 40 on 2 cores: its threads starved past
    ``dead_after_s``) would otherwise cost them a round per step."""
    return 0.0 if misses <= 1 else min(30.0, 2.0 ** (misses - 2))


def _join_running(store: dist.TCPStore, uid: str, hb: _Heartbeat, *, dead_after_s: float,
                  timeout_s: float, misses: int = 0) -> tuple[int, list[str] | None]:
    """A process that starts while the job runs (a replacement node, a worker restarted by its
    launcher) or that a round was formed without (it was frozen or cut off, then came back):
    register, then wait to be admitted. Returns the round to form and its ``previous`` list
    (round -1: the job finished meanwhile).

    * the survivors admit it at their next snapshot (``Manager.save`` votes, every rank raises
      ``Regroup`` after that snapshot committed) by writing ``aegis/join/round/<slot>``;
    * a round that is being formed (the survivors of a failure) is joined directly;
    * when no member of the newest round is alive (its heartbeats stopped: the whole job was
      restarted by its launcher), the processes waiting here form the next round among
      themselves (``WORLD_SIZE`` of them, as in the first round) and restore from the stores.

    ``misses``: admitted rounds this process missed in a row; it registers after
    :func:`_backoff_s` of them, and again after a longer wait each time its slot is admitted
    into a round it misses.
    """
    if not _backoff(store, _backoff_s(misses)):
        return -1, None
    slot = store.add("aegis/join/count", 1)
    store.set(f"aegis/join/slot/{slot}", uid)
    store.set(f"aegis/join/slot_of/{uid}", str(slot))
    key = f"aegis/join/round/{slot}"
    deadline = time.monotonic() + timeout_s
    since = time.monotonic()
    r = _latest_round(store)
    watching: list[str] = []
    while True:
        if store.check([key]):
            plan = json.loads(store.get(key).decode())
            return int(plan["round"]), list(plan["previous"])
        r = _latest_round(store, r)
        members = json.loads(store.get(f"aegis/round/{r}/members").decode())["members"]
        others = [u for u in members if u != uid]
        if others != watching:
            hb.watch(others)
            watching, since = others, time.monotonic()
        if store.check([f"aegis/round/{r}/done"]):
            return -1, None  # the job finished while this process waited
        if store.add(f"aegis/round/{r + 1}/count", 0) > 0:  # survivors are forming a round
            return r + 1, members
        if int(store.add("aegis/admitted", 0)) >= slot and not store.check([key]):
            # its slot was admitted into a round it missed: a new slot, after a while
            misses += 1
            if not _backoff(store, _backoff_s(misses)):
                return -1, None
            slot = store.add("aegis/join/count", 1)
            store.set(f"aegis/join/slot/{slot}", uid)
            store.set(f"aegis/join/slot_of/{uid}", str(slot))
            key = f"aegis/join/round/{slot}"
        if time.monotonic() - since > dead_after_s and all(
                hb.silent_for(u) >= dead_after_s for u in others):
            return r + 1, None  # nobody of the newest round is alive: a restarted job
        if time.monotonic() > deadline:
            raise RecoveryGaveUp(f"registered to join the running job (slot {slot}) but was not "
                                 f"admitted within {timeout_s:.0f} s: the job saves no snapshot, "
                                 "or has ended")
        time.sleep(0.02)


def _backoff(store: dist.TCPStore, wait_s: float) -> bool:
    """Sleep ``wait_s`` unless the job finishes meanwhile (then False)."""
    until = time.monotonic() + wait_s
    while time.monotonic() < until:
        if store.check([f"aegis/round/{_latest_round(store)}/done"]):
            return False
        time.sleep(min(0.2, max(0.0, until - time.monotonic())))
    return True


def _emit_recovery(w: World) -> None:
    """One ``recovery`` event per rank and round in ``$AEGIS_EVENTS_DIR`` (beside the Manager's
    events), with the phases so far: teardown, agree, regroup; the Manager's ``start`` and
    ``restore`` events that follow time the rebuild and the restore."""
    root = os.environ.get("AEGIS_EVENTS_DIR")
    if not root:
        return
    with contextlib.suppress(OSError):
        os.makedirs(root, exist_ok=True)
        with open(os.path.join(root, f"rank-{w.rank:05d}.jsonl"), "a") as fh:
            fh.write(json.dumps({"time": time.time(), "event": "recovery", "rank": w.rank,
                                 "round": w.round, "world_size": w.size, "node": w.node,
                                 "failed_at": w.failed_at, "cause": w.cause,
                                 "timings": w.timings}) + "\n")


def run_in_process(
    train: Callable[[World], Any],
    *,
    min_world: int = 1,
    max_restarts: int = 100,
    heartbeat_s: float = 0.2,
    dead_after_s: float = 1.0,
    collective_timeout: timedelta = timedelta(seconds=30),
    form_timeout: timedelta = timedelta(minutes=2),
    backend: str = "gloo",
    on_round: Callable[[World], None] | None = None,
) -> Any:
    """Run ``train(world)`` on every process of the job, and again on the survivors, in the same
    processes, whenever a peer is lost. Returns what the last call of ``train`` returned.

    Every process of the job calls it once, instead of ``init_process_group``; ``train`` must
    build everything that is bound to the process group (device mesh, FSDP model, optimizer,
    the aegis ``Manager``) itself. ``WORLD_SIZE`` (torchrun's) is the size of the first round;
    later rounds have the survivors (at least ``min_world``). A peer counts as dead once its
    heartbeat has not moved for ``dead_after_s``; a collective waiting on a stopped peer ends
    after ``collective_timeout`` (gloo cannot abandon it sooner).
    """
    if min_world < 1 or dead_after_s <= heartbeat_s:
        raise ConfigError(f"run_in_process(min_world={min_world}, heartbeat_s={heartbeat_s}, "
                          f"dead_after_s={dead_after_s}): need min_world >= 1 and dead_after_s > "
                          "heartbeat_s")
    if dist.is_initialized():
        raise ConfigError("run_in_process() creates the process groups itself: call it instead of "
                          "init_process_group(), not after it")
    node = node_id()
    local = os.environ.get("LOCAL_RANK", "0")
    uid = f"{node}/{local}/{os.getpid()}"
    store = _store_from_env(form_timeout)
    hb = _Heartbeat(uid, heartbeat_s, form_timeout, fence_after_s=dead_after_s)
    membership = _Membership(store, uid, hb, dead_after_s=dead_after_s,
                             form_timeout_s=form_timeout.total_seconds(), min_world=min_world)
    first = int(os.environ.get("WORLD_SIZE", "1"))
    r = 0
    previous: list[str] | None = None
    restarts = 0
    misses = 0  # rounds formed without this process in a row (see _backoff_s)
    timings: dict[str, float] = {}
    failed_at: float | None = None
    cause: str | None = None
    join = store.check(["aegis/round/0/members"])  # the job runs already: join it
    try:
        while True:
            t0 = time.perf_counter()
            if join:
                r, previous = _join_running(store, uid, hb, dead_after_s=dead_after_s,
                                            timeout_s=form_timeout.total_seconds(), misses=misses)
                join = False
                if r < 0:
                    return None
            try:
                members, admitted = membership.form(r, previous, first)
            except _Excluded as e:
                join = True  # left out while silent: register and come back at a snapshot
                misses += 1
                cause = str(e)
                continue
            misses = 0
            t1 = time.perf_counter()
            rank = members.index(uid)
            hb.watch([u for u in members if u != uid])
            _Round.store, _Round.r, _Round.uid, _Round.members = store, r, uid, members
            _Round.admitted = admitted
            _Round.baseline_inodes = frozenset(_my_sockets())
            dist.init_process_group(backend, store=dist.PrefixStore(f"aegis/round/{r}/pg", store),
                                    rank=rank, world_size=len(members), timeout=collective_timeout)
            t2 = time.perf_counter()
            if restarts:
                timings.update(agree_s=t1 - t0, regroup_s=t2 - t1)
            world = World(rank=rank, size=len(members), round=r, node=node, members=members,
                          restarts=restarts, timings=dict(timings), failed_at=failed_at,
                          cause=cause)
            if restarts:
                _emit_recovery(world)
            publish_ports()  # the default group's sockets
            if on_round is not None:
                on_round(world)
            _Round.active = True
            try:
                result = _run_round(train, world)
                with contextlib.suppress(Exception):  # a process still waiting to join: go home
                    store.set(f"aegis/round/{r}/done", "1")
                return result
            except Regroup as e:  # every rank, after the same committed snapshot
                registered = e.registered
                failed_at = None
                cause = f"regroup: {e}"
            except BaseException as e:
                if not is_peer_failure(e) or restarts >= max_restarts:
                    raise
                failed_at = time.time()
                registered = 0
                cause = f"{type(e).__name__}: {e}"[:500]
            finally:
                _Round.active = False
            # Out of the except block: the exception and its frames (holding the round's model,
            # mesh and groups) are released, so destroying the groups really closes them.
            del world
            td = time.perf_counter()
            _teardown()
            timings = {"teardown_s": time.perf_counter() - td}
            previous = members
            restarts += 1
            r += 1
            if registered > admitted:  # grow: admit the processes that registered
                joiners = [store.get(f"aegis/join/slot/{i}").decode()
                           for i in range(admitted + 1, registered + 1)]
                joiners = [u for k, u in enumerate(joiners) if u not in previous and u not in joiners[:k]]
                for i in range(admitted + 1, registered + 1):
                    store.set(f"aegis/join/round/{i}", json.dumps(
                        {"round": r, "previous": previous + joiners}))
                store.set("aegis/admitted", str(registered))
                previous = previous + joiners
                hb.watch([u for u in previous if u != uid])
    finally:
        hb.stop()
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
