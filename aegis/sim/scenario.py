"""Failure scenarios on the simulated cluster, with the checks that every recovery must pass.

A scenario runs the reference trainer on N simulated nodes with snapshots every step, loses
nodes at chosen moments (between steps, or exactly at a phase of a snapshot or a restore, through
``aegis._fault``'s pause mode), lets replacements join or the world shrink, and then checks:

* every agent exits 0 and training reaches the last step;
* after each loss, the job restored the newest step that was committed on a surviving node;
* the restored state equals, bit for bit, the state saved at that step (full-state crc32c that
  the trainer logs after every save and after every restore).

Used by the demo's checks, the fault-matrix tests and the benchmarks.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aegis.sim.cluster import SimCluster
from aegis.snapshot.node_store import NodeStore

__all__ = ["Kill", "StoreFault", "Scenario", "ScenarioResult", "read_jsonl", "read_events",
           "wait_exited", "TRAINER"]

TRAINER = str(Path(__file__).resolve().parents[2] / "examples" / "train_fsdp.py")


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            try:
                out.append(json.loads(line))
            except ValueError:  # a line cut by a kill
                continue
    return out


def read_events(workdir: Path) -> list[dict[str, Any]]:
    """Every rank's events, in time order, each with ``_node`` and ``_pid`` (the process that
    wrote it: the pid of the last ``start`` event before it in the same rank file; in-process
    rounds renumber ranks, so one file holds several processes' events)."""
    out = []
    for f in sorted((workdir / "events").glob("*/rank-*.jsonl")):
        pid = None
        for e in read_jsonl(f):
            if e.get("event") == "start":
                pid = e.get("pid")
            e["_node"] = f.parent.name
            e["_pid"] = pid
            out.append(e)
    return sorted(out, key=lambda e: e["time"])


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:  # gone (FileNotFoundError, or ProcessLookupError mid-read)
        return False


def wait_exited(pids: set[int], timeout: float) -> float | None:
    """Time at which none of ``pids`` runs any more, or None on timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(_running(p) for p in pids):
            return time.time()
        time.sleep(0.01)
    return None


@dataclass
class Kill:
    """Lose a node: after ``after_step`` is logged (node given by id), or when the fault marker
    of ``fault`` appears (the node that hit it). ``replace``: a replacement joins. ``worker``:
    lose only that local rank's worker process (SIGKILL; the agent, the node's other workers and
    its node store stay): with ``Scenario.on_worker_failure="replace"`` its agent starts a new
    process in its place, which joins at the survivors' next snapshot."""

    after_step: int | None = None
    node: str | None = None
    fault: str | None = None  # an AEGIS_FAIL_AT entry, run in pause mode
    replace: bool = True
    delay: float = 0.1  # after the step is logged, so the node is between steps
    worker: int | None = None  # a local rank: kill that worker only


@dataclass
class StoreFault:
    """A fault of the membership and rendezvous store (``aegis store serve``) after
    ``after_step`` is logged: ``"restart"`` (SIGKILLed and started again, empty, on its address:
    its host lost and brought back by a supervisor) or ``"outage"`` (SIGSTOPped for ``seconds``:
    connections stay open, nothing is answered). In-process recovery only (``aegis.launch``
    agents; torchrun's own agents need their rendezvous store). Checked: training goes on
    through it without a recovery or a new process until the next loss."""

    after_step: int
    kind: str = "restart"
    seconds: float = 6.0
    delay: float = 0.1


# torchelastic's warning for a keep-alive its rendezvous handler could not write to the store
KEEP_ALIVE_FAILED = "has failed to send a keep-alive heartbeat"
# aegis.launch's lines when its rendezvous store goes away and when its client reconnects
STORE_AWAY = "the rendezvous store is unreachable"
STORE_BACK = "the rendezvous store is back"


@dataclass
class StoreRecord:
    kind: str
    t_start: float
    down_s: float
    step: int


@dataclass
class KillRecord:
    node: str
    t_kill: float
    t_detect: float | None
    committed: list[int]  # committed steps on the survivors once their workers were gone
    trigger: str
    worker: int | None = None  # a worker kill: its local rank
    victim: int | None = None  # ... its pid
    others: list[int] = field(default_factory=list)  # the other workers' pids at the kill
    replacement: int | None = None  # the new process its agent started for that local rank


@dataclass
class ScenarioResult:
    workdir: Path
    codes: dict[str, int | None]
    kills: list[KillRecord]
    losses: list[dict[str, Any]]
    digests: list[dict[str, Any]]
    events: list[dict[str, Any]]
    checks: list[tuple[str, bool]] = field(default_factory=list)
    store_faults: list[StoreRecord] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return bool(self.checks) and all(ok for _, ok in self.checks)

    def failures(self) -> list[str]:
        return [what for what, ok in self.checks if not ok]


@dataclass
class Scenario:
    workdir: Path
    kills: list[Kill | StoreFault]  # in the order they happen
    nodes: int = 3
    steps: int = 14
    replicas: int = 1
    config: str = "tiny"
    step_sleep: float = 0.05
    job: str = "scenario"
    timeout: float = 300.0
    extra_args: list[str] = field(default_factory=list)
    # aegis.run_in_process: survivors recover in place; replacements (their own torchrun
    # rendezvous) join at a snapshot; the world may shrink to nodes - 1 meanwhile
    in_process: bool = False
    nproc_per_node: int = 1  # ranks per node, sharing the node's store
    # run the agents with aegis.launch and this policy (None: torchrun)
    on_worker_failure: str | None = None
    # in place, rounds of whole nodes (the trainer's --mesh hsdp/tp, --whole-nodes): checked
    # as an invariant of every round
    whole_nodes: bool = False
    # the run's last step, once the harness moved it (see run)
    last_step: int | None = field(default=None, init=False)

    def run(self) -> ScenarioResult:
        work = Path(self.workdir)
        work.mkdir(parents=True, exist_ok=True)
        faults = work / "faults"
        faults.mkdir(exist_ok=True)
        loss_log, digest_log = work / "loss.jsonl", work / "digest.jsonl"
        if any(isinstance(k, StoreFault) for k in self.kills) and not self.in_process:
            raise ValueError("StoreFault: in-process recovery only (torchrun's agents need their "
                             "rendezvous store)")
        kills = [k for k in self.kills if isinstance(k, Kill)]
        fault_spec = ",".join(k.fault for k in kills if k.fault)
        shrink = any(not k.replace for k in kills)
        lost = sum(1 for k in kills if not k.replace)
        min_world = max(1, (self.nodes - max(1, lost)) * self.nproc_per_node)
        inproc = ["--in-process", "--min-world", str(min_world)] if self.in_process else []
        # In place, a replacement joins the running job at a snapshot; the job must still be
        # training when it is ready (starting a process and importing torch took ~4.5 s on a
        # loaded 2-core machine). So the run does not end at a count of steps: its last step,
        # in the trainer's --end-file, stays out of reach until every replacement restored
        # (or JOIN_WAIT_S passed), then becomes a few steps past the newest one logged.
        joiners = self.in_process and any(self._expects_joiner(k) for k in kills)
        # the same for a store restart: the check reads each agent's reconnect (tried every
        # RECONNECT_S) after it, so the run lasts until every agent that lost the store has it
        # back (48 steps had ended first once steps got quicker: a count of steps again)
        restarts = any(isinstance(k, StoreFault) and k.kind == "restart" for k in self.kills)
        hold = joiners or restarts
        end_file = work / "end_step"
        write_end(end_file, self.steps + HOLD_STEPS if hold else self.steps)
        cluster = SimCluster(
            work,
            [TRAINER, "--config", self.config, "--steps", str(self.steps), "--dropout", "0.1",
             "--job", self.job, "--replicas", str(self.replicas), "--loss-log", str(loss_log),
             "--digest-log", str(digest_log), "--step-sleep", str(self.step_sleep),
             "--end-file", str(end_file), *inproc,
             *self.extra_args],
            nodes=self.nodes,
            nproc_per_node=self.nproc_per_node,
            on_worker_failure=self.on_worker_failure,
            min_nodes=self.nodes - lost if shrink else self.nodes,
            max_nodes=self.nodes,
            job=self.job,
            env={"AEGIS_FAIL_AT": fault_spec, "AEGIS_FAIL_MODE": "pause", "AEGIS_FAULT_DIR": str(faults)}
            if fault_spec else {},
        )
        records: list[KillRecord] = []
        stores: list[StoreRecord] = []
        added: list[str] = []  # replacement nodes (in place), in kill order
        deadline = time.monotonic() + self.timeout
        try:
            cluster.start()
            for kill in self.kills:
                if isinstance(kill, StoreFault):
                    stores.append(self._store_fault(kill, cluster, loss_log, deadline))
                    continue
                node, trigger = self._wait_trigger(kill, cluster, loss_log, faults, deadline)
                if kill.worker is not None:
                    records.append(self._kill_worker(cluster, node, kill.worker, trigger, deadline))
                    continue
                survivors = [n for n in cluster.alive_nodes() if n != node]
                old = {p for n in survivors for p in cluster.nodes[n].workers()}
                t_kill = cluster.kill_node(node)
                if self.in_process:
                    # the survivors keep their processes and restore soon after the kill (at
                    # once when the store host's liveness service sees the process go): read
                    # what they hold once the commits in flight at the kill have settled, but
                    # before a restore (after it, the new round commits again: with the
                    # liveness service and a quick round, a step within 0.3 s of the kill)
                    committed = self._committed_before_restore(cluster, survivors, t_kill)
                    if kill.replace:
                        added.append(cluster.add_node(solo=True).node_id)
                    t_detect = None
                else:
                    if kill.replace:
                        cluster.add_node()
                    t_detect = wait_exited(old, max(deadline - time.monotonic(), 1))
                    committed = self._committed(cluster, survivors)
                records.append(KillRecord(node, t_kill, t_detect, committed, trigger))
            if hold:
                self.last_step = self._release_end(cluster, records, added, loss_log, end_file,
                                                   deadline, restarts)
            if self.in_process:
                # a lost node's agent never reaches torchrun's exit barrier: the survivors'
                # agents wait there (see SimCluster.wait_workers); the job is over when the
                # workers are, each having exited 0 (from the agents' logs)
                done = cluster.wait_workers(max(deadline - time.monotonic(), 1))
                codes: dict[str, int | None] = {
                    n: (0 if done and not _worker_failed(cluster.nodes[n].log) else 1)
                    for n in cluster.alive_nodes()}
            else:
                codes = cluster.wait(max(deadline - time.monotonic(), 1))
        finally:
            cluster.shutdown()
        result = ScenarioResult(work, codes, records, read_jsonl(loss_log), read_jsonl(digest_log),
                                read_events(work), store_faults=stores)
        self._check(result)
        return result

    def _expects_joiner(self, k: Kill) -> bool:
        """A new process or node is to join the running job after this loss."""
        if k.worker is not None:
            return self.on_worker_failure == "replace"
        return k.replace

    def _release_end(self, cluster: SimCluster, records: list[KillRecord], added: list[str],
                     loss_log: Path, end_file: Path, deadline: float, store_restart: bool) -> int:
        """Wait until every replacement (a worker's new process, a new node's workers) restored
        a snapshot and, after a store restart, every agent that found the store unreachable has
        reconnected, at most JOIN_WAIT_S after the last fault (what never comes fails the
        checks, not the harness), then end the run a few steps on."""
        pids = {k.replacement for k in records if k.worker is not None and k.replacement}
        until = min(deadline, time.monotonic() + JOIN_WAIT_S)
        while time.monotonic() < until:
            joined = {(e["_node"], e["_pid"]) for e in read_events(cluster.workdir)
                      if e["event"] == "restore" and e.get("found")}
            if (pids <= {p for _, p in joined} and set(added) <= {n for n, _ in joined}
                    and (not store_restart or _agents_reconnected(cluster))):
                break
            if not cluster.alive_nodes():
                break
            time.sleep(0.05)
        losses = read_jsonl(loss_log)
        # the ranks agree on the end at every step (an all-reduce MIN of what each read), so
        # they stop together whenever they see it; the margin puts it ahead of them (they are
        # a step or two past the newest step logged), so the run ends exactly there
        last = max(self.steps, (losses[-1]["step"] if losses else 0) + END_MARGIN_STEPS)
        write_end(end_file, last)
        return last

    def _store_fault(self, fault: StoreFault, cluster: SimCluster, loss_log: Path,
                     deadline: float) -> StoreRecord:
        while time.monotonic() < deadline:
            losses = read_jsonl(loss_log)
            if losses and losses[-1]["step"] >= fault.after_step:
                break
            time.sleep(0.01)
        else:
            raise TimeoutError(f"step {fault.after_step} was never logged; see {cluster.workdir}")
        time.sleep(fault.delay)
        step = read_jsonl(loss_log)[-1]["step"]
        t = time.time()
        if fault.kind == "restart":
            down = cluster.restart_store()
        elif fault.kind == "outage":
            cluster.freeze_store(fault.seconds)
            down = fault.seconds
        else:
            raise ValueError(f"StoreFault(kind={fault.kind!r}): 'restart' or 'outage'")
        return StoreRecord(fault.kind, t, down, step)

    def _kill_worker(self, cluster: SimCluster, node: str, local: int, trigger: str,
                     deadline: float) -> KillRecord:
        """SIGKILL one worker; note the other workers' pids and the process started in its
        place (if its agent starts one)."""
        before = {n: cluster.nodes[n].worker_pids() for n in cluster.alive_nodes()}
        victim = before[node][local]
        others = sorted(p for pids in before.values() for p in pids.values() if p != victim)
        t_kill, _ = cluster.kill_worker(node, local)
        t_detect = None
        if self.in_process:
            time.sleep(0.3)  # the survivors restore ~1 s after the kill: what every store holds now
        else:
            t_detect = wait_exited(set(others), max(deadline - time.monotonic(), 1))
        committed = self._committed(cluster, cluster.alive_nodes())
        replacement = None
        until = min(deadline, time.monotonic() + 30)
        while time.monotonic() < until and cluster.nodes[node].alive:
            pid = cluster.nodes[node].worker_pids().get(local)
            if pid is not None and pid != victim:
                replacement = pid
                break
            time.sleep(0.02)
        return KillRecord(f"{node}/{local}", t_kill, t_detect, committed,
                          f"worker (local rank {local}, pid {victim}) {trigger}", worker=local,
                          victim=victim, others=others, replacement=replacement)

    def _committed_before_restore(self, cluster: SimCluster, nodes: list[str], t_kill: float,
                                  settle_s: float = 0.3) -> list[int]:
        """The steps committed on ``nodes`` ``settle_s`` after a kill, or their last reading
        before a survivor's restore, if one came sooner. A reading counts only when no restore
        event was there after it: none is emitted before the restore ends, and no new round
        commits before that."""
        end = time.monotonic() + settle_s
        last: list[int] | None = None
        while True:
            reading = self._committed(cluster, nodes)
            if any(e["event"] == "restore" and e["time"] > t_kill for e in read_events(cluster.workdir)):
                return reading if last is None else last  # (None: restored before any look)
            last = reading
            if time.monotonic() >= end:
                return last
            time.sleep(0.01)

    def _committed(self, cluster: SimCluster, nodes: list[str]) -> list[int]:
        return sorted({s.step for n in nodes
                       for s in NodeStore(cluster.nodes[n].store_dir, self.job).steps() if s.committed})

    def _wait_trigger(self, kill: Kill, cluster: SimCluster, loss_log: Path, faults: Path,
                      deadline: float) -> tuple[str, str]:
        while time.monotonic() < deadline:
            if kill.fault:
                rank, step, phase = kill.fault.split(":")
                marker = faults / f"{rank}-{'any' if step == '*' else step}-{phase}"
                if marker.exists():
                    try:
                        info = json.loads(marker.read_text())
                    except ValueError:
                        time.sleep(0.01)
                        continue
                    if phase in ("complete", "replicate", "commit"):
                        # The frozen thread is the background one; let the main threads log the
                        # digest of the step being saved, so the check has the reference state.
                        until = time.monotonic() + 5
                        while time.monotonic() < until and not any(
                            d["step"] == info["step"] and d["phase"] == "saved"
                            for d in read_jsonl(loss_log.with_name("digest.jsonl"))
                        ):
                            time.sleep(0.01)
                    return info["node"], f"rank {info['rank']} frozen at {phase} of step {info['step']}"
            elif kill.after_step is not None:
                losses = read_jsonl(loss_log)
                if losses and losses[-1]["step"] >= kill.after_step:
                    time.sleep(kill.delay)
                    assert kill.node is not None
                    return kill.node, f"between steps, after step {losses[-1]['step']}"
            if not cluster.alive_nodes():
                raise RuntimeError(f"every node exited before the kill; see {cluster.workdir}")
            time.sleep(0.01)
        raise TimeoutError(f"the kill trigger never happened; see {cluster.workdir}")

    def _check(self, r: ScenarioResult) -> None:
        r.checks.append((f"every agent exited 0: {r.codes}", bool(r.codes) and all(c == 0 for c in r.codes.values())))
        if self.last_step is None:
            r.checks.append((f"training reached the last step ({self.steps})",
                             bool(r.losses) and r.losses[-1]["step"] == self.steps))
        else:  # a harness delayed past the margin: the ranks stop together a little later
            r.checks.append((f"training reached the last step ({self.last_step}) the harness set",
                             bool(r.losses) and r.losses[-1]["step"] >= self.last_step))
        for f in r.store_faults:
            # until the next loss (or the end): no round ended, no process started, and steps
            # went on past the one logged at the fault
            nxt = min((k.t_kill for k in r.kills if k.t_kill > f.t_start), default=float("inf"))
            during = [e for e in r.events if f.t_start < e["time"] < nxt]
            ended = [e for e in during if e["event"] in ("recovery", "start")]
            later = [x["step"] for x in r.losses if f.t_start < x["time"] < nxt]
            r.checks.append((
                f"the store's {f.kind} after step {f.step} ({f.down_s:.1f} s without it): training "
                f"went on to step {max(later, default=f.step)} with no recovery and no new process "
                f"({len(ended)} recovery/start events)",
                not ended and max(later, default=f.step) > f.step))
        if any(f.kind == "restart" for f in r.store_faults):
            # an agent whose rendezvous client broke at the restart gets a new one once the store
            # listens again; then its keep-alive stops failing (before: a failed keep-alive and a
            # broken-pipe traceback every second for the rest of the job)
            broke = {p.stem: p.read_text(errors="replace") for p in sorted(r.workdir.glob("node-*.log"))}
            broke = {n: t for n, t in broke.items()  # the nodes still in the job at its end
                     if n in r.codes and STORE_AWAY in t}
            after = {n: t.rsplit(STORE_BACK, 1)[1].count(KEEP_ALIVE_FAILED)
                     if STORE_BACK in t else None for n, t in broke.items()}
            r.checks.append((
                f"after the store's restart each agent's rendezvous client reconnected, and its "
                f"keep-alive stopped failing (failed keep-alives after it, by node: {after})",
                all(v is not None and v <= 2 for v in after.values())))
        if self.whole_nodes:
            rounds = [e for e in r.events if e["event"] == "recovery"]
            worlds = sorted({x["world"] for x in r.losses})
            r.checks.append((
                f"every round was made of whole nodes of {self.nproc_per_node} (worlds {worlds}; "
                f"{len(rounds)} recovery events, whole: {sorted({e.get('whole_nodes') for e in rounds}, key=str)})",
                all(e.get("whole_nodes") is True for e in rounds)
                and all(w % self.nproc_per_node == 0 for w in worlds)))
        for i, k in enumerate(r.kills):
            # the state saved at each step by the run that was interrupted (latest before the kill)
            saved = {d["step"]: d["digest"] for d in r.digests
                     if d["phase"] == "saved" and d["time"] < k.t_kill}
            nxt = r.kills[i + 1].t_kill if i + 1 < len(r.kills) else float("inf")
            restores = [e for e in r.events if e["event"] == "restore" and e.get("found")
                        and k.t_kill < e["time"] < nxt]
            if not restores:
                if i + 1 < len(r.kills):
                    continue  # the next loss came during this recovery
                r.checks.append((f"loss {i + 1} ({k.node}): a restore happened", False))
                continue
            step = restores[0]["step"]
            r.checks.append((
                f"loss {i + 1} ({k.node}, {k.trigger}): restored step {step}, the newest committed "
                f"on the survivors {k.committed[-3:]}",
                bool(k.committed) and step == k.committed[-1],
            ))
            back = [d for d in r.digests if d["phase"] == "restored" and d["step"] == step
                    and d["time"] > k.t_kill]
            r.checks.append((
                f"loss {i + 1}: restored state equals the state saved at step {step}",
                bool(back) and saved.get(step) == back[0]["digest"],
            ))
            if k.worker is not None and self.in_process:
                self._check_worker_kill(r, i, k, nxt)

    def _check_worker_kill(self, r: ScenarioResult, i: int, k: KillRecord, nxt: float) -> None:
        """A worker kill under in-process recovery: the other workers kept their processes,
        and (``replace``) a new process took the dead rank's place at a snapshot, bitwise."""
        after = [e for e in r.events if k.t_kill < e["time"] < nxt]
        started = {e["pid"] for e in after if e["event"] == "start"}
        if self.on_worker_failure == "leave":
            node = k.node.split("/")[0]
            ours = {e["pid"] for e in r.events if e["event"] == "start" and e["_node"] == node}
            stayed = set(k.others) - ours
            r.checks.append((f"loss {i + 1}: the other nodes' processes went on in place "
                             f"(Manager starts after the kill by {sorted(started)}, kept {sorted(stayed)})",
                             bool(stayed) and started <= stayed))
            return
        r.checks.append((
            f"loss {i + 1}: the other ranks' processes went on in place (pids {k.others}; Manager "
            f"starts after the kill by {sorted(started)})",
            set(k.others) <= started and started <= {*k.others, k.replacement}))
        r.checks.append((f"loss {i + 1}: local rank {k.worker} (pid {k.victim}) was replaced by a new "
                         f"process ({k.replacement})", k.replacement is not None))
        joined = [e for e in after if e["event"] == "restore" and e.get("found")
                  and e["_pid"] == k.replacement]
        if not joined:
            r.checks.append((f"loss {i + 1}: the new process {k.replacement} restored a snapshot", False))
            return
        step, t = joined[0]["step"], joined[0]["time"]
        same = {e["_pid"] for e in after if e["event"] == "restore" and e.get("found")
                and e["step"] == step and abs(e["time"] - t) < 30}
        r.checks.append((f"loss {i + 1}: the new process joined at step {step} with every other rank "
                         f"({len(same)} processes restored it)",
                         same == {*k.others, k.replacement}))
        # the state saved at that step last before the join (a step may be trained twice: once
        # before a rollback, once after it)
        saved = [d["digest"] for d in r.digests if d["phase"] == "saved" and d["step"] == step
                 and d["time"] < t]
        back = [d["digest"] for d in r.digests if d["phase"] == "restored" and d["step"] == step
                and d["time"] > k.t_kill]
        r.checks.append((f"loss {i + 1}: the state restored at the join (step {step}) equals the state "
                         "saved at that step", bool(back) and bool(saved) and back[0] == saved[-1]))


HOLD_STEPS = 100_000  # the end while a joiner is awaited: out of reach
JOIN_WAIT_S = 120.0  # a liveness bound: a joiner ready later than this fails the checks
END_MARGIN_STEPS = 6


def write_end(path: Path, step: int) -> None:
    """The trainer's --end-file, replaced whole (a rank reads the old number or the new one)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(str(step))
    os.replace(tmp, path)


def _agents_reconnected(cluster: SimCluster) -> bool:
    """Every running agent logged that the rendezvous store was unreachable (each asks at every
    monitor interval) and, after that, that its client reconnected."""
    for n in cluster.alive_nodes():
        try:
            text = cluster.nodes[n].log.read_text(errors="replace")
        except OSError:
            return False
        if STORE_AWAY not in text or STORE_BACK not in text.rsplit(STORE_AWAY, 1)[1]:
            return False
    return True


def _worker_failed(log: Path) -> bool:
    """torchrun's agent logs every worker that exited non-zero ("failed (exitcode: N)")."""
    try:
        return "failed (exitcode:" in log.read_text(errors="replace")
    except OSError:
        return True


def main(argv: list[str] | None = None) -> int:
    """``python -m aegis.sim.scenario WORKDIR``: lose node-1 after step 6, replacement joins."""
    work = Path(argv[0] if argv else sys.argv[1] if len(sys.argv) > 1 else "/tmp/aegis-scenario")
    res = Scenario(work, [Kill(after_step=6, node="node-1")]).run()
    for what, ok in res.checks:
        print(f"[{'PASS' if ok else 'FAIL'}] {what}")
    return 0 if res.ok else 1


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
