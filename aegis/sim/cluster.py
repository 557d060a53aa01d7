"""A simulated multi-node cluster on one machine.

Each node is a torchrun agent (or ``python -m aegis.launch``, torchelastic's agent with a
worker's death left to in-process recovery) with its own ``AEGIS_NODE_ID`` and node store
directory, shared by the node's ranks. The agents meet through c10d rendezvous hosted by
``aegis store serve``, a process that no node owns (agents run with ``is_host=false``; in-process
recovery's membership lives in the same store), and ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``
makes every rendezvous round publish a fresh master address. Measured here: with the store
hosted by one of the agents (torchrun's default), a replacement node never joined after that
agent's node was lost.

Losing a node = SIGKILL its agent and its workers (they run in their own sessions, so the
agent's process group does not cover them) and delete its node store. A replacement node is a
new agent with a new id and an empty store. Losing a worker = SIGKILL one worker process; the
agent, the node's other workers and its store stay.

On a real cluster the same roles are: a rendezvous endpoint that outlives any training node
(a small always-on host, or etcd with ``--rdzv_backend=etcd-v2``), ``--nnodes=MIN:MAX`` with
``--max-restarts``, and a node store on each node's tmpfs (``AEGIS_STORE_DIR``). See docs/guides/cluster.md.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from aegis.sim.netns import NetnsNetwork
from aegis.sim.procs import children, descendants, kill_tree, wait_gone

__all__ = ["SimCluster", "SimNode", "free_port"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class SimNode:
    node_id: str
    store_dir: Path
    log: Path
    proc: subprocess.Popen[bytes]
    index: int = 0
    started: float = field(default_factory=time.time)
    killed: float | None = None
    addr: str = "127.0.0.1"

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def workers(self) -> list[int]:
        """Worker pids (the agent's descendants)."""
        return descendants(self.proc.pid) if self.alive else []

    def worker_pids(self) -> dict[int, int]:
        """The agent's workers by local rank (``LOCAL_RANK`` in each child's environment)."""
        out: dict[int, int] = {}
        for pid in children(self.proc.pid) if self.alive else []:
            rank = _env_of(pid).get("LOCAL_RANK")
            if rank is not None and rank.isdigit():
                out[int(rank)] = pid
        return out


def _env_of(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return {}
    return dict(kv.decode(errors="replace").split("=", 1) for kv in raw.split(b"\0") if b"=" in kv)


class SimCluster:
    """N simulated nodes running ``command`` (a script and its arguments) under torchrun.

    ``min_nodes < nodes`` lets the world shrink when a node is lost and no replacement comes.
    ``nproc_per_node``: ranks per node; they share the node's store (its first rank writes the
    manifests). ``on_worker_failure``: run the agents with ``python -m aegis.launch`` and that
    policy (``replace``, ``leave``, ``restart``) instead of torchrun, so that one worker's death
    (:meth:`kill_worker`) is left to in-process recovery.
    ``network``: give every node its own network namespace (see :mod:`aegis.sim.netns`), so
    that its link can be cut. ``store_tmpfs_bytes``: mount a tmpfs of that size as each node's
    store (root only), so that one node's store can fill up.
    """

    def __init__(
        self,
        workdir: str | os.PathLike[str],
        command: list[str],
        *,
        nodes: int = 3,
        nproc_per_node: int = 1,
        min_nodes: int | None = None,
        max_nodes: int | None = None,
        job: str = "sim",
        store_root: str | os.PathLike[str] | None = None,
        max_restarts: int = 20,
        env: dict[str, str] | None = None,
        last_call_timeout: int = 1,
        network: NetnsNetwork | None = None,
        store_tmpfs_bytes: int | None = None,
        on_worker_failure: str | None = None,
    ) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.command = command
        self.initial_nodes = nodes
        self.nproc = nproc_per_node
        self.min_nodes = min_nodes or nodes
        self.max_nodes = max_nodes or max(nodes, self.min_nodes)
        self.job = job
        self.store_root = Path(store_root) if store_root else Path(f"/dev/shm/aegis-sim-{os.getpid()}-{job}")
        self.max_restarts = max_restarts
        self.env = env or {}
        self.last_call_timeout = last_call_timeout
        self.network = network
        self.store_tmpfs_bytes = store_tmpfs_bytes
        self.on_worker_failure = on_worker_failure
        self.host = network.hub if network else "127.0.0.1"
        self.port = free_port()
        self.nodes: dict[str, SimNode] = {}
        self._next = 0
        self.generation = 0
        self._store: subprocess.Popen[bytes] | None = None

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> SimCluster:
        self.start_store()
        for _ in range(self.initial_nodes):
            self.add_node()
        return self

    def start_store(self, timeout: float = 120.0) -> subprocess.Popen[bytes]:
        """The rendezvous and membership store, as a cluster user runs it: ``aegis store serve``
        on the hub address, its log (one line per membership change) in ``store.log``."""
        log = self.workdir / "store.log"
        start = log.stat().st_size if log.exists() else 0
        with open(log, "ab") as out:
            self._store = subprocess.Popen(
                [sys.executable, "-m", "aegis.cli", "store", "serve", "--host", self.host,
                 "--port", str(self.port), "--poll", "0.5"],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
        deadline = time.monotonic() + timeout
        while b"ready on" not in log.read_bytes()[start:]:
            if self._store.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the rendezvous store did not start: {log.read_bytes()[start:]!r}")
            time.sleep(0.05)
        return self._store

    def restart_store(self) -> float:
        """The store's host lost and the store started again on its address, empty: SIGKILL
        of ``aegis store serve``, then a new one (as a supervisor such as systemd or a
        Kubernetes Deployment restarts it). Returns the seconds it was down."""
        assert self._store is not None
        t0 = time.monotonic()
        self._store.kill()
        self._store.wait()
        self.start_store()
        return time.monotonic() - t0

    def freeze_store(self, seconds: float) -> None:
        """The store unreachable for ``seconds``: SIGSTOP (connections stay open, nothing is
        answered), then SIGCONT."""
        assert self._store is not None
        os.kill(self._store.pid, signal.SIGSTOP)
        try:
            time.sleep(seconds)
        finally:
            os.kill(self._store.pid, signal.SIGCONT)

    def add_node(self, *, solo: bool = False) -> SimNode:
        """Start a node with a new id and an empty node store (a replacement, or the first).

        ``solo``: its agent forms a rendezvous of its own (``--nnodes=1``, its own id), so the
        running agents see no node waiting and do not restart their workers: an in-process job
        (``--in-process``) admits the new workers itself, through the membership store."""
        index = self._next
        node_id = f"node-{index}"
        self._next += 1
        store_dir = self.store_root / node_id
        shutil.rmtree(store_dir, ignore_errors=True)
        store_dir.mkdir(parents=True, mode=0o700)
        if self.store_tmpfs_bytes:
            subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.store_tmpfs_bytes},mode=0700",
                            "tmpfs", str(store_dir)], check=True)
        addr = "127.0.0.1"
        if self.network is not None:
            addr = self.network.add(index).addr
        return self._launch(node_id, index, store_dir, addr, solo=solo)

    def relaunch(self, *, solo: bool = False) -> list[str]:
        """Start a new agent on every node whose agent exited (not killed), keeping its node
        store and address, under a new rendezvous id: what a job scheduler does when it requeues
        the job (torchrun closes a rendezvous for good once one of its agents fails). ``solo``:
        as in :meth:`add_node` (an in-process job: the node rejoins the running job)."""
        self.generation += 1
        out = []
        for node_id, node in list(self.nodes.items()):
            if node.killed is None and not node.alive:
                self._launch(node_id, node.index, node.store_dir, node.addr, solo=solo)
                out.append(node_id)
        return out

    @property
    def rdzv_id(self) -> str:
        return self.job if not self.generation else f"{self.job}-{self.generation}"

    def _launch(self, node_id: str, index: int, store_dir: Path, addr: str, *,
                solo: bool = False) -> SimNode:
        prefix: list[str] = []
        extra_env: dict[str, str] = {}
        if self.network is not None:
            prefix = self.network.exec_prefix(index)
            extra_env["GLOO_SOCKET_IFNAME"] = "eth0"
        log = self.workdir / f"{node_id}.log"
        rdzv_conf = (
            f"is_host=false,join_timeout=300,last_call_timeout={self.last_call_timeout},"
            "close_timeout=10,keep_alive_interval=1,keep_alive_max_attempt=3,read_timeout=30"
        )
        cmd = [
            *prefix,
            sys.executable, "-m", "torch.distributed.run" if self.on_worker_failure is None else "aegis.launch",
            *([f"--on-worker-failure={self.on_worker_failure}"] if self.on_worker_failure else []),
            "--nnodes=1" if solo else f"--nnodes={self.min_nodes}:{self.max_nodes}",
            f"--nproc_per_node={self.nproc}",
            "--rdzv_backend=c10d",
            f"--rdzv_endpoint={self.host}:{self.port}",
            f"--rdzv_id={self.rdzv_id}-solo-{index}" if solo else f"--rdzv_id={self.rdzv_id}",
            f"--rdzv_conf={rdzv_conf}",
            f"--max_restarts={self.max_restarts}",
            "--monitor_interval=0.1",
            f"--local_addr={addr}",
            *self.command,
        ]
        env = {
            **os.environ,
            "AEGIS_NODE_ID": node_id,
            "AEGIS_STORE_DIR": str(store_dir),
            "AEGIS_EVENTS_DIR": str(self.workdir / "events" / node_id),
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
            # in-process recovery agrees on membership in the same store (keys under aegis/)
            "AEGIS_MEMBERSHIP": f"{self.host}:{self.port}",
            "OMP_NUM_THREADS": "1",
            "PYTHONWARNINGS": "ignore",
            "PYTHONUNBUFFERED": "1",
            **extra_env,
            **self.env,
        }
        with open(log, "ab") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)
        node = SimNode(node_id, store_dir, log, proc, index=index, addr=addr)
        self.nodes[node_id] = node
        return node

    def kill_node(self, node_id: str, *, delete_store: bool = True) -> float:
        """SIGKILL a node's agent and workers and delete its node store; return the kill time."""
        node = self.nodes[node_id]
        t = time.time()
        victims = kill_tree(node.proc.pid)
        node.killed = t
        wait_gone(victims, timeout=10)
        with contextlib.suppress(Exception):
            node.proc.wait(timeout=5)
        if delete_store:
            self._drop_store(node)
        if self.network is not None:
            self.network.remove(node.index)
        return t

    def kill_worker(self, node_id: str, local_rank: int) -> tuple[float, int]:
        """SIGKILL one worker process of a node (not its agent, not its node store): a GPU
        fallen off the bus, an OOM kill, a segfault. Returns the kill time and the pid."""
        pid = self.nodes[node_id].worker_pids()[local_rank]
        t = time.time()
        os.kill(pid, signal.SIGKILL)
        wait_gone([pid], timeout=10)
        return t, pid

    def drop_store(self, node_id: str) -> None:
        """Delete a (killed) node's store now (``kill_node(delete_store=False)`` left it)."""
        self._drop_store(self.nodes[node_id])

    def _drop_store(self, node: SimNode) -> None:
        shutil.rmtree(node.store_dir, ignore_errors=True)
        if self.store_tmpfs_bytes:
            subprocess.run(["umount", "-l", str(node.store_dir)], check=False, capture_output=True)
            shutil.rmtree(node.store_dir, ignore_errors=True)

    def stop_node(self, node_id: str) -> list[int]:
        """SIGSTOP a node's processes (a frozen node, not a dead one); returns the pids."""
        node = self.nodes[node_id]
        pids = [node.proc.pid, *node.workers()]
        for p in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGSTOP)
        return pids

    def cont_node(self, pids: list[int]) -> None:
        for p in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGCONT)

    def alive_nodes(self) -> list[str]:
        return [n for n, node in self.nodes.items() if node.alive]

    def wait(self, timeout: float) -> dict[str, int | None]:
        """Wait for every live agent to exit; return exit codes (None: still running)."""
        deadline = time.monotonic() + timeout
        for node in self.nodes.values():
            if node.killed is not None:
                continue
            remaining = max(deadline - time.monotonic(), 0.01)
            with contextlib.suppress(subprocess.TimeoutExpired):
                node.proc.wait(timeout=remaining)
        return {n: node.proc.poll() for n, node in self.nodes.items() if node.killed is None}

    def wait_workers(self, timeout: float) -> bool:
        """Wait until no live node has a worker left; True if so. With in-process recovery a
        lost node's agent never reaches torchrun's exit barrier, so the survivors' agents wait
        there (torchrun's fixed 300 s) after their workers are done: the job is over when the
        workers are."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not any(node.workers() for node in self.nodes.values() if node.killed is None):
                return True
            time.sleep(0.1)
        return False

    def shutdown(self, *, remove_stores: bool = True) -> None:
        for node in self.nodes.values():
            if node.alive:
                victims = kill_tree(node.proc.pid)
                wait_gone(victims, timeout=10)
            with contextlib.suppress(Exception):
                node.proc.wait(timeout=5)
        if self._store is not None and self._store.poll() is None:
            self._store.terminate()
            try:
                self._store.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._store.kill()
                self._store.wait(timeout=5)
        if self.store_tmpfs_bytes:
            for node in self.nodes.values():
                subprocess.run(["umount", "-l", str(node.store_dir)], check=False, capture_output=True)
        if self.network is not None:
            for node in self.nodes.values():
                self.network.remove(node.index)
        if remove_stores:
            shutil.rmtree(self.store_root, ignore_errors=True)
        # the node heartbeat relays of this job (AEGIS_NODE_RELAY): killed processes leave them
        from aegis.training.inprocess.relay import relay_root

        shutil.rmtree(relay_root(f"{self.host}:{self.port}"), ignore_errors=True)

    def __enter__(self) -> SimCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
