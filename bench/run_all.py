#!/usr/bin/env python
"""The benchmark suite (``make bench``): every case side by side with DCP, one after the other,
each in a fresh process, then plots, ``bench/results/summary.md`` and the README's summary block.

==================  =========================================================================
snapshot_overhead   1. blocking time per snapshot across state sizes: aegis, dcp.save,
                    dcp.async_save (thread, process), memcpy floor
throughput          2. training steps/s vs snapshot interval, with and without replica, upload
restore             3. restore time by source: own / peer memory, durable S3 / directory,
                    dcp.load from a directory and through s3fs
recovery            4. node loss end to end on the simulated cluster: aegis-memory,
                    aegis-durable, DCP-to-S3 (timeline of phases, steps lost)
codec               5. durable codec per dtype: raw / zstd / byte planes
dp_replicas         6. HSDP replicas pushed whole vs built from the data-parallel copies
==================  =========================================================================

Writes ``bench/results/<case>.json`` (each with the exact command, the machine and the load
average), ``<case>.png`` (``recovery_timeline.png`` for case 4), ``run_all.json`` (what ran,
for how long, the load) and ``summary.md``, and rewrites the block between
``<!-- bench:summary:begin -->`` and ``<!-- bench:summary:end -->`` in README.md from it, so
that no number in the README is typed by hand. Default sizes fit a 2-core machine in under 10
minutes; ``--size`` multiplies every state size.

    .venv/bin/python bench/run_all.py                        # what `make bench` runs
    .venv/bin/python bench/run_all.py --size 4               # bigger states, bigger machines
    .venv/bin/python bench/run_all.py --cases codec,restore  # some cases (summary: all results)
    .venv/bin/python bench/run_all.py --render-only          # plots + summary from the JSON
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import RESULTS, ROOT, ForeignCpu, python  # noqa: E402 - bench/ on sys.path
from _machine import describe, load1, machine, replace_block  # noqa: E402

CASES = {  # name -> (title, plot file)
    "snapshot_overhead": ("1. Snapshot blocking time", "snapshot_overhead.png"),
    "throughput": ("2. Training throughput vs snapshot interval", "throughput.png"),
    "restore": ("3. Restore time by source", "restore.png"),
    "recovery": ("4. Node loss end to end", "recovery_timeline.png"),
    "codec": ("5. Durable-tier codec", "codec.png"),
    "dp_replicas": ("6. Replicas from data-parallel copies (HSDP)", None),
}
BEGIN, END = "<!-- bench:summary:begin -->", "<!-- bench:summary:end -->"
BUDGET_S = 600.0


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=float, default=1.0, help="multiply every state size")
    p.add_argument("--cases", default=",".join(CASES), help=f"subset of {','.join(CASES)}")
    p.add_argument("--render-only", action="store_true",
                   help="run nothing: plots, summary and README block from the JSON results")
    p.add_argument("--readme", type=Path, default=ROOT / "README.md",
                   help="README whose summary block is rewritten (default README.md)")
    p.add_argument("--no-readme", action="store_true", help="leave the README alone")
    args = p.parse_args(argv)
    args.cases = [c for c in args.cases.split(",") if c]
    if set(args.cases) - set(CASES):
        p.error(f"--cases: choose from {list(CASES)}")
    return args


def run_case(name: str, size: float, logs: Path) -> dict[str, Any]:
    """One case in a fresh process; its stdout (the table) is shown, stderr goes to a log."""
    cmd = [python(), f"bench/{name}.py", "--size", f"{size:g}"]
    print(f"\n=== {CASES[name][0]}: {shlex.join(cmd)}", flush=True)
    log = logs / f"{name}.log"
    t0 = time.time()
    with open(log, "wb") as err:
        proc = subprocess.run(cmd, cwd=ROOT, stderr=err, check=False,
                              env={**os.environ, "OMP_NUM_THREADS":
                                   os.environ.get("OMP_NUM_THREADS", "1")})
    secs = time.time() - t0
    print(f"=== {name}: exit {proc.returncode} in {secs:.0f} s", flush=True)
    if proc.returncode:
        tail = log.read_text(errors="replace").splitlines()[-25:]
        print("\n".join(f"    {line}" for line in tail))
    return {"command": shlex.join(cmd), "exit_code": proc.returncode, "wall_s": secs,
            "stderr_log": str(log), "load_end": load1()}


def _load(name: str) -> dict[str, Any] | None:
    p = RESULTS / f"{name}.json"
    return json.loads(p.read_text()) if p.exists() else None


def render(index: dict[str, Any], prefix: str) -> str:
    """The summary in markdown; image paths start with ``prefix`` (README: bench/results/)."""
    m = index["machine"]
    ran = index.get("cases", {})
    lines = [
        f"Generated by `{index['command']}` on {index['finished']} in "
        f"{index['wall_s'] / 60:.1f} min: {describe(m)}, gloo on loopback; 1-minute load "
        f"average {index['load_start']:.2f} at the start, {index['load_end']:.2f} at the end "
        "(other work on the machine distorts timings). Each case ran in one process, all its "
        "arms on the same state; the JSON next to each plot has every repetition, the exact "
        "command and the machine.",
    ]
    for name, (title, png) in CASES.items():
        doc = _load(name)
        lines += ["", f"#### {title}", ""]
        if doc is None:
            lines.append("not run yet")
            continue
        r = ran.get(name)
        if r and r["exit_code"]:
            lines.append(f"**This case failed (exit {r['exit_code']}); the numbers below are "
                         "from its last successful run.**\n")
        mod = importlib.import_module(name)
        lines.append(mod.summary_md(doc))
        plot = f"plot: [{png}]({prefix}{png}), " if png else ""
        lines += ["", f"`{doc['command']}` ({doc['created']}, {doc['wall_s']:.0f} s, load "
                  f"{doc['loadavg_1m']['start']:.2f} -> {doc['loadavg_1m']['end']:.2f}); "
                  f"{plot}data: [{name}.json]({prefix}{name}.json)"]
        if doc.get("errors"):
            lines.append(f"\nErrors: {json.dumps(doc['errors'])[:400]}")
        if name == "recovery":
            lines += ["", f"![recovery timeline]({prefix}{png})"]
    gpu = _load("gpu_check")
    if gpu is not None:  # written by bench/gpu_check.py on a machine with a GPU
        from gpu_check import summary_md

        lines += ["", "#### GPU check", "", summary_md(gpu), "",
                  f"`{gpu['command']}` ({gpu['created']}, {describe(gpu['machine'])}); data: "
                  f"[gpu_check.json]({prefix}gpu_check.json)"]
    return "\n".join(lines) + "\n"


def plot_all() -> None:
    for name, (_, png) in CASES.items():
        doc = _load(name)
        if doc is not None and png:
            importlib.import_module(name).plot(doc, RESULTS / png)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parse(argv)
    index_path = RESULTS / "run_all.json"
    failed = []
    if args.render_only:
        index = json.loads(index_path.read_text())
    else:
        t0 = time.time()
        cmd = shlex.join([python(), "bench/run_all.py", *argv])
        index = {"command": f"make bench` (`{cmd}" if os.environ.get("MAKELEVEL") else cmd,
                 "argv": argv, "machine": machine(),
                 "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t0)),
                 "load_start": load1(), "cases": {}}
        prev = json.loads(index_path.read_text()) if index_path.exists() else {}
        index["cases"] = {k: v for k, v in prev.get("cases", {}).items() if k not in args.cases}
        foreign = ForeignCpu()
        logs = Path(tempfile.mkdtemp(prefix="aegis-bench-logs-"))
        print(f"aegis benchmarks: {describe(index['machine'])}; load {index['load_start']:.2f}; "
              f"stderr logs in {logs}", flush=True)
        for name in args.cases:
            m = foreign.mark()
            index["cases"][name] = run_case(name, args.size, logs)
            index["cases"][name]["foreign_cpu"] = foreign.since(m)
        foreign.close()
        index["wall_s"] = time.time() - t0
        index["load_end"] = load1()
        index["finished"] = time.strftime("%Y-%m-%d %H:%M UTC")
        index_path.write_text(json.dumps(index, indent=1) + "\n")
        failed = [n for n in args.cases if index["cases"][n]["exit_code"]]
    plot_all()
    summary = render(index, "")
    (RESULTS / "summary.md").write_text("## aegis benchmarks\n\n" + summary)
    print("\n" + summary)
    if not args.no_readme:
        replace_block(args.readme, BEGIN, END, render(index, "bench/results/"))
    wall = index["wall_s"]
    print(f"total {wall:.0f} s ({wall / 60:.1f} min; budget {BUDGET_S / 60:.0f} min"
          f"{', OVER BUDGET' if wall > BUDGET_S else ''}); wrote "
          f"{(RESULTS / 'summary.md').relative_to(ROOT)} and the plots in "
          f"{RESULTS.relative_to(ROOT)}/")
    if failed:
        print(f"FAILED: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
