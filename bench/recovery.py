#!/usr/bin/env python
"""Case 4: node loss end to end on the simulated cluster, three ways to recover, one run.

The reference trainer (``examples/train_fsdp.py``, a TinyGPT whose fp32 params + AdamW moments
are ``--state-mb`` x ``--size`` MB) runs on ``--nodes`` simulated nodes
(``aegis.sim.cluster.SimCluster``: one torchrun agent per node, 1 rank each). Once step
``--kill-after`` is logged, ``node-1`` is SIGKILLed (agent + workers, node store deleted: in the
in-process arms once the survivors train again, its pages freed off their recovery as on a
cluster, where they are freed on the dead machine) and a replacement node joins. The same
model, data, kill and replacement, for each arm:

================  ================================================================================
aegis-memory      snapshot every step, 1 replica on another node: restore from peer memory
aegis-durable     snapshot + upload to S3 every ``--durable-every`` steps, no replica: the lost
                  node's shard comes from S3 (the survivors' own shards from their node stores)
dcp-s3            no aegis: ``dcp.save`` through fsspec/s3fs (``FsspecWriter``) to the same S3
                  server every ``--durable-every`` steps; restore = ``dcp.load`` of the newest
                  step with a ``.metadata`` (``FsspecReader``), the way a plain DCP user resumes
aegis-inprocess   as aegis-memory, with ``--in-process`` (``aegis.run_in_process``): the survivors
                  are not restarted; they re-form their groups and restore in the same processes
                  (shrink); once they train again a replacement node starts and joins in place
aegis-inprocess-  as aegis-inprocess, but node-1 is SIGSTOPped (agent + workers) instead of
freeze            killed: the survivors' heartbeat threads fence it off; once they train again
                  it is SIGCONTed and rejoins in place (its processes never exited)
aegis-inprocess-  as aegis-inprocess-freeze, but node-1's link is cut (each node in its own
partition         network namespace; needs root) and later restored
================  ================================================================================

The S3 server is moto's, on loopback (as in the tests). The default kill lands just before the
next durable checkpoint (``--kill-after`` = 2 x ``--durable-every`` - 1): the worst case of that
interval for the durable arms. Time from the SIGKILL until training is past the step it had
reached, split into phases (from process, event and loss-log timestamps):

* detection: until the survivors' workers have exited (their collective failed);
* restart: rendezvous of the new world + every new worker's start-up (its ``start`` event);
* restore: until the last rank's ``restore`` event;
* redo lost steps: until the step reached before the kill is logged again (0 if none was lost);
* next step: until the first step beyond it is logged.

``steps lost`` = the last step logged before the kill minus the restored step. The dcp-s3 arm
runs the trainer with a small stand-in for ``aegis.Manager`` (``_DcpCheckpointer`` below:
``save``/``restore``/``close`` with plain DCP, the same ``start``/``restore`` events);
``train_fsdp.py`` itself is unchanged. A raw gloo send/recv of ``--gloo-mib`` is measured first,
for the peer fetch rate next to it.

    .venv/bin/python bench/recovery.py
    .venv/bin/python bench/recovery.py --arms aegis-memory --state-mb 500
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import (  # noqa: E402 - bench/ is on sys.path as a script
    MB,
    RESULTS,
    ForeignCpu,
    MotoServer,
    f,
    gpt_shape,
    have_s3fs,
    md_table,
    new_doc,
    plt,
    s3fs_kwargs,
    size_arg,
    text_table,
    trainer_module,
    write_doc,
)

NAME = "recovery"
SELF = str(Path(__file__).resolve())
ARMS = ("aegis-memory", "aegis-durable", "dcp-s3", "aegis-inprocess", "aegis-inprocess-freeze",
        "aegis-inprocess-partition")
INPROCESS = {"aegis-inprocess": "kill", "aegis-inprocess-freeze": "freeze",
             "aegis-inprocess-partition": "partition"}
PHASES = (("detection_s", "detection"),
          ("restart_s", "restart (rendezvous + worker start; in-process: groups + model re-formed)"),
          ("restore_s", "restore"), ("redo_s", "redo lost steps"), ("next_step_s", "next step"))
GB = 1e9


# -- the trainer, run under torchrun by the simulated nodes -----------------------------------


class _DcpCheckpointer:
    """The dcp-s3 arm's stand-in for ``aegis.Manager`` in the reference trainer: what a user
    without aegis does (torchtitan-style). ``save(step)``: every ``BENCH_DCP_EVERY`` steps,
    ``dcp.save`` of the Stateful state (model + optimizer through DCP's ``get_state_dict``,
    scheduler, sampler) to ``<BENCH_DCP_URL>/<job>/step-<8 digits>`` through s3fs. ``restore()``:
    rank 0 lists the steps that have a ``.metadata`` (DCP writes it last), every rank loads the
    newest. Events: ``start`` and ``restore`` lines like aegis' own, in ``AEGIS_EVENTS_DIR``."""

    def __init__(self, job: str, state: dict[str, Any], **_aegis_options: Any) -> None:
        import torch.distributed as dist

        self.url = os.environ["BENCH_DCP_URL"].rstrip("/") + f"/{job}"
        self.every = int(os.environ["BENCH_DCP_EVERY"])
        self.state = state
        self.kw = s3fs_kwargs(os.environ["AWS_ENDPOINT_URL"])
        self.rank = dist.get_rank()
        events = Path(os.environ["AEGIS_EVENTS_DIR"])
        events.mkdir(parents=True, exist_ok=True)
        self.events = events / f"rank-{self.rank:05d}.jsonl"
        self._emit("start", node=os.environ.get("AEGIS_NODE_ID"), pid=os.getpid())

    def _emit(self, event: str, **fields: Any) -> None:
        with open(self.events, "a") as fh:
            fh.write(json.dumps({"time": time.time(), "event": event, "rank": self.rank,
                                 **fields}) + "\n")

    def restore(self) -> int:
        import s3fs
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        t0 = time.time()
        newest = [0]
        if self.rank == 0:
            fs = s3fs.S3FileSystem(**self.kw)
            root = self.url.removeprefix("s3://")
            steps = [int(p.rsplit("step-", 1)[1]) for p in (fs.ls(root) if fs.exists(root) else [])
                     if "step-" in p and fs.exists(f"{p}/.metadata")]
            newest = [max(steps, default=0)]
        dist.broadcast_object_list(newest, src=0)
        step = int(newest[0])
        if not step:
            self._emit("restore", step=0, found=False, seconds=time.time() - t0)
            return 0
        t1 = time.time()
        dcp.load(dict(self.state),
                 storage_reader=FsspecReader(f"{self.url}/step-{step:08d}", **self.kw))
        now = time.time()
        self._emit("restore", step=step, found=True, seconds=now - t0,
                   timings={"list_s": t1 - t0, "load_s": now - t1},
                   sources=[{"tier": "dcp-s3"}])
        return step

    def save(self, step: int) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        if step % self.every:
            return
        dcp.save(dict(self.state),
                 storage_writer=FsspecWriter(f"{self.url}/step-{step:08d}", **self.kw))

    def close(self) -> None:
        pass


def _trainer(argv: list[str]) -> int:
    """``_trainer DIM,LAYERS,HEADS,VOCAB,SEQ -- TRAIN_FSDP_ARGS``: train_fsdp.main with a
    ``bench`` config of that shape (and, with ``BENCH_DCP_URL``, plain DCP instead of aegis)."""
    import faulthandler
    import signal

    t_enter = time.time()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # stacks of a hung worker, on demand
    spec, rest = argv[0], argv[1:]
    if rest[:1] == ["--"]:
        rest = rest[1:]
    mod = trainer_module()  # imports torch
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
    if os.environ.get("BENCH_DCP_URL"):
        import aegis

        aegis.Manager = _DcpCheckpointer  # type: ignore[misc,assignment]
    dim, layers, heads, vocab, seq = (int(x) for x in spec.split(","))
    mod.CONFIGS["bench"] = mod.GPTConfig(vocab_size=vocab, dim=dim, n_layers=layers,
                                         n_heads=heads, seq_len=seq, lr=6e-4)
    return int(mod.main(["--config", "bench", *rest]))


# -- raw gloo bandwidth ------------------------------------------------------------------------

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
    """2 processes, gloo on loopback, send/recv of one ``mib`` MiB tensor; GB/s on the receiver."""
    from aegis.sim.cluster import free_port

    port, nbytes = free_port(), mib * 2**20
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    procs = [subprocess.Popen([sys.executable, "-c", _GLOO_MAIN, str(r), str(port), str(nbytes),
                               str(repeats)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=env) for r in (0, 1)]
    outs = [p.communicate(timeout=300) for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError("gloo run failed: " + " | ".join(o[1].decode()[-500:] for o in outs))
    secs = json.loads(outs[1][0].decode().strip().splitlines()[-1])["seconds"]
    gbps = [nbytes / s / GB for s in secs]
    return {"bytes": nbytes, "repeats": repeats, "seconds": secs, "gbps": gbps,
            "best_gbps": max(gbps), "median_gbps": statistics.median(gbps)}


# -- one arm on the simulated cluster ----------------------------------------------------------


def _jsonl(path: Path) -> list[dict[str, Any]]:
    from aegis.sim.scenario import read_jsonl

    return read_jsonl(path)


def _running(pid: int) -> bool:
    from aegis.sim.procs import state

    return state(pid) not in (None, "Z")


def _spawn_time(pid: int) -> float | None:
    """Wall-clock time at which ``pid`` was created (/proc starttime, 10 ms resolution)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            ticks = int(fh.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as fh:
            btime = next(int(x.split()[1]) for x in fh if x.startswith("btime"))
    except (OSError, StopIteration, ValueError):
        return None
    return btime + ticks / os.sysconf("SC_CLK_TCK")


def _watch_restart(cluster: Any, old: set[int], nodes: int, deadline: float
                   ) -> tuple[float | None, dict[str, float | None]]:
    """Poll until the survivors' old workers are gone (detection) and every live node runs a new
    worker; returns the detection time and, per node, when its first new worker was created."""
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


def _worker_start(work: Path, t_kill: float, starts: list[dict[str, Any]],
                  spawned: dict[str, float | None]) -> dict[str, Any]:
    """Where a restarted worker's start-up goes (per node, seconds): spawn -> main()
    (interpreter), -> torch + trainer imported, -> the trainer's set-up, -> process group up
    (waits for the slowest worker), -> model built, -> ``start`` event (optimizer, Manager)."""
    out: dict[str, Any] = {}
    for fp in sorted((work / "trainer-times").glob("*.json")):
        m = json.loads(fp.read_text())
        if m["enter"] < t_kill:
            continue
        start = next((e["time"] for e in starts if e["_node"] == m["node"]), None)
        seq = [("interpreter_s", spawned.get(m["node"]), m["enter"]),
               ("import_s", m["enter"], m["imported"]),
               ("main_setup_s", m["imported"], m.get("main_setup")),
               ("process_group_s", m.get("main_setup"), m.get("process_group")),
               ("build_model_s", m.get("process_group"), m.get("model_built")),
               ("optimizer_and_manager_s", m.get("model_built"), start)]
        out[m["node"]] = {k: (b - a) if a is not None and b is not None else None
                          for k, a, b in seq}
    return out


def arm_args(arm: str, args: argparse.Namespace, bucket: str | None) -> tuple[list[str], dict]:
    """Trainer arguments and extra environment of one arm."""
    k = str(args.durable_every)
    if arm == "aegis-memory":
        return ["--every", "1", "--replicas", "1"], {}
    if arm in INPROCESS:
        return ["--every", "1", "--replicas", "1", "--in-process", "--pg-timeout", "30"], {}
    if arm == "aegis-durable":
        return ["--every", k, "--replicas", "0", "--durable", f"s3://{bucket}/aegis",
                "--durable-every", k], {}
    return [], {"BENCH_DCP_URL": f"s3://{bucket}/dcp", "BENCH_DCP_EVERY": k}


def run_arm(arm: str, args: argparse.Namespace, spec: str, work: Path, extra: list[str],
            env: dict[str, str]) -> dict[str, Any]:
    from aegis.sim.cluster import SimCluster
    from aegis.sim.scenario import read_events

    work.mkdir(parents=True, exist_ok=True)
    job = f"bench-{arm}"
    loss_log = work / "loss.jsonl"
    fault = INPROCESS.get(arm, "kill")
    # in-process: long enough for a replacement to start and join while the survivors train
    steps = args.kill_after + (60 if arm in INPROCESS else 2)
    cmd = [SELF, "_trainer", spec, "--", "--steps", str(steps), "--batch-size",
           str(args.batch_size), "--job", job, "--loss-log", str(loss_log), *extra]
    net = None
    if fault == "partition":
        from aegis.sim.netns import NetnsNetwork, netns_available

        why = netns_available()
        if why is not None:
            raise RuntimeError(f"not measured: network namespaces unavailable ({why})")
        net = NetnsNetwork().setup()
    cluster = SimCluster(work, cmd, nodes=args.nodes, job=job, network=net,
                         store_root=f"/dev/shm/aegis-bench-{os.getpid()}-{arm}",
                         env={"BENCH_TIMES_DIR": str(work / "trainer-times"), **env})
    victim = "node-1"
    deadline = time.monotonic() + args.arm_timeout
    try:
        cluster.start()
        while max((r["step"] for r in _jsonl(loss_log)), default=0) < args.kill_after:
            if time.monotonic() > deadline or not cluster.alive_nodes():
                raise RuntimeError(f"step {args.kill_after} was never logged; see {work}")
            time.sleep(0.02)
        time.sleep(0.1)  # between steps, as aegis.sim.scenario.Kill does
        survivors = [n for n in cluster.alive_nodes() if n != victim]
        old = {p for n in survivors for p in cluster.nodes[n].workers()}
        last_logged = max(r["step"] for r in _jsonl(loss_log))
        stopped: list[int] = []
        if fault == "freeze":
            t_kill = time.time()
            stopped = cluster.stop_node(victim)
        elif fault == "partition":
            assert net is not None
            t_kill = time.time()
            net.cut(cluster.nodes[victim].index)
        else:
            # in place, the dead node's store is deleted once the survivors train again (below):
            # on a cluster its pages are freed on the dead machine; here that would take the
            # survivors' two cores in the middle of their recovery
            t_kill = cluster.kill_node(victim, delete_store=arm not in INPROCESS)
        t_replace: float | None = None
        if arm in INPROCESS:
            # shrink at once; once the survivors train again, a replacement (its own torchrun
            # rendezvous: the running agents must not restart their workers) joins in place,
            # or the frozen / cut-off node comes back and rejoins
            t_detect, spawned = None, {}
            while not any(r["time"] > t_kill and r.get("world") == args.nodes - 1
                          for r in _jsonl(loss_log)):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{arm}: the survivors never trained again; see {work}")
                time.sleep(0.02)
            t_replace = time.time()
            if fault not in ("freeze", "partition"):
                cluster.drop_store(victim)  # (deleted at the kill in the other arms)
            if fault == "freeze":
                cluster.cont_node(stopped)
                replacement = victim
            elif fault == "partition":
                assert net is not None
                net.heal(cluster.nodes[victim].index)
                replacement = victim
            else:
                replacement = cluster.add_node(solo=True).node_id
            cluster.wait_workers(max(deadline - time.monotonic(), 1))  # see wait_workers
            codes = {n: 0 if not cluster.nodes[n].workers() else None for n in cluster.alive_nodes()}
        else:
            replacement = cluster.add_node().node_id
            t_detect, spawned = _watch_restart(cluster, old, args.nodes, deadline)
            codes = cluster.wait(max(deadline - time.monotonic(), 1))
    finally:
        if stopped_pids := locals().get("stopped"):
            cluster.cont_node(stopped_pids)
        cluster.shutdown()
        if net is not None:
            net.teardown()
    losses = _jsonl(loss_log)
    events = read_events(work)
    after = [e for e in events if e["time"] > t_kill]
    restores = [e for e in after if e["event"] == "restore" and e.get("found")
                and (t_replace is None or e["time"] < t_replace)]  # not the grow round's
    if not restores:
        raise RuntimeError(f"{arm}: no restore after the kill (exit codes {codes}); see {work}")
    t_first_restore = min(e["time"] for e in restores)
    starts = [e for e in after if e["event"] == "start" and e["time"] <= t_first_restore]
    restored = restores[0]["step"]
    resumed = [r for r in losses if r["time"] > t_kill]
    t_up = max(e["time"] for e in starts)
    t_restored = max(e["time"] for e in restores)
    inproc: dict[str, Any] | None = None
    # the shrink's recovery events (a later grow round has no failure: failed_at is None)
    recoveries = [e for e in after if e["event"] == "recovery" and e.get("failed_at")
                  and (t_replace is None or e["time"] < t_replace)]
    if arm in INPROCESS:
        if not recoveries:
            raise RuntimeError(f"{arm}: no in-process recovery after the kill; see {work}")
        # detection: the survivors' collective failed; then teardown, agreement on the new
        # membership and the new group (the recovery event), the model, optimizer and Manager
        # built again (the Manager's start event)
        t_detect = max(e["failed_at"] for e in recoveries)
        t_grouped = max(e["time"] for e in recoveries)
        slowest = max(recoveries, key=lambda e: e["timings"].get("teardown_s", 0.0))["timings"]
        inproc = {"teardown_s": slowest.get("teardown_s", 0.0),
                  "teardown_phases": {k: slowest[k] for k in ("abort_s", "leave_s", "release_s")
                                      if k in slowest},
                  "agree_s": max(e["timings"].get("agree_s", 0.0) for e in recoveries),
                  "regroup_s": max(e["timings"].get("regroup_s", 0.0) for e in recoveries),
                  "rebuild_s": t_up - t_grouped, "restore_s": t_restored - t_up,
                  "world_after": recoveries[0]["world_size"],
                  # a teardown that stopped waiting for a snapshot thread: where that thread was
                  "abort_wait": [{k: e.get(k) for k in ("rank", "snapshot_s", "upload_s", "snapshot",
                                                         "snapshot_at", "upload_at")}
                                 for e in after if e["event"] == "abort_wait"
                                 and (t_replace is None or e["time"] < t_replace)],
                  "survivor_pids_kept": sorted(old) == sorted(
                      {e["pid"] for e in starts if "pid" in e})}
        # the replacement joining: the survivors' longest gap between two logged steps from its
        # start until the first step trained by the grown world
        grown = [r for r in losses if t_replace and r["time"] > t_replace and r["world"] == args.nodes]
        if grown:
            window = [r for r in losses if t_replace < r["time"] <= grown[0]["time"]]
            before_first = [r for r in losses if r["time"] <= t_replace][-1:]
            seq = before_first + window
            inproc["replacement"] = {
                "started_to_joined_s": grown[0]["time"] - t_replace,
                "survivors_longest_stall_s": max(
                    (b["time"] - a["time"] for a, b in zip(seq, seq[1:], strict=False)), default=None),
                "steps_while_it_started": sum(1 for r in window if r["world"] == args.nodes - 1),
                "joined_at_step": grown[0]["step"],
            }
    redo = next((r for r in resumed if r["step"] == last_logged), None)
    nxt = next((r for r in resumed if r["step"] == last_logged + 1), None)
    t_redo = redo["time"] if redo is not None and restored < last_logged else t_restored
    before = [r for r in losses if 1 < r["step"] <= last_logged and r["time"] < t_kill]
    step_s = statistics.median(r["time"] - p["time"] for p, r in zip(before, before[1:], strict=False))
    phases = {
        "detection_s": (t_detect - t_kill) if t_detect else None,
        "restart_s": t_up - (t_detect or t_kill),
        "restore_s": t_restored - t_up,
        "redo_s": t_redo - t_restored,
        "next_step_s": (nxt["time"] - t_redo) if nxt else None,
        "total_s": (nxt["time"] - t_kill) if nxt else None,
    }
    res: dict[str, Any] = {
        "arm": arm, "trainer_args": extra, "workdir": str(work), "exit_codes": codes,
        "killed": victim, "replacement": replacement, "t_kill": t_kill,
        "last_step_logged_before_kill": last_logged, "restored_step": restored,
        "steps_lost": last_logged - restored, "wall_per_step_before_kill_s": step_s,
        "phases": phases, "in_process": inproc,
        "restore_event_seconds_max": max(e["seconds"] for e in restores),
        "restore_sources": sorted({s.get("source", s["tier"]) for e in restores for s in e.get("sources", [])}),
        "worker_start": _worker_start(work, t_kill, starts, spawned),
        "losses": losses, "start_events": starts, "restore_events": restores,
    }
    peer = [s for e in restores if e["_node"] == replacement for s in e.get("sources", [])
            if s.get("source", s["tier"]) == "peer"]
    if peer:  # every shard of one exchange round reports the round's time: take the longest
        fb = sum(s.get("fetch_bytes", 0) for s in peer)
        fs = max(s.get("fetch_s", 0.0) for s in peer)
        res["replacement_fetch"] = {"bytes": fb, "seconds": fs,
                                    "gbps": fb / fs / GB if fs else None}
    res["bitwise_resume"] = _same_losses(losses, t_kill, restored)
    return res


def _same_losses(losses: list[dict[str, Any]], t_kill: float, restored: int) -> bool | None:
    """Did the steps recomputed after the restore give the same loss, bit for bit, as before?"""
    before = {r["step"]: r["loss_hex"] for r in losses if r["time"] < t_kill}
    again = [(r["step"], r["loss_hex"]) for r in losses
             if r["time"] > t_kill and r["step"] in before]
    return None if not again else all(before[s] == h for s, h in again)


# -- report ------------------------------------------------------------------------------------


def report(doc: dict[str, Any]) -> str:
    rows = []
    for arm, r in doc["arms"].items():
        if "phases" not in r:
            rows.append([arm, *(["-"] * (len(PHASES) + 3)), "failed"])
            continue
        p = r["phases"]
        rows.append([arm, *(f(p[k]) for k, _ in PHASES), f(p["total_s"]),
                     str(r["steps_lost"]), f"{r['restored_step']}",
                     "+".join(r.get("restore_sources", r.get("restore_tiers", []))) or "-"])
    out = text_table(["arm", *(label.split(" (")[0] for _, label in PHASES), "total s",
                      "steps lost", "restored", "sources"], rows)
    g = doc.get("gloo")
    if g:
        out += (f"\nraw gloo send/recv on loopback: {g['median_gbps']:.2f} GB/s (median of "
                f"{g['repeats']} x {g['bytes'] / 2**20:.0f} MiB)")
    for arm, r in doc["arms"].items():
        rf = r.get("replacement_fetch")
        if rf:
            out += (f"\n{arm}: the replacement fetched {rf['bytes'] / MB:.0f} MB from peers at "
                    f"{f(rf['gbps'])} GB/s")
        if "error" in r:
            out += f"\n{arm}: ERROR {r['error'].splitlines()[0]}"
        out += _inprocess_line(r)
    return out


def _inprocess_line(r: dict[str, Any]) -> str:
    ip = r.get("in_process") or {}
    out = ""
    if ip:
        out += (f"\n{r['arm']}: survivors kept their processes: {ip['survivor_pids_kept']}; "
                f"teardown {f(ip['teardown_s'])} s, agree {f(ip['agree_s'])} s, new groups "
                f"{f(ip['regroup_s'])} s, model + Manager rebuilt {f(ip['rebuild_s'])} s, restore "
                f"{f(ip['restore_s'])} s")
    rep = ip.get("replacement")
    if rep:
        who = ("a replacement joined", "started") if r["arm"] == "aegis-inprocess" else (
            "node-1 rejoined", "back")
        out += (f"\n{r['arm']}: {who[0]} {f(rep['started_to_joined_s'])} s after it "
                f"was {who[1]} (at step {rep['joined_at_step']}; the survivors trained "
                f"{rep['steps_while_it_started']} steps meanwhile); the survivors' longest stall: "
                f"{f(rep['survivors_longest_stall_s'])} s")
    return out


def summary_md(doc: dict[str, Any]) -> str:
    rows = []
    for arm, r in doc["arms"].items():
        if "phases" not in r:
            rows.append([arm, *(["-"] * (len(PHASES) + 2)), f"failed: {r.get('error', '')[:80]}"])
            continue
        p = r["phases"]
        rows.append([arm, *(f(p[k], ".1f") for k, _ in PHASES), f"**{f(p['total_s'], '.1f')}**",
                     f"{r['steps_lost']} ({r['restored_step']} of "
                     f"{r['last_step_logged_before_kill']})"])
    table = md_table(["node loss, seconds", *(label for _, label in PHASES),
                      "kill -> past the old step", "steps lost (restored of reached)"], rows)
    notes = "".join(_inprocess_line(r) for r in doc["arms"].values() if "phases" in r)
    return table + ("\n" + notes.replace("\n", "\n\n") if notes else "")


def plot(doc: dict[str, Any], path: Path) -> None:
    pyplot = plt()
    arms = [a for a, r in doc["arms"].items() if "phases" in r]
    fig, ax = pyplot.subplots(figsize=(9, 0.9 * len(arms) + 2.2))
    colors = ["tab:red", "tab:orange", "tab:blue", "tab:purple", "tab:green"]
    for i, arm in enumerate(arms):
        r = doc["arms"][arm]
        left = 0.0
        for (key, label), c in zip(PHASES, colors, strict=True):
            w = r["phases"].get(key) or 0.0
            ax.barh(i, w, left=left, color=c, label=label if i == 0 else None)
            if w > 0.6:
                ax.text(left + w / 2, i, f"{w:.1f}", ha="center", va="center", fontsize=7,
                        color="white")
            left += w
        ax.text(left + 0.2, i, f"{left:.1f} s, {r['steps_lost']} steps lost", va="center",
                fontsize=8)
    ax.set_yticks(range(len(arms)))
    ax.set_yticklabels(arms)
    ax.invert_yaxis()
    ax.set_xlabel("seconds from SIGKILL of a node until training is past the step it had reached")
    m = doc["machine"]
    st = doc["model"]
    ax.set_title(f"Node loss, {doc['args']['nodes']} simulated nodes, {st['state_bytes'] / MB:.0f}"
                 f" MB state, durable every {doc['args']['durable_every']} steps; "
                 f"{m['device']}, {m['cpu_count']} cores", fontsize=9)
    xmax = max(sum(doc["arms"][a]["phases"].get(k) or 0.0 for k, _ in PHASES) for a in arms)
    ax.set_xlim(0, xmax * 1.3)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=5,
              frameon=False)
    ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot.close(fig)


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arms", default=",".join(ARMS), help=f"subset of {','.join(ARMS)}")
    p.add_argument("--state-mb", type=float, default=48.0,
                   help="MB of fp32 params + AdamW moments; default 48")
    size_arg(p)
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=2, help="sequences per rank; default 2")
    p.add_argument("--durable-every", type=int, default=4,
                   help="durable arms: checkpoint every N steps; default 4")
    p.add_argument("--kill-after", type=int, default=None,
                   help="kill node-1 once this step is logged (default 2 x durable-every - 1)")
    p.add_argument("--gloo-mib", type=int, default=64, help="gloo transfer size; 0: skip")
    p.add_argument("--arm-timeout", type=float, default=300.0, help="seconds per arm")
    p.add_argument("--workdir", default=None, help="logs (default: a new temp dir, kept)")
    p.add_argument("--out", type=Path, default=RESULTS / f"{NAME}.json")
    args = p.parse_args(argv)
    args.arms = [a for a in args.arms.split(",") if a]
    if set(args.arms) - set(ARMS):
        p.error(f"--arms: choose from {ARMS}")
    if args.kill_after is None:
        args.kill_after = 2 * args.durable_every - 1
    return args


def main(argv: list[str] | None = None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    if raw[:1] == ["_trainer"]:
        return _trainer(raw[1:])
    args = _parse(raw)
    doc = new_doc(NAME, __file__, raw, args)
    shape = gpt_shape(args.state_mb * args.size)
    spec = ",".join(str(shape[k]) for k in ("dim", "n_layers", "n_heads", "vocab_size", "seq_len"))
    doc["model"] = shape
    work = Path(args.workdir or tempfile.mkdtemp(prefix="aegis-bench-recovery-"))
    doc["workdir"] = str(work)
    print(f"{NAME}: TinyGPT {shape['params'] / 1e6:.1f}M params ({shape['state_bytes'] / MB:.0f}"
          f" MB state), {args.nodes} nodes, kill node-1 after step {args.kill_after}, durable "
          f"every {args.durable_every}; logs in {work}", flush=True)
    foreign = ForeignCpu()
    doc["noise"] = {}
    if args.gloo_mib:
        try:
            doc["gloo"] = measure_gloo(args.gloo_mib, 3)
        except Exception as e:  # noqa: BLE001 - reported, the arms still run
            doc["errors"]["gloo"] = repr(e)
    no_s3fs = have_s3fs()
    moto = MotoServer() if any(a != "aegis-memory" for a in args.arms) else None
    doc["arms"] = {}
    try:
        bucket = moto.bucket() if moto else None
        for arm in args.arms:
            if arm == "dcp-s3" and no_s3fs:
                doc["arms"][arm] = {"error": f"not measured: {no_s3fs}"}
                continue
            print(f"  {arm} ...", flush=True)
            extra, env = arm_args(arm, args, bucket)
            m = foreign.mark()
            try:
                doc["arms"][arm] = run_arm(arm, args, spec, work / arm, extra,
                                           {**(moto.env if moto else {}), **env})
            except Exception as e:  # noqa: BLE001 - the other arms still run
                doc["arms"][arm] = {"error": repr(e)}
                doc["errors"][arm] = repr(e)
            doc["noise"][arm] = foreign.since(m)
            doc["loadavg_1m"][f"after {arm}"] = os.getloadavg()[0]
    finally:
        foreign.close()
        if moto:
            moto.stop()
    print(report(doc))
    write_doc(doc, args.out)
    if any("phases" in r for r in doc["arms"].values()):
        plot(doc, args.out.with_name(f"{args.out.stem}_timeline.png"))  # recovery.json: recovery_timeline.png
    if not args.workdir and not doc["errors"]:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if doc["errors"] else 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
