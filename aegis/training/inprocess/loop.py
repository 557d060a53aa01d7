"""The round loop: form a round, run ``train(world)`` in it, and after a lost peer (or joiners
admitted) tear it down and form the next one, in the same process.

Phases of one recovery, each behind its own module: *detect* (the heartbeat thread of
:mod:`.membership` fences a silent member through the round's :mod:`.abandon`; a collective
fails), *tear down* (:func:`teardown`: abort the round's Managers without collectives, leave and
destroy its groups through :mod:`.abandon`, free what the round held, check the CUDA context),
*agree* (:meth:`.membership.Membership.form`), *regroup* (a new default group on the round's
``PrefixStore``), then ``train`` again, which restores.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from aegis import _dist, _fault
from aegis._dist import node_id
from aegis.errors import ConfigError
from aegis.snapshot import hostmem
from aegis.training.inprocess import _sockets
from aegis.training.inprocess import abandon as _abandon
from aegis.training.inprocess import liveness as _liveness
from aegis.training.inprocess.membership import (
    Excluded,
    Heartbeat,
    Membership,
    member_uid,
    store_address,
    store_from_env,
)
from aegis.training.inprocess.relay import NodeRelay, relay_root
from aegis.training.inprocess.round import (
    RecoveryGaveUp,
    Regroup,
    Round,
    World,
    in_round,
    is_peer_failure,
    set_in_process_round,
    take_managers,
)
from aegis.training.inprocess.storeclient import (
    BASE_ROUND,
    CONNECT_S,
    StoreClient,
    StoreRestarted,
    is_store_failure,
    reseed,
)

JOIN_COUNT = "aegis/join/count"  # registrations to join (membership._register)

__all__ = ["run_in_process", "teardown", "check_nccl_env", "cuda_health", "relay_by_default", "RELAY_FROM"]


def _clear_dtensor_caches() -> None:
    """DTensor's caches keyed by DeviceMesh that are not per thread hold the failed round's
    meshes, and through them its groups: drop them (see :func:`_run_round` for why each round
    runs in a thread of its own)."""
    with contextlib.suppress(Exception):
        from torch.distributed.tensor import DTensor

        sp = DTensor._op_dispatcher.sharding_propagator
        sp.propagate_op_sharding = type(sp.propagate_op_sharding)(sp.propagate_op_sharding_non_cached)
        type(sp)._propagate_tensor_meta_cached.cache_clear()
    with contextlib.suppress(Exception):
        from torch.distributed.tensor._collective_utils import MeshTopoInfo

        MeshTopoInfo.build_from_mesh.cache_clear()


def _cuda_in_use() -> bool:
    import torch

    return bool(torch.cuda.is_available() and torch.cuda.is_initialized())


def cuda_health() -> None:
    """After a round: the CUDA context must still work, or the process restarts. A fault can
    leave a *sticky* error (an illegal address, a device assert: every later CUDA call fails the
    same way, cudaDeviceReset is the only cure, and it takes every tensor with it); training
    on would fail later or, worse, on wrong values. A synchronize and one small kernel tell."""
    if not _cuda_in_use():
        return
    import torch

    try:
        torch.cuda.synchronize()
        x = torch.ones(16, device="cuda")
        if float((x * 2).sum().item()) != 32.0:
            raise RuntimeError("a test kernel computed a wrong value")
    except Exception as e:  # noqa: BLE001 - any failure means the context cannot be trusted
        raise RecoveryGaveUp(
            f"the CUDA context of this process is unusable after the failed round ({type(e).__name__}: "
            f"{str(e)[:300]}); restarting the process (its node store keeps the snapshots)") from None


def cuda_memory() -> dict[str, int]:
    """Bytes allocated and reserved by torch's CUDA caching allocator (empty without CUDA)."""
    if not _cuda_in_use():
        return {}
    import torch

    return {"cuda_allocated": int(torch.cuda.memory_allocated()),
            "cuda_reserved": int(torch.cuda.memory_reserved())}


def teardown(ab: _abandon.Abandon, members: list[str]) -> dict[str, float]:
    """After a round ended: abort its Managers (no collectives), leave its groups so that no
    peer stays blocked on this process, destroy every group, release what the round held (its
    DTensor caches, its CUDA blocks), and check that the CUDA context still works. Returns its
    phases in seconds (the recovery event's ``timings``): ``teardown_s`` in all, of which
    ``abort_s`` (the Managers), ``leave_s`` (the groups), ``release_s`` (the collection that
    frees the round's state, and the CUDA check)."""
    t0 = time.perf_counter()
    managers = take_managers()  # this round's only: never one of an earlier round again
    for m in managers:
        with contextlib.suppress(Exception):
            m.abort(begin=True)
    t1 = time.perf_counter()
    ab.leave(members)
    t2 = time.perf_counter()
    for m in managers:
        with contextlib.suppress(Exception):
            m.abort(begin=False)
    del managers
    t3 = time.perf_counter()
    _clear_dtensor_caches()
    gc.collect()
    cuda_health()
    if _cuda_in_use():
        import torch

        torch.cuda.empty_cache()  # the round's blocks, so that memory stays flat over rounds
    t4 = time.perf_counter()
    return {"teardown_s": t4 - t0, "abort_s": (t1 - t0) + (t3 - t2), "leave_s": t2 - t1,
            "release_s": t4 - t3}


def check_nccl_env(backend: str, collective_timeout: timedelta, dead_after_s: float) -> list[str]:
    """The environment in-process recovery needs with NCCL, checked before the first round;
    returns what was set on the user's behalf (a line each). torch's default for
    ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` (3) tears the process down at the first NCCL error or
    timeout: a survivor would die instead of recovering. 2 (abort the communicator, keep the
    process) is set when the variable is unset; 0 (no handling: aegis' fence aborts) is accepted;
    1 and 3 are refused. The collective timeout must leave aegis' detection (``dead_after_s``)
    the time to fence a silent member first."""
    if "nccl" not in backend.lower():
        return []
    said: list[str] = []
    value = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
    if value is None:
        os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "2"
        said.append("TORCH_NCCL_ASYNC_ERROR_HANDLING=2 set (abort the communicator on an NCCL "
                    "error, keep the process: in-process recovery needs the survivors alive)")
    elif value.strip() not in ("0", "2"):
        raise ConfigError(
            f"TORCH_NCCL_ASYNC_ERROR_HANDLING={value}: with it, torch tears the process down at the "
            "first NCCL error or timeout, so a survivor of a lost peer dies instead of recovering in "
            "place. Set it to 2 (abort the communicator, keep the process) or 0 (aegis aborts), or "
            "leave it unset (aegis sets 2)")
    if collective_timeout.total_seconds() <= dead_after_s + 1.0:
        raise ConfigError(
            f"run_in_process(collective_timeout={collective_timeout.total_seconds():g} s, "
            f"dead_after_s={dead_after_s:g}): with NCCL the collective timeout must exceed "
            "dead_after_s + 1 s, so that aegis fences a silent peer (and aborts the communicators) "
            "before torch's watchdog times the collective out")
    hb = os.environ.get("TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC")
    if hb is not None and float(hb) < 30:
        raise ConfigError(
            f"TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC={hb}: torch's NCCL monitor kills the process when its "
            "watchdog is stuck that long, which an abort in progress can be; use at least 30 s")
    return said


def _store_timeout(e: BaseException) -> bool:
    """A store wait that ran out (a c10d ``DistStoreError``: the key of a member that is gone)."""
    return type(e).__name__ in ("DistStoreError", "DistNetworkError") or "timeout" in str(e).lower()


def _connect_within(timeout: timedelta) -> Any:
    """A plain client of the membership store (a round's groups rendezvous through it), its
    connect bounded: a connect to a store that stopped answering hangs past its own timeout
    (the server accepts, then never validates)."""
    box: list[tuple[bool, Any]] = []

    def connect() -> None:
        # attempts of CONNECT_S (one begun while the store was down must not outlast its
        # return by long), until the timeout; the client then waits up to the timeout for a key
        deadline = time.monotonic() + timeout.total_seconds()
        while True:
            try:
                raw = store_from_env(timedelta(seconds=CONNECT_S))
                raw.set_timeout(timeout)
                box.append((True, raw))
                return
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                if time.monotonic() + CONNECT_S > deadline or not is_store_failure(e):
                    box.append((False, e))
                    return
            time.sleep(0.1)

    # a daemon thread: one blocked for good must not keep the process from exiting
    t = threading.Thread(target=connect, name="aegis-pg-store", daemon=True)
    t.start()
    t.join(timeout.total_seconds() + 5.0)
    if not box:
        raise TimeoutError(f"connecting to the membership store: no reply within "
                           f"{timeout.total_seconds() + 5.0:.0f} s (timeout)")
    ok, value = box[0]
    if not ok:
        raise value
    return value


def _check_per_node(ranks_per_node: int | None, max_world: int | None) -> int:
    """``run_in_process(ranks_per_node=)`` against the launcher's environment, before anything
    starts; returns the granularity of a round (1: any processes)."""
    if ranks_per_node is None:
        return 1
    if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) or ranks_per_node < 1:
        raise ConfigError(f"run_in_process(ranks_per_node={ranks_per_node!r}): the processes of a "
                          "node (e.g. int(os.environ['LOCAL_WORLD_SIZE'])), a positive integer")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    first = int(os.environ.get("WORLD_SIZE", "1"))
    where = (f"run_in_process(ranks_per_node={ranks_per_node}) with LOCAL_RANK={local}, "
             f"WORLD_SIZE={first}")
    if local >= ranks_per_node:
        raise ConfigError(f"{where}: local rank {local} is not one of the node's "
                          f"0..{ranks_per_node - 1}; start {ranks_per_node} processes a node "
                          "(--nproc-per-node) or pass the number it starts")
    if first % ranks_per_node:
        raise ConfigError(f"{where}: the first round ({first} processes) is not whole nodes of "
                          f"{ranks_per_node}; start the same number of processes on every node")
    if max_world is not None and max_world % ranks_per_node:
        raise ConfigError(f"run_in_process(max_world={max_world}, ranks_per_node={ranks_per_node}):"
                          " max_world must be whole nodes (a multiple of ranks_per_node)")
    return ranks_per_node


def _empty_rounds(empty: int, bound: int, backend: str, cause: str | None) -> dict[str, Any]:
    """``empty`` rounds in a row ended before the training function saved anything (a failed
    group creation counts too): past ``bound`` the process gives up (its launcher restarts it);
    else what the next ``recovery`` event records beside the round's timings."""
    if empty > bound:
        raise RecoveryGaveUp(f"{empty} rounds in a row ended before the training function saved "
                             f"anything (the last: {cause}); restarting the process")
    return {"backend": backend, "empty_rounds": empty, **cuda_memory()}


def fresh_group_names() -> None:
    """Before a round creates its default group: name it as every peer will. torch names a
    group without an explicit name by a process-wide counter (``_world.group_count``; the
    default group takes it too), and only ``destroy_process_group()`` of the default group
    resets it. A creation that failed part-way (a member lost, its fence, ``create_timeout``)
    took a name and left no group to destroy, so this process's next default group was named
    "1/" while a peer's was "0/": their rendezvous keys never met and every later round timed
    out at ``create_timeout`` (seen in the chaos campaign: 23 rounds of 6, 10.5 s apart, after a
    double kill). No group exists here: reset the counter."""
    if dist.is_initialized():
        return
    from torch.distributed.distributed_c10d import _world

    _world.group_count = 0


def _run_round(train: Callable[[World], Any], world: World) -> Any:
    """``train(world)`` in a thread of its own, one per round. A DeviceMesh compares equal to an
    earlier round's mesh of the same shape unless it was made in another thread (equality looks
    at the rank map, layout, device type, names and the creating thread, not at the process
    group or this rank's coordinate), and DTensor caches sharding decisions by mesh, per thread.
    Measured here in one thread: a survivor whose rank changed between rounds got tensors on the
    earlier round's mesh, with its old coordinate, and planned its shards at its old rank's
    offsets (DCP: "invalid fill ... chunks-volume"). A thread per round gives each round meshes
    of its own and empty thread-local caches (and the NCCL fence a thread to raise in)."""
    box: dict[str, Any] = {}
    device: list[int] = []
    if _cuda_in_use():
        import torch

        device.append(torch.cuda.current_device())

    def run() -> None:
        set_in_process_round(True)
        try:
            if device:  # the current device is per thread
                import torch

                torch.cuda.set_device(device[0])
            box["result"] = train(world)
        except BaseException as e:  # noqa: BLE001 - handed to the caller below
            box["error"] = e
        finally:
            set_in_process_round(False)

    thread = threading.Thread(target=run, name=f"aegis-round-{world.round}", daemon=True)
    Round.thread = thread
    thread.start()
    thread.join()
    Round.thread = None
    error = box.pop("error", None)
    if error is not None:
        try:
            raise error
        finally:
            del error
    return box.get("result")


def _emit_recovery(w: World, extra: dict[str, Any]) -> None:
    """One ``recovery`` event per rank and round in ``$AEGIS_EVENTS_DIR`` (beside the Manager's
    events), with the phases so far: teardown, agree, regroup; the Manager's ``start`` and
    ``restore`` events that follow time the rebuild and the restore."""
    root = os.environ.get("AEGIS_EVENTS_DIR")
    if not root:
        return
    with contextlib.suppress(OSError):
        os.makedirs(root, exist_ok=True)
        with open(os.path.join(root, f"rank-{w.rank:05d}.jsonl"), "a") as fh:
            fh.write(json.dumps({"time": time.time(), "event": "recovery", "rank": w.rank,
                                 "round": w.round, "world_size": w.size, "node": w.node,
                                 "failed_at": w.failed_at, "cause": w.cause,
                                 "timings": w.timings, **extra}) + "\n")


RELAY_FROM = 512


def relay_by_default(world: int, env: str | None) -> bool:
    """Whether a job beats through node relays when ``run_in_process(node_relay=)`` is not
    given: ``$AEGIS_NODE_RELAY`` when set, else from ``RELAY_FROM`` processes in the first round
    (``WORLD_SIZE``). Direct beats cost the store 2 requests per process per beat: 0.18 cores of
    the store at 1,024 processes (bench/scale.py), 2.7 at 16,384, more than one TCPStore loop
    serves; a relay adds up to one beat to a detection (its batch's phase), which a small job
    need not pay (chaos medians: freeze detection 1.2 s relayed, 1.0 s direct, XOR 3 x 2)."""
    if env is not None and env.strip() != "":
        return env.strip().lower() not in ("0", "false", "no", "off")
    return world >= RELAY_FROM


def run_in_process(
    train: Callable[[World], Any],
    *,
    min_world: int = 1,
    max_world: int | None = None,
    ranks_per_node: int | None = None,
    max_restarts: int = 100,
    heartbeat_s: float = 0.2,
    dead_after_s: float = 1.0,
    collective_timeout: timedelta = timedelta(seconds=30),
    form_timeout: timedelta = timedelta(minutes=2),
    create_timeout: timedelta = timedelta(seconds=10),
    max_empty_rounds: int = 10,
    store_outage: timedelta = timedelta(seconds=60),
    backend: str = "gloo",
    on_round: Callable[[World], None] | None = None,
    node_relay: bool | None = None,
) -> Any:
    """Run ``train(world)`` on every process of the job, and again on the survivors, in the same
    processes, whenever a peer is lost.

    Every process of the job calls it once, instead of ``init_process_group``; ``train`` must
    build everything that is bound to the process group (device mesh, FSDP model, optimizer,
    the aegis ``Manager``) itself. ``WORLD_SIZE`` (torchrun's) is the size of the first round;
    later rounds have the survivors. A peer counts as dead once the store host's liveness
    service saw its connection close, or its heartbeat has not moved for ``dead_after_s``; then
    every process fences it off (gloo: its connections shut down; NCCL: the communicators
    aborted), so a collective waiting on it ends then, not at ``collective_timeout``. Each
    process watches two members (its successors on a ring interleaved by node) and reads one
    death log: its store load does not grow with the world (:mod:`.membership`). It freezes the
    garbage collector's objects of the moment (``gc.freeze``: the imports and what the script
    made before calling it), so that the full collection at each round's teardown is quick.

    Args:
        train: the training function, called with the round's :class:`World`; it may be called
            again in the same process after a failure.
        min_world: the fewest processes a round trains with; below it the survivors wait for
            a spare or a replacement.
        max_world: the most processes that train; more (a spare node started beside the job, or
            a first round bigger than it) wait as *spares*, started and connected, and step in
            at the next loss. None: every process that comes is taken in at the survivors' next
            snapshot.
        ranks_per_node: rounds of whole nodes (2-D and 3-D meshes: HSDP, tensor parallel
            within a node): every round is made of nodes whose local ranks ``0 ..
            ranks_per_node - 1`` are all there, each node's ranks contiguous and in local-rank
            order (``world.local_rank`` is then ``LOCAL_RANK``). A node that lost a worker sits
            out whole: its other workers wait, connected, as spares do, and the node rejoins at
            the survivors' first snapshot after its replacement worker registered (or at the
            next round formed after a loss). ``min_world`` is rounded up to whole nodes,
            ``max_world`` and ``WORLD_SIZE`` must be multiples. None (the default): rounds of any
            processes (1-D jobs).
        max_restarts: rounds this process may re-enter ``train`` after failures before it gives
            up (its launcher then restarts it).
        heartbeat_s: the heartbeat interval.
        dead_after_s: silence after which a member is declared dead (more than ``heartbeat_s``).
        collective_timeout: the default group's timeout: the last resort when no fence ends a
            collective.
        form_timeout: how long forming a round may take before this process gives up.
        create_timeout: the bound on creating a round's process groups (the default group here,
            the Manager's snapshot groups in the training function): the members first arrive
            together through the store, then create the group under a fifth of it (gloo waits 5x
            a group's timeout for a pair's first connection, a wait no fence can end); the round
            then fails like any other. Groups ``train`` creates itself need a timeout of their own.
        max_empty_rounds: rounds in a row that end before ``train`` saved anything (each logged
            with its cause in the ``recovery`` event) before this process gives up and restarts.
        store_outage: how long a membership step (forming a round, joining, admitting) keeps
            reconnecting to a membership store it cannot reach before this process gives up and
            restarts; training goes on while the store is away, and a store restarted empty is
            re-seeded by the members (:mod:`.storeclient`).
        backend: ``"gloo"`` (CPU, or CUDA tensors over gloo), ``"nccl"`` or
            ``"cpu:gloo,cuda:nccl"`` (:func:`check_nccl_env` names the NCCL environment it checks).
        on_round: called with each round's :class:`World` before ``train`` (tests, logging).
        node_relay: beat through the node's heartbeat relay (:mod:`.relay`, issue 40): the
            processes of a node share one process's 2 store requests per beat, so the store's
            load grows with the nodes, not the ranks. Default: ``$AEGIS_NODE_RELAY`` (``1`` on,
            ``0`` off), else on from ``RELAY_FROM`` processes in the first round
            (:func:`relay_by_default`).

    Returns:
        What the last call of ``train`` returned.

    Raises:
        ConfigError: a bad argument, ``AEGIS_MEMBERSHIP`` missing or malformed, or a process
            group already initialized; before anything is started.
        RecoveryGaveUp: recovery could not go on in this process (too few members within
            ``form_timeout``, restarts or empty rounds spent, the store away for longer than
            ``store_outage``); the launcher restarts the process, which restores from its node
            store.
    """
    if min_world < 1 or dead_after_s <= heartbeat_s:
        raise ConfigError(f"run_in_process(min_world={min_world}, heartbeat_s={heartbeat_s}, "
                          f"dead_after_s={dead_after_s}): need min_world >= 1 and dead_after_s > "
                          "heartbeat_s")
    if max_world is not None and max_world < min_world:
        raise ConfigError(f"run_in_process(min_world={min_world}, max_world={max_world}): "
                          "max_world (the most processes that train; more wait as spares) must "
                          "be at least min_world; leave it out to take in every process")
    per_node = _check_per_node(ranks_per_node, max_world)
    min_world = -(-min_world // per_node) * per_node  # whole nodes
    if dist.is_initialized():
        raise ConfigError("run_in_process() creates the process groups itself: call it instead of "
                          "init_process_group(), not after it")
    ab = _abandon.for_backend(backend)
    for line in check_nccl_env(backend, collective_timeout, dead_after_s):
        print(f"[aegis] {line}", flush=True)
    node = node_id()
    local = os.environ.get("LOCAL_RANK", "0")
    uid = member_uid(node, local, os.getpid())
    store_address()  # a ConfigError now if the variable is missing or malformed
    # membership (issue 25): clients that reconnect after a broken connection and bound every
    # request; membership steps retry for store_outage, the heartbeat once per beat
    store = StoreClient(store_from_env, timeout_s=form_timeout.total_seconds(),
                        outage_s=store_outage.total_seconds())
    store.seal()
    # the store host's liveness service (aegis store serve): this process's connection to it
    # ends when the process dies, and the host declares it dead at once (not after
    # dead_after_s of silence); absent, nothing changes
    link = _liveness.Link(uid, store_address()[0],
                          lambda: _liveness.published_port(store.quick))
    hb_timeout = timedelta(seconds=max(5.0, 2 * dead_after_s))
    hb_store = StoreClient(store_from_env, timeout_s=hb_timeout.total_seconds(),
                           outage_s=None, name="membership store (heartbeat)")
    hb_store.seal()
    # when the heartbeat's client had to reconnect, so will the membership client: at once, in
    # the background, not at the next round's first request
    hb_store.on_reconnect = store.refresh
    # the rendezvous of each round's groups goes through a client of its own whose waits end at
    # create_timeout (a member lost while the groups are created, issue 25), made per round
    pg_store: Any = None
    if node_relay is None:
        node_relay = relay_by_default(int(os.environ.get("WORLD_SIZE", "1")),
                                      os.environ.get("AEGIS_NODE_RELAY"))
    relay = None
    if node_relay:
        host, port = store_address()
        relay = NodeRelay(relay_root(f"{host}:{port}"), node, uid, stale_s=2.5 * heartbeat_s)
    hb = Heartbeat(uid, heartbeat_s, form_timeout, dead_after_s=dead_after_s, fence=ab.fence,
                   fenceable=lambda u: (in_round() or Round.creating) and u in Round.members,
                   creating=lambda: Round.creating, store=hb_store,
                   on_restart=lambda st: reseed(st, Round.r, list(Round.members), Round.admitted,
                                                uid), also=(JOIN_COUNT,), relay=relay)
    link.on_death = hb.poke  # a death the liveness service declared: read the log now
    Round.joiners = lambda: hb.readings.get(JOIN_COUNT, 0)
    Round.max_world = max_world
    Round.per_node = per_node
    membership = Membership(store, uid, hb, dead_after_s=dead_after_s,
                            form_timeout_s=form_timeout.total_seconds(), min_world=min_world,
                            max_world=max_world, per_node=per_node, relay=relay)
    first = int(os.environ.get("WORLD_SIZE", "1"))
    r = 0
    previous: list[str] | None = None
    join_slot = 0  # this process's registration, while it joins the running job
    restarts = 0
    misses = 0  # rounds formed without this process in a row (see membership.backoff_s)
    timings: dict[str, float] = {}
    extra: dict[str, Any] = {}
    failed_at: float | None = None
    cause: str | None = None
    empty = 0  # rounds in a row that ended before train() saved anything
    # the job runs already (or ran, on a store re-seeded after a restart): join it
    join = store.check(["aegis/round/0/members"]) or store.check([BASE_ROUND])
    clean = False  # the last round returned: its groups are healthy, destroy them plainly
    # What exists now (the imports: torch alone is ~240 K objects) will live as long as the
    # process: kept out of every later collection, so the full collection that releases each
    # round's model at its teardown scans only what was made since (measured here, idle: 53 ms
    # -> under 1 ms; the campaign's teardowns, 6 ranks on 2 cores, took 0.3-0.8 s)
    gc.freeze()
    # what a round frees (its model and optimizer state) is kept for the next round's, which the
    # restore then writes into pages already faulted in (hostmem.retain_freed_memory)
    hostmem.retain_freed_memory()
    try:
        while True:
            t0 = time.perf_counter()
            if join:
                try:
                    r, previous, join_slot = membership.join(
                        timeout_s=form_timeout.total_seconds(), misses=misses)
                except StoreRestarted as e:  # its registration is gone with the store's keys
                    cause = str(e)
                    continue
                join = False
                if r < 0:
                    return None
                if previous is not None:  # know the dead of the round it joins from
                    hb.follow(previous, r - 1, forming=True)
            try:
                members, admitted = membership.form(r, previous, first, join_slot=join_slot)
            except Excluded as e:
                join = True  # left out while silent: register and come back at a snapshot
                misses += 0 if e.spare else 1  # a full round is no miss: a spare waits
                cause = str(e)
                continue
            except StoreRestarted as e:
                # the store lost the round's keys while it formed: every process that was
                # forming it finds that out at its next request and forms it again from the
                # start; one already in the round wrote its member list back (reseed)
                cause = str(e)
                continue
            misses = 0
            join_slot = 0
            t1 = time.perf_counter()
            rank = members.index(uid)
            hb.follow(members, r)
            # what runs beside training (the joiners vote in save(), fencing from the heartbeat
            # thread, publishing and reading ports) tries each request once: it never waits
            # out an outage of the store
            Round.store, Round.r, Round.uid, Round.members = store.quick, r, uid, members
            Round.admitted = admitted
            Round.failed = None
            Round.abandon = ab
            ab.begin(store.quick, r, uid)
            # from here a member silent for CREATING_SILENT_S is declared and fenced: the fence
            # shuts down this process's connection to the groups' rendezvous (a loss while the
            # groups are created, issue 25)
            Round.creating = True
            _fault.hit("group", r, rank)
            try:
                fresh_group_names()
                before = _sockets.my_sockets()
                pg_store = _connect_within(create_timeout)
                ab.rendezvous(_sockets.connected_to(
                    store_address()[1], set(_sockets.my_sockets()) - set(before)))
                t_conn = time.perf_counter()
                # the members arrive together (a loss before then: its fence cuts this wait),
                # then create the group under a timeout that bounds its creation by
                # create_timeout even when a member dies between publishing its address and
                # connecting (gloo waits 5x the timeout for a pair's first connection, and no
                # fence can end that wait), then give it collective_timeout for its collectives
                _dist.arrive(pg_store, f"aegis/round/{r}/arrived", len(members), create_timeout)
                t_arrived = time.perf_counter()
                dist.init_process_group(
                    backend, store=dist.PrefixStore(f"aegis/round/{r}/pg", pg_store), rank=rank,
                    world_size=len(members),
                    timeout=min(_dist.creation_timeout(create_timeout), collective_timeout))
                from torch.distributed.distributed_c10d import _set_pg_timeout

                _set_pg_timeout(collective_timeout)
            except Exception as e:  # noqa: BLE001 - a member lost while the groups were created
                if restarts >= max_restarts or not (is_peer_failure(e) or _store_timeout(e)):
                    raise
                failed_at, cause = time.time(), f"creating round {r}'s groups: {type(e).__name__}: {e}"[:500]
                Round.creating = False
                hb.round_ended()
                timings = teardown(ab, members)
                previous, restarts, r = members, restarts + 1, r + 1
                empty += 1  # a round without a trained step
                extra = _empty_rounds(empty, max_empty_rounds, backend, cause)
                continue
            Round.saves = 0
            Round.create_timeout = create_timeout
            Round.collective_timeout = collective_timeout
            t2 = time.perf_counter()
            if restarts:  # regroup_s: connect_s + arrive_s + init_pg_s (and the rest)
                timings.update(agree_s=t1 - t0, regroup_s=t2 - t1, connect_s=t_conn - t1,
                               arrive_s=t_arrived - t_conn, init_pg_s=t2 - t_arrived)
            world = World(rank=rank, size=len(members), round=r, node=node, members=members,
                          restarts=restarts, timings=dict(timings), failed_at=failed_at,
                          cause=cause)
            if restarts:
                # the liveness link as it stands (connected: this process's death is seen by
                # the store host at once; connects > 1: it came back after a store restart)
                _emit_recovery(world, {**extra, "whole_nodes": world.whole_nodes,
                                       "nodes": world.num_nodes, "liveness": {
                    "connected": link.connected, "connects": link.connects,
                    "failures": link.failures}})
            ab.publish()  # the default group's sockets
            if on_round is not None:
                on_round(world)
            Round.active, Round.creating = True, False
            try:
                result = _run_round(train, world)
                with contextlib.suppress(Exception):  # a process still waiting to join: go home
                    store.set(f"aegis/round/{r}/done", "1")
                clean = True
                return result
            except Regroup as e:  # every rank, after the same committed snapshot
                registered = e.registered
                failed_at = None
                cause = f"regroup: {e}"
            except BaseException as e:
                if not is_peer_failure(e) or restarts >= max_restarts:
                    raise
                failed_at = time.time()
                registered = 0
                cause = f"{type(e).__name__}: {e}"[:500]
                if Round.failed is not None and Round.failed not in cause:
                    cause = f"{cause} ({Round.failed})"[:500]
            finally:
                Round.active = False
                hb.round_ended()  # from now on its watchers declare for the next round
            # Out of the except block: the exception and its frames (holding the round's model,
            # mesh and groups) are released, so destroying the groups really closes them.
            del world
            timings = teardown(ab, members)
            # a round that ended before train() saved anything: counted, logged with its cause
            # (the recovery event's empty_rounds), and bounded
            empty = empty + 1 if Round.saves == 0 else 0
            extra = _empty_rounds(empty, max_empty_rounds, backend, cause)
            previous = members
            restarts += 1
            r += 1
            if registered > admitted:  # grow: admit the processes that registered
                try:
                    previous = membership.admit(r, members, admitted, registered)
                except StoreRestarted:  # their registrations went with the store's keys
                    previous = members
                hb.follow(previous, r - 1, forming=True)  # the joiners watched (as just seen) too
    finally:
        link.leave(bye=clean)  # leaving on an error: declared at once, as if dead
        hb.stop()
        Round.joiners = None
        Round.max_world = None
        Round.per_node = 1
        Round.creating = False
        store.close()
        hb_store.close()
        with contextlib.suppress(Exception):
            del pg_store
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                if not clean:  # leaving on an error: never flush a broken communicator
                    _abandon.abort_nccl()
                dist.destroy_process_group()
