"""``python -m aegis.launch``: torchrun, with a worker's death left to in-process recovery.

Takes torchrun's arguments (same parser, same rendezvous, same ``--max-restarts``) plus one::

    python -m aegis.launch --nnodes=2:3 --nproc-per-node=8 --max-restarts=100 \\
        --rdzv-backend=c10d --rdzv-endpoint=$STORE:29400 --rdzv-id=$JOB \\
        --rdzv-conf=is_host=false --on-worker-failure=replace train.py --in-process ...

Why torchrun alone cannot do it. torchelastic's ``LocalElasticAgent`` treats its workers as one
group: its process context stops every worker of the node as soon as one exits non-zero
(``SubprocessContext._poll``: "if ANY have failed ... terminate all running procs"), and the
agent then re-rendezvouses (``SimpleElasticAgent._restart_workers``), which makes every other
node's agent restart its workers too. Measured here (3 workers, one SIGKILLed, under
``aegis.run_in_process``): within 2 s all three were new processes. In-process recovery makes
that unnecessary: the survivors of a lost process re-form their groups through the aegis
membership store (``AEGIS_MEMBERSHIP``), and a new process joins the running job at their next
snapshot. What is left for the launcher is to start that new process, and nothing else.

:class:`InProcessAgent` is a ``LocalElasticAgent`` whose ``_monitor_workers`` looks at its
workers before torchelastic's poll does, and applies ``--on-worker-failure``:

* ``replace``: each worker that exited non-zero is started again, alone, with its own local
  rank and the environment of the last rendezvous (``RANK`` is stale but unused: in-process
  membership numbers the ranks), while the other workers keep running; no rendezvous, so no
  other node notices. Each replacement counts against ``--max-restarts``; once they are spent,
  torchelastic's own handling applies (the agent stops its workers and fails).
* ``leave``: the node leaves the job: its other workers are stopped and the agent exits with
  the failure; the survivors on other nodes recover in place without it (a scheduler may bring
  a node back later, which joins at a snapshot).
* ``restart``: torchelastic's behaviour, unchanged (every worker of the job restarted).

``auto`` (the default) is ``replace`` when ``AEGIS_MEMBERSHIP`` is set (in-process recovery is
configured) and ``restart`` otherwise: a job that uses ``init_process_group`` directly cannot
take a single new process, and needs torchrun's restart.

Nodes that arrive later (a replacement node) are handled as by torchrun: a node waiting in the
job's rendezvous makes the running agents restart their workers. Under in-process recovery a
replacement node is started with a rendezvous of its own (``--nnodes=1`` and its own
``--rdzv-id``) and joins through the membership store (docs/guides/in-process.md).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
import uuid
from typing import Any

from torch.distributed.elastic import events, metrics
from torch.distributed.elastic.agent.server.api import (
    RunResult,
    WorkerGroup,
    WorkerSpec,
)
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.api import SubprocessContext
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
from torch.distributed.elastic.multiprocessing.subprocess_handler import get_subprocess_handler
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous import registry as rdzv_registry
from torch.distributed.launcher.api import LaunchConfig, _get_addr_and_port, _get_entrypoint_name

__all__ = ["InProcessAgent", "POLICIES", "launch", "main"]

POLICIES = ("auto", "replace", "leave", "restart")
log = logging.getLogger("aegis.launch")


def resolve_policy(policy: str) -> str:
    """``auto`` -> ``replace`` with in-process recovery configured, else ``restart``."""
    if policy not in POLICIES:
        raise ValueError(f"--on-worker-failure={policy!r}: choose one of {', '.join(POLICIES)}")
    if policy == "auto":
        return "replace" if os.environ.get("AEGIS_MEMBERSHIP") else "restart"
    return policy


def _say(msg: str) -> None:
    print(f"[aegis.launch] {msg}", file=sys.stderr, flush=True)


class InProcessAgent(LocalElasticAgent):
    """A ``LocalElasticAgent`` that leaves a worker's death to in-process recovery (see the
    module docstring). Called by torchelastic's run loop (``SimpleElasticAgent._invoke_run``)
    every ``monitor_interval``; only ``_monitor_workers`` differs."""

    def __init__(self, *args: Any, on_worker_failure: str = "replace", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if on_worker_failure not in ("replace", "leave", "restart"):
            raise ValueError(f"on_worker_failure={on_worker_failure!r}: replace, leave or restart")
        self.policy = on_worker_failure
        self.replaced: list[tuple[int, int, int, int]] = []  # (local rank, old pid, exit code, new pid)
        self._announced: dict[int, int] = {}  # local rank -> the pid whose death was declared

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        pc = self._pcontext
        if self.policy != "restart" and isinstance(pc, SubprocessContext):
            failed = {lr: code for lr, h in pc.subprocess_handlers.items()
                      if lr in pc._running_local_ranks and (code := h.proc.poll()) not in (None, 0)}
            for lr in sorted(failed):
                if self._announced.get(lr) != pc.subprocess_handlers[lr].proc.pid:
                    self._announced[lr] = pc.subprocess_handlers[lr].proc.pid
                    declare_dead(lr, pc.subprocess_handlers[lr].proc.pid)
            if failed and self.policy == "leave":
                # torchelastic's poll (below) stops the other workers and reports the failure;
                # with no restarts left the agent exits with it: the node leaves the job
                _say(f"worker(s) {self._describe(failed)} failed: this node leaves the job "
                     "(--on-worker-failure=leave); its other workers are stopped")
                self._remaining_restarts = 0
            elif failed and self._remaining_restarts >= len(failed):
                for lr, code in sorted(failed.items()):
                    self._replace(pc, worker_group, lr, code)
            elif failed:  # restarts spent: torchelastic stops the other workers, the agent fails
                _say(f"worker(s) {self._describe(failed)} failed and {self._remaining_restarts} "
                     f"restart(s) are left of {worker_group.spec.max_restarts}: stopping this node")
                self._remaining_restarts = 0
        return super()._monitor_workers(worker_group)

    def _describe(self, failed: dict[int, int]) -> str:
        assert isinstance(self._pcontext, SubprocessContext)
        return ", ".join(f"local rank {lr} (pid {self._pcontext.subprocess_handlers[lr].proc.pid}, "
                         f"exit {code})" for lr, code in sorted(failed.items()))

    def _replace(self, pc: SubprocessContext, worker_group: WorkerGroup, lr: int, code: int) -> None:
        """Start a new process for local rank ``lr`` in the place of the one that exited."""
        spec = worker_group.spec
        self._remaining_restarts -= 1
        old = pc.subprocess_handlers[lr]
        for fh in (old._stdout, old._stderr):  # the dead worker's redirected output, kept
            if fh is not None:
                with contextlib.suppress(OSError):
                    fh.close()
        for path in (pc.stdouts[lr], pc.stderrs[lr]):
            if path and os.path.exists(path):  # SubprocessHandler opens it with "w"
                with contextlib.suppress(OSError):
                    os.replace(path, f"{path}.{old.proc.pid}")
        env = dict(pc.envs[lr])
        env["TORCHELASTIC_RESTART_COUNT"] = str(spec.max_restarts - self._remaining_restarts)
        new = get_subprocess_handler(
            entrypoint=pc.entrypoint,  # type: ignore[arg-type] # a binary: SubprocessContext
            args=pc.args[lr], env=env, stdout=pc.stdouts[lr], stderr=pc.stderrs[lr],
            local_rank_id=lr, numa_options=pc._numa_options)
        pc.subprocess_handlers[lr] = new
        worker_group.workers[lr].id = new.proc.pid
        self.replaced.append((lr, old.proc.pid, code, new.proc.pid))
        _say(f"local rank {lr} (pid {old.proc.pid}) exited with {code}; started pid {new.proc.pid} "
             f"in its place, the other workers keep running (restart "
             f"{spec.max_restarts - self._remaining_restarts} of {spec.max_restarts}); it joins the "
             "running job through the membership store")


def declare_dead(local_rank: int, pid: int) -> bool:
    """Name a worker that exited in the death log of the job's newest round, as its watchers
    would once it had been silent for ``dead_after_s``: the agent saw it exit (waitpid), which
    is proof, where silence is a guess. The survivors read the log at their next beat, fence it
    off and form the next round without it: detection in a heartbeat interval instead of
    ``dead_after_s`` (the commonest real failure, one process of a node, issue 25). Its uid is
    the one ``run_in_process`` gave it (node, local rank, pid; the agent's ``AEGIS_NODE_ID`` and
    ``AEGIS_MEMBERSHIP`` are its workers'). A no-op without ``AEGIS_MEMBERSHIP``; best effort
    (False) when the store cannot be reached within a second: the heartbeats still detect it.
    Per dead worker: one connect, one request per round formed since the store's base round
    (``latest_round`` walks them), and one append; nothing that grows with the world size."""
    from datetime import timedelta

    from aegis._dist import node_id
    from aegis.training.inprocess.membership import ENV_STORE, declare, member_uid, store_from_env

    if ":" not in os.environ.get(ENV_STORE, ""):
        return False
    uid = member_uid(node_id(), local_rank, pid)
    try:
        r = declare(store_from_env(timedelta(seconds=2)), uid)
    except Exception:  # noqa: BLE001 - the heartbeats detect it instead
        return False
    _say(f"worker pid {pid} (local rank {local_rank}) exited: declared dead in round {r}")
    return True


class _StoreTolerantRendezvous:
    """The agent's rendezvous handler, except that a store it cannot reach while the job runs
    counts as no node waiting. torchelastic's run loop asks ``num_nodes_waiting()`` at every
    monitor interval, and the c10d backend raises ``RendezvousConnectionError`` once the store
    is away, or for good once it was restarted (its client's connection is broken): the agent
    exited and took its healthy workers with it (the chaos campaign's ``store_restart``, issue
    25). With in-process recovery, nodes join through the membership store, never through a
    re-rendezvous, so nothing is lost by not counting them here.

    While the store is away, the c10d backend's client is replaced once the store listens again
    (:meth:`_reconnect`, at most every ``RECONNECT_S``): a c10d client whose connection broke
    fails at every later request, so the handler's keep-alive thread logged a failed heartbeat
    and a broken-pipe traceback every second for the rest of the job."""

    RECONNECT_S = 2.0

    def __init__(self, handler: Any, endpoint: str = "") -> None:
        self._handler = handler
        self._endpoint = endpoint
        self._away = False
        self._tried = 0.0

    def num_nodes_waiting(self) -> int:
        from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

        try:
            n = int(self._handler.num_nodes_waiting())
        except RendezvousConnectionError as e:
            if not self._away:
                _say(f"the rendezvous store is unreachable ({str(e.__cause__ or e)[:120]}); the "
                     "workers go on (in-process recovery admits nodes through the membership store)")
            self._away = True
            if time.monotonic() - self._tried >= self.RECONNECT_S:
                self._tried = time.monotonic()
                if self._reconnect():
                    _say("the rendezvous store is back: its client reconnected")
            return 0
        self._away = False
        return n

    def _backend(self) -> Any:
        """The c10d rendezvous backend under the handler (torch internals: None if absent)."""
        holder = getattr(self._handler, "_state_holder", None)
        backend = getattr(holder, "_backend", None)
        if backend is None or not hasattr(backend, "_store") or not hasattr(backend, "_key"):
            return None
        return backend

    def _reconnect(self) -> bool:
        """A new client of the rendezvous store for the c10d backend, once the store listens
        (a plain TCP connect first: refused at once while it is down, where a c10d connect would
        block this monitor loop for its whole timeout). A store restarted empty gets the
        backend's empty state back (as the backend's constructor writes it). True if done."""
        from datetime import timedelta

        import torch.distributed as dist
        from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

        from aegis.training.inprocess.membership import connect_store

        backend = self._backend()
        if backend is None or not isinstance(backend._store, dist.TCPStore) or not self._endpoint:
            return False
        try:
            host, port = parse_rendezvous_endpoint(self._endpoint, default_port=29400)
            store = connect_store(host, port, timedelta(seconds=5))
            store.compare_set(backend._key, "", backend._NULL_SENTINEL)
        except Exception:  # noqa: BLE001 - still away: tried again later
            return False
        store.set_timeout(getattr(backend._store, "timeout", timedelta(seconds=60)))
        backend._store = store  # aegis: private-assign (torchelastic's C10d backend has no setter)
        return True

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handler, name)


def launch(config: LaunchConfig, entrypoint: str, args: list[str], *, on_worker_failure: str) -> dict[int, Any]:
    """torchelastic's ``launch_agent`` with :class:`InProcessAgent` as the agent (the same
    rendezvous handler, worker spec, metrics, events and failure report; torch's function
    hard-codes ``LocalElasticAgent``). Returns the workers' return values by global rank;
    raises ``ChildFailedError`` when the workers failed for good."""
    if not config.run_id:
        config.run_id = str(uuid.uuid4().int)
    params = RendezvousParameters(
        backend=config.rdzv_backend, endpoint=config.rdzv_endpoint, run_id=config.run_id,
        min_nodes=config.min_nodes, max_nodes=config.max_nodes, local_addr=config.local_addr,
        **config.rdzv_configs)
    master_addr, master_port = _get_addr_and_port(params)
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = config.signals_to_handle
    spec = WorkerSpec(
        role=config.role, local_world_size=config.nproc_per_node, entrypoint=entrypoint,
        args=tuple(args), rdzv_handler=rdzv_registry.get_rendezvous_handler(params),
        max_restarts=config.max_restarts, monitor_interval=config.monitor_interval,
        master_addr=master_addr, master_port=master_port, local_addr=config.local_addr,
        event_log_handler=config.event_log_handler, numa_options=config.numa_options,
        duplicate_stdout_filters=config.duplicate_stdout_filters,
        duplicate_stderr_filters=config.duplicate_stderr_filters,
        virtual_local_rank=config.virtual_local_rank)
    if on_worker_failure != "restart":
        spec.rdzv_handler = _StoreTolerantRendezvous(  # type: ignore[assignment]
            spec.rdzv_handler, config.rdzv_endpoint if config.rdzv_backend == "c10d" else "")
    agent = InProcessAgent(
        spec=spec, logs_specs=config.logs_specs, start_method=config.start_method,  # type: ignore[arg-type]
        log_line_prefix_template=config.log_line_prefix_template,
        shutdown_timeout=config.shutdown_timeout,  # type: ignore[arg-type]
        on_worker_failure=on_worker_failure)
    shutdown_rdzv = True
    try:
        metrics.initialize_metrics(metrics.MetricsConfig(config.metrics_cfg))
        result = agent.run()
        events.record(agent.get_event_succeeded(), config.event_log_handler)
        if result.is_failed():
            raise ChildFailedError(name=_get_entrypoint_name(entrypoint, args), failures=result.failures)
        return result.return_values
    except ChildFailedError:
        raise
    except Exception as e:
        # a signal to the agent leaves the rendezvous open (torchelastic's rule: closing it
        # would keep every later node out)
        from torch.distributed.elastic.multiprocessing.api import SignalException

        shutdown_rdzv = not isinstance(e, SignalException)
        events.record(agent.get_event_failed(), config.event_log_handler)
        raise
    finally:
        if shutdown_rdzv:
            with contextlib.suppress(Exception):  # the store may be gone: nothing to close
                spec.rdzv_handler.shutdown()


@record
def main(argv: list[str] | None = None) -> None:
    """``python -m aegis.launch [torchrun options] [--on-worker-failure P] script [args]``."""
    from torch.distributed.run import config_from_args, get_args_parser

    parser = get_args_parser()
    parser.description = "torchrun, with a worker's death left to aegis' in-process recovery"
    parser.add_argument(
        "--on-worker-failure", "--on_worker_failure", dest="on_worker_failure", default="auto",
        choices=POLICIES,
        help="replace: start a new process for a failed worker and leave the others running (it "
             "joins at the survivors' next snapshot); leave: the node leaves the job; restart: "
             "torchrun's behaviour (every worker restarted); auto: replace when AEGIS_MEMBERSHIP "
             "is set, else restart")
    args = parser.parse_args(argv)
    if args.standalone:  # as torchrun does
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500
    policy = resolve_policy(args.on_worker_failure)
    config, cmd, cmd_args = config_from_args(args)
    if not isinstance(cmd, str):
        raise SystemExit("aegis.launch runs a script or module (not --run-path)")
    _say(f"on worker failure: {policy} (--on-worker-failure={args.on_worker_failure}), "
         f"max restarts {config.max_restarts}")
    t0 = time.monotonic()
    launch(config, cmd, cmd_args, on_worker_failure=policy)
    log.info("workers done after %.1f s", time.monotonic() - t0)


if __name__ == "__main__":
    main()
