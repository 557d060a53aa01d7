#!/usr/bin/env python
"""In-process recovery with real faults, on CPU or with CUDA tensors over gloo (issue 23).

``--procs`` processes (one simulated node each, a node store of its own) train a small
data-parallel model (DDP, the same batch on every rank, so every rank holds the whole state)
under :func:`aegis.run_in_process` with ``backend="gloo"`` (on ``--device cuda`` the tensors
live on the GPU and gloo moves them: several processes can share one GPU that way, NCCL could
not), snapshot every step. Then, with the membership store hosted here:

1. one process is SIGKILLed; the survivors recover in place (world ``procs - 1``); a
   replacement process is started and joins at a snapshot (world ``procs`` again);
2. ``--cycles - 1`` more recoveries: a process is frozen (SIGSTOP) until the survivors have
   formed a round without it and trained on, then thawed (SIGCONT); it rejoins in place.

Checked, and written to ``--out`` (JSON): the survivors' processes never restart (same pids to
the end); every restore of a step loads exactly the state that was saved at that step (a
crc32c digest of every tensor of model and optimizer, logged at save and at restore); the
memory each survivor holds at the start of a round (``torch.cuda.memory_allocated`` on CUDA,
and the process's RSS) stays flat over the recoveries; the time from each fault to the
survivors' first trained step after it.

    .venv/bin/python bench/inprocess_check.py --device cpu --cycles 3      # here
    python3 bench/inprocess_check.py --device cuda --cycles 10             # a GPU machine
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
JOB = "ipc"


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--procs", type=int, default=3)
    p.add_argument("--cycles", type=int, default=10, help="recoveries: 1 kill + (cycles-1) freezes")
    p.add_argument("--dim", type=int, default=1024, help="width of the model (4 Linear layers)")
    p.add_argument("--staging", default="sync", choices=("sync", "pinned", "async"))
    p.add_argument("--step-sleep", type=float, default=0.05)
    p.add_argument("--timeout", type=float, default=420.0, help="the whole check, seconds")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "inprocess_check.json")
    p.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--root", type=Path, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# -- worker ------------------------------------------------------------------------------------


def _digest(model: Any, opt: Any) -> str:
    import crc32c
    import torch

    crc = 0
    for k, v in sorted(model.state_dict().items()):
        crc = crc32c.crc32c(k.encode(), crc)
        crc = crc32c.crc32c(v.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes(), crc)
    for pid, st in sorted(opt.state_dict()["state"].items()):
        for k, v in sorted(st.items()):
            if isinstance(v, torch.Tensor):
                crc = crc32c.crc32c(f"{pid}.{k}".encode(), crc)
                crc = crc32c.crc32c(v.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes(), crc)
    return f"{crc:08x}"


def _rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def worker(args: argparse.Namespace) -> int:
    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import aegis

    root = args.root
    assert root is not None
    torch.set_num_threads(1)
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(0)
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    log = open(root / f"w{args.worker}.jsonl", "a")  # noqa: SIM115 - closed at exit

    def emit(**kw: Any) -> None:
        log.write(json.dumps({"w": args.worker, "pid": os.getpid(), "time": time.time(), **kw}) + "\n")
        log.flush()

    def stop_at() -> int:
        try:
            return int((root / "stop_at").read_text())
        except (OSError, ValueError):
            return 10**9

    def train(world: aegis.World) -> None:
        mem = {"rss": _rss()}
        if cuda:
            mem["cuda_allocated"] = int(torch.cuda.memory_allocated())
            mem["cuda_reserved"] = int(torch.cuda.memory_reserved())
        emit(event="round", round=world.round, world=world.size, rank=world.rank, **mem,
             timings=world.timings, cause=world.cause)
        torch.manual_seed(0)
        d = args.dim
        net = nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Linear(d, d), nn.GELU(),
                            nn.Linear(d, d), nn.GELU(), nn.Linear(d, 16)).to(dev)
        model = DDP(net, device_ids=[0] if cuda else None)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        mgr = aegis.Manager(JOB, {"model": aegis.ModelOptimizerState(model, opt)}, every=1,
                            keep=1, replicas=1, staging=args.staging, verbose=False)
        start = mgr.restore()
        emit(event="restored", round=world.round, world=world.size, step=start,
             digest=_digest(net, opt) if start else None)
        step = start
        while step < stop_at():
            step += 1
            g = torch.Generator().manual_seed(step)  # the same batch on every rank
            x = torch.randn(64, d, generator=g).to(dev)
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            # logged before save(): a Regroup (joiners admitted) ends the round inside it,
            # after the snapshot committed
            emit(event="state", step=step, digest=_digest(net, opt))
            mgr.save(step)
            emit(event="step", round=world.round, world=world.size, step=step)
            time.sleep(args.step_sleep)
        mgr.close()
        emit(event="done", round=world.round, step=step)

    aegis.run_in_process(train, min_world=2, backend="gloo", dead_after_s=1.0,
                         collective_timeout=timedelta(seconds=30))
    emit(event="exit")
    return 0


# -- harness -----------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Harness:
    def __init__(self, args: argparse.Namespace, root: Path, port: int) -> None:
        self.args, self.root, self.port = args, root, port
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.killed: set[int] = set()

    def start(self, i: int) -> None:
        env = dict(os.environ, AEGIS_MEMBERSHIP=f"127.0.0.1:{self.port}",
                   WORLD_SIZE=str(self.args.procs), LOCAL_RANK="0", AEGIS_NODE_ID=f"n{i}",
                   AEGIS_STORE_DIR=str(self.root / f"store-n{i}"),
                   AEGIS_EVENTS_DIR=str(self.root / f"events-n{i}"), OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", str(i), "--root",
               str(self.root), "--device", self.args.device, "--dim", str(self.args.dim),
               "--staging", self.args.staging, "--step-sleep", str(self.args.step_sleep)]
        with open(self.root / f"w{i}.out", "ab") as out:
            self.procs[i] = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                             start_new_session=True)

    def events(self) -> list[dict[str, Any]]:
        out = []
        for f in sorted(self.root.glob("w*.jsonl")):
            for line in f.read_text().splitlines():
                try:
                    out.append(json.loads(line))
                except ValueError:
                    continue  # a line being written
        return out

    def wait_for(self, what: str, pred: Any, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if pred(self.events()):
                return
            dead = [i for i, p in self.procs.items()
                    if p.poll() not in (None, 0) and i not in self.killed]
            if dead:
                raise RuntimeError(f"worker(s) {dead} exited with {[self.procs[i].poll() for i in dead]} "
                                   f"while waiting for {what}")
            time.sleep(0.1)
        raise TimeoutError(f"timed out waiting for {what}")

    def max_step(self, evs: list[dict[str, Any]] | None = None) -> int:
        return max((e["step"] for e in (evs or self.events()) if e["event"] == "step"), default=0)

    def trained_after(self, workers: list[int], t: float, steps: int, world: int
                      ) -> Any:
        def pred(evs: list[dict[str, Any]]) -> bool:
            return all(sum(1 for e in evs if e["w"] == w and e["event"] == "step" and e["time"] > t
                           and e["world"] == world) >= steps for w in workers)
        return pred


def harness(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    t_start = time.monotonic()
    root = Path(tempfile.mkdtemp(prefix="aegis-ipc-", dir="/dev/shm"))
    port = _free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=60))
    h = Harness(args, root, port)
    survivors = [0, 1]
    doc: dict[str, Any] = {"command": " ".join([Path(sys.executable).name, *sys.argv]),
                           "device": args.device, "procs": args.procs, "cycles": args.cycles,
                           "staging": args.staging, "faults": [], "errors": []}
    if args.device == "cuda":
        import torch

        doc["gpu"] = torch.cuda.get_device_name(0)
    try:
        for i in range(args.procs):
            h.start(i)
        h.wait_for("every process training", lambda evs: all(
            any(e["w"] == i and e["event"] == "step" and e["step"] >= 5 for e in evs)
            for i in range(args.procs)), timeout=180)
        pids = {i: h.procs[i].pid for i in survivors}
        victim, nxt = args.procs - 1, args.procs
        for cycle in range(args.cycles):
            t0 = time.time()
            if cycle == 0:
                h.killed.add(victim)
                os.killpg(h.procs[victim].pid, signal.SIGKILL)
                kind = "kill"
            else:
                os.killpg(h.procs[victim].pid, signal.SIGSTOP)
                kind = "freeze"
            fault = {"cycle": cycle, "kind": kind, "worker": victim, "time": t0}
            h.wait_for(f"cycle {cycle}: the survivors training without w{victim}",
                       h.trained_after(survivors, t0, 2, args.procs - 1))
            evs = h.events()
            first = min(e["time"] for e in evs if e["event"] == "step" and e["time"] > t0
                        and e["w"] in survivors and e["world"] == args.procs - 1)
            fault["resume_s"] = first - t0
            t1 = time.time()
            if kind == "kill":
                h.procs[victim].wait()
                h.start(nxt)
                victim, nxt = nxt, nxt + 1
            else:
                os.killpg(h.procs[victim].pid, signal.SIGCONT)
            h.wait_for(f"cycle {cycle}: w{victim} back, {args.procs} ranks training",
                       h.trained_after([*survivors, victim], t1, 2, args.procs), timeout=180)
            fault["rejoin_s"] = time.time() - t1
            doc["faults"].append(fault)
            print(f"cycle {cycle}: {kind} w{fault['worker']}: survivors resumed after "
                  f"{fault['resume_s']:.2f} s, back to {args.procs} ranks after "
                  f"{fault['rejoin_s']:.2f} s", flush=True)
            if time.monotonic() - t_start > args.timeout - 60:
                doc["errors"].append(f"stopped after {cycle + 1} cycles: time budget")
                break
        (root / "stop_at").write_text(str(h.max_step() + 10))
        for i, p in h.procs.items():
            if p.poll() is None:
                try:
                    p.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    doc["errors"].append(f"w{i} did not exit")
                if p.returncode not in (0, None) and i not in h.killed:
                    doc["errors"].append(f"w{i} exited with {p.returncode}")
        verdict = _verdict(h.events(), pids, survivors)
        doc["errors"].extend(verdict.pop("errors"))
        doc.update(verdict)
    except Exception as e:  # noqa: BLE001 - reported in the document
        doc["errors"].append(f"{type(e).__name__}: {e}")
    finally:
        for p in h.procs.values():
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
        tails = {}
        for f in sorted(root.glob("w*.out")):
            tails[f.name] = f.read_text(errors="replace")[-1500:]
        doc["worker_output_tails"] = tails
        import shutil

        shutil.rmtree(root, ignore_errors=True)
        del server
    doc["ok"] = not doc["errors"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps({k: v for k, v in doc.items() if k != "worker_output_tails"}, indent=1))
    return 0 if doc["ok"] else 1


def _verdict(evs: list[dict[str, Any]], pids: dict[int, int], survivors: list[int]
             ) -> dict[str, Any]:
    out: dict[str, Any] = {}
    errors: list[str] = []
    # 1. the survivors never restarted
    seen = {w: sorted({e["pid"] for e in evs if e["w"] == w}) for w in survivors}
    for w in survivors:
        if seen[w] != [pids[w]]:
            errors.append(f"survivor w{w} ran as pids {seen[w]}, expected only {pids[w]}")
    out["survivor_pids"] = seen
    # 2. every restore loads exactly what was saved at that step
    saved: dict[int, set[str]] = {}
    for e in evs:
        if e["event"] == "state":
            saved.setdefault(e["step"], set()).add(e["digest"])
    # a step in flight when a peer died may leave ranks with different states (DDP surfaces a
    # failed all-reduce late); such a step never commits (the commit needs every rank's shard)
    out["steps_with_differing_states"] = sorted(s for s, d in saved.items() if len(d) > 1)
    restores = [e for e in evs if e["event"] == "restored" and e["step"]]
    bad = [(e["w"], e["round"], e["step"]) for e in restores
           if e["digest"] not in saved.get(e["step"], set())]
    if bad:
        errors.append(f"restores that differ from the saved state: {bad[:5]}")
    out["restores_checked"] = len(restores)
    out["restores_bitwise"] = not bad and bool(restores)
    # 3. memory at round start, per survivor, over the rounds
    mem: dict[str, Any] = {}
    for w in survivors:
        rounds = [e for e in evs if e["w"] == w and e["event"] == "round"]
        series = {k: [e[k] for e in rounds if k in e] for k in ("cuda_allocated", "rss")}
        mem[f"w{w}"] = {k: v for k, v in series.items() if v}
        later = series["cuda_allocated"][1:]  # from the first recovery on (round 0 is empty)
        if later and max(later) - min(later) > 16 << 20:
            errors.append(f"w{w}: CUDA memory at round start grew from {min(later)} to "
                          f"{max(later)} bytes over {len(later)} recoveries")
    out["memory_at_round_start"] = mem
    out["rounds"] = max((e["round"] for e in evs if e["event"] == "round"), default=0)
    out["errors"] = errors
    return out


def main(argv: list[str] | None = None) -> int:
    args = _parse(list(sys.argv[1:] if argv is None else argv))
    if args.worker is not None:
        return worker(args)
    return harness(args)


if __name__ == "__main__":
    sys.exit(main())
