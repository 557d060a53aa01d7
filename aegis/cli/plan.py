"""``aegis plan``: how often to snapshot, and what failures cost (see :mod:`aegis.goodput`).

Registered by the ``aegis`` group (``cli.add_command(plan)``). JSON schema ``aegis.plan/1``:
``cluster: {nodes, gpus_per_node, total_gpus, gpu_hour_cost}, failures: {mtbf_s, per_day,
memory_coverage}, costs: {memory: {snapshot_s, restore_s, restart_s, latency_s}, durable: {...},
step_s}, intervals: {memory: {young_s, daly_s, multi_level_s}, durable: {young_s, daly_s,
multi_level_s}}, strategies: [{name, memory_interval_s, durable_interval_s, durable_every_n,
checkpoint, recompute, restart, goodput, lost, gpu_hours_lost_per_day, cost_lost_per_day}],
measured: {sources, counts}, redundancy: {scheme, group_size, survives, memory_factor,
replica_memory_factor, node_store_gb, replica_node_store_gb, rebuild_bytes_factor}, notes: [str],
scale (with --scale): {ranks, source, projected: {commit_s|detect_s|agree_s: {value, exponent,
measured_to}}, added: {memory_latency_s, restart_s}}``
(fractions of wall-clock time; seconds; ``null`` where undefined, e.g. no price given, or no
failure needs the durable tier).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import click
from rich.table import Table

from aegis.cli._common import EXIT_OK, CliError, fmt_age, json_number, show, stdout_console
from aegis.goodput import (
    DAY_S,
    Measured,
    Plan,
    TierCosts,
    measured_from_bench,
    measured_from_events,
    scale_costs,
)
from aegis.goodput import plan as make_plan

__all__ = ["plan"]


def _dur(s: float | None) -> str:
    if s is None or not math.isfinite(s):
        return "-"
    if s < 1:
        return f"{s * 1e3:.0f} ms" if s < 0.1 else f"{s:.2f} s"
    return f"{s:.1f} s" if s < 60 else fmt_age(s)


def _steps(s: float | None, step_s: float | None) -> str:
    if s is None or not step_s:
        return _dur(s)
    return f"{_dur(s)} ({max(1, round(s / step_s))} steps)"


def _pct(x: float) -> str:
    return f"{x * 100:.2f}%"


def _clean(x: Any) -> Any:
    if isinstance(x, float):
        return json_number(x)
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_clean(v) for v in x]
    return x


def _pick(name: str, explicit: float | None, measured: float | None, fallback: float | None,
          used: dict[str, str], why: str = "") -> float:
    if explicit is not None:
        used[name] = "given"
        return explicit
    if measured is not None:
        used[name] = "measured"
        return measured
    if fallback is None:
        raise CliError(f"no {name.replace('_', ' ')}: pass --{name.replace('_', '-')} or "
                       "--events/--bench with a measurement of it")
    used[name] = why or "default"
    return fallback


@click.command("plan")
@click.option("--nodes", type=click.IntRange(min=1), required=True, help="Nodes in the job.")
@click.option("--gpus-per-node", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--gpu-hour-cost", type=click.FloatRange(min=0), default=None,
              help="Price of one GPU-hour (money columns only when given).")
@click.option("--mtbf-node-hours", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Mean time between failures of one node, hours (job MTBF = this / nodes).")
@click.option("--failures-per-day", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Interruptions of the whole job per day (instead of --mtbf-node-hours).")
@click.option("--memory-coverage", type=click.FloatRange(0, 1), default=0.9, show_default=True,
              help="Share of interruptions the memory tier recovers (replicas survive: single "
                   "node faults, process crashes); the rest needs the durable tier. The default is "
                   "an assumption: Llama 3's table of 419 interruptions has 10% that may take "
                   "more than one node or need an older state (network, corruption, dependency).")
@click.option("--snapshot-s", type=click.FloatRange(min=0), default=None,
              help="Blocking seconds of a memory snapshot (default: measured).")
@click.option("--durable-snapshot-s", type=click.FloatRange(min=0), default=None,
              help="Blocking seconds of a durable snapshot (default: measured, else --snapshot-s: "
                   "aegis uploads from the memory snapshot in the background).")
@click.option("--restore-s", type=click.FloatRange(min=0), default=None,
              help="Seconds to restore from memory (default: measured, else 0).")
@click.option("--durable-restore-s", type=click.FloatRange(min=0), default=None,
              help="Seconds to restore from the durable tier (default: measured, else the memory one).")
@click.option("--restart-s", type=click.FloatRange(min=0), default=None,
              help="Failure -> new workers up: detection, rendezvous, process start (default: measured).")
@click.option("--durable-restart-s", type=click.FloatRange(min=0), default=None,
              help="Restart before a durable-tier restore, when it differs: with in-process recovery "
                   "(aegis.run_in_process) --restart-s is the seconds survivors take to re-form in "
                   "place, and a failure the memory tier cannot cover still restarts the whole job "
                   "(default: --restart-s).")
@click.option("--memory-latency-s", type=click.FloatRange(min=0), default=None,
              help="Snapshot -> committed in memory (background; default: measured, else 0).")
@click.option("--durable-latency-s", type=click.FloatRange(min=0), default=None,
              help="Snapshot -> committed on the durable tier (upload; default: measured, else 0).")
@click.option("--step-s", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Seconds per training step, to show intervals in steps (default: measured).")
@click.option("--events", "events_dirs", type=click.Path(path_type=Path, exists=True), multiple=True,
              help="A run's events directory (rank-NNNNN.jsonl files, searched recursively).")
@click.option("--bench", "bench_files", type=click.Path(path_type=Path, exists=True, dir_okay=False),
              multiple=True, help="A bench/results/*.json file (recovery, snapshot_overhead, restore, goodput).")
@click.option("--redundancy", type=click.Choice(["replica", "xor", "rs"]), default=None,
              help="Memory redundancy: one whole replica per shard (default), XOR parity groups, "
                   "or Reed-Solomon groups (Manager(redundancy=...)). Replica and XOR survive one "
                   "lost node (per group for xor), RS --parity per group. Given (or with "
                   "--state-gb-per-node), the table ends with the node memory.")
@click.option("--group-size", type=click.IntRange(min=2), default=5, show_default=True,
              help="With --redundancy xor or rs: nodes per parity group.")
@click.option("--parity", type=click.IntRange(min=1), default=2, show_default=True,
              help="With --redundancy rs: lost nodes per group it rebuilds (Manager(parity=)).")
@click.option("--state-gb-per-node", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Training state per node (GB), to size the node store (x (keep + 1)).")
@click.option("--keep", type=click.IntRange(min=1), default=1, show_default=True,
              help="Committed snapshots kept in memory (Manager(keep=)), for the node store size.")
@click.option("--scale", "scale_file", type=click.Path(path_type=Path, exists=True, dir_okay=False),
              default=None,
              help="bench/scale.py's result (scale.json): the costs that grow with the job (commit "
                   "time per snapshot; detecting a lost node and agreeing on the next round), "
                   "fitted and evaluated at nodes x gpus-per-node ranks, are added to the memory "
                   "tier's latency and restart costs.")
@click.option("--json", "as_json", is_flag=True, help="One JSON document on stdout.")
def plan(nodes: int, gpus_per_node: int, gpu_hour_cost: float | None, mtbf_node_hours: float | None,
         failures_per_day: float | None, memory_coverage: float, snapshot_s: float | None,
         durable_snapshot_s: float | None, restore_s: float | None, durable_restore_s: float | None,
         restart_s: float | None, durable_restart_s: float | None, memory_latency_s: float | None,
         durable_latency_s: float | None,
         step_s: float | None, events_dirs: tuple[Path, ...], bench_files: tuple[Path, ...],
         redundancy: str | None, group_size: int, parity: int, state_gb_per_node: float | None,
         keep: int, scale_file: Path | None, as_json: bool) -> int:
    """Optimal snapshot intervals (Young, Daly, two-level) and the expected cost of failures:
    durable-only checkpointing against memory + durable. Costs default to the ones measured in
    a run's events (--events) or a benchmark result (--bench); explicit options override."""
    if (mtbf_node_hours is None) == (failures_per_day is None):
        raise CliError("give the failure rate: --mtbf-node-hours H or --failures-per-day N (one of them)")
    mtbf_s = (mtbf_node_hours * 3600.0 / nodes if mtbf_node_hours is not None
              else DAY_S / (failures_per_day or 1.0))
    measured = Measured()
    try:
        for d in events_dirs:
            measured = measured.merge(measured_from_events(d))
        for f in bench_files:
            measured = measured.merge(measured_from_bench(f))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CliError(f"reading measurements: {type(e).__name__}: {e}") from e
    used: dict[str, str] = {}
    mem_snap = _pick("snapshot_s", snapshot_s, measured.memory_snapshot_s, None, used)
    dur_snap = _pick("durable_snapshot_s", durable_snapshot_s, measured.durable_snapshot_s, mem_snap,
                     used, "same as memory")
    restart = _pick("restart_s", restart_s, measured.restart_s, None, used)
    dur_restart = _pick("durable_restart_s", durable_restart_s, None, restart, used, "same as memory")
    mem_restore = _pick("restore_s", restore_s, measured.memory_restore_s, 0.0, used, "default 0")
    dur_restore = _pick("durable_restore_s", durable_restore_s, measured.durable_restore_s, mem_restore,
                        used, "same as memory")
    mem_lat = _pick("memory_latency_s", memory_latency_s, measured.memory_latency_s, 0.0, used,
                    "default 0")
    dur_lat = _pick("durable_latency_s", durable_latency_s, measured.durable_latency_s, 0.0, used,
                    "default 0")
    step = step_s if step_s is not None else measured.step_s
    scale: dict[str, Any] | None = None
    if scale_file is not None:
        try:
            projected = scale_costs(json.loads(scale_file.read_text()), nodes * gpus_per_node)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CliError(f"reading {scale_file}: {type(e).__name__}: {e}") from e
        commit = projected.get("commit_s", {}).get("value", 0.0)
        find = (projected.get("detect_s", {}).get("value", 0.0)
                + projected.get("agree_s", {}).get("value", 0.0))
        # the projected cost at this job's size on top of what was given or measured (measured
        # at a few ranks, where these costs are small)
        mem_lat += commit
        restart += find
        scale = {"ranks": nodes * gpus_per_node, "source": str(scale_file), "projected": projected,
                 "added": {"memory_latency_s": commit, "restart_s": find}}
        used["memory_latency_s"] += f" + projected commit at {nodes * gpus_per_node} ranks"
        used["restart_s"] += f" + projected detection and agreement at {nodes * gpus_per_node} ranks"
    try:
        p = make_plan(
            nodes=nodes, gpus_per_node=gpus_per_node, mtbf_s=mtbf_s, memory_coverage=memory_coverage,
            memory=TierCosts(snapshot_s=mem_snap, restore_s=mem_restore, restart_s=restart,
                             latency_s=mem_lat),
            durable=TierCosts(snapshot_s=dur_snap, restore_s=dur_restore, restart_s=dur_restart,
                              latency_s=dur_lat),
            gpu_hour_cost=gpu_hour_cost, step_s=step,
        )
    except ValueError as e:
        raise CliError(str(e)) from e
    red = _redundancy(redundancy or "replica", group_size, nodes, state_gb_per_node, keep, parity)
    if as_json:
        doc = {"schema": "aegis.plan/1", **p.to_json(),
               "measured": {"sources": measured.sources, "counts": measured.counts, "used": used},
               "redundancy": red}
        if scale is not None:
            doc["scale"] = scale
        click.echo(json.dumps(_clean(doc), indent=2, allow_nan=False))
        return EXIT_OK
    _print(p, measured, used)
    if scale is not None:
        stdout_console().print(
            f"Costs that grow with the job, fitted from {scale['source']} at {scale['ranks']:,} "
            "ranks: " + ", ".join(f"{k} {_dur(v['value'])} (exponent {v['exponent']:.2f}, measured "
                                  f"to {v['measured_to']:,.0f})" for k, v in scale["projected"].items())
            + f"; added: memory latency {_dur(scale['added']['memory_latency_s'])}, restart "
            f"{_dur(scale['added']['restart_s'])}")
    if redundancy is not None or state_gb_per_node is not None:
        _print_redundancy(red)
    return EXIT_OK


def _redundancy(scheme: str, group_size: int, nodes: int, state_gb: float | None,
                keep: int, parity: int = 2) -> dict[str, Any]:
    """What the memory tier holds per node and what it survives, for ``scheme``.

    A replica doubles each node's snapshot memory; XOR parity over groups of N nodes adds
    1/(N-1) (groups of N to 2N-1 members: with fewer than N nodes, one group of all of them).
    Both survive one lost node (XOR: one per group), which is what ``--memory-coverage``
    assumes; a rebuild moves N-1 times the bytes a replica fetch moves. Reed-Solomon with k
    parity adds k/(N-k) and survives k lost nodes per group; a rebuild moves N-k times."""
    if scheme == "rs":
        n = min(group_size, nodes)
        if n < parity + 2:
            raise CliError(f"--redundancy rs with --parity {parity} needs groups of at least "
                           f"{parity + 2} nodes (2 data pieces per stripe); this plan has {n}: "
                           f"lower --parity, raise --group-size / --nodes, or use xor")
        factor = 1 + parity / (n - parity)
        survives = f"{parity} lost nodes per parity group"
        rebuild = float(n - parity)
    elif scheme == "xor":
        if nodes < 2:
            raise CliError("--redundancy xor needs at least 2 nodes (a group rebuilds a lost member "
                           "from the others)")
        n = min(group_size, nodes)
        factor = 1 + 1 / (n - 1)
        survives = "1 lost node per parity group"
        rebuild = float(n - 1)
    else:
        n = 0
        factor = 2.0 if nodes > 1 else 1.0
        survives = "1 lost node" if nodes > 1 else "nothing (one node: no other node holds a copy)"
        rebuild = 1.0
    copies = keep + 1  # kept snapshots plus the one in flight
    return {"scheme": scheme, "group_size": n or None, "survives": survives,
            "memory_factor": factor, "replica_memory_factor": 2.0 if nodes > 1 else 1.0,
            "node_store_gb": state_gb * factor * copies if state_gb else None,
            "replica_node_store_gb": state_gb * 2.0 * copies if state_gb and nodes > 1 else None,
            "rebuild_bytes_factor": rebuild}


def _print_redundancy(r: dict[str, Any]) -> None:
    console = stdout_console()
    scheme = {"replica": "whole replicas",
              "xor": f"XOR parity, groups of {r['group_size']} nodes",
              "rs": f"Reed-Solomon parity, groups of {r['group_size']} nodes"}[r["scheme"]]
    line = (f"\nmemory    {scheme}: {r['memory_factor']:.3g}x the state per node (a replica: "
            f"{r['replica_memory_factor']:.3g}x); survives {r['survives']}")
    if r["node_store_gb"] is not None:
        line += (f"; node store {r['node_store_gb']:,.1f} GB"
                 + (f" (replica: {r['replica_node_store_gb']:,.1f} GB)" if r["scheme"] != "replica"
                    and r["replica_node_store_gb"] is not None else ""))
    console.print(line)
    if r["scheme"] != "replica":
        console.print(f"{'':<10}a lost node's shard is rebuilt from {r['rebuild_bytes_factor']:.0f} survivors' pieces: "
                      f"{r['rebuild_bytes_factor']:.0f}x the bytes of a replica fetch (count it in "
                      "--restore-s)")


def _print(p: Plan, measured: Measured, used: dict[str, str]) -> None:
    console = stdout_console()
    per_day = DAY_S / p.mtbf_s
    price = f", {p.gpu_hour_cost:g} per GPU-hour" if p.gpu_hour_cost is not None else ""
    console.print(f"cluster   {p.nodes} nodes x {p.gpus_per_node} GPUs = {p.total_gpus:,} GPUs{price}")
    console.print(f"failures  {per_day:.3g}/day (job MTBF {_dur(p.mtbf_s)}); "
                  f"{p.memory_coverage:.0%} recoverable from memory")
    for name, c in (("memory", p.memory), ("durable", p.durable)):
        console.print(f"{'costs' if name == 'memory' else '':<10}{name + ':':<9}snapshot {_dur(c.snapshot_s)}, "
                      f"restore {_dur(c.restore_s)}, restart {_dur(c.restart_s)}, commit latency "
                      f"{_dur(c.latency_s)}")
    by: dict[str, list[str]] = {}
    for k, v in used.items():
        by.setdefault(v, []).append(k.removesuffix("_s").replace("_", " "))
    for v, keys in by.items():
        console.print(f"{'':<10}{v}: {', '.join(keys)}")
    for src in measured.sources:
        console.print(f"{'':<10}measured in {src}")
    if p.step_s:
        console.print(f"{'':<10}step {_dur(p.step_s)}")
    console.print("")

    t = Table(box=None, header_style="bold", pad_edge=False, title_justify="left",
              title="optimal interval (work between snapshots)")
    for col in ("tier", "recovers", "snapshot", "Young", "Daly", "multi-level"):
        t.add_column(col, justify="left" if col == "tier" else "right", no_wrap=True)
    lam = per_day
    if "memory" in p.intervals:
        iv = p.intervals["memory"]
        t.add_row("memory", f"{lam * p.memory_coverage:.3g}/day", _dur(p.memory.snapshot_s),
                  _steps(iv["young_s"], p.step_s), _steps(iv["daly_s"], p.step_s),
                  _steps(iv.get("multi_level_s"), p.step_s))
    iv = p.intervals["durable"]
    t.add_row("durable", f"{lam:.3g}/day", _dur(p.durable.snapshot_s), _steps(iv["young_s"], p.step_s),
              _steps(iv["daly_s"], p.step_s), _steps(iv.get("multi_level_s"), p.step_s))
    show(console, t)
    console.print(f"(Young and Daly: each tier alone; multi-level: memory recovers "
                  f"{p.memory_coverage:.0%}, durable the rest, {lam * (1 - p.memory_coverage):.3g}/day)")
    console.print("")

    t = Table(box=None, header_style="bold", pad_edge=False, title_justify="left",
              title="expected losses at those intervals (share of wall-clock time; lost GPU-hours "
                    "and cost per day)")
    cols = ["strategy", "memory", "durable", "checkpoint", "recompute", "restart", "goodput",
            "GPU-h/day"]
    if p.gpu_hour_cost is not None:
        cols.append("cost/day")
    for col in cols:
        t.add_column(col, justify="left" if col == "strategy" else "right", no_wrap=True)
    for s in p.strategies:
        durable = ("-" if s.durable_interval_s is None else _dur(s.durable_interval_s)
                   + (f" (n={s.durable_every_n})" if s.memory_interval_s is not None else ""))
        row = [s.name, _dur(s.memory_interval_s) if s.memory_interval_s else "-", durable,
               _pct(s.waste.checkpoint), _pct(s.waste.recompute), _pct(s.waste.restart),
               _pct(s.waste.goodput), f"{s.gpu_hours_lost_per_day:,.1f}"]
        if p.gpu_hour_cost is not None:
            row.append(f"{s.cost_lost_per_day or 0.0:,.0f}")
        t.add_row(*row)
    show(console, t)
    if len(p.strategies) == 2:
        a, b = p.strategies
        saved = a.gpu_hours_lost_per_day - b.gpu_hours_lost_per_day
        money = (f" ({saved * p.gpu_hour_cost:,.0f}/day)" if p.gpu_hour_cost is not None else "")
        console.print(f"\n{b.name} over {a.name}: goodput {_pct(b.waste.goodput - a.waste.goodput)} "
                      f"points, {saved:,.1f} GPU-hours/day{money}")
    for note in p.notes:
        console.print(f"note: {note}")
    if any(s.memory_interval_s is not None and s.durable_interval_s is not None for s in p.strategies):
        console.print("durable (n=N): every N-th snapshot is also uploaded; N - 1 memory-only ones between")
    console.print("restart = restart + restore (failures during it included); recompute = work since "
                  "the last commit")
    console.print("intervals: Young, Daly, first-order multi-level; losses: failures at any time, exact "
                  "for one level")
