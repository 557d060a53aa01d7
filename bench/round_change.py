#!/usr/bin/env python
"""What a new round costs the processes that stay: Manager start, restore, first save, first
step, when the world changes size in place (issue 25).

``--world`` gloo processes on CPU (one simulated node and node store each) train the example's
FSDP2 model (``--config``) with a Manager that snapshots every step. The same processes then go
through rounds of world ``W, W-1, W, W-1`` (the last process sits out the ``W-1`` rounds), the
way in-process recovery re-forms its groups: each round a new process group, a new model,
optimizer and Manager, ``restore()`` from the node stores (resharding), then ``--steps`` steps.
Rounds 3 and 4 repeat the world sizes of rounds 1 and 2, so their first save can reuse the plan
of those rounds (``plan_reused``) and their DTensor dispatch is warm.

Per round, on rank 0: Manager start, restore (and its phase timings from the ``restore`` event),
the first training step and the steady one (median of the rest), the first save's blocking and
planning time and whether its plan was reused.

    .venv/bin/python bench/round_change.py                  # writes bench/results/round_change.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, f, free_port, new_doc, run_ranks, text_table, trainer_module, write_doc  # noqa: E402


def _round(rank: int, world: int, port: int, store_dir: str, events: str, config: str,
           steps: int) -> dict[str, Any] | None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    from aegis import Manager, ModelOptimizerState

    T = trainer_module()
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        t0 = time.perf_counter()
        model = T.build_model(config, seed=0, mesh=mesh)
        opt, sched = T.build_optimizer_and_scheduler(model, lr=1e-3, total_steps=10_000)
        mgr = Manager("rounds", {"model": ModelOptimizerState(model, opt), "scheduler": sched},
                      every=1, keep=2, store_dir=os.path.join(store_dir, f"node-{rank}"),
                      events_dir=events, verbose=False)
        t1 = time.perf_counter()
        start = mgr.restore()
        t2 = time.perf_counter()
        data = T.SyntheticTokens(model.cfg.vocab_size, model.cfg.seq_len, seed=0)
        step_s, first_save = [], None
        for step in range(start + 1, start + steps + 1):
            ts = time.perf_counter()
            x, y = data.batch([(step * 64 + rank * 2 + i) % 100_000 for i in range(2)])
            logits = model(x)
            F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1)).backward()
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step_s.append(time.perf_counter() - ts)
            handle = mgr.save(step)
            if first_save is None and handle is not None:
                r = handle.wait()
                first_save = {"blocking_s": r.blocking_s, "plan_s": r.plan_s,
                              "plan_reused": getattr(r, "plan_reused", None)}
        mgr.close()
        dist.barrier()
        if rank:
            return None
        return {"world": world, "restored_step": start, "manager_start_s": t1 - t0,
                "restore_s": t2 - t1, "first_step_s": step_s[0],
                "steady_step_s": statistics.median(step_s[1:]), "first_save": first_save,
                "param_dtype": str(torch.get_default_dtype())}
    finally:
        dist.destroy_process_group()


def _rounds(rank: int, world: int, ports: list[int], store_dir: str, events: str, config: str,
            steps: int) -> list[dict[str, Any] | None]:
    import torch.distributed as dist

    dist.destroy_process_group()  # the rounds make their own groups, as run_in_process does
    out = []
    for i, port in enumerate(ports):
        w = world if i % 2 == 0 else world - 1
        if rank < w:
            out.append(_round(rank, w, port, store_dir, events, config, steps))
        else:
            out.append(None)
            time.sleep(0.5)
    return out


def _run(args: argparse.Namespace) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(dir="/dev/shm", prefix="aegis-rounds-") as tmp:
        events = os.path.join(tmp, "events")
        ports = [free_port() for _ in range(4)]
        results = run_ranks(args.world, _rounds, ports, tmp, events, args.config, args.steps,
                            timeout=600, rank_env=lambda r: {"AEGIS_NODE_ID": f"node-{r}"})
        restores = [json.loads(line) for line in
                    Path(events, "rank-00000.jsonl").read_text().splitlines()]
        restores = [e for e in restores if e["event"] == "restore" and e.get("found")]
    rounds = [r for r in results[0] if r is not None]
    for r, e in zip(rounds[1:], restores, strict=True):  # round 1 has nothing to restore
        r["apply_s"] = e["timings"].get("apply_s")
        r["restore_timings"] = e["timings"]
    for r in rounds:
        r.update(first_save_s=r["first_save"]["blocking_s"], plan_s=r["first_save"]["plan_s"],
                 plan_reused=r["first_save"]["plan_reused"])
    return rounds


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=3)
    p.add_argument("--config", default="tiny")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--repeats", type=int, default=3, help="runs; the table shows medians")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "round_change.json")
    args = p.parse_args(argv)
    doc = new_doc("round_change", __file__, sys.argv[1:] if argv is None else argv, args)
    runs = [_run(args) for _ in range(args.repeats)]
    doc["runs"] = runs
    keys = ["manager_start_s", "restore_s", "apply_s", "first_step_s", "steady_step_s",
            "first_save_s", "plan_s"]

    def med(i: int, k: str) -> float | None:
        v = [r[i][k] for r in runs if r[i].get(k) is not None]
        return statistics.median(v) if v else None

    doc["median"] = [{"round": i + 1, "world": runs[0][i]["world"],
                      "plan_reused": [r[i]["plan_reused"] for r in runs],
                      **{k: med(i, k) for k in keys}} for i in range(len(runs[0]))]
    rows = [[str(m["round"]), str(m["world"]), *(f(m[k], ".3f") for k in keys),
             ",".join(str(x) for x in m["plan_reused"])] for m in doc["median"]]
    print(f"medians of {args.repeats} runs, rank 0")
    print(text_table(["round", "world", "manager s", "restore s", "apply s", "first step s",
                      "steady step s", "first save s", "plan s", "plan reused"], rows))
    write_doc(doc, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
