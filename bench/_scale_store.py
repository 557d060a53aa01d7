"""``bench/scale.py --sections store_cost``: what one beat costs the membership store's server,
measured on an idle store (issue 40).

The relay section measures the store's CPU with simulated members that send 1-2.5 K requests/s
(37 us of server CPU per request at 1,024-2,048 relayed members), where the relays of 16,384
ranks send 20 K/s. This section runs a
TCPStore server in a process of its own and ``--store-clients`` client threads that send the
requests of one beat, with the keys of a 16,384-rank job (8 per node), together at that job's
rate (``--no-store-paced``: as fast as they can; the server's CPU per request depends on the
rate: measured here for relayed beats, 63 us per beat at 12 K requests/s from 1 client, 45 at
20 K from 2, 26-28 at 36 K from 8):

* direct: a process's ``add`` on its counter, then one ``multi_get`` of its 2 ring successors'
  counters, the round's death log and the join count (``Heartbeat.tick``);
* relayed: a node's relay's ``multi_set`` of its 8 processes' counters, then one ``multi_get``
  of the 16 counters they watch, the death log and the join count (``Heartbeat._relay_batch``).

Per beat: the server's CPU seconds over the beats sent. Projected to the job: cost per beat x
beats per second (16,384 processes, or 2,048 nodes, every 0.2 s). The direct beats of 16,384
ranks (164 K requests/s) are past what the clients reach on this machine: they run as fast as
they can, at a lower rate (the table says which).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

RANKS = 16384
PER_NODE = 8
INTERVAL_S = 0.2

_SERVER = """
import sys
from datetime import timedelta
import torch.distributed as dist
s = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                  timeout=timedelta(seconds=60))
print(s.port, flush=True)
sys.stdin.read()
"""


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        f = fh.read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def _uid(node: int, local: int) -> str:
    return f"aegis/hb/node-{node:05d}/{local}/{100000 + node * PER_NODE + local}"


def section_store_cost(args: argparse.Namespace) -> dict[str, Any]:
    import torch.distributed as dist

    server = subprocess.Popen([sys.executable, "-c", _SERVER], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline())  # type: ignore[union-attr]

        def client() -> Any:
            return dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                                 timeout=timedelta(seconds=60))

        log, joins = "aegis/round/7/dead", "aegis/join/count"
        seed = client()
        nodes = RANKS // PER_NODE
        for node in range(3):
            for local in range(PER_NODE):
                seed.set(_uid(node, local), "1")
        seed.set(log, "")
        seed.set(joins, "0")
        own = [_uid(0, local) for local in range(PER_NODE)]
        # ring interleaved by node: local rank l of node n watches local rank l of nodes n+1, n+2
        watched = [_uid(n, local) for local in range(PER_NODE) for n in (1, 2)]
        counter = [0]

        def direct(c: Any) -> None:
            c.add(own[0], 1)
            c.multi_get([watched[0], watched[1], log, joins])

        def relayed(c: Any) -> None:
            counter[0] += 1
            c.multi_set(own, [str(counter[0])] * PER_NODE)
            c.multi_get([*watched, log, joins])

        rows, out = [], {}
        for name, beat, beats_s in (
                ("direct (per process)", direct, RANKS / INTERVAL_S),
                ("relayed (per node of 8)", relayed, nodes / INTERVAL_S)):
            # paced at the job's rate (capped at what the clients reach), or as fast as they can
            pace = beats_s if args.store_paced else None
            runs = [_measure(server.pid, client, beat, args.store_clients, args.store_beats, pace)
                    for _ in range(args.store_repeats)]
            us = sorted(u for u, _ in runs)
            med = us[len(us) // 2]
            rate = sorted(2 * b for _, b in runs)[len(runs) // 2]  # requests/s sent
            cores = med * 1e-6 * beats_s
            out[name] = {"us_per_beat": us, "median_us_per_beat": med, "beats_per_s_16k": beats_s,
                         "cores_16k": cores, "requests_per_s_sent": rate}
            rows.append([name, "2", f"{med:.1f}", f"{min(us):.1f} - {max(us):.1f}", f"{rate:,.0f}",
                         f"{beats_s:,.0f}", f"{cores:.2f}"])
    finally:
        if server.stdin:
            server.stdin.close()
        server.wait(10)
    relay = out["relayed (per node of 8)"]
    direct_ = out["direct (per process)"]
    return {
        "title": "The membership store's CPU per beat, on an idle store (issue 40)",
        "params": {"clients": args.store_clients, "beats": args.store_beats,
                   "repeats": args.store_repeats, "ranks": RANKS, "per_node": PER_NODE,
                   "interval_s": INTERVAL_S},
        "results": out, "series": [],
        "table": {"headers": ["beat", "requests", "server CPU per beat (us, median)",
                              "(range over repeats)", "requests/s sent (median)",
                              f"beats/s at {RANKS:,} ranks",
                              f"store cores at {RANKS:,}"], "rows": rows},
        "notes": [
            f"A TCPStore (libuv) server in a process of its own, {args.store_clients} client "
            f"threads each sending {args.store_beats:,} beats, "
            + ("together at the job's rate where they reach it (beats/s at 16,384 ranks), else "
               "as fast as they can" if args.store_paced else "as fast as they can")
            + f", {args.store_repeats} repeats per kind; the server's CPU (user + system, "
            "/proc) over the beats sent; 'requests/s sent' is the rate the clients reached. The "
            "server's CPU per request depends on the rate (at lower rates, likely fewer requests "
            "served per wake-up of its loop). Keys as a 16,384-rank job's (8 ranks per node, ring "
            "successors on the next two nodes).",
            f"Relayed, the beats of {RANKS:,} ranks cost the store {relay['cores_16k']:.2f} cores "
            f"(issue 40: <= 0.5); beating directly {direct_['cores_16k']:.2f} at the rate its clients "
            "reached (compare the membership section's fit of direct beats in the projection "
            "table). The relay section's fit comes from simulated members sending 1-2.5 K "
            f"requests/s; the relays of {RANKS:,} ranks send "
            f"{2 * relay['beats_per_s_16k']:,.0f}/s, and this section's clients sent "
            f"{relay['requests_per_s_sent']:,.0f}/s relayed.",
        ],
    }


def _measure(pid: int, client: Callable[[], Any], beat: Callable[[Any], None], threads: int,
             beats: int, pace: float | None = None) -> tuple[float, float]:
    """(the server's CPU us per beat, beats/s sent); ``pace``: beats/s wanted from all the
    threads together (each on a fixed schedule), else as fast as they can."""
    clients = [client() for _ in range(threads)]
    for c in clients:  # warm: connections made, keys looked up once
        beat(c)

    def run(c: Any) -> None:
        if pace is None:
            for _ in range(beats):
                beat(c)
            return
        gap = threads / pace
        due = time.perf_counter()
        for _ in range(beats):
            beat(c)
            due += gap
            wait = due - time.perf_counter()
            if wait > 0:
                time.sleep(wait)

    ts = [threading.Thread(target=run, args=(c,)) for c in clients]
    cpu0, t0 = _cpu_s(pid), time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    wall = time.perf_counter() - t0
    time.sleep(0.05)  # the server's last replies
    return (_cpu_s(pid) - cpu0) / (threads * beats) * 1e6, threads * beats / wall
