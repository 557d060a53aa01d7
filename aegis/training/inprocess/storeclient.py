"""A membership store client that survives the store's failures (issue 25).

A c10d ``TCPStore`` client fails for good once its connection breaks (a partition, the store
restarted: ``DistNetworkError: Broken pipe`` on every later request), and a request to a store
that stopped answering (its host frozen, packets dropped) blocks with no bound at all: measured
here, an ``add`` to a SIGSTOPped server returned 12 s later, when the server was continued, and
a connect to it hung the same way. :class:`StoreClient` wraps one client:

* every request runs on a worker thread of the client and is waited for with a bound (the
  request's own timeout, for ``get`` and ``wait``, plus ``request_s``); a request past it
  abandons that client (its thread stays blocked until the store answers or the process ends)
  and the next request reconnects, in attempts of ``CONNECT_S`` (2 s) each;
* a request that fails on the connection reconnects and is sent again, with a growing pause,
  until ``outage_s`` has passed since the first failure: then :class:`StoreUnreachable` (a
  :class:`~.round.RecoveryGaveUp`: the process exits and its launcher restarts it, to restore
  from its node store). ``outage_s=None``: never retried here, the caller's next request
  reconnects (the heartbeat: one attempt per beat);
* after every reconnect the client reads the store's *epoch* (``aegis/epoch``, a token the
  first process of the job writes): missing or different, the store lost its keys (it was
  restarted empty); a missing epoch is replaced by a new token (the first writer's stays, so
  that every client reconnecting later finds a token other than the one it knew), the client
  adopts the store's and raises :class:`StoreRestarted` instead of sending the request: the caller
  re-seeds what it knows (the round loop: :func:`reseed`) and starts its membership step over.

A request sent again after a failure may have been applied once already (the reply was lost):
membership only sends requests for which that is harmless (``append`` of a line read as a set,
``add`` on a counter that only wakes a reader, ``compare_set`` that returns the winner).

Costs: one thread handoff per request (tens of microseconds; membership makes 2 requests per
process per heartbeat), nothing per world size.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import queue
import threading
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from aegis.training.inprocess.records import encode_record
from aegis.training.inprocess.round import RecoveryGaveUp

__all__ = ["StoreClient", "StoreUnreachable", "StoreRestarted", "is_store_failure", "EPOCH",
           "reseed"]

EPOCH = "aegis/epoch"
BASE_ROUND = "aegis/base_round"  # the round a store re-seeded after a restart starts from

QUICK_S = 3.0  # the bound on a request that runs beside training (StoreClient.once)
# One connect attempt: c10d retries a refused connect until its timeout, then may sleep a
# backoff (measured: a 2 s timeout returns after ~3 s, a 10 s one after ~15 s). An attempt
# begun while the store was down must not outlast its return by long: the heartbeat, whose
# thread makes the attempt, stayed blind for 11 s after a store restart in the chaos campaign
# (a frozen member fenced that much later). Short attempts, retried.
CONNECT_S = 2.0
# After a failure, what runs beside training (once) tries to reconnect at most this often
RETRY_S = 1.0

# requests whose own timeout bounds how long they may wait on the server
_WAITING = ("get", "wait", "multi_get")


class StoreUnreachable(RecoveryGaveUp):
    """The membership store could not be reached for ``outage_s``: the process restarts."""


class StoreRestarted(Exception):  # noqa: N818 - an event the caller handles, not an error
    """The store lost its keys (it was restarted empty); the request was not sent."""


# errnos of a route that is gone (a partition, a link down: connect() fails at once with these
# once the neighbour's ARP entry expired), which are plain OSErrors, not ConnectionErrors
_UNREACHABLE = {errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN, errno.ENETDOWN}


def is_store_failure(e: BaseException) -> bool:
    """A failure of the connection to the store (not a key that a ``get`` or ``wait`` waited
    for in vain: that is the request's own timeout, ``DistStoreError: wait timeout``)."""
    if isinstance(e, ConnectionError | TimeoutError | _Abandoned):
        return True
    if isinstance(e, OSError) and e.errno in _UNREACHABLE:
        return True
    name = type(e).__name__
    text = str(e).lower()
    if name == "DistNetworkError":
        return True
    return any(m in text for m in ("broken pipe", "connection reset", "connection refused",
                                   "failed to recv", "connection was likely closed",
                                   "failed to connect", "no route to host",
                                   "network is unreachable"))


class _Abandoned(Exception):  # noqa: N818
    """A request ran past its bound: the client it ran on is abandoned."""


class _Worker:
    """One daemon thread that runs a client's requests in order; a caller waits for each with a
    bound. Daemon: a worker blocked for good in a request to a frozen store must not keep the
    process from exiting (``concurrent.futures`` joins its workers at exit)."""

    def __init__(self, name: str) -> None:
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def _run(self) -> None:
        while (item := self._q.get()) is not None:
            fn, box, done = item
            try:
                box.append((True, fn()))
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                box.append((False, e))
            done.set()

    def run(self, fn: Callable[[], Any], bound: float, what: str) -> Any:
        box: list[tuple[bool, Any]] = []
        done = threading.Event()
        self._q.put((fn, box, done))
        if not done.wait(bound):
            raise _Abandoned(f"no reply from the {what} within {bound:.1f} s")
        ok, value = box[0]
        if ok:
            return value
        raise value

    def stop(self) -> None:
        self._q.put(None)


class StoreClient:
    """One membership store client that reconnects (see the module). ``connect(timeout)``
    makes a raw c10d client that gives up connecting after ``timeout`` (a timedelta; a store
    that is down is retried by c10d for that long); the client's own timeout is then set to
    ``timeout_s``, which bounds a ``get`` of a missing key. A connect attempt is given
    ``CONNECT_S`` (or ``request_s``, if shorter); ``request_s`` bounds every other request."""

    def __init__(self, connect: Callable[[timedelta], Any], *, timeout_s: float,
                 request_s: float = 10.0,
                 outage_s: float | None = 60.0, name: str = "membership store") -> None:
        self._connect = connect
        self.timeout_s = timeout_s
        self.request_s = request_s
        self.outage_s = outage_s
        self.name = name
        self._lock = threading.Lock()  # one generation at a time
        self._store: Any = None
        self._pool: _Worker | None = None
        self._generation = 0
        self.epoch: str | None = None  # the store's epoch as this client last read it
        self.reconnects = 0
        self.restarts_seen = 0
        self.broken_since: float | None = None  # first failure of the current outage
        self.failed_at = float("-inf")  # the last failure
        self.last_failure: str | None = None
        # called (on a thread of its own) after this client reconnected: run_in_process makes
        # the heartbeat's client refresh the membership client then (see refresh())
        self.on_reconnect: Callable[[], None] | None = None
        self._pending: str | None = None  # a restart found outside a membership step

    # -- the connection -----------------------------------------------------------------------

    def _bounded(self, pool: _Worker, fn: Callable[[], Any], bound: float) -> Any:
        return pool.run(fn, bound, self.name)

    def _drop(self) -> None:
        """Forget the current client (its worker may stay blocked in a request)."""
        pool, self._store, self._pool = self._pool, None, None
        if pool is not None:
            pool.stop()

    def _ensure(self) -> None:
        """Connected, or connect now (bounded); after a reconnect, check the store's epoch."""
        if self._store is not None:
            return
        self._generation += 1
        pool = _Worker(f"aegis-store-{self._generation}")

        attempt = min(CONNECT_S, self.request_s)

        def connect() -> Any:
            raw = self._connect(timedelta(seconds=attempt))
            raw.set_timeout(timedelta(seconds=self.timeout_s))
            return raw

        try:
            store = self._bounded(pool, connect, 1.5 * attempt + 1.0)
        except BaseException:
            pool.stop()
            raise
        self._store, self._pool = store, pool
        if self._generation > 1:
            self.reconnects += 1
            if self.on_reconnect is not None:
                threading.Thread(target=self.on_reconnect, name="aegis-store-refresh",
                                 daemon=True).start()
            self._check_epoch()

    def _check_epoch(self) -> None:
        assert self._store is not None and self._pool is not None
        if self.epoch is None:
            return
        # a store found without an epoch gets a new one (the first client to write it wins):
        # every client that reconnects later, in this process or another, finds a token other
        # than its own and knows of the restart too
        store, known, fresh = self._store, self.epoch, uuid.uuid4().hex
        now = self._bounded(self._pool, lambda: store.compare_set(EPOCH, "", fresh),
                            self.request_s).decode()
        if now != known:
            self.epoch = now
            self.restarts_seen += 1
            raise StoreRestarted(f"the {self.name} lost its keys (restarted empty): epoch "
                                 f"{known[:8]} -> {now[:8]}")

    def seal(self) -> str:
        """Read the store's epoch, writing one first if the store has none (every process of a
        job gets the first writer's token)."""
        token = uuid.uuid4().hex
        self.epoch = self.compare_set(EPOCH, "", token).decode()
        return self.epoch

    # -- requests -----------------------------------------------------------------------------

    def _bound(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> float:
        if name == "wait" and len(args) > 1 and isinstance(args[1], timedelta):
            return args[1].total_seconds() + self.request_s
        if name in _WAITING:
            return self.timeout_s + self.request_s
        return self.request_s

    def call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """``name(*args)`` on the store, reconnecting and sending it again after a connection
        failure until ``outage_s`` (see the module)."""
        with self._lock:
            if self._pending is not None:  # found by refresh() or a quick request: this
                why, self._pending = self._pending, None  # step starts over, as if it had
                raise StoreRestarted(why)                  # found it itself
        return self._call(name, args, kwargs, self.outage_s, None)

    def _call(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any],
              outage_s: float | None, bound: float | None, *, step: bool = True) -> Any:
        pause = 0.05
        while True:
            started = time.monotonic()
            with self._lock:
                try:
                    self._ensure()
                    store, pool = self._store, self._pool
                    assert store is not None and pool is not None
                    out = self._bounded(pool, functools.partial(getattr(store, name), *args,
                                                                **kwargs),
                                        bound or self._bound(name, args, kwargs))
                    self.broken_since = None
                    return out
                except StoreRestarted as e:
                    self.broken_since = None
                    if not step:  # kept for the next membership step (call())
                        self._pending = str(e)
                    raise
                except Exception as e:
                    if not is_store_failure(e):
                        raise
                    self._drop()
                    now = self.failed_at = time.monotonic()
                    if self.broken_since is None:  # from when the failed request was sent
                        self.broken_since = started
                    self.last_failure = f"{type(e).__name__}: {str(e)[:200]}"
                    if outage_s is None:
                        raise
                    if now - self.broken_since >= outage_s:
                        raise StoreUnreachable(
                            f"the {self.name} has been unreachable for "
                            f"{now - self.broken_since:.0f} s (bound: run_in_process(store_outage="
                            f"{outage_s:g} s)); the last failure: {self.last_failure}. "
                            "Restarting the process: it restores from its node store once the "
                            "store is back") from e
            time.sleep(pause)
            pause = min(1.0, pause * 2)

    def once(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """One attempt bounded by ``quick_s`` (``QUICK_S``, or ``request_s`` if shorter),
        never retried: what runs beside training (a teardown reading its peers' ports, a
        fence) must not wait out an outage. Within ``RETRY_S`` of a failure it fails at once
        (no reconnect per request)."""
        with self._lock:
            if self._store is None and time.monotonic() - self.failed_at < min(RETRY_S,
                                                                                self.request_s):
                raise ConnectionError(f"the {self.name} is unreachable ({self.last_failure})")
        # a get here reads a key known to exist (its caller checks first): bounded as short
        bound = None if name == "wait" else min(QUICK_S, self.request_s)
        return self._call(name, args, kwargs, None, bound, step=False)

    def refresh(self) -> None:
        """Reconnect now if the connection is broken, and adopt a restarted store's epoch,
        instead of at the next membership step: a connect can take seconds (measured in the
        chaos campaign: ~11 s in 2 of 4 processes whose membership client first reconnected
        when the next round formed, after a store restart), and the step would then start by
        raising StoreRestarted. Two attempts: the first may find the old connection dead."""
        for _ in range(2):
            try:
                self._call("check", ([EPOCH],), {}, None, None, step=False)
                return
            except StoreRestarted:
                return  # the new epoch is adopted
            except Exception:  # noqa: BLE001 - the store still away: the next step retries
                continue

    @property
    def quick(self) -> _Once:
        """This client as a store whose requests are each tried once (:meth:`once`): for
        what runs beside training (fencing, publishing ports, the joiners vote)."""
        return _Once(self)

    def close(self) -> None:
        with self._lock:
            self._drop()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)

        def request(*args: Any, **kwargs: Any) -> Any:
            return self.call(name, *args, **kwargs)

        return request


class _Once:
    def __init__(self, client: StoreClient) -> None:
        self._client = client

    def once(self, name: str, *args: Any, **kwargs: Any) -> Any:
        return self._client.once(name, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return functools.partial(self._client.once, name)


def _at_least(store: Any, key: str, value: int) -> None:
    """Raise the counter ``key`` to ``value`` unless it is higher (a heartbeat may have created
    it at 0 first): compare-and-set, so that members writing at once never add up."""
    now = int(store.add(key, 0))
    while now < value:
        now = int(store.compare_set(key, str(now), str(value)).decode())


def reseed(store: Any, r: int, members: list[str], admitted: int, uid: str) -> None:
    """After the store restarted empty: write back what a member of round ``r`` knows (every
    member writes the same values; the first write of each key stays): the round's whole
    member list, the join slots admitted so far (and the join counter, so that a new
    registration gets a slot past them), and the round a later ``latest_round`` starts from.
    5 requests, O(world) bytes, once per member per store restart."""
    if r < 0 or not members:
        return
    record = encode_record({"members": members, "admitted": admitted, "by": uid})
    store.compare_set(f"aegis/round/{r}/members", "", record)
    _at_least(store, "aegis/admitted", admitted)
    _at_least(store, "aegis/join/count", admitted)
    store.compare_set(BASE_ROUND, "", str(r))
    with contextlib.suppress(Exception):
        store.set(f"aegis/round/{r}/reseeded/{uid}", "1")
