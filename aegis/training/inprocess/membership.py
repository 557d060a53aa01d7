"""Membership: who is in the job, agreed through one c10d ``TCPStore`` (the job's rendezvous
store, ``AEGIS_MEMBERSHIP=host:port``), apart from any training.

* Every process beats a heartbeat counter (``aegis/hb/<uid>``) from a thread with its own store
  client, and watches the counters of the members it cares about (:class:`Heartbeat`); one
  whose counter has not moved for ``dead_after_s`` is dead. The same thread hands a silent
  member of a running round to a fence callback (the round's ``Abandon``).
* A *round* is one membership (:class:`Membership.form`): each live process takes a slot, and
  the first proposal written with ``compare_set`` is the round's member list, which every
  process adopts; the store is the single point of agreement. A proposal waits for every member
  of the previous round whose heartbeat still moves.
* A process that starts while the job runs, or that a round was formed without, registers and
  waits to be admitted at the survivors' next snapshot (:func:`join_running`).

Store keys (all under ``aegis/``): ``hb/<uid>``; ``round/<r>/count``, ``round/<r>/slot/<i>``,
``round/<r>/members`` (``{"members", "admitted"}``), ``round/<r>/done``, ``round/<r>/ports/<uid>``
(gloo fencing); ``join/count``, ``join/slot/<i>``, ``join/slot_of/<uid>``, ``join/round/<i>``,
``admitted``.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from aegis.errors import ConfigError
from aegis.training.inprocess.round import RecoveryGaveUp

__all__ = ["ENV_STORE", "store_from_env", "Heartbeat", "Membership", "Excluded", "latest_round",
           "join_running", "backoff_s", "backoff"]

ENV_STORE = "AEGIS_MEMBERSHIP"


def store_from_env(timeout: timedelta) -> dist.TCPStore:
    addr = os.environ.get(ENV_STORE)
    if not addr or ":" not in addr:
        raise ConfigError(
            f"{ENV_STORE}=host:port must name a c10d TCPStore that no training node owns (the "
            "job's rendezvous store; aegis.sim starts one): in-process recovery agrees on "
            "membership through it"
        )
    host, port = addr.rsplit(":", 1)
    return dist.TCPStore(host, int(port), is_master=False, timeout=timeout, wait_for_workers=False)


class Heartbeat:
    """A counter in the store, bumped every ``interval_s`` from a thread with its own client;
    the same thread watches the counters of the current round's members, so that when a round
    fails, how long each peer has been silent is already known (a peer that stopped with the
    failure is declared dead ``dead_after_s`` after it stopped, not after the failure was seen).
    Every process reads every member's counter: O(world) reads per process per interval, fine
    for the simulated cluster; at scale, per-node heartbeats are the next step."""

    def __init__(self, uid: str, interval_s: float, timeout: timedelta, *,
                 fence_after_s: float | None = None,
                 fence: Callable[[str], int] | None = None,
                 fenceable: Callable[[str], bool] | None = None) -> None:
        self.key = f"aegis/hb/{uid}"
        self.interval_s = interval_s
        self.fence_after_s = fence_after_s
        self._fence = fence  # cuts this process off a silent member (the round's Abandon)
        self._fenceable = fenceable  # is the member part of a running round?
        self._store = store_from_env(timeout)
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
        machine gone without closing its sockets) is fenced off through the ``fence`` callback
        (the round's :class:`~.abandon.Abandon`: gloo shuts its connections with it down, NCCL
        aborts the communicators), so that a collective waiting on it fails now instead of at
        the group's timeout. The member is left out of the next round; if it comes back, it
        registers and rejoins at a snapshot."""
        assert self.fence_after_s is not None
        for uid in watch:
            if uid in self._fenced or self._fenceable is None or not self._fenceable(uid):
                continue
            silent = self.silent_for(uid)
            if silent < self.fence_after_s:
                continue
            self._fenced.add(uid)
            n = self._fence(uid) if self._fence is not None else 0
            self.fences.append((uid, silent, n))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


class Membership:
    """Rounds of membership agreed through one TCPStore (see the module docstring)."""

    def __init__(self, store: dist.TCPStore, uid: str, hb: Heartbeat, *, dead_after_s: float,
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
            raise Excluded(f"round {r} was formed without this process ({self.uid})")
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


class Excluded(RecoveryGaveUp):  # noqa: N818
    """A round formed without this process (it was silent: frozen, cut off, or late)."""


def latest_round(store: Any, start: int = 0) -> int:
    r = start
    while store.check([f"aegis/round/{r + 1}/members"]):
        r += 1
    return r


def backoff_s(misses: int) -> float:
    """How long a process that missed ``misses`` admitted rounds in a row waits before it
    registers again: none for the first (a frozen process back), then 1, 2, 4 ... 30 s. Every
    registration makes the survivors end a round at their next snapshot; a process too slow to
    make it in (seen in the chaos campaign at a load of 40 on 2 cores: its threads starved past
    ``dead_after_s``) would otherwise cost them a round per step."""
    return 0.0 if misses <= 1 else min(30.0, 2.0 ** (misses - 2))


def join_running(store: dist.TCPStore, uid: str, hb: Heartbeat, *, dead_after_s: float,
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
    :func:`backoff_s` of them, and again after a longer wait each time its slot is admitted
    into a round it misses.
    """
    if not backoff(store, backoff_s(misses)):
        return -1, None
    slot = store.add("aegis/join/count", 1)
    store.set(f"aegis/join/slot/{slot}", uid)
    store.set(f"aegis/join/slot_of/{uid}", str(slot))
    key = f"aegis/join/round/{slot}"
    deadline = time.monotonic() + timeout_s
    since = time.monotonic()
    r = latest_round(store)
    watching: list[str] = []
    while True:
        if store.check([key]):
            plan = json.loads(store.get(key).decode())
            return int(plan["round"]), list(plan["previous"])
        r = latest_round(store, r)
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
            if not backoff(store, backoff_s(misses)):
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


def backoff(store: dist.TCPStore, wait_s: float) -> bool:
    """Sleep ``wait_s`` unless the job finishes meanwhile (then False)."""
    until = time.monotonic() + wait_s
    while time.monotonic() < until:
        if store.check([f"aegis/round/{latest_round(store)}/done"]):
            return False
        time.sleep(min(0.2, max(0.0, until - time.monotonic())))
    return True
