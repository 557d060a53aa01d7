"""Recovery, step 1-2: every node's inventory of its store, and the choice of the newest step
that is committed somewhere and whose every shard some node holds (or can rebuild); pure once
the inventories are gathered (:mod:`.recovery` orchestrates).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from aegis._dist import Group
from aegis.errors import (
    IncompatibleSnapshotError,
    ManifestError,
)
from aegis.snapshot.manifest import Manifest, Redundancy, ShardRecord
from aegis.snapshot.node_manifest import (
    Layout,
    StepManifest,
    assemble_any,
    merge_parity,
    pool_groups,
)
from aegis.snapshot.node_store import NodeStore


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
                    world, split, red = m.world_size, True, m.parity  # this node's groups
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
            red = pool_groups([inv[step].redundancy for inv in invs.values() if step in inv])
            parity = {p for inv in invs.values() if step in inv for p in inv[step].parity}
            blockers = {s: _rebuild_blocker(red, s, held, parity) for s in missing}
            if any(blockers.values()):
                why = "; ".join(f"rank {s}: {b}" for s, b in blockers.items() if b)
                notes.append(f"step {step}: shards of rank(s) {missing} missing on every node ({why})")
                continue
        return step, notes
    return None, notes


# rebuild_tails(each snapshot rank's node, parity, members' shard records, records found,
# missing ranks) -> (records, notes)
RebuildTails = Callable[[tuple[str, ...], Redundancy, Mapping[int, tuple[int, int]],
                         Mapping[int, ShardRecord], list[int]], tuple[dict[int, ShardRecord], list[str]]]


def _assemble_step(store: NodeStore, group: Group, step: int, is_leader: bool, src: int,
                   rebuild_tails: RebuildTails | None = None,
                   ) -> tuple[tuple[Manifest, tuple[Layout, StepManifest]] | None, list[str]]:
    """The whole manifest of a format-4 step, put together on every rank: the first node that
    committed it sends its layout and step record, every node leader sends the records (from the
    shards' own crc-checked indexes) of the shards of that step it holds and, with parity groups,
    its step record's groups; one all-gather (O(world) records in all: what the whole manifest
    held, moved once per restore instead of written at every step). A rank whose copies
    disagree is settled by the step's digest. A rank no node holds a shard of (a lost parity
    group member) gets its record from its index rebuilt from parity (``rebuild_tails``,
    collective: every rank sees the same gathered records, so all of them call it or none).
    Returns (manifest, (layout, step record)) or None, and notes on the copies passed over."""
    parts: tuple[Layout, StepManifest] | None = None
    records: dict[int, ShardRecord] = {}
    notes: list[str] = []
    own: StepManifest | None = None
    if is_leader:
        info = next((i for i in store.steps() if i.step == step), None)
        for r in info.shard_ranks if info is not None else ():
            try:
                records[r] = store.shard_record(step, r)
            except (OSError, ManifestError) as e:  # this copy's index is damaged: others may do
                notes.append(f"step {step}: index of rank {r}'s shard on node store {store.dir} "
                             f"skipped: {e}")
        if info is not None and info.committed:
            with contextlib.suppress(ManifestError):  # its groups, if it has any (others may)
                m = store.read_node_manifest(step)
                own = m if isinstance(m, StepManifest) and m.parity is not None else None
    if group.rank == src:
        try:
            m = store.read_node_manifest(step)
            assert isinstance(m, StepManifest)
            parts = (store.read_layout(m.layout), m)
        except (ManifestError, AssertionError) as e:
            notes.append(f"step {step}: manifest on node store {store.dir} unreadable: {e}")
    gathered = group.all_gather((parts, records, notes, own), "restore records")
    found = next((p for p, _, _, _ in gathered if p is not None), None)
    why = [n for _, _, ns, _ in gathered for n in ns]
    if found is None:
        return None, why or [f"step {step}: no readable format-4 manifest"]
    candidates: dict[int, list[ShardRecord]] = {}
    for _, recs, _, _ in gathered:
        for r, rec in recs.items():
            candidates.setdefault(r, []).append(rec)
    layout, stepm = found
    red, members = merge_parity([stepm, *(o for _, _, _, o in gathered if o is not None)])
    missing = [r for r in range(stepm.world_size) if r not in candidates]
    if missing and red is not None and rebuild_tails is not None \
            and all(r in members for r in missing):
        got, more = rebuild_tails(layout.nodes, red, members, {r: c[0] for r, c in candidates.items()},
                                  missing)
        why.extend(more)
        for r, rec in got.items():
            candidates[r] = [rec]
    try:
        manifest = assemble_any(layout, stepm, candidates, where=f"step {step}", redundancy=red)
    except ManifestError as e:
        return None, [*why, f"step {step}: {e}"]
    if red is not None:  # the pooled groups: a node that now holds the step keeps its own
        found = (layout, dataclasses.replace(stepm, parity=red, members=members))
    return (manifest, found), why
