"""The goodput planner: published Young/Daly values, the two-level model against a brute-force
Monte-Carlo simulation, ``aegis plan``, and ``Manager(every="auto")`` on real gloo ranks."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from aegis import ConfigError, Manager, ModelOptimizerState
from aegis.cli.plan import plan as plan_cmd
from aegis.goodput import (
    AutoInterval,
    TierCosts,
    daly_interval,
    measured_from_bench,
    measured_from_events,
    plan,
    two_level_optimum,
    two_level_waste,
    waste,
    young_interval,
)
from tests.dist_utils import run_ranks

# -- published values ----------------------------------------------------------------------------


@pytest.mark.quick
@pytest.mark.parametrize("mtbf_min, daly_min, tol", [(24 * 60, 117, 0.5), (6 * 60, 57, 0.5), (15, 9.1, 0.05)])
def test_daly_reproduces_the_published_optima(mtbf_min: float, daly_min: float, tol: float) -> None:
    # Daly (2006), Figs. 3-5: dump time 5 min, restart 10 min; M = 24 h, 6 h, 15 min -> the
    # model predicts 117, 57 and 9.1 min (minutes in, minutes out: the formula is scale-free).
    assert daly_interval(5.0, mtbf_min) == pytest.approx(daly_min, abs=tol)
    assert daly_interval(5.0 * 60, mtbf_min * 60) == pytest.approx(daly_min * 60, abs=tol * 60)


@pytest.mark.quick
def test_young_first_order_values() -> None:
    # Young (1974): T = sqrt(2 C M); Daly's three cases give 120, 60 and sqrt(150) minutes.
    assert young_interval(5.0, 24 * 60) == pytest.approx(120.0)
    assert young_interval(5.0, 6 * 60) == pytest.approx(60.0)
    assert young_interval(5.0, 15) == pytest.approx(math.sqrt(150.0))
    # Daly's estimate approaches Young's (less C) as C/M -> 0, and is M once C >= 2M.
    assert daly_interval(1.0, 1e8) == pytest.approx(young_interval(1.0, 1e8) - 1.0, rel=1e-3)
    assert daly_interval(30.0, 10.0) == 10.0
    assert daly_interval(0.0, 100.0) == 0.0
    with pytest.raises(ValueError):
        young_interval(1.0, 0.0)


@pytest.mark.quick
def test_waste_is_the_textbook_first_order_model() -> None:
    # Small C/M: lost ~= C/T + (T/2 + R)/M.
    c, r, m = 0.1, 10.0, 1e5
    t = daly_interval(c, m)
    w = waste(t, TierCosts(snapshot_s=c, restart_s=r), m)
    assert w.lost == pytest.approx(c / t + (t / 2 + r) / m, rel=0.02)
    assert w.checkpoint + w.recompute + w.restart + w.goodput == pytest.approx(1.0)
    assert w.restart == pytest.approx(r / m, rel=1e-3)  # 1 - exp(-R/M)
    # Restarts longer than the MTBF still finish now and then (a failure during one starts it
    # over): little goodput, not none.
    w = waste(10.0, TierCosts(snapshot_s=1.0, restart_s=100.0), 50.0)
    exact = 10.0 / (math.exp(100.0 / 50.0) * math.expm1(11.0 / 50.0) * 50.0)
    assert w.goodput == pytest.approx(exact) and 0 < w.goodput < 0.15
    # Losing more than everything (a commit latency far beyond the MTBF) is nothing left, not
    # a negative goodput.
    w = waste(10.0, TierCosts(snapshot_s=1.0, latency_s=1000.0), 50.0)
    assert w.goodput == 0.0 and w.checkpoint + w.restart + w.recompute == pytest.approx(1.0)


@pytest.mark.quick
def test_two_level_closed_form() -> None:
    mem = TierCosts(snapshot_s=0.5)
    dur = TierCosts(snapshot_s=8.0)
    lam1, lam2 = 1 / 100.0, 1 / 2000.0
    t1, n = two_level_optimum(mem, dur, lam1, lam2)
    x = math.sqrt((8.0 - 0.5) * lam1 / (0.5 * lam2))  # Benoit et al. 2017: n* = sqrt(...)
    assert n in (math.floor(x), math.ceil(x))
    assert n * t1 == pytest.approx(math.sqrt(2 * ((n - 1) * 0.5 + 8.0) / (lam1 / n + lam2)))
    # One level: Young's formula.
    t, n1 = two_level_optimum(dur, dur, 0.0, lam2)
    assert n1 == 1 and t == pytest.approx(young_interval(8.0, 1 / lam2))
    # A durable snapshot that costs no more than a memory one: every snapshot is durable.
    assert two_level_optimum(mem, mem, lam1, lam2)[1] == 1


# -- the model against a brute-force simulation ------------------------------------------------


def simulate(t1: float, n: int, mem: TierCosts, dur: TierCosts, lam1: float, lam2: float,
             horizon: float, reps: int, seed: int) -> tuple[float, float]:
    """Monte-Carlo goodput of the two-level pattern: mean over ``reps`` runs of ``horizon``
    seconds, and its standard error.

    The process played out, event by event, with no formula of the model: failures arrive at
    ``lam1 + lam2`` per second of wall clock at all times, recoveries included (exponential
    gaps); ``lam2/(lam1+lam2)`` of them need the durable tier. A failure while running rolls
    the position back to the newest snapshot of its tier whose commit (end of the copy + the
    tier's latency) came before the failure; a failure during a recovery drops that recovery
    and starts its own (a durable one also rolls back to the newest durable snapshot). A
    recovery takes ``restart_s + restore_s``. Goodput: work content of the final position /
    horizon.
    """
    rng = np.random.default_rng(seed)
    s1, s2 = t1 + mem.snapshot_s, t1 + dur.snapshot_s
    period = (n - 1) * s1 + s2
    lam = lam1 + lam2
    wall = np.zeros(reps)
    x = np.zeros(reps)  # position on the failure-free timeline
    xd = np.zeros(reps)  # the newest durable snapshot committed before the last failure
    rec = np.zeros(reps)  # recovery time left (0: running)
    alive = np.ones(reps, dtype=bool)
    while alive.any():
        gap = rng.exponential(1.0 / lam, reps)
        durable = rng.random(reps) < lam2 / lam
        cost = np.where(durable, dur.recovery_s, mem.recovery_s)
        recovering = alive & (rec > 0)
        # -- recovering: done before the next failure (memoryless: the rest of the gap goes), or not
        end = recovering & (wall + np.minimum(gap, rec) >= horizon)
        alive &= ~end
        recovering &= ~end
        done = recovering & (gap >= rec)
        hit = recovering & ~done
        wall = np.where(done, wall + rec, np.where(hit, wall + gap, wall))
        x = np.where(hit & durable, xd, x)
        rec = np.where(done, 0.0, np.where(hit, cost, rec))
        # -- running: the next failure after ``gap`` seconds of running
        run = alive & ~recovering & ~done & ~hit
        end = run & (wall + gap >= horizon)
        x = np.where(end, x + (horizon - wall), x)
        alive &= ~end
        run &= ~end
        xf = x + gap
        y = xf - mem.latency_s
        k = np.floor(y / period)
        j = np.minimum(np.floor((y - k * period) / s1), n - 1)
        back_mem = np.where(y < 0, 0.0, k * period + j * s1)
        y2 = xf - dur.latency_s
        back_dur = np.where(y2 < 0, 0.0, np.floor(y2 / period) * period)
        x = np.where(run, np.where(durable, back_dur, back_mem), x)
        xd = np.where(run, back_dur, xd)
        wall = np.where(run, wall + gap, wall)
        rec = np.where(run, cost, rec)
    k = np.floor(x / period)
    j = np.minimum(np.floor((x - k * period) / s1), n - 1)
    work = k * n * t1 + j * t1 + np.minimum(x - k * period - j * s1, t1)
    g = work / horizon
    return float(g.mean()), float(g.std(ddof=1) / math.sqrt(reps))


MEM = TierCosts(snapshot_s=0.5, restore_s=1.0, restart_s=2.0, latency_s=0.2)
DUR = TierCosts(snapshot_s=2.0, restore_s=8.0, restart_s=2.0, latency_s=5.0)
LAM1, LAM2 = 1 / 100.0, 1 / 1000.0


def _tolerance(se: float, t1: float, n: int) -> float:
    """4 standard errors (a false failure once in ~16,000 comparisons) plus the term the model
    leaves out: memory-recovered failures stretch the time since the last durable snapshot,
    a cross term of order (lam1 s1)(lam2 P)/12 (the same 1/12 as the s/2 - mu s^2/12 age)."""
    s1 = t1 + MEM.snapshot_s
    period = (n - 1) * s1 + t1 + DUR.snapshot_s
    return 4 * se + (LAM1 * s1) * (LAM2 * period) / 12


@pytest.mark.quick
def test_two_level_model_matches_brute_force_simulation() -> None:
    t1, n = two_level_optimum(MEM, DUR, LAM1, LAM2)
    assert n == 5  # sqrt(1.5 * 0.01 / (0.5 * 0.001)) = 5.48
    points = [(t1, n), (t1, 1), (2 * t1, n), (t1 / 2, 2 * n), (t1, 4 * n)]
    sims = {}
    for i, (t, k) in enumerate(points):
        model = two_level_waste(t, k, MEM, DUR, LAM1, LAM2).goodput
        sim, se = simulate(t, k, MEM, DUR, LAM1, LAM2, horizon=20_000, reps=2000, seed=10 + i)
        sims[(t, k)] = (sim, se)
        assert abs(model - sim) <= _tolerance(se, t, k), (t, k, model, sim, se)
    # The closed-form optimum is the simulated optimum: no point of a brute-force grid of
    # (T1, n) around it does better than the noise allows.
    best_sim, best_se = sims[(t1, n)]
    for t in (0.5 * t1, 0.75 * t1, 1.33 * t1, 2 * t1):
        for k in (max(1, n - 3), n, n + 3, 2 * n):
            sim, se = simulate(t, k, MEM, DUR, LAM1, LAM2, horizon=20_000, reps=1000, seed=99)
            assert sim <= best_sim + 4 * math.hypot(se, best_se), (t, k, sim, best_sim)


@pytest.mark.quick
@pytest.mark.parametrize("interval", [2.0, 10.0, 30.0])
def test_single_level_model_matches_simulation(interval: float) -> None:
    d = TierCosts(snapshot_s=1.0, restore_s=2.0, restart_s=3.0, latency_s=0.5)
    model = waste(interval, d, 100.0).goodput
    sim, se = simulate(interval, 1, d, d, 0.0, 1 / 100.0, horizon=20_000, reps=2000, seed=3)
    assert abs(model - sim) <= 4 * se, (model, sim, se)


@pytest.mark.quick
def test_single_level_is_the_exact_expectation_with_failures_during_recovery() -> None:
    # Daly (2006) / Bougeret et al. (2011): failures at rate lam at any time, one during a
    # restart starts it over; a segment of W work + C snapshot takes on average
    # E[T] = exp(lam R) (exp(lam (W + C)) - 1) / lam, so goodput = W / E[T].
    for c, r, m, w in [(300.0, 600.0, 3600.0, 1276.0), (5.0, 10.0, 1440.0, 117.0), (1.0, 30.0, 100.0, 10.0)]:
        lam = 1.0 / m
        exact = w / (math.exp(lam * r) * math.expm1(lam * (w + c)) / lam)
        got = waste(w, TierCosts(snapshot_s=c, restart_s=r), m)
        assert got.goodput == pytest.approx(exact, rel=1e-12)
        assert got.restart == pytest.approx(-math.expm1(-lam * r), rel=1e-12)
        assert got.checkpoint + got.recompute + got.restart + got.goodput == pytest.approx(1.0)


def test_failures_during_recovery_against_simulation_over_a_grid() -> None:
    # The simulator plays the process out; the model must agree within 0.2 points everywhere,
    # restart costs up to 0.3 MTBF included (the case: C = 300 s, R = 600 s, M = 1 h
    # simulates to 54.6%; a model without failures during recovery said 51.3%).
    m = 3600.0
    for r_m in (0.01, 0.054, 0.167, 0.3):
        for c_m in (0.01, 300.0 / 3600.0):
            d = TierCosts(snapshot_s=c_m * m, restart_s=0.7 * r_m * m, restore_s=0.3 * r_m * m)
            t = daly_interval(d.snapshot_s, m)
            model = waste(t, d, m).goodput
            sim, se = simulate(t, 1, d, d, 0.0, 1 / m, horizon=300 * m, reps=3000, seed=int(r_m * 1000))
            assert se < 0.0005  # the comparison can tell 0.2 points apart
            assert abs(model - sim) <= 0.002, (r_m, c_m, model, sim, se)
    # Two levels, with commit latencies, restarts up to 0.3 of the job MTBF.
    m = 1000.0
    for r_m in (0.01, 0.1, 0.3):
        for coverage in (0.5, 0.9):
            r1 = 0.3 * r_m * m
            mem = TierCosts(snapshot_s=2.0, restart_s=0.7 * r1, restore_s=0.3 * r1, latency_s=2.0)
            dur = TierCosts(snapshot_s=20.0, restart_s=0.7 * r1, restore_s=r_m * m - 0.7 * r1, latency_s=20.0)
            lam1, lam2 = coverage / m, (1 - coverage) / m
            t1, n = two_level_optimum(mem, dur, lam1, lam2)
            model = two_level_waste(t1, n, mem, dur, lam1, lam2).goodput
            sim, se = simulate(t1, n, mem, dur, lam1, lam2, horizon=300 * m, reps=3000, seed=7)
            assert se < 0.0005
            assert abs(model - sim) <= 0.002, (r_m, coverage, t1, n, model, sim, se)


# -- plan ----------------------------------------------------------------------------------------


LLAMA3_PER_DAY = 419 / 54  # Llama 3 405B: 419 unexpected interruptions in 54 days, 16,384 GPUs


@pytest.mark.quick
def test_plan_llama3_scale() -> None:
    mem = TierCosts(snapshot_s=0.5, restore_s=20.0, restart_s=300.0)
    dur = TierCosts(snapshot_s=0.5, restore_s=180.0, restart_s=300.0, latency_s=120.0)
    p = plan(nodes=2048, gpus_per_node=8, mtbf_s=86400 / LLAMA3_PER_DAY, memory=mem, durable=dur,
             memory_coverage=0.9, gpu_hour_cost=2.0)
    only, both = p.strategies
    assert only.name == "durable only" and both.name == "memory + durable"
    assert both.waste.goodput > only.waste.goodput
    for s in p.strategies:
        assert s.gpu_hours_lost_per_day == pytest.approx(16384 * 24 * s.waste.lost)
        assert s.cost_lost_per_day == pytest.approx(2.0 * s.gpu_hours_lost_per_day)
    # Uploads take 120 s: no interval shorter than that for the durable tier.
    assert only.durable_interval_s >= 120.0 and both.durable_interval_s >= 120.0
    assert json.dumps(p.to_json(), allow_nan=False)


@pytest.mark.quick
def test_auto_interval_policy() -> None:
    a = AutoInterval(mtbf_s=3600.0, every_max=50)
    assert a.interval == 1 and a.update(None, None) is None
    new = a.update(0.05, 0.1)  # Daly(0.05 s, 1 h) = 18.9 s -> 189 steps -> bounded to 50
    assert new == 50 and a.interval == 50
    b = AutoInterval(mtbf_s=3600.0, every_max=1000)
    assert b.update(0.05, 0.1) == round(daly_interval(0.05, 3600.0) / 0.1)
    assert b.update(0.05, 0.105) is None  # 5% slower steps: within the hysteresis
    for _ in range(10):
        b.update(0.2, 0.1)  # snapshots became 4x dearer: twice the interval
    target = daly_interval(0.2, 3600.0) / 0.1
    assert target / 1.2 <= b.interval <= target and b.interval > 1.5 * 189  # within the hysteresis
    c = AutoInterval(mtbf_s=1.0, every_max=10)
    assert c.update(5.0, 1.0) is None and c.interval == 1  # Daly -> M = 1 s = 1 step


# -- measured costs and the command ------------------------------------------------------------


def _write_events(d: Path) -> None:
    t = 1000.0
    lines: dict[int, list[dict[str, Any]]] = {0: [], 1: []}
    for r in (0, 1):
        lines[r].append({"time": t + r * 0.01, "event": "start", "rank": r})
    for step in range(1, 11):
        for r in (0, 1):
            lines[r].append({"time": t + step + r * 0.01, "event": "snapshot", "step": step, "rank": r,
                             "committed": True, "blocking_ms": 10.0 + 10 * r, "background_ms": 5.0,
                             "plan_ms": 300.0 if step == 1 else 0.0})
        if step % 5 == 0:
            for r in (0, 1):
                lines[r].append({"time": t + step + 0.3 + r * 0.01, "event": "upload", "step": step,
                                 "rank": r, "committed": True, "seconds": 0.2 + 0.1 * r})
    t2 = t + 20.0  # a restart: new workers start 9 s after the last sign of life
    for r in (0, 1):
        lines[r].append({"time": t2 + r * 0.01, "event": "start", "rank": r})
        lines[r].append({"time": t2 + 1 + r * 0.01, "event": "restore", "rank": r, "found": True,
                         "step": 10, "seconds": 0.5 + r, "sources": [{"tier": "peer"}]})
    (d / "node-0").mkdir(parents=True)
    (d / "node-1").mkdir(parents=True)
    for r in (0, 1):
        (d / f"node-{r}" / f"rank-{r:05d}.jsonl").write_text(
            "\n".join(json.dumps(e) for e in lines[r]) + "\n{cut by a kill")


@pytest.mark.quick
def test_measured_from_events(tmp_path: Path) -> None:
    _write_events(tmp_path)
    m = measured_from_events(tmp_path)
    assert m.memory_snapshot_s == pytest.approx(0.020)  # slowest rank, planning left out
    assert m.durable_snapshot_s == pytest.approx(0.020)
    assert m.counts["snapshots"] == 9
    assert m.memory_latency_s == pytest.approx(0.005)
    assert m.durable_latency_s == pytest.approx(0.3 + 0.005)
    assert m.memory_restore_s == pytest.approx(1.5) and m.durable_restore_s is None
    assert m.restart_s == pytest.approx(20.0 - 10.31, abs=1e-6)
    assert m.step_s == pytest.approx(1.0)


@pytest.mark.quick
def test_measured_from_bench_results(tmp_path: Path) -> None:
    # The shapes of bench/results/{recovery,snapshot_overhead,restore}.json.
    recovery = {"bench": "recovery", "arms": {
        "aegis-memory": {"phases": {"detection_s": 2.0, "restart_s": 10.0, "restore_s": 0.4},
                         "wall_per_step_before_kill_s": 0.2},
        "aegis-durable": {"phases": {"detection_s": 3.0, "restart_s": 11.0, "restore_s": 0.6}},
        "dcp-s3": {"phases": {"detection_s": 2.0, "restart_s": 8.0, "restore_s": 1.9}}}}
    overhead = {"bench": "snapshot_overhead", "sizes": [
        {"cases": {"aegis": {"median_ms": 5.0}}},
        {"cases": {"aegis": {"median_ms": 22.0}, "aegis_background": {"median_ms": 15.0}}}]}
    restore = {"bench": "restore", "summary": {
        "sources": {"peer memory": {"median_s": 0.22}, "durable S3": {"median_s": 0.59},
                    "durable dir": {"median_s": 0.27}, "dcp dir": {"median_s": 0.07}},
        "save_s": {"aegis s3": 0.73, "aegis file": 0.44, "dcp dir": 0.2}}}
    files = {}
    for name, doc in (("recovery", recovery), ("snapshot_overhead", overhead), ("restore", restore)):
        files[name] = tmp_path / f"{name}.json"
        files[name].write_text(json.dumps(doc))
    r = measured_from_bench(files["recovery"])
    assert r.restart_s == pytest.approx(13.0) and r.memory_restore_s == 0.4
    assert r.durable_restore_s == 0.6 and r.step_s == 0.2
    s = measured_from_bench(files["snapshot_overhead"])
    assert s.memory_snapshot_s == pytest.approx(0.022) and s.memory_latency_s == pytest.approx(0.015)
    x = measured_from_bench(files["restore"])
    assert x.memory_restore_s == 0.22 and x.durable_restore_s == 0.59 and x.durable_latency_s == 0.73
    merged = r.merge(s).merge(x)  # the first measurement of a cost wins
    assert merged.memory_restore_s == 0.4 and merged.memory_snapshot_s == pytest.approx(0.022)
    assert merged.durable_latency_s == 0.73 and len(merged.sources) == 3
    (tmp_path / "other.json").write_text("{}")
    with pytest.raises(ValueError, match="not a result"):
        measured_from_bench(tmp_path / "other.json")


RESULTS = Path(__file__).resolve().parent.parent / "bench" / "results"


@pytest.mark.quick
@pytest.mark.parametrize("name, fields", [
    ("recovery", ("restart_s", "memory_restore_s", "durable_restore_s", "step_s")),
    ("snapshot_overhead", ("memory_snapshot_s", "memory_latency_s")),
    ("restore", ("memory_restore_s", "durable_restore_s", "durable_latency_s")),
    ("goodput", ("memory_snapshot_s", "restart_s", "memory_restore_s", "durable_restore_s")),
])
def test_measured_from_the_committed_bench_results(name: str, fields: tuple[str, ...]) -> None:
    """The planner reads what `make bench` / `make goodput` write today (guards schema drift)."""
    m = measured_from_bench(RESULTS / f"{name}.json")
    for f in fields:
        v = getattr(m, f)
        assert isinstance(v, float) and 0 < v < 3600, (name, f, v)


@pytest.mark.quick
def test_plan_command_table_json_and_errors(tmp_path: Path) -> None:
    runner = CliRunner()
    args = ["--nodes", "16", "--failures-per-day", "2", "--gpu-hour-cost", "2.5", "--snapshot-s",
            "0.1", "--restart-s", "60", "--restore-s", "5", "--durable-restore-s", "40",
            "--durable-latency-s", "30"]
    r = runner.invoke(plan_cmd, args)
    assert r.exit_code == 0, r.output
    assert "durable only" in r.output and "memory + durable" in r.output and "Daly" in r.output
    r = runner.invoke(plan_cmd, [*args, "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert doc["schema"] == "aegis.plan/1"
    assert doc["cluster"]["total_gpus"] == 128
    assert doc["failures"]["per_day"] == pytest.approx(2.0)
    names = [s["name"] for s in doc["strategies"]]
    assert names == ["durable only", "memory + durable"]
    for s in doc["strategies"]:
        assert s["gpu_hours_lost_per_day"] == pytest.approx(128 * 24 * s["lost"])
    assert doc["costs"]["durable"]["restart_s"] == 60.0  # --durable-restart-s defaults to it
    # In-process recovery: survivors re-form in seconds, a durable-tier failure still restarts
    r = runner.invoke(plan_cmd, [*args, "--restart-s", "3", "--durable-restart-s", "60", "--json"])
    assert r.exit_code == 0, r.output
    fast = json.loads(r.output)
    assert (fast["costs"]["memory"]["restart_s"], fast["costs"]["durable"]["restart_s"]) == (3.0, 60.0)
    by = {s["name"]: s for s in fast["strategies"]}
    slow = {s["name"]: s for s in doc["strategies"]}
    assert by["memory + durable"]["restart"] < slow["memory + durable"]["restart"]
    assert by["durable only"]["restart"] == pytest.approx(slow["durable only"]["restart"])
    # Measured costs: an explicit flag overrides the measurement.
    _write_events(tmp_path / "ev")
    r = runner.invoke(plan_cmd, ["--nodes", "2", "--mtbf-node-hours", "100", "--events",
                                 str(tmp_path / "ev"), "--restart-s", "12", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert doc["costs"]["memory"]["snapshot_s"] == pytest.approx(0.02)
    assert doc["costs"]["memory"]["restart_s"] == 12.0
    assert doc["failures"]["mtbf_s"] == pytest.approx(100 * 3600 / 2)
    # Memory redundancy: XOR parity over groups of 8 of the 16 nodes holds 1 + 1/7 of the state
    # per node against a replica's 2x, and a rebuild moves 7x a replica fetch
    r = runner.invoke(plan_cmd, [*args, "--redundancy", "xor", "--group-size", "8",
                                 "--state-gb-per-node", "400", "--json"])
    assert r.exit_code == 0, r.output
    red = json.loads(r.output)["redundancy"]
    assert red["memory_factor"] == pytest.approx(8 / 7) and red["replica_memory_factor"] == 2.0
    assert red["node_store_gb"] == pytest.approx(400 * 8 / 7 * 2)  # keep 1 + 1 in flight
    assert red["replica_node_store_gb"] == pytest.approx(1600.0) and red["rebuild_bytes_factor"] == 7
    r = runner.invoke(plan_cmd, [*args, "--redundancy", "xor", "--group-size", "8"])
    assert r.exit_code == 0 and "1.14x the state per node" in r.output, r.output
    assert json.loads(runner.invoke(plan_cmd, [*args, "--json"]).output)["redundancy"]["memory_factor"] == 2.0
    # Reed-Solomon 6+2 over groups of 8: 1 + 2/6 of the state, survives 2 per group, and a
    # group too small for its parity is refused with the fix
    r = runner.invoke(plan_cmd, [*args, "--redundancy", "rs", "--group-size", "8", "--parity", "2", "--json"])
    red = json.loads(r.output)["redundancy"]
    assert red["memory_factor"] == pytest.approx(8 / 6) and red["rebuild_bytes_factor"] == 6, red
    assert red["survives"] == "2 lost nodes per parity group", red
    r = runner.invoke(plan_cmd, [*args, "--redundancy", "rs", "--group-size", "3", "--parity", "2"])
    assert r.exit_code == 2 and "at least 4 nodes" in r.output, r.output
    # Bad input: exit code 2 and one line.
    r = runner.invoke(plan_cmd, ["--nodes", "2", "--failures-per-day", "1", "--snapshot-s", "0.1"])
    assert r.exit_code == 2 and "restart" in r.output
    r = runner.invoke(plan_cmd, ["--nodes", "2", "--snapshot-s", "0.1", "--restart-s", "1"])
    assert r.exit_code == 2 and "failure rate" in r.output


# -- Manager(every="auto") -----------------------------------------------------------------------


@pytest.mark.quick
@pytest.mark.parametrize("kwargs, message", [
    ({"every": "auto"}, "needs mtbf_s"),
    ({"every": "auto", "mtbf_s": 0}, "needs mtbf_s"),
    ({"every": 2, "mtbf_s": 100.0}, "only used with every='auto'"),
    ({"every": "sometimes"}, "every='sometimes'"),
    ({"every": "auto", "mtbf_s": 10.0, "every_max": 0}, "every_max=0"),
])
def test_auto_config_is_checked(store_dir: Path, kwargs: dict[str, Any], message: str) -> None:
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match=message):
        Manager("ok", {"m": ModelOptimizerState(model, opt)}, store_dir=str(store_dir), **kwargs)


def _events(store: Path, job: str, rank: int) -> list[dict[str, Any]]:
    path = store / job / "events" / f"rank-{rank:05d}.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()]


def _snapshot_steps(events: list[dict[str, Any]]) -> list[int]:
    return [e["step"] for e in events if e["event"] == "snapshot" and e["committed"]]


def _check_schedule(events: list[dict[str, Any]]) -> None:
    """Every gap between snapshots is the interval in force when the earlier one was taken."""
    interval, changes = 1, {e["step"]: e["every"] for e in events if e["event"] == "interval"}
    snaps = _snapshot_steps(events)
    for a, b in zip(snaps, snaps[1:], strict=False):
        interval = changes.get(a, interval)
        assert b - a == interval, (a, b, interval, changes)


@pytest.mark.quick
def test_auto_single_process_adapts_and_is_bounded(store_dir: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    # Blocking ~1-5 ms, steps 10 ms, MTBF 20 s: Daly ~0.2-0.45 s ~ 20-45 steps, bounded to 8.
    mgr = Manager("auto", {"m": ModelOptimizerState(model, opt)}, store_dir=str(store_dir),
                  verbose=False, every="auto", mtbf_s=20.0, every_max=8)
    assert mgr.restore() == 0
    weights = {}
    for step in range(1, 41):
        model(torch.ones(2, 64)).sum().backward()
        opt.step()
        time.sleep(0.01)
        if mgr.save(step) is not None:
            weights[step] = model.weight.detach().clone()
    mgr.close()
    events = _events(store_dir, "auto", 0)
    changes = [e for e in events if e["event"] == "interval"]
    assert changes and changes[-1]["every"] == 8 and changes[-1]["bounded"]
    assert changes[0]["previous"] == 1 and changes[0]["snapshot_s"] > 0 and changes[0]["step_s"] >= 0.009
    snaps = _snapshot_steps(events)
    assert snaps[:2] == [1, 2]  # the first two measure the snapshot and the step
    assert snaps[-1] >= 33
    _check_schedule(events)
    # A later run resumes the schedule from the restored step.
    model2 = torch.nn.Linear(64, 64)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.01)
    mgr2 = Manager("auto", {"m": ModelOptimizerState(model2, opt2)}, store_dir=str(store_dir),
                   verbose=False, every="auto", mtbf_s=20.0, every_max=8)
    start = mgr2.restore()
    assert start == snaps[-1] and torch.equal(model2.weight, weights[start])
    assert mgr2.save(start + 1) is not None  # interval 1 again until measured
    mgr2.close()


@pytest.mark.quick
def test_integer_every_is_unchanged(store_dir: Path) -> None:
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mgr = Manager("int", {"m": ModelOptimizerState(model, opt)}, store_dir=str(store_dir),
                  verbose=False, every=3)
    mgr.restore()
    handles = [mgr.save(s) for s in range(1, 10)]
    mgr.close()
    assert [s for s, h in zip(range(1, 10), handles, strict=True) if h is not None] == [3, 6, 9]
    assert not [e for e in _events(store_dir, "int", 0) if e["event"] == "interval"]


def _auto_ranks(rank: int, world: int, store: str, durable: str) -> list[int]:
    from tests.models import build, train_step

    model, opt, sched = build(world, seed=0)
    mgr = Manager("auto2", {"model": ModelOptimizerState(model, opt), "sched": sched}, store_dir=store,
                  verbose=False, every="auto", mtbf_s=5.0, every_max=6, durable=durable,
                  durable_every=4)
    mgr.restore()
    saved = []
    for step in range(1, 31):
        train_step(model, opt, sched, step, rank)
        time.sleep(0.004 * (1 + 3 * rank))  # rank 1 is slower: its step time must win
        if mgr.save(step) is not None:
            saved.append(step)
    mgr.wait_durable(60)
    mgr.close()
    return saved


def test_auto_ranks_agree_and_durable_follows(store_dir: Path, tmp_path: Path) -> None:
    """Ranks with different step times take the same decisions (or they would hang in the
    snapshot collectives), and the durable tier uploads at every crossing of durable_every
    although auto steps need not be multiples of it."""
    durable = f"file://{tmp_path / 'durable'}"
    saved = run_ranks(2, _auto_ranks, str(store_dir), durable, timeout=180)
    assert saved[0] == saved[1] and len(saved[0]) >= 6
    for r in (0, 1):
        _check_schedule(_events(store_dir, "auto2", r))
    changes = [e for e in _events(store_dir, "auto2", 0) if e["event"] == "interval"]
    assert changes and all(1 <= e["every"] <= 6 for e in changes)
    assert [e["every"] for e in changes] == [
        e["every"] for e in _events(store_dir, "auto2", 1) if e["event"] == "interval"]
    uploads = [e["step"] for e in _events(store_dir, "auto2", 0) if e["event"] == "upload" and e["committed"]]
    crossings = [s for prev, s in zip([0, *saved[0]], saved[0], strict=False) if s // 4 > prev // 4]
    assert uploads and set(uploads) <= set(crossings)


@pytest.mark.quick
def test_plan_adds_the_costs_that_grow_with_the_job_from_scale_results(tmp_path: Path) -> None:
    """`aegis plan --scale scale.json`: bench/scale.py's series fitted log-log and evaluated at
    nodes x gpus-per-node ranks, added to the memory tier's latency (commit) and restart
    (detection + agreement). Synthetic series with known growth; points marked limited by the
    machine are left out of the fit."""
    from aegis.goodput import SCALE_COSTS, scale_costs

    xs = [8, 64, 512]

    def series(name: str, ys: list[float], limited: list[bool] | None = None) -> dict[str, Any]:
        panel, label = SCALE_COSTS[name]
        return {"panel": panel, "label": label, "x": xs, "y": ys,
                **({"limited": limited} if limited else {})}

    doc = {"sections": {
        "metadata": {"series": [series("commit_s", [0.02, 0.02, 0.02])]},
        "membership": {"series": [
            series("detect_s", [1.2, 1.2, 9.0], limited=[False, False, True]),
            series("agree_s", [0.1 * (x / 8) ** 0.5 for x in xs])]},
    }}
    got = scale_costs(doc, 1024)
    assert got["commit_s"]["value"] == pytest.approx(0.02)
    # a series the benchmark marked not to project (oversubscribed times) adds nothing
    unprojected = json.loads(json.dumps(doc))
    unprojected["sections"]["metadata"]["series"][0]["project"] = False
    assert "commit_s" not in scale_costs(unprojected, 1024)
    assert got["detect_s"]["value"] == pytest.approx(1.2)  # the limited point is not fitted
    assert got["agree_s"]["value"] == pytest.approx(0.1 * (1024 / 8) ** 0.5)
    assert got["agree_s"]["exponent"] == pytest.approx(0.5)
    path = tmp_path / "scale.json"
    path.write_text(json.dumps(doc))
    runner = CliRunner()
    args = ["--nodes", "128", "--gpus-per-node", "8", "--failures-per-day", "10", "--snapshot-s",
            "0.1", "--restart-s", "2", "--json"]
    base = json.loads(runner.invoke(plan_cmd, args).output)
    r = runner.invoke(plan_cmd, [*args, "--scale", str(path)])
    assert r.exit_code == 0, r.output
    grown = json.loads(r.output)
    assert grown["scale"]["ranks"] == 1024
    assert grown["costs"]["memory"]["restart_s"] == pytest.approx(2 + 1.2 + 0.1 * 128 ** 0.5)
    assert grown["costs"]["memory"]["latency_s"] == pytest.approx(
        base["costs"]["memory"]["latency_s"] + 0.02)
    lost = {s["name"]: s["lost"] for s in grown["strategies"]}
    assert lost["memory + durable"] > {s["name"]: s["lost"] for s in base["strategies"]}["memory + durable"]
