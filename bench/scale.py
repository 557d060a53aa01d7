#!/usr/bin/env python
"""Costs against the world size (issue 24): each measured at growing member counts, fitted,
plotted log-log beside O(1), O(world) and O(world^2), and projected to 1,024 and 16,384 ranks.

Sections, each a function that returns its part of ``bench/results/scale.json`` (a section run
replaces only its own part; ``--render`` draws the plot and the benchmarks guide's block from whatever
sections the file holds):

``membership``  the in-process recovery membership protocol (``aegis/training/inprocess/
                membership.py``) with a real ``TCPStore`` server in its own process and members
                as threads of a few host processes (no model: they beat, watch, declare, fence,
                propose and agree exactly as ``run_in_process`` does). Per size: store requests
                per member per second at steady state (counted at every client), the store
                server's CPU, the time until every survivor has fenced a SIGKILLed node and a
                SIGSTOPped node, the time until every survivor has the next round's member list,
                and the requests each member spent to form it. The protocol before issue 24
                (read from git, ``--baseline-rev``) runs the steady state too, at small sizes.
``metadata``    per-step snapshot metadata with real gloo ranks (``bench/_scale_snapshot.py``),
                2 -> 32 ranks, 8 per simulated node, a model of many small tensors: bytes each
                node writes per step and once per plan, bytes the commit gathers and broadcasts,
                commit and planning time; format 4 beside the whole manifest of before.
``restore``     restore traffic after a world change: one rank per node, a node lost, the
                survivors reshard; per rank the bytes fetched from other nodes over the bytes
                its load read of them, 4 -> 32 ranks.
``relay``       the membership section's harness with every member beating through its node's
                heartbeat relay (issue 40): store requests and CPU, detection, agreement.
``parity_rebuild`` a lost node's shard rebuilt from its parity group (XOR of 5, RS 4+2):
                the bytes the rebuilding rank receives over the shard (issue 40), 5 -> 12 ranks.
``parity_metadata`` the metadata section with parity groups (XOR of 4, RS 4+2), one rank per
                node, 2 -> 32 ranks: format 4's step record with the node's own groups
                (issue 40) beside the whole format-3 manifest of before.
``store_cost``  the store server's CPU per heartbeat, direct and through a node's relay, on an
                idle store with a 16,384-rank job's keys (``bench/_scale_store.py``), and the
                cores the beats of 16,384 ranks need (issue 40).

Adding a section: a function ``section_<name>(args) -> dict`` with the keys of
:func:`section_membership`'s result (``series`` drive the plot and the projection, ``table`` and
``notes`` the benchmarks guide), registered in ``SECTIONS``.

    .venv/bin/python bench/scale.py --sections membership            # sizes 8 ... 4096
    .venv/bin/python bench/scale.py --sections membership --sizes 8,64,512
    .venv/bin/python bench/scale.py --sections metadata,restore
    .venv/bin/python bench/scale.py --render                         # plot + the guide's block only
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import multiprocessing as mp
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ForeignCpu, md_table, plt, python, text_table  # noqa: E402
from _machine import ROOT, describe, load1, machine  # noqa: E402
from _scale_snapshot import (  # noqa: E402
    rebuild_metadata,
    rebuild_parity_metadata,
    rebuild_parity_rebuild,
    rebuild_restore,
    section_metadata,
    section_parity_metadata,
    section_parity_rebuild,
    section_restore,
)
from _scale_store import section_store_cost  # noqa: E402

from aegis.goodput import fit_loglog, larger_half  # noqa: E402

OUT = ROOT / "bench" / "results" / "scale.json"
GUIDE = ROOT / "docs" / "guides" / "benchmarks.md"  # the guide that holds the scale block
BEGIN, END = "<!-- scale:begin -->", "<!-- scale:end -->"
PROJECT_TO = (1024, 16384)
RANKS_PER_NODE = 8
BASELINE_REV = "c24da38"  # membership.py before issue 24: every process reads every counter


# == membership ==================================================================================

STORE_MAIN = """
import sys
from datetime import timedelta
from torch.distributed import TCPStore
s = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=600))
print(s.port, flush=True)
sys.stdin.read()  # serve until the bench closes stdin
"""


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (its threads included)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            f = fh.read().rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


class _Member:
    """One process of the job as ``run_in_process`` drives it, without the model: a heartbeat
    (own client, own thread), a Membership (own client), a fence callback that ends the round."""

    def __init__(self, port: int, uid: str, p: dict[str, Any]) -> None:
        import torch.distributed as dist

        from aegis.training.inprocess.membership import CountingStore, Heartbeat, Membership
        from aegis.training.inprocess.storeclient import EPOCH

        def client() -> Any:
            return CountingStore(dist.TCPStore("127.0.0.1", port, is_master=False,
                                               wait_for_workers=False,
                                               timeout=timedelta(seconds=p["form_timeout"])))

        self.uid = uid
        self.r = -1
        self.members: list[str] = []
        self.in_round = False
        self.failed = threading.Event()
        self.fenced: dict[str, float] = {}  # "<round>|<uid>" -> time.time()
        self.hb_store = client()
        self.store = client()
        # the store's epoch, read at connect as run_in_process' StoreClient does (off the clock)
        self.store.epoch = self.store.compare_set(EPOCH, "", uuid.uuid4().hex).decode()
        # declarations armed once every member has the first round (see _Run.run)
        relay = None
        if p.get("relay_root"):  # the node heartbeat relay (issue 40): a node's members share one
            from aegis.training.inprocess.relay import NodeRelay

            relay = NodeRelay(p["relay_root"], uid.split("/")[0], uid, stale_s=2.5 * p["interval"])
        self.hb = Heartbeat(uid, p["interval"], timedelta(seconds=p["form_timeout"]),
                            dead_after_s=None, fence=self._fence,
                            fenceable=self._fenceable, store=self.hb_store,
                            start=not p["drivers"], relay=relay)
        self.m = Membership(self.store, uid, self.hb, dead_after_s=p["dead_after"],
                            form_timeout_s=p["form_timeout"], min_world=1, relay=relay)
        self.rounds: list[dict[str, Any]] = []
        self.excluded: float | None = None

    def _fenceable(self, u: str) -> bool:
        return self.in_round and u in self.members  # rare (a declared member): no set per round

    def _fence(self, u: str) -> int:
        self.fenced.setdefault(f"{self.r}|{u}", time.time())
        self.failed.set()  # the round's collectives fail (gloo: connections shut)
        return 0

    def enter(self, r: int, previous: list[str] | None, expected: int) -> None:
        self.in_round = False
        self.hb.round_ended()
        req0, t0 = self.store.requests, time.time()
        members, _ = self.m.form(r, previous, expected)
        agreed = time.time()
        self.members, self.r = members, r
        self.failed.clear()
        self.hb.follow(members, r)
        self.in_round = True
        self.rounds.append({"r": r, "entered_at": t0, "agreed_at": agreed,
                            "size": len(members), "requests": self.store.requests - req0,
                            "proposed": r in self.m.proposed})


class _OldMember:
    """A member of the protocol before issue 24 (its Heartbeat reads every member's counter)."""

    def __init__(self, old: Any, port: int, uid: str, p: dict[str, Any]) -> None:
        import torch.distributed as dist

        from aegis.training.inprocess.membership import CountingStore

        self.hb_store = CountingStore(dist.TCPStore(
            "127.0.0.1", port, is_master=False, wait_for_workers=False,
            timeout=timedelta(seconds=p["form_timeout"])))
        self.store = CountingStore(self.hb_store.store)  # unused: no formation measured
        with _OLD_LOCK:  # the old Heartbeat makes its client through this module function
            old.store_from_env = lambda timeout: self.hb_store
            self.hb = old.Heartbeat(uid, p["interval"], timedelta(seconds=p["form_timeout"]),
                                    fence_after_s=p["dead_after"], fence=lambda u: 0,
                                    fenceable=lambda u: False)
        self.uid = uid


_OLD_LOCK = threading.Lock()


def _load_old(rev: str) -> Any:
    src = subprocess.run(["git", "show", f"{rev}:aegis/training/inprocess/membership.py"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    path = Path(tempfile.mkdtemp(prefix="aegis-scale-")) / "old_membership.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("old_membership", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _host(conn: Any, spec: dict[str, Any]) -> None:
    """A host process: ``spec["uids"]`` members, driven by the bench over ``conn``."""
    threading.stack_size(256 << 10)
    from aegis.training.inprocess.membership import Excluded, RecoveryGaveUp

    p, port, uids = spec["params"], spec["port"], spec["uids"]
    send_lock = threading.Lock()

    def send(*msg: Any) -> None:
        with send_lock:
            conn.send(msg)

    def parallel(fn: Callable[[Any], Any], items: list[Any]) -> list[Any]:
        out: list[Any] = [None] * len(items)
        errors: list[BaseException] = []

        def run(i: int) -> None:
            try:
                out[i] = fn(items[i])
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(items))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return out

    # c10d looks the store's address up in reverse DNS at every connect; this sandbox's
    # resolver leaves one lookup in ~20 unanswered for 5 s: connect in parallel, off the clock
    t0 = time.time()
    if spec["baseline"]:
        old = _load_old(spec["baseline"])
        members: list[Any] = parallel(lambda u: _OldMember(old, port, u, p), uids)
    else:
        members = parallel(lambda u: _Member(port, u, p), uids)
    send("connected", time.time() - t0)
    done: dict[int, int] = {}
    done_lock = threading.Lock()
    stopping = threading.Event()

    def finished(r: int) -> None:
        with done_lock:
            done[r] = done.get(r, 0) + 1
            if done[r] == len(members):
                send("round", r, time.time())

    def loop(mem: _Member) -> None:
        try:
            mem.enter(0, None, spec["world"])
            finished(0)
            while True:
                mem.failed.wait()
                if stopping.is_set():
                    return
                try:
                    mem.enter(mem.r + 1, mem.members, spec["world"])
                except Excluded:
                    mem.excluded = time.time()
                    finished(-1)
                    return
                finished(mem.r)
        except RecoveryGaveUp as e:
            send("error", mem.uid, str(e)[:300])

    def drive(mine: list[Any]) -> None:
        """Beat ``mine`` in turn every interval, as each one's own heartbeat thread would (many
        threads of one process would queue for its GIL instead: a cost of the simulation)."""
        due = time.monotonic()
        while not stopping.is_set():
            for mem in mine:
                mem.hb.tick()
            due += p["interval"]
            now = time.monotonic()
            if due < now - p["interval"]:
                due = now
            stopping.wait(max(0.0, due - now))

    def monitor() -> None:  # a member back from SIGSTOP reads itself in the death log
        while not stopping.wait(0.1):
            for mem in members:
                if mem.in_round and mem.uid in mem.hb.declared():
                    mem.failed.set()

    while True:
        msg = conn.recv()
        if msg[0] == "go":
            if spec["baseline"]:
                for mem in members:
                    mem.hb.watch([u for u in spec["all"] if u != mem.uid])
                send("round", 0, time.time())
            else:
                for mem in members:
                    threading.Thread(target=loop, args=(mem,), daemon=True).start()
                threading.Thread(target=monitor, daemon=True).start()
            n = p["drivers"]
            if n and not spec["baseline"]:
                for k in range(n):
                    threading.Thread(target=drive, args=(members[k::n],), daemon=True).start()
        elif msg[0] == "arm":
            for mem in members:
                if not spec["baseline"]:
                    mem.hb.dead_after_s = p["dead_after"]
            send("armed", time.time())
        elif msg[0] == "snap":
            hb = [m.hb_store.requests for m in members]
            if spec["baseline"]:
                adds = sum(m.hb_store.counts.get("add", 0) for m in members)
                ticks = adds / max(1, len(spec["all"]))
                declared = 0
            else:
                ticks = sum(m.hb.ticks for m in members)
                declared = sum(len(m.hb.declarations) for m in members)
            send("snap", time.time(), hb, sum(m.store.requests for m in members), ticks, declared,
                 _cpu_s(os.getpid()))
        elif msg[0] == "report":
            send("report", [] if spec["baseline"] else [
                {"uid": m.uid, "rounds": m.rounds, "fenced": m.fenced, "excluded": m.excluded,
                 "declarations": m.hb.declarations} for m in members])
        elif msg[0] == "exit":
            stopping.set()
            for m in members:
                m.hb.stop()
                if not spec["baseline"]:
                    m.failed.set()
            send("bye")
            return


def _per_node(world: int) -> int:
    """8 ranks per node, fewer in the smallest worlds (4 nodes at least: a node killed, one
    frozen, two that survive)."""
    return min(RANKS_PER_NODE, max(1, world // 4))


class _Run:
    """One world size: a store server, host processes, the phases, the numbers."""

    def __init__(self, world: int, args: argparse.Namespace, ctx: Any, baseline: str | None,
                 relay: bool = False) -> None:
        self.world, self.args, self.ctx, self.baseline = world, args, ctx, baseline
        self.relay_root = tempfile.mkdtemp(prefix="aegis-scale-relay-", dir="/dev/shm") if relay else None
        self.per = _per_node(world)
        self.nodes = world // self.per
        self.uids = [f"node-{n:05d}/{lr}/{n * self.per + lr + 1}" for n in range(self.nodes)
                     for lr in range(self.per)]
        self.params = {"interval": args.interval, "dead_after": args.dead_after,
                       "form_timeout": args.form_timeout, "drivers": args.drivers,
                       "relay_root": self.relay_root}
        self.kill_node, self.stop_node = 1, self.nodes // 2 + 1
        groups: list[list[str]] = [[] for _ in range(max(1, min(args.hosts, self.nodes - 2)))]
        self.victims: dict[str, list[str]] = {}
        rest = 0
        for n in range(self.nodes):
            node = self.uids[n * self.per:(n + 1) * self.per]
            if not baseline and n == self.kill_node:
                self.victims["kill"] = node
            elif not baseline and n == self.stop_node:
                self.victims["stop"] = node
            else:
                groups[rest % len(groups)].extend(node)
                rest += 1
        self.host_uids = [g for g in groups if g] + [self.victims[k] for k in ("kill", "stop")
                                                    if k in self.victims]
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        self.inbox: list[list[tuple[Any, ...]]] = []

    # -- plumbing ------------------------------------------------------------------------------

    def _start(self) -> None:
        self.store = subprocess.Popen([sys.executable, "-c", STORE_MAIN], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True)
        assert self.store.stdout is not None
        self.port = int(self.store.stdout.readline())
        for uids in self.host_uids:
            parent, child = self.ctx.Pipe()
            spec = {"params": self.params, "port": self.port, "uids": uids, "world": self.world,
                    "baseline": self.baseline, "all": self.uids if self.baseline else []}
            proc = self.ctx.Process(target=_host, args=(child, spec), daemon=True)
            proc.start()
            self.procs.append(proc)
            self.conns.append(parent)
            self.inbox.append([])

    def _pump(self, i: int, timeout: float = 0.0) -> None:
        c = self.conns[i]
        with contextlib.suppress(EOFError, OSError):
            while c.poll(timeout):
                self.inbox[i].append(c.recv())
                timeout = 0.0

    def _wait(self, hosts: Sequence[int], kind: str, pred: Callable[[tuple[Any, ...]], bool],
              timeout: float) -> dict[int, tuple[Any, ...]]:
        deadline = time.monotonic() + timeout
        got: dict[int, tuple[Any, ...]] = {}
        while True:
            for i in hosts:
                if i in got:
                    continue
                self._pump(i)
                for m in self.inbox[i]:
                    if m[0] == "error":
                        raise RuntimeError(f"host {i}: {m[1]}: {m[2]}")
                    if m[0] == kind and pred(m):
                        got[i] = m
                        self.inbox[i].remove(m)
                        break
            if len(got) == len(hosts):
                return got
            if time.monotonic() > deadline:
                missing = [i for i in hosts if i not in got]
                raise TimeoutError(f"world {self.world}: no {kind!r} from hosts {missing} "
                                   f"within {timeout:.0f} s")
            time.sleep(0.005)

    def _ask(self, hosts: Sequence[int], *msg: Any, reply: str, timeout: float = 60.0
             ) -> dict[int, tuple[Any, ...]]:
        for i in hosts:
            self.conns[i].send(msg)
        return self._wait(hosts, reply, lambda m: True, timeout)

    def _stop(self) -> None:
        for i, p in enumerate(self.procs):
            if p.is_alive():
                with contextlib.suppress(Exception):
                    os.kill(p.pid, signal.SIGCONT)
                    self.conns[i].send(("exit",))
        deadline = time.monotonic() + 10
        for p in self.procs:
            p.join(max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(5)
        with contextlib.suppress(Exception):
            assert self.store.stdin is not None
            self.store.stdin.close()
            self.store.wait(10)
        if self.store.poll() is None:
            self.store.kill()

    # -- phases --------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        out: dict[str, Any] = {"world": self.world, "per_node": self.per, "nodes": self.nodes,
                               "hosts": len(self.host_uids), "load_start": load1(),
                               "protocol": f"before issue 24 ({self.baseline})" if self.baseline
                               else "node relay (issue 40)" if self.relay_root else "issue 24"}
        foreign = ForeignCpu()
        mark = foreign.mark()
        try:
            self._start()
            everyone = list(range(len(self.procs)))
            conn = self._wait(everyone, "connected", lambda m: True, 120 + self.world / 20)
            out["connect_s"] = max(m[1] for m in conn.values())
            t_go, cpu_go = time.time(), _cpu_s(self.store.pid)
            for i in everyone:
                self.conns[i].send(("go",))
            formed = self._wait(everyone, "round", lambda m: m[1] == 0, 60 + self.world / 10)
            out["first_round_s"] = max(m[2] for m in formed.values()) - t_go
            # the store's serial work in the first round (the members' beats during it included)
            out["first_round_store_cpu_s"] = _cpu_s(self.store.pid) - cpu_go
            if not self.baseline:
                rep = self._ask(everyone, "report", reply="report")
                first = [x["requests"] for i in everyone for m in rep[i][1]
                         for x in m["rounds"] if x["r"] == 0]
                out["first_round_requests"] = {"total": sum(first), "per_member": _stats(
                    [float(x) for x in first])}
            # a job's processes each parse the first round's list on a CPU of their own; here
            # thousands of members parse it at once on this machine's cores, which can hold their
            # beats back for a second: declarations are armed once that is over (after which every
            # false declaration counts against the size)
            time.sleep(self.args.warmup)
            self._ask(everyone, "arm", reply="armed")
            time.sleep(self.args.warmup)
            out["steady"] = self._steady(everyone)
            if not self.baseline:
                out["faults"] = self._faults(everyone)
                if "timeout" in out["faults"]:
                    out["error"] = f"{out['faults']['timeout']}; {_why(out['faults'])}"
                out["records"] = self._record_sizes()
        except Exception as e:  # noqa: BLE001 - recorded, the run goes on with other sizes
            out["error"] = f"{type(e).__name__}: {e}"[:500]
        finally:
            with contextlib.suppress(Exception):
                self._stop()
            if self.relay_root:
                shutil.rmtree(self.relay_root, ignore_errors=True)
            out["foreign"] = foreign.since(mark)
            foreign.close()
            out["load_end"] = load1()
        return out

    def _steady(self, hosts: list[int]) -> dict[str, Any]:
        cpu0, a = _cpu_s(self.store.pid), self._ask(hosts, "snap", reply="snap")
        time.sleep(self.args.steady)
        cpu1, b = _cpu_s(self.store.pid), self._ask(hosts, "snap", reply="snap")
        dt = max(b[i][1] for i in hosts) - min(a[i][1] for i in hosts)
        per_member = [(y - x) / dt for i in hosts for x, y in zip(a[i][2], b[i][2], strict=True)]
        hb = sum(per_member)
        mem = sum(b[i][3] - a[i][3] for i in hosts) / dt
        ticks = sum(b[i][4] - a[i][4] for i in hosts) / dt / self.world
        declared = sum(b[i][5] for i in hosts)
        host_cpu = sum(b[i][6] - a[i][6] for i in hosts) / dt
        want = 1.0 / self.args.interval
        return {"seconds": dt, "requests_per_member_s": (hb + mem) / self.world,
                "heartbeat_requests_per_member_s": hb / self.world,
                "min_member_requests_s": min(per_member), "max_member_requests_s": max(per_member),
                "total_requests_s": hb + mem, "beats_per_member_s": ticks,
                "beats_wanted_s": want, "kept_up": ticks >= 0.9 * want and declared == 0,
                "declarations_before_faults": declared,
                "false_declarations": declared, "store_cpu": (cpu1 - cpu0) / dt,
                "members_cpu": host_cpu, "requests_per_beat": (hb + mem) / self.world / ticks
                if ticks else None,
                "store_cpu_us_per_request": (cpu1 - cpu0) / dt / (hb + mem) * 1e6}

    def _faults(self, everyone: list[int]) -> dict[str, Any]:
        kill_host = len(self.procs) - 2
        stop_host = len(self.procs) - 1
        survivors = [i for i in everyone if i not in (kill_host, stop_host)]
        out: dict[str, Any] = {}
        limit = self.args.dead_after + 30 + self.world / 50
        t_kill = time.time()
        os.kill(self.procs[kill_host].pid, signal.SIGKILL)
        out["kill"] = {"t": t_kill}
        try:
            got = self._wait(survivors + [stop_host], "round", lambda m: m[1] == 1, limit)
            out["kill"]["hosts_done"] = max(m[2] for m in got.values()) - t_kill
            time.sleep(self.args.warmup)
            t_stop = time.time()
            os.kill(self.procs[stop_host].pid, signal.SIGSTOP)
            out["stop"] = {"t": t_stop}
            got = self._wait(survivors, "round", lambda m: m[1] == 2, limit)
            out["stop"]["hosts_done"] = max(m[2] for m in got.values()) - t_stop
            t_cont = time.time()
            os.kill(self.procs[stop_host].pid, signal.SIGCONT)
            with contextlib.suppress(TimeoutError):
                got = self._wait([stop_host], "round", lambda m: m[1] == -1, 30)
                out["stop"]["thawed_excluded_s"] = got[stop_host][2] - t_cont
        except TimeoutError as e:  # what the members saw says why
            out["timeout"] = str(e)
            os.kill(self.procs[stop_host].pid, signal.SIGCONT)
        reports = self._ask(survivors + [stop_host], "report", reply="report", timeout=120)
        rows = [m for i in survivors for m in reports[i][1]]
        frozen = reports[stop_host][1]  # they survived the kill
        out["kill"].update(_fault_numbers(rows + frozen, self.victims["kill"], 1, out["kill"]["t"]))
        if "stop" in out:
            out["stop"].update(_fault_numbers(rows, self.victims["stop"], 2, out["stop"]["t"]))

        return out

    def _record_sizes(self) -> dict[str, Any]:
        import torch.distributed as dist

        c = dist.TCPStore("127.0.0.1", self.port, is_master=False, wait_for_workers=False,
                          timeout=timedelta(seconds=30))
        return {f"round_{r}_bytes": len(c.get(f"aegis/round/{r}/members")) for r in (0, 1, 2)
                if c.check([f"aegis/round/{r}/members"])}


def _why(faults: dict[str, Any]) -> str:
    k = faults.get("stop") if "stop" in faults else faults["kill"]
    return (f"{k['agreed']} of {k['survivors']} survivors agreed, {k['excluded']} excluded, "
            f"{k['false_declarations']} false declarations after the fault (a member's beats held "
            "back past dead_after_s)")


def _stats(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    if not xs:
        return {}
    return {"max": xs[-1], "median": xs[len(xs) // 2], "min": xs[0]}


def _fault_numbers(rows: list[dict[str, Any]], victims: list[str], r: int, t: float) -> dict[str, Any]:
    """From the survivors' records: when each had fenced every victim, when the first victim was
    declared (by whom), when each had round ``r`` agreed, and what forming it cost each."""
    running = r - 1
    fenced = []  # when each survivor fenced a member of the lost node: its round ended there
    for m in rows:
        ts = [x for v in victims if (x := m["fenced"].get(f"{running}|{v}")) is not None]
        if ts:
            fenced.append(min(ts))
    declared = [d[2] for m in rows for d in m["declarations"] if d[0] in victims]
    declarers = [m["uid"] for m in rows if any(d[0] in victims for d in m["declarations"])]
    agreed = [x for m in rows for x in m["rounds"] if x["r"] == r]
    sizes = {x["size"] for x in agreed}
    proposer = [x["requests"] for x in agreed if x["proposed"]]
    others = [x["requests"] for x in agreed if not x["proposed"]]
    last_agreed = max(x["agreed_at"] for x in agreed) if agreed else t + 60.0
    # within this fault's recovery: from the signal until every survivor has the next round
    false = [d for m in rows for d in m["declarations"]
             if d[0] not in victims and t <= d[2] <= last_agreed]
    excluded = [m for m in rows if m["excluded"] is not None and t <= m["excluded"] <= last_agreed + 5]
    first_declared = min(declared) if declared else float("nan")
    return {
        "survivors": len(rows), "fenced": len(fenced), "agreed": len(agreed),
        "form_requests_total": sum(x["requests"] for x in agreed),
        "excluded": len(excluded),
        "false_declarations": len(false),
        "round_sizes": sorted(sizes),
        "declared_first_s": first_declared - t, "declarers": len(declarers),
        "detect_s": _stats([x - t for x in fenced]),
        "agree_s": _stats([x["agreed_at"] - t for x in agreed]),
        "published_to_agreed_s": last_agreed - first_declared,
        "published_to_all_learnt_s": max(fenced) - first_declared if fenced else None,
        "last_entered_to_agreed_s": last_agreed - max(x["entered_at"] for x in agreed)
        if agreed else None,
        "last_fenced_to_agreed_s": last_agreed - max(fenced) if fenced else None,
        "form_requests": {"proposer": proposer, "others": _stats([float(x) for x in others]),
                          "others_mean": sum(others) / len(others) if others else None},
    }


# For the bench's own processes (set before its fork server and store server start): c10d looks
# the store's address up in reverse DNS at every connect, and this sandbox's resolver leaves
# lookups unanswered for 5 s (1,024 connects took 105 s; connects happen before any clock starts);
# c10d's warnings (a failed lookup, a wait slice that ran out) would be one line per member.
CHILD_ENV = {"RES_OPTIONS": "timeout:1 attempts:1", "TORCH_CPP_LOG_LEVEL": "ERROR"}


def _member_ctx() -> Any:
    os.environ.update(CHILD_ENV)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch.distributed", "aegis.training.inprocess.membership"])
    return ctx


def _grow(args: argparse.Namespace, ctx: Any, sizes: str, what: str, *, relay: bool = False
          ) -> tuple[list[dict[str, Any]], str | None]:
    """One run per member count, up to the first this machine cannot simulate: (runs, why
    it stopped or None)."""
    runs: list[dict[str, Any]] = []
    for w in [int(x) for x in sizes.split(",")]:
        print(f"{what}: {w} members ...", flush=True)
        res = _Run(w, args, ctx, None, relay=relay).run()
        runs.append(res)
        _print_run(res)
        why = _limited(res)
        if why:
            stopped = f"stopped after {w} members: {why}"
            print(stopped, flush=True)
            return runs, stopped
    return runs, None


def _stopped(runs: list[dict[str, Any]]) -> str | None:
    why = next(((r["world"], w) for r in runs if (w := _limited(r))), None)
    return f"stopped after {why[0]} members: {why[1]}" if why else None


def _stored_args(p: dict[str, Any]) -> argparse.Namespace:
    return argparse.Namespace(interval=p["interval_s"], dead_after=p["dead_after_s"],
                              steady=p["steady_s"], hosts=p["hosts"], drivers=p["drivers"],
                              baseline_rev=p["baseline_rev"])


def section_membership(args: argparse.Namespace) -> dict[str, Any]:
    ctx = _member_ctx()
    base_sizes = [int(x) for x in args.baseline_sizes.split(",")] if args.baseline_sizes else []
    runs, stopped = _grow(args, ctx, args.sizes, "membership")
    base: list[dict[str, Any]] = []
    for w in base_sizes:
        print(f"membership, protocol before issue 24: {w} members ...", flush=True)
        res = _Run(w, args, ctx, args.baseline_rev).run()
        base.append(res)
        _print_run(res)
        if "error" in res or not res["steady"]["kept_up"]:
            break
    return _membership_result(args, runs, base, stopped)


def section_relay(args: argparse.Namespace) -> dict[str, Any]:
    """The membership section's harness with every member beating through its node's relay
    (issue 40, ``aegis/training/inprocess/relay.py``): the same phases and numbers, and what
    one process computes in a first round of 16,384 (measured at that size)."""
    work = _first_round_work(PROJECT_TO[-1])
    runs, stopped = _grow(args, _member_ctx(), args.relay_sizes, "relay", relay=True)
    out = _membership_result(args, runs, [], stopped, label="node relay (issue 40)")
    out["first_round_work"] = work
    return _relay_result(out)


class _DictStore:
    """The few store operations a proposer and a member make in a first round, on a dict: the
    processes' own work, timed without a store."""

    def __init__(self) -> None:
        self.kv: dict[str, bytes] = {}

    def get(self, key: str) -> bytes:
        return self.kv[key]

    def set(self, key: str, value: str | bytes) -> None:
        self.kv[key] = value.encode() if isinstance(value, str) else value

    def compare_set(self, key: str, expected: str, desired: str | bytes) -> bytes:
        if self.kv.get(key, b"") == expected.encode():
            self.set(key, desired)
        return self.kv[key]

    def add(self, key: str, n: int) -> int:
        self.kv[key] = str(int(self.kv.get(key, b"0")) + n).encode()
        return int(self.kv[key])


def _first_round_work(n: int, repeats: int = 5) -> dict[str, Any]:
    """One process's own work in a first round of ``n`` members (8 per node), the real code on
    a :class:`_DictStore`, best of ``repeats``: the proposer reads the join log and writes the
    record (``Membership._joined`` + ``_write``); a member decodes the record and finds its ring
    successors (``_read`` + ``successors``, the ring not cached)."""
    import json as _json
    import random

    from aegis.training.inprocess.heartbeat import _ring, successors
    from aegis.training.inprocess.layout import _natural
    from aegis.training.inprocess.membership import Membership

    rnd = random.Random(40)
    uids = [f"node-{k // 8:05d}/{k % 8}/{rnd.randrange(1000, 4_000_000)}" for k in range(n)]
    rnd.shuffle(uids)  # joined in no order
    log = "".join(_json.dumps({"u": u, "j": 0}) + "\n" for u in uids).encode()
    best = {"proposer_s": math.inf, "member_s": math.inf}
    size = 0
    for _ in range(repeats):
        st = _DictStore()
        st.kv["aegis/round/0/joined"] = log
        m = Membership(st, uids[0], None, dead_after_s=1.0,  # type: ignore[arg-type]
                       form_timeout_s=60.0, min_world=1)
        _natural.cache_clear()  # cold, as a proposer's one sort is
        t0 = time.perf_counter()
        m._write(0, None, m._joined(0))
        t1 = time.perf_counter()
        _ring.cache_clear()
        members = m._read(0)[0]
        successors(members, uids[-1], 2)
        t2 = time.perf_counter()
        assert len(members) == n
        size = len(st.kv["aegis/round/0/members"])
        best = {"proposer_s": min(best["proposer_s"], t1 - t0),
                "member_s": min(best["member_s"], t2 - t1)}
    return {"members": n, "record_bytes": size, "json_bytes": len(_json.dumps(sorted(uids))), **best}


def _first_round_model(out: dict[str, Any]) -> dict[str, Any] | None:
    """The first round at 16,384 members as a job runs it: the store's serial work (its CPU in
    the first round per member at the largest size that kept up, times 16,384: the round's
    requests are O(world), ~4 per member, and with the relay its bytes O(world) too), one
    proposer's and one member's own work (measured at that size: each process has a CPU of its
    own in a job, where the simulation runs thousands on 2 cores), and the protocol's round
    trips (the smallest size's first round)."""
    work = out.get("first_round_work")
    good = [r for r in out["runs"] if _ok(r) and r["steady"]["kept_up"]
            and r.get("first_round_store_cpu_s") is not None]
    if not work or not good:
        return None
    big = max(good, key=lambda r: r["world"])
    n = work["members"]
    store_s = big["first_round_store_cpu_s"] / big["world"] * n
    trips_s = min(good, key=lambda r: r["world"])["first_round_s"]
    total = store_s + work["proposer_s"] + work["member_s"] + trips_s
    return {"members": n, "store_cpu_s": store_s, "store_cpu_from": big["world"],
            "store_cpu_at_from_s": big["first_round_store_cpu_s"],
            "store_requests_per_member": big["first_round_requests"]["total"] / big["world"],
            "proposer_s": work["proposer_s"], "member_s": work["member_s"],
            "round_trips_s": trips_s, "total_s": total}


def _relay_result(out: dict[str, Any]) -> dict[str, Any]:
    out["title"] = "Membership with the node heartbeat relay (issue 40)"
    out["series"] = [x for x in out["series"] if not str(x["label"]).startswith("before")]
    out["notes"].append(
        "With the relay each member also writes its post and reads the relay's output every beat "
        "(0.25 ms of CPU a beat against 0.18 ms beating directly, 4 heartbeats ticked 500 times "
        "in one process, a one-off measurement): thousands of members as threads on this "
        "machine's 2 cores run out of CPU sooner than beating directly, which is where the sizes "
        "stop here; in a job each process has a CPU of its own.")
    model = _first_round_model(out)
    if model:
        out["first_round_model"] = model
        w = out["first_round_work"]
        out["notes"].append(
            f"First round at {model['members']:,} members, as a job runs it: the store's serial work "
            f"{model['store_cpu_s']:.2f} s (its CPU in the first round, {model['store_cpu_at_from_s']:.2f} s "
            f"at {model['store_cpu_from']:,} members with the members' beats meanwhile, "
            f"{model['store_requests_per_member']:.1f} requests per member, scaled linearly: the "
            "round's requests and, read once per node, its bytes are O(world); the CPU is read in "
            "10 ms ticks) + the proposer's own work "
            f"{model['proposer_s']:.3f} s + a member's {model['member_s']:.3f} s "
            f"(both measured at {model['members']:,}: the join log read, the record "
            f"{w['record_bytes']:,} B compressed from {w['json_bytes']:,} B of JSON written; the "
            f"record read, decoded and the ring found) + the protocol's round trips "
            f"{model['round_trips_s']:.2f} s (the smallest size's first round) = "
            f"{model['total_s']:.2f} s. The simulation's own first round (its panel) runs every "
            "member's wake-up and decoding on this machine's 2 cores at once, so it grows with the "
            "world where a job's does not.")
    return out


def _form_total(k: dict[str, Any]) -> float:
    """Requests all survivors made to form the round (counted; runs recorded before the total
    was: the members' mean times their number, plus the proposer's)."""
    if "form_requests_total" in k:
        return float(k["form_requests_total"])
    fr = k["form_requests"]
    return fr["others_mean"] * (k["agreed"] - len(fr["proposer"])) + sum(fr["proposer"])


def _limited(res: dict[str, Any]) -> str | None:
    """Why this size is past what this machine can simulate (None: it is not)."""
    s = res.get("steady")
    if s and not s["kept_up"]:
        return (f"this machine did not keep up in the steady state ({s['beats_per_member_s']:.2f} "
                f"beats per member per second of {s['beats_wanted_s']:.0f} wanted, "
                f"{s['false_declarations']} false declarations)"
                + (f"; then {res['error']}" if "error" in res else ""))
    if "error" in res:
        return str(res["error"])
    false = {k: f.get("false_declarations", 0) for k, f in res.get("faults", {}).items()
             if isinstance(f, dict)}
    if any(false.values()):
        return ("the survivors' recovery held members' beats back past dead_after_s on this "
                f"machine (false declarations while recovering: {false}); its recovery numbers "
                "are shown but not fitted")
    return None


def _ok(r: dict[str, Any]) -> bool:
    return "error" not in r and "steady" in r


def _membership_result(args: argparse.Namespace, runs: list[dict[str, Any]],
                       base: list[dict[str, Any]], stopped: str | None,
                       label: str = "issue 24") -> dict[str, Any]:
    good = [r for r in runs if _ok(r) and r["steady"]["kept_up"]]
    faults = [r for r in good if "faults" in r and all(
        "max" in r["faults"].get(k, {}).get("detect_s", {}) for k in ("kill", "stop"))]
    clean = [not _limited(r) for r in faults]
    bgood = [r for r in base if _ok(r)]

    def xs(rs: list[dict[str, Any]]) -> list[int]:
        return [r["world"] for r in rs]

    series = [
        {"panel": "store requests per member per second (steady)", "label": label,
         "x": xs(good), "y": [r["steady"]["requests_per_member_s"] for r in good],
         "unit": "req/s", "project": True, "per": "per process"},
        {"panel": "store requests per member per second (steady)",
         "label": f"before ({args.baseline_rev})", "x": xs(bgood),
         "y": [r["steady"]["requests_per_member_s"] for r in bgood], "unit": "req/s",
         "project": True, "per": "per process", "limited": [not r["steady"]["kept_up"] for r in bgood]},
        {"panel": "store requests per second, all members (steady)", "label": label,
         "x": xs(good), "y": [r["steady"]["total_requests_s"] for r in good], "unit": "req/s",
         "project": True, "per": "total"},
        {"panel": "store requests per second, all members (steady)",
         "label": f"before ({args.baseline_rev})", "x": xs(bgood),
         "y": [r["steady"]["total_requests_s"] for r in bgood], "unit": "req/s", "project": True,
         "per": "total", "limited": [not r["steady"]["kept_up"] for r in bgood]},
        {"panel": "store server CPU (steady, cores)", "label": label, "x": xs(good),
         "y": [r["steady"]["store_cpu"] for r in good], "unit": "cores", "project": True,
         "per": "total"},
        {"panel": "fault -> every survivor fenced it (s)", "label": "SIGKILL of a node",
         "x": xs(faults), "limited": [not c for c in clean],
         "y": [r["faults"]["kill"]["detect_s"]["max"] for r in faults],
         "unit": "s", "project": True, "per": "per failure", "bound": args.dead_after + 1.0},
        {"panel": "fault -> every survivor fenced it (s)", "label": "SIGSTOP of a node",
         "x": xs(faults), "limited": [not c for c in clean],
         "y": [r["faults"]["stop"]["detect_s"]["max"] for r in faults],
         "unit": "s", "project": True, "per": "per failure", "bound": args.dead_after + 1.0},
        {"panel": "loss published -> every survivor has the next round (s)",
         "label": "after the SIGKILL", "x": xs(faults), "limited": [not c for c in clean],
         "y": [r["faults"]["kill"]["published_to_agreed_s"] for r in faults], "unit": "s",
         "project": True, "per": "per failure", "bound": 1.0},
        {"panel": "loss published -> every survivor has the next round (s)",
         "label": "after the SIGSTOP", "x": xs(faults), "limited": [not c for c in clean],
         "y": [r["faults"]["stop"]["published_to_agreed_s"] for r in faults], "unit": "s",
         "project": True, "per": "per failure", "bound": 1.0},
        {"panel": "store requests to form the next round, all members",
         "label": "after the SIGKILL", "x": xs(faults), "limited": [not c for c in clean],
         "y": [_form_total(r["faults"]["kill"]) for r in faults], "unit": "requests",
         "project": True, "per": "total per failure"},
        {"panel": "store requests per member to form the next round", "label": "members",
         "x": xs(faults), "limited": [not c for c in clean],
         "y": [r["faults"]["kill"]["form_requests"]["others_mean"] for r in faults],
         "unit": "requests", "project": True, "per": "per process per failure"},
        {"panel": "store requests per member to form the next round", "label": "the proposer",
         "x": xs(faults), "limited": [not c for c in clean],
         "y": [max(r["faults"]["kill"]["form_requests"]["proposer"] or [0]) for r in faults],
         "unit": "requests", "project": True, "per": "one process per failure"},
        {"panel": "first round: every member has the list (s)", "label": label,
         "x": xs(good), "y": [r["first_round_s"] for r in good], "unit": "s", "project": True,
         "per": "once per job"},
    ]
    cpu = [r for r in good if r.get("first_round_store_cpu_s") is not None]
    if cpu:  # runs recorded before issue 40's first-round change did not measure it
        series.append({"panel": "first round: the store's CPU (s)", "label": label, "x": xs(cpu),
                       "y": [max(1e-3, r["first_round_store_cpu_s"]) for r in cpu], "unit": "s",
                       # read in 10 ms ticks: not fitted; the relay section's note scales the
                       # largest size's linearly (its requests are O(world))
                       "project": False, "per": "once per job"})
    rows = []
    for r in runs:
        s, fk = r.get("steady", {}), r.get("faults", {})
        k, st = fk.get("kill", {}), fk.get("stop", {})
        rows.append([
            str(r["world"]), f"{r['nodes']}x{r['per_node']}",
            _f(s.get("requests_per_member_s")), _f(s.get("requests_per_beat")),
            _f(s.get("beats_per_member_s")),
            _f(s.get("total_requests_s"), ".0f"), _f(s.get("store_cpu")),
            _f(k.get("detect_s", {}).get("max")), _f(st.get("detect_s", {}).get("max")),
            _f(k.get("published_to_agreed_s")), _f(st.get("published_to_agreed_s")),
            _f(k.get("form_requests", {}).get("others_mean"), ".1f"),
            _f(r.get("first_round_s")),
            f"{r['load_start']:.1f}->{r['load_end']:.1f}",
            r.get("error", "") or ("" if s.get("kept_up") else "machine did not keep up")])
    for r in base:
        s = r.get("steady", {})
        rows.append([f"{r['world']} (before)", f"{r['nodes']}x{r['per_node']}",
                     _f(s.get("requests_per_member_s")), _f(s.get("requests_per_beat")),
                     _f(s.get("beats_per_member_s")), _f(s.get("total_requests_s"), ".0f"),
                     _f(s.get("store_cpu")), "", "", "", "", "", "",
                     f"{r['load_start']:.1f}->{r['load_end']:.1f}",
                     r.get("error", "") or ("" if s.get("kept_up") else "machine did not keep up")])
    headers = ["members", "nodes", "req/s per member", "req per beat", "beats/s per member",
               "req/s total", "store CPU (cores)", "kill: all fenced (s)", "stop: all fenced (s)",
               "kill: published -> agreed (s)", "stop: published -> agreed (s)",
               "req to form (member)", "first round (s)", "load", "note"]
    largest = max((r["world"] for r in good), default=0)
    big = [r for r in good if r["world"] >= 512]
    per_req = (sum(r["steady"]["store_cpu"] for r in big)
               / sum(r["steady"]["total_requests_s"] for r in big) * 1e6) if big else None
    # requests per member per beat at those sizes: 2 beating directly, 2 per node with the relay
    rpb = (sum(r["steady"]["requests_per_beat"] for r in big) / len(big)) if big else 2.0
    notes = [
        f"Heartbeat every {args.interval:g} s, dead after {args.dead_after:g} s (run_in_process' "
        f"defaults); {args.steady:g} s of steady state per size; a store server process of its own "
        "(libuv TCPStore), members as threads of host processes, each with two clients of its "
        "own (heartbeat, membership), so the server sees one connection per client as in a job.",
        "Requests are counted at every client (each request waits for its reply). 'all fenced': "
        "from the signal until the last survivor's fence callback ran for a member of the lost "
        "node, which ends its round (the bound is dead_after + 1 s); 'published -> agreed': "
        "from the first death record in the store until the last survivor has the next round's "
        "member list.",
        "What grows with the world in a recovery here is partly the simulation: every member's "
        "own O(1) work (read the record, apply the change, recompute its ring) runs on this "
        "machine's 2 cores, where a job runs it on one CPU per process. What stays serial in a "
        "job is the store's work: the requests counted per recovery (5 per member, and the "
        "proposer's) times its CPU per request (next note).",
        (f"The store server spent {per_req:.1f} us of CPU per request at steady state (512 "
         "members and up; this machine, a gVisor sandbox): the heartbeats of 16,384 ranks at "
         f"0.2 s ({rpb:.2f} requests per member per beat, as measured) would need "
         f"{per_req * 1e-6 * rpb * 16384 / 0.2:.2f} cores of it; a recovery's 5 requests per member, "
         f"{per_req * 1e-6 * 5 * 16384:.2f} s of its serial work at 16,384."
         if per_req else "No size of 512 members or more kept up."),
        "The 1-minute load average counts the bench's own threads (thousands of members); "
        "other people's work on the machine is the 'other processes used' figure above.",
        "Declarations are armed once every member has the first round (its list is parsed by "
        "thousands of members at once on this machine's cores, where a job's processes each "
        "parse it on their own CPU); from then on a false declaration fails the size.",
        f"Largest size that kept up: {largest} members. "
        + (stopped or "Every size asked for kept up."),
    ]
    return {"title": "Membership (in-process recovery) against the member count",
            "env": CHILD_ENV,
            "params": {"interval_s": args.interval, "dead_after_s": args.dead_after,
                       "steady_s": args.steady, "hosts": args.hosts, "drivers": args.drivers,
                       "baseline_rev": args.baseline_rev},
            "runs": runs, "baseline": base, "stopped": stopped, "largest_kept_up": largest,
            "series": series, "table": {"headers": headers, "rows": rows}, "notes": notes}


def _f(x: Any, spec: str = ".2f") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return format(x, spec)


def _print_run(r: dict[str, Any]) -> None:
    s = r.get("steady", {})
    line = (f"  {r['world']:>5} members ({r['protocol']}): "
            f"{_f(s.get('requests_per_member_s'))} req/s per member, "
            f"{_f(s.get('beats_per_member_s'))} beats/s, "
            f"total {_f(s.get('total_requests_s'), '.0f')} req/s, "
            f"store CPU {_f(s.get('store_cpu'))}, first round {_f(r.get('first_round_s'))} s")
    for kind in ("kill", "stop"):
        k = r.get("faults", {}).get(kind)
        if k and "detect_s" in k:
            line += (f"\n        {kind}: all fenced {_f(k['detect_s'].get('max'))} s, published -> "
                     f"agreed {_f(k['published_to_agreed_s'])} s, form req/member "
                     f"{_f(k['form_requests']['others_mean'], '.1f')}, sizes {k['round_sizes']}")
    if "error" in r:
        line += f"\n        error: {r['error']}"
    print(line, flush=True)


SECTIONS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "membership": section_membership,
    "metadata": section_metadata,
    "restore": section_restore,
    "parity_rebuild": section_parity_rebuild,
    "relay": section_relay,
    "parity_metadata": section_parity_metadata,
    "store_cost": section_store_cost,
}


def _rebuild_membership(sec: dict[str, Any]) -> dict[str, Any]:
    return _membership_result(_stored_args(sec["params"]), sec["runs"], sec["baseline"],
                              _stopped(sec["runs"]))


def _rebuild_relay(sec: dict[str, Any]) -> dict[str, Any]:
    out = _membership_result(_stored_args(sec["params"]), sec["runs"], [], _stopped(sec["runs"]),
                             label="node relay (issue 40)")
    if "first_round_work" in sec:
        out["first_round_work"] = sec["first_round_work"]
    return _relay_result(out)


# sections whose derived parts (series, table, notes) can be rebuilt from their stored runs
REBUILD: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "membership": _rebuild_membership,
    "metadata": rebuild_metadata,
    "restore": rebuild_restore,
    "parity_rebuild": rebuild_parity_rebuild,
    "relay": _rebuild_relay,
    "parity_metadata": rebuild_parity_metadata,
}


# == fits, plot, guide block =======================================================================

def growth(b: float) -> str:
    for exp, name in ((0, "O(1)"), (1, "O(world)"), (2, "O(world^2)")):
        if abs(b - exp) <= 0.3:
            return name
    return f"O(world^{b:.2f})"


def _usable(s: dict[str, Any]) -> tuple[list[float], list[float]]:
    limited = s.get("limited") or [False] * len(s["x"])
    pts = [(x, y) for x, y, lim in zip(s["x"], s["y"], limited, strict=True)
           if y is not None and not lim]
    return [p[0] for p in pts], [p[1] for p in pts]


def projections(doc: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for name, sec in doc.get("sections", {}).items():
        for s in sec.get("series", []):
            if not s.get("project"):
                continue
            x, y = _usable(s)
            ab = fit_loglog(*larger_half(x, y))
            if ab is None:
                continue
            a, b = ab
            out.append({"section": name, "panel": s["panel"], "label": s["label"], "per": s["per"],
                        "unit": s["unit"], "exponent": b, "growth": growth(b),
                        "measured_to": max(x), "at_largest": y[x.index(max(x))],
                        **{str(w): math.exp(a) * w ** b for w in PROJECT_TO}})
    return out


def render(doc: dict[str, Any], out: Path = OUT) -> None:
    """The plot (``out`` with .png) and, for the committed results, the benchmarks guide's block, from every
    section in ``doc``."""
    png = out.with_suffix(".png")
    panels: dict[str, list[dict[str, Any]]] = {}
    for sec in doc.get("sections", {}).values():
        for s in sec.get("series", []):
            if s["x"]:
                panels.setdefault(s["panel"], []).append(s)
    if panels:
        pyplot = plt()
        n = len(panels)
        cols = 3 if n > 4 else 2
        rows = math.ceil(n / cols)
        fig, axes = pyplot.subplots(rows, cols, figsize=(5.2 * cols, 3.9 * rows), squeeze=False)
        for ax, (title, ss) in zip(axes.flat, panels.items(), strict=False):
            xs_all = [x for s in ss for x in s["x"]]
            lo, hi = min(xs_all), max(max(xs_all), PROJECT_TO[-1])
            for s in ss:
                x, y = _usable(s)
                lim = [(a, b) for a, b, li in zip(s["x"], s["y"], s.get("limited") or
                                                   [False] * len(s["x"]), strict=True) if li and b]
                line = ax.plot(x, y, "o-", label=s["label"])[0]
                if lim:
                    ax.plot([p[0] for p in lim], [p[1] for p in lim], "x", color=line.get_color(),
                            label=f"{s['label']}: machine did not keep up")
                ab = fit_loglog(*larger_half(x, y))
                if ab is not None:
                    a, b = ab
                    grid = [lo, hi]
                    ax.plot(grid, [math.exp(a) * g ** b for g in grid], ":",
                            color=line.get_color(), alpha=0.7)
                if s.get("bound"):
                    ax.axhline(s["bound"], color="red", lw=0.8, ls="--")
            first = ss[0]
            x0, y0 = next(((a, b) for a, b in zip(first["x"], first["y"], strict=True) if b),
                          (None, None))
            if x0 is not None and y0:
                for exp, style, name in ((0, "-", "O(1)"), (1, "--", "O(world)"),
                                         (2, "-.", "O(world^2)")):
                    ax.plot([lo, hi], [y0 * (lo / x0) ** exp, y0 * (hi / x0) ** exp], style,
                            color="gray", lw=0.7, alpha=0.6, label=name)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(title, fontsize=9)
            ax.set_xlabel("members (ranks)", fontsize=8)
            ax.legend(fontsize=6)
            ax.grid(True, which="both", alpha=0.2)
        for ax in list(axes.flat)[n:]:
            ax.axis("off")
        fig.suptitle("bench/scale.py: measured (points), fitted (dotted), projected to 16K ranks",
                     fontsize=10)
        fig.tight_layout()
        png.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(png, dpi=110)
        pyplot.close(fig)
        print(f"wrote {png}")
    if out.resolve() == OUT.resolve():
        _readme(doc)


def _markdown(doc: dict[str, Any]) -> str:
    lines: list[str] = []
    for name, sec in doc.get("sections", {}).items():
        lines += [f"**{sec.get('title', name)}** (section `{name}`): `{sec['command']}` "
                  f"({sec['created']}, {sec['wall_s'] / 60:.1f} min, {describe(sec['machine'])}; "
                  f"1-minute load average {sec['load_start']:.1f} at the start, "
                  f"{sec['load_end']:.1f} at the end"
                  + (f", other processes used {sec['foreign_cpus']:.2f} cores on average"
                     if sec.get("foreign_cpus") is not None else "") + ").", ""]
        t = sec.get("table")
        if t:
            lines += [md_table(t["headers"], t["rows"]), ""]
        lines += [f"- {n}" for n in sec.get("notes", [])] + [""]
    proj = projections(doc)
    if proj:
        lines += ["Projection from the fitted growth (exponent of a least-squares fit on the "
                  "log-log points of the larger half of the sizes measured, points the machine "
                  f"limited left out; {RANKS_PER_NODE} ranks per node):", ""]
        lines.append(md_table(
            ["cost", "", "per", "fitted growth", "measured up to", "at the largest",
             *[f"{w:,} ranks" for w in PROJECT_TO]],
            [[p["panel"], p["label"], p["per"], f"{p['growth']} (exponent {p['exponent']:.2f})",
              f"{p['measured_to']:,}", _g(p["at_largest"], p["unit"]),
              *[_g(p[str(w)], p["unit"]) for w in PROJECT_TO]] for p in proj]))
        lines.append("")
    lines.append("Plot: [scale.png](../../bench/results/scale.png), data: "
                 "[scale.json](../../bench/results/scale.json).")
    return "\n".join(lines)


def _g(v: float, unit: str) -> str:
    if v >= 1000:
        return f"{v:,.0f} {unit}"
    return f"{v:.3g} {unit}"


def _readme(doc: dict[str, Any]) -> None:
    text = GUIDE.read_text()
    if BEGIN not in text or END not in text:
        print(f"{GUIDE} has no {BEGIN} ... {END} block: not updated")
        return
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    GUIDE.write_text(head + BEGIN + "\n" + _markdown(doc) + "\n" + END + tail)
    print(f"{GUIDE}: scale block rewritten")


# == main =========================================================================================

def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sections", default=",".join(SECTIONS),
                   help=f"comma-separated, of: {', '.join(SECTIONS)}")
    p.add_argument("--render", action="store_true", help="only redraw the plot and the guide's block")
    p.add_argument("--rebuild", action="store_true",
                   help="re-derive each section's series, table and notes from its stored runs "
                        "(no measuring), then render")
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--sizes", default="8,16,32,64,128,256,512,1024,2048,4096",
                   help="membership: member counts (stops at the first the machine cannot keep up with)")
    p.add_argument("--baseline-sizes", default="8,16,32,64,128",
                   help="membership: member counts for the protocol before issue 24 ('' for none)")
    p.add_argument("--baseline-rev", default=BASELINE_REV)
    p.add_argument("--interval", type=float, default=0.2, help="heartbeat interval (s)")
    p.add_argument("--dead-after", type=float, default=1.0, help="dead_after_s")
    p.add_argument("--form-timeout", type=float, default=120.0)
    p.add_argument("--steady", type=float, default=5.0, help="seconds of steady state measured")
    p.add_argument("--warmup", type=float, default=1.5, help="seconds before measuring / a fault")
    p.add_argument("--hosts", type=int, default=32,
                   help="host processes for the members (more: fewer members queueing for each "
                        "process's GIL when a round forms)")
    p.add_argument("--drivers", type=int, default=2,
                   help="threads per host process that beat its members in turn (0: each "
                        "member's own heartbeat thread, as in a job)")
    p.add_argument("--relay-sizes", default="8,64,256,1024,2048",
                   help="relay: member counts, every member beating through its node's relay")
    p.add_argument("--store-clients", type=int, default=32, help="store_cost: client threads")
    p.add_argument("--store-beats", type=int, default=600, help="store_cost: beats per client")
    p.add_argument("--store-repeats", type=int, default=3, help="store_cost: repeats per kind")
    p.add_argument("--store-paced", action=argparse.BooleanOptionalAction, default=True,
                   help="store_cost: send the beats at a 16,384-rank job's rate (default), not "
                        "as fast as the clients can")
    p.add_argument("--rebuild-worlds", default="xor:5,10;rs:6,12",
                   help="parity_rebuild: scheme:world sizes, ';'-separated")
    p.add_argument("--rebuild-mb", type=float, default=16.0,
                   help="parity_rebuild: training state (MB), sharded over the ranks")
    p.add_argument("--meta-worlds", default="2,4,8,16,32",
                   help="metadata: world sizes (8 ranks per simulated node)")
    p.add_argument("--meta-layers", type=int, default=64,
                   help="metadata: Linear layers of the many-small-tensors model")
    p.add_argument("--restore-worlds", default="4,8,16,32",
                   help="restore: world sizes before the loss (one rank per node)")
    p.add_argument("--restore-mb", type=float, default=32.0,
                   help="restore: state size (MB, model + AdamW moments)")
    args = p.parse_args(argv)
    doc: dict[str, Any] = json.loads(args.out.read_text()) if args.out.exists() else {}
    doc.setdefault("bench", "scale")
    doc.setdefault("sections", {})
    if args.rebuild:
        for name, rebuild in REBUILD.items():
            if name in doc["sections"]:
                doc["sections"][name].update(rebuild(doc["sections"][name]))
        args.render = True
    if not args.render:
        names = [s.strip() for s in args.sections.split(",") if s.strip()]
        unknown = [n for n in names if n not in SECTIONS]
        if unknown:
            p.error(f"unknown section(s) {unknown}; known: {', '.join(SECTIONS)}")
        for name in names:
            t0, load0 = time.time(), load1()
            foreign = ForeignCpu()
            mark = foreign.mark()
            sec = SECTIONS[name](args)
            noise = foreign.since(mark)
            foreign.close()
            sec.update(command=shlex.join([python(), "bench/scale.py", *argv]),
                       created=time.strftime("%Y-%m-%dT%H:%M:%S%z", time.gmtime(t0)),
                       wall_s=time.time() - t0, load_start=load0, load_end=load1(),
                       foreign_cpus=noise["foreign_cpus"], foreign_top=noise["top"],
                       machine=machine())
            doc["sections"][name] = sec
            if "table" in sec:
                print(text_table(sec["table"]["headers"], sec["table"]["rows"]))
            args.out.parent.mkdir(parents=True, exist_ok=True)
            tmp = args.out.with_name(args.out.name + ".tmp")
            tmp.write_text(json.dumps(doc, indent=1, default=str) + "\n")
            os.replace(tmp, args.out)
            print(f"wrote {args.out}")
    doc["projections"] = projections(doc)
    if not args.render or args.rebuild:
        args.out.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    render(doc, args.out)
    for pr in doc["projections"]:
        print(f"{pr['panel']} [{pr['label']}]: {pr['growth']} (exponent {pr['exponent']:.2f}); "
              + ", ".join(f"{w}: {_g(pr[str(w)], pr['unit'])}" for w in PROJECT_TO))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
