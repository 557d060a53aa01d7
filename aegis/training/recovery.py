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
"""

from __future__ import annotations

import contextlib
import mmap
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.api import CheckpointException

from aegis import _fault, errors
from aegis._dist import Group
from aegis.errors import (
    AegisError,
    CorruptShardError,
    IncompatibleSnapshotError,
    ManifestError,
    StateMismatchError,
)
from aegis.snapshot.dcp_io import SafeLoadPlanner, ShardReader
from aegis.snapshot.durable import fetch_chunks, list_steps, read_manifest
from aegis.snapshot.erasure import StripeLayout, rs_piece_size, rs_stripe_decode, xor_into
from aegis.snapshot.manifest import (
    ChunkRecord,
    Layout,
    Manifest,
    Redundancy,
    ShardRecord,
    StepManifest,
    assemble_any,
)
from aegis.snapshot.node_store import NodeStore, Slot
from aegis.snapshot.objstore import ObjectStore
from aegis.snapshot.shard import (
    FOOTER_SIZE,
    check_blob,
    check_index_matches,
    chunks_for_ranges,
    crc32c,
    decode_footer,
    decode_index,
    verify_chunks,
)
from aegis.snapshot.transport import Recv, Send, Transport

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


# -- inventory and decision (pure once gathered) ------------------------------------------------


@dataclass(frozen=True)
class _StepInv:
    committed: bool
    world_size: int | None
    shards: tuple[int, ...]
    parity: tuple[int, ...] = ()  # ranks whose XOR parity stripe this node holds
    redundancy: Redundancy | None = None  # from this node's manifest, when committed
    split: bool = False  # committed here as a format-4 step record + layout (assembled at restore)


def _rebuild_blocker(red: Redundancy | None, shard: int, held: set[int], parity_held: set[int]
                     ) -> str | None:
    """Why the missing ``shard`` cannot be rebuilt from its parity group (None: it can)."""
    group = red.group_of(shard) if red is not None else None
    if group is None:
        return "no parity group covers it"
    lost = [m for m in group.members if m not in held]
    k, code = red.parity, red.scheme.upper()  # type: ignore[union-attr]
    if len(lost) > k:
        return (f"its {code} parity group (ranks {list(group.members)}) lost the shards of ranks {lost}; "
                f"{code} parity rebuilds {'one lost member' if k == 1 else f'{k} lost members'} per group")
    gone = [m for m in group.members if m not in lost and m not in parity_held]
    if len(lost) + len(gone) > k:
        return (f"its {code} parity group (ranks {list(group.members)}) lost the parity of rank(s) "
                f"{gone} as well")
    return None


def _inventory(store: NodeStore) -> tuple[dict[int, _StepInv], list[str]]:
    """What this node holds, and the steps whose manifest is damaged here (skipped: treated as
    not committed on this node, its shards still usable against another node's manifest).
    A manifest of another job or format is no damage: it raises."""
    out = {}
    notes: list[str] = []
    for info in store.steps():
        world = None
        red = None
        committed = info.committed
        split = False
        if committed:
            try:
                m = store.read_node_manifest(info.step)
                if isinstance(m, StepManifest):
                    lnotes: list[str] = []
                    store.read_layout(m.layout, lnotes)  # an intact copy, or not committed here
                    notes.extend(f"step {info.step}: {n}" for n in lnotes)
                    world, split = m.world_size, True
                else:
                    world, red = m.world_size, m.redundancy
            except IncompatibleSnapshotError:
                raise
            except ManifestError as e:
                committed = False
                notes.append(f"step {info.step}: manifest on node store {store.dir} skipped: {e}")
        out[info.step] = _StepInv(committed, world, info.shard_ranks, info.parity_ranks, red, split)
    return out, notes


def _choose(invs: dict[str, dict[int, _StepInv]], bad: set[int], durable_steps: list[int],
            want: int | None = None) -> tuple[int | None, list[str]]:
    """The newest step committed on some node with every shard held by some node, or committed
    on the durable tier, whichever is newer (memory preferred for the same step); only ``want``
    when given."""
    notes: list[str] = []
    steps = sorted({s for inv in invs.values() for s, i in inv.items() if i.committed}
                   | set(durable_steps), reverse=True)
    if want is not None:
        if want not in steps:
            notes.append(f"step {want} is not committed on any node store or the durable tier "
                         f"(committed: {sorted(steps)[-8:] or 'none'})")
        steps = [s for s in steps if s == want]
    for step in steps:
        if step in bad:
            continue
        if step in durable_steps:
            return step, notes
        world = next(inv[step].world_size for inv in invs.values() if step in inv and inv[step].committed)
        assert world is not None
        held = {s for inv in invs.values() if step in inv for s in inv[step].shards}
        missing = [s for s in range(world) if s not in held]
        if missing:
            red = next((inv[step].redundancy for inv in invs.values()
                        if step in inv and inv[step].redundancy is not None), None)
            parity = {p for inv in invs.values() if step in inv for p in inv[step].parity}
            blockers = {s: _rebuild_blocker(red, s, held, parity) for s in missing}
            if any(blockers.values()):
                why = "; ".join(f"rank {s}: {b}" for s, b in blockers.items() if b)
                notes.append(f"step {step}: shards of rank(s) {missing} missing on every node ({why})")
                continue
        return step, notes
    return None, notes


def _assemble_step(store: NodeStore, group: Group, step: int, is_leader: bool, src: int
                   ) -> tuple[tuple[Manifest, tuple[Layout, StepManifest]] | None, list[str]]:
    """The whole manifest of a format-4 step, put together on every rank: the first node that
    committed it sends its layout and step record, every node leader sends the records (from the
    shards' own crc-checked indexes) of the shards of that step it holds; one all-gather
    (O(world) records in all: what the whole manifest held, moved once per restore instead of
    written at every step). A rank whose copies disagree is settled by the step's digest.
    Returns (manifest, (layout, step record)) or None, and notes on the copies passed over."""
    parts: tuple[Layout, StepManifest] | None = None
    records: dict[int, ShardRecord] = {}
    notes: list[str] = []
    if is_leader:
        info = next((i for i in store.steps() if i.step == step), None)
        for r in info.shard_ranks if info is not None else ():
            try:
                records[r] = store.shard_record(step, r)
            except (OSError, ManifestError) as e:  # this copy's index is damaged: others may do
                notes.append(f"step {step}: index of rank {r}'s shard on node store {store.dir} "
                             f"skipped: {e}")
    if group.rank == src:
        try:
            m = store.read_node_manifest(step)
            assert isinstance(m, StepManifest)
            parts = (store.read_layout(m.layout), m)
        except (ManifestError, AssertionError) as e:
            notes.append(f"step {step}: manifest on node store {store.dir} unreadable: {e}")
    gathered = group.all_gather((parts, records, notes), "restore records")
    found = next((p for p, _, _ in gathered if p is not None), None)
    why = [n for _, _, ns in gathered for n in ns]
    if found is None:
        return None, why or [f"step {step}: no readable format-4 manifest"]
    candidates: dict[int, list[ShardRecord]] = {}
    for _, recs, _ in gathered:
        for r, rec in recs.items():
            candidates.setdefault(r, []).append(rec)
    layout, stepm = found
    try:
        manifest = assemble_any(layout, stepm, candidates, where=f"step {step}")
    except ManifestError as e:
        return None, [*why, f"step {step}: {e}"]
    return (manifest, found), why


# -- the restore ---------------------------------------------------------------------------------


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

    def lap(name: str, since: float) -> float:
        now = time.perf_counter()
        timings[name] = timings.get(name, 0.0) + now - since
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
    ranks_of = {n: [r for r, x in enumerate(nodes) if x == n] for n in dict.fromkeys(nodes)}
    want = step
    split_parts: tuple[Layout, StepManifest] | None = None
    while True:
        split_parts = None
        step, notes = _choose(invs, bad, durable_steps, want)
        skipped.extend(x for x in notes if x not in skipped)
        if step is None:
            if want is not None:
                raise errors.NoSnapshotError(
                    f"restore(step={want}): that step cannot be restored; "
                    + "; ".join(skipped or ["it is not committed anywhere"])
                    + ". Nothing was loaded. Call restore() for the newest intact step"
                )
            if skipped:
                raise CorruptShardError(
                    "committed snapshots exist but none is complete and intact; tried: "
                    + "; ".join(skipped)
                    + f". Nothing was loaded. Restore from the durable tier, or remove the node "
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
                got, why = _assemble_step(store, group, step, is_leader, src)
                skipped.extend(x for x in why if x not in skipped)
                if got is None:
                    bad.add(step)
                    continue
                manifest, split_parts = got
        _fault.hit("restore", step, group.rank)
        t = lap("decide_s", t)
        # 3. what every node needs, from each rank's local DCP load plan
        box: dict[str, dict[str, Any]] = {}

        def build(m: Manifest = manifest, out: dict[str, dict[str, Any]] = box) -> None:
            out["sd"] = make_state(m)

        group.run_all("restore state", build)
        state_dict = box["sd"]

        def key_check(sd: dict[str, Any] = state_dict, m: Manifest = manifest) -> None:
            check_state(sd, m)

        def plan_needs(sd: dict[str, Any] = state_dict, m: Manifest = manifest
                       ) -> tuple[str, dict[int, tuple[set[int], list[tuple[int, int]]]]]:
            return node, _needed_chunks(sd, m, group.rank == 0)

        group.run_all("restore key check", key_check)
        needs = group.run_all("restore plan", plan_needs)
        need_by_node: dict[str, dict[int, set[int]]] = {n: {} for n in ranks_of}
        spans_by_node: dict[str, dict[int, list[tuple[int, int]]]] = {n: {} for n in ranks_of}
        for n, shards in needs:
            for s, (chunk_ids, spans) in shards.items():
                need_by_node[n].setdefault(s, set()).update(chunk_ids)
                spans_by_node[n][s] = _merge(spans_by_node[n].get(s, []) + spans)
        t = lap("plan_s", t)
        outcome = _gather_shards(store, group, transport, manifest, node, invs, need_by_node, ranks_of,
                                 durable if durable_manifest is not None else None,
                                 spans_by_node=spans_by_node)
        t = lap("fetch_verify_s", t)
        skipped.extend(outcome.rejected)
        if outcome.failures:
            skipped.extend(outcome.failures)
            bad.add(step)
            continue
        break

    # 5. load
    paths = {
        s: store.partial_path(step, s) if (node, s) in outcome.partial else store.shard_path(step, s)
        for s in need_by_node[node]
    }
    reader = ShardReader(manifest, paths)
    try:
        dcp.load(state_dict, storage_reader=reader, planner=SafeLoadPlanner(), process_group=group.pg)
    except CheckpointException as e:  # a BaseException: turn it into an ordinary error
        raise AegisError(f"loading step {step} failed: {e}") from None
    t = lap("load_s", t)
    apply_state(state_dict, manifest)
    t = lap("apply_s", t)
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
                    store.write_manifest(split_parts[1], split_parts[0])
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
            "tier": "local" if origin is None else (origin[0] if origin[0] in (DURABLE, REBUILD) else "peer"),
            "node": node if origin is None else origin[0],
            "bytes_read": nread,
            "read_s": round(reader.seconds_by_rank.get(shard, 0.0), 6),
            **({"fetch_bytes": origin[1], "fetch_s": round(origin[2], 6)} if origin else {}),
        })
    return RestoreResult(step, manifest, sources, timings, reader.bytes_read, outcome.fetched_bytes, skipped)


def _needed_chunks(state_dict: dict[str, Any], manifest: Manifest, is_coordinator: bool
                   ) -> dict[int, tuple[set[int], list[tuple[int, int]]]]:
    """shard rank -> (indices of the chunks this rank's DCP load plan reads, the byte ranges
    [start, end) it reads of them, merged)."""
    metadata = manifest.to_dcp_metadata()
    planner = SafeLoadPlanner()
    planner.set_up_planner(state_dict, metadata, is_coordinator)
    plan = planner.create_local_plan()
    ranges: dict[int, list[tuple[int, int]]] = {}
    spans: dict[int, list[tuple[int, int]]] = {}
    items = {(s.rank, i.fqn, i.offset): i for s in manifest.shards for i in s.items}
    for item in plan.items:
        loc = metadata.storage_data[item.storage_index]
        ranges.setdefault(loc.rank, []).append((loc.file_offset, loc.length))
        off = item.storage_index.offset
        rec = items.get((loc.rank, item.storage_index.fqn, tuple(off) if off is not None else None))
        spans.setdefault(loc.rank, []).append(_read_span(loc.file_offset, loc.length, rec, item))
    return {s: (chunks_for_ranges(manifest.shard(s).chunks, rs), _merge(spans[s]))
            for s, rs in ranges.items()}


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
    origin: dict[int, tuple[str, int, float]] = field(default_factory=dict)  # shard -> (node, bytes, s)
    fetched_bytes: int = 0


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
) -> _Outcome:
    """Make every node hold verified copies of the shards it needs (collective)."""
    step = manifest.step
    out = _Outcome()

    def holders(s: int) -> list[str]:
        return [n for n in ranks_of if step in invs.get(n, {}) and s in invs[n][step].shards]

    def parity_holders(s: int) -> list[str]:
        return [n for n in ranks_of if step in invs.get(n, {}) and s in invs[n][step].parity]

    def rebuildable(s: int) -> bool:
        held = {r for r in range(manifest.world_size) if holders(r)}
        parity = {r for r in range(manifest.world_size) if parity_holders(r)}
        return _rebuild_blocker(manifest.redundancy, s, held, parity) is None

    def worker(n: str, s: int) -> int:
        return ranks_of[n][s % len(ranks_of[n])]

    # Verify local copies; shard s on node n is checked by one rank of n.
    mine: list[tuple[str, int, str | None]] = []
    for n, shards in need_by_node.items():
        for s in sorted(shards):
            if n in holders(s) and worker(n, s) == group.rank:
                try:
                    store.verify_shard(step, manifest.shard(s), shards[s])
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
            if (options[0] not in (DURABLE, REBUILD) and spans is not None
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
        peer = [t for t in transfers if t[1] not in (DURABLE, REBUILD)]
        rebuilds = [t for t in transfers if t[1] == REBUILD]
        results = []
        if peer:
            assert transport is not None
            results = _run_transfers(store, group, transport, manifest, peer, worker)
        if rebuilds:
            assert transport is not None
            results += _run_rebuilds(store, group, transport, manifest, rebuilds, worker,
                                     holders, parity_holders)
        for shard, origin, dst, wanted in transfers:
            if origin == DURABLE and worker(dst, shard) == group.rank:
                results.append(_fetch_durable(store, durable, manifest, shard, dst, wanted))
        pending = set()
        for s, src, dst, err, nbytes, secs, part in (
            x for xs in group.all_gather(results, "restore fetch") for x in xs
        ):
            if err is None:
                if part:
                    out.partial.add((dst, s))
                if dst == node:
                    out.origin[s] = (src, nbytes, secs)
                    out.fetched_bytes += nbytes
            else:
                pending.add((dst, s))
                tried.setdefault((dst, s), []).append(f"{src}: {err}")
                used.setdefault((dst, s), set()).add(src)
                out.rejected.append(f"{src} -> {dst}: {err}")
    return out


def _fixed(view: torch.Tensor) -> Callable[[list[int]], list[torch.Tensor]]:
    """A Recv allocator that receives into ``view``."""
    return lambda sizes: [view]


def _runs(chunks: list[ChunkRecord], ids: set[int], *, size: int | None = None) -> list[tuple[int, int]]:
    """Byte ranges [start, end) covering the chunks ``ids``, contiguous chunks merged; with
    ``size`` (the shard's size) also the index and footer after the last chunk."""
    spans = [(chunks[i].offset, chunks[i].offset + chunks[i].length) for i in sorted(ids)]
    if size is not None:
        spans.append((chunks[-1].offset + chunks[-1].length if chunks else 0, size))
    out: list[tuple[int, int]] = []
    for a, b in spans:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def _check_partial(mem: memoryview, rec: Any, step: int, ids: set[int], where: str) -> None:
    """A partial copy: the chunks it holds, and its own index, which must match the manifest."""
    verify_chunks(mem, rec.chunks, step=step, rank=rec.rank, where=where, only=ids)
    size = len(mem)
    try:
        start, icrc = decode_footer(bytes(mem[size - FOOTER_SIZE:]), size=size, where=where)
        index = decode_index(bytes(mem[start:size - FOOTER_SIZE]), crc=icrc, size=size, where=where)
    except ManifestError as e:
        raise CorruptShardError(f"shard of rank {rec.rank} at step {step}: {e}", step=step,
                                rank=rec.rank, where=where) from e
    if icrc != rec.index_crc32c:
        raise CorruptShardError(f"copy of the shard of rank {rec.rank} from {where} does not match "
                                "the manifest (index crc32c differs)", step=step, rank=rec.rank, where=where)
    check_index_matches(index, rec, step=step, where=where)


def _run_transfers(
    store: NodeStore,
    group: Group,
    transport: Transport,
    manifest: Manifest,
    transfers: list[tuple[int, str, str, Any]],
    worker: Callable[[str, int], int],
) -> list[tuple[int, str, str, str | None, int, float, bool]]:
    """One round of copies between nodes: a whole shard (ids None), the chunks a node needs
    (a set of chunk ids: their byte runs, the index and footer), or only the byte ranges it
    reads ((ids, spans): the sender checks those chunks against the manifest first and sends
    the spans with a crc32c of each, which the receiver checks). Receivers verify what arrives
    before it is used."""
    step = manifest.step
    sends: list[Send] = []
    recvs: list[Recv] = []
    opened: list[mmap.mmap] = []
    incoming: dict[int, tuple[Slot, str, str, set[int] | None]] = {}
    spans_in: dict[int, tuple[Slot, str, str, list[tuple[int, int]], list[torch.Tensor]]] = {}
    t0 = time.perf_counter()
    ranged = [t for t in transfers if isinstance(t[3], tuple)]
    transfers = [t for t in transfers if not isinstance(t[3], tuple)]
    for s, src, dst, (ids, spans) in ranged:
        sender, receiver = worker(src, s), worker(dst, s)
        rec = manifest.shard(s)
        total = sum(b - a for a, b in spans)
        if sender == group.rank:
            crcs = torch.full((len(spans),), -1, dtype=torch.int64)
            data = torch.zeros(total, dtype=torch.uint8)
            try:
                with open(store.shard_path(step, s), "rb") as f:
                    if os.fstat(f.fileno()).st_size != rec.size:
                        raise ValueError("size differs from the manifest")
                    m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
                try:
                    verify_chunks(m, rec.chunks, step=step, rank=s, where=f"node {src!r}", only=ids)
                    with warnings.catch_warnings():  # read-only mapping, only read
                        warnings.simplefilter("ignore", UserWarning)
                        whole = torch.frombuffer(m, dtype=torch.uint8)
                    view = memoryview(m)
                    pos = 0
                    for i, (a, b) in enumerate(spans):
                        data[pos:pos + b - a].copy_(whole[a:b])
                        crcs[i] = crc32c(view[a:b])
                        pos += b - a
                    del whole, view
                finally:
                    with contextlib.suppress(BufferError):
                        m.close()
            except (OSError, ValueError, CorruptShardError):
                crcs.fill_(-1)  # the receiver rejects it and tries the next source
            sends.append(Send(receiver, [data, crcs.view(torch.uint8)]))
        if receiver == group.rank:
            store.step_dir(step).mkdir(mode=0o700, parents=True, exist_ok=True)
            slot = Slot(store.partial_path(step, s))
            slot.ensure(rec.size, prefault=False)  # sparse: only the spans are written
            bufs = [torch.empty(total, dtype=torch.uint8), torch.empty(8 * len(spans), dtype=torch.uint8)]
            spans_in[s] = (slot, src, dst, spans, bufs)
            recvs.append(Recv(sender, _fixed_many(bufs)))
    for s, src, dst, ids in transfers:
        sender, receiver = worker(src, s), worker(dst, s)
        rec = manifest.shard(s)
        runs = [(0, rec.size)] if ids is None else _runs(list(rec.chunks), ids, size=rec.size)
        if sender == receiver:
            raise AegisError("internal: a node fetching from itself")
        if sender == group.rank:
            try:
                with open(store.shard_path(step, s), "rb") as f:
                    size = os.fstat(f.fileno()).st_size
                    if size != rec.size:
                        raise ValueError(f"{size} bytes, the manifest says {rec.size}")
                    m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
                opened.append(m)
                whole = torch.frombuffer(m, dtype=torch.uint8)
            except (OSError, ValueError):
                # The receiver has posted its receives: send as many bytes, which its checks
                # then reject, so it moves on to the next source instead of waiting out a timeout.
                whole = torch.zeros(rec.size, dtype=torch.uint8)
            sends.extend(Send(receiver, [whole[a:b]]) for a, b in runs)
        if receiver == group.rank:
            store.step_dir(step).mkdir(mode=0o700, parents=True, exist_ok=True)
            path = (store.step_dir(step) / f".recv-rank-{s:05d}.shard" if ids is None
                    else store.partial_path(step, s))
            slot = Slot(path)
            # a whole shard is pre-faulted; a partial one stays sparse
            slot.ensure(rec.size, prefault=ids is None)
            incoming[s] = (slot, src, dst, ids)
            for a, b in runs:
                recvs.append(Recv(sender, _fixed(slot.view[a:b])))
    try:
        transport.exchange(sends, recvs)
    except BaseException:
        for slot in [x[0] for x in incoming.values()] + [x[0] for x in spans_in.values()]:
            slot.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(slot.path)
        raise
    finally:
        for m in opened:
            with contextlib.suppress(BufferError):
                m.close()
    secs = time.perf_counter() - t0
    results = []
    for s, (slot, src, dst, ids) in sorted(incoming.items()):
        rec = manifest.shard(s)
        err = None
        where = f"copy from node {src!r}"
        try:
            with slot.memory as mem:
                if ids is None:
                    index, icrc = check_blob(mem, step=step, rank=s, where=where)
                    if icrc != rec.index_crc32c:
                        raise CorruptShardError(f"copy of the shard of rank {s} from node {src!r} "
                                                "does not match the manifest", step=step, rank=s)
                    check_index_matches(index, rec, step=step, where=where)
                else:
                    _check_partial(mem, rec, step, ids, where)
        except CorruptShardError as e:
            err = str(e)
        slot.close()
        nbytes = sum(b - a for a, b in ([(0, rec.size)] if ids is None
                                        else _runs(list(rec.chunks), ids, size=rec.size)))
        if err is None and ids is None:
            os.replace(slot.path, store.shard_path(step, s))
        elif err is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(slot.path)
        results.append((s, src, dst, err, nbytes, secs, ids is not None))
    for s, (slot, src, dst, spans, bufs) in sorted(spans_in.items()):
        data, crcs = bufs[0], bufs[1].view(torch.int64)
        err = None
        pos = 0
        for i, (a, b) in enumerate(spans):
            piece = data[pos:pos + b - a]
            if int(crcs[i]) < 0:
                err = f"node {src!r}'s copy of the shard of rank {s} failed its check"
                break
            if crc32c(memoryview(piece.numpy())) != int(crcs[i]):  # type: ignore[arg-type]
                err = f"bytes {a}..{b} of the shard of rank {s} from node {src!r} arrived damaged"
                break
            slot.view[a:b].copy_(piece)
            pos += b - a
        slot.close()
        if err is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(slot.path)
        results.append((s, src, dst, err, data.numel() + crcs.numel() * 8, secs, True))
    return results


def _fixed_many(bufs: list[torch.Tensor]) -> Callable[[list[int]], list[torch.Tensor]]:
    """A Recv allocator that receives the announced parts into ``bufs`` (sizes must match)."""
    def alloc(sizes: list[int]) -> list[torch.Tensor]:
        if sizes != [b.numel() for b in bufs]:
            raise AegisError(f"expected parts of {[b.numel() for b in bufs]} bytes, announced {sizes}")
        return bufs
    return alloc


DURABLE = "durable"
REBUILD = "rebuild"


def _map_local(path: os.PathLike[str] | str) -> tuple[torch.Tensor | None, mmap.mmap | None]:
    """A private read mapping of a node-store file as uint8 (None when it cannot be read)."""
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size == 0:
                return torch.zeros(0, dtype=torch.uint8), None
            m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    except OSError:
        return None, None
    return torch.frombuffer(m, dtype=torch.uint8), m


def _run_rebuilds(
    store: NodeStore,
    group: Group,
    transport: Transport,
    manifest: Manifest,
    jobs: list[tuple[int, str, str, set[int] | None]],
    worker: Callable[[str, int], int],
    holders: Callable[[int], list[str]],
    parity_holders: Callable[[int], list[str]],
) -> list[tuple[int, str, str, str | None, int, float, bool]]:
    """Rebuild lost shards from their parity groups (collective, like a transfer round).

    For each job (shard ``s`` for node ``dst``, the chunks its DCP plan reads), only what
    covers the byte runs of those chunks plus the shard's index is rebuilt. XOR: each run is
    cut at the group's segment boundaries, and for each piece the receiving rank gets the
    parity of the stripe the piece belongs to and the same bytes of every surviving
    contributor (read locally when its node holds them) and XORs them into a sparse partial
    file. RS: each segment the runs touch is decoded from d surviving pieces of its stripe
    (the other contributors' segments first, then parity pieces). Every rebuilt chunk's
    crc32c and the index are then checked against the manifest before the file may be
    loaded. The parity files used are first checked against their recorded crc32c by the
    ranks that hold them."""
    step = manifest.step
    red = manifest.redundancy
    assert red is not None
    scheme = red.scheme
    me = group.rank
    t0 = time.perf_counter()
    files: dict[tuple[str, int], torch.Tensor | None] = {}
    opened: list[mmap.mmap] = []

    def local(kind: str, r: int) -> torch.Tensor | None:
        if (kind, r) not in files:
            path = store.shard_path(step, r) if kind == "shard" else store.parity_path(step, r, scheme)
            files[(kind, r)], m = _map_local(path)
            if m is not None:
                opened.append(m)
        return files[(kind, r)]

    def source(kind: str, r: int, dst: str) -> str:
        nodes = holders(r) if kind == "shard" else parity_holders(r)
        return dst if dst in nodes else nodes[0]

    def lost(g: Any) -> set[int]:  # member indices whose shard no node holds
        return {i for i, m in enumerate(g.members) if not holders(m)}

    def no_parity(g: Any) -> set[int]:  # member indices whose parity file no node holds
        return {i for i, m in enumerate(g.members) if not parity_holders(m)}

    # 1. every parity file held for the groups involved, checked where it is held
    checks = sorted({(r, source("parity", r, dst), g.stored, g.parity_crc32c[i])
                     for s, _, dst, _ in jobs for g in [red.group_of(s)] if g is not None
                     for i, r in enumerate(g.members) if parity_holders(r)})
    mine = []
    for r, n, size, crc in checks:
        if worker(n, r) == me:
            try:
                store.verify_parity(step, r, size, crc, scheme)
            except CorruptShardError as e:
                mine.append((r, f"{n}: {e}"))
    bad = dict(x for xs in group.all_gather(mine, "rebuild parity check") for x in xs)
    # 2. what each job reads: (kind, member index, lo, hi) per piece, per rebuilt range; RS
    # reads around missing or corrupt parity while the group's losses stay within k
    plans = []
    for s, _, dst, ids in jobs:
        g = red.group_of(s)
        assert g is not None
        layout = red.layout([manifest.shard(m).size for m in g.members])
        x = g.members.index(s)
        rec = manifest.shard(s)
        wanted = set(range(len(rec.chunks))) if ids is None else ids
        runs = _runs(list(rec.chunks), wanted, size=rec.size)
        corrupt = {i for i, m in enumerate(g.members) if m in bad}
        if scheme == "rs":
            ranges = (_rs_ranges(layout, x, runs, lost(g), no_parity(g) | corrupt)
                      if len(lost(g) | no_parity(g) | corrupt) <= layout.parity else [])
            used = corrupt if not ranges else set()
        else:  # XOR has no other piece: a corrupt parity the runs need ends the rebuild
            ranges = _xor_ranges(layout, x, runs)
            used = corrupt & {i for _, parts in ranges for kind, i, _, _ in parts if kind == "parity"}
            ranges = [] if used else ranges
        why = "; ".join(bad[g.members[i]] for i in sorted(used)) or (
            None if ranges else f"more than {layout.parity} member(s) of group {list(g.members)} lost")
        plans.append((s, dst, wanted, g, layout, ranges, why))
    # 3. the pieces: sends and receives in one global order, so every pair of ranks matches
    sends: list[Send] = []
    recvs: list[Recv] = []
    todo: dict[tuple[int, str], tuple[list[tuple[int, list[torch.Tensor]]], int]] = {}
    for s, dst, _wanted, g, _layout, ranges, unusable in plans:
        if unusable:
            continue
        receiver = worker(dst, s)
        pieces: list[tuple[int, list[torch.Tensor]]] = []
        nbytes = 0
        for pos, parts in ranges:
            bufs: list[torch.Tensor] = []
            for kind, i, lo, hi in parts:
                r = g.members[i]
                if hi == lo:  # an empty segment (a short shard): zeros, from nobody
                    if receiver == me:
                        bufs.append(torch.zeros(0, dtype=torch.uint8))
                    continue
                src = source(kind, r, dst)
                if src == dst:
                    if receiver == me:
                        data = local(kind, r)
                        bufs.append(data[lo:hi] if data is not None and data.numel() >= hi
                                    else torch.zeros(hi - lo, dtype=torch.uint8))
                    continue
                sender = worker(src, r)
                if sender == me:
                    data = local(kind, r)
                    # a missing or short file still sends as many bytes (zeros): the
                    # receiver's crc32c checks reject them instead of waiting out a timeout
                    sends.append(Send(receiver, [data[lo:hi] if data is not None and data.numel() >= hi
                                                 else torch.zeros(hi - lo, dtype=torch.uint8)]))
                if receiver == me:
                    buf = torch.empty(hi - lo, dtype=torch.uint8)
                    recvs.append(Recv(sender, _fixed(buf)))
                    bufs.append(buf)
                    nbytes += hi - lo
            if receiver == me:
                pieces.append((pos, bufs))
        if receiver == me:
            todo[(s, dst)] = (pieces, nbytes)
    try:
        transport.exchange(sends, recvs)
        secs = time.perf_counter() - t0
        return _fold_rebuilds(store, manifest, plans, todo, worker, me, secs)
    finally:
        sends.clear()
        todo.clear()
        files.clear()
        for m in opened:
            with contextlib.suppress(BufferError):
                m.close()


_Part = tuple[str, int, int, int]  # ("shard" | "parity", member index, lo, hi) of a file


def _xor_ranges(layout: StripeLayout, x: int, runs: list[tuple[int, int]]
                ) -> list[tuple[int, list[_Part]]]:
    """XOR: the runs of member ``x``'s shard cut at segment boundaries; each piece at ``pos``
    is the XOR of its stripe's parity bytes and the same bytes of every other contributor."""
    out: list[tuple[int, list[_Part]]] = []
    seg_size = layout.segment_size
    for a, b in runs:
        pos = a
        while pos < b:
            seg = pos // seg_size
            end = min(b, (seg + 1) * seg_size)
            off, length = pos - seg * seg_size, end - pos
            j = layout.stripe_of(x, seg)
            parts: list[_Part] = [("parity", j, off, off + length)]
            for i in layout.contributors(j):
                if i != x:
                    start = layout.segment_for(i, j) * seg_size + off
                    lo, hi = min(start, layout.lengths[i]), min(start + length, layout.lengths[i])
                    if hi > lo:
                        parts.append(("shard", i, lo, hi))
            out.append((pos, parts))
            pos = end
    return out


def _rs_ranges(layout: StripeLayout, x: int, runs: list[tuple[int, int]], lost: set[int],
               no_parity: set[int]) -> list[tuple[int, list[_Part]]]:
    """RS: every segment of member ``x`` the runs touch, each read from d surviving pieces of
    its stripe, listed as data positions 0..d-1 then parity pieces (the decoder's order):
    the contributors that survive (an empty segment needs no bytes) first, then the pieces of
    holders whose parity file some node holds (``_rebuild_blocker`` made sure enough do)."""
    seg_size, d = layout.segment_size, layout.data
    piece = rs_piece_size(layout)
    segs = sorted({p // seg_size for a, b in runs for p in range(a - a % seg_size, b, seg_size)})
    out: list[tuple[int, list[_Part]]] = []
    for seg in segs:
        j = layout.stripe_of(x, seg)
        parts: list[_Part] = []
        for p in range(d):
            i = layout.contributor_at(j, p)
            lo, hi = layout.segment_range(i, j)
            if i != x and (i not in lost or hi == lo):
                parts.append(("shard", i, lo, hi))
        for q, h in enumerate(layout.holders(j)):
            if len(parts) < d and h not in lost and h not in no_parity:
                parts.append(("parity", h, q * piece, (q + 1) * piece))
        out.append((seg * seg_size, parts))
    return out


def _fold_rebuilds(store: NodeStore, manifest: Manifest, plans: list[Any],
                   todo: dict[tuple[int, str], tuple[list[tuple[int, list[torch.Tensor]]], int]],
                   worker: Callable[[str, int], int], me: int, secs: float
                   ) -> list[tuple[int, str, str, str | None, int, float, bool]]:
    """The receiving side of :func:`_run_rebuilds`: XOR the pieces (or RS-decode each
    segment) into a sparse partial file and check every rebuilt chunk and the index against
    the manifest."""
    step = manifest.step
    red = manifest.redundancy
    assert red is not None
    results: list[tuple[int, str, str, str | None, int, float, bool]] = []
    for s, dst, wanted, g, layout, ranges, unusable in plans:
        if unusable:
            if worker(dst, s) == me:
                results.append((s, REBUILD, dst, "parity unusable: " + unusable, 0, 0.0, True))
            continue
        if (s, dst) not in todo:
            continue  # another rank rebuilds this one
        pieces, nbytes = todo[(s, dst)]
        rec = manifest.shard(s)
        path = store.partial_path(step, s)
        err = None
        slot: Slot | None = None
        code = red.scheme.upper()
        try:  # every failure is a result, never raised on this rank alone (peers wait for it)
            store.step_dir(step).mkdir(mode=0o700, parents=True, exist_ok=True)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # a sparse file of zeros: XOR starts from nothing
            slot = Slot(path)
            slot.ensure(rec.size, prefault=False)
            with slot.memory as mem:
                x = g.members.index(s)
                for (pos, bufs), (_, parts) in zip(pieces, ranges, strict=True):
                    views = [memoryview(b.numpy()) for b in bufs]  # type: ignore[arg-type]
                    if red.scheme == "xor":
                        for v in views:
                            xor_into(mem[pos:pos + len(v)], v)  # type: ignore[arg-type]
                        continue
                    j = layout.stripe_of(x, pos // layout.segment_size)
                    have = {(layout.segment_for(i, j) if kind == "shard" else layout.data + (i - j) % layout.members): v
                            for (kind, i, _, _), v in zip(parts, views, strict=True)}
                    want = layout.segment_for(x, j)
                    seg = rs_stripe_decode(layout, j, have, [want])[want]
                    n = min(len(seg), rec.size - pos)
                    mem[pos:pos + n] = seg[:n]
                _check_partial(mem, rec, step, wanted,
                               f"{code} rebuild from parity group {list(g.members)}")
        except CorruptShardError as e:
            err = str(e)
        except Exception as e:  # noqa: BLE001 - e.g. a full tmpfs: the next source is tried
            err = f"{code} rebuild on node {dst!r}: {type(e).__name__}: {e}"
        finally:
            if slot is not None:
                slot.close()
        if err is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        results.append((s, REBUILD, dst, err, nbytes, secs, True))
    return results


def _fetch_durable(store: NodeStore, durable: ObjectStore | None, manifest: Manifest, s: int,
                   dst: str, ids: set[int] | None) -> tuple[int, str, str, str | None, int, float, bool]:
    """Download the chunks of shard ``s`` that node ``dst`` needs into a sparse local file."""
    assert durable is not None
    t0 = time.perf_counter()
    rec = manifest.shard(s)
    wanted = set(range(len(rec.chunks))) if ids is None else ids
    store.step_dir(manifest.step).mkdir(mode=0o700, parents=True, exist_ok=True)
    slot = Slot(store.partial_path(manifest.step, s))
    slot.ensure(rec.size, prefault=False)
    err, nbytes = None, 0
    try:
        with slot.memory as mem:
            nbytes = fetch_chunks(durable, store.job, manifest, s, wanted, mem)
    except Exception as e:  # noqa: BLE001 - an unreachable store too: reported, never raised alone
        err = str(e) if isinstance(e, CorruptShardError) else f"{type(e).__name__}: {e}"
    finally:
        slot.close()
    if err is not None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(slot.path)
    return (s, DURABLE, dst, err, nbytes, time.perf_counter() - t0, True)


def _cleanup(store: NodeStore, is_leader: bool, *, keep_step: int | None, bad: set[int] | None = None) -> None:
    """Leader of each node: drop what can never be restored: steps newer than the one restored
    (uncommitted, incomplete or corrupt), uncommitted leftovers, and corrupt steps."""
    if not is_leader:
        return
    for info in store.steps():
        newer = keep_step is not None and info.step > keep_step
        if (bad and info.step in bad) or not info.committed or newer:
            store.remove_step(info.step)
        else:
            for f in store.step_dir(info.step).glob(".partial-*"):
                f.unlink(missing_ok=True)
