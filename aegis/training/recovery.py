"""Recovery: inventory -> choose one step -> fetch what is missing -> verify -> DCP load.

Collective: every rank calls :func:`restore_newest` once, before the training loop.

1. The first rank of every node lists its node store (steps, manifests, shard files); all ranks
   all-gather the inventories, so every rank computes the same decision without a broadcast.
2. The newest step that is committed on some node and whose every shard is held by some node is
   chosen; its manifest is broadcast from a node that has it.
3. Each rank plans its DCP load locally to learn which shards it reads; each node needs the union
   of its ranks' shards. Local copies are verified (crc32c of every chunk); missing or corrupt
   ones are fetched from a peer node holding a replica, verified on arrival, and on a mismatch
   fetched from the next holder.
4. If a shard has no intact source left, the step is abandoned for the next older committed one;
   if none is left the error names every step, shard and source tried. Nothing is loaded until
   every needed shard is verified.
5. DCP loads through :class:`ShardReader` (resharding when the world size changed).

This module orchestrates (and chooses each missing shard's source, :func:`_gather_shards`); the
phases live beside it: :mod:`.restore_choose` (inventory, the step), :mod:`.restore_fetch`
(from peers, from the durable tier), :mod:`.restore_rebuild` (from parity).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import mmap
import resource
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.planner import LoadItemType

from aegis import _fault, errors
from aegis._dist import Group
from aegis.errors import (
    AegisError,
    CorruptShardError,
    IncompatibleSnapshotError,
    ManifestError,
    StateMismatchError,
)
from aegis.snapshot.dcp_io import SafeLoadPlanner, ShardReader, plain_span
from aegis.snapshot.durable import list_steps, read_manifest
from aegis.snapshot.manifest import Manifest, Redundancy, ShardRecord
from aegis.snapshot.node_manifest import Layout, StepManifest
from aegis.snapshot.node_store import NodeStore
from aegis.snapshot.objstore import ObjectStore
from aegis.snapshot.shard import (
    chunks_for_ranges,
)
from aegis.snapshot.stream_read import byte_view
from aegis.snapshot.transport import Transport
from aegis.training.restore_choose import (  # noqa: F401 - re-exported (tests)
    _assemble_step,
    _choose,
    _inventory,
    _rebuild_blocker,
    _StepInv,
)
from aegis.training.restore_direct import DIRECT_MIN, Direct, Received
from aegis.training.restore_fetch import (  # noqa: F401 - re-exported (tests)
    DURABLE,
    REBUILD,
    _fetch_durable,
    _run_transfers,
    _runs,
)
from aegis.training.restore_rebuild import (  # noqa: F401 - re-exported (tests)
    _fold_rebuilds,
    _rebuild_tails,
    _run_rebuilds,
    _xor_ranges,
)

__all__ = ["RestoreResult", "restore_newest", "check_keys"]


@dataclass
class RestoreResult:
    step: int
    manifest: Manifest
    sources: list[dict[str, Any]] = field(default_factory=list)  # one per shard this rank read
    timings: dict[str, float] = field(default_factory=dict)
    bytes_read: int = 0
    bytes_fetched: int = 0  # received from peers or downloaded from the durable tier by this rank
    skipped: list[str] = field(default_factory=list)
    # minor page faults of this process during each phase (the keys of ``timings``, "_s" cut):
    # a load into memory written for the first time faults every page in (0.5-1.2 s per GB
    # here), into memory the process already used it does not
    page_faults: dict[str, int] = field(default_factory=dict)


def check_keys(state_dict: dict[str, Any], manifest: Manifest, *,
               include: Callable[[str], bool] = lambda k: True) -> None:
    """Raise StateMismatchError naming missing and unexpected keys (among those ``include``
    accepts)."""
    flat, _ = flatten_state_dict(state_dict)
    mine = {k for k in flat if include(k)}
    theirs = {k for k in manifest.entries if include(k)}
    missing = sorted(mine - theirs)
    unexpected = sorted(theirs - mine)
    if missing or unexpected:

        def show(keys: list[str]) -> str:
            head = ", ".join(keys[:8])
            return head + (f", ... ({len(keys)} in all)" if len(keys) > 8 else "")

        parts = []
        if missing:
            parts.append(f"missing from the snapshot: {show(missing)}")
        if unexpected:
            parts.append(f"unexpected (in the snapshot, not in this state): {show(unexpected)}")
        raise StateMismatchError(
            f"the state does not match the snapshot of step {manifest.step}: {'; '.join(parts)}. "
            "Build the same model/optimizer/state names as the run that saved it, or use another job"
        )


# -- the restore ---------------------------------------------------------------------------------


@contextlib.contextmanager
def _no_gc_pauses() -> Iterator[None]:
    """Python's cyclic collector off for the restore's span. A restore allocates many small
    objects (records, DCP plans and metadata: O(world x tensors)), which starts full
    collections over the training process's whole heap: measured here, a 0.2-0.25 s pause on
    one rank of two in most restores of a 1 GB state (0.6 s in all), which every other rank then
    waited for at the next all-gather. Nothing is leaked: the collector runs again after."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@_no_gc_pauses()
def restore_newest(
    store: NodeStore,
    group: Group,
    transport: Transport | None,
    *,
    node: str,
    nodes: list[str],
    is_leader: bool,
    make_state: Callable[[Manifest], dict[str, Any]],
    check_state: Callable[[dict[str, Any], Manifest], None],
    apply_state: Callable[[dict[str, Any], Manifest], None],
    durable: ObjectStore | None = None,
    step: int | None = None,
) -> RestoreResult | None:
    """Restore the newest complete, verified committed step; None when there is none at all.

    ``make_state(manifest)`` builds the state dict DCP loads into, ``check_state`` raises if it
    does not fit the snapshot (both run on every rank, errors raised on all of them), and
    ``apply_state`` puts the loaded values into the live objects. With ``step``, exactly that
    committed step or NoSnapshotError (never another one)."""
    t0 = time.perf_counter()
    timings: dict[str, float] = {}
    faults: dict[str, int] = {}
    seen = [_minflt()]

    def lap(name: str, since: float) -> float:
        now = time.perf_counter()
        timings[name] = timings.get(name, 0.0) + now - since
        n = _minflt()
        faults[name[:-2]] = faults.get(name[:-2], 0) + n - seen[0]
        seen[0] = n
        return now

    # 1. inventory of every node
    local: tuple[str, Any] = ("ok", None)
    durable_local: list[int] = []
    durable_note: str | None = None
    try:
        if is_leader:
            local = ("ok", _inventory(store))
    except AegisError as e:  # a manifest of another job / format: fatal, never guessed past
        local = ("error", (type(e).__name__, str(e)))
    if durable is not None and group.rank == 0:
        try:
            durable_local = list_steps(durable, store.job)[0]
        except Exception as e:  # noqa: BLE001 - an unreachable object store must not block memory
            durable_note = f"durable tier {durable.url} not listed: {type(e).__name__}: {e}"
    gathered = group.all_gather((node, local, (durable_local, durable_note)), "restore inventory")
    invs: dict[str, dict[int, _StepInv]] = {}
    durable_steps, note = gathered[0][2]
    skipped: list[str] = [note] if note else []
    for n, (kind, payload), _ in gathered:
        if kind == "error":
            cls = getattr(errors, payload[0], AegisError)
            raise cls(payload[1])
        if payload is not None:
            invs[n] = payload[0]
            skipped.extend(x for x in payload[1] if x not in skipped)
    t = lap("inventory_s", t0)

    bad: set[int] = set()
    distrust: dict[int, dict[tuple[str, int], str]] = {}  # step -> local copies a load found damaged
    overwritten: list[int] = []  # steps whose shards were received into the state, in place
    ranks_of = {n: [r for r, x in enumerate(nodes) if x == n] for n in dict.fromkeys(nodes)}
    want = step
    split_parts: tuple[Layout, StepManifest] | None = None
    while True:
        split_parts = None
        step, notes = _choose(invs, bad, durable_steps, want)
        skipped.extend(x for x in notes if x not in skipped)
        if step is None:
            # A streamed load writes a chunk's bytes before its crc32c is known (stream_read):
            # after a damaged copy was streamed, the state is no longer the one before restore().
            loaded = ("The state was partly overwritten by a damaged copy's bytes (each chunk is "
                      "checked as it lands): do not train from it" if distrust else
                      f"The state was partly overwritten by shards of step {max(overwritten)} "
                      "received into it before that step proved incomplete: do not train from it"
                      if overwritten else "Nothing was loaded")
            if want is not None:
                raise errors.NoSnapshotError(
                    f"restore(step={want}): that step cannot be restored; "
                    + "; ".join(skipped or ["it is not committed anywhere"])
                    + f". {loaded}. Call restore() for the newest intact step"
                )
            if skipped:
                raise CorruptShardError(
                    "committed snapshots exist but none is complete and intact; tried: "
                    + "; ".join(skipped)
                    + f". {loaded}. Restore from the durable tier, or remove the node "
                    f"store directories ({store.dir} here) to start from scratch",
                    step=-1, rank=-1,
                )
            _cleanup(store, is_leader, keep_step=None)
            return None
        # 2. the manifest: from the durable tier when it has the step (its chunk records say how
        # each chunk is stored there), else from the first node leader that has it
        durable_manifest: Manifest | None = None
        if step in durable_steps:
            outcome_d: tuple[str, Any] | None = None
            if group.rank == 0:
                try:
                    outcome_d = ("ok", read_manifest(durable, store.job, step))  # type: ignore[arg-type]
                except IncompatibleSnapshotError as e:  # a newer format: fatal, never guessed past
                    outcome_d = ("error", (type(e).__name__, str(e)))
                except ManifestError as e:  # damaged: the memory tier or an older step may serve
                    outcome_d = ("skip", f"step {step}: durable manifest skipped: {e}")
                except Exception as e:  # noqa: BLE001 - unreadable now: try an older step
                    outcome_d = ("skip", f"step {step}: durable manifest unreadable: {type(e).__name__}: {e}")
            kind, payload = group.broadcast(outcome_d, "restore durable manifest")
            if kind == "error":
                raise getattr(errors, payload[0], AegisError)(payload[1])
            if kind == "skip":
                # the same step may still be whole in memory; else an older one is chosen
                skipped.append(payload)
                durable_steps = [x for x in durable_steps if x != step]
                continue
            durable_manifest = manifest = payload
        else:
            src_node = min((n for n, inv in invs.items() if step in inv and inv[step].committed),
                           key=lambda n: ranks_of[n][0])
            src = ranks_of[src_node][0]
            if not invs[src_node][step].split:
                manifest = group.broadcast(
                    store.read_manifest(step) if group.rank == src else None, "restore manifest", src=src
                )
            else:
                def tails(saved_on: tuple[str, ...], red: Redundancy,
                          members: Mapping[int, tuple[int, int]],
                          records: Mapping[int, ShardRecord], missing: list[int], step: int = step,
                          ) -> tuple[dict[int, ShardRecord], list[str]]:
                    if transport is None:
                        return {}, [f"step {step}: no transport to rebuild lost indexes with"]
                    held, parity_held = _holder_lookups(invs, ranks_of, step)
                    return _rebuild_tails(store, group, transport, saved_on, step, red, members,
                                          records, missing, nodes[0],
                                          functools.partial(_worker, ranks_of), held, parity_held)

                got, why = _assemble_step(store, group, step, is_leader, src, tails)
                skipped.extend(x for x in why if x not in skipped)
                if got is None:
                    bad.add(step)
                    continue
                manifest, split_parts = got
        _fault.hit("restore", step, group.rank)
        t = lap("decide_s", t)
        # 3. what every node needs, from each rank's local DCP load plan
        box: dict[str, Any] = {}

        def build(m: Manifest = manifest, out: dict[str, Any] = box) -> None:
            out["sd"] = make_state(m)

        group.run_all("restore state", build)
        t = lap("state_s", t)
        state_dict = box["sd"]

        def key_check(sd: dict[str, Any] = state_dict, m: Manifest = manifest) -> None:
            check_state(sd, m)

        # shards this node does not hold (a replacement node's): may be received in place
        remote = {s for s in range(manifest.world_size)
                  if s not in getattr(invs.get(node, {}).get(step), "shards", ())}

        def plan_needs(sd: dict[str, Any] = state_dict, m: Manifest = manifest,
                       out: dict[str, Any] = box, remote: set[int] = remote) -> tuple[str, Any]:
            needs, out["load"] = _needed_chunks(sd, m, group.rank == 0, remote)
            out["needs"] = needs
            return node, needs

        group.run_all("restore key check", key_check)
        t = lap("key_check_s", t)
        needs = group.run_all("restore plan", plan_needs)
        need_by_node: dict[str, dict[int, set[int]]] = {n: {} for n in ranks_of}
        spans_by_node: dict[str, dict[int, list[tuple[int, int]]]] = {n: {} for n in ranks_of}
        readers: dict[tuple[str, int], list[tuple[int, list[tuple[int, int]]]]] = {}
        for r, (n, shards) in enumerate(needs):
            for s, (chunk_ids, spans, direct) in shards.items():
                need_by_node[n].setdefault(s, set()).update(chunk_ids)
                spans_by_node[n][s] = _merge(spans_by_node[n].get(s, []) + spans)
                readers.setdefault((n, s), []).append((r, direct))
        # (node, shard) -> (rank, ranges): its one reader there takes those items in place
        direct_by = {k: v[0] for k, v in readers.items() if len(v) == 1 and v[0][1]}
        t = lap("plan_s", t)
        maps: dict[str, mmap.mmap] = {}  # shards received whole, mapped, for the load
        received: dict[int, Received] = {}  # shards received into the state (restore_direct)
        outcome = _gather_shards(store, group, transport, manifest, node, invs, need_by_node, ranks_of,
                                 durable if durable_manifest is not None else None,
                                 spans_by_node=spans_by_node, maps=maps, distrust=distrust.get(step),
                                 direct_by=direct_by, targets=box["load"].targets, received=received)
        t = lap("fetch_verify_s", t)
        if outcome.into_state:
            overwritten.append(step)
        skipped.extend(x for x in outcome.rejected if x not in skipped)
        if outcome.failures:
            _close_maps(maps)
            skipped.extend(outcome.failures)
            bad.add(step)
            continue

        # 5. load: the shards of this node's store streamed into the state, each chunk's
        # crc32c checked as it lands; copies fetched from elsewhere (verified on arrival) mapped
        paths = {
            s: store.partial_path(step, s) if (node, s) in outcome.partial else store.shard_path(step, s)
            for s in need_by_node[node]
        }
        # shards this rank reads little of (replicated items another rank saved): mapped lazily
        sparse = {s for s, (_, spans, _) in box["needs"].items()
                  if 2 * sum(b - a for a, b in spans) < manifest.shard(s).size}
        unchecked = {s: ids for s, (ids, _, _) in box["needs"].items() if s not in outcome.origin}
        reader = ShardReader(manifest, paths, sparse=sparse, maps=maps, verify=unchecked,
                             received=received)

        def load(local: _LocalLoad = box["load"], reader: ShardReader = reader, step: int = step
                 ) -> tuple[str, int, str] | None:
            try:
                local.read(reader)
            except CorruptShardError as e:  # a local copy's chunk: that copy is fetched again
                return (node, e.rank, str(e))
            except Exception as e:  # noqa: BLE001 - one error on every rank (run_all)
                raise AegisError(f"loading step {step} failed: {type(e).__name__}: {e}") from None
            return None

        damaged = [x for x in group.run_all("restore load", load) if x is not None]
        t = lap("load_s", t)
        _close_maps(maps)
        if damaged:
            # The state holds some unverified bytes now; the next pass fetches those shards from
            # another copy and loads every byte again (or moves on to an older step).
            for n, s, err in damaged:
                distrust.setdefault(step, {})[(n, s)] = err  # the verdict adds "(local copy)"
                skipped.append(f"{n} (local copy): {err}")
            continue
        break

    apply_state(state_dict, manifest)
    t = lap("apply_s", t)
    # A local copy rejected in this restore (damaged, or another timeline's file of the same
    # step number) and not replaced by a whole copy is removed: left in place, the manifest
    # written below would vouch for it and the next restore would find the step broken here.
    if is_leader:
        for n, s in sorted(outcome.stale):
            if n == node:
                with contextlib.suppress(FileNotFoundError):
                    store.shard_path(step, s).unlink()
    # A memory step's manifest goes to every node that now holds whole shards of it (a
    # replacement node included); the durable manifest describes objects, not node files.
    if is_leader and durable_manifest is None and any(
        store.shard_path(step, s).exists() for s in range(manifest.world_size)
    ):
        mine = invs.get(node, {}).get(step)
        with contextlib.suppress(FileNotFoundError):
            # a replacement node now holds the step too; a damaged copy here is replaced
            if mine is None or not mine.committed:
                if split_parts is not None:  # format 4: its layout, then its step record
                    held = [s for s in range(manifest.world_size)
                            if store.shard_path(step, s).exists()]  # (parity: their groups)
                    store.write_manifest(split_parts[1].for_ranks(held), split_parts[0])
                else:
                    store.write_manifest(manifest)
    _cleanup(store, is_leader, keep_step=step, bad=bad)
    group.barrier("restore done")  # after every leader's cleanup: ranks then list a settled store
    timings["total_s"] = time.perf_counter() - t0
    sources = []
    for shard, nread in sorted(reader.bytes_by_rank.items()):
        origin = outcome.origin.get(shard)
        sources.append({
            "shard": shard,
            # source: where this shard came from (local, peer, rebuild, durable); tier: the
            # tier that held it (memory or durable), the CLI's word
            "source": "local" if origin is None else (origin[0] if origin[0] in (DURABLE, REBUILD) else "peer"),
            "tier": "durable" if origin is not None and origin[0] == DURABLE else "memory",
            "node": node if origin is None else origin[0],
            "bytes_read": nread,
            "read_s": round(reader.seconds_by_rank.get(shard, 0.0), 6),
            **({"fetch_bytes": origin[1], "fetch_s": round(origin[2], 6)} if origin else {}),
            **({"in_place": True} if shard in received else {}),  # received into the state
        })
    return RestoreResult(step, manifest, sources, timings, reader.bytes_read, outcome.fetched_bytes,
                         skipped, faults)


def _minflt() -> int:
    """Minor page faults of this process so far (every thread; ~1 us)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _close_maps(maps: dict[str, mmap.mmap]) -> None:
    for m in maps.values():
        with contextlib.suppress(BufferError):
            m.close()
    maps.clear()


@dataclass
class _LocalLoad:
    """This rank's DCP load, planned once (by :func:`_needed_chunks`) and run without DCP's
    collectives: ``dcp.load`` gathers every rank's local plan on the coordinator and scatters
    them back, and the default load planner's global step returns them unchanged, so the
    gather and scatter (pickled plans: 0.19 s of a 0.57 s restore of 0.5 GB, profiled here)
    buy nothing. The same calls as ``dcp.load``'s, in its order; errors reach every rank
    through the restore's own all-gather. Resharding is the local planner's work either way."""

    metadata: Any
    planner: SafeLoadPlanner
    plan: Any
    is_coordinator: bool
    targets: dict[int, dict[tuple[int, int], torch.Tensor]] = field(default_factory=dict)

    def read(self, reader: ShardReader) -> None:
        reader.set_up_storage_reader(self.metadata, self.is_coordinator)
        plan = self.planner.finish_plan(reader.prepare_local_plan(self.plan))
        reader.read_data(plan, self.planner).wait()


def _needed_chunks(state_dict: dict[str, Any], manifest: Manifest, is_coordinator: bool,
                   remote: Collection[int] = ()
                   ) -> tuple[dict[int, tuple[set[int], list[tuple[int, int]], list[tuple[int, int]]]],
                              _LocalLoad]:
    """shard rank -> (indices of the chunks this rank's DCP load plan reads, the byte ranges
    [start, end) it reads of them, merged, and, for the shards in ``remote`` (not on this
    node), the items it could receive in place: whole items of at least DIRECT_MIN bytes with a
    plain destination, whose byte views the load keeps in ``targets``); and the load, planned."""
    metadata = manifest.to_dcp_metadata()
    planner = SafeLoadPlanner()
    planner.set_up_planner(state_dict, metadata, is_coordinator)
    plan = planner.create_local_plan()
    ranges: dict[int, list[tuple[int, int]]] = {}
    spans: dict[int, list[tuple[int, int]]] = {}
    targets: dict[int, dict[tuple[int, int], torch.Tensor]] = {}
    items = {(s.rank, i.fqn, i.offset): i for s in manifest.shards for i in s.items}
    for item in plan.items:
        loc = metadata.storage_data[item.storage_index]
        ranges.setdefault(loc.rank, []).append((loc.file_offset, loc.length))
        off = item.storage_index.offset
        rec = items.get((loc.rank, item.storage_index.fqn, tuple(off) if off is not None else None))
        spans.setdefault(loc.rank, []).append(_read_span(loc.file_offset, loc.length, rec, item))
        if loc.rank in remote and rec is not None and item.type == LoadItemType.TENSOR \
                and rec.length >= DIRECT_MIN:
            target = planner.resolve_tensor(item).detach()
            whole = (rec.file_offset, rec.file_offset + rec.length)
            if plain_span(rec, item, target) == whole and byte_view(target) is not None:
                targets.setdefault(loc.rank, {})[whole] = target.reshape(-1).view(torch.uint8)
    direct: dict[int, list[tuple[int, int]]] = {}
    for s, by_span in targets.items():
        for a, b in sorted(by_span):
            if direct.get(s) and a < direct[s][-1][1]:  # two destinations of the same bytes
                del by_span[(a, b)]
            else:
                direct.setdefault(s, []).append((a, b))
    return ({s: (chunks_for_ranges(manifest.shard(s).chunks, rs), _merge(spans[s]), direct.get(s, []))
             for s, rs in ranges.items()}, _LocalLoad(metadata, planner, plan, is_coordinator, targets))


def _read_span(file_offset: int, length: int, rec: Any, item: Any) -> tuple[int, int]:
    """The bytes of a stored item that a DCP read of it touches: a resharded read narrows the
    stored chunk; along the first dimension only (FSDP's), that is one contiguous range of its
    rows, else the whole item."""
    shape = tuple(rec.shape) if rec is not None and rec.shape is not None else None
    offs, lens = tuple(item.storage_offsets), tuple(item.lengths)
    if not shape or len(shape) != len(offs) or any(
            o != 0 or n != d for o, n, d in zip(offs[1:], lens[1:], shape[1:], strict=True)):
        return (file_offset, file_offset + length)
    row = length // shape[0] if shape[0] else 0
    return (file_offset + offs[0] * row, file_offset + (offs[0] + lens[0]) * row)


def _merge(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """[start, end) spans sorted, overlapping or touching ones merged."""
    out: list[tuple[int, int]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


# A peer copy moves only the byte ranges a node reads when they are at most this share of the
# chunks holding them (a replacement reading step counters from a 16 MiB chunk); else whole
# chunks, verified on arrival as before.
RANGE_SHARE = 0.9


@dataclass
class _Outcome:
    failures: list[str] = field(default_factory=list)
    rejected: list[str] = field(default_factory=list)  # copies that failed verification
    partial: set[tuple[str, int]] = field(default_factory=set)  # (node, shard) fetched in part
    # (node, shard): local copies rejected here and not replaced by a whole copy fetched after
    stale: set[tuple[str, int]] = field(default_factory=set)
    origin: dict[int, tuple[str, int, float]] = field(default_factory=dict)  # shard -> (node, bytes, s)
    fetched_bytes: int = 0
    into_state: bool = False  # this rank's state received shard bytes in place (restore_direct)


def _worker(ranks_of: dict[str, list[int]], n: str, s: int) -> int:
    """The rank of node ``n`` that handles shard ``s`` there (spread over the node's ranks)."""
    return ranks_of[n][s % len(ranks_of[n])]


def _holder_lookups(invs: dict[str, dict[int, _StepInv]], ranks_of: dict[str, list[int]], step: int
                    ) -> tuple[Callable[[int], list[str]], Callable[[int], list[str]]]:
    """The nodes holding rank s's shard of ``step``, and those holding its parity file."""

    def holders(s: int) -> list[str]:
        return [n for n in ranks_of if step in invs.get(n, {}) and s in invs[n][step].shards]

    def parity_holders(s: int) -> list[str]:
        return [n for n in ranks_of if step in invs.get(n, {}) and s in invs[n][step].parity]

    return holders, parity_holders


def _gather_shards(
    store: NodeStore,
    group: Group,
    transport: Transport | None,
    manifest: Manifest,
    node: str,
    invs: dict[str, dict[int, _StepInv]],
    need_by_node: dict[str, dict[int, set[int]]],
    ranks_of: dict[str, list[int]],
    durable: ObjectStore | None = None,
    *,
    spans_by_node: dict[str, dict[int, list[tuple[int, int]]]] | None = None,
    maps: dict[str, mmap.mmap] | None = None,
    distrust: Mapping[tuple[str, int], str] | None = None,
    direct_by: Mapping[tuple[str, int], tuple[int, list[tuple[int, int]]]] | None = None,
    targets: Mapping[int, Mapping[tuple[int, int], torch.Tensor]] | None = None,
    received: dict[int, Received] | None = None,
) -> _Outcome:
    """Make every node hold copies of the shards it needs (collective): local copies checked
    for size and index (their chunks' crc32c is checked as the load streams them), copies from
    elsewhere verified whole on arrival. ``maps`` receives the mappings of the shards received
    whole (path -> mapping), which the load then reads instead of mapping them again.
    ``distrust``: (node, shard) -> why: local copies a load found damaged, fetched again.
    ``direct_by``: (node, shard) -> (rank, item ranges): a peer's copy goes straight into that
    rank's ``targets`` (restore_direct); what it received lands in ``received``."""
    distrust = distrust or {}
    step = manifest.step
    out = _Outcome()
    holders, parity_holders = _holder_lookups(invs, ranks_of, step)

    def rebuildable(s: int) -> bool:
        held = {r for r in range(manifest.world_size) if holders(r)}
        parity = {r for r in range(manifest.world_size) if parity_holders(r)}
        return _rebuild_blocker(manifest.redundancy, s, held, parity) is None

    worker = functools.partial(_worker, ranks_of)

    # Verify local copies; shard s on node n is checked by one rank of n.
    mine: list[tuple[str, int, str | None]] = []
    for n, shards in need_by_node.items():
        for s in sorted(shards):
            if n in holders(s) and worker(n, s) == group.rank:
                if (n, s) in distrust:  # its chunks failed their check as a load streamed them
                    mine.append((n, s, distrust[(n, s)]))
                    continue
                try:
                    # size and index here; every chunk's crc32c as the load streams it
                    store.verify_shard(step, manifest.shard(s), shards[s], check_chunks=False)
                    mine.append((n, s, None))
                except Exception as e:  # noqa: BLE001 - reported to every rank, never raised alone
                    mine.append((n, s, str(e)))
    verdicts = [v for vs in group.all_gather(mine, "restore verify") for v in vs]
    pending: set[tuple[str, int]] = {
        (n, s) for n, shards in need_by_node.items() for s in shards if n not in holders(s)
    }
    tried: dict[tuple[str, int], list[str]] = {}  # what was tried, for the error message
    used: dict[tuple[str, int], set[str]] = {}  # source nodes already tried
    good_copy: dict[int, list[str]] = {}
    for n, s, err in verdicts:
        if err is None:
            good_copy.setdefault(s, []).append(n)
        else:
            pending.add((n, s))
            out.stale.add((n, s))
            tried.setdefault((n, s), []).append(f"{n} (local copy): {err}")
            used.setdefault((n, s), set()).add(n)
            out.rejected.append(f"{n} (local copy): {err}")

    while pending:
        transfers: list[tuple[int, str, str, Any]] = []  # (shard, from node, to node, what)
        failures = []
        busy: dict[str, int] = {}
        for n, s in sorted(pending):
            options = [m for m in holders(s) if m != n and m not in used.get((n, s), set())]
            if not options and REBUILD not in used.get((n, s), set()) and not holders(s) \
                    and rebuildable(s):
                options = [REBUILD]  # from the parity group's survivors, still in memory
            if not options and durable is not None and DURABLE not in used.get((n, s), set()):
                options = [DURABLE]  # memory copies first, the object store last
            if not options:
                what = "; ".join(tried.get((n, s), [])) or "no node holds it"
                failures.append(f"step {step}: no intact copy of the shard of rank {s} for node "
                                f"{n!r} (tried: {what})")
                continue
            # verified copies first, then the least busy sender
            options.sort(key=lambda m: (m not in good_copy.get(s, []), busy.get(m, 0)))
            ids = need_by_node[n][s]
            full = len(ids) == len(manifest.shard(s).chunks)
            spans = (spans_by_node or {}).get(n, {}).get(s)
            chunks = manifest.shard(s).chunks
            if options[0] != REBUILD and (n, s) in (direct_by or {}):
                rank, ranges = (direct_by or {})[(n, s)]
                transfers.append((s, options[0], n, Direct(ids, rank, ranges)))
            elif (options[0] not in (DURABLE, REBUILD) and spans is not None
                    and sum(b - a for a, b in spans)
                    <= RANGE_SHARE * sum(chunks[i].length for i in ids)):
                transfers.append((s, options[0], n, (ids, spans)))  # only the bytes it reads
            else:
                transfers.append((s, options[0], n, None if full else ids))
            busy[options[0]] = busy.get(options[0], 0) + 1
        if failures:
            out.failures = failures
            return out
        if transport is None and any(t[1] != DURABLE for t in transfers):
            raise AegisError("shards must be fetched from peers but no transport is configured")
        # a copy received into this rank's state writes it, before (peer) or after (durable)
        # its check: should the step prove incomplete, the restore's error says so
        if any(isinstance(t[3], Direct) and t[3].rank == group.rank for t in transfers):
            out.into_state = True
        peer = [t for t in transfers if t[1] not in (DURABLE, REBUILD)]
        rebuilds = [t for t in transfers if t[1] == REBUILD]
        results = []
        if peer:
            assert transport is not None
            results = _run_transfers(store, group, transport, manifest, peer, worker, maps=maps,
                                     targets=targets, received=received)
        if rebuilds:
            assert transport is not None
            results += _run_rebuilds(store, group, transport, manifest, rebuilds, worker,
                                     holders, parity_holders)
        for shard, origin, dst, wanted in transfers:
            # into the state: by its one reader on the node; else by the shard's worker there
            fetcher = wanted.rank if isinstance(wanted, Direct) else worker(dst, shard)
            if origin == DURABLE and fetcher == group.rank:
                results.append(_fetch_durable(store, durable, manifest, shard, dst, wanted,
                                              targets=targets, received=received))
        pending = set()
        for s, src, dst, err, nbytes, secs, part in (
            x for xs in group.all_gather(results, "restore fetch") for x in xs
        ):
            if err is None:
                if part:
                    out.partial.add((dst, s))
                else:  # a whole verified copy replaced the node's file
                    out.stale.discard((dst, s))
                if dst == node:
                    out.origin[s] = (src, nbytes, secs)
                    out.fetched_bytes += nbytes
            else:
                pending.add((dst, s))
                tried.setdefault((dst, s), []).append(f"{src}: {err}")
                used.setdefault((dst, s), set()).add(src)
                out.rejected.append(f"{src} -> {dst}: {err}")
    return out


def _cleanup(store: NodeStore, is_leader: bool, *, keep_step: int | None, bad: set[int] | None = None) -> None:
    """Leader of each node: drop what can never be restored: steps newer than the one restored
    (uncommitted, incomplete or corrupt), uncommitted leftovers, and corrupt steps."""
    if not is_leader:
        return
    store.sweep_removed()
    for info in store.steps():
        newer = keep_step is not None and info.step > keep_step
        if (bad and info.step in bad) or not info.committed or newer:
            store.remove_step(info.step, later=True)  # the pages freed after the restore
        else:
            for f in store.step_dir(info.step).glob(".partial-*"):
                f.unlink(missing_ok=True)
