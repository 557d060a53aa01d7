"""The snapshot engine: async, double-buffered in-memory snapshots of a sharded state dict.

Who calls what: every rank of the snapshot group calls :meth:`SnapshotEngine.save` with the same
step, in the same order (it is collective). ``save`` blocks while it copies the rank's shard into
a pre-faulted slot in the node store and returns a :class:`SnapshotHandle`; a background thread
per rank then checksums the shard, writes its index, protects it through the world's
redundancy scheme (:mod:`.redundancy`: replicas pushed, or parity exchanged), and takes part in
the commit: rank 0 gathers every rank's shard record, builds the manifest and broadcasts it; the
first rank of each node writes it into that node's store. Only then is the step committed. The
rank's slots come from its :class:`~aegis.snapshot.slot_pools.SlotPools`.

Double buffer: a save first waits for the previous snapshot's background work, so at most one
snapshot is in flight, and an error from it is raised by that next ``save`` (or ``wait``).

Plan caching: the DCP save plan (local plan -> global plan with de-duplication -> final plan) is
computed through DCP's ``DefaultSavePlanner`` on the first save and reused while the structure
of the state dict (names, dtypes, shapes, sharding) is unchanged; a change on any rank makes
every rank plan again, decided by one small all-reduce per save.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from aegis import _fault
from aegis._dist import Group
from aegis.errors import AegisError, CollectiveError, StepOrderError, StoreFullError
from aegis.snapshot import hostmem
from aegis.snapshot.dcp_io import DEFAULT_CHUNK_BYTES, StagedShard, complete, stage
from aegis.snapshot.engine_plan import (
    CachedPlan,
    _DaemonWorker,
    _fast_resolvable,
    _Flattener,
    _fp_digest,
    _plans,
    _remember_plan,
    _resolver,
)
from aegis.snapshot.manifest import (
    BytesEntry,
    Commit,
    EncodedManifest,
    Manifest,
    ShardRecord,
    TensorEntry,
)
from aegis.snapshot.node_manifest import Layout, StepManifest, shards_digest
from aegis.snapshot.node_store import NodeStore, Slot, await_frees, free_later, is_store_full
from aegis.snapshot.redundancy import Protected, Scheme, build, shard_summary
from aegis.snapshot.shard import FOOTER_SIZE, ShardLayout, decode_footer, plan_layout
from aegis.snapshot.slot_pools import SlotPools
from aegis.snapshot.staging import CopyBarrier, Stager
from aegis.snapshot.transport import Transport

__all__ = ["SnapshotEngine", "SnapshotHandle", "SnapshotResult", "format_bytes"]

_TAIL_ALLOWANCE = 1 << 20  # bytes region + index, estimated for the free-space check


def _release_later(slots: list[Slot], paths: list[Path]) -> None:
    """Close ``slots`` (unmap) and unlink ``paths`` on a daemon thread, started once the next
    restore is done (``start_frees``; freeing the pages of an aborted 1 GB-per-rank engine took
    ~1 s of a core here, py-spy, which the rebuild and the restore of the next round then
    shared two cores with); ``await_frees`` starts and waits for it: every engine of the
    process before it counts the store's free bytes, and at its close."""
    def run() -> None:
        for slot in slots:
            with contextlib.suppress(Exception):
                slot.close()
        for path in paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    free_later(run, "aegis-slot-release", defer=True)


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError


@dataclass
class SnapshotResult:
    """What one rank measured for one snapshot."""

    step: int
    rank: int
    node: str
    committed: bool = False
    shard_bytes: int = 0
    tensor_bytes: int = 0
    blocking_s: float = 0.0
    wait_s: float = 0.0  # part of blocking_s spent waiting for the previous snapshot
    copy_s: float = 0.0
    plan_s: float = 0.0  # > 0 only when this save (re)planned
    plan_reused: bool = False  # planned with the plan of an earlier round (see Engine._make_plan)
    background_s: float = 0.0
    commit_s: float = 0.0
    snapshot_bytes: int = 0  # all ranks together (known on every rank after commit)
    replicate_s: float = 0.0
    replica_bytes: int = 0  # replicas this rank received and holds
    replica_sent_bytes: int = 0  # bytes this rank sent for replicas (redundancy="dp": its unshared part)
    replica_copy_s: float = 0.0  # redundancy="dp": copying sources' tensors from this rank's own (blocking)
    encode_s: float = 0.0  # XOR parity: segments exchanged and folded into this rank's parity
    encode_compute_s: float = 0.0  # the part of encode_s spent in crc32c and XOR on this rank
    parity_bytes: int = 0  # XOR parity this rank holds
    deferred_s: float = 0.0  # staging="async": from issuing the deferred copies to their end
    pin_s: float = 0.0  # seconds spent registering own slots as pinned memory (background)
    error: str | None = None
    skipped: bool = False  # not committed because a node store was full (training goes on)

    @property
    def staging_gbps(self) -> float:
        return self.tensor_bytes / self.copy_s / 1e9 if self.copy_s > 0 else 0.0


class SnapshotHandle:
    """Future-like handle of one snapshot's background work."""

    def __init__(self, step: int, future: Future[SnapshotResult]) -> None:
        self.step = step
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> SnapshotResult:
        """Block until the snapshot is committed (or failed); re-raises its error. A snapshot
        skipped because a node store was full is not an error: its result says ``skipped``."""
        return self._future.result(timeout)


@dataclass
class _Plan:
    fingerprint: tuple[Any, ...]
    layout: ShardLayout
    entries: dict[str, TensorEntry | BytesEntry] = field(default_factory=dict)
    planner_data: dict[str, tuple[str | int, ...]] = field(default_factory=dict)
    fast: bool = False  # sources resolved by _resolver, not DCP's planner


class SnapshotEngine:
    """Async in-memory snapshots of one rank into its node store. See the module docstring.

    Construction is collective (all ranks gather their node ids).
    """

    def __init__(
        self,
        store: NodeStore,
        group: Group,
        *,
        keep: int = 1,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        node: str = "local",
        domain: str | None = None,
        replicas: int = 0,
        transport: Transport | None = None,
        on_result: Callable[[SnapshotResult], None] | None = None,
        mesh: dict[str, Any] | None = None,
        upload_filter: Callable[[int], bool] | None = None,
        on_commit: Callable[[Commit], None] | None = None,
        extra_snapshots: int = 0,
        state_kinds: Mapping[str, str] | None = None,
        redundancy: str = "replica",
        group_size: int = 5,
        parity: int = 2,
        staging: str = "sync",
        parity_fallback: bool = False,
        stable_entries: Iterable[tuple[str, str]] = (),
    ) -> None:
        self.store = store
        self.stager = Stager(staging)
        self._barrier: CopyBarrier | None = None  # the in-flight snapshot's deferred copies (async)
        # entry name -> kind, recorded in each manifest; the owner (the Manager) fills it in when
        # it builds the state dict, before the save that commits it
        self.state_kinds = state_kinds if state_kinds is not None else {}
        # an integer every rank contributes to save()'s all-reduce; last_vote is the maximum
        # (in-process recovery: how many processes wait to join, the same answer on every rank)
        self.vote: Callable[[], int] | None = None
        self.last_vote = 0
        # why this rank's state can no longer be trusted (in-process recovery: a peer fenced off
        # by an NCCL abort), checked before this rank reports its shard to the commit
        self.poisoned: Callable[[], str | None] | None = None
        self.group = group
        self.rank = group.rank
        self.world = group.world
        self.keep = keep
        self.chunk_bytes = chunk_bytes
        self.node = node
        self.on_result = on_result
        self.mesh = mesh or {}
        self.extra_snapshots = extra_snapshots  # snapshots that uploads may hold beyond keep
        self.upload_filter = upload_filter  # rank 0 decides which commits go to the durable tier
        self.on_commit = on_commit  # every rank, for each commit chosen for upload
        self._pinned: dict[int, int] = {}
        self._pin_s = 0.0  # registration seconds not yet reported in a result
        ids = group.all_gather((node, domain or node), "node discovery")
        self.nodes: list[str] = [n for n, _ in ids]
        self.is_leader = self.nodes.index(node) == self.rank  # first rank of this node
        self.local_world = self.nodes.count(node)
        self._local_ranks = [r for r, n in enumerate(self.nodes) if n == node]
        store.create()
        if self.is_leader:  # free slots of ranks no longer on this node (renumbered on restart)
            local = {r for r, n in enumerate(self.nodes) if n == node}
            for f in store.slots_dir.iterdir():
                with contextlib.suppress(ValueError, OSError):
                    if int(f.name.split("-", 1)[1].split(".", 1)[0]) not in local:
                        f.unlink()
        self._lock = threading.RLock()  # pools, slot names, committed list, pins
        self.slots = SlotPools(store, self.rank, pins=self.stager.pins, lock=self._lock)
        # how the snapshot survives a lost node (aegis.snapshot.redundancy)
        self.redundancy: Scheme = build(
            redundancy, nodes=self.nodes, domains=[d for _, d in ids], rank=self.rank, group=group,
            pools=self.slots, transport=transport, replicas=replicas, group_size=group_size,
            parity=parity, parity_fallback=parity_fallback)
        r = self.redundancy
        self.placement, self.groups, self.group_of = r.placement, r.groups, r.group_of
        self.scheme, self.parity, self.degraded = r.name, r.losses, r.degraded
        self.targets, self.sources = r.targets, r.sources
        self._planner = DefaultSavePlanner()
        # rank 0: the format-4 layout of the current plan, and the digest last sent to leaders
        self._layout: Layout | None = None
        self._layout_sent: str | None = None
        # write whole manifests (format 2) every step as before format 4: bench/scale.py's
        # comparison arm, nothing else
        self.whole_manifests = False
        # stable_entries: the owner's (top key, entry name) pairs whose state_dict() hands back
        # the same object while its tensors are the live ones (flattened once, _Flattener)
        self._flat = _Flattener(stable_entries)
        self._plan: _Plan | None = None
        # (step, own slot or None for a step found on restore, replica slots), oldest first
        self._committed: list[tuple[int, Slot | None, list[Slot]]] = []
        self._inflight: tuple[SnapshotHandle, Slot | None] | None = None
        self.last_step = -1  # newest step saved or restored: save() must go beyond it
        self._executor = _DaemonWorker(f"aegis-snap-r{self.rank}")
        self._closed = False
        self.busy_at_abort: str | None = None  # abort() gave up waiting on the thread: where it was
        self.abort_timings: dict[str, float] = {}  # abort(begin=False): waiting, releasing the slots
        if self.stager.pins:
            self.slots.adopt_kept()

    # -- public --------------------------------------------------------------------------------

    @property
    def committed_steps(self) -> list[int]:
        return [s for s, _, _ in self._committed]

    def adopt_committed(self, steps: list[int]) -> None:
        """Steps already committed in the store (found on restore); they count toward ``keep``
        and are evicted (leader removes the directory) like any other."""
        self._committed = [(s, None, []) for s in sorted(steps)]
        self.last_step = max(steps, default=-1)

    def save(self, step: int, state_dict: dict[str, Any] | Callable[[], dict[str, Any]]) -> SnapshotHandle:
        """Snapshot ``state_dict`` as ``step``. Collective; blocks only for the copy.

        ``state_dict`` may be a callable, called after the previous snapshot is finished, so that
        taking the state dict counts in the blocking time this reports.
        """
        if self._closed:
            raise AegisError("save() after close(): create a new Manager")
        if step <= self.last_step:
            # Same answer on every rank (the last step is common knowledge), so no rank waits.
            raise StepOrderError(
                f"save({step}): step {self.last_step} is already snapshotted or restored; steps must "
                "increase (saving a step again would replace a committed snapshot)"
            )
        t0 = time.perf_counter()
        self.wait()  # double buffer: at most one snapshot in flight; raises its error
        wait_s = time.perf_counter() - t0
        if callable(state_dict):
            state_dict = state_dict()
        planner = self._planner
        flat, fingerprint = self._flat.flatten(state_dict)
        changed = self._plan is None or fingerprint != self._plan.fingerprint
        # the first save of this engine: a plan this process made before for this world size,
        # rank and state (an earlier round), reused if every rank holds the one of the same plan
        cached = self._cached_plan(fingerprint) if self._plan is None else None
        g = cached[1][0] if cached is not None else -1
        vote = [self.vote()] if self.vote is not None else []
        any_changed, hi, neg_lo, g_hi, neg_g_lo, *voted = self.group.all_reduce_max(
            [int(changed), step, -step, g, -g, *vote], "save")
        self.last_vote = voted[0] if voted else 0
        if hi != -neg_lo:
            raise StepOrderError(
                f"ranks called save() with different steps (from {-neg_lo} to {hi}); every rank "
                "must call save(step) with the same step, in the same order"
            )
        plan_s = 0.0
        reuse = bool(any_changed) and cached is not None and g_hi == -neg_g_lo >= 0
        if any_changed:
            tp = time.perf_counter()
            if not reuse:
                planner.set_up_planner(state_dict, storage_meta=None, is_coordinator=self.rank == 0)
            self._plan = self._make_plan(planner, fingerprint, cached[1] if reuse and cached else None)
            self._layout = None  # a new plan, a new layout (built at its first commit)
            self._plan.fast = _fast_resolvable(flat, self._plan.layout)
            plan_s = time.perf_counter() - tp
            any_changed = not reuse  # a reused plan: the planner is set up below when needed
        assert self._plan is not None
        if self._plan.fast:
            resolve = _resolver(flat)
        else:
            if not any_changed:
                planner.set_up_planner(state_dict, storage_meta=None, is_coordinator=self.rank == 0)
            resolve = planner.resolve_data
        self.last_step = step
        result = SnapshotResult(step=step, rank=self.rank, node=self.node, wait_s=wait_s, plan_s=plan_s,
                                plan_reused=reuse, tensor_bytes=self._plan.layout.tensor_bytes)
        slot: Slot | None = None
        staged: StagedShard | None = None
        error: BaseException | None = None
        try:
            slot = self.slots.take_own(step, self._plan.layout)
            staged = stage(step, self.rank, self._plan.layout, slot, resolve, self.stager)
            result.copy_s = staged.copy_s
        except Exception as e:  # noqa: BLE001 - every rank must still take part in the commit
            error = e
        tl = time.perf_counter()
        # redundancy="dp": the replicas this rank builds from its own copy (never raises:
        # protect() reports its failures); copies it defers join this snapshot's barrier
        later = self.redundancy.stage_local(step, resolve, self.stager if staged is not None else None)
        if later and staged is not None:
            if staged.barrier is not None:
                staged.barrier.later.extend(later)
            else:
                staged.barrier = self.stager.begin_deferred(later, False)
        result.replica_copy_s = time.perf_counter() - tl
        self._barrier = staged.barrier if staged is not None else None
        if self._barrier is not None:  # async: the deferred copies run first on the worker
            self._executor.submit(self._run_deferred, self._barrier, step)
        result.blocking_s = time.perf_counter() - t0
        future = self._executor.submit(self._finish, result, slot, staged, error)
        handle = SnapshotHandle(step, future)
        self._inflight = (handle, slot)
        if error is not None and not is_store_full(error):
            # A full store is decided for every rank by the commit (the step is skipped); any
            # other copy failure is a bug or a broken state, and stops this rank.
            raise AegisError(f"snapshot of step {step} failed while copying on rank {self.rank}: {error}") from error
        return handle

    def wait(self) -> SnapshotResult | None:
        """Wait for the in-flight snapshot; re-raise its error once. Collective in effect (its
        background commit needs every rank)."""
        inflight, self._inflight = self._inflight, None
        if inflight is None:
            return None
        return inflight[0].wait()

    def _run_deferred(self, barrier: CopyBarrier, step: int) -> None:
        try:
            _fault.hit("deferred", step, self.rank)
        finally:  # the barrier is always resolved: an optimizer step may be waiting on it
            self.stager.run_deferred(barrier)

    def order(self) -> None:
        """What may overwrite the state next (an optimizer step) is ordered after the in-flight
        snapshot's deferred copies (``staging="async"``): on CUDA the current stream waits for
        them (the host does not), on a CPU state the host waits. A no-op otherwise. Called by the
        Manager's optimizer step pre-hooks, on the training thread."""
        barrier = self._barrier
        if barrier is not None:
            barrier.order()
            self._barrier = None

    def close(self) -> None:
        """Finish the in-flight snapshot, then release the slots (free ones are deleted)."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._executor.shutdown(wait=True)
            await_frees()
            for slot in self.slots.spares():
                slot.close(keep=False)
            self.slots.unlink_spares()
            for _, own, replica_slots in self._committed:
                held: list[Slot | None] = [own, *replica_slots]
                for s in held:
                    if s is not None:
                        s.close(keep=False)
            if self.stager.pins:
                hostmem.sweep()

    def abort(self, *, begin: bool, timeout: float = 0.5) -> None:
        """Give up without collectives (in-process recovery: a peer is gone). ``begin=True``
        before the process groups are destroyed: no new work; ``begin=False`` after: wait (at
        most ``timeout``) for the background thread, whose transfer the destroyed group ends,
        then release the slots. Committed snapshots stay in the node store."""
        self._closed = True
        if begin:
            self._executor.shutdown(wait=False)
            return
        t0 = time.perf_counter()
        self._executor.shutdown(wait=True, timeout=timeout)
        self.abort_timings = {"wait_s": time.perf_counter() - t0}
        if self._executor.alive:
            # still blocked (a stopped peer) or still busy: its slots stay mapped until it ends;
            # where it is goes into the Manager's abort event
            self.busy_at_abort = self._executor.where()
            return
        with self._lock:
            slots = self.redundancy.staged_slots()
            if self._inflight is not None and self._inflight[1] is not None:
                slots.append(self._inflight[1])
            for _, own, replica_slots in self._committed:
                slots.extend(s for s in (own, *replica_slots) if s is not None)
            if self.stager.pins:
                # spares go; with device staging own ones stay with their mappings (kept by
                # this process, registered) for the next round's engine (SlotPools.adopt_kept)
                for slot in [*self.slots.spares(), *slots]:
                    slot.close()
                self.slots.unlink_spares(keep_own=True)
                spares: list[Slot] = []
                trash: list[Path] = []
            else:
                # renamed out of the pools now (the next engine of this process never sees
                # them); unmapped and unlinked on a thread: freeing their pages took 0.66-1.37 s
                # of a 1 GB-per-rank teardown here (the next engine waits for it before it
                # counts the store's free bytes)
                spares, trash = self.slots.trash_spares()
            self._committed.clear()
            self._inflight = None
        if not self.stager.pins:
            _release_later([*spares, *slots], trash)
        self.abort_timings["release_s"] = time.perf_counter() - t0 - self.abort_timings["wait_s"]

    # -- planning ------------------------------------------------------------------------------

    def _plan_key(self, fingerprint: tuple[Any, ...]) -> tuple[Any, ...]:
        return (self.store.job, self.world, self.rank, self.chunk_bytes, _fp_digest(fingerprint),
                self.redundancy.plan_key())

    def _cached_plan(self, fingerprint: tuple[Any, ...]) -> tuple[tuple[Any, ...], CachedPlan] | None:
        key = self._plan_key(fingerprint)
        hit = _plans.get(key)
        return (key, hit) if hit is not None else None

    def _make_plan(self, planner: DefaultSavePlanner, fingerprint: tuple[Any, ...],
                   cached: CachedPlan | None = None) -> _Plan:
        """DCP planning, collective: local plans -> rank 0 -> global plan -> every rank.

        ``cached``: a plan this process made in an earlier round, that every rank agreed to
        reuse (the save's all-reduce found the same key on every rank). The key is the digest
        of every rank's fingerprint digest at that plan, and each rank's entry is its own
        fingerprint at its rank, so the ranks now hold the same states as then, and DCP's plan
        (a function of those states) would come out the same: it is not made again. Saves the
        local plans, their gather, rank 0's global plan (O(world x tensors)) and the scatter: on
        the first save after a recovery in the long chaos campaign (6 processes, 2 cores) a new
        plan took 31-413 ms (median 57), a reused one 4-22 ms (median 11)."""
        key = self._plan_key(fingerprint)
        if cached is not None:
            _, layout, entries, planner_data, extra = cached
            _remember_plan(key, cached)  # most recently used last
        else:
            local = planner.create_local_plan()
            plans = self.group.gather((local, _fp_digest(fingerprint)), "plan gather")
            outcome: list[tuple[bool, Any]] | None = None
            entries = {}
            planner_data = {}
            if self.rank == 0:
                assert plans is not None
                try:
                    global_plans, metadata = planner.create_global_plan([p for p, _ in plans])
                    everyone = int.from_bytes(hashlib.sha256(b"".join(d for _, d in plans)).digest()[:7], "big")
                    extras = self.redundancy.plan_extras([p for p, _ in plans], global_plans,
                                                         self.chunk_bytes) or [None] * self.world
                    outcome = [(True, (p, everyone, x)) for p, x in zip(global_plans, extras, strict=True)]
                    entries = Manifest.entries_from_dcp(metadata)
                    planner_data = {k: tuple(v) for k, v in (metadata.planner_data or {}).items()}
                except Exception as e:  # noqa: BLE001 - sent to every rank
                    outcome = [(False, f"{type(e).__name__}: {e}")] * self.world
            ok, central = self.group.scatter(outcome, "plan scatter")
            if not ok:
                raise AegisError(f"DCP could not plan the snapshot: {central}")
            central_plan, everyone, extra = central
            final = planner.finish_plan(central_plan)
            layout = plan_layout(final.items, chunk_bytes=self.chunk_bytes)
            _remember_plan(key, (everyone, layout, entries, planner_data, extra))
        self.redundancy.adopt(extra, layout)  # the scheme's part of the plan (redundancy="dp")
        self._check_capacity(layout)
        plan = _Plan(fingerprint, layout, entries, planner_data)
        # keep + 1 pre-faulted slots, so no later save pays for first-touch page faults: the one
        # this save copies into now, the others in the background (queued before this save's
        # commit, so they are ready before the next save takes a slot).
        in_use = sum(1 for _, s, _ in self._committed if s is not None)
        with self._lock:
            own = self.slots.own
            while len(own) + in_use < self.keep + 1:
                own.append(self.slots.new_own())
            if own:
                with contextlib.suppress(StoreFullError):  # the save then skips (SlotPools.take_own)
                    own[-1].ensure(layout.tensor_end)
            later = list(own[:-1])
        if later:
            def prefault() -> None:
                for s in later:
                    s.ensure(layout.tensor_end)
                    if self.stager.pins:
                        self._pin_s += s.pin() or 0.0

            self._executor.submit(prefault)
        return plan

    def _check_capacity(self, layout: ShardLayout) -> None:
        """Fail before the first save if this node's store cannot hold keep + 1 snapshots."""
        await_frees()  # an aborted engine's slots still being freed would count as used
        per_shard = layout.tensor_end + _TAIL_ALLOWANCE
        # own shard + the replicas this rank receives, for keep + 1 snapshots
        copies = self.redundancy.copies_per_shard()
        need = int((self.keep + 1 + self.extra_snapshots) * per_shard * (1 + copies))
        reusable = self.slots.reusable_bytes()
        reports = self.group.all_gather(
            (self.node, need, reusable, self.store.free_bytes()), "capacity check"
        )
        short = []
        for node in dict.fromkeys(self.nodes):
            mine = [r for r in reports if r[0] == node]
            node_need = sum(r[1] for r in mine)
            node_have = mine[0][3] + sum(r[2] for r in mine)
            if node_need > node_have:
                short.append(
                    f"the node store on node {node!r} needs {format_bytes(node_need)} ({self.keep} "
                    f"kept + 1 in flight + {self.extra_snapshots} held for uploads, {len(mine)} local rank(s), "
                    f"{self.placement.effective_replicas} replica(s), about "
                    f"{format_bytes(per_shard)} per shard here) but has {format_bytes(node_have)} free"
                )
        if short:
            raise StoreFullError(
                f"{'; '.join(short)} ({self.store.dir}). Free space on that tmpfs, lower keep "
                f"(now {self.keep}), or point store_dir (or AEGIS_STORE_DIR) at a larger tmpfs, "
                "e.g. `mount -o remount,size=<bytes> /dev/shm`"
            )

    # -- background ----------------------------------------------------------------------------

    def _finish(self, result: SnapshotResult, slot: Slot | None, staged: StagedShard | None,
                error: BaseException | None) -> SnapshotResult:
        """Background, every rank: checksum + index, replicate, then the commit protocol:
        gather shard and replica reports on rank 0 -> broadcast the manifest (or an abort) ->
        node leaders write it -> all-gather the writes -> evict.

        Every rank runs every collective of this protocol exactly once whatever fails locally:
        local failures travel in the reports, and the abort is decided for everyone."""
        t0 = time.perf_counter()
        record: ShardRecord | None = None
        err = f"{type(error).__name__}: {error}" if error is not None else None
        full = error is not None and is_store_full(error)  # only a full store on this rank?
        if staged is not None and staged.barrier is not None:
            try:  # the deferred copies must be in the slot before anything reads it
                staged.barrier.wait()
            except Exception as e:  # noqa: BLE001 - reported to rank 0
                err = err or f"deferred copy: {type(e).__name__}: {e}"
            result.deferred_s = staged.barrier.seconds
        if staged is not None and err is None:
            try:
                record = complete(staged, job=self.store.job, node=self.node)
                result.shard_bytes = record.size
            except Exception as e:  # noqa: BLE001 - reported to rank 0
                err, full = f"{type(e).__name__}: {e}", is_store_full(e)
        protected = Protected()
        ok = err is None and slot is not None
        try:
            protected = self.redundancy.protect(result.step, slot if ok else None, staged if ok else None, result)
            full = protected.full if err is None else full and protected.full
        except Exception as e:  # noqa: BLE001 - a peer that stopped answering: abort for everyone
            err, full = err or f"{self.redundancy.what}: {type(e).__name__}: {e}", False
        received, replica_slots = protected.received, protected.slots
        result.replica_bytes = sum(os.fstat(s.fd).st_size for s in replica_slots if s.kind == "replica")
        if self.poisoned is not None and (why := self.poisoned()) is not None:
            err, full = err or f"round abandoned: {why}", False
        tc = time.perf_counter()
        # (size, index crc32c): O(1) per rank, the format-4 step manifest needs nothing more
        # (each shard's index holds the rest); with parity groups also where the index starts
        # (a lost member's index is rebuilt from parity, issue 40). Whole records only for the
        # benchmarks' whole-manifest comparison.
        sent: Any = record
        if record is not None and not self.whole_manifests:
            sent = (record.size, record.index_crc32c)
            if self.groups and staged is not None:
                sent += (decode_footer(staged.tail[-FOOTER_SIZE:], size=record.size,
                                       where="this rank's shard")[0],)
        reports = self.group.gather(
            (sent, err, received, result.blocking_s, result.copy_s, full, protected.parity), "commit gather"
        )
        decision: tuple[str, Any] | None = None
        whole: Manifest | None = None  # rank 0: a whole manifest, sent as its text
        if self.rank == 0:
            assert reports is not None
            try:
                decision = self._decide_commit(result.step, reports, tc - t0)
                if decision[0] == "commit" and isinstance(decision[1][0], Manifest):
                    whole = decision[1][0]
                    decision = ("commit", (EncodedManifest.of(whole), *decision[1][1:]))
            except Exception as e:  # noqa: BLE001 - every rank must hear the outcome
                decision = ("abort", ({0: f"commit decision: {type(e).__name__}: {e}"}, False))
        kind, payload = self.group.broadcast(decision, "commit broadcast")
        if kind == "commit":
            manifest, upload, layout = payload
            write_err: tuple[str, bool] | None = None
            if self.is_leader:
                try:
                    _fault.hit("commit", result.step, self.rank)
                    # parity groups: a node keeps its own groups' records only
                    mine = manifest.for_ranks(self._local_ranks) \
                        if isinstance(manifest, StepManifest) else manifest
                    self.store.write_manifest(mine, layout)  # a new plan's layout first
                    if layout is not None:
                        self.store.prune_layouts()
                except Exception as e:  # noqa: BLE001 - e.g. a full tmpfs
                    write_err = (f"writing the manifest on node {self.node!r}: {type(e).__name__}: {e}",
                                 is_store_full(e))
            # Evict nothing until every node holds the new manifest: a leader dying (or failing)
            # before its write must leave the previous snapshot complete everywhere.
            writes = self.group.all_gather(write_err, "commit acknowledge")
            failed = {r: w[0] for r, w in enumerate(writes) if w is not None}
            if failed:
                if self.is_leader:
                    self.store.uncommit(result.step)
                kind, payload = "abort", (failed, all(w[1] for w in writes if w is not None))
        if kind == "abort":
            failures, skipped = payload
            self.slots.discard(result.step, [slot, *replica_slots])
            failure = CollectiveError(f"snapshot of step {result.step}", failures)
            result.error = str(failure)
            if skipped:
                # Every failure was a full node store: skip this snapshot on every rank (the
                # previous committed one stays), warn through the result, keep training.
                result.skipped = True
                result.background_s = time.perf_counter() - t0
                self._report(result)
                return result
            self._report(result)
            raise failure
        result.committed = True
        result.snapshot_bytes = manifest.total_bytes
        assert slot is not None
        # Past the last collective: nothing below may raise on one rank only.
        with self._lock:
            self._committed.append((result.step, slot, replica_slots))
        if upload and self.on_commit is not None:
            try:
                # a whole manifest: rank 0's object (the others upload their own record)
                self.on_commit(Commit(
                    step=result.step, record=record, whole=whole,
                    step_manifest=manifest if isinstance(manifest, StepManifest) else None,
                    layout=self._layout if self.rank == 0 else None))
            except Exception as e:  # noqa: BLE001 - reported as an event, not raised on one rank
                result.error = f"queueing the durable upload failed: {type(e).__name__}: {e}"
        with self._lock:
            try:
                self._evict()
            except Exception as e:  # noqa: BLE001
                result.error = f"eviction failed: {type(e).__name__}: {e}"
        if sizes := [s.capacity for s in replica_slots if s.kind == "replica"]:  # the next save's,
            self._executor.submit(self.slots.stock_replicas, sizes)  # pre-faulted: see there
        result.commit_s = time.perf_counter() - tc
        if self.stager.pins and not slot.pinned:
            # the slot of a first save after a (re)plan was copied unpinned: register it now,
            # off the training thread, for the saves that reuse it
            self._pin_s += slot.pin() or 0.0
        result.pin_s, self._pin_s = self._pin_s, 0.0
        result.background_s = time.perf_counter() - t0
        self._report(result)
        return result

    def _report(self, result: SnapshotResult) -> None:
        if self.on_result is not None:
            with contextlib.suppress(Exception):  # events must never break the commit protocol
                self.on_result(result)

    def _decide_commit(self, step: int, reports: list[Any], complete_s: float) -> tuple[str, Any]:
        """Rank 0: commit only if every shard is stored and every replica verified against the
        owner's index crc32c."""
        failures: dict[int, str] = {}
        records = {r: rep[0] for r, rep in enumerate(reports)}
        summary = {r: shard_summary(rec) for r, rec in records.items() if rec is not None}
        full = {r: rep[5] for r, rep in enumerate(reports)}
        for r, rep in enumerate(reports):
            if rep[1] is not None:
                failures[r] = rep[1]
        held, redundancy = self.redundancy.verify(reports, records, summary, self.nodes, failures, full)
        if failures:
            # Skipped (not an error) only when every failing rank ran out of node-store room.
            return ("abort", (failures, all(full[r] for r in failures)))
        upload = bool(self.upload_filter and self.upload_filter(step))
        timings = {
            "blocking_s_max": max(rep[3] for rep in reports),
            "copy_s_max": max(rep[4] for rep in reports),
            "complete_replicate_s_rank0": complete_s,
        }
        if not self.whole_manifests:
            # format 4: the layout once per plan (sent with the first commit that needs it), a
            # step record of constant size per step; with parity groups the groups and their
            # members' (size, index start), of which each node keeps its own
            # groups' (O(world) small numbers in the broadcast, O(group) written per node)
            if self._layout is None:
                self._layout = Layout(job=self.store.job, world_size=self.world,
                                      nodes=tuple(self.nodes),
                                      entries=self._plan.entries if self._plan else {},
                                      planner_data=self._plan.planner_data if self._plan else {},
                                      state_kinds=dict(self.state_kinds), mesh=self.mesh)
            new = self._layout.digest != self._layout_sent
            self._layout_sent = self._layout.digest
            pairs = [summary[r] for r in range(self.world)]
            members = {} if redundancy is None else {
                m: (records[m][0], records[m][2])
                for g in redundancy.groups for m in g.members}
            step_manifest = StepManifest(
                job=self.store.job, step=step, world_size=self.world, layout=self._layout.digest,
                shards_digest=shards_digest(pairs), total_bytes=sum(sz for sz, _ in pairs),
                created=time.time(), timings=timings, parity=redundancy, members=members)
            return ("commit", (step_manifest, upload, self._layout if new else None))
        return ("commit", (Manifest(
            job=self.store.job,
            step=step,
            world_size=self.world,
            shards=tuple(dataclasses.replace(records[r], replicas=tuple(held[r]))
                         for r in range(self.world)),
            entries=self._plan.entries if self._plan else {},
            planner_data=self._plan.planner_data if self._plan else {},
            state_kinds=dict(self.state_kinds),
            redundancy=redundancy,
            mesh=self.mesh,
            timings=timings,
            created=time.time(),
        ), upload, None))

    def pin(self, step: int) -> None:
        """Keep ``step`` in the node store (beyond ``keep``) until :meth:`unpin` (an upload)."""
        with self._lock:
            self._pinned[step] = self._pinned.get(step, 0) + 1

    def unpin(self, step: int) -> None:
        with self._lock:
            n = self._pinned.get(step, 0) - 1
            if n > 0:
                self._pinned[step] = n
            else:
                self._pinned.pop(step, None)
            self._evict()

    def _evict(self) -> None:
        """Keep the newest ``keep`` committed snapshots (and pinned ones); the newest committed
        one is never evicted. Caller holds the lock."""
        candidates = self._committed[: max(len(self._committed) - max(self.keep, 1), 0)]
        for entry in candidates:
            step, slot, replica_slots = entry
            if step in self._pinned:
                continue
            self._committed.remove(entry)
            if self.is_leader:
                self.store.uncommit(step)  # manifest first: a half-evicted step is never chosen
            if slot is not None:
                for held in (slot, *replica_slots):
                    self.slots.release(held)
                self.store.remove_dir_if_empty(step)
            elif self.is_leader:
                self.store.remove_step(step)  # from an earlier run: nobody maps its files
        if self.stager.pins:
            hostmem.sweep()  # a kept mapping of a removed step (another rank's, or a leader's)
