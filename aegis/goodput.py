"""Goodput planning: how often to snapshot, and what failures cost.

Checkpointing trades a known cost (blocking time per snapshot) against an expected one (the
work since the last snapshot plus the restart, at every failure). This module turns measured
costs and a failure rate into intervals and expected losses. It is pure arithmetic, apart from
:func:`measured_from_events` and :func:`measured_from_bench`, which read what aegis and its
benchmarks measured; ``aegis plan`` (:mod:`aegis.cli.plan`), ``Manager(every="auto")`` and
``bench/goodput.py`` call it.

Formulas, with ``C`` the blocking cost of one snapshot, ``M`` the mean wall-clock time between
interruptions of the job (the MTBF of the job: a node MTBF divided by the node count), ``R`` the
time from a failure to resumed training (restart + restore), ``L`` the commit latency of a tier
(time from the end of the blocking copy until the snapshot is committed on that tier, during
which a failure still loses it):

* Young's first-order optimum (J. W. Young, "A first order approximation to the optimum
  checkpoint interval", Commun. ACM 17(9):530-531, 1974, doi:10.1145/361147.361115):
  ``T = sqrt(2 C M)``.
* Daly's higher-order estimate (J. T. Daly, "A higher order estimate of the optimum checkpoint
  interval for restart dumps", Future Generation Computer Systems 22(3):303-312, 2006,
  doi:10.1016/j.future.2004.11.016): ``T = sqrt(2 C M) (1 + sqrt(C/(2M))/3 + C/(18 M)) - C``
  for ``C < 2 M``, else ``T = M``. Its published examples (C = 5 min, R = 10 min; M = 24 h,
  6 h, 15 min -> 117, 57 and 9.1 min) are reproduced in ``tests/test_goodput.py``.
* Expected losses (periodic snapshots every ``T`` seconds of work), failures striking at any
  time at ``lam = 1/M`` per second, restarts included (one during a recovery starts it over)::

      running    = exp(-lam R)                       (fraction of wall time not recovering)
      goodput    = T/(T+C) * running * (1 - lam (a(T+C) + L))
      restart    = 1 - running
      recompute  = running * lam (a(T+C) + L)
      checkpoint = C/(T+C) * running * (1 - lam (a(T+C) + L))

  ``a(s) = 1/lam - s/(exp(lam s) - 1)`` is the mean time since the start of a segment of length
  ``s`` at an exponential failure within it (``s/2 - lam s^2/12 + ...``). Without latency this
  is exactly ``T / E[T_seg]`` with the expected time of one segment
  ``E[T_seg] = exp(lam R) (exp(lam (T + C)) - 1) / lam`` (J. T. Daly 2006, above; G. Bougeret,
  H. Casanova, M. Rabie, Y. Robert, F. Vivien, "Checkpointing strategies for parallel jobs",
  SC 2011, doi:10.1145/2063384.2063428). To first order it is the textbook waste
  ``C/T + (T/2 + R)/M``. ``tests/test_goodput.py`` checks it against a Monte-Carlo simulation
  of that process (its own code, no formula of this module) within 0.2 points for restart
  costs up to 0.3 M.
* Two levels (memory + durable): memory snapshots every ``T1`` recover the failures a node's
  replicas survive (rate ``lam1``, cost ``R1``); every ``n``-th snapshot is also made durable
  (blocking ``C2`` instead of ``C1``) and recovers the rest (rate ``lam2``: lost replica sets,
  corruption, whole-job failures; cost ``R2``). The first-order optimum of the pattern
  (A. Benoit, A. Cavelan, V. Le Fevre, Y. Robert, H. Sun, "Towards optimal multi-level
  checkpointing", IEEE Trans. Computers 66(7):1212-1226, 2017; the two-level model of S. Di,
  M. S. Bouguerra, L. Bautista-Gomez, F. Cappello, "Optimization of multi-level checkpoint model
  for large scale HPC applications", IPDPS 2014, doi:10.1109/IPDPS.2014.122) is::

      n* = sqrt((C2 - C1) lam1 / (C1 lam2))            (best neighbouring integer >= 1)
      n T1 = sqrt(2 ((n-1) C1 + C2) / (lam1/n + lam2))

  which reduces to Young's formula with one level (the intervals are first-order optima; the
  losses below are not first order). Expected losses of a pattern are those of the
  single-level model with the per-level average loss: a memory-recovered failure loses the
  time since the last snapshot of either kind, a durable-recovered one the time since the last
  durable snapshot. A failure during a recovery starts a recovery of its own kind, so the
  running fraction is ``sum_k p_k exp(-lam R_k)`` (``p_k``: the share of failures of kind
  ``k``); a durable one also sends the position back to the last durable snapshot (see
  :func:`two_level_waste`).

Failure rates are interruptions per second of wall clock (restarts included, and failures
strike during restarts too), as reported by
large runs, e.g. Llama 3 405B: 419 unexpected interruptions in 54 days on 16,384 GPUs
("The Llama 3 Herd of Models", arXiv:2407.21783, section 3.3.4, table 5).
"""

from __future__ import annotations

import json
import math
import os
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "AutoInterval",
    "Measured",
    "Plan",
    "Strategy",
    "TierCosts",
    "Waste",
    "daly_interval",
    "gpu_hours_lost_per_day",
    "measured_from_bench",
    "measured_from_events",
    "plan",
    "two_level_optimum",
    "two_level_waste",
    "waste",
    "young_interval",
]

DAY_S = 86400.0


# -- single level --------------------------------------------------------------------------------


def young_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """Young (1974): ``sqrt(2 C M)``, seconds of work between snapshots."""
    _check_cost(checkpoint_s, mtbf_s)
    return math.sqrt(2.0 * checkpoint_s * mtbf_s)


def daly_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """Daly (2006), higher order: ``sqrt(2CM) (1 + sqrt(C/2M)/3 + (C/2M)/9) - C`` for
    ``C < 2M``, else ``M``. Seconds of work between snapshots (0 when C is 0)."""
    _check_cost(checkpoint_s, mtbf_s)
    c, m = checkpoint_s, mtbf_s
    if c >= 2.0 * m:
        return m
    x = c / (2.0 * m)
    return max(0.0, math.sqrt(2.0 * c * m) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - c)


def _check_cost(checkpoint_s: float, mtbf_s: float) -> None:
    if not checkpoint_s >= 0 or not mtbf_s > 0 or math.isinf(checkpoint_s):
        raise ValueError(f"need a snapshot cost >= 0 and an MTBF > 0 (got C={checkpoint_s!r}, "
                         f"M={mtbf_s!r})")


@dataclass(frozen=True, kw_only=True)
class TierCosts:
    """What one tier costs. ``snapshot_s``: blocking time of one snapshot on this tier;
    ``restore_s``: loading from it after a failure; ``restart_s``: failure -> new workers up
    (detection, rendezvous, process start), paid before any restore; ``latency_s``: end of the
    blocking copy -> committed on this tier (background work a failure can still lose)."""

    snapshot_s: float
    restore_s: float = 0.0
    restart_s: float = 0.0
    latency_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("snapshot_s", "restore_s", "restart_s", "latency_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"{name}={v!r}: seconds, finite and >= 0")

    @property
    def recovery_s(self) -> float:
        """Failure -> training again: restart + restore."""
        return self.restart_s + self.restore_s


@dataclass(frozen=True)
class Waste:
    """Expected fractions of wall-clock time; they sum to 1."""

    checkpoint: float
    recompute: float
    restart: float
    goodput: float

    @property
    def lost(self) -> float:
        return 1.0 - self.goodput


def two_level_waste(interval_s: float, n: int, memory: TierCosts, durable: TierCosts,
                    memory_rate: float, durable_rate: float) -> Waste:
    """Expected losses of the pattern "``n - 1`` memory snapshots, then one durable one", with a
    snapshot after every ``interval_s`` seconds of work.

    ``memory_rate``: interruptions per second that the memory tier recovers (cost
    ``memory.recovery_s``, losing the work since the last snapshot of either kind, plus
    ``memory.latency_s``); ``durable_rate``: those that need the durable tier (cost
    ``durable.recovery_s``, losing the work since the last durable snapshot, plus
    ``durable.latency_s``). ``n = 1`` with ``memory_rate = 0`` is durable-only checkpointing.
    """
    if not interval_s > 0 or n < 1:
        raise ValueError(f"interval_s={interval_s!r} must be > 0 and n={n!r} >= 1")
    if memory_rate < 0 or durable_rate < 0:
        raise ValueError("failure rates must be >= 0")
    s_mem = interval_s + memory.snapshot_s
    s_dur = interval_s + durable.snapshot_s
    pattern = (n - 1) * s_mem + s_dur
    work = n * interval_s / pattern
    lam = memory_rate + durable_rate
    if lam == 0:
        return Waste(checkpoint=1.0 - work, recompute=0.0, restart=0.0, goodput=work)
    p_mem, p_dur = memory_rate / lam, durable_rate / lam
    # Failures strike at any time, recoveries included; one during a recovery starts a new
    # recovery, of its own kind. A recovery of length R ends before the next failure with
    # probability exp(-lam R), so the time to get back to running after a failure is
    # (Q/lam)/(1 - Q), Q = sum_k p_k (1 - exp(-lam R_k)), and the fraction of the wall clock
    # spent running is 1 - Q (exp(-lam R) for one level: Daly 2006, Bougeret et al. 2011).
    q_mem = -math.expm1(-lam * memory.recovery_s)
    q_dur = -math.expm1(-lam * durable.recovery_s)
    running = 1.0 - (p_mem * q_mem + p_dur * q_dur)
    # A durable failure during a recovery that a memory failure began also sends the position
    # back to the last durable snapshot: the chain meets one with probability d.
    d = q_mem * p_dur / (1.0 - q_mem * p_mem) if memory_rate > 0 else 0.0
    # While running, failures come at lam per second. Time since the segment began at a failure:
    # the mean age of an exponential arrival within a segment of length s, s/2 - lam s^2/12 + ...
    e_mem = ((n - 1) * s_mem * _age(s_mem, lam) + s_dur * _age(s_dur, lam)) / pattern + memory.latency_s
    # Only durable rollbacks move the position back to a durable snapshot.
    e_dur = _age(pattern, durable_rate + memory_rate * d) + durable.latency_s
    # Lost work per second of running: exactly lam a(s) (= 1 - lam s/(exp(lam s) - 1)) for one
    # level without latency, which makes goodput W / E[T] with the exact expectation
    # E[T] = exp(lam R) (exp(lam (W + C)) - 1) / lam of a segment.
    lost_running = memory_rate * ((1.0 - d) * e_mem + d * max(e_mem, e_dur)) + durable_rate * e_dur
    restart = 1.0 - running
    if lost_running >= 1.0:  # the job never gets anywhere: failures take all the running time
        return Waste(checkpoint=0.0, recompute=running, restart=restart, goodput=0.0)
    return Waste(checkpoint=(1.0 - work) * running * (1.0 - lost_running),
                 recompute=running * lost_running, restart=restart,
                 goodput=work * running * (1.0 - lost_running))


def _age(s: float, mu: float) -> float:
    """Mean time since the start of a segment of length ``s`` at a failure within it, failures
    arriving at rate ``mu``: ``1/mu - s/(exp(mu s) - 1)`` (``s/2`` as ``mu s -> 0``)."""
    x = mu * s
    if x < 1e-6:
        return s / 2.0
    if x > 700:
        return 1.0 / mu
    return 1.0 / mu - s / math.expm1(x)


def waste(interval_s: float, costs: TierCosts, mtbf_s: float) -> Waste:
    """Single level: a snapshot every ``interval_s`` seconds of work, every interruption
    (one per ``mtbf_s`` of wall clock) recovered from this tier."""
    if not mtbf_s > 0:
        raise ValueError(f"mtbf_s={mtbf_s!r} must be > 0")
    return two_level_waste(interval_s, 1, costs, costs, 0.0, 1.0 / mtbf_s)


def two_level_optimum(memory: TierCosts, durable: TierCosts, memory_rate: float,
                      durable_rate: float, *, max_n: int = 1_000_000) -> tuple[float, int]:
    """First-order optimum ``(T1, n)`` of the two-level pattern (Benoit et al. 2017).

    ``n`` is the integer neighbour of ``sqrt((C2 - C1) lam1 / (C1 lam2))`` with the smaller
    first-order overhead ``((n-1) C1 + C2)(lam1/n + lam2)``; ``T1 = sqrt(2((n-1)C1 + C2) /
    (lam1/n + lam2)) / n``. Without durable-only failures ``n`` is ``max_n`` (the durable tier
    is then not needed for recovery at all). Raises ``ValueError`` without any failures.
    """
    c1, c2 = memory.snapshot_s, durable.snapshot_s
    if memory_rate < 0 or durable_rate < 0 or memory_rate + durable_rate <= 0:
        raise ValueError("need a failure rate > 0")
    if c2 <= c1 or memory_rate == 0 or c1 == 0 and c2 == 0:
        candidates = [1]
    elif durable_rate == 0 or c1 == 0:
        candidates = [max_n]
    else:
        x = math.sqrt((c2 - c1) * memory_rate / (c1 * durable_rate))
        candidates = sorted({min(max_n, max(1, math.floor(x))), min(max_n, max(1, math.ceil(x)))})

    def overhead(n: int) -> float:
        return ((n - 1) * c1 + c2) * (memory_rate / n + durable_rate)

    n = min(candidates, key=overhead)
    cost = (n - 1) * c1 + c2
    if cost == 0:
        return 0.0, n
    return math.sqrt(2.0 * cost / (memory_rate / n + durable_rate)) / n, n


# -- planning ------------------------------------------------------------------------------------


def gpu_hours_lost_per_day(total_gpus: int, lost_fraction: float) -> float:
    return total_gpus * 24.0 * lost_fraction


@dataclass(frozen=True)
class Strategy:
    """One way to checkpoint, at its optimum: intervals in seconds of work."""

    name: str
    memory_interval_s: float | None
    durable_interval_s: float | None  # None: no failure needs the durable tier
    durable_every_n: int | None  # durable = every n-th memory snapshot
    waste: Waste
    gpu_hours_lost_per_day: float
    cost_lost_per_day: float | None


@dataclass(frozen=True)
class Plan:
    """What ``aegis plan`` prints. ``intervals``: per tier, Young and Daly for the failures it
    recovers alone (``memory``: the memory-recoverable ones; ``durable``: all of them)."""

    nodes: int
    gpus_per_node: int
    gpu_hour_cost: float | None
    mtbf_s: float
    memory_coverage: float
    memory: TierCosts
    durable: TierCosts
    intervals: dict[str, dict[str, float]]
    strategies: list[Strategy]
    step_s: float | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def total_gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    def to_json(self) -> dict[str, Any]:
        return {
            "cluster": {"nodes": self.nodes, "gpus_per_node": self.gpus_per_node,
                        "total_gpus": self.total_gpus, "gpu_hour_cost": self.gpu_hour_cost},
            "failures": {"mtbf_s": self.mtbf_s, "per_day": DAY_S / self.mtbf_s,
                         "memory_coverage": self.memory_coverage},
            "costs": {"memory": asdict(self.memory), "durable": asdict(self.durable),
                      "step_s": self.step_s},
            "intervals": self.intervals,
            "strategies": [
                {"name": s.name, "memory_interval_s": s.memory_interval_s,
                 "durable_interval_s": s.durable_interval_s, "durable_every_n": s.durable_every_n,
                 "checkpoint": s.waste.checkpoint, "recompute": s.waste.recompute,
                 "restart": s.waste.restart, "goodput": s.waste.goodput, "lost": s.waste.lost,
                 "gpu_hours_lost_per_day": s.gpu_hours_lost_per_day,
                 "cost_lost_per_day": s.cost_lost_per_day}
                for s in self.strategies
            ],
            "notes": self.notes,
        }


def plan(*, nodes: int, gpus_per_node: int, mtbf_s: float, memory: TierCosts,
         durable: TierCosts, memory_coverage: float, gpu_hour_cost: float | None = None,
         step_s: float | None = None) -> Plan:
    """Durable-only (at Daly's interval) against memory + durable (at the two-level optimum).

    ``mtbf_s``: mean wall-clock time between interruptions of the whole job;
    ``memory_coverage``: the fraction of them the memory tier recovers (its replicas survive).
    """
    if nodes < 1 or gpus_per_node < 1:
        raise ValueError("nodes and gpus_per_node must be >= 1")
    if not mtbf_s > 0:
        raise ValueError(f"mtbf_s={mtbf_s!r} must be > 0")
    if not 0.0 <= memory_coverage <= 1.0:
        raise ValueError(f"memory_coverage={memory_coverage!r} must be within [0, 1]")
    lam = 1.0 / mtbf_s
    lam1, lam2 = lam * memory_coverage, lam * (1.0 - memory_coverage)
    gpus = nodes * gpus_per_node
    notes: list[str] = []

    def strategy(name: str, mem_t: float | None, dur_t: float | None, n: int | None,
                 w: Waste) -> Strategy:
        lost = gpu_hours_lost_per_day(gpus, w.lost)
        return Strategy(name, mem_t, dur_t, n, w, lost,
                        None if gpu_hour_cost is None else lost * gpu_hour_cost)

    intervals: dict[str, dict[str, float]] = {
        "durable": {"young_s": young_interval(durable.snapshot_s, mtbf_s),
                    "daly_s": daly_interval(durable.snapshot_s, mtbf_s)},
    }
    if lam1 > 0:
        intervals["memory"] = {"young_s": young_interval(memory.snapshot_s, 1.0 / lam1),
                               "daly_s": daly_interval(memory.snapshot_s, 1.0 / lam1)}
    strategies: list[Strategy] = []
    t_dur = intervals["durable"]["daly_s"]
    if 0 < t_dur < durable.latency_s:
        # One upload at a time: a shorter interval only queues (then skips) uploads.
        notes.append(f"durable-only: interval raised from Daly's {t_dur:.3g} s to the upload time "
                     f"{durable.latency_s:.3g} s, so that uploads keep up")
        t_dur = durable.latency_s
    if t_dur > 0:
        strategies.append(strategy("durable only", None, t_dur, 1, waste(t_dur, durable, mtbf_s)))
    if lam1 > 0:
        t1, n = two_level_optimum(memory, durable, lam1, lam2)
        if 0 < n * (t1 + memory.snapshot_s) < durable.latency_s and lam2 > 0:
            n0, n = n, math.ceil(durable.latency_s / (t1 + memory.snapshot_s))
            notes.append(f"memory + durable: durable every {n} memory snapshots instead of {n0}, so "
                         f"that uploads ({durable.latency_s:.3g} s) keep up")
        if t1 > 0:
            if lam2 > 0:
                w = two_level_waste(t1, n, memory, durable, lam1, lam2)
                strategies.append(strategy("memory + durable", t1, n * t1, n, w))
            else:  # no failure needs the durable tier: its snapshots are pure overhead
                w = two_level_waste(t1, 1, memory, memory, lam1, 0.0)
                strategies.append(strategy("memory + durable", t1, None, None, w))
                notes.append("memory_coverage=1: no failure needs the durable tier; its interval "
                             "is free (its own blocking cost is not counted)")
            intervals["memory"]["multi_level_s"] = t1
            if lam2 > 0:
                intervals["durable"]["multi_level_s"] = n * t1
    if memory.snapshot_s == 0 or durable.snapshot_s == 0:
        notes.append("a snapshot cost of 0 makes any interval optimal: measure it (--events/--bench)")
    return Plan(nodes=nodes, gpus_per_node=gpus_per_node, gpu_hour_cost=gpu_hour_cost,
                mtbf_s=mtbf_s, memory_coverage=memory_coverage, memory=memory, durable=durable,
                intervals=intervals, strategies=strategies, step_s=step_s, notes=notes)


# -- Manager(every="auto") -----------------------------------------------------------------------


class AutoInterval:
    """The memory interval of ``Manager(every="auto")``, in steps: Daly's optimum for the
    measured blocking time per snapshot and the configured MTBF, divided by the measured step
    time, within ``[1, every_max]``.

    Measurements go through an exponential moving average (``alpha``); the interval changes
    only when the new value differs by ``hysteresis`` (relative) or more, so that noise does not
    flip it at every snapshot. Pure: the Manager measures, agrees on the inputs across ranks
    (every rank must take the same decision) and emits the ``interval`` event.
    """

    def __init__(self, mtbf_s: float, every_max: int, *, alpha: float = 0.3,
                 hysteresis: float = 0.2) -> None:
        if not mtbf_s > 0 or every_max < 1:
            raise ValueError("mtbf_s must be > 0 and every_max >= 1")
        self.mtbf_s = float(mtbf_s)
        self.every_max = int(every_max)
        self.alpha = alpha
        self.hysteresis = hysteresis
        self.interval = 1  # snapshot the first steps: they measure the cost
        self.snapshot_s: float | None = None
        self.step_s: float | None = None

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.alpha * (new - old)

    def target(self) -> int | None:
        """The interval the current averages call for (None until both are measured)."""
        if self.snapshot_s is None or self.step_s is None or self.step_s <= 0:
            return None
        t = daly_interval(self.snapshot_s, self.mtbf_s)
        return max(1, min(self.every_max, round(t / self.step_s)))

    def update(self, snapshot_s: float | None, step_s: float | None) -> int | None:
        """Feed one measurement (None: not measured this time); return the new interval when it
        changes, else None."""
        if snapshot_s is not None and snapshot_s >= 0 and math.isfinite(snapshot_s):
            self.snapshot_s = self._ema(self.snapshot_s, snapshot_s)
        if step_s is not None and step_s > 0 and math.isfinite(step_s):
            self.step_s = self._ema(self.step_s, step_s)
        new = self.target()
        if new is None or new == self.interval:
            return None
        if max(new, self.interval) < (1.0 + self.hysteresis) * min(new, self.interval):
            return None
        self.interval = new
        return new


# -- measured costs ------------------------------------------------------------------------------


@dataclass
class Measured:
    """Costs measured by a run (events) or a benchmark; None where nothing was measured."""

    memory_snapshot_s: float | None = None
    durable_snapshot_s: float | None = None
    memory_restore_s: float | None = None
    durable_restore_s: float | None = None
    restart_s: float | None = None
    memory_latency_s: float | None = None
    durable_latency_s: float | None = None
    step_s: float | None = None
    counts: dict[str, int] = field(default_factory=dict)
    sources: list[str] = field(default_factory=list)

    def merge(self, other: Measured) -> Measured:
        """Fields of ``other`` fill the ones still unknown here."""
        out = Measured(**{k: v for k, v in asdict(self).items() if k not in ("counts", "sources")})
        for k, v in asdict(other).items():
            if k in ("counts", "sources"):
                continue
            if getattr(out, k) is None:
                setattr(out, k, v)
        out.counts = {**other.counts, **self.counts}
        out.sources = [*self.sources, *other.sources]
        return out


def _clusters(events: Iterable[dict[str, Any]], gap_s: float) -> list[list[dict[str, Any]]]:
    """Events of one collective action across ranks: same time within ``gap_s``."""
    out: list[list[dict[str, Any]]] = []
    for e in sorted(events, key=lambda e: e["time"]):
        if out and e["time"] - out[-1][-1]["time"] <= gap_s:
            out[-1].append(e)
        else:
            out.append([e])
    return out


def _mean(xs: Sequence[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def measured_from_events(directory: str | os.PathLike[str]) -> Measured:
    """Costs from the ``rank-NNNNN.jsonl`` event files under ``directory`` (searched
    recursively: a simulated cluster keeps one directory per node).

    * snapshot blocking: per snapshot, the slowest rank's ``blocking_ms`` less ``plan_ms`` (the
      one-off planning after a start belongs to the restart); mean over snapshots. Durable: the
      snapshots whose step was uploaded.
    * latency: memory, the slowest rank's ``background_ms`` (checksums, replicas, commit);
      durable, that plus the slowest rank's upload ``seconds``.
    * restore: per restore, the slowest rank's ``seconds``; durable when any shard came from
      the durable tier.
    * restart: per restart, the first new ``start`` event less the last event before it. The
      failure happened after that last event, so this overstates the restart by up to one
      snapshot interval; pass the restart time explicitly when it is known.
    * step time: wall time between consecutive snapshots over the steps between them.
    """
    root = Path(directory)
    files = sorted(root.rglob("rank-*.jsonl"))
    if not files:
        raise FileNotFoundError(f"no rank-*.jsonl event files under {root}")
    events: list[dict[str, Any]] = []
    for f in files:
        with open(f) as fh:
            for line in fh:
                if line.strip():
                    try:
                        e = json.loads(line)
                    except ValueError:  # a line cut by a kill
                        continue
                    if isinstance(e, dict) and isinstance(e.get("time"), (int, float)):
                        events.append(e)
    events.sort(key=lambda e: e["time"])
    m = Measured(sources=[f"events {root}"])
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for e in events:
        by_kind.setdefault(str(e.get("event")), []).append(e)

    uploaded = {e["step"] for e in by_kind.get("upload", []) if e.get("committed")}
    snaps: dict[int, list[dict[str, Any]]] = {}
    for e in by_kind.get("snapshot", []):
        if e.get("committed"):
            snaps.setdefault(int(e["step"]), []).append(e)
    mem_c: list[float] = []
    dur_c: list[float] = []
    mem_l: list[float] = []
    snap_points: list[tuple[float, int]] = []
    for step, evs in snaps.items():
        for group in _clusters(evs, 5.0):
            if any(g.get("plan_ms", 0) > 0 for g in group):
                continue  # first snapshot after a start: planning and prefaulting
            c = max(g.get("blocking_ms", 0.0) for g in group) / 1e3
            (dur_c if step in uploaded else mem_c).append(c)
            mem_l.append(max(g.get("background_ms", 0.0) for g in group) / 1e3)
            snap_points.append((min(g["time"] for g in group), step))
    m.memory_snapshot_s = _mean(mem_c) if mem_c else _mean(dur_c)
    m.durable_snapshot_s = _mean(dur_c)
    m.memory_latency_s = _mean(mem_l)
    up_s: list[float] = []
    ups: dict[int, list[dict[str, Any]]] = {}
    for e in by_kind.get("upload", []):
        if e.get("committed"):
            ups.setdefault(int(e["step"]), []).append(e)
    for evs in ups.values():
        for group in _clusters(evs, 5.0):
            up_s.append(max(g.get("seconds", 0.0) for g in group))
    if up_s:
        m.durable_latency_s = statistics.fmean(up_s) + (m.memory_latency_s or 0.0)

    mem_r: list[float] = []
    dur_r: list[float] = []
    for group in _clusters([e for e in by_kind.get("restore", []) if e.get("found")], 10.0):
        tiers = {s.get("tier") for g in group for s in g.get("sources", [])}
        (dur_r if "durable" in tiers else mem_r).append(max(g.get("seconds", 0.0) for g in group))
    m.memory_restore_s = _mean(mem_r)
    m.durable_restore_s = _mean(dur_r)

    restarts: list[float] = []
    for group in _clusters(by_kind.get("start", []), 10.0)[1:]:
        t = min(g["time"] for g in group)
        before = [e["time"] for e in events if e["time"] < t and e.get("event") != "start"]
        if before:
            restarts.append(t - max(before))
    m.restart_s = _mean(restarts)

    steps: list[float] = []
    snap_points.sort()
    for (t0, s0), (t1, s1) in zip(snap_points, snap_points[1:], strict=False):
        if s1 > s0 and t1 - t0 < 60.0 * (s1 - s0):  # the same incarnation, no restart between
            steps.append((t1 - t0) / (s1 - s0))
    m.step_s = statistics.median(steps) if steps else None
    m.counts = {"snapshots": len(mem_c) + len(dur_c), "durable_snapshots": len(dur_c),
                "uploads": len(up_s), "memory_restores": len(mem_r),
                "durable_restores": len(dur_r), "restarts": len(restarts)}
    return m


def measured_from_bench(path: str | os.PathLike[str]) -> Measured:
    """Costs from one ``bench/results/*.json``:

    * ``recovery.json``: restart = detection + restart (rendezvous and worker start) of the
      node-loss arms, the memory and durable restore times, the step time;
    * ``snapshot_overhead.json``: aegis' blocking and background time (the largest size run);
    * ``restore.json``: restore time from peer memory and from the durable tier; the durable
      save time (snapshot -> uploaded) as the durable commit latency;
    * ``goodput.json``: the costs it measured.
    """
    p = Path(path)
    with open(p) as f:
        doc = json.load(f)
    m = Measured(sources=[f"bench {p}"])
    kind = doc.get("bench")
    if kind == "recovery" and isinstance(doc.get("arms"), dict):
        arms = doc["arms"]
        restarts = []
        for name, arm in arms.items():
            ph = arm.get("phases") or {}
            if not name.startswith("aegis") or "restart_s" not in ph:
                continue
            restarts.append(ph.get("detection_s", 0.0) + ph["restart_s"])
            if "memory" in name:
                m.memory_restore_s = ph.get("restore_s")
                m.step_s = arm.get("wall_per_step_before_kill_s")
            elif "durable" in name:
                m.durable_restore_s = ph.get("restore_s")
        m.restart_s = _mean(restarts)
    elif kind == "recovery" or "phases" in doc.get("recovery", {}):
        ph = doc["recovery"]["phases"]
        m.restart_s = ph["detection_s"] + ph["rendezvous_and_start_s"]
        m.memory_restore_s = ph.get("restore_event_seconds_max", ph.get("restore_s"))
        stats = doc["recovery"].get("step_stats_before_kill", {})
        m.memory_snapshot_s = stats.get("save_time_mean_s")
        m.step_s = stats.get("wall_per_step_s")
    elif kind == "snapshot_overhead":
        if "summary" in doc:
            cases = doc["summary"]
            blocking = cases.get("aegis_blocking") or cases.get("aegis")
        else:
            cases = doc["sizes"][-1]["cases"]
            blocking = cases.get("aegis")
        m.memory_snapshot_s = blocking["median_ms"] / 1e3
        bg = cases.get("aegis_background")
        if isinstance(bg, dict) and "median_ms" in bg:
            m.memory_latency_s = bg["median_ms"] / 1e3
    elif kind == "restore":
        sources = doc["summary"]["sources"]
        peer = sources.get("peer memory") or sources.get("own memory")
        if peer:
            m.memory_restore_s = peer["median_s"]
        durable = [v["median_s"] for k, v in sources.items() if k.startswith("durable")]
        if durable:
            m.durable_restore_s = max(durable)
        saves = [v for k, v in doc["summary"].get("save_s", {}).items() if k.startswith("aegis")]
        if saves:
            m.durable_latency_s = max(saves)
    elif kind == "goodput":
        c = doc["planner_costs"]
        m = Measured(**{k: c.get(k) for k in (
            "memory_snapshot_s", "durable_snapshot_s", "memory_restore_s", "durable_restore_s",
            "restart_s", "memory_latency_s", "durable_latency_s", "step_s")},
            sources=[f"bench {p}"])
    elif "restore" in doc and "upload" in doc:  # the former bench/durable.py
        restore = doc["restore"]
        r = restore.get("aegis-s3") or restore.get("aegis-file")
        if r:
            m.durable_restore_s = r["seconds"]
        up = doc["upload"].get("s3") or doc["upload"].get("file")
        if up:
            m.durable_latency_s = up["seconds"]
    else:
        raise ValueError(f"{p}: not a result of bench/recovery.py, snapshot_overhead.py, "
                         "restore.py or goodput.py")
    return m


# -- costs that grow with the job: bench/scale.py's fitted series at the job's size (issue 24) ----

# (panel, label) of bench/scale.py's series -> the cost it measures
SCALE_COSTS = {
    "commit_s": ("commit time per snapshot (s)", "format 4 (issue 24)"),
    "detect_s": ("fault -> every survivor fenced it (s)", "SIGKILL of a node"),
    "agree_s": ("loss published -> every survivor has the next round (s)", "after the SIGKILL"),
}


def fit_loglog(x: Sequence[float], y: Sequence[float]) -> tuple[float, float] | None:
    """Least squares of log y = a + b log x over the positive points; (a, b), or None."""
    pts = [(math.log(a), math.log(b)) for a, b in zip(x, y, strict=True) if a > 0 and b and b > 0]
    if len(pts) < 2:
        return None
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    sxx = sum((p[0] - mx) ** 2 for p in pts)
    if sxx == 0:
        return None
    b = sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx
    return my - b * mx, b


def larger_half(x: Sequence[float], y: Sequence[float]) -> tuple[list[float], list[float]]:
    """The points of the larger half of the sizes (at least 3): what a projection extrapolates
    from (the smallest worlds' times are a heartbeat's phase, near zero, and would set the
    slope). ``bench/scale.py``'s projection (docs/guides/benchmarks.md) and :func:`scale_costs` both fit these."""
    keep = sorted(range(len(x)), key=lambda i: x[i])[max(0, min(len(x) - 3, len(x) // 2)):]
    return [x[i] for i in keep], [y[i] for i in keep]


def scale_costs(doc: Mapping[str, Any], ranks: int) -> dict[str, dict[str, float]]:
    """Each of :data:`SCALE_COSTS` that ``doc`` (``bench/results/scale.json``) measured, fitted
    log-log and evaluated at ``ranks``: ``{name: {value, exponent, measured_to}}``. Points the
    benchmark marked as limited by its machine are left out; a cost with fewer than two usable
    points is absent, and so is one whose series the benchmark marked not to project (times
    measured with more ranks than the machine has cores grow with the ranks sharing them:
    ``"project": false``)."""
    out: dict[str, dict[str, float]] = {}
    series = [s for sec in doc.get("sections", {}).values() for s in sec.get("series", [])]
    for name, (panel, label) in SCALE_COSTS.items():
        s = next((s for s in series if s.get("panel") == panel and s.get("label") == label), None)
        if s is None or s.get("project") is False:
            continue
        limited = s.get("limited") or [False] * len(s["x"])
        pts = [(x, y) for x, y, lim in zip(s["x"], s["y"], limited, strict=True)
               if y is not None and not lim]
        ab = fit_loglog(*larger_half([p[0] for p in pts], [p[1] for p in pts]))
        if ab is None:
            continue
        a, b = ab
        out[name] = {"value": math.exp(a) * ranks ** b, "exponent": b,
                     "measured_to": float(max(p[0] for p in pts))}
    return out
