"""The heartbeat half of membership (:mod:`.membership` is the round protocol): each process's
counter in the store, bumped from a thread with its own client; the ring of the round's members
interleaved by node that says whom each process watches; the death log it reads and appends to;
and a store client that counts requests (the scale benchmark and the tests measure load with it).

Store load, against the world size W: per process per beat 2 requests (``add`` on its own
counter, one ``multi_get`` of the ``watchers`` counters it watches and the death log), O(1)
bytes but for the log; the ring is O(W) once per round and process (cached).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from aegis.training.inprocess.relay import NodeRelay
from aegis.training.inprocess.storeclient import StoreRestarted

__all__ = ["Heartbeat", "CountingStore", "REQUESTS", "ring", "successors", "BLIND_GRACE_S",
           "BLIND_BEAT_S", "CREATING_SILENT_S"]

# after the store was away, how much longer than dead_after_s a watched member has to beat again
BLIND_GRACE_S = 2.0
# a beat that took this long (or 2 x dead_after_s) hung on the store. Not less: under load a
# beat waits for the GIL for most of a second (the chaos campaign on 2 cores), and a bound of
# 0.6 s took every slow beat for an outage, so the silence of a SIGKILLed node restarted at
# every beat and its watchers never declared it (a round formed 54 s after the loss)
BLIND_BEAT_S = 2.0
# A member of a round whose groups are being created is declared after this long silent at
# least (2 x dead_after_s when that is longer): the group's rendezvous waits on the store for
# every member's address, and a member lost then held the others until create_timeout (10 s;
# issue 25). Longer than dead_after_s because the members' heartbeats compete with the
# creation for the CPU, and a declaration stays for the round.
CREATING_SILENT_S = 2.0


def _hb(uid: str) -> str:
    return f"aegis/hb/{uid}"


def _rk(r: int, name: str) -> str:
    return f"aegis/round/{r}/{name}"


def _node(uid: str) -> str:
    """``"<node>/<local rank>/<pid>"`` -> ``"<node>"`` (a uid of another shape is its own node)."""
    parts = uid.rsplit("/", 2)
    return parts[0] if len(parts) == 3 else uid


def ring(members: list[str]) -> list[str]:
    """The round's members on a ring interleaved by node: the first process of every node, then
    the second of every node, ... Neighbours on it are on different nodes whenever the round
    spans more than one, so the processes of a lost node are watched from other nodes (with
    processes of a node next to each other, a lost node would take the watchers of most of its
    processes with it)."""
    return list(_ring(tuple(members))[0])


@functools.lru_cache(maxsize=4)
def _ring(members: tuple[str, ...]) -> tuple[tuple[str, ...], dict[str, int]]:
    """:func:`ring` and each member's position on it; O(world), once per round and process (a
    benchmark running many members in one process computes it once for all of them)."""
    by_node: dict[str, list[str]] = {}
    for u in members:
        by_node.setdefault(_node(u), []).append(u)
    groups = list(by_node.values())
    depth = max((len(g) for g in groups), default=0)
    order = tuple(g[i] for i in range(depth) for g in groups if i < len(g))
    return order, {u: i for i, u in enumerate(order)}


def successors(members: list[str], uid: str, k: int) -> list[str]:
    """The ``k`` members after ``uid`` on :func:`ring` (``uid`` inserted if it is not a member):
    whom ``uid`` watches. Each member is watched by its ``k`` predecessors."""
    order, pos = _ring(tuple(members))
    if uid not in pos:
        order, pos = _ring((*members, uid))
    i = pos[uid]
    n = len(order)
    return [order[(i + j) % n] for j in range(1, min(k, n - 1) + 1)]


REQUESTS = frozenset({"add", "get", "set", "check", "compare_set", "multi_get", "multi_set",
                      "append", "wait", "delete_key", "num_keys", "queue_push", "queue_pop",
                      "queue_len", "list_keys"})


class CountingStore:
    """A store client that counts the requests sent through it, by method (the scale benchmark
    and the tests measure store load with it); every call is passed on unchanged."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.counts: dict[str, int] = {}
        self._lock = threading.Lock()

    @property
    def requests(self) -> int:
        with self._lock:
            return sum(self.counts.values())

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.store, name)
        if name not in REQUESTS:
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                self.counts[name] = self.counts.get(name, 0) + 1
            return attr(*args, **kwargs)

        setattr(self, name, call)  # found directly from now on
        return call


class Heartbeat:
    """A counter in the store, bumped every ``interval_s`` from a thread with its own client;
    the same thread watches a few members and reads the followed round's death log.

    Who calls what: the round loop calls :meth:`follow` with each round it enters (the ring and
    the log of that round; during the next formation it keeps following the round that ended,
    whose log names the dead); :meth:`Membership.form` and :meth:`Membership.join` call
    :meth:`watch` for members they must judge themselves (a proposer: the previous round's
    members that have not joined; a joiner: a sample of the running round). Each beat (``tick``)
    is 2 requests whatever the world size: ``add`` on its own counter, then one ``multi_get`` of
    the watched counters and the death log.

    A watched member whose counter has not moved for ``dead_after_s`` (as this thread saw it)
    and that is one of its ring successors is declared dead in the log; every process that reads
    a member of its running round (``fenceable``) in the log hands it to ``fence`` (the round's
    ``Abandon``), so the detector's finding reaches every process that holds connections to
    the dead member (or waits for its address while the round's groups are created,
    ``creating``: then after ``CREATING_SILENT_S`` silent at least) within one more interval:
    detection within ``dead_after_s`` + 2 intervals of the last beat (the thread looks once more
    when a successor it saw unmoved reaches ``dead_after_s``, see :meth:`_run`). Nothing is declared or
    fenced in a beat whose store requests failed: a process that cannot reach the store (it is
    the one cut off) fences nobody."""

    def __init__(self, uid: str, interval_s: float, timeout: timedelta, *,
                 dead_after_s: float | None = None,
                 fence: Callable[[str], int] | None = None,
                 fenceable: Callable[[str], bool] | None = None,
                 watchers: int = 2, store: Any = None, start: bool = True,
                 on_restart: Callable[[Any], None] | None = None,
                 also: tuple[str, ...] = (),
                 creating: Callable[[], bool] | None = None,
                 relay: NodeRelay | None = None) -> None:
        self.uid = uid
        # the node's relay (issue 40): beats through it while it answers, else directly
        self._relay = relay
        self._count = 0  # this process's beats posted to the relay
        self.relayed_ticks = 0
        self.key = _hb(uid)
        self.interval_s = interval_s
        self.dead_after_s = dead_after_s
        self.watchers = watchers
        self._fence = fence  # cuts this process off a dead member (the round's Abandon)
        self._fenceable = fenceable  # is the member part of a running round?
        self._creating = creating  # is that round still creating its groups?
        if store is None:
            from aegis.training.inprocess.membership import store_from_env

            store = store_from_env(timeout)
        self._store: Any = store
        # the counter exists before any process can be told to watch it (a multi_get of an
        # absent key would wait for the client's timeout)
        self._store.add(self.key, 1)
        self._stop = threading.Event()
        self._wake = threading.Event()  # stop() or poke(): the thread looks now
        self._lock = threading.Lock()
        self._epoch = 0  # bumped when the followed round changes: a beat's log reading is dropped
        self._ring: list[str] = []  # successors on the followed round's ring: declared here
        self._extra: list[str] = []  # watched for this process's own decisions (watch())
        self._targets: list[str] = []  # ring + extra, once each
        self._keys: list[str] = []  # their counters' keys
        self._log: str | None = None  # the followed round's death log
        self._forming = False  # the followed round has ended: its log serves the next round's
        self._present: set[str] = set()  # keys known to exist (keys are never deleted)
        # uid -> (counter, when it last moved, when this process last looked at it)
        self._seen: dict[str, tuple[int, float, float]] = {}
        self._declared: dict[str, float] = {}  # the log's uids, in order -> when read here
        self._fenced: set[str] = set()
        self.fences: list[tuple[str, float, int]] = []  # (uid, silent s here, connections shut)
        self.declarations: list[tuple[str, float, float]] = []  # (uid, silent s, time.time())
        self.ticks = 0
        self.failed_ticks = 0
        # the store restarted empty (a StoreClient found its epoch gone): re-seed what this
        # process knows through this thread's client (storeclient.reseed)
        self._on_restart = on_restart
        self.store_restarts = 0
        self._blind = False  # a beat failed since the last successful look (the store away)
        # counters read in the same multi_get at every beat (created at 0 if missing), their
        # last values in readings: run_in_process reads the join counter this way, so that the
        # joiners vote in save() makes no store request of its own
        self._also = tuple(also)
        self.readings: dict[str, int] = {}
        self._thread: threading.Thread | None = None
        if start:
            self._thread = threading.Thread(target=self._run, name="aegis-heartbeat", daemon=True)
            self._thread.start()

    # -- what to watch ------------------------------------------------------------------------

    def _rewatch(self, ring_: list[str], extra: list[str]) -> None:
        """Caller holds the lock. A member not watched before counts as just seen: until this
        thread reads its counter, the last reading (if any) is from before it was left out (a
        frozen process that came back would look silent for as long as it was away, and a
        round would form without it; seen in CI under load). It is dead only once its counter
        has not moved for ``dead_after_s`` from now. Members no longer watched are forgotten."""
        now = time.monotonic()
        before = set(self._ring) | set(self._extra)
        after = set(ring_) | set(extra)
        for u in after - before:
            self._seen[u] = (-1, now, now)  # no counter reads -1: the first read moves it
        for u in before - after:
            self._seen.pop(u, None)
        self._ring, self._extra = ring_, extra
        self._targets = list(dict.fromkeys(ring_ + extra))
        self._keys = [_hb(u) for u in self._targets]

    def follow(self, members: list[str], r: int | None, *, forming: bool = False) -> None:
        """This process enters round ``r`` of ``members`` (``forming``: it forms the next round
        from round ``r``, which has ended): watch its ring successors there and read round
        ``r``'s death log. ``r=None``: neither (a process waiting to join). Starting on another
        log forgets what was fenced.

        While a round runs, a silent successor is declared only by a watcher that runs the round
        itself (``fenceable``), as each process fenced on its own before issue 24: a watcher
        still starting the round must not declare a member whose start held its heartbeat back
        (``gc.collect()`` holding the GIL for a second under load), for a declaration stays for
        the whole round. Once the round has ended (:meth:`round_ended`, or ``forming``), every
        watcher declares: the next round's proposer waits for the dead to be named."""
        ring_ = successors(members, self.uid, self.watchers) if members and r is not None else []
        with self._lock:
            self._rewatch(ring_, [])
            self._epoch += 1
            self._forming = forming
            log = None if r is None else _rk(r, "dead")
            if log != self._log:
                self._log = log
                self._declared = {}
                self._fenced = set()

    def round_ended(self) -> None:
        """The followed round has ended (failed, or regrouping): its log now serves the next
        round's formation, and every watcher declares its silent successors."""
        with self._lock:
            self._forming = True

    def watch(self, uids: list[str]) -> None:
        """Also watch ``uids`` from now on (instead of the ones given before), for this
        process's own judgement (:meth:`silent_for`); they are never declared from here."""
        extra = [u for u in dict.fromkeys(uids) if u != self.uid]
        with self._lock:
            if extra != self._extra:  # a beat in flight keeps its readings (applied to whoever
                self._rewatch(self._ring, extra)  # is still watched when it ends)

    def watched(self) -> list[str]:
        with self._lock:
            return list(dict.fromkeys(self._ring + self._extra))

    def silent_for(self, uid: str) -> float:
        """For how long ``uid``'s counter had not moved when this process last looked at it; 0
        if not watched. Not the time since it last moved: an observer that has not looked for a
        while (its thread starved, its store reads failing) must not take a member for silent
        because of its own absence (a proposer starved on a loaded machine left 2,395 beating
        members out of a round that way)."""
        with self._lock:
            seen = self._seen.get(uid)
        return 0.0 if seen is None else max(0.0, seen[2] - seen[1])

    def count(self, uid: str) -> tuple[int | None, float]:
        """``uid``'s counter as this process last read it (None: not watched, or no counter
        read yet) and when it last looked (``time.monotonic()``; -inf if not watched)."""
        with self._lock:
            seen = self._seen.get(uid)
        if seen is None:
            return None, float("-inf")
        return (None if seen[0] < 0 else seen[0]), seen[2]

    def declared(self, store: Any = None) -> set[str]:
        """Members the followed round's death log names (read at the last beat, or declared
        here); with ``store``, read the log now through that client (1 request: the proposer
        of a round, so that it does not wait for its next beat)."""
        with self._lock:
            log = self._log
            out = set(self._declared)
        if store is not None and log is not None and log in self._present:
            with contextlib.suppress(Exception):
                out.update(u for u in store.get(log).decode().splitlines() if u)
        return out

    # -- the node's relay ---------------------------------------------------------------------

    def _relayed(self, targets: list[str], keys: list[str], log: str | None
                 ) -> tuple[list[str], list[str], list[str], list[Any], float] | None:
        """This beat through the node's relay (:mod:`.relay`): post the counter and the keys,
        relay for the node when this process holds the lock, take the values from the relay's
        output. Returns (members read, their keys, the ``also`` keys, the values of those, the
        ``also`` counters and the log, when the relay read them), or None when the relay's
        output is stale, failed or has not seen this process's recent beats: then this beat
        goes to the store directly."""
        relay = self._relay
        assert relay is not None
        if self._suspect():
            # a successor already silent for nearly dead_after_s: look at it directly, not at
            # the relay's reading of up to a beat ago (a direct beat; rare: only while a member
            # is silent, so the steady state stays relayed)
            return None
        self._count += 1
        also = list(self._also)
        try:
            relay.post(self._count, keys, also, log)
            if relay.lead():
                self._relay_batch(relay)
            out = relay.result()
        except OSError:  # e.g. a full tmpfs
            return None
        if out is None or int(out.get("seen", {}).get(self.uid, -1)) < self._count - 2:
            return None
        vals: dict[str, str | None] = out.get("values", {})
        # every key this process reads must have been looked up by the relay (a value, or None:
        # no such counter), else it would take a member it watches for one that never beat
        if any(k not in vals for k in keys) or any(vals.get(a) is None for a in also) or (
                log is not None and vals.get(log) is None):
            return None
        read = [u for u, k in zip(targets, keys, strict=True) if vals[k] is not None]
        values: list[Any] = [str(vals[_hb(u)]).encode() for u in read]
        values += [str(vals[a]).encode() for a in also]
        if log is not None:
            values.append(str(vals[log]).encode())
        self.relayed_ticks += 1
        return read, [_hb(u) for u in read], also, values, float(out["t"])

    def _suspect(self) -> bool:
        """A ring successor of the followed round has not moved for ``dead_after_s`` less two
        beats (as this process last looked)."""
        if self.dead_after_s is None:
            return False
        with self._lock:
            if self._log is None:
                return False
            near = self.dead_after_s - 2 * self.interval_s
            return any(u in self._seen and u not in self._declared
                       and self._seen[u][2] - self._seen[u][1] >= near for u in self._ring)

    def _ensure(self, keys: list[str], also: list[str], logs: list[str]) -> None:
        """Make sure what a beat reads exists or is known not to (a ``multi_get`` of a missing
        key would wait for the client's timeout): each log created once per round (``append``
        of nothing), each newly watched counter checked once (a member that never beat has
        none), each ``also`` counter seeded at 0 once (and again after a store restart)."""
        for lg in logs:
            if lg not in self._present:
                self._store.append(lg, b"")
                self._present.add(lg)
        new = [k for k in keys if k not in self._present]
        if new:
            if self._store.check(new):
                self._present.update(new)
            else:
                self._present.update(k for k in new if self._store.check([k]))
        for a in also:
            if a not in self._present:
                self._store.add(a, 0)
                self._present.add(a)

    def _restarted(self) -> None:
        """The store lost its keys: none of them is known to exist any more; what this process
        knows of its round is written back (``on_restart``), the next beat goes on, and its
        first look counts as blind."""
        self.store_restarts += 1
        self._blind = True
        with self._lock:
            self._present = set()
        if self._on_restart is not None:
            with contextlib.suppress(Exception):
                self._on_restart(self._store)

    def _relay_batch(self, relay: NodeRelay) -> None:
        """The relay's beat for the node: every fresh post's counter written with one
        ``multi_set``, the union of the keys they read with one ``multi_get`` (new keys checked
        first, logs created and ``also`` counters seeded once, as a direct beat does), the
        values written for the node's processes; a failure is written too (they beat directly)."""
        posts = relay.posts()
        out: dict[str, Any] = {"t": time.monotonic(), "ok": False}
        try:
            if posts:
                self._store.multi_set([_hb(str(p["uid"])) for p in posts],
                                      [str(int(p["counter"])) for p in posts])
            keys = list(dict.fromkeys(str(k) for p in posts for k in p.get("keys", [])))
            also = list(dict.fromkeys(str(a) for p in posts for a in p.get("also", [])))
            logs = list(dict.fromkeys(str(p["log"]) for p in posts if p.get("log")))
            self._ensure(keys, also, logs)
            read = [k for k in keys if k in self._present] + also + logs
            got = self._store.multi_get(read) if read else []
            values: dict[str, str | None] = {k: None for k in keys}  # looked up, no counter
            values.update((k, v.decode("utf-8", "replace")) for k, v in zip(read, got, strict=True))
            out = {"t": time.monotonic(), "ok": True,
                   "seen": {str(p["uid"]): int(p["counter"]) for p in posts}, "values": values}
        except StoreRestarted:
            # as a direct beat does; the node's other processes beat directly on the failed
            # output, and their own clients find the restart and re-seed
            self._restarted()
        except Exception:  # noqa: BLE001 - written as failed: the node's processes beat directly
            pass
        relay.publish(out)

    # -- one beat -----------------------------------------------------------------------------

    def tick(self) -> bool:
        """One beat (the thread calls it every ``interval_s``; a benchmark may drive many
        heartbeats from one thread). Returns False if the store could not be reached."""
        with self._lock:  # the lists are replaced, never changed in place
            epoch, ring_, log, targets, keys = (self._epoch, self._ring, self._log, self._targets,
                                                self._keys)
        began = time.monotonic()
        via = self._relayed(targets, keys, log) if self._relay is not None else None
        looked: float | None = None
        if via is not None:  # the node's relay read them this beat or the one before
            read, rkeys, also, values, looked = via
        else:
            try:
                self._store.add(self.key, 1)
                also = list(self._also)
                tail = [log] if log else []
                self._ensure(keys, also, tail)
                if all(k in self._present for k in keys):
                    read, rkeys = targets, keys
                else:  # a member that never beat: not read (silent since it was watched)
                    read = [u for u, k in zip(targets, keys, strict=True) if k in self._present]
                    rkeys = [_hb(u) for u in read]
                values = self._store.multi_get(rkeys + also + tail) if rkeys or also or tail else []
            except StoreRestarted:
                self.failed_ticks += 1
                self._restarted()
                return False
            except Exception:  # noqa: BLE001 - a store hiccup is seen by the peers, not here
                self.failed_ticks += 1
                self._blind = True
                return False
        now = time.monotonic() if looked is None else looked
        # A look after the store was away (this thread's requests failed, or this beat's hung
        # on a store that stopped answering: BLIND_BEAT_S) proves nothing about the time in between: the
        # watched members could not beat either. Every one counts as just seen, dead only
        # after dead_after_s of looks from now (else every member would look silent for the
        # whole outage when the store comes back), with BLIND_GRACE_S more: the members do
        # not reconnect at the same moment (a c10d client retries a refused connect with a
        # backoff of about a second). An observer that merely did not run (its
        # host starved, the store fine) keeps its readings: a member unmoved between two of
        # its looks is silent.
        blind = self._blind or now - began > max(BLIND_BEAT_S, 2 * (self.dead_after_s or 0.0))
        self._blind = False
        with self._lock:
            for k, v in zip(also, values[len(rkeys):len(rkeys) + len(also)], strict=True):
                self.readings[k] = int(v)
            for u, v in zip(read, values, strict=False):
                last = self._seen.get(u)
                if last is not None:  # (None: no longer watched)
                    if last[0] != int(v):
                        self._seen[u] = (int(v), now, now)
                    elif blind:
                        self._seen[u] = (int(v), now + BLIND_GRACE_S, now)
                    else:
                        self._seen[u] = (*last[:2], now)
            if blind:
                # a member without a counter now (the store restarted empty and it has not
                # beaten since) counts as just seen too, not as silent since its last beat
                # before the outage: a watcher whose client reconnected first declared every
                # member that had not yet (the chaos campaign: 3 live members declared dead at
                # once after a store restart, a 12 s formation)
                seen = set(read)
                for u in targets:
                    last = self._seen.get(u)
                    if last is not None and (last[0] == -1 or u not in seen):
                        self._seen[u] = (-1, now + BLIND_GRACE_S, now)
            for u in targets:  # looked at, found no counter: that is a look too
                last = self._seen.get(u)
                if last is not None and last[2] < now and last[0] == -1:
                    self._seen[u] = (-1, last[1], now)
            if epoch != self._epoch:
                return True  # another round followed meanwhile: this log is not its log
            if log is not None:
                for line in values[-1].decode().splitlines():
                    if line and line not in self._declared:
                        self._declared[line] = now
            dead_after = self.dead_after_s
            forming = self._forming
            silent = [] if dead_after is None or log is None else [
                (u, now - self._seen[u][1]) for u in ring_ if u not in self._declared
                and u in self._seen and now - self._seen[u][1] >= dead_after]
        if not forming and self._fenceable is not None:
            floor = 0.0  # a round creating its groups: see CREATING_SILENT_S
            if self._creating is not None and self._creating():
                floor = max(CREATING_SILENT_S, 2 * (dead_after or 0.0))
            silent = [(u, s) for u, s in silent if s >= floor and self._fenceable(u)]
        for u, s in silent:
            assert log is not None
            try:
                self._store.append(log, f"{u}\n")
            except Exception:  # noqa: BLE001 - not declared: the next beat tries again
                self.failed_ticks += 1
                return False
            with self._lock:
                if self._log == log:
                    self._declared.setdefault(u, now)
            self.declarations.append((u, s, time.time()))
        self._fence_declared(log)
        self.ticks += 1
        return True

    def _fence_declared(self, log: str | None) -> None:
        """A member of the running round declared dead (frozen, cut off, or its machine gone
        without closing its sockets) is fenced off through the ``fence`` callback (the round's
        :class:`~.abandon.Abandon`: gloo shuts its connections with it down, NCCL aborts the
        communicators), so that a collective waiting on it fails now instead of at the group's
        timeout. The member is left out of the next round; if it comes back, it registers and
        rejoins at a snapshot. This process itself declared dead (read when it wakes up or its
        link comes back) is fenced too: off its whole round, whose collectives cannot finish
        (found by a chaos campaign: a frozen worker, thawed, stayed blocked for good in an
        all-gather waiting on its own node's other worker, which had left the round without
        closing that connection)."""
        if self._fence is None or self._fenceable is None or log is None:
            return
        with self._lock:
            if self._log != log:
                return
            todo = [u for u in self._declared if u not in self._fenced]
        for uid in todo:
            if not self._fenceable(uid):
                continue
            with self._lock:
                if self._log != log or uid in self._fenced:
                    continue
                self._fenced.add(uid)
            try:
                n = self._fence(uid)
            except Exception:  # noqa: BLE001 - its sockets unknown (the store away): next beat
                with self._lock:
                    self._fenced.discard(uid)
                continue
            self.fences.append((uid, self.silent_for(uid), n))

    def _deadline(self) -> float | None:
        """When (``time.monotonic()``) the first ring successor that looked unmoved at this
        thread's last look reaches ``dead_after_s`` of silence; None if none does."""
        if self.dead_after_s is None:
            return None
        with self._lock:
            if self._log is None:
                return None
            return min((self._seen[u][1] + self.dead_after_s for u in self._ring
                        if u in self._seen and u not in self._declared
                        and self._seen[u][2] > self._seen[u][1]), default=None)

    def _run(self) -> None:
        """A beat every ``interval_s``, and one more look at the moment a silent successor
        reaches ``dead_after_s``: its declaration comes then, not up to a beat later (the
        chaos campaign's freezes: a tenth of a second on average, the whole round waiting on
        it). The extra look is taken only for a member already silent for ``dead_after_s``
        less a beat: none while every member beats."""
        due = time.monotonic()
        while not self._stop.is_set():
            self._wake.clear()  # (a poke during this look: the wait below returns at once)
            self.tick()
            now = time.monotonic()
            if now >= due - 1e-3:  # the regular beat (not an extra look): the next one
                due += self.interval_s
            if due < now - self.interval_s:  # starved: no burst of beats to catch up
                due = now
            wake = due
            deadline = self._deadline()
            if deadline is not None and now < deadline < due:
                wake = deadline + 1e-3
            self._wake.wait(max(0.0, wake - now))

    def poke(self) -> None:
        """Look now, not at the next beat (the liveness service says a process died: its
        name is in the round's death log, and the thread fences it off at this look)."""
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._relay is not None:
            self._relay.close()
