"""The Manager's entries as one nested state dict, and back (:class:`StateEntries`).

The layout DCP saves and loads: ``app.<name>`` for sharded and replicated entries,
``per_rank.rankNNNNN.<name>`` for per-rank ones (keys no other rank has, so DCP keeps every
rank's copy), ``rng.rankNNNNN`` for every rank's RNG states. On restore: the checks before
anything is loaded (the snapshot's entries, kinds and keys), the per-rank templates when the
world size changed (every old rank's state for an entry with a reshard function), and the
load. Entries marked ``aegis_skip_restore`` are saved and never loaded. Costs: O(entries) per
snapshot; on restore into another world O(old world) templates per per-rank entry.
"""

from __future__ import annotations

import functools
import pickle
from collections.abc import Mapping
from typing import Any

import crc32c
import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._traverse import set_element

from aegis._dist import Group
from aegis.errors import (
    ConfigError,
    PerRankStateError,
    StateMismatchError,
)
from aegis.snapshot.manifest import Manifest, TensorEntry, dtype_from_name
from aegis.training.events import EventLog
from aegis.training.recovery import check_keys
from aegis.training.state import (
    ModelOptimizerState,
    PerRank,
    Reshard,
    _hook,
    _Wrapper,
    rng_state,
    set_rng_state,
    state_kind,
)

__all__ = ["StateEntries", "skips_restore", "check_built_in_round"]

_APP = "app"
_RNG = "rng"
_PER_RANK = "per_rank"


def _saved(manifest: Manifest, prefix: str, key: str) -> bool:
    """Whether snapshot ``manifest`` holds ``prefix + key`` (a flattened state-dict key)."""
    return prefix + key in manifest.entries


def skips_restore(obj: Any) -> bool:
    """An entry that is saved but never loaded (``aegis_skip_restore = True`` on the object, as
    the torchtitan backend's ``exclude_from_loading`` sets): left out of the restore's state
    dict, its key check and its load."""
    while obj is not None:
        if getattr(obj, "aegis_skip_restore", False) is True:
            return True
        obj = obj.obj if isinstance(obj, _Wrapper) else None  # per_rank()/replicated()
    return False


def check_built_in_round(state: Mapping[str, Any]) -> None:
    """Under :func:`aegis.run_in_process` a model must be built inside the function it re-runs:
    one sharded on the process group of a failed round would fail at its first collective. Name
    what to move instead."""
    from torch.distributed.distributed_c10d import _world

    for name, obj in state.items():
        if not isinstance(obj, ModelOptimizerState):
            continue
        for pg in _fsdp_groups(obj.model):
            if pg not in _world.pg_map:
                raise ConfigError(
                    f"state[{name!r}]: the model is sharded on a process group of an earlier round, "
                    "which in-process recovery has destroyed. Build the device mesh, the model "
                    "(fully_shard), the optimizer and the Manager inside the function given to "
                    "aegis.run_in_process, so that each round builds them anew"
                )


def _fsdp_groups(model: Any) -> list[Any]:
    """The process groups FSDP2 communicates on for ``model`` (its shard groups)."""
    out = []
    for m in model.modules():
        get_state = getattr(m, "_get_fsdp_state", None)
        if get_state is None:
            continue
        try:
            group = get_state()._fsdp_param_group
            if group is not None:
                out.append(group.mesh_info.shard_process_group)
        except Exception:  # noqa: BLE001 - FSDP internals moved: no check rather than a false alarm
            continue
    return out

class StateEntries:
    """The entries of one Manager (name -> object) as the nested state dict a snapshot holds
    (see the module docstring). ``kinds`` (name -> sharded / per_rank / replicated) is learnt at
    the first state dict and written into each manifest by the engine."""

    def __init__(self, state: dict[str, Any], *, rank: int, world: int, group: Group,
                 events: EventLog, rng: bool, debug: bool) -> None:
        self.state = state
        self.rank = rank
        self.world = world
        self.group = group
        self.events = events
        self.rng = rng
        self.debug = debug
        self.kinds: dict[str, str] = {}

    @staticmethod
    def rng_key(rank: int) -> str:
        return f"rank{rank:05d}"

    def _kind(self, name: str, obj: Any, sd: Any) -> str:
        kind = self.kinds.get(name)
        if kind is None:
            kind = self.kinds[name] = state_kind(obj, sd)
        return kind

    def state_dict(self, manifest: Manifest | None = None) -> dict[str, Any]:
        """The nested state dict that DCP saves or loads into (``manifest``: for a restore).

        Per-rank entries live under ``per_rank.rankNNNNN.<name>`` (RNG under
        ``rng.rankNNNNN``): keys no other rank has, so DCP keeps every rank's copy. Restoring
        into another world size, an entry with a reshard function loads every old rank's state
        (templates built from the manifest); see :func:`aegis.per_rank`.
        """
        if manifest is not None:
            for name, obj in self.state.items():
                if isinstance(obj, ModelOptimizerState):
                    obj.prepare_for_load(functools.partial(_saved, manifest, f"{_APP}.{name}."))
        app: dict[str, Any] = {}
        mine: dict[str, Any] = {}
        for name, obj in self.state.items():
            if manifest is not None and skips_restore(obj):
                continue  # saved, never loaded (torchtitan's exclude_from_loading)
            osd = obj.state_dict()
            if self._kind(name, obj, osd) == "per_rank":
                mine[name] = osd
            else:
                app[name] = osd
        sd: dict[str, Any] = {_APP: app}
        if manifest is None:
            if mine:
                sd[_PER_RANK] = {self.rng_key(self.rank): mine}
            if self.debug:
                self._check_replicated(app)
        elif mine:
            sd[_PER_RANK] = self._per_rank_targets(mine, manifest)
        if self.rng:
            key = self.rng_key(self.rank)
            # On restore, a rank that did not exist when the snapshot was taken keeps its RNG.
            if manifest is None or any(k.startswith(f"{_RNG}.{key}.") for k in manifest.entries):
                sd[_RNG] = {key: rng_state()}
        return sd

    def _resharder(self, name: str) -> Reshard | str:
        obj = self.state[name]
        if isinstance(obj, PerRank):
            return obj.resharder() or str(obj.on_reshard)
        return _hook(obj) or "error"

    def _per_rank_targets(self, mine: dict[str, Any], m: Manifest) -> dict[str, Any]:
        """What this rank loads of the per-rank entries of snapshot ``m``."""
        if m.world_size == self.world:
            return {self.rng_key(self.rank): mine}
        stuck = [n for n in mine if m.state_kinds.get(n) == "per_rank" and self._resharder(n) == "error"]
        if stuck:
            raise PerRankStateError(
                f"per-rank state {stuck} was saved by {m.world_size} rank(s) at step {m.step} and "
                f"this job has {self.world}: each rank's state has no owner in the new world. Give "
                "the object a reshard_state_dicts(states, rank, world_size) method, or wrap it with "
                "aegis.per_rank(obj, on_reshard=fn) to compute each new rank's state from all old "
                "ones, or on_reshard='fresh' to start it over; declare it aegis.replicated(obj) "
                f"if it is the same on every rank; or restart with {m.world_size} rank(s)"
            )
        out: dict[str, Any] = {}
        for name in mine:
            if callable(self._resharder(name)):
                for k in range(m.world_size):
                    out.setdefault(self.rng_key(k), {})[name] = {}
        # Templates from the manifest: DCP names each flattened key by its path (planner_data),
        # and loads into tensors of the saved dtype and shape (byte items need no template).
        root: dict[str, Any] = {_PER_RANK: out}
        for fqn, path in m.planner_data.items():
            if len(path) > 3 and path[0] == _PER_RANK and path[2] in out.get(str(path[1]), {}):
                entry = m.entries[fqn]
                value = (torch.empty(entry.size, dtype=dtype_from_name(entry.dtype))
                         if isinstance(entry, TensorEntry) else None)
                set_element(root, path, value)
        return out

    def _check_replicated(self, app: dict[str, Any]) -> None:
        """debug=True: every replicated entry must be equal on every rank."""
        names = [n for n in app if self.kinds.get(n) == "replicated"]
        if not names:
            return
        digests = []
        for name in names:
            flat, _ = flatten_state_dict(app[name])
            crc = 0
            for key in sorted(flat):
                v = flat[key]
                data = (v.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
                        if isinstance(v, torch.Tensor) else pickle.dumps(v))
                crc = crc32c.crc32c(key.encode() + data, crc)
            digests.append(crc)
        every = self.group.all_gather(digests, "replicated check")
        differ = [n for i, n in enumerate(names) if len({d[i] for d in every}) > 1]
        if differ:
            raise StateMismatchError(
                f"entries {differ} are declared replicated but differ between ranks (debug=True "
                "check); declare them aegis.per_rank(...) or make every rank hold the same state"
            )

    def check_restore(self, sd: dict[str, Any], m: Manifest) -> None:
        """Before anything is loaded: the snapshot has this state's entries, of the same kinds,
        with the same keys (this rank's own per-rank keys when the world size is the same)."""
        theirs = dict(m.state_kinds)
        missing = sorted(set(self.state) - set(theirs))
        unexpected = sorted(set(theirs) - set(self.state))
        changed = [f"{n!r} saved {theirs[n]}, declared {self.kinds[n]}" for n in self.state
                   if n in theirs and n in self.kinds and theirs[n] != self.kinds[n]]
        if missing or unexpected or changed:
            parts = ([f"missing from the snapshot: {missing}"] if missing else []) + (
                [f"unexpected (in the snapshot, not in this state): {unexpected}"] if unexpected else []
            ) + ([f"declared differently: {'; '.join(changed)}"] if changed else [])
            raise StateMismatchError(
                f"the state does not match the snapshot of step {m.step}: {'; '.join(parts)}. Build "
                "the same state names, declared the same way (per_rank/replicated), as the run that "
                "saved it, or use another job"
            )
        skipped = {n for n, obj in self.state.items() if skips_restore(obj)}

        def loaded(k: str) -> bool:  # not a key of an entry that is saved but never loaded
            parts = k.split(".", 3)
            return not skipped or not ((parts[0] == _APP and len(parts) > 1 and parts[1] in skipped)
                                       or (parts[0] == _PER_RANK and len(parts) > 2
                                           and parts[2] in skipped))

        check_keys(sd, m, include=lambda k: not k.startswith((f"{_RNG}.", f"{_PER_RANK}."))
                   and loaded(k))
        if m.world_size == self.world:
            own = f"{_PER_RANK}.{self.rng_key(self.rank)}."
            check_keys(sd, m, include=lambda k: k.startswith(own) and loaded(k))

    def apply(self, sd: dict[str, Any], manifest: Manifest) -> None:
        per = sd.get(_PER_RANK, {})
        fresh = []
        for name, obj in self.state.items():
            if skips_restore(obj):
                continue
            if self.kinds.get(name) != "per_rank":
                obj.load_state_dict(sd[_APP][name])
            elif manifest.world_size == self.world:
                obj.load_state_dict(per[self.rng_key(self.rank)][name])
            else:
                fn = self._resharder(name)
                if callable(fn):
                    states = [per[self.rng_key(k)][name] for k in range(manifest.world_size)]
                    obj.load_state_dict(fn(states, self.rank, self.world))
                else:
                    fresh.append(name)
        if fresh:
            self.events.warn(
                f"per-rank state {fresh} not restored: saved by {manifest.world_size} rank(s), "
                f"loaded by {self.world}; on_reshard='fresh', so it starts over"
            )
        rng = sd.get(_RNG, {}).get(self.rng_key(self.rank))
        if rng is not None:
            set_rng_state(rng)
