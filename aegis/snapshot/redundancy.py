"""How a snapshot survives a lost node: whole replicas, XOR parity or Reed-Solomon parity.

Each scheme is a :class:`Scheme` with two halves that the snapshot engine's commit protocol
calls (:meth:`~aegis.snapshot.engine.SnapshotEngine` ``._finish``):

* :meth:`Scheme.protect`, on every rank in the background, after its shard is in its slot and
  checksummed: the scheme's traffic (replicas pushed to target ranks, or parity segments
  exchanged inside the rank's group) and the files it leaves in the step directory; its report
  travels to rank 0 with the shard's;
* :meth:`Scheme.verify`, on rank 0 with every rank's report: the failures it finds (a replica
  whose crc32c differs from its owner's, a parity file of the wrong size) and what the manifest
  records (the nodes holding each replica; the parity groups with their crc32c).

:func:`build` chooses the scheme from the configuration and the world (the node of every
rank): ``replica`` (:class:`ReplicaScheme`, ``replicas`` whole copies on the next nodes of the ring,
other failure domains first), ``dp`` (:class:`DpReplicaScheme`: the same replicas, each built on
its holder from the holder's own data-parallel copy of the tensors, only the rest sent), ``xor``
(:class:`XorScheme`, one loss per group) or ``rs``
(:class:`RsScheme`, ``parity`` losses per group, pyeclib), with the parity schemes degrading to
fewer losses, or to one whole replica, in worlds their groups do not fit.

Costs per rank and snapshot, flat in the world size: replicas send and receive ``replicas``
shards (``dp``: the unshared part of each, and one more local copy per replica held); XOR sends about one shard and receives N-1 segments of 1/(N-1) shard; RS sends about
one shard plus k-1 pieces and encodes one stripe (N: the parity group's size, ``group_size``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import crc32c as _crc32c
import torch
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

from aegis import _fault
from aegis._dist import Group
from aegis.errors import AegisError, ConfigError, CorruptShardError
from aegis.snapshot.dcp_io import StagedShard
from aegis.snapshot.erasure import (
    RS_DEFAULT_EC_TYPE,
    StripeLayout,
    rs_piece_size,
    rs_stripe_encode,
    rs_stripe_layout,
    stripe_layout,
    xor_into,
    xor_layout,
)
from aegis.snapshot.manifest import ParityGroup, Redundancy, ShardRecord
from aegis.snapshot.node_store import Slot, is_store_full
from aegis.snapshot.placement import Placement, parity_groups
from aegis.snapshot.shard import ShardLayout, check_blob, check_split, plan_layout, zero_gaps
from aegis.snapshot.slot_pools import SlotPools
from aegis.snapshot.staging import Stager
from aegis.snapshot.transport import Recv, Send, Transport

__all__ = ["DpReplicaScheme", "Protected", "ReplicaScheme", "RsScheme", "Scheme", "XorScheme", "build",
           "shard_summary"]

_ENCODE_SCRATCH = 256 << 20  # private memory for parity segments in flight (at least one segment)


def _mv(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU uint8 tensor, without a copy."""
    return memoryview(t.numpy())  # type: ignore[arg-type]  # numpy arrays are buffers


@dataclass
class Protected:
    """One rank's outcome of :meth:`Scheme.protect` for one step.

    ``received``: per source rank (source, index crc32c of the verified replica or None,
    error); ``slots``: the files it left in the step directory (replicas, parity); ``full``:
    every failure among the received replicas was a full node store (True when none failed);
    ``parity``: (parity bytes, parity crc32c) of this rank's parity file, or None."""

    received: list[tuple[int, int | None, str | None]] = field(default_factory=list)
    slots: list[Slot] = field(default_factory=list)
    full: bool = True
    parity: tuple[int, int] | None = None


class Scheme:
    """The interface every redundancy scheme implements; see the module docstring."""

    name = ""
    what = ""  # how its failures are worded ("replication", "parity encoding")

    def __init__(self, placement: Placement, rank: int, node: str, *, group: Group,
                 pools: SlotPools, transport: Transport | None) -> None:
        self.placement = placement
        self.rank = rank
        self.node = node
        self.group = group
        self.pools = pools
        self.transport = transport
        self.groups: list[tuple[int, ...]] = []  # parity groups: member ranks in order
        self.group_of: tuple[int, ...] = ()  # this rank's parity group
        self.losses = 0  # parity: losses per group it rebuilds (0 for replicas)
        self.degraded: str | None = None  # why this world keeps replicas instead of parity
        self.targets = placement.targets(rank)
        self.sources = placement.sources(rank)

    def copies_per_shard(self) -> float:
        """Bytes this rank's node store holds for the scheme per byte of its own shard."""
        raise NotImplementedError

    # Plan-time and save-time hooks; only :class:`DpReplicaScheme` uses them.

    def plan_key(self) -> tuple[Any, ...]:
        """What of the world, besides the state, the plan extras depend on (the plan cache's key)."""
        return ()

    def plan_extras(self, local_plans: Sequence[SavePlan], final_plans: Sequence[SavePlan],
                    chunk_bytes: int) -> list[Any] | None:
        """Rank 0, while DCP plans (it holds every rank's local and final plan): what each rank
        needs of the plan beyond its own, scattered with its final plan; None: nothing."""
        return None

    def adopt(self, extra: Any, layout: ShardLayout) -> None:
        """Every rank, once per plan: its part of :meth:`plan_extras` and its own layout."""

    def stage_local(self, step: int, resolve: Callable[[WriteItem], Any],
                    stager: Stager | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Training thread, in the blocking part of ``save(step)`` after the own copy. Returns
        the copies ``stager`` (``staging="async"``) defers, for the snapshot's barrier."""
        return []

    def staged_slots(self) -> list[Slot]:
        """Slots :meth:`stage_local` filled that no :meth:`protect` took yet (an abort)."""
        return []

    def protect(self, step: int, slot: Slot | None, staged: StagedShard | None,
                result: Any) -> Protected:
        """Background, every rank, collective within the scheme's peers: protect this rank's
        shard of ``step`` (``slot``/``staged`` None when it failed: the rank still takes part,
        so no peer waits for it). Records its timings and bytes on ``result``."""
        raise NotImplementedError

    def verify(self, reports: Sequence[Any], records: dict[int, Any], summary: dict[int, tuple[int, int]],
               nodes: Sequence[str], failures: dict[int, str], full: dict[int, bool]
               ) -> tuple[dict[int, list[str]], Redundancy | None]:
        """Rank 0: check every rank's report; add to ``failures`` (and clear ``full`` for a
        failure that is not a full store). Returns the nodes holding each rank's replicas and
        the parity record for the manifest."""
        raise NotImplementedError


class ReplicaScheme(Scheme):
    """``replicas`` whole copies of each shard on the next nodes (other failure domains first)."""

    name = "replica"
    what = "replication"

    def copies_per_shard(self) -> float:
        return float(len(self.sources))

    def protect(self, step: int, slot: Slot | None, staged: StagedShard | None,
                result: Any) -> Protected:
        """Push this rank's shard to its targets; receive and verify its sources' shards. A
        replica that did not fit is still received, into private memory, and dropped: the
        sender must never wait for a receive that is not posted."""
        t0 = time.perf_counter()
        try:
            return self._exchange(step, slot, staged, result)
        finally:
            result.replicate_s = time.perf_counter() - t0

    def _exchange(self, step: int, slot: Slot | None, staged: StagedShard | None, result: Any) -> Protected:
        if not self.targets and not self.sources:
            return Protected()
        assert self.transport is not None
        parts: list[torch.Tensor] = []
        if staged is not None and slot is not None:
            parts = [slot.view[: staged.layout.tensor_end],
                     torch.frombuffer(bytearray(staged.tail), dtype=torch.uint8)]
        slots: dict[int, Slot] = {}
        no_room: dict[int, str] = {}
        tails: dict[int, tuple[int, torch.Tensor]] = {}  # source -> (its tensor region's size, tail)

        def alloc(src: int) -> Callable[[list[int]], list[torch.Tensor]]:
            def fn(sizes: list[int]) -> list[torch.Tensor]:
                # (tensor region, tail): the region into the mapped slot, whose size is the
                # plan's (the same every save: the slot is reused as it is); the tail (bytes
                # region, index, footer; a few bytes more or less each step) into private
                # memory, written behind the region once verified (as the owner's own slot)
                head = sizes[0] if len(sizes) == 2 else sum(sizes)
                try:
                    rs = self.pools.take_replica(step, src, max(head, 1))
                except Exception as e:
                    if not is_store_full(e):
                        raise
                    no_room[src] = f"{type(e).__name__}: {e}"
                    return [torch.empty(n, dtype=torch.uint8) for n in sizes]  # drained, dropped
                slots[src] = rs
                if len(sizes) == 2:
                    tails[src] = (head, torch.empty(sizes[1], dtype=torch.uint8))
                    return [rs.view[:head], tails[src][1]]
                out, pos = [], 0
                for n in sizes:
                    out.append(rs.view[pos:pos + n])
                    pos += n
                return out
            return fn

        sends = [Send(t, parts) for t in self.targets]
        recvs = [Recv(s, alloc(s)) for s in self.sources]
        result.replica_sent_bytes = sum(p.numel() for p in parts) * len(self.targets)
        _fault.hit("replicate", step, self.rank)
        try:
            self.transport.exchange(sends, recvs)
        except BaseException:
            self.pools.discard(step, list(slots.values()))
            raise
        received: list[tuple[int, int | None, str | None]] = []
        for src in self.sources:
            rs = slots.get(src)
            if src in no_room:
                received.append((src, None, f"no room for the replica: {no_room[src]}"))
                continue
            if rs is None or (src not in tails and rs.capacity <= 1):
                received.append((src, None, "no shard received (the owner failed)"))
                continue
            where = f"replica on node {self.node!r}"
            try:
                if src in tails:
                    head, tail = tails[src][0], _mv(tails[src][1])
                    with rs.memory as mem, mem[:head] as region:
                        _, icrc = check_split(region, tail, step=step, rank=src, where=where)
                    rs.write_tail([], bytes(tail), head)
                else:
                    with rs.memory as mem:
                        _, icrc = check_blob(mem, step=step, rank=src, where=where)
                received.append((src, icrc, None))
            except CorruptShardError as e:
                received.append((src, None, str(e)))
            except OSError as e:  # the tail did not fit: a full store skips the snapshot
                if not is_store_full(e):
                    raise
                no_room[src] = f"{type(e).__name__}: {e}"
                received.append((src, None, f"no room for the replica: {no_room[src]}"))
        full = all(err is None or src in no_room for src, _, err in received)
        return Protected(received, list(slots.values()), full)

    def verify(self, reports: Sequence[Any], records: dict[int, Any], summary: dict[int, tuple[int, int]],
               nodes: Sequence[str], failures: dict[int, str], full: dict[int, bool]
               ) -> tuple[dict[int, list[str]], Redundancy | None]:
        held: dict[int, list[str]] = {r: [] for r in range(len(reports))}
        for holder, rep in enumerate(reports):
            for src, icrc, rerr in rep[2]:
                if rerr is not None:
                    if reports[src][1] is not None:
                        continue  # the owner failed (counted by the engine); the holder got nothing
                    failures.setdefault(holder, f"replica of rank {src}: {rerr}")
                elif records.get(src) is not None and icrc != summary[src][1]:
                    failures.setdefault(holder, f"replica of rank {src} does not match its owner's crc32c")
                    full[holder] = False
                else:
                    held[src].append(nodes[holder])
        return held, None


def _item_key(item: WriteItem) -> tuple[Any, ...]:
    """What makes two ranks' tensor write items the same bytes when their states are equal:
    the name, the chunk's offsets and sizes in the global tensor, the dtype."""
    td = item.tensor_data
    assert td is not None
    return (item.index.fqn, tuple(td.chunk.offsets), tuple(td.chunk.sizes), td.properties.dtype)


class DpReplicaScheme(ReplicaScheme):
    """Whole replicas, as :class:`ReplicaScheme` places them, each built on its holder from the
    holder's own copy of the same tensors where it has one (a data-parallel replica: HSDP's
    replicate dimension, plain DP), so that only what the holder does not hold travels: the
    source's rank-unique items (RNG, per-rank entries), its bytes region, index and footer.

    Once per plan, rank 0 (which holds every rank's DCP local plan, before de-duplication, and
    final plan) lists for each (source, holder) pair the source's tensor slots that the holder's
    local plan has with the same name, chunk offsets, sizes and dtype (:meth:`plan_extras`); the
    holder gets the source's final plan and that list, the source the list. At each save the
    holder copies those tensors from its own state into the replica slot at the source's offsets,
    in the blocking part (:meth:`stage_local`: the state moves on after ``save`` returns; so the
    copy is synchronous in every staging mode); in the background the source sends the other
    slots and its tail, and the holder checks the assembled replica against the source's index,
    every chunk, as any received replica. A replica that differs (data-parallel copies that are
    not bitwise equal) fails the commit with an error that says so.

    The replica files, the manifest and the restore are exactly :class:`ReplicaScheme`'s, so are
    the node-store bytes; the bytes sent per snapshot fall from a shard per target to the
    source's unshared part. Costs: rank 0's extras are O(world x tensors) once per plan (as DCP's
    global plan); per rank and save, a copy of the source's shared tensors (as much as its own
    shard in HSDP) and O(tensors) bookkeeping: flat in the world size."""

    name = "dp"

    def __init__(self, placement: Placement, rank: int, node: str, *, group: Group,
                 pools: SlotPools, transport: Transport | None) -> None:
        super().__init__(placement, rank, node, group=group, pools=pools, transport=transport)
        # per source: its layout, the slots this rank copies, the byte ranges it receives
        self._src: dict[int, tuple[ShardLayout, tuple[int, ...], list[tuple[int, int]]]] = {}
        self._send: dict[int, list[tuple[int, int]]] = {}  # per target: the byte ranges sent
        # the step staged by stage_local: per source, its slot or why there is none
        self._staged: tuple[int, dict[int, Slot | str]] | None = None

    def plan_key(self) -> tuple[Any, ...]:
        return ("dp", tuple(self.sources), tuple(self.targets))

    def plan_extras(self, local_plans: Sequence[SavePlan], final_plans: Sequence[SavePlan],
                    chunk_bytes: int) -> list[Any] | None:
        held = [{_item_key(it) for it in p.items if it.type != WriteItemType.BYTE_IO}
                for p in local_plans]
        extras: list[dict[str, dict[int, Any]]] = [{"sources": {}, "targets": {}} for _ in final_plans]
        for s, plan in enumerate(final_plans):
            targets = self.placement.targets(s)
            if not targets:
                continue
            layout = plan_layout(plan.items, chunk_bytes=chunk_bytes)
            for t in targets:
                local = tuple(i for i, ts in enumerate(layout.tensors) if _item_key(ts.item) in held[t])
                extras[t]["sources"][s] = (plan.items, local)
                extras[s]["targets"][t] = local
        return extras

    def adopt(self, extra: Any, layout: ShardLayout) -> None:
        if extra is None:
            raise AegisError("redundancy='dp': the plan came without the data-parallel replicas' "
                             "extras (a plan cached under another scheme)")
        every = range(len(layout.tensors))
        self._send = {t: layout.spans(set(every) - set(local)) for t, local in extra["targets"].items()}
        self._src = {}
        for s, (items, local) in extra["sources"].items():
            src = plan_layout(items, chunk_bytes=layout.chunk_bytes)
            self._src[s] = (src, local, src.spans(set(range(len(src.tensors))) - set(local)))

    def stage_local(self, step: int, resolve: Callable[[WriteItem], Any],
                    stager: Stager | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        staged: dict[int, Slot | str] = {}
        self._staged = (step, staged)
        deferred: list[tuple[torch.Tensor, torch.Tensor]] = []
        for s, (layout, local, _) in self._src.items():
            try:
                rs = self.pools.take_replica(step, s, layout.tensor_end)
            except Exception as e:  # noqa: BLE001 - protect() still receives (and drops) it
                staged[s] = f"no room for the replica: {type(e).__name__}: {e}" if is_store_full(e) \
                    else f"{type(e).__name__}: {e}"
                continue
            staged[s] = rs
            try:
                if rs.clean is not layout:
                    zero_gaps(rs.view, layout)
                    rs.clean = layout
                views = rs.item_views(layout)
                pairs = [(views[i], resolve(layout.tensors[i].item)) for i in local]
                now, later = pairs, []
                if stager is not None and stager.mode == "async":  # as the own copies: the
                    split = stager.split(pairs)  # tensors an optimizer updates go to the barrier
                    now, later = split.now, split.later
                with torch.no_grad():
                    for dst, src in now:
                        dst.copy_(src.detach())
                deferred.extend(later)
            except Exception as e:  # noqa: BLE001 - reported by protect(), the commit aborts
                staged[s] = f"copying this rank's data-parallel copy of rank {s}'s tensors: " \
                            f"{type(e).__name__}: {e}"
                self.pools.discard(step, [rs])
        return deferred

    def staged_slots(self) -> list[Slot]:
        staged, self._staged = self._staged, None
        return [v for v in (staged[1].values() if staged else ()) if isinstance(v, Slot)]

    def _exchange(self, step: int, slot: Slot | None, staged: StagedShard | None, result: Any) -> Protected:
        if not self.targets and not self.sources:
            return Protected()
        assert self.transport is not None
        local: dict[int, Slot | str] = {}
        if self._staged is not None and self._staged[0] == step:
            local = self._staged[1]
        self._staged = None
        tails: dict[int, torch.Tensor] = {}
        sends = []
        for t in self.targets:
            parts: list[torch.Tensor] = []
            if staged is not None and slot is not None:
                parts = [slot.view[a:b] for a, b in self._send.get(t, [])]
                parts.append(torch.frombuffer(bytearray(staged.tail), dtype=torch.uint8))
            sends.append(Send(t, parts))
        bad: dict[int, str] = {}

        def alloc(src: int) -> Callable[[list[int]], list[torch.Tensor]]:
            layout, _, spans = self._src[src]

            def fn(sizes: list[int]) -> list[torch.Tensor]:
                rs = local.get(src)
                want = [b - a for a, b in spans]
                if sizes and sizes[:-1] != want:
                    bad[src] = f"rank {src} sent parts of {sizes[:-1]} bytes, expected {want}"
                if not isinstance(rs, Slot) or src in bad or not sizes:
                    return [torch.empty(n, dtype=torch.uint8) for n in sizes]  # drained, dropped
                tails[src] = torch.empty(sizes[-1], dtype=torch.uint8)
                return [*(rs.view[a:b] for a, b in spans), tails[src]]
            return fn

        recvs = [Recv(s, alloc(s)) for s in self.sources]
        result.replica_sent_bytes = sum(p.numel() for send in sends for p in send.parts)
        _fault.hit("replicate", step, self.rank)
        try:
            self.transport.exchange(sends, recvs)
        except BaseException:
            self.pools.discard(step, [v for v in local.values() if isinstance(v, Slot)])
            raise
        received: list[tuple[int, int | None, str | None]] = []
        kept: list[Slot] = []
        no_room: set[int] = set()
        for src in self.sources:
            rs = local.get(src)
            if not isinstance(rs, Slot):
                why = rs if isinstance(rs, str) else "no replica slot was staged"
                if why.startswith("no room"):
                    no_room.add(src)
                received.append((src, None, why))
                continue
            err = bad.get(src)
            if err is None and src not in tails:
                err = "no shard received (the owner failed)"
            if err is None:
                try:
                    layout = self._src[src][0]
                    with rs.memory as mem, mem[:layout.tensor_end] as head:
                        tail = _mv(tails[src])
                        _, icrc = check_split(head, tail, step=step, rank=src,
                                              where=f"replica on node {self.node!r}")
                    rs.write_tail([], bytes(tail), layout.tensor_end)
                    received.append((src, icrc, None))
                    kept.append(rs)
                    continue
                except CorruptShardError as e:
                    err = (f"{e}; this replica was built from rank {self.rank}'s own copy of rank "
                           f"{src}'s tensors (redundancy='dp'): are the data-parallel replicas "
                           "bitwise equal? If they are not, use redundancy='replica'")
                except OSError as e:  # the tail did not fit: a full store skips the snapshot
                    err = f"no room for the replica: {type(e).__name__}: {e}" if is_store_full(e) \
                        else f"writing the replica's tail: {type(e).__name__}: {e}"
                    if is_store_full(e):
                        no_room.add(src)
            received.append((src, None, err))
            self.pools.discard(step, [rs])
        full = all(err is None or src in no_room for src, _, err in received)
        return Protected(received, kept, full)


class _ParityScheme(Scheme):
    """Parity files over groups of ranks on distinct nodes (see ``aegis.snapshot.erasure``)."""

    what = "parity encoding"

    def __init__(self, placement: Placement, rank: int, node: str, *, group: Group, pools: SlotPools,
                 transport: Transport | None, groups: list[tuple[int, ...]], losses: int) -> None:
        super().__init__(placement, rank, node, group=group, pools=pools, transport=transport)
        self.groups = groups
        self.group_of = next((g for g in groups if rank in g), ())
        self.losses = losses

    def copies_per_shard(self) -> float:
        n = len(self.group_of)
        return self.losses / (n - self.losses) if n > self.losses else 0.0

    def protect(self, step: int, slot: Slot | None, staged: StagedShard | None,
                result: Any) -> Protected:
        """This rank's parity file for ``step``.

        Every rank first learns the shard lengths (one all-gather of the snapshot group: the
        stripe layout needs them); a group with a member that has no shard encodes nothing
        (that member's failure aborts the commit). Then the scheme's exchanges
        (:meth:`XorScheme._stripes`, :meth:`RsScheme._stripes`) fill the parity slot, which
        moves into the step directory with its crc32c."""
        t0 = time.perf_counter()
        try:
            return self._encode(step, slot, staged, result)
        finally:
            result.encode_s = time.perf_counter() - t0

    def _encode(self, step: int, slot: Slot | None, staged: StagedShard | None, result: Any) -> Protected:
        assert self.transport is not None
        length = staged.layout.tensor_end + len(staged.tail) if staged is not None and slot is not None else -1
        lengths = self.group.all_gather(length, "parity lengths")
        members = self.group_of
        if any(lengths[m] < 0 for m in members):
            return Protected()
        assert staged is not None and slot is not None
        te = staged.layout.tensor_end
        tail = torch.frombuffer(bytearray(staged.tail), dtype=torch.uint8) if staged.tail else None

        def cut(a: int, b: int) -> list[torch.Tensor]:
            parts = []
            if a < min(b, te):
                parts.append(slot.view[a:min(b, te)])
            if b > max(a, te) and tail is not None:
                parts.append(tail[max(a, te) - te:b - te])
            return parts

        pslot = self.pools.take_parity()
        try:
            size = self._stripes(step, [lengths[m] for m in members], cut, pslot, result)
            tc = time.perf_counter()
            pcrc = int(_crc32c.crc32c(_mv(pslot.view[:size])))
            result.encode_compute_s += time.perf_counter() - tc
        except BaseException:
            self.pools.discard(step, [pslot])
            raise
        result.parity_bytes = pslot.capacity
        return Protected(slots=[pslot], parity=(size, pcrc))

    def _stripes(self, step: int, lengths: list[int], cut: Callable[[int, int], list[torch.Tensor]],
                 pslot: Slot, result: Any) -> int:
        raise NotImplementedError

    def _expected(self, layout: StripeLayout) -> int:
        raise NotImplementedError

    def verify(self, reports: Sequence[Any], records: dict[int, Any], summary: dict[int, tuple[int, int]],
               nodes: Sequence[str], failures: dict[int, str], full: dict[int, bool]
               ) -> tuple[dict[int, list[str]], Redundancy | None]:
        held: dict[int, list[str]] = {r: [] for r in range(len(reports))}
        if failures:
            return held, None
        groups = []
        layout = None
        for members in self.groups:
            layout = stripe_layout([summary[m][0] for m in members], self.losses)
            expect = self._expected(layout)
            for m in members:
                par = reports[m][6]
                if par is None or par[0] != expect:
                    failures.setdefault(m, f"{self.name.upper()} parity not stored (got {par}, "
                                           f"expected {expect} bytes)")
                    full[m] = False
            groups.append(ParityGroup(members, layout.segment_size,
                                      tuple(reports[m][6][1] if reports[m][6] else 0 for m in members),
                                      expect if self.name == "rs" else -1))
        ec_type = (layout.ec_type if layout is not None else "") or RS_DEFAULT_EC_TYPE
        return held, Redundancy(self.name, tuple(groups), self.losses, ec_type if self.name == "rs" else "")

    def _segment_exchange(self, step: int, rounds: list[tuple[list[tuple[int, list[torch.Tensor]]], list[int]]],
                          size: int, result: Any) -> list[list[memoryview]]:
        """One exchange of parity segments: each round sends ``(member, parts)`` (this rank's
        segment for a stripe, crc32c appended) and receives one segment from each listed
        member into private scratch. Returns the received segments per round, each checked
        against its crc32c; a damaged one raises once every transfer is done."""
        assert self.transport is not None
        members = self.group_of
        total = sum(len(srcs) for _, srcs in rounds)
        scratch = torch.empty(total * (size + 8), dtype=torch.uint8)
        sends, recvs, got = [], [], {}
        w = 0
        for dests, srcs in rounds:
            for dst, parts in dests:
                crc = 0
                tc = time.perf_counter()
                for part in parts:
                    crc = _crc32c.crc32c(_mv(part), crc)
                result.encode_compute_s += time.perf_counter() - tc
                stamp = torch.frombuffer(bytearray(crc.to_bytes(8, "little")), dtype=torch.uint8)
                sends.append(Send(members[dst], [*parts, stamp]))
            for src in srcs:
                buf = scratch[w * (size + 8):(w + 1) * (size + 8)]

                def alloc(sizes: list[int], w: int = w, buf: torch.Tensor = buf) -> list[torch.Tensor]:
                    total = sum(sizes)
                    if total > size + 8 or not sizes or sizes[-1] != 8:
                        raise AegisError(f"parity encoding: a segment of {total} bytes for a "
                                         f"{size}-byte stripe")
                    got[w] = total - 8
                    out, pos = [], 0
                    for nbytes in sizes:
                        out.append(buf[pos:pos + nbytes])
                        pos += nbytes
                    return out

                recvs.append(Recv(members[src], alloc))
                w += 1
        self.transport.exchange(sends, recvs)
        tc = time.perf_counter()
        out: list[list[memoryview]] = []
        damaged: list[int] = []  # every transfer still ran: a peer never waits for a send
        w = 0
        for _, srcs in rounds:
            segs = []
            for src in srcs:
                nseg = got[w]
                buf = scratch[w * (size + 8):(w + 1) * (size + 8)]
                seg = _mv(buf[:nseg])
                if _crc32c.crc32c(seg) != int.from_bytes(_mv(buf[nseg:nseg + 8]), "little"):
                    damaged.append(members[src])
                segs.append(seg)
                w += 1
            out.append(segs)
        result.encode_compute_s += time.perf_counter() - tc
        if damaged:
            raise CorruptShardError(
                f"parity segment(s) from rank(s) {damaged} for the parity of rank {self.rank} at "
                f"step {step} were damaged in transit (crc32c differs)",
                step=step, rank=damaged[0], where=f"parity encoding on node {self.node!r}")
        return out


class XorScheme(_ParityScheme):
    """One XOR parity segment per member: any one lost member per group is rebuilt.

    N-1 rounds within the group; in round k member i sends its segment for stripe i+k to member
    i+k, with the segment's crc32c, and receives member i-k's segment for its own stripe,
    checks its crc32c and folds it into its parity slot. Rounds are posted together as far as
    ``_ENCODE_SCRATCH`` of private scratch allows (at least one segment); every member sends
    about one shard in all."""

    name = "xor"

    def _expected(self, layout: StripeLayout) -> int:
        return layout.segment_size

    def _stripes(self, step: int, lengths: list[int], cut: Callable[[int, int], list[torch.Tensor]],
                 pslot: Slot, result: Any) -> int:
        layout = xor_layout(lengths)
        members = self.group_of
        me, n, size = members.index(self.rank), len(members), layout.segment_size
        pslot.ensure(size)
        pslot.move(self.pools.store.parity_path(step, self.rank))
        parity = pslot.view[:size]
        parity.zero_()
        window = max(1, min(n - 1, _ENCODE_SCRATCH // max(size + 8, 1)))
        _fault.hit("encode", step, self.rank)
        for first in range(1, n, window):
            ks = range(first, min(n, first + window))
            rounds = [([((me + k) % n, cut(*layout.segment_range(me, (me + k) % n)))], [(me - k) % n])
                      for k in ks]
            segs = self._segment_exchange(step, rounds, size, result)
            tc = time.perf_counter()
            for (seg,) in segs:
                xor_into(_mv(parity), seg)
            result.encode_compute_s += time.perf_counter() - tc
        return size


class RsScheme(_ParityScheme):
    """Reed-Solomon parity pieces (k = ``losses`` of them per stripe): any k lost members per
    group are rebuilt.

    Two exchanges. First, member i sends its segment for each stripe t it feeds to t's first
    holder (member t), and, as first holder of its own stripe, receives that stripe's d
    segments (crc32c-checked), encodes them once (pyeclib) and keeps piece 0. Then it sends
    piece q to the stripe's holder q (member i + q) and receives piece q of stripe i - q from
    member i - q. Each member sends about one shard plus k-1 pieces, encodes one stripe, and
    holds one shard of scratch."""

    name = "rs"

    def _expected(self, layout: StripeLayout) -> int:
        return self.losses * rs_piece_size(layout)

    def _stripes(self, step: int, lengths: list[int], cut: Callable[[int, int], list[torch.Tensor]],
                 pslot: Slot, result: Any) -> int:
        layout = rs_stripe_layout(lengths, self.losses)
        members = self.group_of
        me, n, d, size = members.index(self.rank), len(members), layout.data, layout.segment_size
        k = self.losses
        piece = rs_piece_size(layout)
        pslot.ensure(max(k * piece, 1))
        pslot.move(self.pools.store.parity_path(step, self.rank, "rs"))
        _fault.hit("encode", step, self.rank)
        dests = [(t, cut(*layout.segment_range(me, t))) for t in ((me + 1 + s) % n for s in range(d))]
        srcs = [layout.contributor_at(me, p) for p in range(d)]
        (segs,) = self._segment_exchange(step, [(dests, srcs)], size, result)
        tc = time.perf_counter()
        pieces = [torch.frombuffer(bytearray(p), dtype=torch.uint8) if p else torch.empty(0, dtype=torch.uint8)
                  for p in rs_stripe_encode(layout, me, segs)]
        if piece:
            pslot.view[:piece].copy_(pieces[0])
        result.encode_compute_s += time.perf_counter() - tc
        if k > 1:
            sends = [((me + q) % n, [pieces[q]]) for q in range(1, k)]
            (got,) = self._segment_exchange(step, [(sends, [(me - q) % n for q in range(1, k)])],
                                            piece, result)
            for q, buf in zip(range(1, k), got, strict=True):
                if len(buf) != piece:
                    raise AegisError(f"RS parity piece {q} from rank {members[(me - q) % n]} is "
                                     f"{len(buf)} bytes, expected {piece}")
                if piece:
                    pslot.view[q * piece:(q + 1) * piece].copy_(torch.frombuffer(buf, dtype=torch.uint8))
        return k * piece


def build(redundancy: str, *, nodes: Sequence[str], domains: Sequence[str], rank: int, group: Group,
          pools: SlotPools, transport: Transport | None, replicas: int, group_size: int, parity: int,
          parity_fallback: bool) -> Scheme:
    """The scheme for this world (every rank chooses the same one from the same node map).

    RS in a world whose smallest group cannot hold ``parity`` + 2 members keeps the parity it
    can (XOR below 3); a world where no parity groups form (a recovery in place left it uneven:
    a worker of a 2-rank node lost) keeps one whole replica per shard with ``parity_fallback``
    (the next world that can form groups uses parity again), and otherwise raises. The Manager
    warns about both."""
    if redundancy not in ("replica", "dp", "xor", "rs"):
        raise AegisError(f"redundancy={redundancy!r}: use 'replica', 'dp', 'xor' or 'rs'")
    common: dict[str, Any] = {"group": group, "pools": pools, "transport": transport}
    node = nodes[rank]
    scheme: Scheme
    if redundancy in ("replica", "dp"):
        if redundancy == "dp" and replicas < 1:
            raise AegisError("redundancy='dp' builds the replicas from data-parallel copies: it "
                             "needs replicas >= 1")
        kind = DpReplicaScheme if redundancy == "dp" else ReplicaScheme
        scheme = kind(Placement.build(nodes, domains, replicas), rank, node, **common)
    else:
        placement = Placement.build(nodes, domains, 0)
        try:
            groups = parity_groups(placement, group_size)
            losses = 1
            cls: type[_ParityScheme] = XorScheme
            if redundancy == "rs":
                smallest = min(len(g) for g in groups)
                losses = max(1, min(parity, smallest - 2))
                if smallest >= 3:
                    cls = RsScheme  # pyeclib present: fail now, not at the first save
                    rs_piece_size(rs_stripe_layout([64] * smallest, losses))
            scheme = cls(placement, rank, node, groups=groups, losses=losses, **common)
        except (ValueError, ConfigError) as e:
            if not parity_fallback:
                raise AegisError(f"redundancy={redundancy!r} cannot form parity groups: {e}") from None
            scheme = ReplicaScheme(Placement.build(nodes, domains, 1), rank, node, **common)
            scheme.degraded = f"redundancy={redundancy!r} cannot form parity groups in this world ({e})"
    if (scheme.placement.effective_replicas or scheme.groups) and transport is None:
        raise AegisError("replicas > 0 or parity groups need a transport")
    return scheme


def shard_summary(rec: ShardRecord | tuple[int, ...]) -> tuple[int, int]:
    """(size, index crc32c) of a shard from its whole record or its summary (with parity
    groups also the index's start, which :func:`shard_summary` leaves out)."""
    return (rec.size, rec.index_crc32c) if isinstance(rec, ShardRecord) else (rec[0], rec[1])
