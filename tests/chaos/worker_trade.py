"""One worker killed on a multi-rank node: replace the dead worker, or let its node leave the job?
(issue 25, part 5). Measures both trades on the simulated cluster, with in-process recovery.

    python -m tests.chaos.worker_trade --repeats 3 --out bench/results/worker_trade.json

The reference trainer on 3 nodes x 2 ranks (``aegis.launch`` agents), a snapshot every step, one
replica; node-1's local rank 1 is SIGKILLed between steps. Arms:

* ``replace``: its agent starts one new process for that rank; the 5 survivors recover in place
  (world 5), the new process joins at their next snapshot (world 6).
* ``leave``: its agent stops the node's other worker and exits; the 4 processes of the other two
  nodes recover in place (world 4). What that costs later depends on when a node comes back:
  here a replacement node (empty store, its own rendezvous) is started as soon as the job runs
  shrunk, and joins at a snapshot (world 6), the best case for this arm.

Per run, from rank 0's loss log: the survivors' stall at the fault (kill -> first step trained
after the recovery), the stall when the world grows back (the regroup step's gap less the median
step time), the time at reduced world, the world meanwhile, and the capacity lost in
rank-seconds (every rank idle during a stall, the missing ranks while the world is reduced).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from aegis.sim.cluster import SimCluster
from aegis.sim.scenario import TRAINER, read_jsonl

NODES, NPROC = 3, 2
FULL = NODES * NPROC


def run_arm(work: Path, policy: str, *, kill_after: int = 10, steps: int = 60,
            timeout: float = 300.0) -> dict[str, Any]:
    shutil.rmtree(work, ignore_errors=True)
    loss, digest = work / "loss.jsonl", work / "digest.jsonl"
    cl = SimCluster(
        work,
        [TRAINER, "--config", "tiny", "--steps", str(steps), "--dropout", "0.1", "--job", "trade",
         "--replicas", "1", "--loss-log", str(loss), "--digest-log", str(digest),
         "--step-sleep", "0.05", "--timeout", "6", "--pg-timeout", "12",
         "--in-process", "--min-world", str(FULL - NPROC)],
        nodes=NODES, nproc_per_node=NPROC, job="trade", on_worker_failure=policy)
    deadline = time.monotonic() + timeout
    t_node = None
    try:
        cl.start()
        while not (read_jsonl(loss) and read_jsonl(loss)[-1]["step"] >= kill_after):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no step {kill_after}: {work}")
            time.sleep(0.05)
        time.sleep(0.1)  # between steps
        t_kill, _ = cl.kill_worker("node-1", 1)
        if policy == "leave":  # a node comes back as soon as the job runs shrunk (best case)
            while not any(x["world"] < FULL for x in read_jsonl(loss) if x["time"] > t_kill):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the job never ran shrunk: {work}")
                time.sleep(0.05)
            cl.add_node(solo=True)
            t_node = time.time()
        if not cl.wait_workers(max(1.0, deadline - time.monotonic())):
            raise TimeoutError(f"the job did not finish: {work}")
    finally:
        cl.shutdown()
    return measure(read_jsonl(loss), t_kill, policy, t_node)


def measure(losses: list[dict[str, Any]], t_kill: float, policy: str, t_node: float | None) -> dict[str, Any]:
    before = [x for x in losses if x["time"] < t_kill]
    after = [x for x in losses if x["time"] > t_kill]
    normal = statistics.median(b["time"] - a["time"] for a, b in zip(before[2:], before[3:], strict=False))
    first = after[0]
    full_again = next(x for x in after if x["world"] == FULL)
    i = after.index(full_again)
    regroup_gap = full_again["time"] - after[i - 1]["time"] if i else full_again["time"] - t_kill
    reduced = [x for x in after[:i]]
    world = min((x["world"] for x in reduced), default=FULL)
    stall1 = first["time"] - t_kill
    stall2 = max(0.0, regroup_gap - normal) if i else 0.0
    reduced_s = full_again["time"] - t_kill
    lost = FULL * (stall1 + stall2) + (FULL - world) * max(0.0, reduced_s - stall1 - stall2)
    return {
        "policy": policy,
        "step_s": normal,
        "stall_at_fault_s": stall1,
        "stall_at_regroup_s": stall2,
        "reduced_world": world,
        "reduced_s": reduced_s,
        "rank_s_lost": lost,
        "lost_steps": (before[-1]["step"] if before else 0) - first["step"] + 1,
        "node_started_after_s": None if t_node is None else t_node - t_kill,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workdir", default="/tmp/aegis-worker-trade")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    rows: list[dict[str, Any]] = []
    for r in range(a.repeats):
        for policy in ("replace", "leave"):
            res = run_arm(Path(a.workdir) / f"{policy}-{r}", policy)
            rows.append(res)
            print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in res.items()}),
                  flush=True)
    print()
    print("| trade | survivors' stall at the fault (s) | stall when the world grows back (s) "
          "| reduced world | time at reduced world (s) | rank-seconds lost | lost steps |")
    print("|---|---|---|---|---|---|---|")
    for policy in ("replace", "leave"):
        rs = [x for x in rows if x["policy"] == policy]

        def med(k: str, rs: list[dict[str, Any]] = rs) -> str:
            v = [x[k] for x in rs]
            return f"{statistics.median(v):.1f} ({min(v):.1f}-{max(v):.1f})"

        print(f"| {policy} | {med('stall_at_fault_s')} | {med('stall_at_regroup_s')} | "
              f"{FULL} -> {rs[0]['reduced_world']} | {med('reduced_s')} | {med('rank_s_lost')} | "
              f"{med('lost_steps')} |")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({"topology": f"{NODES}x{NPROC}", "runs": rows}, indent=1))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
