"""Membership: who is in the job, agreed through one c10d ``TCPStore`` (the job's rendezvous
store, ``AEGIS_MEMBERSHIP=host:port``), apart from any training.

* Every process beats a heartbeat counter (``aegis/hb/<uid>``) from a thread with its own store
  client (:class:`~.heartbeat.Heartbeat`, in :mod:`.heartbeat`, re-exported here). It watches only ``watchers`` (2) members of its round: its
  successors on a ring of the round's members interleaved by node (so that a lost node's
  processes are watched from other nodes). One whose counter has not moved for ``dead_after_s``
  is *declared* dead: its uid is appended to the round's death log (``aegis/round/<r>/dead``).
  Every process reads that one log in the same ``multi_get`` as its neighbours' counters, and
  fences every member of its running round that the log names (the round's ``Abandon``).
* A *round* is one membership (:meth:`Membership.form`): each process appends itself to the
  round's join log and counts itself in; the first process to ``compare_set`` the round's
  proposer key proposes, once every member of the previous round has joined or is dead (declared
  in the log, or silent for ``dead_after_s`` as the proposer watches it); the others wait on the
  round's ``members`` key (a server-side wait, no polling) and take over only if the proposer's
  own counter stops. The record is the change from the previous round (removed, added), so a
  round after a failure costs each process O(changes) bytes, not O(world). A whole list (a
  first round's) is written compressed (:mod:`.records`), and with the node relay
  (``relay=``) each node reads it from the store once: its processes share it through the
  node's tmpfs (:meth:`.relay.NodeRelay.shared`).
* A process that starts while the job runs, or that a round was formed without, registers and
  waits to be admitted at the survivors' next snapshot (:meth:`Membership.join`).
* Whole-node rounds (``per_node`` > 1, ``run_in_process(ranks_per_node=)``): the proposer keeps
  the nodes whose local ranks ``0 .. per_node - 1`` all joined (:func:`.layout.whole_nodes`);
  the processes of a node missing a worker are named in the record's ``"waiting"`` and wait in
  :meth:`Membership.join` as spares do. The survivors' vote counts a node's registrations only
  once the node is whole (:func:`.round.joiners_registered`).

Store load, against the world size W (docs/architecture.md 13.1; ``bench/scale.py`` measures
it): per process per heartbeat interval 2 requests (its counter; one ``multi_get``), O(1) bytes
but for the death log; per round formed O(1) requests per process (O(W) bytes for the proposer,
and for everyone in a first round, which needs the whole list: compressed, ~6.5 B per member,
and with the relay read once per node); O(W) requests in all.

Store keys (all under ``aegis/``): ``hb/<uid>``; ``round/<r>/joined`` (one JSON line per joining
process), ``round/<r>/count``, ``round/<r>/proposer``, ``round/<r>/members`` (the record:
``{"members"}`` or ``{"base", "removed", "added", "size"}``, with ``"admitted"``, ``"by"`` and
for whole-node rounds ``"waiting"``),
``round/<r>/list/<uid>`` (the proposer's whole list; whole lists are zstd-compressed past
4 KB, :mod:`.records`), ``round/<r>/dead`` (death log),
``round/<r>/done``, ``round/<r>/ports/<uid>`` (gloo fencing); ``join/count``, ``join/slot/<i>``,
``join/slot_of/<uid>``, ``join/round/<i>`` (``{"round", "base", "joiners"}``), ``admitted``.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
import uuid
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from aegis.errors import ConfigError
from aegis.training.inprocess.heartbeat import (  # noqa: F401 - re-exported
    BLIND_BEAT_S,
    BLIND_GRACE_S,
    CREATING_SILENT_S,
    REQUESTS,
    CountingStore,
    Heartbeat,
    _hb,
    _node,
    _rk,
    ring,
    successors,
)
from aegis.training.inprocess.layout import uid_order, whole_nodes
from aegis.training.inprocess.records import decode_record, encode_record
from aegis.training.inprocess.relay import NodeRelay
from aegis.training.inprocess.round import RecoveryGaveUp
from aegis.training.inprocess.storeclient import BASE_ROUND, EPOCH

__all__ = ["ENV_STORE", "connect_store", "declare", "member_uid", "store_from_env", "Heartbeat", "Membership", "Excluded", "latest_round",
           "backoff_s", "backoff", "ring", "successors", "CountingStore", "REQUESTS"]

ENV_STORE = "AEGIS_MEMBERSHIP"


def connect_store(host: str, port: int, timeout: timedelta) -> dist.TCPStore:
    """A c10d client of the store at ``host:port``, after a plain TCP connect has found it
    listening (within ``timeout``, 1 s at most): a refused connect raises at once
    (``ConnectionRefusedError``) and the caller tries again soon, instead of c10d's own
    retries, whose pauses grow across a connect (measured: clients were back 3.5-10 s after a
    restarted store was)."""
    with socket.create_connection((host, port), timeout=min(1.0, timeout.total_seconds())):
        pass
    return dist.TCPStore(host, port, is_master=False, timeout=timeout, wait_for_workers=False)


def store_from_env(timeout: timedelta) -> dist.TCPStore:
    """A c10d client of ``AEGIS_MEMBERSHIP`` (:func:`connect_store`)."""
    return connect_store(*store_address(), timeout)


def member_uid(node: str, local_rank: int | str, pid: int) -> str:
    """A process's name in the membership: ``"<node>/<local rank>/<pid>"``."""
    return f"{node}/{local_rank}/{pid}"


def declare(store: Any, uid: str) -> int:
    """Name ``uid`` in the death log of the job's newest round, as its watchers do once it has
    been silent for ``dead_after_s`` (for a caller that knows it is dead: its agent saw it
    exit). Returns that round."""
    r = latest_round(store)
    store.append(_rk(r, "dead"), f"{uid}\n")
    return r


def store_address() -> tuple[str, int]:
    """``AEGIS_MEMBERSHIP``'s host and port, or a ConfigError that says what to set."""
    addr = os.environ.get(ENV_STORE)
    if not addr or ":" not in addr:
        raise ConfigError(
            f"{ENV_STORE}=host:port must name a c10d TCPStore that no training node owns (the "
            "job's rendezvous store; aegis.sim starts one): in-process recovery agrees on "
            "membership through it"
        )
    host, port = addr.rsplit(":", 1)
    return host, int(port)


class Membership:
    """Rounds of membership agreed through one TCPStore (see the module docstring)."""

    def __init__(self, store: Any, uid: str, hb: Heartbeat, *, dead_after_s: float,
                 form_timeout_s: float, min_world: int, max_world: int | None = None,
                 per_node: int = 1, poll_s: float = 0.01,
                 relay: NodeRelay | None = None) -> None:
        self.store = store
        self.uid = uid
        self.hb = hb
        self.dead_after_s = dead_after_s
        self.form_timeout_s = form_timeout_s
        self.min_world = min_world
        self.max_world = max_world  # None: every process that comes is taken in
        # > 1: whole-node rounds (run_in_process(ranks_per_node=)); a node missing a worker
        # sits out whole, its other workers wait like spares (layout.whole_nodes)
        self.per_node = per_node
        self.poll_s = poll_s
        self.relay = relay  # the node's relay: a whole list read from the store once per node
        self._epoch: str | None = None  # the store's, for a client that does not keep it
        self._lists: dict[int, list[str]] = {}  # member lists of the rounds known here
        self.proposed: list[int] = []  # rounds this process proposed (tests, bench)

    # -- forming a round ----------------------------------------------------------------------

    def form(self, r: int, previous: list[str] | None, expected_first: int, *,
             join_slot: int = 0) -> tuple[list[str], int]:
        """Join round ``r``; return its members in rank order and the number of join slots
        admitted so far (every caller gets the same). Every process that takes part calls it:
        the survivors of round ``r - 1`` with ``previous`` its members (plus, after a regroup,
        the joiners admitted), a first round or a job restarted as a whole with ``None``, a
        joiner with what :meth:`join` returned (``join_slot``: its registration)."""
        deadline = time.monotonic() + self.form_timeout_s
        # a proposer must have followed the previous round (its ring knows the dead); a joiner
        # joins and waits
        eligible = previous is None or self.uid in previous
        self.store.append(_rk(r, "joined"), json.dumps({"u": self.uid, "j": join_slot}) + "\n")
        proposer = self.store.compare_set(_rk(r, "proposer"), "", self.uid).decode() \
            if eligible else ""
        self.store.add(_rk(r, "count"), 1)  # counted after its line: count n -> n lines logged
        if proposer == self.uid:
            self._propose(r, previous, expected_first, deadline)
        else:
            self._await(r, previous, expected_first, deadline, proposer, eligible)
        # a first round's record is the whole list: read once per node with the relay
        members, admitted, waiting = self._read(r, share=previous is None)
        if self.uid not in members:
            if self.uid in waiting:
                raise Excluded(f"round {r} was formed of whole nodes ({self.per_node} processes "
                               f"each) without this process's node ({self.uid}): a worker of it "
                               "is missing; this process waits for it, like a spare",
                               spare=True)
            if self.full(members):
                raise Excluded(f"round {r} was formed full ({len(members)} of max_world="
                               f"{self.max_world}) without this process ({self.uid}): a spare",
                               spare=True)
            raise Excluded(f"round {r} was formed without this process ({self.uid})")
        self._keep(r, members)
        return members, admitted

    def full(self, members: list[str]) -> bool:
        """The round of ``members`` has ``max_world`` processes: one more waits as a spare."""
        return self.max_world is not None and len(members) >= self.max_world

    def _admissible(self, uids: list[str] | dict[str, int],
                    previous: list[str] | None) -> list[str]:
        """The processes a round could be formed of: all of them, or with ``per_node`` > 1 those
        of whole nodes (:func:`.layout.whole_nodes`)."""
        if self.per_node <= 1:
            return list(uids)
        return whole_nodes(list(uids), self.per_node, previous or [])[0]

    def _alive(self, uid: str, declared: set[str]) -> bool:
        return uid not in declared and self.hb.silent_for(uid) < self.dead_after_s

    def _joined(self, r: int) -> dict[str, int]:
        """The processes that joined round ``r`` (in order) -> their join slot."""
        out: dict[str, int] = {}
        for line in self.store.get(_rk(r, "joined")).decode().splitlines():
            if line:
                e = json.loads(line)
                out.setdefault(str(e["u"]), int(e["j"]))
        return out

    def _propose(self, r: int, previous: list[str] | None, expected_first: int,
                 deadline: float) -> None:
        """The proposer: poll the round's count and the death log of the previous round (2
        requests per poll), read the join log when the count changed (at most once an interval
        until enough processes joined), watch the previous members that have not joined, and
        write the proposal once every one of them has joined or is dead (first round:
        ``expected_first`` processes)."""
        key = _rk(r, "members")
        needed = max(expected_first, self.min_world)
        last_n, last_read = -1, float("-inf")
        joined: dict[str, int] = {}
        missing: list[str] = list(previous or [])
        started = time.monotonic()
        base: dict[str, tuple[int | None, float]] = {}  # suspects (below) -> (counter, when)
        while True:
            if self.store.check([key]):
                return  # another process took over while this one was away (frozen)
            n = int(self.store.add(_rk(r, "count"), 0))
            now = time.monotonic()
            declared = self.hb.declared(self.store if previous is not None else None)
            if previous is not None:
                needed = max(self.min_world, sum(1 for u in previous if u not in declared))
            if n != last_n and (n >= needed or now - last_read >= self.hb.interval_s):
                joined = self._joined(r)
                last_n, last_read = n, now
                if previous is not None:
                    missing = [u for u in previous if u not in joined]
            if previous is None:
                if len(self._admissible(joined, None)) >= needed:
                    self._write(r, previous, joined)
                    return
            else:
                # joined but declared (it stopped after joining, or its beats were held back
                # for dead_after_s: a GC pause under load): left out only if this process,
                # watching it from then on, sees its counter still for dead_after_s more;
                # kept once it moves
                suspects = [u for u in joined if u != self.uid and u in declared]
                for u in suspects:
                    if base.get(u, (None, 0.0))[0] is None:  # its counter when suspected
                        base[u] = (self.hb.count(u)[0], now)
                alive, dead = set(), set()
                for u in suspects:
                    count, looked = self.hb.count(u)
                    if count is not None and base[u][0] is not None and count != base[u][0]:
                        alive.add(u)
                    elif looked - base[u][1] >= self.dead_after_s:
                        dead.add(u)
                undecided = [u for u in suspects if u not in alive and u not in dead]
                # the previous members still missing an interval in (the live ones join at
                # once) ride on this process's heartbeat multi_get too, so that a dead one that
                # no ring successor declares is judged here
                late = missing if now - started >= self.hb.interval_s else []
                self.hb.watch(late + suspects)
                if (len(self._admissible([u for u in joined if u not in dead], previous))
                        >= self.min_world and not undecided
                        and not any(self._alive(u, declared) for u in missing)):
                    self._write(r, previous, {u: j for u, j in joined.items() if u not in dead})
                    return
            if now > deadline:
                waiting = [u for u in missing if self._alive(u, declared)]
                raise RecoveryGaveUp(
                    f"round {r}: {len(joined)} process(es) joined within {self.form_timeout_s:.0f} s, "
                    f"fewer than needed (min_world={self.min_world}"
                    + (f", first round: {expected_first}" if previous is None else
                       f", still beating but not joined: {waiting[:8]}") + ")")
            time.sleep(self.poll_s)

    def _write(self, r: int, previous: list[str] | None, joined: dict[str, int]) -> None:
        order = {u: k for k, u in enumerate(previous or [])}
        waiting: list[str] = []
        if self.per_node > 1:
            # whole nodes only, survivors' nodes first, each node's processes in local-rank
            # order; at most max_world // per_node nodes (the rest are spares)
            kept, waiting = whole_nodes(list(joined), self.per_node, previous or [])
            if self.max_world is not None:
                kept = kept[:self.max_world // self.per_node * self.per_node]
            joined = {u: joined[u] for u in kept}
            order = {u: k for k, u in enumerate(kept)}
        elif self.max_world is not None and len(joined) > self.max_world:
            # the members of the previous round first, then the others in the order they
            # joined (a first round: in uid order); the rest stay spares (they are Excluded,
            # and wait in join() until a round has room)
            ranked = sorted(joined, key=lambda u: (order.get(u, len(order)),
                                                   u if previous is None else ""))
            keep = set(ranked[:max(self.max_world, sum(1 for u in joined if u in order))])
            joined = {u: j for u, j in joined.items() if u in keep}
        proposal = sorted(joined, key=lambda u: (order.get(u, len(order)), uid_order(u)))
        admitted_before = int(self.store.add("aegis/admitted", 0))
        admitted = max([admitted_before] + [joined[u] for u in proposal])
        if admitted > admitted_before:
            # a joiner that walked into this round (registered after the survivors' vote, then
            # found the round forming) was admitted here, not by admit(): the key follows, or
            # the next round's record would count its slot as waiting again and its members
            # would end a round at their next snapshot to admit a process already among them
            # (an empty round per loss in the chaos campaign, issue 25)
            self.store.set("aegis/admitted", str(admitted))
        record: dict[str, Any] = {"admitted": admitted, "by": self.uid}
        base = self._lists.get(r - 1) if previous is not None else None
        if base is not None:
            inside = set(proposal)
            known = set(base)
            record.update(base=r - 1, removed=[u for u in base if u not in inside],
                          added=[u for u in proposal if u not in known], size=len(proposal))
            if _apply(base, record) != proposal:  # the order is not base's: send the whole list
                base = None
        if base is None:
            record = {"members": proposal, "admitted": admitted, "by": self.uid}
        if waiting:  # processes of nodes not whole: Excluded as spares, not as misses
            record["waiting"] = waiting
        # the whole list, for processes that do not know the base round (joiners), under this
        # proposer's name: two proposers after a takeover never overwrite each other's
        self.store.set(_rk(r, f"list/{self.uid}"), encode_record(proposal))
        text = encode_record(record)
        if self.store.compare_set(_rk(r, "members"), "", text) == text:
            self.proposed.append(r)

    def _await(self, r: int, previous: list[str] | None, expected_first: int, deadline: float,
               proposer: str, eligible: bool) -> None:
        """Wait (server-side) for the proposal; every ``slice`` s without one, check that the
        proposer still beats (its counter, 1 request) and take over if it stopped or was
        declared dead."""
        key = _rk(r, "members")
        slice_s = max(2.0, 2.0 * self.dead_after_s + 1.0)  # longer than a formation after a loss
        last: tuple[str, int] | None = None
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RecoveryGaveUp(f"round {r}: no proposal within {self.form_timeout_s:.0f} s "
                                     f"(proposer {proposer or 'none'})")
            with contextlib.suppress(Exception):  # DistStoreError: the slice ran out
                self.store.wait([key], timedelta(seconds=min(slice_s, remaining)))
                return
            if self.store.check([key]):
                return
            if not eligible:
                continue
            proposer = self.store.compare_set(_rk(r, "proposer"), "", self.uid).decode()
            if proposer == self.uid:
                break
            beat = int(self.store.add(_hb(proposer), 0))
            if proposer in self.hb.declared() or last == (proposer, beat):
                took = self.store.compare_set(_rk(r, "proposer"), proposer, self.uid).decode()
                if took == self.uid:
                    break
                proposer = took
            last = (proposer, beat)
        self._propose(r, previous, expected_first, deadline)

    def _get(self, r: int, what: str, *, share: bool) -> bytes:
        """Round ``r``'s key ``what`` (it exists): from the store, or (``share``, with the
        node's relay) from the node's copy, one process of the node reading the store. Shared:
        the whole lists (O(world) bytes to every process); a change record after a loss is a few
        hundred bytes, read directly: sharing it saves the store one small ``get`` per process
        but puts a second wake-up on the path to every process (measured with 1,024 simulated
        members: the agreement 0.64-0.69 s direct, 0.99-1.06 s shared)."""
        key = _rk(r, what)
        if self.relay is None or not share:
            return bytes(self.store.get(key))
        # a StoreClient keeps the epoch of the store it talks to (a new one after a restart)
        epoch = getattr(self.store, "epoch", None)
        epoch = epoch if isinstance(epoch, str) else self._epoch
        if epoch is None:
            epoch = self._epoch = self.store.compare_set(EPOCH, "", uuid.uuid4().hex).decode()
        return self.relay.shared(epoch, r, what, lambda: bytes(self.store.get(key)))

    def _read(self, r: int, *, share: bool = False) -> tuple[list[str], int, list[str]]:
        record = decode_record(self._get(r, "members", share=share))
        return self._members_of(r, record), int(record["admitted"]), list(record.get("waiting", []))

    def _members_of(self, r: int, record: dict[str, Any]) -> list[str]:
        if "members" in record:
            return list(record["members"])
        base = self._lists.get(int(record["base"]))
        if base is not None:
            out = _apply(base, record)
            if len(out) == int(record["size"]):
                return out
        return list(decode_record(self._get(r, f"list/{record['by']}", share=True)))

    def _keep(self, r: int, members: list[str]) -> None:
        self._lists = {k: v for k, v in self._lists.items() if k >= r - 1}
        self._lists[r] = members

    def round_list(self, r: int) -> list[str]:
        """The members of round ``r`` (formed), from what this process knows or the store."""
        if r not in self._lists:
            self._keep(r, self._read(r)[0])
        return list(self._lists[r])

    # -- growing back -------------------------------------------------------------------------

    def admit(self, r: int, members: list[str], admitted: int, registered: int) -> list[str]:
        """After a ``Regroup`` ended round ``r - 1`` of ``members``: admit the processes that
        registered (join slots ``admitted + 1 .. registered``, the same numbers on every member:
        the snapshot vote) into round ``r``; returns its ``previous`` (members, then the joiners).
        Every member calls it: 3 requests each, O(joiners) bytes."""
        slots = list(range(admitted + 1, registered + 1))
        keys = [f"aegis/join/slot/{i}" for i in slots]
        if keys and not self.store.check(keys):  # a registrant lost between its two writes
            keys = [k for k in keys if self.store.check([k])]
        names = [v.decode() for v in self.store.multi_get(keys)] if keys else []
        known = set(members)
        joiners: list[str] = []
        for u in names:
            if u not in known:
                known.add(u)
                joiners.append(u)
        joiners.sort(key=uid_order)  # a node's processes in local-rank order, not as they came
        plan = json.dumps({"round": r, "base": r - 1, "joiners": joiners})
        if slots:
            self.store.multi_set([f"aegis/join/round/{i}" for i in slots], [plan] * len(slots))
        self.store.set("aegis/admitted", str(registered))
        return members + joiners

    def _register(self) -> int:
        slot = int(self.store.add("aegis/join/count", 1))
        self.store.set(f"aegis/join/slot/{slot}", self.uid)
        self.store.set(f"aegis/join/slot_of/{self.uid}", str(slot))
        return slot

    def join(self, *, timeout_s: float, misses: int = 0,
             poll_s: float = 0.05) -> tuple[int, list[str] | None, int]:
        """A process that starts while the job runs (a replacement node, a worker restarted by its
        launcher) or that a round was formed without (it was frozen or cut off, then came back):
        register, then wait to be admitted. Returns the round to form, its ``previous`` list and
        this process's join slot (round -1: the job finished meanwhile).

        * the survivors admit it at their next snapshot (``Manager.save`` votes, every rank raises
          ``Regroup`` after that snapshot committed) by writing ``aegis/join/round/<slot>``;
        * a round that is being formed (the survivors of a failure) is joined directly;
        * when no member of the newest round is alive (its heartbeats stopped: the whole job was
          restarted by its launcher), the processes waiting here form the next round among
          themselves (``WORLD_SIZE`` of them, as in the first round) and restore from the stores.
          A few members (its ring successors) are watched; only when they all look dead are all
          members watched, and the job is taken for dead once none of them moved for
          ``dead_after_s``.

        * while the newest round is full (``max_world`` members), it waits as a *spare*, with
          no time limit: the survivors admit none at their snapshots, and it joins the next
          round that is formed after a loss (it watches for one every poll); a round that
          fills up without it is not counted as a miss.

        ``misses``: admitted rounds this process missed in a row; it registers after
        :func:`backoff_s` of them, and again after a longer wait each time its slot is admitted
        into a round it misses. 5 requests per poll (every ``poll_s``), the newest round's list
        read once per round.
        """
        store, hb = self.store, self.hb
        hb.follow([], None)
        if not backoff(store, backoff_s(misses)):
            return -1, None, 0
        slot = self._register()
        key = f"aegis/join/round/{slot}"
        deadline = time.monotonic() + timeout_s
        r = latest_round(store)
        seen_r = -1
        members: list[str] = []
        others: list[str] = []
        everyone = False  # the sample looked dead: every member is watched
        since = time.monotonic()
        while True:
            if store.check([key]):
                plan = json.loads(store.get(key).decode())
                previous = self.round_list(int(plan["base"])) + list(plan["joiners"])
                return int(plan["round"]), previous, slot
            r = latest_round(store, r)
            if r != seen_r:
                members = self.round_list(r)
                others = [u for u in members if u != self.uid]
                hb.watch(successors(others, self.uid, hb.watchers) if others else [])
                seen_r, since, everyone = r, time.monotonic(), False
            if store.check([_rk(r, "done")]):
                return -1, None, 0  # the job finished while this process waited
            if int(store.add(_rk(r + 1, "count"), 0)) > 0:  # survivors are forming a round
                return r + 1, members, slot
            if int(store.add("aegis/admitted", 0)) >= slot and not store.check([key]):
                # its slot was admitted into a round it missed: a new slot, after a while (at
                # once for a spare passed over by a round that filled up: not a miss)
                if not self.full(members):
                    misses += 1
                    if not backoff(store, backoff_s(misses)):
                        return -1, None, 0
                slot = self._register()
                key = f"aegis/join/round/{slot}"
            watched = hb.watched()
            if time.monotonic() - since > self.dead_after_s and all(
                    hb.silent_for(u) >= self.dead_after_s for u in watched):
                if everyone or len(watched) >= len(others):
                    return r + 1, None, slot  # nobody of the newest round is alive: restarted job
                hb.watch(others)  # the sample is silent: all of them, before concluding
                since, everyone = time.monotonic(), True
            if time.monotonic() > deadline and self.full(members):
                deadline = time.monotonic() + timeout_s  # a spare waits for room, unbounded
            if time.monotonic() > deadline:
                raise RecoveryGaveUp(f"registered to join the running job (slot {slot}) but was "
                                     f"not admitted within {timeout_s:.0f} s: the job saves no "
                                     "snapshot, or has ended")
            time.sleep(poll_s)


def _apply(base: list[str], record: dict[str, Any]) -> list[str]:
    removed = set(record["removed"])
    return [u for u in base if u not in removed] + list(record["added"])


class Excluded(RecoveryGaveUp):  # noqa: N818
    """A round formed without this process (it was silent: frozen, cut off, or late; or the
    round was full, ``spare``: it waits for room, which is not a miss)."""

    def __init__(self, message: str, *, spare: bool = False) -> None:
        super().__init__(message)
        self.spare = spare


def latest_round(store: Any, start: int = 0) -> int:
    """The newest round formed (its ``members`` key exists), searched from ``start`` (from the
    round a re-seeded store starts at, when ``start`` is 0 and the store was restarted)."""
    r = start
    if r == 0 and store.check([BASE_ROUND]):
        r = int(store.get(BASE_ROUND).decode())
    while store.check([_rk(r + 1, "members")]):
        r += 1
    return r


def backoff_s(misses: int) -> float:
    """How long a process that missed ``misses`` admitted rounds in a row waits before it
    registers again: none for the first (a frozen process back), then 1, 2, 4 ... 30 s. Every
    registration makes the survivors end a round at their next snapshot; a process too slow to
    make it in (seen in the chaos campaign at a load of 40 on 2 cores: its threads starved past
    ``dead_after_s``) would otherwise cost them a round per step."""
    return 0.0 if misses <= 1 else min(30.0, 2.0 ** (misses - 2))


def backoff(store: Any, wait_s: float) -> bool:
    """Sleep ``wait_s`` unless the job finishes meanwhile (then False)."""
    until = time.monotonic() + wait_s
    while time.monotonic() < until:
        if store.check([_rk(latest_round(store), "done")]):
            return False
        time.sleep(min(0.2, max(0.0, until - time.monotonic())))
    return True
