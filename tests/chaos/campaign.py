"""The chaos campaign: a seeded schedule of faults against a training job on the simulated
cluster, with the invariants checked after every fault.

    python -m tests.chaos.campaign --seed 1 --faults 50      # `make chaos`
    python -m tests.chaos.campaign --seed 1 --faults 50 --in-process   # `make chaos-inprocess`
    python -m tests.chaos.campaign --topology 3x2 --in-process --kinds ...,worker_kill

The reference trainer runs on 3 simulated nodes (min 2: the world may shrink) with a memory
snapshot every step, one replica, and durable uploads to a loopback S3 server (moto) behind a
TCP forwarder. Each node has its own network namespace (when the machine allows it) and its own
small tmpfs node store. ``--topology NxR``: N nodes of R ranks each (default ``3x1``; ``3x2``:
multi-rank nodes whose ranks share the node store; ``6x1``: room for Reed-Solomon 4+2 with
``--redundancy rs``); the world may shrink by one node. Fault kinds:

* ``kill``        SIGKILL of a random node at a random moment (agent, workers, node store); a
                  replacement joins, or the world shrinks (and grows back later);
* ``freeze``      SIGSTOP of a node's processes for longer than the snapshot timeout, then
                  SIGCONT: a frozen peer, not a dead one;
* ``partition``   a node's link cut (its bridge port down), then restored;
* ``s3_outage``   the S3 endpoint down (connections refused and reset) or hung (the server
                  SIGSTOPped), then back;
* ``store_full``  a node's tmpfs node store filled to the last byte, then freed;
* ``double_kill`` a second node lost while the job recovers from the first loss (injected once
                  the durable tier holds a step: both copies of a shard may go with the two);
* ``worker_kill`` SIGKILL of one worker process of a node (a GPU fallen off the bus, an OOM, a
                  segfault); the agent, the node's other ranks and its store stay. Not in the
                  default mix (``KINDS``, which ``make chaos`` and ``make chaos-inprocess`` run).
* ``store_restart`` the rendezvous and membership store (``aegis store serve``) SIGKILLed and
                  started again on its address, empty; ``--in-process`` only;
* ``store_outage`` the store SIGSTOPped (connections open, nothing answered) for 3-15 s, then
                  continued; ``--in-process`` only. Neither may stop training (invariant 6).

Adding a fault kind: a name in ``ALL_KINDS`` and a method ``_fault_<name>(rec)`` that injects it,
fills ``rec.detail`` and ``rec.t_end``, and calls ``_resolve`` with what it expects (a recovery,
none, or either); ``_resolve`` then checks every invariant below.

``--in-process``: the trainer runs under ``aegis.run_in_process`` (``min_world``: the nodes
less the losses the redundancy scheme rebuilds, times the ranks per node): survivors
re-form their groups in place, a frozen or cut-off node is fenced off and rejoins when it comes
back, replacement nodes start with a torchrun rendezvous of their own (``add_node(solo=True)``)
and join at a snapshot, and an agent that exits is relaunched alone. The agents are
``python -m aegis.launch --on-worker-failure=replace``: a worker that dies is started again alone
and joins at a snapshot (torchrun would restart every worker of the job). A fault's ``restarts``
then counts worker processes started again on a node that already ran one (0 when every recovery
was in place; 1 for a worker kill: its replacement), ``in place`` the rounds re-formed.
``--spares N`` (with ``--in-process``): the trainer runs with ``max_world`` = the full world, N
spare nodes are started once the job trains and kept topped up; a spare steps in at the first
round after a loss, and fault targets are the nodes with a process in the newest round.

Invariants, checked from the trainer's logs, the aegis events and the stores:

1. the job resumes after every fault and keeps training;
2. every restore loads a step that was committed before it (memory or durable), never older than
   the newest committed durable step, and its state is bitwise equal to a state the job saved at
   that step (full-state crc32c logged by the trainer after every save and restore); after a
   single node loss it is the newest step committed on the survivors;
3. while the job never changed its world size, every saved state is bitwise equal to the state
   an uninterrupted reference run had at that step;
4. the newest committed durable step is never deleted (polled throughout);
5. no orphaned processes: every process of the campaign belongs to a live agent, and none
   remains at the end;
6. a full node store, an unreachable object store or a lost or frozen membership store never
   stops training: no restart or in-place recovery; the memory snapshot is skipped (full
   store) or uploads are skipped and later catch up (S3).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from aegis.sim.cluster import SimCluster
from aegis.sim.netns import NetnsNetwork, netns_available
from aegis.sim.procs import descendants, kill_tree, wait_gone
from aegis.sim.scenario import TRAINER, read_events, read_jsonl, wait_exited
from aegis.snapshot.node_store import NodeStore
from tests.servers import S3_ENV, free_port, start_moto

# The default mix (its order fixes the seeded schedule of `make chaos` / `make chaos-inprocess`)
KINDS = ("kill", "freeze", "partition", "s3_outage", "store_full", "double_kill")
# Every kind the campaign can inject (`--kinds`); each has a `Campaign._fault_<kind>` method.
STORE_KINDS = ("store_restart", "store_outage")  # in-process only: the membership store's faults
ALL_KINDS = (*KINDS, "worker_kill", *STORE_KINDS)
RESTART_KINDS = ("kill", "double_kill", "worker_kill")
TOPOLOGIES = ("3x1", "3x2", "6x1")
BUCKET = "aegis-chaos"


@dataclass
class Config:
    seed: int = 1
    faults: int = 50
    kinds: tuple[str, ...] = KINDS
    nodes: int = 3
    nproc_per_node: int = 1  # ranks per node (--topology NxR), sharing the node's store
    workdir: Path = Path("/tmp/aegis-chaos")
    snapshot_timeout: float = 6.0  # aegis Manager(timeout=)
    pg_timeout: float = 12.0  # the training process group's collectives
    step_sleep: float = 0.05
    durable_every: int = 4
    durable_keep_last: int = 2
    durable_max_pending: int = 1
    store_tmpfs_mb: int = 48
    steady_steps: int = 3  # steps at full world between faults
    fault_timeout: float = 240.0  # a fault not resolved by then is a violation
    reference_steps: int = 60
    network: bool = True  # network namespaces, when the machine allows them
    in_process: bool = False  # aegis.run_in_process instead of torchrun restarts
    redundancy: str = "replica"  # "dp" (replicas from DP copies) or "xor" / "rs": one parity group over all nodes
    spares: int = 0  # --in-process: nodes started beside the job that wait (max_world) to step in
    # the trainer's --mesh: "fsdp" (1-D), "hsdp" or "tp" (2-D, the inner dimension within a
    # node); 2-D in place runs rounds of whole nodes, checked in every round
    mesh: str = "fsdp"
    # --in-process: beat through each node's heartbeat relay (AEGIS_NODE_RELAY, issue 40)
    node_relay: bool = False

    @property
    def world(self) -> int:
        """Ranks at full size."""
        return self.nodes * self.nproc_per_node

    @property
    def launcher_policy(self) -> str | None:
        """In-process: ``aegis.launch`` agents that replace a dead worker alone; else torchrun."""
        return "replace" if self.in_process else None


@dataclass
class FaultRecord:
    index: int
    kind: str
    node: str
    detail: str
    t_start: float
    t_end: float = 0.0
    t_resolved: float = 0.0
    step_before: int = 0  # last step logged before the fault
    running: list[int] = field(default_factory=list)  # worker pids alive when it was injected
    restarts: int = 0
    in_place: int = 0  # in-process recoveries (rounds re-formed), --in-process
    relaunches: int = 0  # whole-job requeues (an agent exited and closed the rendezvous)
    restored: list[int] = field(default_factory=list)
    tiers: list[str] = field(default_factory=list)
    resume_s: float | None = None  # fault -> first step after the first restore
    t_second: float | None = None  # double_kill: when the second node was killed
    lost_steps: int | None = None
    max_step_gap_s: float = 0.0
    checks: list[tuple[str, bool]] = field(default_factory=list)

    @property
    def violations(self) -> list[str]:
        return [what for what, ok in self.checks if not ok]


class Campaign:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.work = Path(cfg.workdir)
        self.marker = f"chaos-{uuid.uuid4().hex[:8]}"
        self.records: list[FaultRecord] = []
        self.relaunches: list[tuple[float, list[str]]] = []
        self.global_checks: list[tuple[str, bool]] = []
        self.net: NetnsNetwork | None = None
        self.net_reason: str | None = None
        self.cluster: SimCluster | None = None
        self.moto: subprocess.Popen[bytes] | None = None
        self.proxy: Any = None
        self.reference: dict[int, str] = {}
        self._durable_max = -1
        self._durable_violations: list[str] = []
        self._durable_polls = 0
        self._memory_committed: dict[int, float] = {}  # step -> first seen with a manifest
        self._monitor_stop = threading.Event()
        self._monitor_paused = threading.Event()
        self.loss_log = self.work / "loss.jsonl"
        self.digest_log = self.work / "digest.jsonl"
        self.job = "chaos"
        self.requested: tuple[str, ...] = cfg.kinds

    # -- infrastructure ------------------------------------------------------------------------

    def _start_s3(self) -> None:
        from tests.chaos.tcp_proxy import TcpProxy

        host = self.net.hub if self.net else "127.0.0.1"
        self.moto, self.moto_url = start_moto(host, env={"AEGIS_CHAOS": self.marker})
        mport, pport = int(self.moto_url.rsplit(":", 1)[1]), free_port(host)
        self.proxy = TcpProxy((host, pport), (host, mport))
        self.proxy.up()
        self.s3_url = f"http://{host}:{pport}"
        import boto3

        boto3.client("s3", endpoint_url=self.moto_url, **_boto_kw()).create_bucket(Bucket=BUCKET)

    def _durable_store(self) -> Any:
        from aegis.snapshot.retry import RetryPolicy
        from aegis.snapshot.s3 import S3Store

        return S3Store(BUCKET, "chaos", endpoint_url=self.moto_url, connect_timeout_s=2,
                       read_timeout_s=5, retry=RetryPolicy(max_attempts=2, max_total_s=5))

    def _sample_cpu(self) -> None:
        """The machine's CPU busy fraction every 50 ms (``/proc/stat``: all CPUs, every process,
        the campaign's own included) to ``cpu.txt``, one ``<unix time> <busy 0-1>`` line per
        sample: ``python -m tests.chaos.phases`` reads it to tell a recovery phase that waits
        (detection) from one that competes for the CPUs."""
        def read() -> tuple[int, int]:
            with open("/proc/stat") as fh:
                v = [int(x) for x in fh.readline().split()[1:]]
            return sum(v), v[3] + v[4]  # all jiffies, idle + iowait

        with contextlib.suppress(OSError), open(self.work / "cpu.txt", "w") as out:
            before = read()
            while not self._monitor_stop.wait(0.05):
                now = read()
                total, idle = now[0] - before[0], now[1] - before[1]
                out.write(f"{time.time():.3f} {1.0 - idle / max(total, 1):.3f}\n")
                before = now

    def _monitor(self) -> None:
        """Invariant 4: the newest committed durable step seen so far is always still there."""
        from aegis.snapshot.durable import list_steps

        store = self._durable_store()
        while not self._monitor_stop.wait(0.3):
            self._watch_node_stores()
            if self._monitor_paused.is_set():
                continue
            try:
                committed, _ = list_steps(store, self.job)
            except Exception:  # noqa: BLE001 - the server is being faulted
                continue
            self._durable_polls += 1
            if max(committed, default=-1) < self._durable_max:
                # retention may delete a step only once a newer one is committed: the newest
                # committed step seen so far (or a newer one) must always be there
                self._durable_violations.append(
                    f"durable step {self._durable_max} (the newest committed seen) is gone: {committed}")
            if committed:
                self._durable_max = max(self._durable_max, committed[-1])

    def _watch_node_stores(self) -> None:
        """When each step's manifest first appeared on some node: the step was committed then
        (the manifest is written only after every shard and replica was verified)."""
        cl = self.cluster
        if cl is None:
            return
        now = time.time()
        try:
            nodes = list(cl.nodes.values())
        except RuntimeError:  # the main thread added a node meanwhile
            return
        for nd in nodes:
            for m in (nd.store_dir / self.job).glob("step-*/manifest.json"):
                with contextlib.suppress(ValueError):
                    self._memory_committed.setdefault(int(m.parent.name[5:]), now)

    def _trainer_args(self, steps: int, job: str, loss: Path, digest: Path) -> list[str]:
        c = self.cfg
        return [TRAINER, "--config", "tiny", "--steps", str(steps), "--dropout", "0.1",
                "--job", job, "--every", "1", "--keep", "2",
                *(["--redundancy", c.redundancy, "--group-size", str(c.nodes)] if c.redundancy in ("xor", "rs")
                  else ["--redundancy", c.redundancy, "--replicas", "1"]),
                "--durable", f"s3://{BUCKET}/chaos", "--durable-every", str(c.durable_every),
                "--durable-keep-last", str(c.durable_keep_last),
                "--durable-max-pending", str(c.durable_max_pending),
                "--timeout", str(c.snapshot_timeout), "--pg-timeout", str(c.pg_timeout),
                "--loss-log", str(loss), "--digest-log", str(digest),
                "--step-sleep", str(c.step_sleep)] + (
                    ["--mesh", c.mesh] if c.mesh != "fsdp" else []) + (
                    ["--in-process", "--min-world", str(self.min_world)] if c.in_process else []) + (
                    ["--max-world", str(c.world)] if c.in_process and c.spares else [])

    @property
    def min_world(self) -> int:
        """In-process: the nodes less the losses the scheme rebuilds from memory (one; two for
        RS 4+2, which then goes on at 4 nodes as RS 2+2), times the ranks per node. Fewer
        survivors wait for replacement nodes."""
        c = self.cfg
        return (c.nodes - (2 if c.redundancy == "rs" else 1)) * c.nproc_per_node

    def _add_node(self) -> Any:
        """A replacement node. In-process: with a rendezvous of its own, so that the running
        agents see no node waiting and leave their workers alone; aegis admits the new worker."""
        assert self.cluster is not None
        return self.cluster.add_node(solo=self.cfg.in_process)

    def _wait_recovered(self, since: float, timeout: float) -> None:
        """In-process: until a survivor reports a recovery after ``since`` (the survivors'
        processes do not exit)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(e["event"] == "recovery" and e["time"] > since for e in self._events()):
                return
            time.sleep(0.1)

    def _env(self) -> dict[str, str]:
        return {**S3_ENV, "AWS_ENDPOINT_URL": self.s3_url, "AEGIS_CHAOS": self.marker}

    def _run_reference(self, attempts: int = 3) -> None:
        """Invariant 3's reference: the same job, uninterrupted, for reference_steps steps.
        Only its states saved before its own first world-size change or restore count: under
        in-process recovery a heavily loaded machine can fence a slow process off even here (seen
        with 3 x 2 ranks at a load of 40: a round of 5 at step 1), and the states that follow are
        another run's. Such a run is tried again, ``attempts`` times in all."""
        for attempt in range(1, attempts + 1):
            ref = self.work / ("reference" if attempt == 1 else f"reference-{attempt}")
            loss, digest = ref / "loss.jsonl", ref / "digest.jsonl"
            job = "reference" if attempt == 1 else f"reference-{attempt}"  # its own stores
            cl = SimCluster(ref, self._trainer_args(100_000, job, loss, digest),
                            nodes=self.cfg.nodes, nproc_per_node=self.cfg.nproc_per_node,
                            job=job, env=self._env())
            try:
                cl.start()
                deadline = time.monotonic() + 300
                while time.monotonic() < deadline:
                    losses = read_jsonl(loss)
                    if losses and losses[-1]["step"] >= self.cfg.reference_steps:
                        break
                    time.sleep(0.2)
                else:
                    raise RuntimeError(f"the reference run did not reach step {self.cfg.reference_steps}")
            finally:
                cl.shutdown()
            digests = read_jsonl(digest)
            changed = min((x["time"] for x in read_jsonl(loss) + digests
                           if x["world"] != self.cfg.world or x.get("phase") == "restored"),
                          default=float("inf"))
            self.reference = {d["step"]: d["digest"] for d in digests
                              if d["phase"] == "saved" and d["time"] < changed}
            if changed == float("inf"):
                return
            print(f"the reference run (attempt {attempt}) changed its world at step "
                  f"{max(self.reference, default=0) + 1}: {len(self.reference)} states kept", flush=True)

    # -- the campaign --------------------------------------------------------------------------

    def schedule(self) -> list[str]:
        kinds = list(self.cfg.kinds)
        out: list[str] = []
        while len(out) < self.cfg.faults:
            self.rng.shuffle(kinds)
            out.extend(kinds)
        return out[: self.cfg.faults]

    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        for k, v in S3_ENV.items():  # the invariant monitor reads the bucket too
            os.environ.setdefault(k, v)
        shutil.rmtree(self.work, ignore_errors=True)
        self.work.mkdir(parents=True)
        kinds = list(cfg.kinds)
        self.requested = tuple(kinds)
        if cfg.network:
            self.net_reason = netns_available()
        else:
            self.net_reason = "disabled (--no-network)"
        if self.net_reason is None:
            self.net = NetnsNetwork().setup()
        elif "partition" in kinds:
            kinds.remove("partition")  # reported in the summary, not silently passed
        full_ok = os.geteuid() == 0
        if not full_ok and "store_full" in kinds:
            kinds.remove("store_full")
        cfg.kinds = tuple(kinds)
        t0 = time.time()
        monitor = threading.Thread(target=self._monitor, daemon=True)
        sampler = threading.Thread(target=self._sample_cpu, daemon=True)
        sampler.start()
        try:
            self._start_s3()
            self._run_reference()
            self.cluster = SimCluster(
                self.work, self._trainer_args(100_000, self.job, self.loss_log, self.digest_log),
                nodes=cfg.nodes, nproc_per_node=cfg.nproc_per_node, min_nodes=cfg.nodes - 1,
                max_nodes=cfg.nodes, job=self.job, on_worker_failure=cfg.launcher_policy,
                env=self._env(), network=self.net,
                store_tmpfs_bytes=cfg.store_tmpfs_mb << 20 if full_ok else None,
            )
            self.cluster.start()
            monitor.start()
            self._wait_steady(time.time(), first=True)
            self._start_spares()
            for i, kind in enumerate(self.schedule()):
                rec = self._inject(i, kind)
                self.records.append(rec)
                print(self._line(rec), flush=True)
                if any("did not resume" in v for v in rec.violations):
                    break
        finally:
            self._monitor_stop.set()
            if self.cluster is not None:
                self.cluster.shutdown()
            if self.proxy is not None:
                self.proxy.down()
            if self.moto is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.moto.pid, signal.SIGCONT)
                self.moto.terminate()
                with contextlib.suppress(Exception):
                    self.moto.wait(timeout=10)
            if self.net is not None:
                self.net.teardown()
        monitor.join(timeout=5)
        sampler.join(timeout=5)
        left = wait_marker_gone(self.marker, 20)
        self.global_checks.append((f"no process of the campaign remains at the end ({left})", not left))
        self.global_checks.append((
            f"the newest committed durable step was never deleted ({self._durable_polls} polls, "
            f"newest seen {self._durable_max}) {self._durable_violations[:3]}",
            not self._durable_violations and self._durable_polls > 0,
        ))
        if self.cfg.mesh != "fsdp" and self.cfg.in_process:
            self._check_whole_rounds()
        self._check_reference()
        return self.summary(time.time() - t0)

    def _check_whole_rounds(self) -> None:
        """2-D meshes in place: every round of the campaign was made of whole nodes (each
        rank's ``recovery`` event says so, and every world logged is whole nodes)."""
        n = self.cfg.nproc_per_node
        rounds = [e for e in self._events() if e["event"] == "recovery"]
        partial = sorted({e["round"] for e in rounds if e.get("whole_nodes") is not True})
        worlds = sorted({x["world"] for x in read_jsonl(self.loss_log)})
        self.global_checks.append((
            f"every round was made of whole nodes of {n} ({len({e['round'] for e in rounds})} "
            f"rounds re-formed, worlds {worlds}, rounds with a partial node: {partial})",
            bool(rounds) and not partial and all(w % n == 0 for w in worlds)))

    # -- faults ----------------------------------------------------------------------------------

    def _inject(self, i: int, kind: str) -> FaultRecord:
        """Fault ``i``: a random node, at a random moment; the kind's ``_fault_<kind>`` method
        injects it and resolves it (see the module docstring)."""
        node = self.rng.choice(self._participants())
        delay = self.rng.uniform(0.0, 1.0)  # a random moment within the next step or so
        step_before = self._last_step()
        time.sleep(delay)
        rec = FaultRecord(i + 1, kind, node, "", time.time(), step_before=step_before,
                          running=sorted(p for nd in self.cluster.nodes.values() if nd.alive
                                         for p in nd.workers()) if self.cluster else [])
        getattr(self, f"_fault_{kind}")(rec)
        return rec

    def _fault_kill(self, rec: FaultRecord) -> None:
        cl = self.cluster
        assert cl is not None
        node = rec.node
        replace = self.rng.random() < 0.6 or len(self._participants()) <= cl.min_nodes
        survivors = [n for n in self._participants() if n != node]
        old = {p for n in survivors for p in cl.nodes[n].workers()}
        rec.t_start = cl.kill_node(node)
        if self.cfg.in_process:
            # the survivors restore in place ~1 s after the kill and commit newer steps
            # soon after: what they held is read now
            time.sleep(0.3)
            committed = self._committed_on(survivors)
            if replace:
                self._add_node()
            self._wait_recovered(rec.t_start, 60)
        else:
            if replace:
                cl.add_node()
            wait_exited(old, 60)
            committed = self._committed_on(survivors)
        rec.detail = f"{'replacement' if replace else 'shrink'}; survivors held {committed[-2:]}"
        rec.t_end = time.time()
        self._resolve(rec, expect_restart=True, newest=committed[-1] if committed else None,
                      survivors=survivors)

    def _fault_double_kill(self, rec: FaultRecord) -> None:
        cl = self.cluster
        assert cl is not None
        node = rec.node
        other = self.rng.choice([n for n in self._participants() if n != node])
        survivors = [n for n in self._participants() if n not in (node, other)]
        # Two nodes lost may take both copies of some shards: only the durable tier then has
        # them. Before its first commit the recovery rightly finds "committed snapshots exist
        # but none is complete" (a schedule drawn too early, not a finding): wait for one.
        deadline = time.monotonic() + 120
        while self._durable_max < 0 and time.monotonic() < deadline:
            time.sleep(0.3)
        old = {p for n in survivors + [other] for p in cl.nodes[n].workers()}
        rec.t_start = cl.kill_node(node)
        self._add_node()
        if self.cfg.in_process:
            self._wait_recovered(rec.t_start, 60)  # the first recovery has begun
        else:
            wait_exited(old, 60)  # the first recovery has begun
        gap = self.rng.uniform(0.0, 3.0)
        time.sleep(gap)
        t2 = rec.t_second = cl.kill_node(other)
        self._add_node()
        if self.cfg.in_process:
            # the recovery from the second loss has begun too, before the fault is resolved:
            # with a spare stepping in the world never looks short, and the next fault must
            # not come while that recovery runs (a step whose shard and replica were on the
            # two lost nodes is gone from memory then, and the check below would be wrong)
            self._wait_recovered(t2, 60)
        rec.detail = f"then {other} {gap:.1f} s into the recovery; replacements join"
        rec.t_end = time.time()
        self._resolve(rec, expect_restart=True)

    def _fault_worker_kill(self, rec: FaultRecord) -> None:
        """One worker process SIGKILLed; its agent, the node's other workers and its store stay.
        In-process: the others recover in place, the agent starts one new process for that
        rank, which joins at a snapshot; checked below. Restart mode: torchrun restarts every
        worker of the job."""
        cl = self.cluster
        assert cl is not None
        node = rec.node
        pids = cl.nodes[node].worker_pids()
        spare_pids: set[int] = set()
        if self.cfg.spares:  # a process that trains, not one of a node's spares
            members = self._members_now()
            spare_pids = {p for nd in cl.nodes.values() if nd.alive for p in nd.workers()} - {
                p for _, p in members}
            pids = {k: p for k, p in pids.items() if (node, p) in members}
        local = self.rng.choice(sorted(pids))
        before = {n: cl.nodes[n].worker_pids() for n in self._participants()}
        victim = pids[local]
        others = {p for ps in before.values() for p in ps.values() if p != victim}
        # nodes that keep a worker (a one-rank node's only worker is the victim); with a 2-D
        # mesh in place the victim's node sits out whole until its new worker is up
        survivors = [n for n, ps in before.items() if set(ps.values()) - {victim}
                     and not (self.cfg.in_process and self.cfg.mesh != "fsdp" and n == node)]
        rec.node = f"{node}/{local}"
        rec.t_start, _ = cl.kill_worker(node, local)
        if self.cfg.in_process:
            time.sleep(0.3)  # as for a node loss: what the stores hold when the survivors restore
            committed = self._committed_on(list(before))
            self._wait_recovered(rec.t_start, 60)
        else:
            wait_exited(others, 60)
            committed = self._committed_on(list(before))
        replacement = None
        until = time.monotonic() + 60
        while self.cfg.in_process and time.monotonic() < until and cl.nodes[node].alive:
            pid = cl.nodes[node].worker_pids().get(local)
            if pid is not None and pid != victim:
                replacement = pid
                break
            time.sleep(0.05)
        rec.detail = (f"pid {victim}; survivors held {committed[-2:]}"
                      + (f"; replaced by pid {replacement}" if replacement else ""))
        rec.t_end = time.time()
        self._resolve(rec, expect_restart=True, newest=committed[-1] if committed else None,
                      survivors=survivors)
        if not self.cfg.in_process:
            return
        events = [e for e in self._events() if rec.t_start <= e["time"] <= rec.t_resolved]
        started = {e["pid"] for e in events if e["event"] == "start"}
        strangers = sorted(started - others - {replacement} - spare_pids)
        rec.checks.append((f"the other workers went on in their processes (new processes: {strangers})",
                           not strangers))
        joined = [e for e in events if e["event"] == "restore" and e.get("found")
                  and e.get("_pid") == replacement]
        if self.cfg.spares and replacement is not None and not joined:
            # a spare stepped in at the loss: the replacement, started after, waits as a spare
            waiting = (node, replacement) not in self._members_now()
            world = self._last_world()
            rec.checks.append((
                f"local rank {local} of {node} was replaced by a new process ({replacement}) that "
                f"waits as a spare (a spare stepped in: world {world} of {self.cfg.world})",
                waiting and world == self.cfg.world))
            return
        rec.checks.append((
            f"local rank {local} of {node} was replaced by a new process ({replacement}) that joined "
            f"at a snapshot ({'step ' + str(joined[0]['step']) if joined else 'no restore'})",
            replacement is not None and bool(joined)))

    def _fault_freeze(self, rec: FaultRecord) -> None:
        cl = self.cluster
        assert cl is not None
        dur = self.rng.uniform(self.cfg.snapshot_timeout + 2, self.cfg.pg_timeout + 8)
        pids = cl.stop_node(rec.node)
        time.sleep(dur)
        cl.cont_node(pids)
        rec.detail = f"SIGSTOP for {dur:.1f} s (snapshot timeout {self.cfg.snapshot_timeout:.0f} s)"
        rec.t_end = time.time()
        self._resolve(rec, expect_restart=None)

    def _fault_partition(self, rec: FaultRecord) -> None:
        cl = self.cluster
        assert cl is not None and self.net is not None
        dur = self.rng.uniform(self.cfg.snapshot_timeout + 2, self.cfg.pg_timeout + 8)
        self.net.cut(cl.nodes[rec.node].index)
        time.sleep(dur)
        if rec.node in self.net_nodes():
            self.net.heal(cl.nodes[rec.node].index)
        rec.detail = f"link down for {dur:.1f} s"
        rec.t_end = time.time()
        self._resolve(rec, expect_restart=None)

    def _fault_s3_outage(self, rec: FaultRecord) -> None:
        dur = self.rng.uniform(8.0, 20.0)
        mode = self.rng.choice(["down", "hang"])
        rec.node = "s3"
        self._monitor_paused.set()
        if mode == "down":
            self.proxy.down()
        else:
            assert self.moto is not None
            os.kill(self.moto.pid, signal.SIGSTOP)
        time.sleep(dur)
        if mode == "down":
            self.proxy.up()
        else:
            assert self.moto is not None
            os.kill(self.moto.pid, signal.SIGCONT)
        self._monitor_paused.clear()
        rec.detail = f"endpoint {'down (refused/reset)' if mode == 'down' else 'hung (SIGSTOP)'} for {dur:.1f} s"
        rec.t_end = time.time()
        self._resolve(rec, expect_restart=False)
        self._check_uploads_caught_up(rec)

    def _fault_store_restart(self, rec: FaultRecord) -> None:
        cl = self.cluster
        assert cl is not None
        rec.node = "store"
        down = cl.restart_store()
        rec.detail = f"store SIGKILLed and started again empty ({down:.1f} s down)"
        rec.t_end = time.time()
        self._resolve(rec, expect_restart=False)

    def _fault_store_outage(self, rec: FaultRecord) -> None:
        cl = self.cluster
        assert cl is not None
        dur = self.rng.uniform(3.0, 15.0)
        rec.node = "store"
        cl.freeze_store(dur)
        rec.detail = f"store SIGSTOPped for {dur:.1f} s"
        rec.t_end = time.time()
        self._resolve(rec, expect_restart=False)

    def _fault_store_full(self, rec: FaultRecord) -> None:
        cl = self.cluster
        assert cl is not None
        dur = self.rng.uniform(2.0, 6.0)
        store = cl.nodes[rec.node].store_dir
        ballast = fill(store)
        time.sleep(dur)

        def met() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
            """Snapshots of this node's ranks since the fill: skipped, and committed (a step
            whose only new file fits in the pages the eviction of the step before freed needs
            no free space: the shards go to reused slots)."""
            ours = [e for e in self._events() if e["event"] == "snapshot" and e["_node"] == rec.node
                    and e["time"] >= rec.t_start]
            return [e for e in ours if e.get("skipped")], [e for e in ours if e.get("committed")]

        # held full until a snapshot met it (a slow first step must not pass the window
        # without one): one skipped, or 3 committed, at most 30 s more
        until = time.time() + 30
        while time.time() < until:
            skipped, committed = met()
            if skipped or len({e["step"] for e in committed}) >= 3:
                break
            time.sleep(0.5)
        with contextlib.suppress(FileNotFoundError):
            ballast.unlink()
        rec.detail = f"tmpfs store full for {time.time() - rec.t_start:.1f} s"
        rec.t_end = time.time()
        self._resolve(rec, expect_restart=False)
        skipped, committed = met()
        skipped = [e for e in skipped if e["time"] <= rec.t_end + 2]
        committed = [e for e in committed if e["time"] <= rec.t_end]
        rec.checks.append((f"memory snapshots went on while full: {len(skipped)} skipped, "
                           f"{len({e['step'] for e in committed})} committed in freed space",
                           bool(skipped or committed)))

    def _committed_on(self, nodes: list[str]) -> list[int]:
        assert self.cluster is not None
        return sorted({s.step for n in nodes
                       for s in NodeStore(self.cluster.nodes[n].store_dir, self.job).steps() if s.committed})

    def net_nodes(self) -> list[str]:
        assert self.cluster is not None and self.net is not None
        return [n for n, nd in self.cluster.nodes.items() if nd.index in self.net.nodes]

    # -- resolution and checks -----------------------------------------------------------------

    def _resolve(self, rec: FaultRecord, *, expect_restart: bool | None, newest: int | None = None,
                 survivors: list[str] | None = None) -> None:
        """Wait until the job trains again at full size; then check this fault's invariants."""
        cl = self.cluster
        assert cl is not None
        ok = self._wait_steady(rec.t_start)
        rec.t_resolved = time.time()
        if not ok:
            rec.checks.append((f"the job did not resume within {self.cfg.fault_timeout:.0f} s", False))
            return
        events = [e for e in self._events() if rec.t_start <= e["time"] <= rec.t_resolved]
        losses = [x for x in read_jsonl(self.loss_log) if x["time"] <= rec.t_resolved]
        starts = sorted({round(e["time"]) for e in events if e["event"] == "start" and e["rank"] == 0})
        restores = [e for e in events if e["event"] == "restore" and e["rank"] == 0 and e.get("found")]
        rec.restarts = len(starts)
        if self.cfg.in_process:
            # process restarts: a worker process started on a node that ran one before the fault
            earlier = [e for e in self._events() if e["event"] == "start" and e["time"] < rec.t_start]
            old_nodes = {e["_node"] for e in earlier}
            # (a spare that stepped in ran before the fault: not a restart)
            old_pids = {(e["_node"], e.get("pid")) for e in earlier} | {
                (e["_node"], e.get("pid")) for e in events if e.get("pid") in rec.running}
            rec.restarts = len({(e["_node"], e.get("pid")) for e in events if e["event"] == "start"
                                and e["_node"] in old_nodes and (e["_node"], e.get("pid")) not in old_pids})
            rec.in_place = len({e["round"] for e in events if e["event"] == "recovery"})
        rec.relaunches = sum(1 for t, _ in self.relaunches if rec.t_start <= t <= rec.t_resolved)
        rec.restored = [e["step"] for e in restores]
        rec.tiers = sorted({s.get("source", s["tier"]) for e in events if e["event"] == "restore" and e.get("found")
                            for s in e.get("sources", [])})
        during = [x for x in losses if x["time"] >= rec.t_start]
        times = [rec.t_start] + [x["time"] for x in during]
        rec.max_step_gap_s = max((b - a for a, b in zip(times, times[1:], strict=False)), default=0.0)
        if restores:
            first = restores[0]
            after = [x for x in losses if x["time"] > first["time"]]
            if after:
                rec.resume_s = after[0]["time"] - rec.t_start
            # the work lost: from the last step the job computed before it went down (its state
            # digest is logged before save) back to the restored one; the log is in time order,
            # and an earlier rollback may have logged higher steps long before
            before = [d["step"] for d in read_jsonl(self.digest_log)
                      if d["phase"] == "saved" and d["time"] < first["time"]]
            rec.lost_steps = (before[-1] if before else 0) - first["step"]
        if expect_restart is True:
            rec.checks.append(("the job restarted and restored a snapshot", bool(restores)))
        elif expect_restart is False:
            rec.checks.append((f"training never stopped: no restart ({rec.restarts}) or in-place "
                               f"recovery ({rec.in_place}), longest step gap {rec.max_step_gap_s:.1f} s",
                               rec.restarts == 0 and rec.in_place == 0))
        if newest is not None and restores:
            # Only when every survivor took part in that round: torchrun may close a round (min
            # nodes reached + last call) before a slow survivor rejoins, and the shards it holds
            # are then not available; the round restores the newest step complete without it.
            t_r = restores[0]["time"]
            joined = {e["_node"] for e in events if e["event"] == "start" and t_r - 10 < e["time"] <= t_r}
            if set(survivors or ()) <= joined:
                rec.checks.append((f"restored step {restores[0]['step']} = newest committed on the survivors {newest}",
                                   restores[0]["step"] == newest))
            else:
                rec.detail += f"; {sorted(set(survivors or ()) - joined)} missed the first round"
        self._check_restores(rec, [e for e in events if e["event"] == "restore" and e.get("found")])
        orphans = self._orphans()
        rec.checks.append((f"no orphaned processes ({orphans})", not orphans))

    def _check_restores(self, rec: FaultRecord, restores: list[dict[str, Any]]) -> None:
        all_events = self._events()
        digests = read_jsonl(self.digest_log)
        firsts = sorted(e["time"] for e in restores if e["rank"] == 0)
        for e in restores:
            if e["rank"] != 0:
                continue
            t, step = e["time"], e["step"]
            interrupted = any(t < t2 for t2 in firsts)  # another restore followed this one
            # committed = a manifest on a node, or a committed event of any rank (a rank may die
            # between the manifest writes and its event), or a committed durable upload
            committed = self._memory_committed.get(step, float("inf")) < t or any(
                x["time"] < t and x.get("step") == step and x.get("committed")
                and x["event"] in ("snapshot", "upload") for x in all_events)
            rec.checks.append((f"restored step {step} was committed before the restore", committed))
            durable = [x["step"] for x in all_events if x["time"] < t and x["event"] == "upload"
                       and x.get("committed") and x["rank"] == 0]
            if durable:
                rec.checks.append((f"restored step {step} >= newest durable step {max(durable)}", step >= max(durable)))
            saved = {d["digest"] for d in digests if d["phase"] == "saved" and d["step"] == step and d["time"] < t}
            back = [d for d in digests if d["phase"] == "restored" and d["step"] == step and d["time"] > t - 1]
            if not back and interrupted:
                continue  # lost again before it could log its state; the next restore is checked
            rec.checks.append((f"restored state of step {step} is bitwise a state saved at that step",
                               bool(back) and back[0]["digest"] in saved))

    def _check_uploads_caught_up(self, rec: FaultRecord) -> None:
        events = [e for e in self._events() if e["rank"] == 0]
        hit = [e for e in events if rec.t_start <= e["time"] <= rec.t_end + 1 and (
            e["event"] == "upload_skipped" or (e["event"] == "upload" and e.get("error")))]
        # the tier catches up: an upload committed after the store came back
        deadline = time.time() + 90
        caught = []
        while time.time() < deadline:
            caught = [e for e in self._events() if e["rank"] == 0 and e["event"] == "upload"
                      and e.get("committed") and e["time"] > rec.t_end]
            if caught:
                break
            time.sleep(0.5)
        rec.checks.append((f"uploads caught up after the outage ({len(hit)} skipped/failed during it)", bool(caught)))

    def _check_reference(self) -> None:
        """Invariant 3: until the world first changed size, every saved state equals the
        uninterrupted reference run's state at that step."""
        digests = read_jsonl(self.digest_log)
        changed = min((x["time"] for x in read_jsonl(self.loss_log) + digests
                       if x["world"] != self.cfg.world), default=float("inf"))
        checked = mismatched = 0
        for d in digests:
            if d["time"] >= changed or d["step"] not in self.reference:
                continue
            checked += 1
            mismatched += d["digest"] != self.reference[d["step"]]
        self.global_checks.append((
            f"states saved or restored before the first world-size change equal the uninterrupted "
            f"run's ({checked} compared, {mismatched} differ)", checked > 0 and mismatched == 0))

    # -- waiting ---------------------------------------------------------------------------------

    def _participants(self) -> list[str]:
        """The nodes that train (with spares: that have a process in the newest round; a node
        whose processes all wait as spares is no fault target)."""
        assert self.cluster is not None
        nodes = [n for n, nd in self.cluster.nodes.items() if nd.alive and nd.workers()]
        if self.cfg.spares:
            training = {n for n, _ in self._members_now()}
            nodes = [n for n in nodes if n in training]
        return sorted(nodes)

    def _members_now(self) -> set[tuple[str, int]]:
        """(node, pid) of every process of the newest round formed, read from the membership
        store as its processes read it (the proposer's whole list)."""
        from aegis.training.inprocess.membership import latest_round
        from aegis.training.inprocess.records import decode_record

        for attempt in range(30):  # the store may be restarting (a store fault just before)
            try:
                store = self._membership_client()
                r = latest_round(store)
                record = decode_record(store.get(f"aegis/round/{r}/members"))
                members = record.get("members") or decode_record(
                    store.get(f"aegis/round/{r}/list/{record['by']}"))
                out = set()
                for uid in members:
                    node, _, pid = uid.split("/")
                    out.add((node, int(pid)))
                return out
            except Exception:  # noqa: BLE001 - the store away: again in a second
                if attempt == 29:
                    raise
                time.sleep(1.0)
        return set()

    def _start_spares(self) -> None:
        """``spares`` nodes that wait beside the full job; returns once each of their workers has
        registered to join (the store's join counter), so that the first fault finds them
        waiting."""
        if not self.cfg.spares:
            return
        for _ in range(self.cfg.spares):
            self._add_node()
        store = self._membership_client()
        want = self.cfg.spares * self.cfg.nproc_per_node
        deadline = time.monotonic() + 180
        while int(store.add("aegis/join/count", 0)) < want:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{want} spare worker(s) did not register within 180 s")
            time.sleep(0.2)

    def _membership_client(self) -> Any:
        """A c10d client of the cluster's membership store (``aegis store serve``)."""
        from datetime import timedelta

        import torch.distributed as dist

        cl = self.cluster
        assert cl is not None
        return dist.TCPStore(cl.host, cl.port, is_master=False, wait_for_workers=False,
                             timeout=timedelta(seconds=10))

    def _last_world(self) -> int:
        losses = read_jsonl(self.loss_log)
        return losses[-1]["world"] if losses else 0

    def _last_step(self) -> int:
        losses = read_jsonl(self.loss_log)
        return losses[-1]["step"] if losses else 0

    def _events(self) -> list[dict[str, Any]]:
        return read_events(self.work)

    def _reap(self) -> None:
        """An agent that exited on its own (e.g. its rendezvous timed out while the node was cut
        off, or the round's master was lost before it published its address) has closed the
        rendezvous for every agent: torchrun never reopens it. Requeue the job like a scheduler
        would: stop the other agents (node stores stay) and start every node's agent again
        under a new rendezvous id; aegis then restores from the node stores."""
        cl = self.cluster
        assert cl is not None
        exited = [n for n, nd in cl.nodes.items() if nd.killed is None and not nd.alive]
        if not exited:
            return
        if self.cfg.in_process:  # only that node comes back (its store kept); it joins in place
            self.relaunches.append((time.time(), exited))
            cl.relaunch(solo=True)
            return
        for nd in cl.nodes.values():
            if nd.killed is None and nd.alive:
                wait_gone(kill_tree(nd.proc.pid), 10)
                with contextlib.suppress(Exception):
                    nd.proc.wait(timeout=5)
        self.relaunches.append((time.time(), exited))
        cl.relaunch()

    def _wait_steady(self, since: float, first: bool = False) -> bool:
        """Until ``steady_steps`` steps were logged at full world after the last restart; grows
        the world back (adds a node) when it runs below full size."""
        cl = self.cluster
        assert cl is not None
        deadline = time.monotonic() + (300 if first else self.cfg.fault_timeout)
        while time.monotonic() < deadline:
            self._reap()
            alive = [n for n, nd in cl.nodes.items() if nd.alive]
            losses = [x for x in read_jsonl(self.loss_log) if x["time"] > since]
            starts = [e["time"] for e in self._events() if e["event"] == "start" and e["time"] > since]
            last_start = max(starts, default=since)
            recent = [x for x in losses if x["time"] > last_start]
            if self.cfg.spares and not first and len(alive) < self.cfg.nodes + self.cfg.spares:
                self._add_node()  # a spare stepped in (or a node was lost): one more waits
                time.sleep(1.0)
                continue
            if (not self.cfg.spares and len(alive) < self.cfg.nodes and recent
                    and recent[-1]["world"] == len(alive) * self.cfg.nproc_per_node):
                self._add_node()  # the job runs shrunk: a new node joins (the job restarts, or not)
                time.sleep(1.0)
                continue
            full = [x for x in recent if x["world"] == self.cfg.world]
            if len(full) >= self.cfg.steady_steps and time.time() - last_start > 2:
                return True
            time.sleep(0.2)
        return False

    def _orphans(self) -> list[int]:
        """Processes of this campaign that no live agent owns (after a grace period)."""
        cl = self.cluster
        assert cl is not None
        deadline = time.monotonic() + 30
        while True:
            owned: set[int] = set()
            for nd in cl.nodes.values():
                if nd.alive:
                    owned.add(nd.proc.pid)
                    owned.update(descendants(nd.proc.pid))
            stray = [p for p in _marker_pids(self.marker) if p not in owned
                     and (self.moto is None or p != self.moto.pid)]
            if not stray or time.monotonic() > deadline:
                return stray
            time.sleep(0.5)

    # -- report ----------------------------------------------------------------------------------

    def _line(self, r: FaultRecord) -> str:
        status = "ok" if not r.violations else "VIOLATION: " + "; ".join(r.violations)
        resume = f"{r.resume_s:.1f} s" if r.resume_s is not None else "-"
        return (f"[{r.index:>3}] {r.kind:<11} {r.node:<8} {r.detail} | restarts {r.restarts} "
                + (f"in place {r.in_place} " if self.cfg.in_process else "")
                +
                f"restored {r.restored} from {'+'.join(r.tiers) or '-'} resume {resume} "
                + (f"requeues {r.relaunches} " if r.relaunches else "")
                + f"lost {r.lost_steps if r.lost_steps is not None else '-'} | {status}")

    def summary(self, wall_s: float) -> dict[str, Any]:
        rows = []
        for kind in [k for k in ALL_KINDS if k in KINDS or k in self.requested]:
            rs = [r for r in self.records if r.kind == kind]
            if not rs:
                rows.append({"kind": kind, "injected": 0,
                             "note": self.net_reason if kind == "partition" and self.net_reason else
                             "not available here" if kind not in self.cfg.kinds else ""})
                continue
            resumes = [r.resume_s for r in rs if r.resume_s is not None]
            lost = [r.lost_steps for r in rs if r.lost_steps is not None]
            tiers: Counter[str] = Counter(t for r in rs for t in r.tiers)
            rows.append({
                "kind": kind,
                "injected": len(rs),
                "recoveries": sum(1 for r in rs if r.restored),
                "restarts": sum(r.restarts for r in rs),
                "in_place": sum(r.in_place for r in rs),
                "relaunches": sum(r.relaunches for r in rs),
                "tiers": dict(tiers),
                "resume_median_s": statistics.median(resumes) if resumes else None,
                "resume_max_s": max(resumes) if resumes else None,
                "lost_steps_median": statistics.median(lost) if lost else None,
                "lost_steps_max": max(lost) if lost else None,
                "max_step_gap_s": max(r.max_step_gap_s for r in rs),
                "violations": sum(len(r.violations) for r in rs),
            })
        violations = [f"fault {r.index} ({r.kind}): {v}" for r in self.records for v in r.violations]
        violations += [what for what, ok in self.global_checks if not ok]
        return {
            "seed": self.cfg.seed,
            "mode": "in-process" if self.cfg.in_process else "restart",
            "topology": f"{self.cfg.nodes}x{self.cfg.nproc_per_node}",
            "spares": self.cfg.spares,
            "launcher": "aegis.launch --on-worker-failure=replace" if self.cfg.launcher_policy else "torchrun",
            "redundancy": self.cfg.redundancy,
            "mesh": self.cfg.mesh,
            "faults_planned": self.cfg.faults,
            "faults_injected": len(self.records),
            "wall_s": wall_s,
            "network_namespaces": self.net_reason is None,
            "network_note": self.net_reason,
            "checks": sum(len(r.checks) for r in self.records) + len(self.global_checks),
            "global_checks": self.global_checks,
            "rows": rows,
            "violations": violations,
            "records": [asdict(r) for r in self.records],
            "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(self.cfg).items()},
        }


def format_table(s: dict[str, Any]) -> str:
    head = "| fault | injected | recoveries | restarts (job requeues) | in place | source tiers | resume median / max (s) | lost steps median / max | longest step gap (s) | violations |"
    out = [head, "|" + "---|" * 10]
    for r in s["rows"]:
        if not r["injected"]:
            out.append(f"| {r['kind']} | 0 | | | | | | | | {r.get('note', '')} |")
            continue

        def f(x: Any, fmt: str = "{:.1f}") -> str:
            return "-" if x is None else fmt.format(x)

        out.append(
            f"| {r['kind']} | {r['injected']} | {r['recoveries']} | {r['restarts']} ({r['relaunches']}) | "
            f"{r.get('in_place', 0)} | "
            f"{', '.join(f'{k} {v}' for k, v in sorted(r['tiers'].items())) or '-'} | "
            f"{f(r['resume_median_s'])} / {f(r['resume_max_s'])} | "
            f"{f(r['lost_steps_median'], '{:g}')} / {f(r['lost_steps_max'], '{:g}')} | "
            f"{r['max_step_gap_s']:.1f} | {r['violations']} |")
    total = sum(r["injected"] for r in s["rows"])
    out.append(f"| **all** | {total} | | | | | | | | {len(s['violations'])} |")
    return "\n".join(out)


# -- helpers ---------------------------------------------------------------------------------------


def _boto_kw() -> dict[str, str]:
    return {"aws_access_key_id": S3_ENV["AWS_ACCESS_KEY_ID"],
            "aws_secret_access_key": S3_ENV["AWS_SECRET_ACCESS_KEY"],
            "region_name": S3_ENV["AWS_DEFAULT_REGION"]}


def fill(directory: Path) -> Path:
    """Take every free byte of the file system holding ``directory``."""
    ballast = directory / ".ballast"
    with open(ballast, "wb", buffering=0) as f:
        st = os.statvfs(directory)
        if st.f_bavail:
            with contextlib.suppress(OSError):
                os.posix_fallocate(f.fileno(), 0, st.f_bavail * st.f_frsize)
        f.seek(0, os.SEEK_END)
        with contextlib.suppress(OSError):
            while f.write(b"\0" * 4096):
                pass
    return ballast


def _marker_pids(marker: str) -> list[int]:
    needle = f"AEGIS_CHAOS={marker}".encode()
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/environ", "rb") as f:
                if needle not in f.read():
                    continue
            with open(f"/proc/{d}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
        except OSError:
            continue
        out.append(int(d))
    return out


def wait_marker_gone(marker: str, timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while True:
        left = _marker_pids(marker)
        if not left or time.monotonic() > deadline:
            for p in left:
                kill_tree(p)
            return left
        time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--faults", type=int, default=50)
    p.add_argument("--kinds", default=",".join(KINDS),
                   help=f"comma-separated, from {', '.join(ALL_KINDS)} (default: {', '.join(KINDS)})")
    p.add_argument("--workdir", default="/tmp/aegis-chaos")
    p.add_argument("--no-network", action="store_true", help="no network namespaces (no partitions)")
    p.add_argument("--out", default=None, help="write the summary JSON here")
    p.add_argument("--in-process", action="store_true",
                   help="the trainer recovers in place (aegis.run_in_process)")
    p.add_argument("--node-relay", action="store_true",
                   help="--in-process: every process beats through its node's heartbeat relay "
                        "(AEGIS_NODE_RELAY=1, issue 40)")
    p.add_argument("--redundancy", choices=("replica", "dp", "xor", "rs"), default="replica",
                   help="memory redundancy: one replica per shard (dp: built from the data-parallel "
                        "copies, with --mesh hsdp), or XOR / Reed-Solomon (2 parity) parity over "
                        "the nodes")
    p.add_argument("--topology", default="3x1", metavar="NxR",
                   help=f"N nodes of R ranks each ({', '.join(TOPOLOGIES)}; default 3x1)")
    p.add_argument("--spares", type=int, default=0,
                   help="--in-process: nodes that wait beside the job (max_world) and step in "
                        "at the first round after a loss")
    p.add_argument("--mesh", choices=("fsdp", "hsdp", "tp"), default="fsdp",
                   help="the trainer's mesh: 1-D FSDP, HSDP (replicate across nodes x shard "
                        "within one) or FSDP + TP within a node; 2-D needs R >= 2")
    a = p.parse_args(argv)
    kinds = tuple(k for k in a.kinds.split(",") if k)
    bad = set(kinds) - set(ALL_KINDS)
    if bad:
        p.error(f"unknown fault kinds {sorted(bad)}; choose from {', '.join(ALL_KINDS)}")
    if set(kinds) & set(STORE_KINDS) and not a.in_process:
        p.error(f"{', '.join(STORE_KINDS)}: the membership store's faults need --in-process (under "
                "torchrun restarts the store is only the rendezvous)")
    try:
        nodes, nproc = (int(x) for x in a.topology.lower().split("x"))
    except ValueError:
        p.error(f"--topology {a.topology!r}: give NxR, e.g. 3x2")
    if nodes < 3 or nproc < 1:
        p.error(f"--topology {a.topology}: at least 3 nodes (the world shrinks by one) of >= 1 rank")
    if a.spares < 0 or (a.spares and not a.in_process):
        p.error("--spares N (N >= 0) needs --in-process: spares wait in run_in_process")
    if a.mesh != "fsdp" and nproc < 2:
        p.error(f"--mesh {a.mesh}: the inner dimension is a node's ranks; give --topology Nx2 or more")
    if a.node_relay:  # the agents and their workers inherit it
        os.environ["AEGIS_NODE_RELAY"] = "1"
    cfg = Config(seed=a.seed, faults=a.faults, kinds=kinds, workdir=Path(a.workdir), network=not a.no_network,
                 in_process=a.in_process, redundancy=a.redundancy, nodes=nodes, nproc_per_node=nproc,
                 spares=a.spares, mesh=a.mesh, node_relay=a.node_relay)
    s = Campaign(cfg).run()
    print()
    print(format_table(s))
    for what, ok in s["global_checks"]:
        print(f"[{'PASS' if ok else 'FAIL'}] {what}")
    print(f"{s['faults_injected']} faults, {s['checks']} checks, {len(s['violations'])} invariant violations, "
          f"{s['wall_s'] / 60:.1f} min")
    for v in s["violations"]:
        print(f"  VIOLATION {v}")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(s, indent=1, default=str))
    return 0 if not s["violations"] and s["faults_injected"] == cfg.faults else 1


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
