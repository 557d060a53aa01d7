"""Where an in-process campaign's recovery time went: per fault, the phases of the lowest
surviving rank, read from the campaign's summary JSON and its workdir (every rank's events,
``loss.jsonl``, and ``cpu.txt`` when the campaign sampled the CPUs), then the medians per
fault kind.

Phases, from the fault (``t_start``) to the first trained step after the restore (the
campaign's ``resume_s``), of the last round that rank formed before it resumed:

- ``detect``: fault -> the round's failure (``failed_at`` of the first ``recovery`` event; for
  a round that began without a failure in the training thread, its start);
- ``teardown``, ``agree``, ``regroup``: the ``recovery`` event's timings;
- ``manager_start``: the ``recovery`` event -> the Manager's ``start`` event (the round's process
  groups, the training function's model and optimizer, the Manager);
- ``restore``: the ``restore`` event's seconds;
- ``first_step``: the ``restore`` event -> the first trained step logged (of which the training
  step, ``step_time``, and the save, ``save_time``, as the trainer logged them).

With ``cpu.txt`` (the campaign samples ``/proc/stat`` every 50 ms), ``cpu_detect`` and
``cpu_after`` are the machine's mean busy fraction (all CPUs) over the detection and over the
rest of the recovery, and ``cpu_steady`` over the 5 s before the fault. For a double kill,
``resume_second`` is the second loss -> the first trained step after a restore that followed it.
``empty_admissions``: rounds from the fault until it was resolved that the survivors ended at a
snapshot to admit registered processes (cause ``regroup: ...``) and that formed no bigger than
the round before: nobody was admitted, a round change for nothing. ``stalled``: the seconds
spent in gaps of more than 1 s between two trained steps from the fault until it was resolved
(every round change counts, the ones after the resume too). ``worker_back`` (worker kills,
read from the membership store's ``store.log``): the fault -> the replacement worker's
registration to join, the least a survivor would wait if it waited for the worker instead of
going on without its node (issue 38: "or the survivors wait for it when that is quicker").

    python -m tests.chaos.phases bench/results/chaos_rs6_fp_seed53.json [--workdir DIR] [--faults] [--out F]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from aegis.sim.scenario import read_events, read_jsonl

PHASES = ("empty_admissions", "stalled", "worker_back", "detect", "teardown", "agree", "regroup", "manager_start", "restore", "first_step",
          "step_time", "save_time", "resume", "resume_second", "cpu_steady", "cpu_detect",
          "cpu_after")


def _busy(cpu: list[tuple[float, float]], a: float, b: float) -> float:
    xs = [u for t, u in cpu if a <= t <= b]
    return statistics.mean(xs) if xs else math.nan


def _began(e: dict[str, Any]) -> float:
    """When a round's predecessor failed (``failed_at``), else when its teardown began."""
    return float(e.get("failed_at") or e["time"] - sum(e["timings"].values()))


def _registrations(workdir: Path) -> list[tuple[float, str]]:
    """(time, "node-N/L") of every registration to join in the store's log."""
    out = []
    log = workdir / "store.log"
    for line in log.read_text(errors="replace").splitlines() if log.exists() else []:
        stamp, _, rest = line.partition(" aegis store: ")
        who = rest.split(" ", 1)[0]
        if "registered to join" in rest and who.count("/") == 2:
            with contextlib.suppress(ValueError):
                out.append((datetime.fromisoformat(stamp).timestamp(), who.rsplit("/", 1)[0]))
    return out


def fault_phases(rec: dict[str, Any], events: list[dict[str, Any]], losses: list[dict[str, Any]],
                 cpu: list[tuple[float, float]],
                 registrations: Sequence[tuple[float, str]] = ()) -> dict[str, float] | None:
    """The phases of one fault (see the module docstring); None when it did not resume."""
    if rec.get("resume_s") is None:
        return None
    t0 = rec["t_start"]
    end = t0 + rec["resume_s"] + 0.01
    # the rounds that began at the fault or later (a round under way when it came, e.g. one
    # admitting a joiner, is not its recovery)
    rounds = [e for e in events if e["event"] == "recovery" and t0 <= e["time"] <= end
              and e["_node"] != rec["node"] and _began(e) >= t0 - 0.05]
    if not rounds:
        return None
    rank = min(e["rank"] for e in rounds)
    mine = [e for e in rounds if e["rank"] == rank]
    first, last = mine[0], mine[-1]
    node = last["_node"]

    def after(kind: str) -> dict[str, Any] | None:
        return next((e for e in events if e["event"] == kind and e["rank"] == rank
                     and e["_node"] == node and last["time"] <= e["time"] <= end), None)

    started, restored = after("start"), after("restore")
    # the first step trained after that restore: a step the survivors finished after the fault
    # but before they noticed it (a freeze is seen only after dead_after_s) is not a resume
    since = restored["time"] if restored else t0
    step = next((x for x in losses if x["time"] > since), None)
    failed = max(t0, _began(first))
    nan = math.nan
    out = {
        "detect": failed - t0,
        "rounds": float(len(mine)),
        "teardown": last["timings"].get("teardown_s", nan),
        "agree": last["timings"].get("agree_s", nan),
        "regroup": last["timings"].get("regroup_s", nan),
        "manager_start": started["time"] - last["time"] if started else nan,
        "restore": restored["seconds"] if restored else nan,
        "first_step": step["time"] - restored["time"] if step and restored else nan,
        # (without a restore there is no first step after it: no step's timings either)
        "step_time": step.get("step_time", nan) if step and restored else nan,
        "save_time": step.get("save_time", nan) if step and restored else nan,
        "resume": rec["resume_s"],
        "resume_second": nan,
        "cpu_steady": _busy(cpu, t0 - 5.0, t0),
        "cpu_detect": _busy(cpu, t0, failed),
        "cpu_after": _busy(cpu, failed, t0 + rec["resume_s"]),
    }
    sizes: dict[int, int] = {}
    for e in events:
        if e["event"] == "recovery" and e["time"] <= rec["t_resolved"]:
            sizes[e["round"]] = e["world_size"]
    out["empty_admissions"] = float(sum(
        1 for r, w in sizes.items()
        if r - 1 in sizes and w <= sizes[r - 1] and any(
            e["event"] == "recovery" and e["round"] == r and t0 <= e["time"]
            and str(e.get("cause", "")).startswith("regroup:") for e in events)))
    times = [t0] + [x["time"] for x in losses if t0 < x["time"] <= rec["t_resolved"]]
    out["stalled"] = sum(b - a for a, b in zip(times, times[1:], strict=False) if b - a > 1.0)
    out["worker_back"] = nan
    if rec["kind"] == "worker_kill":  # rec["node"]: "node-N/L"
        back = [t for t, who in registrations if who == rec["node"] and t > t0]
        if back:
            out["worker_back"] = min(back) - t0
    t2 = rec.get("t_second")
    if t2 is not None:
        back = next((e for e in events if e["event"] == "restore" and e.get("found")
                     and e["time"] > t2), None)
        if back is not None:
            step2 = next((x for x in losses if x["time"] > back["time"]), None)
            if step2 is not None:
                out["resume_second"] = step2["time"] - t2
    return out


def _median(xs: list[float]) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    return statistics.median(xs) if xs else math.nan


def analyse(summary: dict[str, Any], workdir: Path) -> dict[str, Any]:
    events = read_events(workdir)
    losses = read_jsonl(workdir / "loss.jsonl")
    cpu_file = workdir / "cpu.txt"
    cpu = []
    if cpu_file.exists():
        for line in cpu_file.read_text().splitlines():
            parts = line.split()
            if len(parts) == 2:
                cpu.append((float(parts[0]), float(parts[1])))
    faults = []
    registrations = _registrations(workdir)
    for rec in summary["records"]:
        ph = fault_phases(rec, events, losses, cpu, registrations)
        if ph is not None:
            faults.append({"index": rec["index"], "kind": rec["kind"], "node": rec["node"], **ph})
    kinds: dict[str, list[dict[str, Any]]] = {}
    for f in faults:
        kinds.setdefault(f["kind"], []).append(f)
    medians = {k: {"faults": len(v), **{p: _median([f[p] for f in v]) for p in PHASES},
                   "empty_admissions": sum(f["empty_admissions"] for f in v)}
               for k, v in sorted(kinds.items())}
    scheme = f"{summary['redundancy']} {summary['topology']}"
    return {"scheme": scheme, "seed": summary["seed"], "workdir": str(workdir),
            "cpu_sampled": bool(cpu), "faults": faults, "medians": medians}


def _fmt(x: float, cpu: bool = False) -> str:
    if math.isnan(x):
        return "-"
    return f"{100 * x:.0f}%" if cpu else f"{x:.2f}"


def table(result: dict[str, Any]) -> str:
    head = ["kind", "n"] + [p for p in PHASES]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for kind, m in result["medians"].items():
        lines.append("| " + " | ".join([kind, str(m["faults"])] + [
            _fmt(m[p], p.startswith("cpu")) for p in PHASES]) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("summary", type=Path, help="the campaign's --out JSON")
    p.add_argument("--workdir", type=Path, help="the campaign's workdir (default: as recorded)")
    p.add_argument("--faults", action="store_true", help="print every fault's phases too")
    p.add_argument("--out", type=Path, help="write the phases as JSON")
    args = p.parse_args(argv)
    summary = json.loads(args.summary.read_text())
    workdir = args.workdir or Path(summary["config"]["workdir"])
    if not (workdir / "events").is_dir():
        print(f"no events under {workdir}: pass the campaign's workdir (--workdir)", file=sys.stderr)
        return 2
    result = analyse(summary, workdir)
    result["summary"] = str(args.summary)
    if args.faults:
        for f in result["faults"]:
            print(f["index"], f["kind"], {k: round(v, 2) for k, v in f.items()
                                          if isinstance(v, float) and not math.isnan(v)})
    print(f"{result['scheme']}, seed {result['seed']}: medians (s; cpu = the machine's busy "
          f"fraction{'' if result['cpu_sampled'] else ', not sampled'}; empty_admissions: the "
          "total)")
    print(table(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
