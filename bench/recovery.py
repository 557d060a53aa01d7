#!/usr/bin/env python
"""Node loss end to end on the simulated cluster: recovery time, restore throughput, overhead.

One run measures, on this machine:

1. **gloo bandwidth**: 2 processes, a gloo group on loopback, ``send``/``recv`` of one large
   uint8 tensor (``--gloo-mib``), 1 warm-up + ``--gloo-repeats`` timed transfers; best and
   median GB/s (timed on the receiver, from a barrier to the end of ``recv``).
2. **node loss**: the reference trainer (``examples/train_fsdp.py``, a TinyGPT sized so that
   params + AdamW exp_avg + exp_avg_sq in fp32 are ``--state-mb`` MB) on ``--nodes`` simulated
   nodes (``aegis.sim.cluster.SimCluster``, 1 rank per node), snapshot every step, 1 replica.
   After step ``--kill-after`` is logged, ``node-1`` is SIGKILLed (agent + workers, node store
   deleted) and a replacement node starts. The time from the SIGKILL to the first resumed step
   is split into: detection (the survivors' old workers have exited), rendezvous + worker start
   (every new worker's aegis ``start`` event), restore (the ``restore`` events), first step
   (the loss log). Restore throughput: (a) bytes the replacement node fetched from peers / its
   fetch time, (b) bytes loaded / restore seconds, both next to the raw gloo bandwidth.
3. **training throughput**: mean wall time per step (loss-log timestamps, after
   ``--warmup-steps``) on the same cluster and model with ``--no-aegis`` and with
   ``--every 1 --replicas 1``; the ratio of steps/s.

Targets (PASS/FAIL, never tuned for): kill -> first resumed step <= 10 s; restore throughput
>= 0.6x raw gloo bandwidth; steps/s with snapshots >= 0.9x without.

The trainer runs through this file (``recovery.py _trainer SPEC -- ARGS``), which registers a
``bench`` entry in the trainer's ``CONFIGS`` for the computed model and calls its ``main``;
``train_fsdp.py`` itself is unchanged.

    .venv/bin/python bench/recovery.py                   # ~500 MB state, ~4-6 min on 2 cores
    .venv/bin/python bench/recovery.py --state-mb 100 --phases gloo,recovery

Defaults: --state-mb 500 (dim 512, vocab 8192, seq 64 -> 11 layers, 43M params),
--batch-size 1, --kill-after 4, --recovery-steps 7, --throughput-steps 12, --warmup-steps 4
(steady state; the ratio over all steps after step 1 is reported too).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from _machine import machine_basics  # noqa: E402 - bench/ is on sys.path as a script

ROOT = Path(__file__).resolve().parent.parent
SELF = str(Path(__file__).resolve())
TRAINER = ROOT / "examples" / "train_fsdp.py"
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "recovery.json"
PHASES = ("gloo", "recovery", "throughput")
TARGET_RECOVERY_S = 10.0
TARGET_RESTORE_VS_GLOO = 0.6
TARGET_THROUGHPUT_RATIO = 0.9
GB = 1e9


# -- the trainer, run under torchrun by the simulated nodes -----------------------------------


def _trainer(argv: list[str]) -> int:
    """``_trainer DIM,LAYERS,HEADS,VOCAB,SEQ -- TRAIN_FSDP_ARGS``: train_fsdp.main with a
    ``bench`` config of that shape."""
    import faulthandler
    import signal

    t_enter = time.time()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # stacks of a hung worker, on demand
    spec, rest = argv[0], argv[1:]
    if rest[:1] == ["--"]:
        rest = rest[1:]
    mod_spec = importlib.util.spec_from_file_location("train_fsdp", TRAINER)
    assert mod_spec is not None and mod_spec.loader is not None
    mod = importlib.util.module_from_spec(mod_spec)
    sys.modules["train_fsdp"] = mod
    mod_spec.loader.exec_module(mod)  # imports torch
    times_dir = os.environ.get("BENCH_TIMES_DIR")
    if times_dir:  # where a restarted worker's start-up time goes
        marks = {"node": os.environ.get("AEGIS_NODE_ID"), "pid": os.getpid(),
                 "enter": t_enter, "imported": time.time()}
        out = Path(times_dir) / f"{marks['node']}-{os.getpid()}.json"
        out.parent.mkdir(parents=True, exist_ok=True)

        def mark(name: str, fn: Any, enter: str | None = None) -> Any:
            def timed(*a: Any, **k: Any) -> Any:
                if enter:
                    marks[enter] = time.time()
                r = fn(*a, **k)
                marks[name] = time.time()
                out.write_text(json.dumps(marks))
                return r
            return timed

        mod.init_distributed = mark("process_group", mod.init_distributed, "main_setup")
        mod.build_model = mark("model_built", mod.build_model)
        out.write_text(json.dumps(marks))
    dim, layers, heads, vocab, seq = (int(x) for x in spec.split(","))
    mod.CONFIGS["bench"] = mod.GPTConfig(vocab_size=vocab, dim=dim, n_layers=layers,
                                         n_heads=heads, seq_len=seq, lr=6e-4)
    return int(mod.main(["--config", "bench", *rest]))


def model_shape(state_mb: float, dim: int, heads: int, vocab: int, seq: int) -> dict[str, int]:
    """TinyGPT layers so that params x 12 bytes (fp32 param + exp_avg + exp_avg_sq) ~ state_mb."""
    fixed = 2 * vocab * dim + seq * dim + 2 * dim  # tok_emb, head, pos_emb, ln_f
    per_layer = 12 * dim * dim + 13 * dim
    layers = max(1, round((state_mb * 1e6 / 12 - fixed) / per_layer))
    params = fixed + layers * per_layer
    return {"dim": dim, "n_layers": layers, "n_heads": heads, "vocab_size": vocab,
            "seq_len": seq, "params": params, "state_bytes": 12 * params}


# -- 1. raw gloo bandwidth ---------------------------------------------------------------------

_GLOO_MAIN = r"""
import json, sys, time
from datetime import timedelta
import torch, torch.distributed as dist
rank, port, nbytes, repeats = (int(x) for x in sys.argv[1:5])
store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=60))
dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
buf = torch.empty(nbytes, dtype=torch.uint8)
buf.fill_(rank + 1)
secs = []
for i in range(repeats + 1):
    dist.barrier()
    t0 = time.perf_counter()
    if rank == 0:
        dist.send(buf, 1)
    else:
        dist.recv(buf, 0)
    t = time.perf_counter() - t0
    if i:
        secs.append(t)
if rank == 1:
    assert int(buf[-1]) == 1
    print(json.dumps({"seconds": secs}), flush=True)
dist.barrier()
dist.destroy_process_group()
"""


def measure_gloo(mib: int, repeats: int) -> dict[str, Any]:
    from aegis.sim.cluster import free_port

    port, nbytes = free_port(), mib * 2**20
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    procs = [subprocess.Popen([sys.executable, "-c", _GLOO_MAIN, str(r), str(port), str(nbytes),
                               str(repeats)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=env) for r in (0, 1)]
    outs = [p.communicate(timeout=300) for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError("gloo bandwidth run failed: " + " | ".join(o[1].decode()[-500:] for o in outs))
    secs = json.loads(outs[1][0].decode().strip().splitlines()[-1])["seconds"]
    gbps = [nbytes / s / GB for s in secs]
    return {"bytes": nbytes, "repeats": repeats, "seconds": secs, "gbps": gbps,
            "best_gbps": max(gbps), "median_gbps": statistics.median(gbps)}


# -- the simulated cluster ---------------------------------------------------------------------


def _jsonl(path: Path) -> list[dict[str, Any]]:
    from aegis.sim.scenario import read_jsonl

    return read_jsonl(path)


def _cluster(work: Path, job: str, spec: str, args: argparse.Namespace, steps: int,
             extra: list[str]) -> Any:
    from aegis.sim.cluster import SimCluster

    cmd = [SELF, "_trainer", spec, "--", "--steps", str(steps), "--batch-size",
           str(args.batch_size), "--job", job, "--loss-log", str(work / "loss.jsonl"), *extra]
    return SimCluster(work, cmd, nodes=args.nodes, job=job,
                      store_root=f"/dev/shm/aegis-bench-{os.getpid()}-{job}",
                      env={"BENCH_TIMES_DIR": str(work / "trainer-times")})


def _wait_step(cluster: Any, loss_log: Path, step: int, deadline: float) -> None:
    while max((r["step"] for r in _jsonl(loss_log)), default=0) < step:
        if time.monotonic() > deadline:
            raise TimeoutError(f"step {step} was never logged; see {cluster.workdir}")
        if not cluster.alive_nodes():
            raise RuntimeError(f"every node exited before step {step}; see {cluster.workdir}")
        time.sleep(0.02)


def _step_stats(losses: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """Wall time per step from loss-log timestamps (steps after ``warmup``), plus the trainer's
    own step_time (fwd/bwd/optimizer) and save_time (blocking part of Manager.save)."""
    rows = [r for r in losses if r["step"] > warmup]
    out: dict[str, Any] = {"steps_used": [r["step"] for r in rows]}
    if len(rows) >= 2:
        span = rows[-1]["time"] - rows[0]["time"]
        out["wall_per_step_s"] = span / (rows[-1]["step"] - rows[0]["step"])
        out["steps_per_s"] = 1.0 / out["wall_per_step_s"]
    if rows:
        out["step_time_mean_s"] = statistics.mean(r["step_time"] for r in rows)
        out["save_time_mean_s"] = statistics.mean(r["save_time"] for r in rows)
    return out


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _spawn_time(pid: int) -> float | None:
    """Wall-clock time at which ``pid`` was created (/proc starttime, 10 ms resolution)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            btime = next(int(x.split()[1]) for x in f if x.startswith("btime"))
    except (FileNotFoundError, StopIteration, ValueError):
        return None
    return btime + ticks / os.sysconf("SC_CLK_TCK")


def _watch_restart(cluster: Any, old: set[int], nodes: int, deadline: float
                   ) -> tuple[float | None, dict[str, float | None]]:
    """Poll until the survivors' old workers are gone (the detection time, as
    aegis.sim.scenario.wait_exited) and every live node runs a new worker; returns the
    detection time and, per node, when its first new worker process was created."""
    t_detect: float | None = None
    spawned: dict[str, float | None] = {}
    while time.monotonic() < deadline:
        if t_detect is None and not any(_running(p) for p in old):
            t_detect = time.time()
        for n in cluster.alive_nodes():
            if n not in spawned:
                new = [p for p in cluster.nodes[n].workers() if p not in old]
                if new:
                    spawned[n] = min((t for t in map(_spawn_time, new) if t is not None),
                                     default=time.time())
        if t_detect is not None and len(spawned) >= nodes:
            break
        time.sleep(0.01)
    return t_detect, spawned


def run_recovery(args: argparse.Namespace, spec: str, work: Path) -> dict[str, Any]:
    from aegis.sim.scenario import read_events
    from aegis.snapshot.node_store import NodeStore

    work.mkdir(parents=True, exist_ok=True)
    job = "bench-recovery"
    loss_log = work / "loss.jsonl"
    cluster = _cluster(work, job, spec, args, args.recovery_steps,
                       ["--every", "1", "--replicas", "1"])
    victim = "node-1"
    t_start = time.time()
    deadline = time.monotonic() + args.phase_timeout
    try:
        cluster.start()
        _wait_step(cluster, loss_log, args.kill_after, deadline)
        time.sleep(0.1)  # between steps, as aegis.sim.scenario.Kill does
        survivors = [n for n in cluster.alive_nodes() if n != victim]
        old = {p for n in survivors for p in cluster.nodes[n].workers()}
        last_logged = max(r["step"] for r in _jsonl(loss_log))
        t_kill = cluster.kill_node(victim)
        replacement = cluster.add_node().node_id
        t_detect, spawned = _watch_restart(cluster, old, args.nodes, deadline)
        committed = sorted({s.step for n in survivors
                            for s in NodeStore(cluster.nodes[n].store_dir, job).steps()
                            if s.committed})
        codes = cluster.wait(max(deadline - time.monotonic(), 1))
    finally:
        cluster.shutdown()
    losses = _jsonl(loss_log)
    events = read_events(work)
    before = [r for r in losses if r["time"] < t_kill]
    after_ev = [e for e in events if e["time"] > t_kill]
    restores = [e for e in after_ev if e["event"] == "restore" and e.get("found")]
    if not restores:
        raise RuntimeError(f"no restore after the kill; see {work}")
    t_first_restore = min(e["time"] for e in restores)
    starts = [e for e in after_ev if e["event"] == "start" and e["time"] <= t_first_restore]
    restored = restores[0]["step"]
    resumed = [r for r in losses if r["time"] > t_kill and r["step"] > restored]
    t_up = max(e["time"] for e in starts)
    t_restored = max(e["time"] for e in restores)
    first = resumed[0] if resumed else None
    res: dict[str, Any] = {
        "workdir": str(work), "exit_codes": codes, "killed": victim, "replacement": replacement,
        "t_cluster_start": t_start, "t_kill": t_kill, "t_detect": t_detect,
        "last_step_logged_before_kill": last_logged, "committed_on_survivors": committed,
        "restored_step": restored, "first_resumed_step": first["step"] if first else None,
        "step_stats_before_kill": _step_stats(before, 1),  # steps 2 .. kill
        "losses": losses, "start_events": starts, "restore_events": restores,
    }
    t_spawn = max((t for t in spawned.values() if t is not None), default=None)
    res["workers_spawned"] = spawned
    phases = {"detection_s": (t_detect - t_kill) if t_detect else None}
    phases["rendezvous_and_start_s"] = t_up - (t_detect or t_kill)
    phases["rendezvous_s"] = (t_spawn - (t_detect or t_kill)) if t_spawn else None
    phases["worker_start_s"] = (t_up - t_spawn) if t_spawn else None
    phases["restore_s"] = t_restored - t_up
    phases["restore_event_seconds_max"] = max(e["seconds"] for e in restores)
    phases["first_step_s"] = (first["time"] - t_restored) if first else None
    phases["first_step_step_time_s"] = first["step_time"] if first else None
    phases["kill_to_first_step_s"] = (first["time"] - t_kill) if first else None
    phases["first_step_save_s"] = first["save_time"] if first else None
    res["phases"] = phases
    res["worker_start"] = _worker_start(work, t_kill, starts, spawned)
    # restore throughput
    ranks = []
    for e in sorted(restores, key=lambda e: e["rank"]):
        peer = [s for s in e["sources"] if s["tier"] == "peer"]
        fetch_bytes = sum(s.get("fetch_bytes", 0) for s in peer)
        # every shard of one exchange round reports the round's time: take the longest
        fetch_s = max((s.get("fetch_s", 0.0) for s in peer), default=0.0)
        ranks.append({
            "rank": e["rank"], "node": e["_node"], "bytes": e["bytes"],
            "bytes_fetched": e.get("bytes_fetched", 0), "seconds": e["seconds"],
            "timings": e["timings"], "tiers": sorted({s["tier"] for s in e["sources"]}),
            "fetch_bytes": fetch_bytes, "fetch_s": fetch_s,
            "fetch_gbps": fetch_bytes / fetch_s / GB if fetch_s else None,
            "fetch_verify_gbps": (fetch_bytes / e["timings"]["fetch_verify_s"] / GB
                                  if fetch_bytes and e["timings"].get("fetch_verify_s") else None),
            "load_gbps": e["bytes"] / e["seconds"] / GB if e["seconds"] else None,
        })
    res["ranks"] = ranks
    repl = [r for r in ranks if r["node"] == replacement]
    fb = sum(r["fetch_bytes"] for r in repl)
    fs = max((r["fetch_s"] for r in repl), default=0.0)
    fv = max((r["timings"].get("fetch_verify_s", 0.0) for r in repl), default=0.0)
    total_bytes = sum(r["bytes"] for r in ranks)
    secs = max(r["seconds"] for r in ranks)
    res["throughput"] = {
        "replacement_fetch_bytes": fb, "replacement_fetch_s": fs,
        "replacement_fetch_gbps": fb / fs / GB if fs else None,
        "replacement_fetch_verify_s": fv,
        "replacement_fetch_verify_gbps": fb / fv / GB if fv else None,
        "all_fetched_bytes": sum(r["bytes_fetched"] for r in ranks),
        "loaded_bytes": total_bytes, "restore_s_max": secs,
        "loaded_gbps": total_bytes / secs / GB if secs else None,
    }
    return res


def _worker_start(work: Path, t_kill: float, starts: list[dict[str, Any]],
                  spawned: dict[str, float | None]) -> dict[str, Any]:
    """Where a restarted worker's start-up goes (per node, seconds): process spawn -> main()
    (interpreter), -> torch + trainer imported, -> the trainer's main() set-up (its
    torch.use_deterministic_algorithms imports torch._dynamo/_inductor), -> process group up
    (waits for the slowest worker), -> model built (init + fully_shard), ->
    aegis 'start' event (optimizer, scheduler, Manager with its two gloo groups)."""
    out: dict[str, Any] = {}
    for f in sorted((work / "trainer-times").glob("*.json")):
        m = json.loads(f.read_text())
        if m["enter"] < t_kill:
            continue
        start = next((e["time"] for e in starts if e["_node"] == m["node"]), None)
        spawn = spawned.get(m["node"])
        seq = [("interpreter_s", spawn, m["enter"]), ("import_s", m["enter"], m["imported"]),
               ("main_setup_s", m["imported"], m.get("main_setup")),
               ("process_group_s", m.get("main_setup"), m.get("process_group")),
               ("build_model_s", m.get("process_group"), m.get("model_built")),
               ("optimizer_and_manager_s", m.get("model_built"), start)]
        out[m["node"]] = {k: (b - a) if a is not None and b is not None else None
                          for k, a, b in seq}
    return out


def run_throughput(args: argparse.Namespace, spec: str, work: Path, extra: list[str],
                   job: str) -> dict[str, Any]:
    work.mkdir(parents=True, exist_ok=True)
    cluster = _cluster(work, job, spec, args, args.throughput_steps, extra)
    t0 = time.time()
    try:
        cluster.start()
        codes = cluster.wait(args.phase_timeout)
    finally:
        cluster.shutdown()
    losses = _jsonl(work / "loss.jsonl")
    if not losses or losses[-1]["step"] != args.throughput_steps:
        raise RuntimeError(f"{job}: training did not finish ({codes}); see {work}")
    first_loss = losses[0]["time"]
    snaps = [e for e in _read_events(work) if e["event"] == "snapshot"]
    return {"workdir": str(work), "args": extra, "exit_codes": codes,
            "startup_to_first_step_s": first_loss - t0, "wall_s": time.time() - t0,
            **_step_stats(losses, args.warmup_steps), "losses": losses,
            "snapshot_events_rank0": [e for e in snaps if e["rank"] == 0]}


def _read_events(work: Path) -> list[dict[str, Any]]:
    from aegis.sim.scenario import read_events

    return read_events(work)


# -- report ------------------------------------------------------------------------------------


class ForeignCpu:
    """Samples, every ``interval`` s, the CPU time used by processes that are not this one or
    its descendants (other people's jobs on the machine), so each phase can say how much
    noise it had. A lower bound: a foreign process's last interval before it exits is lost."""

    def __init__(self, interval: float = 0.5) -> None:
        self.me = os.getpid()
        self.interval = interval
        self.tick = os.sysconf("SC_CLK_TCK")
        self.total = 0.0  # foreign CPU seconds since start
        self.by_cmd: dict[str, float] = {}
        self._prev: dict[int, int] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._sample(count=False)
        self._thread = threading.Thread(target=self._run, name="foreign-cpu", daemon=True)
        self._thread.start()

    def _sample(self, count: bool = True) -> None:
        procs: dict[int, tuple[int, int]] = {}
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                with open(f"/proc/{d}/stat") as f:
                    f_ = f.read().rsplit(")", 1)[1].split()
                procs[int(d)] = (int(f_[1]), int(f_[11]) + int(f_[12]))
            except (OSError, IndexError, ValueError):
                continue
        mine: dict[int, bool] = {}

        def is_mine(pid: int) -> bool:
            chain = []
            p = pid
            while p not in mine and p != self.me and p > 1 and p in procs:
                chain.append(p)
                p = procs[p][0]
            answer = mine.get(p, p == self.me)
            for c in chain:
                mine[c] = answer
            return answer

        with self._lock:
            for pid, (_, ticks) in procs.items():
                # every pid's previous value is kept, so a worker of ours that is re-parented
                # to init when its agent is killed only counts what it uses from then on
                delta = ticks - self._prev.get(pid, 0)
                self._prev[pid] = ticks
                if count and delta > 0 and not is_mine(pid):
                    secs = delta / self.tick
                    self.total += secs
                    try:
                        with open(f"/proc/{pid}/cmdline", "rb") as f:
                            cmd = f.read().replace(b"\0", b" ").decode(errors="replace")[:80]
                    except OSError:
                        cmd = str(pid)
                    self.by_cmd[cmd] = self.by_cmd.get(cmd, 0.0) + secs

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def mark(self) -> tuple[float, float, dict[str, float]]:
        with self._lock:
            return time.time(), self.total, dict(self.by_cmd)

    def since(self, m: tuple[float, float, dict[str, float]]) -> dict[str, Any]:
        now, total, by_cmd = self.mark()
        top = sorted(((v - m[2].get(k, 0.0), k) for k, v in by_cmd.items()), reverse=True)[:3]
        wall = now - m[0]
        return {"wall_s": wall, "foreign_cpu_s": total - m[1],
                "foreign_cpus": (total - m[1]) / wall if wall else 0.0,
                "top": [{"cmd": k, "cpu_s": v} for v, k in top if v > 0.05]}

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def _git() -> dict[str, Any]:
    def git(*a: str) -> str:
        r = subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, timeout=30)
        return r.stdout.strip()

    with contextlib.suppress(Exception):
        return {"commit": git("rev-parse", "HEAD"),
                "dirty": git("status", "--porcelain", "--", "aegis", "examples").splitlines()}
    return {}


def _machine() -> dict[str, Any]:
    import torch

    basics = machine_basics(("MemTotal", "MemAvailable"))
    mem = {k: v for k, v in basics.items() if k.endswith("_kib")}
    cpu = basics["cpu_model"]
    shm = shutil.disk_usage("/dev/shm")
    return {"cpu_count": os.cpu_count(), "cpu_model": cpu, **mem, "dev_shm_total": shm.total,
            "torch": torch.__version__, "python": platform.python_version(),
            "platform": platform.platform(), "device": "cpu"}


def _f(x: float | None, fmt: str = "{:.2f}") -> str:
    return "n/a" if x is None else fmt.format(x)


def _targets(doc: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    gloo = doc.get("gloo", {}).get("median_gbps")
    rec = doc.get("recovery")
    if rec:
        e2e = rec["phases"]["kill_to_first_step_s"]
        out.append({"target": f"kill -> first resumed step <= {TARGET_RECOVERY_S:.0f} s",
                    "value": e2e, "pass": e2e is not None and e2e <= TARGET_RECOVERY_S})
        for key, what in (("replacement_fetch_gbps", "(a) peer fetch on replacement"),
                          ("loaded_gbps", "(b) bytes loaded / restore s")):
            v = rec["throughput"][key]
            ratio = v / gloo if (v is not None and gloo) else None
            out.append({"target": f"{what} >= {TARGET_RESTORE_VS_GLOO}x raw gloo (median)",
                        "value": ratio,
                        "pass": None if ratio is None else ratio >= TARGET_RESTORE_VS_GLOO})
    thr = doc.get("throughput")
    if thr and thr.get("ratio") is not None:
        out.append({"target": f"steps/s with snapshots >= {TARGET_THROUGHPUT_RATIO}x without",
                    "value": thr["ratio"], "pass": thr["ratio"] >= TARGET_THROUGHPUT_RATIO})
    return out


def _print_report(doc: dict[str, Any]) -> None:
    m = doc["model"]
    print()
    print(f"model: TinyGPT dim {m['dim']} x {m['n_layers']} layers, vocab {m['vocab_size']}, "
          f"seq {m['seq_len']}, {m['params'] / 1e6:.1f}M params, state {m['state_bytes'] / 1e6:.0f}"
          f" MB (fp32 params + exp_avg + exp_avg_sq); {doc['args']['nodes']} nodes x 1 rank, "
          f"batch {doc['args']['batch_size']}")
    rows: list[tuple[str, str]] = []
    g = doc.get("gloo")
    if g:
        rows.append(("raw gloo send/recv, loopback (best / median)",
                     f"{g['best_gbps']:.2f} / {g['median_gbps']:.2f} GB/s "
                     f"({g['bytes'] / 2**20:.0f} MiB x {g['repeats']})"))
    rec = doc.get("recovery")
    if rec:
        p, t = rec["phases"], rec["throughput"]
        st = rec["step_stats_before_kill"]
        rows += [
            ("step before the kill (wall / fwd+bwd+opt / save)",
             f"{_f(st.get('wall_per_step_s'))} / {_f(st.get('step_time_mean_s'))} / "
             f"{_f(st.get('save_time_mean_s'))} s"),
            ("kill after step / restored step / committed on survivors",
             f"{rec['last_step_logged_before_kill']} / {rec['restored_step']} / "
             f"{rec['committed_on_survivors'][-3:]}"),
            ("  detection (survivors' workers exited)", f"{_f(p['detection_s'])} s"),
            ("  rendezvous + worker start (all 'start' events)",
             f"{_f(p['rendezvous_and_start_s'])} s (rendezvous until the last new worker "
             f"process: {_f(p['rendezvous_s'])} s; its start: {_f(p['worker_start_s'])} s)"),
            ("  restore (last start -> last restore event)",
             f"{_f(p['restore_s'])} s (event max {_f(p['restore_event_seconds_max'])} s)"),
            ("  first step (last restore -> first resumed step)",
             f"{_f(p['first_step_s'])} s (fwd+bwd+opt {_f(p['first_step_step_time_s'])} s, "
             f"its save {_f(p['first_step_save_s'])} s)"),
            ("kill -> first resumed step", f"{_f(p['kill_to_first_step_s'])} s"),
            ("(a) replacement: peer bytes / fetch s",
             f"{t['replacement_fetch_bytes'] / 1e6:.0f} MB / {t['replacement_fetch_s']:.2f} s = "
             f"{_f(t['replacement_fetch_gbps'])} GB/s (incl. verify: "
             f"{_f(t['replacement_fetch_verify_gbps'])} GB/s)"),
            ("(b) all ranks: bytes loaded / restore s",
             f"{t['loaded_bytes'] / 1e6:.0f} MB / {t['restore_s_max']:.2f} s = "
             f"{_f(t['loaded_gbps'])} GB/s"),
        ]
    thr = doc.get("throughput")
    if thr:
        a, b = thr["no_aegis"], thr["aegis"]
        for name, r in (("no snapshots", a), ("snapshot + 1 replica every step", b)):
            rows.append((f"{name}: wall/step (fwd+bwd+opt, save)",
                         f"{_f(r.get('wall_per_step_s'), '{:.3f}')} s "
                         f"({_f(r.get('step_time_mean_s'), '{:.3f}')}, "
                         f"{_f(r.get('save_time_mean_s'), '{:.3f}')}) = "
                         f"{_f(r.get('steps_per_s'), '{:.3f}')} steps/s"))
        rows.append((f"steps/s ratio (snapshots / none), steps > {doc['args']['warmup_steps']}",
                     f"{_f(thr.get('ratio'), '{:.3f}')} (all steps > 1: "
                     f"{_f(thr.get('ratio_after_step_1'), '{:.3f}')})"))
    w = max(len(k) for k, _ in rows)
    print("-" * (w + 50))
    for k, v in rows:
        print(f"{k:<{w}}  {v}")
    print("-" * (w + 50))
    if rec:
        print("restore events (per rank; seconds):")
        print(f"  {'rank':>4} {'node':>7} {'tiers':>10} {'MB read':>8} {'MB fetch':>8} "
              f"{'total':>6} {'inv':>6} {'decide':>6} {'plan':>6} {'fetch+v':>7} "
              f"{'load':>6} {'apply':>6}")
        for r in rec["ranks"]:
            tm = r["timings"]
            print(f"  {r['rank']:>4} {r['node']:>7} {'+'.join(r['tiers']):>10} "
                  f"{r['bytes'] / 1e6:>8.0f} {r['bytes_fetched'] / 1e6:>8.0f} {r['seconds']:>6.2f} "
                  + " ".join(f"{tm.get(k, 0.0):>{6 if k != 'fetch_verify_s' else 7}.2f}"
                             for k in ("inventory_s", "decide_s", "plan_s", "fetch_verify_s",
                                       "load_s", "apply_s")))
    if rec and rec.get("worker_start"):
        keys = ("interpreter_s", "import_s", "main_setup_s", "process_group_s", "build_model_s",
                "optimizer_and_manager_s")
        print("restarted workers' start-up (seconds; spawn -> aegis 'start' event; main_setup: "
              "train_fsdp main() before init_distributed, incl. the torch._inductor import that "
              "torch.use_deterministic_algorithms triggers):")
        print(f"  {'node':>7} " + " ".join(f"{k[:-2]:>{max(len(k) - 2, 6)}}" for k in keys))
        for node, ws in rec["worker_start"].items():
            print(f"  {node:>7} " + " ".join(f"{_f(ws.get(k)):>{max(len(k) - 2, 6)}}"
                                             for k in keys))
    for t in doc["targets"]:
        verdict = "n/a " if t["pass"] is None else "PASS" if t["pass"] else "FAIL"
        print(f"[{verdict}] {t['target']}: {_f(t['value'])}")
    print("load average (1 min): " + ", ".join(f"{k} {v:.2f}" for k, v in doc["loadavg"].items()))
    for phase, n in doc.get("noise", {}).items():
        top = "; ".join(f"{t['cmd'][:60]} {t['cpu_s']:.1f} s" for t in n["top"])
        print(f"other processes during {phase}: {n['foreign_cpus']:.2f} CPUs "
              f"({n['foreign_cpu_s']:.1f} CPU-s in {n['wall_s']:.0f} s){': ' + top if top else ''}")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--phases", default=",".join(PHASES), help=f"subset of {','.join(PHASES)}")
    p.add_argument("--gloo-mib", type=int, default=256, help="gloo transfer size (MiB)")
    p.add_argument("--gloo-repeats", type=int, default=5)
    p.add_argument("--state-mb", type=float, default=500.0,
                   help="training state MB (1e6), fp32 params + exp_avg + exp_avg_sq; default 500")
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq-len", type=int, default=64, help="sequence length; default 64")
    p.add_argument("--batch-size", type=int, default=1, help="sequences per rank; default 1")
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--kill-after", type=int, default=4, help="kill node-1 once this step is logged")
    p.add_argument("--recovery-steps", type=int, default=7, help="last step of the recovery run")
    p.add_argument("--throughput-steps", type=int, default=12, help="steps per throughput run")
    p.add_argument("--warmup-steps", type=int, default=4,
                   help="steps left out of step stats; default 4: the first two snapshots "
                   "allocate and page in aegis' slots (own + replica, double buffered)")
    p.add_argument("--phase-timeout", type=float, default=300.0, help="seconds per cluster run")
    p.add_argument("--workdir", default=None, help="logs (default: a new temp dir, kept)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON results ({DEFAULT_OUT})")
    args = p.parse_args(argv)
    args.phases = [x for x in args.phases.split(",") if x]
    if set(args.phases) - set(PHASES):
        p.error(f"--phases: choose from {PHASES}")
    if args.recovery_steps <= args.kill_after:
        p.error("--recovery-steps must be > --kill-after")
    if args.throughput_steps < args.warmup_steps + 2:
        p.error("--throughput-steps must be >= --warmup-steps + 2")
    return args


def main(argv: list[str] | None = None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    if raw[:1] == ["_trainer"]:
        return _trainer(raw[1:])
    sys.path.insert(0, str(ROOT))
    args = _parse(raw)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    shape = model_shape(args.state_mb, args.dim, args.heads, args.vocab, args.seq_len)
    spec = ",".join(str(shape[k]) for k in ("dim", "n_layers", "n_heads", "vocab_size", "seq_len"))
    work = Path(args.workdir or tempfile.mkdtemp(prefix="aegis-bench-recovery-"))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    doc: dict[str, Any] = {
        "bench": "recovery", "command": shlex.join([sys.executable, SELF, *raw]),
        "argv": raw, "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "machine": _machine(), "git": _git(), "model": shape, "workdir": str(work),
        "loadavg": {"start": os.getloadavg()[0]}, "started": t0,
    }
    print(f"aegis recovery bench: {shape['params'] / 1e6:.1f}M params, "
          f"{shape['state_bytes'] / 1e6:.0f} MB state, {args.nodes} nodes; logs in {work}; "
          f"load {os.getloadavg()[0]:.2f}", flush=True)
    errors: dict[str, str] = {}
    foreign = ForeignCpu()
    noise: dict[str, Any] = {}
    doc["noise"] = noise
    if "gloo" in args.phases:
        print("1) raw gloo send/recv bandwidth ...", flush=True)
        m = foreign.mark()
        try:
            doc["gloo"] = measure_gloo(args.gloo_mib, args.gloo_repeats)
        except Exception as e:  # report what was measured, with the error
            errors["gloo"] = repr(e)
        noise["gloo"] = foreign.since(m)
        doc["loadavg"]["after_gloo"] = os.getloadavg()[0]
    if "recovery" in args.phases:
        print("2) node loss and recovery ...", flush=True)
        m = foreign.mark()
        try:
            doc["recovery"] = run_recovery(args, spec, work / "recovery")
        except Exception as e:
            errors["recovery"] = repr(e)
        noise["recovery"] = foreign.since(m)
        doc["loadavg"]["after_recovery"] = os.getloadavg()[0]
    if "throughput" in args.phases:
        print("3) training throughput without / with snapshots ...", flush=True)
        thr: dict[str, Any] = {}
        try:
            m = foreign.mark()
            thr["no_aegis"] = run_throughput(args, spec, work / "no-aegis", ["--no-aegis"],
                                             "bench-noaegis")
            noise["no_aegis"] = foreign.since(m)
            doc["loadavg"]["after_no_aegis"] = os.getloadavg()[0]
            m = foreign.mark()
            thr["aegis"] = run_throughput(args, spec, work / "aegis",
                                          ["--every", "1", "--replicas", "1"], "bench-aegis")
            noise["aegis"] = foreign.since(m)
            a, b = thr["no_aegis"].get("steps_per_s"), thr["aegis"].get("steps_per_s")
            thr["ratio"] = b / a if a and b else None
            a1 = _step_stats(thr["no_aegis"]["losses"], 1).get("steps_per_s")
            b1 = _step_stats(thr["aegis"]["losses"], 1).get("steps_per_s")
            thr["ratio_after_step_1"] = b1 / a1 if a1 and b1 else None
        except Exception as e:
            errors["throughput"] = repr(e)
        doc["throughput"] = thr
        doc["loadavg"]["after_throughput"] = os.getloadavg()[0]
    foreign.close()
    doc["errors"] = errors
    doc["wall_s"] = time.time() - t0
    doc["targets"] = _targets(doc)
    if errors:
        for k, v in errors.items():
            print(f"ERROR in {k}: {v}")
    try:
        _print_report(doc)
    except Exception:  # the JSON below still has every number
        traceback.print_exc()
    print(f"total {doc['wall_s']:.0f} s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    os.replace(tmp, args.out)
    print(f"results: {args.out}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
