#!/usr/bin/env python
"""Goodput on the simulated cluster: measured effective training time against the planner.

The reference trainer (``examples/train_fsdp.py --config tiny``, ``--step-sleep`` per step)
runs on ``--nodes`` simulated nodes (``aegis.sim.cluster.SimCluster``, 1 rank per node) for a
fixed window of ``--failures`` x ``--mtbf`` seconds of wall clock, counted from the end of step
1. A node is SIGKILLed (its store deleted, a replacement joins) at ``mtbf/2 + i * mtbf`` into
the window: a fixed rate, every failure at an unrelated point of the snapshot pattern.

1. **calibration** (no failure): a snapshot and an upload every step for ``--calib-steps``
   steps; the planner (:mod:`aegis.goodput`) turns the measured blocking time, upload time and
   step time into intervals: memory every ``E = round(Daly(C, M) / step)`` steps, durable every
   ``D = round(max(Daly(C_durable, M), upload) / step)`` steps.
2. **(a) memory + durable**: ``--every E --replicas 1``, durable every ``D`` rounded to a
   multiple of ``E``: every loss is recovered from peer memory.
3. **(b) durable only**: ``--every D --durable-every D --replicas 0``. Each rank still stages
   its shard in its node store (that is how aegis uploads in the background), but with no
   replica a lost node's shard exists only on the durable tier, so every recovery goes back to
   the newest durable step (the survivors read their own shards of it locally, the replacement
   downloads its shard). Memory snapshots are taken only at durable steps.
4. **(c) memory + durable, in-process**: as (a), with ``--in-process``
   (``aegis.run_in_process``, min world ``nodes - 1``): the survivors re-form their groups and
   restore in place; the replacement (its own torchrun rendezvous) joins at a snapshot. Its
   restart is the kill -> first step after the shrink's restore, plus the survivors' stall
   while the replacement is admitted (the grow's restore). The planner is given that restart
   time; the restart share should fall against (a) by the ratio of the two restart times.

Measured per arm, from the rank-0 loss log and the kill times: the step time ``t`` (mean
wall time between consecutive steps, less the save); effective training time = (last step at
the end of the window - 1) x ``t`` / window; and its parts: checkpoint (save time), restart
(kill -> end of the first resumed step, less one step), recompute (steps redone after the
restore, plus the partial step at the kill). Predicted: :func:`aegis.goodput.two_level_waste`
(a) / :func:`aegis.goodput.waste` (b) at the intervals run, with the costs measured in the same
run (blocking and commit latency from the events, restart from the kills) and ``M`` = window /
failures. Target: |measured - predicted| <= 5 percentage points for both arms. Shown next to
it, not a target: the prediction with the restart time that ``aegis plan --events`` estimates
from the events alone (no kill times), plus the restore.

    .venv/bin/python bench/goodput.py                # ~8 min on 2 cores
    .venv/bin/python bench/goodput.py --mtbf 30 --failures 2 --calib-steps 15   # quick look
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _machine import git_info, machine_basics, replace_block  # noqa: E402 - bench/ is on sys.path as a script

ROOT = Path(__file__).resolve().parent.parent
GUIDE = ROOT / "docs" / "guides" / "planning.md"  # the guide that holds the goodput block
sys.path.insert(0, str(ROOT))

from aegis.goodput import (  # noqa: E402
    TierCosts,
    daly_interval,
    measured_from_events,
    plan,
    two_level_waste,
    waste,
)
from aegis.sim.scenario import read_events, read_jsonl  # noqa: E402

TRAINER = str(ROOT / "examples" / "train_fsdp.py")
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "goodput.json"
TARGET_PP = 5.0


def _step_time(records: list[dict[str, Any]], sleep_s: float, kills: Sequence[float] = ()) -> float:
    """Mean wall time of an uninterrupted step, without its save: consecutive records (steps
    slowed by background snapshot work count as useful time, as the planner assumes). A gap
    with a kill in it is a restart, not a step, even when the job resumed right after the last
    step it logged (restored step = last step before the kill: the two records are consecutive)."""
    gaps = [b["time"] - a["time"] - b["save_time"] for a, b in zip(records, records[1:], strict=False)
            if b["step"] == a["step"] + 1 and b["time"] - a["time"] < 10 * (sleep_s + 1.0)
            and not any(a["time"] < k <= b["time"] for k in kills)]
    if not gaps:
        raise RuntimeError("no two consecutive steps logged")
    return statistics.fmean(gaps)


def _cluster(work: Path, name: str, train: list[str], nodes: int) -> Any:
    from aegis.sim.cluster import SimCluster

    return SimCluster(work, [TRAINER, *train], nodes=nodes, job=name,
                      store_root=f"/dev/shm/aegis-bench-goodput-{os.getpid()}-{name}")


def _train_args(args: argparse.Namespace, name: str, work: Path, every: int, durable_every: int,
                replicas: int, steps: int) -> list[str]:
    return ["--config", args.config, "--steps", str(steps), "--batch-size", str(args.batch_size),
            "--job", name, "--every", str(every), "--keep", "1", "--replicas", str(replicas),
            "--durable", f"file://{work / 'durable'}", "--durable-every", str(durable_every),
            "--loss-log", str(work / "loss.jsonl"), "--step-sleep", str(args.step_sleep)]


def calibrate(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """A snapshot and an upload every step, no failure: what the planner needs."""
    work.mkdir(parents=True)
    cluster = _cluster(work, "calib", _train_args(args, "calib", work, 1, 1, 1, args.calib_steps),
                       args.nodes)
    try:
        cluster.start()
        codes = cluster.wait(args.arm_timeout)
    finally:
        cluster.shutdown()
    if any(c != 0 for c in codes.values()):
        raise RuntimeError(f"calibration failed: exit codes {codes}; see {work}")
    records = read_jsonl(work / "loss.jsonl")
    t = _step_time(records, args.step_sleep)
    m = measured_from_events(work / "events")
    c_mem = m.memory_snapshot_s or 0.0
    c_dur = m.durable_snapshot_s or c_mem
    upload = m.durable_latency_s or 0.0
    t_mem = daly_interval(c_mem, args.mtbf)
    t_dur = max(daly_interval(c_dur, args.mtbf), upload)
    every = max(1, round(t_mem / t))
    durable_every = max(1, round(t_dur / t))
    return {
        "step_s": t, "memory_snapshot_s": c_mem, "durable_snapshot_s": c_dur,
        "durable_latency_s": upload, "memory_latency_s": m.memory_latency_s,
        "daly_memory_s": t_mem, "daly_durable_s": daly_interval(c_dur, args.mtbf),
        "durable_interval_s": t_dur, "memory_every": every, "durable_every": durable_every,
        "snapshots": m.counts.get("snapshots"), "uploads": m.counts.get("uploads"),
    }


def run_arm(args: argparse.Namespace, name: str, work: Path, every: int, durable_every: int,
            replicas: int, *, in_process: bool = False) -> dict[str, Any]:
    """Train for the window, losing a node every ``mtbf`` seconds; measure what happened."""
    work.mkdir(parents=True)
    loss_log = work / "loss.jsonl"
    window = args.failures * args.mtbf
    train = _train_args(args, name, work, every, durable_every, replicas, 1_000_000)
    if in_process:
        train += ["--in-process", "--min-world", str(args.nodes - 1)]
    cluster = _cluster(work, name, train, args.nodes)
    kills: list[dict[str, Any]] = []
    try:
        cluster.start()
        deadline = time.monotonic() + args.arm_timeout
        while not read_jsonl(loss_log):
            if time.monotonic() > deadline or not cluster.alive_nodes():
                raise RuntimeError(f"{name}: step 1 was never logged; see {work}")
            time.sleep(0.05)
        t_start = read_jsonl(loss_log)[0]["time"]
        for i in range(args.failures):
            t_at = t_start + args.mtbf / 2 + i * args.mtbf
            while time.time() < t_at:
                time.sleep(0.01)
            alive = sorted(cluster.alive_nodes(), key=lambda n: cluster.nodes[n].index)
            victim = alive[(i + 1) % len(alive)]
            t_kill = cluster.kill_node(victim)
            replacement = cluster.add_node(solo=in_process).node_id
            kills.append({"t_kill": t_kill, "offset_s": t_kill - t_start, "node": victim,
                          "replacement": replacement})
        t_end = t_start + window
        while time.time() < t_end:
            time.sleep(0.01)
        alive_at_end = cluster.alive_nodes()
    finally:
        cluster.shutdown()
    records = [r for r in read_jsonl(loss_log) if r["time"] <= t_end]
    events = read_events(work)
    t = _step_time(records, args.step_sleep, [k["t_kill"] for k in kills])
    restores = [e for e in events if e["event"] == "restore" and e.get("found") and e["rank"] == 0]
    firsts: set[int] = set()
    restart_s: list[float] = []
    recompute_s: list[float] = []
    for k in kills:
        after = [e for e in restores if e["time"] > k["t_kill"]]
        if not after:
            raise RuntimeError(f"{name}: no restore after the kill at {k['offset_s']:.1f} s; see {work}")
        rs = after[0]
        before = [i for i, r in enumerate(records) if r["time"] < rs["time"]]
        resumed = [i for i, r in enumerate(records) if r["time"] > rs["time"]]
        if not before or not resumed:
            raise RuntimeError(f"{name}: the job did not resume within the window; see {work}")
        last, first = records[before[-1]], records[resumed[0]]
        firsts.add(resumed[0])
        k.update(restored_step=rs["step"], last_step_before=last["step"], resumed_step=first["step"],
                 restore_s=max(e.get("seconds", 0.0) for e in events
                               if e["event"] == "restore" and e.get("found")
                               and abs(e["time"] - rs["time"]) < 10),
                 restore_sources=sorted({s.get("source", s["tier"]) for s in rs.get("sources", [])}))
        restart_s.append(first["time"] - k["t_kill"] - t)
        recompute_s.append((last["step"] - rs["step"]) * t + max(0.0, k["t_kill"] - last["time"]))
        if in_process:
            # the replacement admitted at a snapshot: every rank re-forms and reshards once more
            grow = next((e for e in restores if e["time"] > rs["time"]
                         and e.get("world_size") == args.nodes), None)
            if grow is not None:
                g_before = [r for r in records if r["time"] < grow["time"]]
                g_after = [i for i, r in enumerate(records) if r["time"] > grow["time"]]
                if g_before and g_after:
                    firsts.add(g_after[0])
                    stall = records[g_after[0]]["time"] - g_before[-1]["time"] - t
                    k.update(grow_stall_s=stall, grow_step=grow["step"])
                    restart_s[-1] += stall
        k.update(restart_s=restart_s[-1], recompute_s=recompute_s[-1])
    last_step = records[-1]["step"]
    useful = (last_step - 1) * t
    checkpoint = sum(r["save_time"] for i, r in enumerate(records) if i > 0 and i not in firsts)
    measured = {
        "effective": useful / window,
        "checkpoint": checkpoint / window,
        "restart": sum(restart_s) / window,
        "recompute": sum(recompute_s) / window,
    }
    measured["unaccounted"] = 1.0 - sum(measured.values())
    m = measured_from_events(work / "events")
    return {
        "name": name, "every": every, "durable_every": durable_every, "replicas": replicas,
        "in_process": in_process,
        "window_s": window, "t_start": t_start, "t_end": t_end, "step_s": t,
        "last_step": last_step, "kills": kills, "alive_at_end": alive_at_end,
        "measured": measured,
        "costs": {"memory_snapshot_s": m.memory_snapshot_s, "durable_snapshot_s": m.durable_snapshot_s,
                  "memory_latency_s": m.memory_latency_s, "durable_latency_s": m.durable_latency_s,
                  "restart_s": statistics.fmean(restart_s), "restart_s_each": restart_s,
                  "memory_restore_s": m.memory_restore_s, "durable_restore_s": m.durable_restore_s,
                  "events_restart_s": m.restart_s, "events_counts": m.counts},
        "workdir": str(work),
    }


def predict(arm: dict[str, Any], failures: int, *, events_only: bool = False) -> dict[str, Any]:
    """The planner's expected goodput for what the arm ran, from the costs measured in it.

    ``events_only``: the restart as ``aegis plan --events`` estimates it without the kill
    times (the gap before the next ``start`` event, plus the restore), not from the kills."""
    c = arm["costs"]
    t = arm["step_s"]
    mtbf = arm["window_s"] / failures
    c_mem = c["memory_snapshot_s"] or 0.0
    c_dur = c["durable_snapshot_s"] if c["durable_snapshot_s"] is not None else c_mem
    restart = c["restart_s"]  # kill -> training again: restart and restore together
    if events_only:
        restore = c["memory_restore_s"] if arm["replicas"] > 0 else c["durable_restore_s"]
        restart = (c["events_restart_s"] or 0.0) + (restore or 0.0)
    if arm["replicas"] > 0:
        n = max(1, arm["durable_every"] // arm["every"])
        mem = TierCosts(snapshot_s=c_mem, restart_s=restart, latency_s=c["memory_latency_s"] or 0.0)
        dur = TierCosts(snapshot_s=c_dur, restart_s=restart, latency_s=c["durable_latency_s"] or 0.0)
        w = two_level_waste(arm["every"] * t, n, mem, dur, 1.0 / mtbf, 0.0)
        p = plan(nodes=3, gpus_per_node=1, mtbf_s=mtbf, memory=mem, durable=dur, memory_coverage=1.0)
    else:
        dur = TierCosts(snapshot_s=c_dur, restart_s=restart, latency_s=c["durable_latency_s"] or 0.0)
        w = waste(arm["every"] * t, dur, mtbf)
        p = plan(nodes=3, gpus_per_node=1, mtbf_s=mtbf, memory=dur, durable=dur, memory_coverage=0.0)
    at_optimum = {s.name: s.waste.goodput for s in p.strategies}
    return {"mtbf_s": mtbf, "effective": w.goodput, "checkpoint": w.checkpoint,
            "recompute": w.recompute, "restart": w.restart, "plan_goodput_at_its_optimum": at_optimum}


def command_line(argv: Sequence[str]) -> str:
    """The command that ran, relative to the repository: a result names no path of the machine
    it ran on (the project's venv interpreter as ``.venv/bin/python``, another one by name)."""
    exe = Path(sys.executable)
    py = str(exe.relative_to(ROOT)) if exe.is_relative_to(ROOT) else exe.name
    return shlex.join([py, "bench/goodput.py", *argv])


def portable_command(cmd: str) -> str:
    """``cmd`` with absolute paths into a repository (``/x/.venv/bin/python``,
    ``/x/bench/goodput.py``) made relative to it, for results recorded before
    :func:`command_line`."""
    out = []
    for part in shlex.split(cmd):
        if os.path.isabs(part):
            for marker in ("/.venv/", "/bench/"):
                if marker in part:
                    part = part[part.rindex(marker) + 1:]
                    break
        out.append(part)
    return shlex.join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mtbf", type=float, default=45.0, help="seconds between node losses")
    p.add_argument("--failures", type=int, default=4, help="node losses per arm (window = failures x mtbf)")
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--config", default="tiny")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--step-sleep", type=float, default=0.2, help="seconds slept per step (the 'GPU work')")
    p.add_argument("--calib-steps", type=int, default=25)
    p.add_argument("--arm-timeout", type=float, default=180.0, help="bound on start-up and calibration")
    p.add_argument("--workdir", default=None)
    p.add_argument("--keep-workdir", action="store_true")
    p.add_argument("--out", default=str(DEFAULT_OUT))
    p.add_argument("--no-readme", action="store_true", help="leave the planning guide's result block alone")
    p.add_argument("--render-only", action="store_true",
                   help="run nothing: print the result in --out and rewrite the planning guide's block")
    args = p.parse_args(argv)
    if args.render_only:
        doc = json.loads(Path(args.out).read_text())
        print(render(doc))
        if not args.no_readme:
            replace_block(GUIDE, README_BEGIN, README_END, render(doc))
        return 0
    t0 = time.time()
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="aegis-bench-goodput-"))
    doc: dict[str, Any] = {
        "bench": "goodput", "command": command_line(sys.argv[1:] if argv is None else argv), "argv": sys.argv[1:],
        "args": vars(args), "machine": machine_basics(), "git": git_info(), "started": t0,
        "loadavg_1m": {"start": os.getloadavg()[0]},
    }
    try:
        cal = calibrate(args, work / "calib")
        doc["calibration"] = cal
        doc["loadavg_1m"]["after calibration"] = os.getloadavg()[0]
        print(f"calibration: step {cal['step_s'] * 1e3:.0f} ms, blocking {cal['memory_snapshot_s'] * 1e3:.1f} ms "
              f"(durable steps {cal['durable_snapshot_s'] * 1e3:.1f} ms), upload {cal['durable_latency_s'] * 1e3:.0f} ms"
              f" -> memory every {cal['memory_every']}, durable every {cal['durable_every']} steps", flush=True)
        e, d = cal["memory_every"], cal["durable_every"]
        arms = [("a", "memory + durable", e, e * max(1, round(d / e)), 1, False),
                ("b", "durable only", d, d, 0, False),
                ("c", "memory + durable, in-process", e, e * max(1, round(d / e)), 1, True)]
        results = []
        for key, label, every, durable_every, replicas, inproc in arms:
            arm = run_arm(args, f"arm-{key}", work / f"arm-{key}", every, durable_every, replicas,
                          in_process=inproc)
            arm["label"] = f"({key}) {label}"
            arm["predicted"] = predict(arm, args.failures)
            arm["predicted_events_only"] = predict(arm, args.failures, events_only=True)
            arm["diff_pp"] = 100 * (arm["measured"]["effective"] - arm["predicted"]["effective"])
            arm["pass"] = abs(arm["diff_pp"]) <= TARGET_PP
            results.append(arm)
            doc["loadavg_1m"][f"after {key}"] = os.getloadavg()[0]
            print(f"{arm['label']}: measured {arm['measured']['effective']:.1%}, predicted "
                  f"{arm['predicted']['effective']:.1%}", flush=True)
        doc["arms"] = results
        a, b, c = results
        doc["in_process_vs_restart"] = {
            "restart_s": [a["costs"]["restart_s"], c["costs"]["restart_s"]],
            "predicted_restart_share": [a["predicted"]["restart"], c["predicted"]["restart"]],
            "measured_restart_share": [a["measured"]["restart"], c["measured"]["restart"]],
            "predicted_factor": a["costs"]["restart_s"] / c["costs"]["restart_s"],
            "measured_factor": (a["measured"]["restart"] / c["measured"]["restart"]
                                if c["measured"]["restart"] else None),
        }
        doc["planner_costs"] = {
            "memory_snapshot_s": a["costs"]["memory_snapshot_s"],
            "durable_snapshot_s": b["costs"]["durable_snapshot_s"],
            "memory_restore_s": a["costs"]["memory_restore_s"],
            "durable_restore_s": b["costs"]["durable_restore_s"],
            "restart_s": a["costs"]["restart_s"] - (a["costs"]["memory_restore_s"] or 0.0),
            "memory_latency_s": a["costs"]["memory_latency_s"],
            "durable_latency_s": b["costs"]["durable_latency_s"],
            "step_s": a["step_s"],
        }
        doc["targets"] = [{"target": f"{r['label']}: |measured - predicted| <= {TARGET_PP:g} pp",
                           "value_pp": r["diff_pp"], "pass": r["pass"]} for r in results]
    finally:
        doc["wall_s"] = time.time() - t0
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(doc, indent=1, default=str) + "\n")
        if not args.keep_workdir and "arms" in doc:
            shutil.rmtree(work, ignore_errors=True)
    print("\n" + render(doc))
    if "targets" in doc and not args.no_readme:
        replace_block(GUIDE, README_BEGIN, README_END, render(doc))
    return 0 if all(t["pass"] for t in doc.get("targets", [{"pass": False}])) else 1


README_BEGIN, README_END = "<!-- goodput:begin -->", "<!-- goodput:end -->"


def render(doc: dict[str, Any]) -> str:
    """The result as markdown: targets, then the parts of the lost time, then the run."""
    out = ["| arm | every (memory / durable) | step | failures | restart s | blocking ms | "
           "predicted | measured | diff (pp) | target | predicted, events only |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc["arms"]:
        c = r["costs"]
        mem = str(r["every"]) if r["replicas"] else "-"
        blocking = c["memory_snapshot_s"] if r["replicas"] else (c["durable_snapshot_s"] or c["memory_snapshot_s"])
        out.append(
            f"| {r['label']} | {mem} / {r['durable_every']} | {r['step_s'] * 1e3:.0f} ms | {len(r['kills'])} | "
            f"{c['restart_s']:.1f} | {(blocking or 0) * 1e3:.1f} | {r['predicted']['effective']:.1%} | "
            f"{r['measured']['effective']:.1%} | {r['diff_pp']:+.1f} | {'PASS' if r['pass'] else 'FAIL'} | "
            f"{r['predicted_events_only']['effective']:.1%} (restart {c['events_restart_s'] or 0:.1f} s) |")
    out += ["", "| arm | | checkpoint | recompute | restart | effective | unaccounted |",
            "|---|---|---|---|---|---|---|"]
    for r in doc["arms"]:
        for kind in ("predicted", "measured"):
            x = r[kind]
            extra = f"{x['unaccounted']:+.1%}" if kind == "measured" else ""
            out.append(f"| {r['label']} | {kind} | {x['checkpoint']:.1%} | {x['recompute']:.1%} | "
                       f"{x['restart']:.1%} | {x['effective']:.1%} | {extra} |")
    ip = doc.get("in_process_vs_restart")
    if ip:
        out += ["", f"In-process against restart (arms (c) and (a)): restart {ip['restart_s'][0]:.1f} s -> "
                f"{ip['restart_s'][1]:.1f} s, so the restart share should fall {ip['predicted_factor']:.1f}x "
                f"(predicted {ip['predicted_restart_share'][0]:.1%} -> {ip['predicted_restart_share'][1]:.1%}); "
                f"measured {ip['measured_restart_share'][0]:.1%} -> {ip['measured_restart_share'][1]:.1%} "
                f"({ip['measured_factor']:.1f}x)." if ip["measured_factor"] else ""]
    m = doc["machine"]
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(doc["started"]))
    out += ["", f"`{portable_command(doc['command'])}` ({started}, {doc['wall_s'] / 60:.1f} min; {m['cpu_count']} cores, "
            f"{m['MemTotal_kib'] / 2**20:.0f} GiB; load {doc['loadavg_1m']['start']:.2f} at the start); "
            "data: [bench/results/goodput.json](../../bench/results/goodput.json)"]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.exit(main())
