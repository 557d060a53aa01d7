"""aegis demo: a simulated 3-node training job loses a node and recovers from peer memory.

1. A reference run: the reference trainer, uninterrupted, same world size, no aegis.
2. The same job on 3 simulated nodes (torchrun agents with their own node ids and tmpfs node
   stores, meeting through a standalone rendezvous store), aegis snapshotting every step and
   replicating each shard to the next node.
3. Mid-run one node is SIGKILLed (agent and workers) and its node store deleted.
4. In-process recovery (the default; ``aegis.run_in_process``): the survivors' processes never
   exit. They re-form their process groups without the lost node (3 -> 2), rebuild the model,
   restore the newest committed step from their own memory and the replicas they hold
   (resharding to 2 ranks) and train on. A replacement node with an empty store starts
   meanwhile; the survivors admit it at their next snapshot, and all 3 ranks reshard from that
   step and train on. Checks: the survivors kept their processes; each restore loaded the
   newest committed step and its state equals the state saved at that step (full-state
   crc32c); until the world first changed size every loss equals the uninterrupted run's.
   ``--restart``: the torchrun path instead: every worker is restarted, the replacement joins
   the new rendezvous, the job restores at full size and every loss after recovery equals the
   uninterrupted run's, bitwise (``--shrink``: no replacement, the world shrinks 3 -> 2).

``make demo`` runs it; exit code 0 only if every check passes.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from aegis.sim.cluster import SimCluster  # noqa: E402
from aegis.sim.scenario import (  # noqa: E402
    END_MARGIN_STEPS,
    HOLD_STEPS,
    JOIN_WAIT_S,
    read_events,
    wait_exited,
    write_end,
)
from aegis.sim.scenario import read_jsonl as jsonl  # noqa: E402
from aegis.snapshot.node_store import NodeStore  # noqa: E402

TRAINER = str(ROOT / "examples" / "train_fsdp.py")


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--steps", type=int, default=None,
                    help="default 40; in-process 70, the fewest: the job trains on until the "
                         "replacement joined, then a few steps more")
    ap.add_argument("--kill-after", type=int, default=15, help="kill once this step is logged")
    ap.add_argument("--kill", default="node-1", help="which node to lose")
    ap.add_argument("--shrink", action="store_true", help="--restart: no replacement node: the world shrinks")
    ap.add_argument("--restart", action="store_true",
                    help="recover by restarting every worker under torchrun (the path without "
                         "aegis.run_in_process)")
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--redundancy", choices=("replica", "xor", "rs"), default="replica",
                    help="memory redundancy: one replica per shard, XOR parity over all nodes "
                         "(e.g. --nodes 5 --redundancy xor: 1.25x memory instead of 2x), or "
                         "Reed-Solomon with 2 parity over all nodes (--nodes 6: 4+2, 1.5x)")
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args(argv)

    if args.steps is None:
        args.steps = 40 if args.restart else 70
    work = Path(args.workdir or tempfile.mkdtemp(prefix="aegis-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    world = args.nodes
    train = ["--config", args.config, "--steps", str(args.steps), "--dropout", "0.1",
             *(["--redundancy", args.redundancy, "--group-size", str(args.nodes)]
               if args.redundancy != "replica" else [])]
    mode = f"shrink {args.nodes} -> {args.nodes - 1} nodes" if args.shrink else "replacement node joins"
    if not args.restart:
        mode = (f"in-process recovery: survivors go on at {args.nodes - 1} ranks, a replacement "
                "node joins at a snapshot")
        args.shrink = False
    print(f"aegis demo: {args.nodes} simulated nodes x 1 rank, {args.config} model, {args.steps} steps, "
          f"snapshot every step, "
          f"{ {'xor': 'XOR parity', 'rs': 'Reed-Solomon parity (2)'}.get(args.redundancy, '1 replica')}"
          f"{' over the nodes' if args.redundancy != 'replica' else ''}; "
          f"lose {args.kill} after step {args.kill_after}; {mode}")
    print(f"logs: {work}")

    checks: list[tuple[str, bool]] = []
    reference: dict[int, dict] = {}
    if not args.shrink:
        print("1) reference run (uninterrupted, no aegis) ...", flush=True)
        ref_log = work / "reference.jsonl"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
               TRAINER, *train, "--no-aegis", "--loss-log", str(ref_log)]
        with open(work / "reference.log", "wb") as out:
            code = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                  env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}).returncode
        if code != 0:
            print(f"reference run failed; see {work / 'reference.log'}")
            return 1
        reference = {r["step"]: r for r in jsonl(ref_log)}

    if not args.restart:
        return in_process(args, work, train, reference, checks)
    print(f"2) start {args.nodes} nodes ...", flush=True)
    loss_log, digest_log = work / "loss.jsonl", work / "digest.jsonl"
    cluster = SimCluster(
        work,
        [TRAINER, *train, "--job", "demo", "--loss-log", str(loss_log), "--digest-log", str(digest_log),
         "--step-sleep", "0.05"],
        nodes=args.nodes,
        min_nodes=args.nodes - 1 if args.shrink else args.nodes,
        max_nodes=args.nodes,
        job="demo",
    )
    try:
        cluster.start()
        deadline = time.monotonic() + 300
        while max((r["step"] for r in jsonl(loss_log)), default=0) < args.kill_after:
            if time.monotonic() > deadline:
                print("the job did not reach the kill step; see the node logs")
                return 1
            time.sleep(0.02)
        survivors = [n for n in cluster.alive_nodes() if n != args.kill]
        old_workers = {p for n in survivors for p in cluster.nodes[n].workers()}
        print(f"3) SIGKILL {args.kill} (agent + workers) and delete its node store", flush=True)
        t_kill = cluster.kill_node(args.kill)
        if not args.shrink:
            replacement = cluster.add_node()
            print(f"   replacement {replacement.node_id} started with an empty node store", flush=True)
        t_detect = wait_exited(old_workers, max(deadline - time.monotonic(), 1))
        committed_at_kill = max(
            (s.step for n in survivors for s in NodeStore(cluster.nodes[n].store_dir, "demo").steps() if s.committed),
            default=0,
        )
        print("4) waiting for the job to finish ...", flush=True)
        codes = cluster.wait(600)
    finally:
        cluster.shutdown()

    ok_exit = all(c == 0 for c in codes.values())
    checks.append((f"every node's agent exited 0 ({codes})", ok_exit))
    evs = read_events(work)
    after = [e for e in evs if e["time"] > t_kill]
    starts = [e for e in after if e["event"] == "start"]
    restores = [e for e in after if e["event"] == "restore" and e.get("found")]
    losses = jsonl(loss_log)
    if not restores or not starts:
        print("no restore after the kill was recorded; see the node logs")
        return 1
    restored = restores[0]["step"]
    resumed = [r for r in losses if r["time"] > t_kill and r["step"] > restored]
    first = resumed[0] if resumed else None
    t_up = max(e["time"] for e in starts)
    t_restored = max(e["time"] for e in restores)
    new_world = restores[0]["world_size"]

    print()
    print(f"recovery timeline (seconds after the SIGKILL of {args.kill})")
    print(f"  {0.0:6.2f}  kill        {args.kill}: agent and workers SIGKILLed, node store deleted")
    if t_detect:
        print(f"  {t_detect - t_kill:6.2f}  detection   survivors' workers failed their collective and exited")
    print(f"  {t_up - t_kill:6.2f}  rendezvous  new round complete, world {new_world}: every worker up "
          f"(process group and aegis Manager started)")
    tiers: dict[str, int] = {}
    fetched = 0
    read = 0
    secs = max(e["seconds"] for e in restores)
    for e in restores:
        read += e["bytes"]
        fetched += e.get("bytes_fetched", 0)
        for s in e["sources"]:
            tiers[s["source"]] = tiers.get(s["source"], 0) + 1
    src = ", ".join(f"{k}: {v} shard reads" for k, v in sorted(tiers.items()))
    print(f"  {t_restored - t_kill:6.2f}  restore     step {restored} on {len(restores)} ranks in {secs:.2f} s "
          f"({fmt_bytes(read)} read, {read / secs / 1e9:.3f} GB/s; {fmt_bytes(fetched)} fetched from peers; {src})")
    if first:
        print(f"  {first['time'] - t_kill:6.2f}  first step  step {first['step']} finished (loss {first['loss']:.6f})")
    print()

    checks.append((f"restored the newest step committed at the kill ({committed_at_kill})", restored == committed_at_kill))
    digests = jsonl(digest_log)
    saved = {d["step"]: d["digest"] for d in digests if d["phase"] == "saved" and d["time"] < t_kill}
    back = [d for d in digests if d["phase"] == "restored" and d["time"] > t_kill]
    checks.append((f"restored state equals the state saved at step {restored} (full-state crc32c)",
                   bool(back) and back[0]["digest"] == saved.get(restored)))
    checks.append(("training finished every step", bool(losses) and losses[-1]["step"] == args.steps))
    if not args.shrink:
        same = [r for r in resumed if reference[r["step"]]["loss_hex"] == r["loss_hex"]]
        checks.append((f"all {len(resumed)} losses after recovery equal the uninterrupted run bitwise",
                       bool(resumed) and len(same) == len(resumed)))
        print(f"   {'step':>5}  {'uninterrupted':>16}  {'after recovery':>16}")
        for r in resumed[:5] + ([] if len(resumed) <= 6 else [{"step": "..."}]) + resumed[-1:] * (len(resumed) > 5):
            if r["step"] == "...":
                print("     ...")
                continue
            print(f"   {r['step']:>5}  {reference[r['step']]['loss']:>16.12f}  {r['loss']:>16.12f}")
        print()
    ok = True
    for what, passed in checks:
        ok &= passed
        print(f"  [{'PASS' if passed else 'FAIL'}] {what}")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


def in_process(args: argparse.Namespace, work: Path, train: list[str], reference: dict[int, dict],
               checks: list[tuple[str, bool]]) -> int:
    print(f"2) start {args.nodes} nodes (train_fsdp.py --in-process) ...", flush=True)
    loss_log, digest_log = work / "loss.jsonl", work / "digest.jsonl"
    # the job does not end after a count of steps: it trains on until the replacement (an
    # interpreter and torch to start: ~4.5 s on a loaded 2-core machine) has joined, then a few
    # steps more (the trainer's --end-file; the ranks agree on it)
    end_file, end = work / "end_step", args.steps
    write_end(end_file, args.steps + HOLD_STEPS)
    cluster = SimCluster(
        work,
        [TRAINER, *train, "--job", "demo", "--loss-log", str(loss_log), "--digest-log", str(digest_log),
         "--step-sleep", "0.05", "--in-process", "--min-world", str(args.nodes - 1),
         "--end-file", str(end_file)],
        nodes=args.nodes, job="demo",
    )
    try:
        cluster.start()
        deadline = time.monotonic() + 300
        while max((r["step"] for r in jsonl(loss_log)), default=0) < args.kill_after:
            if time.monotonic() > deadline:
                print("the job did not reach the kill step; see the node logs")
                return 1
            time.sleep(0.02)
        survivors = [n for n in cluster.alive_nodes() if n != args.kill]
        old_workers = {p for n in survivors for p in cluster.nodes[n].workers()}
        print(f"3) SIGKILL {args.kill} (agent + workers) and delete its node store", flush=True)
        t_kill = cluster.kill_node(args.kill)
        committed_at_kill = max(
            (s.step for n in survivors for s in NodeStore(cluster.nodes[n].store_dir, "demo").steps() if s.committed),
            default=0,
        )
        while not any(r["time"] > t_kill and r["world"] == args.nodes - 1 for r in jsonl(loss_log)):
            if time.monotonic() > deadline:
                print("the survivors did not train again; see the node logs")
                return 1
            time.sleep(0.02)
        t_replace = time.time()
        replacement = cluster.add_node(solo=True)
        print(f"4) the survivors train on at {args.nodes - 1} ranks; replacement {replacement.node_id} "
              "started with an empty node store", flush=True)
        until = time.monotonic() + JOIN_WAIT_S
        while time.monotonic() < until and cluster.alive_nodes() and not any(
                e["event"] == "restore" and e.get("found") and e["_node"] == replacement.node_id
                for e in read_events(work)):
            time.sleep(0.1)
        seen = jsonl(loss_log)
        end = max(args.steps, (seen[-1]["step"] if seen else 0) + END_MARGIN_STEPS)
        write_end(end_file, end)
        print(f"5) the replacement joined; the job ends at step {end} ...", flush=True)
        finished = cluster.wait_workers(600)
    finally:
        cluster.shutdown()

    evs = read_events(work)
    after = [e for e in evs if e["time"] > t_kill]
    recov = [e for e in after if e["event"] == "recovery" and e.get("failed_at")]
    shrink_restores = [e for e in after if e["event"] == "restore" and e.get("found") and e["time"] < t_replace]
    grow_restores = [e for e in after if e["event"] == "restore" and e.get("found") and e["time"] > t_replace]
    losses = jsonl(loss_log)
    if not recov or not shrink_restores:
        print("no in-process recovery after the kill was recorded; see the node logs")
        return 1
    restored = shrink_restores[0]["step"]
    starts = [e for e in after if e["event"] == "start" and e["time"] < t_replace]
    pids = {e.get("pid") for e in starts}
    t_fail = max(e["failed_at"] for e in recov)
    t_grouped = max(e["time"] for e in recov)
    t_up = max(e["time"] for e in starts)
    t_restored = max(e["time"] for e in shrink_restores)
    first = next((r for r in losses if r["time"] > t_restored and r["step"] > restored), None)
    timings = recov[0]["timings"]

    print()
    print(f"recovery timeline (seconds after the SIGKILL of {args.kill})")
    print(f"  {0.0:6.2f}  kill        {args.kill}: agent and workers SIGKILLed, node store deleted")
    print(f"  {t_fail - t_kill:6.2f}  detection   the survivors' collective failed (connection closed)")
    print(f"  {t_grouped - t_kill:6.2f}  re-formed   round {recov[0]['round']}, world {recov[0]['world_size']}: "
          f"teardown {timings.get('teardown_s', 0):.2f} s, agreement {timings.get('agree_s', 0):.2f} s, "
          f"new process group {timings.get('regroup_s', 0):.2f} s (same processes)")
    print(f"  {t_up - t_kill:6.2f}  rebuilt     mesh, FSDP model, optimizer and aegis Manager built again")
    src: dict[str, int] = {}
    for e in shrink_restores:
        for x in e["sources"]:
            src[x["source"]] = src.get(x["source"], 0) + 1
    print(f"  {t_restored - t_kill:6.2f}  restore     step {restored} resharded to {len(shrink_restores)} ranks "
          f"({', '.join(f'{k}: {v} shard reads' for k, v in sorted(src.items()))})")
    if first:
        print(f"  {first['time'] - t_kill:6.2f}  first step  step {first['step']} finished (loss {first['loss']:.6f})")
    grown = next((r for r in losses if r["time"] > t_replace and r["world"] == args.nodes), None)
    if grow_restores and grown:
        window = [r for r in losses if r["time"] <= grown["time"]]
        stall = max((b["time"] - a["time"] for a, b in zip(window, window[1:], strict=False)
                     if b["time"] > t_replace), default=0.0)
        print(f"  {t_replace - t_kill:6.2f}  replacement {replacement.node_id} started (interpreter, torch, its "
              "own torchrun agent); the survivors train meanwhile")
        print(f"  {grown['time'] - t_kill:6.2f}  grown       world {args.nodes} again from step "
              f"{grow_restores[0]['step']} (admitted at a snapshot; survivors' longest stall {stall:.2f} s)")
    print()

    digests = jsonl(digest_log)
    saved = [(d["step"], d["digest"]) for d in digests if d["phase"] == "saved"]

    def same_as_saved(step: int, t0: float, t1: float) -> bool:
        back = [d for d in digests if d["phase"] == "restored" and t0 < d["time"] < t1 and d["step"] == step]
        return bool(back) and back[0]["digest"] in {dg for s, dg in saved if s == step}

    checks.append((f"the survivors kept their processes: no worker restarted ({len(pids)} pids, same as before)",
                   bool(pids) and pids <= old_workers))
    checks.append((f"restored the newest step committed at the kill ({committed_at_kill}), in place",
                   restored == committed_at_kill))
    checks.append((f"restored state equals the state saved at step {restored} (full-state crc32c)",
                   same_as_saved(restored, t_kill, t_replace)))
    if args.redundancy != "replica":
        checks.append((f"the lost node's shard was rebuilt from the survivors' {args.redundancy.upper()} parity",
                       "rebuild" in src))
    if grow_restores:
        g = grow_restores[0]["step"]
        checks.append((f"the replacement joined: every rank of the grown world restored step {g}, "
                       "equal to the state saved at that step",
                       len({e["step"] for e in grow_restores}) == 1 and same_as_saved(g, t_replace, float("inf"))))
    else:
        checks.append(("the replacement joined the running job", False))
    checks.append((f"training finished every step (to step {end})",
                   finished and bool(losses) and losses[-1]["step"] >= end))
    before = [r for r in losses if r["time"] < t_kill]
    same = [r for r in before if reference[r["step"]]["loss_hex"] == r["loss_hex"]]
    checks.append((f"all {len(before)} losses until the world changed size equal the uninterrupted run bitwise",
                   bool(before) and len(same) == len(before)))
    ok = True
    for what, passed in checks:
        ok &= passed
        print(f"  [{'PASS' if passed else 'FAIL'}] {what}")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
