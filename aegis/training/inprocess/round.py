"""What runs inside a round sees of it: the current round, the Managers to abort when it fails,
the joiners waiting, and the exceptions that end a round.

Who calls what: the round loop (:mod:`.loop`) fills :class:`Round` before ``train(world)`` runs
and clears ``active`` when it ends; :class:`~aegis.training.manager.Manager` registers itself,
votes on joiners (:func:`joiners_registered`) and raises :class:`Regroup`; the heartbeat thread
reads ``members`` to know whom it may fence.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

from aegis.errors import AegisError
from aegis.training.inprocess.layout import Layout, build_mesh, whole_node_vote

__all__ = [
    "World",
    "Regroup",
    "RecoveryGaveUp",
    "PeerLost",
    "Round",
    "register_manager",
    "live_managers",
    "take_managers",
    "in_process_round",
    "in_round",
    "joiners_registered",
    "joiners_waiting",
    "is_peer_failure",
]


class Regroup(Exception):  # noqa: N818 - not an error: the round ends on purpose
    """Raised by ``Manager.save`` on every rank together, after the snapshot committed, when
    processes wait to join: the next round includes them."""

    def __init__(self, registered: int) -> None:
        super().__init__(f"{registered} process(es) registered to join")
        self.registered = registered


class RecoveryGaveUp(AegisError):
    """In-process recovery could not go on (too few members, a membership timeout, a CUDA
    context that a fault left unusable); the process exits so that the launcher restarts it."""


class PeerLost(AegisError):
    """A member of the round was fenced off (silent for ``dead_after_s``) by a backend that
    cannot make the pending collective fail by itself (NCCL: its communicators were aborted, so
    whatever they computed since is garbage). Raised in the round's thread; a peer failure."""


@dataclass
class World:
    """What ``train`` is called with: the current round's membership, as this process sees it.

    Attributes:
        rank: this process's rank in the round (the default group's).
        size: the round's world size.
        round: the round's number (0 for the first; one more per membership change).
        node: this process's node id (``AEGIS_NODE_ID`` or the hostname).
        members: the round's member uids ``"<node>/<local rank>/<pid>"`` in rank order.
        restarts: rounds this process re-entered ``train`` after a failure.
        timings: the last recovery's phases, in seconds (teardown, agree, regroup).
        failed_at: ``time.time()`` when this process saw the last failure, or None.
        cause: why the previous round ended, as this process saw it, or None.
    """

    rank: int
    size: int
    round: int
    node: str
    members: list[str]
    restarts: int = 0  # rounds this process re-entered train() after a failure
    timings: dict[str, float] = field(default_factory=dict)  # the last recovery's phases (s)
    failed_at: float | None = None  # time.time() when this process saw the last failure
    cause: str | None = None  # why the previous round ended, as this process saw it

    @property
    def layout(self) -> Layout:
        """The round's nodes as this rank sees them (:class:`.layout.Layout`)."""
        return Layout.of(self.members, self.rank)

    @property
    def node_index(self) -> int:
        """This rank's node among the round's nodes (0 .. num_nodes - 1, in rank order)."""
        return self.layout.node_index

    @property
    def num_nodes(self) -> int:
        """The nodes with at least one rank in this round."""
        return self.layout.num_nodes

    @property
    def local_rank(self) -> int:
        """This rank's place among its node's ranks in this round (``LOCAL_RANK`` is where the
        launcher started the process, e.g. its GPU; this is where the round put it)."""
        return self.layout.local_rank

    @property
    def local_size(self) -> int:
        """This node's ranks in this round."""
        return self.layout.local_size

    @property
    def whole_nodes(self) -> bool:
        """Every node of the round holds the same number of ranks, each node's contiguous."""
        return self.layout.whole_nodes

    def mesh(self, device_type: str, *, within_node: tuple[str, ...] = (), **dims: int) -> Any:
        """The round's device mesh from named dimensions, outermost first, one of them ``-1``
        (inferred from the world), e.g. ``world.mesh("cuda", dp_shard=-1, tp=2,
        within_node=("tp",))`` or ``world.mesh("cpu", dp_replicate=-1, dp_shard=2)`` (HSDP).
        Every rank of the round calls it, inside ``train(world)``.

        Args:
            device_type: ``"cpu"`` or ``"cuda"``, as for ``init_device_mesh``.
            within_node: dimensions whose groups must not span two nodes (the innermost ones).
            **dims: dimension name -> size, or -1 for one of them.

        Returns:
            A ``DeviceMesh`` with ``mesh_dim_names`` the names given.

        Raises:
            ConfigError: the dimensions do not divide the world, or a ``within_node``
                dimension would span two nodes of this round; nothing was created.
        """
        mesh = build_mesh(device_type, self.layout, self.size, dims, within_node,
                          timeout=Round.collective_timeout)
        if Round.abandon is not None:
            # its groups' sockets, published now (the Manager publishes again with its own): a
            # process frozen between building the mesh and starting its Manager is fenced off
            # those connections too, and a thawed one cuts them itself
            Round.abandon.publish()
        return mesh


class Round:
    """The current round, for what runs inside it (the Manager publishes its groups and votes
    on joiners; the heartbeat fences members of it). Class attributes: one round per process."""

    store: Any = None
    r: int = -1
    uid: str = ""
    members: list[str] = []
    admitted: int = 0  # join slots admitted into a round so far
    active: bool = False  # train() of the round runs (not torn down)
    creating: bool = False  # the round's default group is being created (its rendezvous)
    thread: threading.Thread | None = None  # the thread train() runs in
    abandon: Any = None  # the round's Abandon (backend seam), for publish()
    failed: str | None = None  # set when a member was fenced off: why the round must end
    saves: int = 0  # Manager.save() calls that snapshotted in this round (empty rounds)
    create_timeout: Any = None  # run_in_process' bound on creating a round's groups
    collective_timeout: Any = None  # run_in_process' collective timeout (World.mesh's groups too)
    joiners: Any = None  # () -> the join counter as the heartbeat last read it
    max_world: int | None = None  # run_in_process(max_world=): more processes wait as spares
    per_node: int = 1  # run_in_process(ranks_per_node=): > 1, rounds of whole nodes only


# -- Managers of the current round: aborted (no collectives) when the round fails -------------

_live: weakref.WeakSet[Any] = weakref.WeakSet()
_active = threading.local()


def register_manager(mgr: Any) -> None:
    _live.add(mgr)


def live_managers() -> list[Any]:
    return list(_live)


def take_managers() -> list[Any]:
    """The Managers of the round that just ended, forgotten here. A Manager of an earlier round
    that something still holds (its uploader thread stuck in a request to an object store that
    hangs keeps it alive) used to stay in this set and be aborted again at every later teardown,
    each time waiting for that thread: teardown grew round after round (issue 25)."""
    out = list(_live)
    _live.clear()
    return out


def in_process_round() -> bool:
    """True in the thread that runs ``train`` of a round (a Manager built there joins it)."""
    return bool(getattr(_active, "on", False))


def set_in_process_round(on: bool) -> None:
    _active.on = on


def in_round() -> bool:
    return Round.active


def joiners_registered() -> int:
    """How many processes have registered to join the job (``Manager.save`` votes with it), as
    far as the round has room for them: with ``max_world``, the join slots beyond the room
    (``max_world`` less the members) are not counted, so a full round admits nobody and the
    processes that registered wait as spares. The cap is the same on every member (the round's
    size and slots admitted), so the vote's maximum is capped the same way."""
    registered = _registered()
    if Round.per_node > 1:
        return _whole_node_vote(registered)
    if Round.max_world is None:
        return registered
    room = max(0, Round.max_world - len(Round.members))
    return min(registered, Round.admitted + room)


# join slot -> the uid that registered it, as read by this process (slots are written once; a
# store restarted empty hands them out again from the slots admitted: dropped then)
_slots: dict[int, str] = {}


def _whole_node_vote(registered: int) -> int:
    """Whole-node rounds: the registrations count only up to the slot that completed the last
    whole node (:func:`.layout.whole_node_vote`), else the round would end at every snapshot to
    admit a node's lone worker that the next round leaves out again. Reads the uids of slots not
    read before (a ``check`` and a ``multi_get``, one bounded attempt each, O(new
    registrations) bytes; none while nobody registers). A failed read counts nobody."""
    admitted = Round.admitted
    if registered <= admitted:
        return admitted
    for gone in [i for i in _slots if i <= admitted or i > registered]:
        del _slots[gone]
    want = [i for i in range(admitted + 1, registered + 1) if i not in _slots]
    if want:
        once = getattr(Round.store, "once", None)
        try:
            ask = once if once is not None else (lambda name, *a: getattr(Round.store, name)(*a))
            keys = [f"aegis/join/slot/{i}" for i in want]
            if not ask("check", keys):  # a registrant between its two writes: the others
                keys = [k for k in keys if ask("check", [k])]
            values = ask("multi_get", keys) if keys else []
        except Exception:  # noqa: BLE001 - the store away: nobody is admitted at this snapshot
            return admitted
        for k, v in zip(keys, values, strict=True):
            _slots[int(k.rsplit("/", 1)[1])] = v.decode()
    pending = [(i, _slots[i]) for i in range(admitted + 1, registered + 1) if i in _slots]
    room = None
    if Round.max_world is not None:
        room = max(0, Round.max_world - len(Round.members)) // Round.per_node
    slot = whole_node_vote(pending, Round.members, Round.per_node, room)
    return admitted if slot is None else slot


def _registered() -> int:
    if Round.joiners is not None:  # the heartbeat's reading: no store request here
        return max(Round.admitted, Round.joiners())
    if Round.store is None:
        return 0
    once = getattr(Round.store, "once", None)  # one bounded attempt: save() never waits out
    try:                                          # an outage of the store
        return int(once("add", "aegis/join/count", 0) if once is not None
                   else Round.store.add("aegis/join/count", 0))
    except Exception:  # noqa: BLE001 - the store away or restarted: nobody can join now
        return Round.admitted


def joiners_waiting(registered: int) -> bool:
    return registered > Round.admitted


def check_round() -> None:
    """Raise :class:`PeerLost` if a member of the running round was fenced off by a backend
    whose collectives do not fail by themselves (``Manager.save`` calls it first: a snapshot
    must never commit state computed on aborted communicators)."""
    if Round.active and Round.failed is not None and in_process_round():
        raise PeerLost(Round.failed)


def is_peer_failure(e: BaseException) -> bool:
    """A lost or silent peer, as gloo, NCCL and aegis report it (not a bug in the script)."""
    from aegis.errors import CollectiveError, SnapshotTimeoutError

    if isinstance(e, SnapshotTimeoutError | PeerLost):
        return True
    text = f"{type(e).__name__}: {e}".lower()
    if isinstance(e, CollectiveError):
        return "peer is likely gone" in text or "timed out" in text or "connection" in text
    if isinstance(e, AegisError):
        return "peer is likely gone" in text or "collective failed" in text
    markers = ("connection closed by peer", "connection reset", "broken pipe", "timed out",
               "timeout", "socket closed", "no route to host", "connection refused",
               "read error", "write error", "gloo", "nccl error", "ncclremoteerror",
               "ncclsystemerror", "ncclinternalerror", "communicator was aborted",
               "has been aborted", "was aborted",
               # a c10d store connection shut down (a fence cuts the round's rendezvous one)
               "connection was likely closed")
    return isinstance(e, RuntimeError | OSError) and any(m in text for m in markers)
