"""The training-loop contract.

::

    mgr = Manager("my-job", {"model": ModelOptimizerState(model, optim),
                             "scheduler": sched, "data": sampler}, every=1, keep=1)
    start = mgr.restore()            # all ranks, before the loop; 0 when nothing to restore
    for step in range(start + 1, total + 1):
        train_one_step(...)
        mgr.save(step)               # all ranks, after optimizer.step(); blocks for one copy
    mgr.close()

Every method is collective: all ranks call it, in the same order, with the same step.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from aegis._dist import Group, new_snapshot_group, node_id
from aegis.errors import (
    AegisError,
    ConfigError,
    StepOrderError,
)
from aegis.goodput import AutoInterval, daly_interval
from aegis.snapshot.codec import Codec
from aegis.snapshot.durable import Uploader, UploadResult, clean_uncommitted, list_steps
from aegis.snapshot.engine import SnapshotEngine, SnapshotHandle, SnapshotResult, format_bytes
from aegis.snapshot.engine_plan import thread_where
from aegis.snapshot.manifest import Commit
from aegis.snapshot.node_store import NodeStore, start_frees
from aegis.snapshot.objstore import open_store
from aegis.snapshot.staging import Deferral
from aegis.snapshot.transport import GlooTransport
from aegis.training import inprocess
from aegis.training.config import ManagerConfig
from aegis.training.entries import _APP, StateEntries, check_built_in_round
from aegis.training.events import EventLog
from aegis.training.recovery import RestoreResult, restore_newest
from aegis.training.state import (
    ModelOptimizerState,
    check_state,
)

__all__ = ["Manager"]



class Manager:
    """Snapshots the training state into host memory and restores it after a failure.

    Construction is collective: every rank of the default group builds its Manager with the same
    job and configuration, in the same order (it creates aegis' own gloo group); it checks the
    configuration and the state before any training time is spent. Then every rank calls
    :meth:`restore` once before the loop, :meth:`save` after each step and :meth:`close` at the
    end, in the same order.

    Args:
        job: names the run; snapshots live under ``<store_dir>/<job>/`` and ``<durable>/<job>/``.
            One name per experiment (1-128 of ``[A-Za-z0-9_.-]``).
        state: entry name -> :class:`ModelOptimizerState` (sharded through DCP), or any object
            with ``state_dict``/``load_state_dict`` (per rank by default; LR schedulers and
            :func:`~aegis.replicated` objects are replicated). No ``.`` in a name.
        every: snapshot every ``every`` steps, or ``"auto"`` (Daly's interval from the measured
            blocking time and ``mtbf_s``, within ``[1, every_max]``).
        keep: committed snapshots kept in memory per node (plus one in flight).
        replicas: copies of each shard pushed to other nodes (``redundancy="replica"``).
        redundancy: ``"replica"``, ``"dp"`` (the replicas built from data-parallel copies: only
            what the holder does not hold travels), ``"xor"`` (XOR parity over ``group_size``
            nodes) or ``"rs"`` (Reed-Solomon, ``parity`` losses per group).
        group_size: nodes per parity group (``"xor"``, ``"rs"``).
        parity: lost nodes per group that ``"rs"`` rebuilds.
        staging: ``"sync"``, ``"pinned"`` or ``"async"`` (how ``save`` copies device tensors);
            default ``$AEGIS_STAGING`` or ``"sync"``.
        store_dir: node store root (a tmpfs); default ``$AEGIS_STORE_DIR`` or ``/dev/shm/aegis``.
        timeout: bound on every snapshot collective.
        chunk_bytes: checksum and compression unit of a shard (default 16 MiB).
        events_dir: where each rank appends its JSON-lines events.
        rng: snapshot every rank's python, numpy, torch and CUDA RNG states.
        verbose: one human line per snapshot and restore on rank 0.
        debug: check replicated entries equal on every rank at each snapshot.
        fresh: start the job over (its node-store snapshots are removed).
        mtbf_s: with ``every="auto"``: mean seconds between interruptions of the whole job.
        every_max: with ``every="auto"``: the longest interval, in steps.
        durable: the durable tier's URL (``file:///path`` or ``s3://bucket/prefix``); None: none.
        durable_every: upload a committed snapshot every N steps.
        durable_every_s: ... or when this many seconds passed since the last upload began.
        durable_keep_last: durable retention: the last N committed steps.
        durable_keep_every: ... and every K-th step (0: none).
        durable_codec: ``"planes"`` (zstd over byte planes), ``"zstd"`` or ``"raw"``.
        durable_level: the zstd level.
        durable_min_gain: the share of a chunk's bytes compression must save, else it is raw.
        durable_max_pending: uploads queued behind the running one before more are skipped.

    Each is a :class:`ManagerConfig` field, documented there in full.

    Raises:
        ConfigError: a bad value, named with the fix, before any collective.
        AegisError: the node store cannot hold ``keep + 1`` snapshots, the durable tier is not
            reachable or writable, or the state does not fit the job's snapshots.
    """

    def __init__(
        self,
        job: str,
        state: Mapping[str, Any],
        *,
        every: int | str = 1,
        keep: int = 1,
        replicas: int = 1,
        redundancy: str = "replica",
        group_size: int = 5,
        parity: int = 2,
        staging: str | None = None,
        store_dir: str | None = None,
        timeout: timedelta = timedelta(minutes=5),
        chunk_bytes: int | None = None,
        events_dir: str | None = None,
        rng: bool = True,
        verbose: bool = True,
        debug: bool = False,
        fresh: bool = False,
        mtbf_s: float | None = None,
        every_max: int = 1000,
        durable: str | None = None,
        durable_every: int = 10,
        durable_every_s: float | None = None,
        durable_keep_last: int = 2,
        durable_keep_every: int = 0,
        durable_codec: str = "planes",
        durable_level: int = 1,
        durable_min_gain: float = 0.25,
        durable_max_pending: int = 2,
    ) -> None:
        t_init = time.perf_counter()
        extra: dict[str, Any] = {} if chunk_bytes is None else {"chunk_bytes": chunk_bytes}
        if staging is not None:
            extra["staging"] = staging
        self.config = ManagerConfig(
            job=job, every=every, keep=keep, replicas=replicas, redundancy=redundancy,
            group_size=group_size, parity=parity, store_dir=store_dir, timeout=timeout,
            events_dir=events_dir, rng=rng, verbose=verbose, debug=debug, fresh=fresh, mtbf_s=mtbf_s,
            every_max=every_max, durable=durable, durable_every=durable_every,
            durable_every_s=durable_every_s, durable_keep_last=durable_keep_last,
            durable_keep_every=durable_keep_every, durable_codec=durable_codec,
            durable_level=durable_level, durable_min_gain=durable_min_gain,
            durable_max_pending=durable_max_pending,
            **extra,
        )
        # every="auto": the interval policy (pure) and what feeds it (see _auto_save).
        self._auto = (AutoInterval(float(self.config.mtbf_s or 0.0), self.config.every_max)
                      if self.config.every == "auto" else None)
        self._last_result: SnapshotResult | None = None
        self._last_snap_step = 0
        self._auto_ref: tuple[float, int] | None = None  # (time, step) the step clock runs from
        self._durable_mark = 0  # auto: the step of the last durable upload decided
        check_state(state)
        if inprocess.in_process_round():
            check_built_in_round(state)
        self.state = dict(state)
        self._restore_called = False
        self._newest_durable = 0
        self.node = node_id()
        self.durable_store = open_store(self.config.durable) if self.config.durable else None
        # in an in-process round, a rank lost while these groups are made ends their creation at
        # run_in_process' create_timeout, not at this Manager's timeout
        create = inprocess.Round.create_timeout if inprocess.in_process_round() else None
        t_groups = time.perf_counter()
        self.group = Group(new_snapshot_group(self.config.timeout, create))
        if self.durable_store is not None:
            # Checked before anything else, on every rank together: a missing bucket or missing
            # credentials must fail now, not at the first upload an hour into training.
            self.group.run_all("durable store check", self._check_durable)
        # Shard transfers get a group of their own, so a long transfer never sits between the
        # small commit collectives.
        self.transport = GlooTransport(new_snapshot_group(self.config.timeout, create),
                                       self.config.timeout)
        groups_s = time.perf_counter() - t_groups
        self.rank = self.group.rank
        self.world = self.group.world
        self.store = NodeStore(self.config.store_root, self.config.job)
        self.events = EventLog(self.config.events_root, job=job, rank=self.rank,
                               verbose=self.config.verbose)
        # the entries as one nested state dict and back (name -> kind learnt at the first state
        # dict; the engine writes the kinds into each manifest)
        self.entries = StateEntries(self.state, rank=self.rank, world=self.world, group=self.group,
                                    events=self.events, rng=self.config.rng, debug=self.config.debug)
        self.engine = SnapshotEngine(
            self.store,
            self.group,
            keep=self.config.keep,
            chunk_bytes=self.config.chunk_bytes,
            node=self.node,
            domain=os.environ.get("AEGIS_FAILURE_DOMAIN") or None,
            replicas=self.config.replicas,
            redundancy=self.config.redundancy,
            group_size=self.config.group_size,
            parity=self.config.parity,
            staging=self.config.staging,
            transport=self.transport,
            on_result=self._on_snapshot,
            mesh={"world_size": self.world},
            upload_filter=self._upload_due if self.durable_store is not None else None,
            on_commit=self._submit_upload,
            extra_snapshots=self.config.durable_max_pending + 1 if self.durable_store else 0,
            state_kinds=self.entries.kinds,
            # in a round of in-process recovery the world may be left uneven (a lost worker):
            # keep snapshots replicated rather than fail every process; at a job's start an
            # impossible layout is still an error
            parity_fallback=inprocess.in_process_round(),
            # ModelOptimizerState entries hand back the same state dict object while its
            # tensors are the live ones (see ModelOptimizerState.state_dict): flattened once
            stable_entries=[(_APP, n) for n, o in self.state.items()
                            if isinstance(o, ModelOptimizerState)],
        )
        self._existing = self._find_existing()
        # staging="async": the tensors the optimizers update are copied after save() returns;
        # each optimizer's next step waits for those copies first
        self._hooks: list[Any] = []
        self._deferred: tuple[list[Any], Deferral] | None = None  # see _deferral
        self._regroup: int | None = None  # joiners seen by the last save(): see save()
        if self.config.staging == "async":
            self.engine.stager.deferral = self._deferral
            for obj in self.state.values():
                if isinstance(obj, ModelOptimizerState):
                    for opt in obj.optimizers:
                        self._hooks.append(opt.register_step_pre_hook(self._before_step))
        if inprocess.in_process_round():
            inprocess.register_manager(self)
            self.engine.vote = inprocess.joiners_registered
            self.engine.poisoned = inprocess.round_failure
        self.uploader: Uploader | None = None
        self._last_upload_t = time.monotonic()
        self._upload_owed = False  # a due upload was skipped (backlog): catch up when it drains
        if self.durable_store is not None:
            if self._dropped:
                self.events.emit("durable_cleanup", uncommitted_steps=self._dropped)
            self.uploader = Uploader(
                self.durable_store,
                self.store,
                Group(new_snapshot_group(max(self.config.timeout, timedelta(minutes=30)), create)),
                codec=Codec(self.config.durable_codec, self.config.durable_level,
                            min_gain=float(self.config.durable_min_gain)),
                keep_last=self.config.durable_keep_last,
                keep_every=self.config.durable_keep_every,
                pin=self.engine.pin,
                unpin=self.engine.unpin,
                on_result=self._on_upload,
                warn=self.events.warn,
            )
        if inprocess.in_process_round():
            # the sockets of aegis' own groups (the uploader's too: created last), so that a
            # peer leaving the round or fencing this one off shuts them down as well
            inprocess.publish_ports()
        self.last_restore: RestoreResult | None = None
        self._closed = False
        self.events.emit("start", node=self.node, world_size=self.world, pid=os.getpid(),
                         replicas=self.engine.placement.effective_replicas,
                         replica_targets=self.engine.targets, redundancy=self.engine.scheme,
                         parity_group=list(self.engine.group_of),
                         parity=self.engine.parity if self.engine.groups else None,
                         init_s=time.perf_counter() - t_init, groups_s=groups_s)
        if self.engine.degraded:
            self.events.warn(f"{self.engine.degraded}: this world keeps one whole replica of each "
                             "shard instead (parity again once the world is even)")
        if self.engine.groups and self.config.redundancy == "rs" and self.engine.parity < self.config.parity:
            smallest = min(len(g) for g in self.engine.groups)
            now = ("XOR parity (RS needs 3)" if self.engine.scheme == "xor"
                   else f"Reed-Solomon parity {self.engine.parity} (RS needs parity + 2)")
            self.events.warn(f"snapshots survive {self.engine.parity} lost node(s) per group, not "
                             f"{self.config.parity}: the smallest parity group of this world has "
                             f"{smallest} node(s), so they use {now}")


    def _find_existing(self) -> int:
        """The newest committed step of this job on any node store or the durable tier (0: none);
        with ``fresh=True`` the node stores' snapshots are removed first. Collective."""
        local = -1
        if self.engine.is_leader:
            local = max((i.step for i in self.store.steps() if i.committed), default=0)
        durable = 0
        if self.durable_store is not None and self.rank == 0:
            try:
                durable = max(list_steps(self.durable_store, self.config.job)[0], default=0)
            except Exception:  # noqa: BLE001 - the start check already reached the store
                durable = 0
        newest, newest_durable = self.group.all_reduce_max([local, durable], "existing snapshots")
        self._newest_durable = newest_durable
        if not self.config.fresh:
            return max(newest, newest_durable)
        if newest_durable > 0:  # refused before anything is removed
            raise ConfigError(
                f"fresh=True, but the durable tier {self.durable_store.url if self.durable_store else ''}"
                f" holds committed snapshots of job {self.config.job!r} up to step {newest_durable}, "
                "which a later restore() would go back to: use a new job name, or remove them "
                "first (aegis prune)"
            )
        if self.engine.is_leader:
            for i in self.store.steps():
                self.store.remove_step(i.step)
        self.group.barrier("fresh start")
        if newest > 0:
            self.events.say(f"fresh=True: removed this job's snapshots up to step {newest} from the node stores")
        return 0

    # -- contract ------------------------------------------------------------------------------

    def restore(self, step: int | None = None) -> int:
        """Load the newest complete committed snapshot; return its step (0 when none).

        Collective. Raises instead of starting from scratch when snapshots exist but none can be
        trusted. With ``step``: exactly that committed step (e.g. to roll back), or
        :class:`~aegis.errors.NoSnapshotError`; snapshots newer than it are then removed from the
        node stores (the job saves those step numbers again), the durable tier keeps its own.

        Args:
            step: the committed step to restore, or None for the newest complete one.

        Returns:
            The restored step, or 0 when the job has no snapshot yet.

        Raises:
            NoSnapshotError: ``step`` is not committed anywhere this job can read.
            AegisError: snapshots exist but none can be trusted (every copy damaged).
        """
        if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 1):
            raise ConfigError(f"restore(step={step!r}): a committed step number >= 1, or None for the newest")
        self._check_open()
        self.engine.wait()
        t0 = time.time()
        try:
            result = restore_newest(
                self.store,
                self.group,
                self.transport,
                durable=self.durable_store,
                node=self.node,
                nodes=self.engine.nodes,
                make_state=self.entries.state_dict,
                check_state=self.entries.check_restore,
                apply_state=self.entries.apply,
                is_leader=self.engine.is_leader,
                step=step,
            )
        finally:
            # what an aborted engine of this process (the last round's) left to free: now,
            # with the restore off the cores
            start_frees()
        self._restore_called = True
        self.last_restore = result
        if result is None:
            self.engine.adopt_committed([])
            self.events.emit("restore", step=0, found=False, seconds=time.time() - t0)
            self.events.say("no snapshot to restore: starting from scratch")
            self._restored(0)
            return 0
        self.engine.adopt_committed(
            [s.step for s in self.store.steps() if s.committed and s.step <= result.step]
        )
        total = result.timings.get("total_s", 0.0)
        nbytes = result.bytes_read
        self.events.emit(
            "restore",
            step=result.step,
            found=True,
            world_size=self.world,
            snapshot_world_size=result.manifest.world_size,
            bytes=nbytes,
            bytes_fetched=result.bytes_fetched,
            seconds=total,
            gbps=nbytes / total / 1e9 if total else 0.0,
            timings=result.timings,
            page_faults=result.page_faults,
            sources=result.sources,
            skipped=result.skipped,
        )
        tiers = sorted({s["source"] for s in result.sources})
        self.events.say(
            f"restored step {result.step} ({format_bytes(result.manifest.total_bytes)} from "
            f"{result.manifest.world_size} rank(s) -> {self.world}) in {total * 1e3:.0f} ms; rank 0 "
            f"read {format_bytes(nbytes)} from {'+'.join(tiers) or 'nothing'}"
            + (f", fetched {format_bytes(result.bytes_fetched)} from "
               + " and ".join(w for t, w in (("peer", "peers"), ("durable", "the durable tier"))
                              if t in tiers)
               if result.bytes_fetched else "")
            + (f"; skipped: {'; '.join(result.skipped)}" if result.skipped else "")
        )
        self._restored(result.step)
        if step is not None and self._newest_durable > step:
            self.events.warn(
                f"restored step {step} on request; the durable tier still holds newer steps (up to "
                f"{self._newest_durable}) of this timeline: a later restore() after a whole-job loss "
                "would choose them, and uploads of the step numbers saved again are refused. Remove "
                "them from the durable tier if this rollback is meant to last"
            )
        return result.step

    def _before_step(self, *_: Any) -> None:
        self.engine.order()

    def _deferral(self) -> Deferral:
        """The storages the optimizers update in place (parameters and optimizer state): their
        only writer is ``optimizer.step()``, which waits for the copies (``_before_step``).
        The same object as last time while every ``ModelOptimizerState`` handed back its cached
        state dict (the same tensors): O(1) then, O(parameters) otherwise."""
        mos = [o for o in self.state.values() if isinstance(o, ModelOptimizerState)]
        key = [id(o._cache[3]) if o._cache is not None else None for o in mos]
        if self._deferred is not None and None not in key and self._deferred[0] == key:
            return self._deferred[1]
        storages: set[int] = set()
        for obj in self.state.values():
            if not isinstance(obj, ModelOptimizerState):
                continue
            for opt in obj.optimizers:
                for group in opt.param_groups:
                    for p in group["params"]:
                        local = p._local_tensor if isinstance(p, DTensor) else p
                        storages.add(local.untyped_storage().data_ptr())
                        for v in opt.state.get(p, {}).values():
                            if isinstance(v, torch.Tensor):
                                t = v._local_tensor if isinstance(v, DTensor) else v
                                storages.add(t.untyped_storage().data_ptr())
        out = Deferral(frozenset(storages))
        self._deferred = (key, out)
        return out

    def _remove_hooks(self) -> None:
        for h in self._hooks:
            with contextlib.suppress(Exception):
                h.remove()
        self._hooks.clear()

    def _restored(self, step: int) -> None:
        self._last_snap_step = self._durable_mark = step
        self._auto_ref = (time.perf_counter(), step)
        self._last_result = None

    def save(self, step: int) -> SnapshotHandle | None:
        """Snapshot the state as ``step`` if ``step % every == 0`` (``every="auto"``: if at
        least the current interval has passed since the last snapshot or restore). Collective.

        Blocks while this rank's shard is copied into host memory; checksums, replication and
        the commit run in the background. Raises the error of the previous snapshot if it failed
        (on every rank: the commit is decided for all), and refuses a step that is not newer
        than the last one saved or restored.

        Args:
            step: the training step just completed (strictly increasing).

        Returns:
            A handle on the snapshot's background work (``wait()`` re-raises its error), or
            None when this step is not snapshotted.

        Raises:
            StepOrderError: ``step`` is not newer than the last one saved or restored.
            AegisError: the previous snapshot failed (on every rank alike).
        """
        self._check_open()
        inprocess.check_round()  # a peer fenced off by an NCCL abort: no snapshot of garbage
        if self._regroup is not None:
            # processes wait to join (the last save's vote, the same on every rank): the round
            # ends here, at the start of the next save(), once that snapshot is committed; so
            # the script's code after the last save() ran, and this step is trained again
            # after the regroup (from the committed step)
            registered, self._regroup = self._regroup, None
            self.engine.wait()
            raise inprocess.Regroup(registered)
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise StepOrderError(f"save(step={step!r}): step must be a non-negative integer")
        if self._existing and not self._restore_called:
            # Same answer on every rank (gathered when the Manager started).
            raise StepOrderError(
                f"save({step}): job {self.config.job!r} already has committed snapshots up to step "
                f"{self._existing}, and this Manager did not call restore(): the next restore would "
                f"go back to step {self._existing} and drop the steps saved now. Call restore() "
                "before the first save(), or pass Manager(..., fresh=True) to start the job over, "
                "or use a new job name (one per experiment)"
            )
        if self._auto is not None:
            return self._auto_save(step)
        assert isinstance(self.config.every, int)
        if step % self.config.every:
            return None
        handle = self.engine.save(step, self.entries.state_dict)
        inprocess.Round.saves += 1
        return self._joined(handle)

    def _joined(self, handle: SnapshotHandle | None) -> SnapshotHandle | None:
        """In-process recovery: processes wait to join (every rank saw the same count through the
        save's all-reduce). The round ends on every rank together at the start of the next
        ``save()`` (see :meth:`save`), so that the next round includes them and every rank
        reshards from this step: never inside this call, whose caller's code after it (logging,
        metrics, evaluation hooks) must run for this step (issue 25: a script's per-step log
        line was lost at a join)."""
        if handle is not None and self.engine.vote is not None and inprocess.joiners_waiting(
                self.engine.last_vote):
            self._regroup = self.engine.last_vote
        return handle

    def _auto_save(self, step: int) -> SnapshotHandle | None:
        """``every="auto"``. Every rank must take the same decision, so the interval changes
        only on numbers all ranks agree on: at each snapshot, after the previous one's
        background work is done (the engine calls the state-dict callable then, with the
        snapshot group idle), one all-reduce takes the slowest rank's blocking time of the
        previous snapshot (its one-off planning left out) and step time since it."""
        assert self._auto is not None
        if step - self._last_snap_step < self._auto.interval:
            return None
        step_s = None
        if self._auto_ref is not None and step > self._auto_ref[1]:
            step_s = (time.perf_counter() - self._auto_ref[0]) / (step - self._auto_ref[1])

        def state_dict() -> dict[str, Any]:
            self._auto_update(step, step_s)
            return self.entries.state_dict()

        handle = self.engine.save(step, state_dict)
        inprocess.Round.saves += 1
        self._last_snap_step = step
        self._auto_ref = (time.perf_counter(), step)
        return self._joined(handle)

    def _auto_update(self, step: int, step_s: float | None) -> None:
        assert self._auto is not None
        r, snap_s = self._last_result, None
        if r is not None and r.committed:
            snap_s = max(0.0, r.blocking_s - r.plan_s)
        snap_us, step_us = self.group.all_reduce_max(
            [-1 if snap_s is None else round(snap_s * 1e6), -1 if step_s is None else round(step_s * 1e6)],
            "auto interval",
        )
        previous = self._auto.interval
        new = self._auto.update(snap_us / 1e6 if snap_us >= 0 else None,
                                step_us / 1e6 if step_us >= 0 else None)
        if new is None:
            return
        c, t = self._auto.snapshot_s or 0.0, self._auto.step_s or 0.0
        daly = daly_interval(c, self._auto.mtbf_s)
        self.events.emit("interval", step=step, every=new, previous=previous, snapshot_s=c,
                         step_s=t, mtbf_s=self._auto.mtbf_s, daly_s=daly,
                         bounded=new in (1, self._auto.every_max))
        self.events.say(
            f"step {step}: snapshot interval {previous} -> {new} steps (blocking {c * 1e3:.1f} ms, "
            f"step {t * 1e3:.0f} ms, MTBF {self._auto.mtbf_s:.0f} s: Daly {daly:.1f} s)"
        )

    def wait(self) -> SnapshotResult | None:
        """Wait until the in-flight snapshot is committed; re-raise its error. Collective."""
        return self.engine.wait()

    def synchronize_staging(self) -> None:
        """``staging="async"`` only (DCP's ``AsyncStager`` has the same call): make changes to parameters or optimizer state that do not
        go through ``optimizer.step()`` safe for the snapshot still being copied. Call it before
        such an in-place change (an EMA written into the parameters, a manual clamp, loading
        weights) between ``save()`` and the next ``optimizer.step()``; the step itself does this
        on its own. On CUDA the current stream waits for the copies (the host does not); on a
        CPU state the host waits. Not collective; a no-op in the other modes."""
        self.engine.order()

    def close(self) -> None:
        """Finish the in-flight snapshot and release resources. Collective. Committed snapshots
        stay in the node store."""
        if self._closed:
            return
        self._closed = True
        try:
            try:
                self.engine.wait()  # the in-flight commit may still queue an upload
            finally:
                try:
                    if self.uploader is not None:
                        # Bounded: an object store that hangs must not hang the end of training.
                        wait_s = self.config.timeout.total_seconds()
                        abandoned = self.uploader.close(timeout=wait_s)
                        if abandoned:
                            self.events.emit("upload_abandoned", pending=abandoned, waited_s=wait_s)
                            self.events.warn(
                                f"{abandoned} durable upload(s) still pending after {wait_s:.0f} s "
                                f"({self.durable_store.url if self.durable_store else ''} does not "
                                "answer); abandoned, the durable tier holds an older step"
                            )
                finally:
                    self.engine.close()
                    self._remove_hooks()
        finally:
            if self.durable_store is not None:
                self.durable_store.close()
            pgs = [self.group.pg, self.transport.pg, self.uploader.group.pg if self.uploader else None]
            if dist.is_initialized():
                for pg in pgs:
                    if pg is not None:
                        dist.destroy_process_group(pg)

    def abort(self, *, begin: bool = True) -> None:
        """Give up without collectives: what in-process recovery calls when a peer is lost
        (``begin=True`` before it destroys the process groups, ``begin=False`` after). Not for
        ordinary use: ``close()`` is the collective, orderly end.

        Args:
            begin: True before the process groups are destroyed, False after.
        """
        self._closed = True
        self._remove_hooks()
        t0 = time.perf_counter()
        self.engine.abort(begin=begin)
        t1 = time.perf_counter()
        uploading: str | None = None
        if self.uploader is not None:
            if begin:
                self.uploader.abort()
            else:  # the running upload ends at its next collective if a peer is gone
                self.uploader._thread.join(timeout=5)
                if self.uploader._thread.is_alive():
                    uploading = thread_where(self.uploader._thread)
        t2 = time.perf_counter()
        if not begin and self.durable_store is not None:
            with contextlib.suppress(Exception):
                self.durable_store.close()
        if not begin and (t2 - t0 > 0.1 or self.engine.busy_at_abort or uploading):
            # a teardown that waited on this Manager's threads (or went on without them: what
            # they still do competes with the next round): how long, and where they were
            self.events.emit("abort_wait", snapshot_s=t1 - t0, upload_s=t2 - t1,
                             snapshot=self.engine.abort_timings,
                             snapshot_at=self.engine.busy_at_abort, upload_at=uploading)

    def __enter__(self) -> Manager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise AegisError("this Manager is closed; create a new one")

    # -- durable tier --------------------------------------------------------------------------

    _dropped: list[int] = []

    def _check_durable(self) -> None:
        assert self.durable_store is not None
        self.durable_store.check()
        if self.group.rank == 0:  # nothing of this job uploads yet: drop a crashed run's half-uploaded steps
            self._dropped = clean_uncommitted(self.durable_store, self.config.job)

    def _upload_due(self, step: int) -> bool:
        """Rank 0, at each commit: upload this step? Broadcast with the commit decision."""
        assert self.uploader is not None
        if self._auto is None:
            crossed = step % self.config.durable_every == 0
        else:  # auto steps need not hit multiples of durable_every: upload on crossing one
            crossed = step // self.config.durable_every > self._durable_mark // self.config.durable_every
        due = crossed or (
            self.config.durable_every_s is not None
            and time.monotonic() - self._last_upload_t >= self.config.durable_every_s
        )
        if not due and not self._upload_owed:
            return False
        if self.uploader.pending > self.config.durable_max_pending:
            # The object store is slow or away: never block the step, never queue without
            # bound; the first commit after the backlog drains uploads at once (catch up).
            if due and not self._upload_owed:
                self.events.warn(f"step {step}: durable upload skipped, {self.uploader.pending} "
                                 "still pending (object store slow or unreachable); will catch up")
            self._upload_owed = self._upload_owed or due
            if due:
                self.events.emit("upload_skipped", step=step, pending=self.uploader.pending)
            return False
        if self._upload_owed and not due:
            self.events.emit("upload_catch_up", step=step)
            self.events.say(f"step {step}: durable tier catching up after skipped uploads")
        self._upload_owed = False
        self._last_upload_t = time.monotonic()
        self._durable_mark = step
        return True

    def _submit_upload(self, commit: Commit) -> None:
        if self.uploader is not None:
            self.uploader.submit(commit)

    def wait_durable(self, timeout: float | None = None) -> None:
        """Block until every queued durable upload is done; raise the last upload error.

        Args:
            timeout: the most seconds to wait, or None for as long as it takes.
        """
        if self.uploader is not None:
            self.uploader.wait(timeout)
            if self.uploader.last_error is not None:
                err, self.uploader.last_error = self.uploader.last_error, None
                raise AegisError(f"durable upload failed: {err}") from err

    def _on_upload(self, r: UploadResult) -> None:
        self.events.emit(
            "upload", step=r.step, committed=r.committed, raw_bytes=r.raw_bytes,
            stored_bytes=r.stored_bytes, ratio=r.raw_bytes / r.stored_bytes if r.stored_bytes else 0.0,
            chunks=r.chunks, seconds=r.seconds, encode_s=r.encode_s, requests=r.requests,
            retries=r.retries, retry_reasons=r.retry_reasons, pruned=r.pruned,
            prune_error=r.prune_error, error=r.error,
            store=self.durable_store.url if self.durable_store else None,
        )
        if r.committed:
            self.events.say(
                f"step {r.step}: durable upload committed ({format_bytes(r.raw_bytes)} -> "
                f"{format_bytes(r.stored_bytes)} on rank 0, {r.seconds:.2f} s, {r.retries} retries)"
            )
        elif r.error:
            self.events.say(f"step {r.step}: durable upload failed: {r.error}")

    # -- events --------------------------------------------------------------------------------

    def _on_snapshot(self, r: SnapshotResult) -> None:
        self._last_result = r
        self.events.emit(
            "snapshot",
            step=r.step,
            committed=r.committed,
            bytes=r.shard_bytes,
            tensor_bytes=r.tensor_bytes,
            snapshot_bytes=r.snapshot_bytes,
            blocking_ms=r.blocking_s * 1e3,
            wait_ms=r.wait_s * 1e3,
            copy_ms=r.copy_s * 1e3,
            plan_ms=r.plan_s * 1e3,
            plan_reused=r.plan_reused,
            staging_gbps=r.staging_gbps,
            background_ms=r.background_s * 1e3,
            commit_ms=r.commit_s * 1e3,
            replicate_ms=r.replicate_s * 1e3,
            replica_bytes=r.replica_bytes,
            replica_sent_bytes=r.replica_sent_bytes,
            replica_copy_ms=r.replica_copy_s * 1e3,
            skipped=r.skipped,
            error=r.error,
        )
        if r.skipped:
            self.events.warn(
                f"step {r.step}: memory snapshot skipped, a node store is full ({r.error}); the "
                "previous snapshot stays committed, training goes on. Free space on that tmpfs."
            )
        if r.committed:
            self.events.say(
                f"step {r.step}: snapshot {format_bytes(r.snapshot_bytes)} committed; rank 0 "
                f"blocked {r.blocking_s * 1e3:.1f} ms ({r.staging_gbps:.2f} GB/s copy), background "
                f"{r.background_s * 1e3:.1f} ms"
            )


