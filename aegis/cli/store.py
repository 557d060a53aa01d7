"""``aegis store``: run the store that a job's rendezvous and in-process recovery agree through.

::

    aegis store serve [--host 0.0.0.0] [--port 29400] [--health-port 29401] [--poll 0.5]
                      [--liveness-port 0 | --no-liveness]
    aegis store ping HOST:PORT [--timeout 2] [--json]

``serve`` hosts a c10d ``TCPStore`` (libuv) that no training node owns: torchrun's c10d
rendezvous (``--rdzv-endpoint=HOST:PORT --rdzv-conf=is_host=false``) and aegis' membership
(``AEGIS_MEMBERSHIP=HOST:PORT``) both use it, so losing any training node never takes it along.
It prints one line per membership change, read from the membership keys
(:mod:`aegis.training.inprocess.membership`) every ``--poll`` seconds by a client of its own:
a process joining a round (its join log), a round formed (its size, the members that left and
the new ones; its members in rank order up to 16), a member declared dead by its watchers (the
round's death log), a process registering to join the running job, join slots admitted, the
job done. A poll is O(1) requests at any world size (a round's join log is read when its count
moves, a formed round's record once): nothing per training step, nothing per member.

Liveness (:mod:`aegis.training.inprocess.liveness`): the same process listens on a second port
(``--liveness-port``, any free one by default, published in the store under
``aegis/liveness/port``); every in-process training process holds one connection to it, and one
that ends without a goodbye (the process crashed or was killed: its kernel closed it) is named
in the newest round's death log at once, with a line here, instead of after ``dead_after_s`` of
heartbeat silence. A machine that stops without closing anything is still found by the
heartbeats. One connection per process, nothing per step.

Health: ``--health-port`` serves ``GET /healthz`` (200 with a JSON body, the membership as last
read, while the store answers a read within a second; 503 otherwise) for a Kubernetes
``httpGet`` probe; ``aegis store ping``
reads one key through the store's own protocol and exits 0 (answered) or 1 (did not), for an
``exec`` probe or a script. SIGTERM or SIGINT: the watcher and the health server stop, the store
closes, exit 0.

JSON (``ping --json``, schema ``aegis.store.ping/1``): ``address, ok, latency_ms, round (the
newest round formed, null when none), members (its members in rank order), joining (processes
registered to join and not yet admitted), error``. ``/healthz``: ``ok, round, members (a count),
joining`` (or ``ok: false, error``).
"""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import sys
import threading
import time
from datetime import datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import click

from aegis.cli._common import EXIT_FAILED, EXIT_OK, CliError

__all__ = ["store", "Watcher", "read_state"]


def _addr(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit():
        raise CliError(f"{value!r}: give the store as HOST:PORT")
    return host or "127.0.0.1", int(port)


def _client(host: str, port: int, timeout_s: float) -> Any:
    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1" if host in ("0.0.0.0", "::", "") else host, port, is_master=False,
                    wait_for_workers=False, timeout=timedelta(seconds=timeout_s))


def _get(s: Any, key: str) -> str | None:
    return s.get(key).decode() if s.check([key]) else None


def _count(s: Any, key: str) -> int:
    return int(s.get(key).decode()) if s.check([key]) else 0


def _members_of(s: Any, r: int, base: list[str] | None) -> list[str]:
    """Round ``r``'s members in rank order: the record is the whole list, or the change from
    round ``r - 1`` (``base``, when known here), else the proposer's whole list beside it."""
    from aegis.training.inprocess.records import decode_record

    record = decode_record(s.get(f"aegis/round/{r}/members"))
    if "members" in record:
        return list(record["members"])
    if base is not None and int(record.get("base", -1)) == r - 1:
        removed = set(record["removed"])
        out = [u for u in base if u not in removed] + list(record["added"])
        if len(out) == int(record["size"]):
            return out
    return list(decode_record(s.get(f"aegis/round/{r}/list/{record['by']}")))


def read_state(s: Any) -> dict[str, Any]:
    """The newest round formed (its members in rank order) and how many processes wait to
    join; every read is a ``check`` first, so nothing is created. O(rounds) checks: a probe."""
    r = None
    while s.check([f"aegis/round/{0 if r is None else r + 1}/members"]):
        r = 0 if r is None else r + 1
    members = _members_of(s, r, None) if r is not None else []
    registered, admitted = _count(s, "aegis/join/count"), _count(s, "aegis/admitted")
    return {"round": r, "members": members, "joining": max(0, registered - admitted)}


def _short(uids: list[str], limit: int = 16) -> str:
    return str(uids) if len(uids) <= limit else f"[{', '.join(uids[:limit])}, ... {len(uids) - limit} more]"


class Watcher:
    """Reads the membership keys (:mod:`aegis.training.inprocess.membership`) every ``poll_s``
    and says what changed, one line each (``say``); :meth:`poll` is one pass. A pass costs O(1)
    requests (the newest round's join count, members and death log, the next round's count,
    the registration count, ``admitted``, ``done``); a round's join log is read when its count
    moves, a formed round's record once."""

    def __init__(self, client: Any, say: Any) -> None:
        self.s = client
        self.say = say
        self.round = 0  # the newest round followed
        self.joined: dict[int, int] = {}  # round -> lines of its join log announced
        self.counted: dict[int, int] = {}  # round -> its join count at the last read
        self.dead: dict[int, int] = {}  # round -> lines of its death log announced
        self.formed: dict[int, list[str]] = {}  # the last two rounds formed -> members
        self.joins = 0  # registrations announced
        self.admitted = 0
        self.done = False

    @property
    def view(self) -> dict[str, Any]:
        """The newest round formed as last read, for the health probe."""
        r = max(self.formed, default=None)
        return {"round": r, "members": len(self.formed[r]) if r is not None else 0,
                "joining": max(0, self.joins - self.admitted)}

    def _join_log(self, r: int) -> None:
        n = _count(self.s, f"aegis/round/{r}/count")
        if n == self.counted.get(r, 0):
            return
        self.counted[r] = n
        text = _get(self.s, f"aegis/round/{r}/joined") or ""
        lines = [x for x in text.splitlines() if x]
        for line in lines[self.joined.get(r, 0):]:
            e = json.loads(line)
            self.say(f"round {r}: {e['u']} joined" + (f" (join slot {e['j']})" if e.get("j") else ""))
        self.joined[r] = len(lines)

    def _formed(self, r: int) -> None:
        if r in self.formed or not self.s.check([f"aegis/round/{r}/members"]):
            return
        prev = self.formed.get(r - 1)
        members = _members_of(self.s, r, prev)
        self.formed = {k: v for k, v in self.formed.items() if k >= r - 1}
        self.formed[r] = members
        line = f"round {r} formed: {len(members)} member(s)"
        if len(members) <= 16:
            line += f", in rank order {members}"
        if prev is not None:
            inside, known = set(members), set(prev)
            left = [u for u in prev if u not in inside]
            new = [u for u in members if u not in known]
            line += (f"; left: {_short(left)}" if left else "") + (f"; new: {_short(new)}" if new else "")
        self.say(line)

    def _death_log(self, r: int) -> None:
        text = _get(self.s, f"aegis/round/{r}/dead")
        if not text:
            return
        lines = [x for x in text.splitlines() if x]
        for uid in lines[self.dead.get(r, 0):]:
            self.say(f"{uid} left: declared dead by its watchers in round {r}")
        self.dead[r] = len(lines)

    def _reseeded(self) -> None:
        """A store restarted empty holds only what the members wrote back
        (:func:`~aegis.training.inprocess.storeclient.reseed`): follow from the round they
        re-seeded, and count join slots from the ones admitted before (their registrations
        went with the old store)."""
        from aegis.training.inprocess.storeclient import BASE_ROUND  # torch is loaded by now

        if self.round or self.formed or not self.s.check([BASE_ROUND]):
            return
        self.round = int(_get(self.s, BASE_ROUND) or "0")
        self.joins = self.admitted = _count(self.s, "aegis/admitted")
        self.say(f"re-seeded by the members after a restart: rounds from {self.round}, join "
                 f"slots 1..{self.admitted} admitted before")

    def poll(self) -> None:
        self._reseeded()
        r = self.round
        while True:  # the round followed, then any formed since the last pass
            self._join_log(r)
            self._formed(r)
            if r in self.formed:
                self._death_log(r)
            if r in self.formed and self.s.check([f"aegis/round/{r + 1}/count"]):
                r += 1
                continue
            break
        self.round = r
        if not self.done and self.s.check([f"aegis/round/{r}/done"]):
            self.done = True
            self.say(f"round {r} done: the job finished")
        joins = _count(self.s, "aegis/join/count")
        for i in range(self.joins + 1, joins + 1):
            uid = _get(self.s, f"aegis/join/slot/{i}")
            if uid is None:
                break
            self.joins = i
            self.say(f"{uid} registered to join the running job (join slot {i})")
        admitted = _count(self.s, "aegis/admitted")
        if admitted > self.admitted:
            self.say(f"join slots {self.admitted + 1}..{admitted} admitted")
            self.admitted = admitted


def _log(msg: str) -> None:
    click.echo(f"{datetime.now().isoformat(timespec='milliseconds')} aegis store: {msg}")
    sys.stdout.flush()


class _Health(BaseHTTPRequestHandler):
    probe: Any = None

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path.split("?")[0] not in ("/healthz", "/"):
            self.send_error(404)
            return
        try:
            doc = {"ok": True, **self.probe()}
            code = 200
        except Exception as e:  # noqa: BLE001 - any failure to answer is unhealthy
            doc, code = {"ok": False, "error": f"{type(e).__name__}: {e}"[:300]}, 503
        body = (json.dumps(doc) + "\n").encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - probes are not news
        pass


@click.group("store")
def store() -> None:
    """Run the store that the job's rendezvous and in-process recovery (AEGIS_MEMBERSHIP) use."""


@store.command("serve")
@click.option("--host", default="0.0.0.0", show_default=True, help="Address to serve on.")
@click.option("--port", type=click.IntRange(1, 65535), default=29400, show_default=True)
@click.option("--health-port", type=click.IntRange(1, 65535), default=None,
              help="Serve GET /healthz (HTTP) on this port too.")
@click.option("--poll", "poll_s", type=click.FloatRange(min=0.05), default=0.5, show_default=True,
              help="Seconds between reads of the membership keys.")
@click.option("--quiet", is_flag=True, help="No line per membership change.")
@click.option("--liveness-port", type=click.IntRange(0, 65535), default=0, show_default=True,
              help="The liveness service's port (0: any free one; it is published in the store). "
                   "Every training process holds a connection to it; one that ends without a "
                   "goodbye is a process gone, declared dead at once.")
@click.option("--no-liveness", is_flag=True, help="No liveness service (heartbeats alone).")
def serve(host: str, port: int, health_port: int | None, poll_s: float, quiet: bool,
          liveness_port: int, no_liveness: bool) -> int:
    """Host the store (a c10d TCPStore, libuv) until SIGTERM; one line per membership change."""
    from torch.distributed import TCPStore

    from aegis.training.inprocess.liveness import LivenessServer

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        server = TCPStore(host, port, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=30), use_libuv=True)
    except Exception as e:  # noqa: BLE001 - the port taken, an address not ours
        raise CliError(f"cannot serve on {host}:{port}: {e}") from None
    watch_client = _client(host, port, 10.0)
    probe_client = _client(host, port, 1.0)
    probe_lock = threading.Lock()

    def probe() -> dict[str, Any]:  # the store answers a read now; the membership last read
        with probe_lock:
            probe_client.check(["aegis/round/0/members"])
        return watcher.view

    watcher = Watcher(watch_client, _log if not quiet else (lambda m: None))
    liveness = None
    if not no_liveness:
        try:
            liveness = LivenessServer(lambda: _client(host, port, 5.0), host=host,
                                      port=liveness_port, say=_log)
        except OSError as e:
            raise CliError(f"cannot serve the liveness service on {host}:{liveness_port}: {e} "
                           "(choose another --liveness-port, or --no-liveness)") from None
        liveness.publish(watch_client)
    httpd = None
    if health_port is not None:
        handler = type("Health", (_Health,), {"probe": staticmethod(probe)})
        httpd = ThreadingHTTPServer((host, health_port), handler)
        threading.Thread(target=httpd.serve_forever, name="aegis-store-health", daemon=True).start()
    _log(f"ready on {host}:{port} (c10d TCPStore, libuv)"
         + (f", health on http://{host}:{health_port}/healthz" if httpd else "")
         + (f", liveness on port {liveness.port}" if liveness else "")
         + f"; membership read every {poll_s:g} s")
    while not stop.is_set():
        try:
            watcher.poll()
        except Exception as e:  # noqa: BLE001 - a torn read: say it, go on serving
            _log(f"membership read failed ({type(e).__name__}: {e})")
        stop.wait(poll_s)
    if httpd is not None:
        httpd.shutdown()
        httpd.server_close()
    if liveness is not None:
        liveness.close()
    del watch_client, server  # the clients, then the server: the port is free when this returns
    _log("stopped")
    return EXIT_OK


@store.command("ping")
@click.argument("address", metavar="HOST:PORT")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=0.1), default=2.0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="One JSON document on stdout.")
def ping(address: str, timeout_s: float, as_json: bool) -> int:
    """Exit 0 if the store at HOST:PORT answers a read within --timeout, else 1."""
    host, port = _addr(address)
    doc: dict[str, Any] = {"schema": "aegis.store.ping/1", "address": f"{host}:{port}", "ok": False,
                           "latency_ms": None, "round": None, "members": [], "joining": 0, "error": None}
    t0 = time.perf_counter()
    result: dict[str, Any] = {}

    def attempt() -> None:  # a client whose connect can hang on a cut link: bounded below
        try:
            # a plain connect first: nothing listening is said in one line (c10d's client
            # retries and logs a stack per attempt)
            socket.create_connection((host, port), timeout=timeout_s).close()
            c = _client(host, port, timeout_s)
            c.check(["aegis/ping"])
            result["latency_ms"] = (time.perf_counter() - t0) * 1e3
            result.update(read_state(c))
        except Exception as e:  # noqa: BLE001 - reported as not answering
            result["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else e}"[:300]

    t = threading.Thread(target=attempt, daemon=True)
    t.start()
    t.join(timeout_s + 1.0)
    if "latency_ms" not in result:
        doc["error"] = result.get("error") or f"no answer within {timeout_s:g} s"
    else:
        doc.update(ok=True, **{k: result[k] for k in ("latency_ms", "round", "members", "joining")})
    if as_json:
        click.echo(json.dumps(doc, indent=2))
    elif doc["ok"]:
        rnd = "no round formed yet" if doc["round"] is None else (
            f"round {doc['round']}, {len(doc['members'])} member(s)")
        click.echo(f"ok: {doc['address']} answered in {doc['latency_ms']:.1f} ms; {rnd}, "
                   f"{doc['joining']} waiting to join")
    else:
        click.echo(f"aegis: error: {doc['address']} did not answer: {doc['error']}", err=True)
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    return EXIT_OK if doc["ok"] else EXIT_FAILED
