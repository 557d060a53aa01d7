#!/usr/bin/env python
"""When a SIGKILLed process's leader thread turns zombie, and when its TCP peer sees the
connection end (issue 25: the simulator removed a killed node's network on 'Z', before the
connection's FIN left, and the store host's liveness service missed the process).

A child process holds a connection to this one, a tensor of ``--gib`` GiB (touched) and a few
idle threads; it is SIGKILLed, and this process polls the child's ``/proc/<pid>/stat`` and the
connection until both the 'Z' and the end of the connection were seen. Per size, median of
``--repeats`` runs.

    .venv/bin/python bench/exit_order.py                    # writes bench/results/exit_order.json
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, new_doc, text_table, write_doc  # noqa: E402

from aegis.sim.procs import state  # noqa: E402

CHILD = r"""
import socket, sys, threading, time
import torch
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
x = torch.ones(int(float(sys.argv[2]) * 2**30) // 4)
for _ in range(6):
    threading.Thread(target=lambda: time.sleep(600), daemon=True).start()
print("ready", flush=True)
time.sleep(600)
"""


def once(srv: socket.socket, gib: float) -> tuple[float, float]:
    p = subprocess.Popen([sys.executable, "-c", CHILD, str(srv.getsockname()[1]), str(gib)],
                         stdout=subprocess.PIPE)
    conn, _ = srv.accept()
    assert p.stdout is not None and p.stdout.readline() == b"ready\n"
    conn.setblocking(False)
    os.kill(p.pid, signal.SIGKILL)
    t0 = time.monotonic()
    zombie = end = None
    while (zombie is None or end is None) and time.monotonic() - t0 < 10:
        if zombie is None and state(p.pid) in ("Z", None):
            zombie = time.monotonic() - t0
        if end is None:
            try:
                if conn.recv(1) == b"":
                    end = time.monotonic() - t0
            except BlockingIOError:
                pass
    p.wait()
    conn.close()
    assert zombie is not None and end is not None, "neither seen within 10 s"
    return zombie, end


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, nargs="+", default=[0.1, 1.0, 4.0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/exit_order.json")
    args = ap.parse_args(argv)
    doc = new_doc("exit_order", __file__, argv, args)
    rows, table = [], []
    with socket.create_server(("127.0.0.1", 0)) as srv:
        for gib in args.gib:
            runs = [once(srv, gib) for _ in range(args.repeats)]
            z = statistics.median(r[0] for r in runs) * 1e3
            e = statistics.median(r[1] for r in runs) * 1e3
            rows.append({"gib": gib, "runs_ms": [[a * 1e3, b * 1e3] for a, b in runs],
                         "zombie_ms_median": z, "end_ms_median": e})
            table.append([f"{gib:g}", f"{z:.2f}", f"{e:.1f}"])
    doc["rows"] = rows
    print(text_table(["GiB held", "leader 'Z' (ms)", "connection end seen (ms)"], table))
    write_doc(doc, args.out)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main(sys.argv[1:]))
