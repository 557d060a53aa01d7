"""aegis demo: a training job is SIGKILLed mid-run and resumes from its in-memory snapshot.

1. an uninterrupted reference run of the reference trainer (2 ranks, torchrun, CPU/gloo);
2. the same run with aegis snapshotting every step into a tmpfs node store; every rank is
   SIGKILLed mid-run (workers and agent: torchrun starts workers in their own sessions);
3. the same command again: aegis restores the newest committed snapshot and training continues;
4. the losses after the restore are compared with the reference run, bit for bit.

Run with ``python examples/demo_restart.py``. Exit code 0 only when the resumed losses equal the reference bitwise.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from aegis.sim.procs import kill_tree, wait_gone  # noqa: E402

TRAINER = ROOT / "examples" / "train_fsdp.py"


def torchrun(nproc: int, args: list[str], *, log: Path) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
        str(TRAINER), *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    with open(log, "ab") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True, cwd=ROOT)


def read_losses(path: Path) -> dict[int, dict]:
    if not path.exists():
        return {}
    out = {}
    for line in path.read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            out[rec["step"]] = rec
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--kill-after", type=int, default=14, help="SIGKILL once this step is logged")
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args(argv)

    work = Path(args.workdir or tempfile.mkdtemp(prefix="aegis-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    store = Path(tempfile.mkdtemp(prefix="aegis-demo-", dir="/dev/shm"))
    common = ["--config", args.config, "--steps", str(args.steps), "--dropout", "0.1"]
    log = work / "torchrun.log"
    print(f"aegis demo: {args.nproc} ranks, {args.config} model, {args.steps} steps; logs in {work}")

    print("1) reference run, uninterrupted ...", flush=True)
    ref_log = work / "reference.jsonl"
    p = torchrun(args.nproc, [*common, "--no-aegis", "--loss-log", str(ref_log)], log=log)
    if p.wait() != 0:
        print(f"reference run failed; see {log}")
        return 1
    reference = read_losses(ref_log)

    print("2) run with aegis (snapshot every step), then SIGKILL every rank mid-run ...", flush=True)
    run_log = work / "aegis.jsonl"
    trainer_args = [*common, "--every", "1", "--store-dir", str(store), "--loss-log", str(run_log),
                    "--step-sleep", "0.05", "--job", "demo"]
    p = torchrun(args.nproc, trainer_args, log=log)
    while p.poll() is None and max(read_losses(run_log), default=0) < args.kill_after:
        time.sleep(0.02)
    if p.poll() is not None:
        print(f"the run ended before it could be killed; see {log}")
        return 1
    t_kill = time.time()
    victims = kill_tree(p.pid)
    wait_gone(victims)
    p.wait()
    killed_at = max(read_losses(run_log))
    committed = sorted(int(d.name[5:]) for d in (store / "demo").glob("step-*") if (d / "manifest.json").exists())
    print(f"   SIGKILL sent to {len(victims)} processes after step {killed_at} was logged; "
          f"committed snapshots in the node store: {committed}")

    print("3) restart the same command: aegis restores from host memory ...", flush=True)
    before = len(read_losses(run_log))
    t_restart = time.time()
    p = torchrun(args.nproc, trainer_args, log=log)
    code = p.wait()
    if code != 0:
        print(f"resumed run failed (exit {code}); see {log}")
        return 1
    lines = [json.loads(x) for x in run_log.read_text().splitlines() if x.strip()]
    resumed = lines[before:]
    first = resumed[0]
    events = [json.loads(x) for x in (store / "demo" / "events" / "rank-00000.jsonl").read_text().splitlines()]
    restore = [e for e in events if e["event"] == "restore" and e["time"] >= t_restart][-1]
    print(f"   restored step {restore['step']} in {restore['seconds'] * 1e3:.0f} ms "
          f"({restore['bytes'] / 1e6:.2f} MB read); first step after restart: {first['step']} "
          f"(restart to first step {first['time'] - t_restart:.1f} s, kill to first step "
          f"{first['time'] - t_kill:.1f} s)")

    print("4) losses after the restore vs the uninterrupted run:")
    print(f"   {'step':>5}  {'reference':>20}  {'resumed':>20}  equal")
    ok = first["step"] == restore["step"] + 1
    for rec in resumed:
        ref = reference[rec["step"]]
        same = ref["loss_hex"] == rec["loss_hex"]
        ok &= same
        print(f"   {rec['step']:>5}  {ref['loss']:>20.12f}  {rec['loss']:>20.12f}  {'yes' if same else 'NO'}")
    ok &= resumed[-1]["step"] == args.steps
    print("PASS: resumed at the snapshot step with bitwise-equal losses" if ok else "FAIL")
    shutil.rmtree(store, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
