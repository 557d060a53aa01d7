"""Recovery: inventory -> choose one step -> verify -> DCP load.

Collective: every rank calls :func:`restore_newest` once, before the training loop. The step is
chosen once, on rank 0, and broadcast, so every rank loads the same step. A step is chosen only
if it is committed (its manifest exists) and every shard is present; every shard is verified
(crc32c of every chunk) before any byte is loaded; a step that fails verification is skipped for
the next older committed one, and the error names what was tried.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.api import CheckpointException

from aegis import errors
from aegis._dist import Group
from aegis.errors import AegisError, CorruptShardError, StateMismatchError
from aegis.snapshot.dcp_io import SafeLoadPlanner, ShardReader
from aegis.snapshot.manifest import Manifest
from aegis.snapshot.node_store import NodeStore

__all__ = ["RestoreResult", "restore_newest", "check_keys"]


@dataclass
class RestoreResult:
    step: int
    manifest: Manifest
    sources: list[dict[str, Any]] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    bytes_read: int = 0
    skipped: list[str] = field(default_factory=list)


def check_keys(state_dict: dict[str, Any], manifest: Manifest, *, ignore_prefix: str) -> None:
    """Raise StateMismatchError naming missing and unexpected keys."""
    flat, _ = flatten_state_dict(state_dict)
    mine = set(flat)
    theirs = {k for k in manifest.entries if not k.startswith(ignore_prefix)}
    mine_cmp = {k for k in mine if not k.startswith(ignore_prefix)}
    missing = sorted(mine_cmp - theirs)
    unexpected = sorted(theirs - mine_cmp)
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


def _decide(store: NodeStore, skip: set[int]) -> tuple[Manifest | None, list[str]]:
    """Rank 0: the newest committed step of this store whose shards are all present."""
    notes = []
    for info in store.steps():
        if not info.committed or info.step in skip:
            continue
        manifest = store.read_manifest(info.step)  # ManifestError is fatal: never guess past it
        missing = [r for r in range(manifest.world_size) if r not in info.shard_ranks]
        if missing:
            notes.append(f"step {info.step}: shards of rank(s) {missing} missing")
            continue
        return manifest, notes
    return None, notes


def restore_newest(
    store: NodeStore,
    group: Group,
    *,
    make_state: Callable[[Manifest], dict[str, Any]],
    apply_state: Callable[[dict[str, Any], Manifest], None],
    is_leader: bool,
    rank_prefix: str,
) -> RestoreResult | None:
    """Restore the newest complete, verified committed step; None when there is none at all."""
    t0 = time.perf_counter()
    skipped: list[str] = []
    bad: set[int] = set()
    timings: dict[str, float] = {}
    while True:
        td = time.perf_counter()
        decision: tuple[str, Any] | None = None
        if group.rank == 0:
            try:
                manifest, notes = _decide(store, bad)
                decision = ("ok", (manifest, notes))
            except AegisError as e:
                decision = ("error", (type(e).__name__, str(e)))
        kind, payload = group.broadcast(decision, "restore decision")
        if kind == "error":
            cls = getattr(errors, payload[0], AegisError)
            raise cls(payload[1])
        manifest, notes = payload
        skipped.extend(n for n in notes if n not in skipped)
        timings["decide_s"] = timings.get("decide_s", 0.0) + time.perf_counter() - td
        if manifest is None:
            if skipped:
                raise CorruptShardError(
                    "committed snapshots exist but none is complete and intact; tried: "
                    + "; ".join(skipped)
                    + ". Nothing was loaded. Restore from the durable tier, or remove the store "
                    f"directory {store.dir} to start from scratch",
                    step=-1, rank=-1,
                )
            _cleanup(store, is_leader, keep_step=None)
            return None
        # Verify every shard before trusting a byte: shard s is checked by rank s % world.
        tv = time.perf_counter()
        local_errors = []
        for rec in manifest.shards:
            if rec.rank % group.world == group.rank:
                try:
                    store.verify_shard(manifest.step, rec)
                except CorruptShardError as e:
                    local_errors.append(str(e))
        all_errors = [e for errs in group.all_gather(local_errors, "verify") for e in errs]
        timings["verify_s"] = timings.get("verify_s", 0.0) + time.perf_counter() - tv
        if all_errors:
            skipped.extend(all_errors)
            bad.add(manifest.step)
            continue
        break

    tl = time.perf_counter()
    state_dict = make_state(manifest)
    group.run_all("restore key check", lambda: check_keys(state_dict, manifest, ignore_prefix=rank_prefix))
    paths = {r.rank: store.shard_path(manifest.step, r.rank) for r in manifest.shards}
    reader = ShardReader(manifest, paths)
    try:
        dcp.load(state_dict, storage_reader=reader, planner=SafeLoadPlanner(), process_group=group.pg)
    except CheckpointException as e:  # a BaseException: turn it into an ordinary error
        raise AegisError(f"loading step {manifest.step} failed: {e}") from None
    timings["load_s"] = time.perf_counter() - tl
    ta = time.perf_counter()
    apply_state(state_dict, manifest)
    timings["apply_s"] = time.perf_counter() - ta
    group.barrier("restore done")
    _cleanup(store, is_leader, keep_step=manifest.step, bad=bad)
    timings["total_s"] = time.perf_counter() - t0
    sources = [
        {"shard": r, "tier": "local", "node": manifest.shard(r).node, "bytes_read": n,
         "seconds": round(reader.seconds_by_rank.get(r, 0.0), 6)}
        for r, n in sorted(reader.bytes_by_rank.items())
    ]
    return RestoreResult(manifest.step, manifest, sources, timings, reader.bytes_read, skipped)


def _cleanup(store: NodeStore, is_leader: bool, *, keep_step: int | None, bad: set[int] | None = None) -> None:
    """Leader of each node: drop what can never be restored: steps newer than the one restored
    (uncommitted, or failed verification), uncommitted leftovers, and corrupt steps."""
    if not is_leader:
        return
    for info in store.steps():
        newer = keep_step is None or info.step > keep_step
        if (bad and info.step in bad) or not info.committed or (newer and keep_step is not None):
            store.remove_step(info.step)
