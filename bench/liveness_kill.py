#!/usr/bin/env python
"""From a SIGKILL to the store host's declaration, against the memory the killed process held.

A killed process frees its memory before it closes its files (the kernel's ``exit_mm`` comes
before ``exit_files``), so the liveness service (``aegis.training.inprocess.liveness``) hears of
a death only once the dead process's pages are freed, when the connection lives in the
process's file table. ``Link`` holds it in a thread with a table of its own, closed as that
thread exits. This script starts a TCPStore and a ``LivenessServer`` in this process, then, for
each ``--gb`` and both arms (``own``: the default; ``shared``: ``Link(own_table=False)``, as
before), a member process that touches that many GB of memory, connects its link, busies
``--busy`` threads (a trainer's compute) and is SIGKILLed; it records the time from the kill to
the server's declaration and to the process's exit (``waitpid``), alternating the arms
``--repeats`` times.

    .venv/bin/python bench/liveness_kill.py
    .venv/bin/python bench/liveness_kill.py --gb 0.01 1 4 --repeats 5
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import textwrap
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from _common import RESULTS, new_doc, write_doc  # noqa: E402 - bench/ is on sys.path

NAME = "liveness_kill"

MEMBER = textwrap.dedent("""
    import sys, threading, time
    from datetime import timedelta
    import torch.distributed as dist
    from aegis.training.inprocess.liveness import Link, published_port
    port, uid, gb, own, busy, idle = int(sys.argv[1]), sys.argv[2], float(sys.argv[3]), sys.argv[4] == "own", int(sys.argv[5]), int(sys.argv[6])
    held = bytearray(int(gb * 2**30))
    for i in range(0, len(held), 4096):
        held[i] = 1  # touched: the kernel has every page to free
    c = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    link = Link(uid, "127.0.0.1", lambda: published_port(c), retry_s=0.2, own_table=own)
    while not link.connected:
        time.sleep(0.01)
    def spin():
        while True:
            sum(range(10000))
    for _ in range(busy):
        threading.Thread(target=spin, daemon=True).start()
    for _ in range(idle):  # a trainer's threads made after the link (groups, snapshot, upload)
        threading.Thread(target=threading.Event().wait, daemon=True).start()
    print("ready", flush=True)
    time.sleep(600)
""")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gb", type=float, nargs="+", default=[0.01, 1.0, 2.0, 4.0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--busy", type=int, default=1, help="spinning threads in the member")
    p.add_argument("--idle", type=int, default=8,
                   help="threads made after the link, waiting (a trainer's groups, snapshots)")
    p.add_argument("--out", type=Path, default=RESULTS / f"{NAME}.json")
    args = p.parse_args(argv)
    doc = new_doc(NAME, __file__, argv, args)

    import torch.distributed as dist

    from aegis.training.inprocess.liveness import LivenessServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=10), use_libuv=True)

    def client() -> Any:
        return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))

    c = client()
    srv = LivenessServer(client, host="127.0.0.1")
    srv.publish(c)
    c.set("aegis/round/0/members", "{}")
    runs: list[dict[str, Any]] = []
    n = 0
    try:
        for gb in args.gb:
            for rep in range(args.repeats):
                for arm in ("shared", "own"):
                    n += 1
                    uid = f"node-{n}/0/{n}"
                    proc = subprocess.Popen(
                        [sys.executable, "-c", MEMBER, str(port), uid, str(gb), arm, str(args.busy), str(args.idle)],
                        stdout=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
                    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
                    time.sleep(0.2)
                    t_kill = time.time()
                    os.kill(proc.pid, signal.SIGKILL)
                    proc.wait()
                    t_exit = time.time()
                    deadline = time.monotonic() + 10
                    while not any(u == uid for u, _, _ in srv.declared) and time.monotonic() < deadline:
                        time.sleep(0.001)
                    t_decl = next((t for u, _, t in srv.declared if u == uid), None)
                    rec = {"gb": gb, "arm": arm, "repeat": rep, "exit_s": t_exit - t_kill,
                           "declared_s": None if t_decl is None else t_decl - t_kill}
                    runs.append(rec)
                    print(f"{gb:5.2f} GB {arm:>6}: declared "
                          f"{'never' if t_decl is None else f'{(t_decl - t_kill) * 1e3:7.1f} ms'}, "
                          f"exited {(t_exit - t_kill) * 1e3:7.1f} ms", flush=True)
    finally:
        srv.close()
        del c, store
    summary: dict[str, Any] = {}
    for gb in args.gb:
        for arm in ("shared", "own"):
            vals = [r["declared_s"] for r in runs if r["gb"] == gb and r["arm"] == arm
                    and r["declared_s"] is not None]
            summary[f"{gb:g} GB {arm}"] = {"declared_median_ms": statistics.median(vals) * 1e3 if vals else None,
                                          "declared_max_ms": max(vals) * 1e3 if vals else None,
                                          "n": len(vals)}
    doc["runs"] = runs
    doc["summary"] = summary
    for k, v in summary.items():
        print(f"{k:>14}: declared median {v['declared_median_ms']:.1f} ms, max {v['declared_max_ms']:.1f} ms")
    write_doc(doc, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
