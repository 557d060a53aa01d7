"""State adapters: what a snapshot holds and how it goes back into live objects.

The Manager's state is a mapping name -> object. An object is either a
:class:`ModelOptimizerState` (an FSDP2 model and its optimizers, through DCP's
``get_state_dict``/``set_state_dict``) or anything with ``state_dict()`` and
``load_state_dict()`` (LR scheduler, data sampler, user extras). RNG states of every rank are
added by the Manager itself (see :func:`rng_state`).

Each entry has a *kind* (recorded in the manifest):

* ``sharded``: a :class:`ModelOptimizerState`, or an object whose state dict holds DTensors.
  DCP saves global tensors chunked by rank and reshards them on load.
* ``per_rank`` (the default for everything else): every rank's own ``state_dict()`` is stored
  under its rank and given back to the same rank. A data sampler, a dataloader, a per-rank
  counter: their states differ by rank, and DCP alone would keep one rank's copy for all
  (it de-duplicates same-key items). When the world size changes there is no obvious owner for
  each state; see :func:`per_rank` for what happens then.
* ``replicated``: declared with :func:`replicated`, and torch's LR schedulers by default (every
  rank steps them alike): the same on every rank, saved once, loaded by every rank (checked
  equal across ranks at each snapshot with ``Manager(debug=True)``). ``per_rank(scheduler)``
  overrides the default.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

from aegis.errors import ConfigError

__all__ = [
    "ModelOptimizerState",
    "PerRank",
    "Replicated",
    "per_rank",
    "replicated",
    "state_kind",
    "rng_state",
    "set_rng_state",
    "check_state",
]

Reshard = Callable[[Sequence[Mapping[str, Any]], int, int], Mapping[str, Any]]


def _state_names(model: nn.Module) -> dict[torch.Tensor, str]:
    """Each parameter's name in DCP's state dicts: as DCP names it (wrappers' prefixes such as
    activation checkpointing's or ``torch.compile``'s left out), or left out where that is not
    one name."""
    from torch.distributed.checkpoint.state_dict import _get_fqns

    out: dict[torch.Tensor, str] = {}
    for name, p in model.named_parameters():
        fqns = _get_fqns(model, name)
        if len(fqns) == 1:
            out[p] = next(iter(fqns))
    return out


@contextlib.contextmanager
def unfilled() -> Iterator[None]:
    """Empty tensors made meanwhile are left unfilled, also under
    ``torch.use_deterministic_algorithms(True)``, which fills every new empty tensor (NaN) by
    default: for tensors every byte of which is about to be written (a restore's destinations).
    A 1 GB-per-rank in-process restore spent 1.1-2.2 s filling (and faulting in) the AdamW
    moments it then overwrote (py-spy ``--native``: ``fill_empty_deterministic_`` under
    ``empty_like``). The setting is the process's; it is put back on leaving."""
    det = torch.utils.deterministic
    before = det.fill_uninitialized_memory  # type: ignore[attr-defined]
    det.fill_uninitialized_memory = False  # type: ignore[attr-defined]
    try:
        yield
    finally:
        det.fill_uninitialized_memory = before  # type: ignore[attr-defined]


def _scalar_dtype() -> torch.dtype:
    from torch.optim.optimizer import _get_scalar_dtype

    return _get_scalar_dtype()


class ModelOptimizerState:
    """An (FSDP2) model and its optimizer(s), saved sharded through DCP's state-dict API.

    ``state_dict()`` returns views of live tensors; the snapshot engine copies them before
    ``save()`` returns, so the next optimizer step cannot change a snapshot.

    Args:
        model: the model (FSDP2 ``fully_shard``-ed, or plain).
        optimizers: its optimizer, several (one state), or None for the model alone.
        options: DCP ``StateDictOptions`` for ``get_state_dict``/``set_state_dict`` (the default
            gives sharded state, no CPU offload).

    Raises:
        ConfigError: ``model`` is not an ``nn.Module``.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer] | None = None,
        *,
        options: StateDictOptions | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise ConfigError(f"ModelOptimizerState: model must be an nn.Module, got {type(model).__name__}")
        if optimizers is None:
            self.optimizers: tuple[torch.optim.Optimizer, ...] = ()
        elif isinstance(optimizers, torch.optim.Optimizer):
            self.optimizers = (optimizers,)
        else:
            self.optimizers = tuple(optimizers)
        self.model = model
        self.options = options
        # the last state dict and what it was built from (see state_dict)
        self._cache: tuple[list[Any], list[int], list[Any], dict[str, Any]] | None = None

    def prepare_for_load(self, saved: Callable[[str], bool] | None = None) -> None:
        """Give empty Adam/AdamW optimizers their state tensors so that DCP has destinations to
        load into. DCP's own fallback runs a whole optimizer step over the DTensor parameters,
        which was measured at 0.5 s (0.1M params) to 2.9 s (42M) per restore; other optimizers
        keep that fallback.

        ``saved(key)`` says whether the snapshot holds ``key`` (this object's state-dict key,
        such as ``optim.state.<fqn>.exp_avg``). A tensor the load will overwrite is made empty
        (not filled under deterministic algorithms either: :func:`unfilled`), not zeroed: one
        pass over the memory fewer (~0.1 s per GB here; the first-touch page faults, most of the
        0.88 s that zeroing 1.4 GB of AdamW moments took in a 2 GB restore, are then taken by
        the load). A parameter the snapshot holds no state for (it never had a gradient before
        it was taken) gets none, as in the run that saved it: giving it zeros made the state's
        keys differ from the snapshot's, and such a model could not be restored at all. Anything
        else is zeros, as Adam's first step would make it.

        Args:
            saved: whether the snapshot to be loaded holds a key; None: unknown (zeros for all).
        """
        names: dict[torch.Tensor, str] | None = None  # made once, if any optimizer needs state

        def held(p: torch.Tensor, fields: tuple[str, ...]) -> bool | None:
            """True: the snapshot has all of p's state; False: none of it; None: unknown, part."""
            nonlocal names
            if names is None:
                names = _state_names(self.model) if saved is not None else {}
            name = names.get(p)
            if saved is None or name is None:
                return None
            have = [saved(f"optim.state.{name}.{f}") for f in ("step", *fields)]
            return True if all(have) else False if not any(have) else None

        for optim in self.optimizers:
            if optim.state or type(optim) not in (torch.optim.Adam, torch.optim.AdamW):
                continue
            for group in optim.param_groups:
                if group.get("fused") or group.get("capturable"):
                    return  # their step lives on the device: leave it to DCP's fallback
            scalar = _scalar_dtype()
            for group in optim.param_groups:
                fields = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")[:3 if group.get("amsgrad") else 2]
                for p in group["params"]:
                    filled = held(p, fields)
                    if not p.requires_grad or filled is False:
                        continue
                    st = optim.state[p]
                    st["step"] = torch.tensor(0.0, dtype=scalar)
                    for f in fields:
                        if filled:
                            with unfilled():
                                st[f] = torch.empty_like(p, memory_format=torch.preserve_format)
                        else:
                            st[f] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def _sources(self) -> tuple[list[Any], list[int], list[Any]]:
        """What the state dict is made of: the parameter and buffer objects, the data pointers of
        their (local) tensors, and every optimizer state value, in order."""
        tensors = [*self.model.parameters(), *self.model.buffers()]
        ptrs = [(t._local_tensor if isinstance(t, DTensor) else t).data_ptr() for t in tensors]
        values: list[Any] = []
        for optim in self.optimizers:
            values.append(len(optim.param_groups))
            for group in optim.param_groups:
                for p in group["params"]:
                    values.extend(optim.state[p].values() if p in optim.state else ())
        return tensors, ptrs, values

    def state_dict(self) -> dict[str, Any]:
        """DCP's ``get_state_dict`` of the model and optimizers: views of the live tensors.

        Rebuilding it costs about 40 us per parameter (14 ms for 384 parameters here), at every
        snapshot. So the last one is kept, with the objects it was built from, and given again
        while every parameter, buffer and optimizer state value is the same object over the same
        storage (checked by identity, about 1 us each): the tensors in it are views of those very
        tensors. Only the optimizer's hyperparameters (a scheduler changes ``lr``) are copied in
        again. Anything replaced (a new parameter, ``p.data = ...``, a new state value such as a
        Python int step) rebuilds it. Options that copy (full or CPU-offloaded state dicts)
        always rebuild."""
        opts = self.options
        cacheable = opts is None or not (opts.full_state_dict or opts.cpu_offload)
        if cacheable and self._cache is not None:
            tensors, ptrs, values, sd = self._cache
            now_t, now_p, now_v = self._sources()
            if (len(now_t) == len(tensors) and len(now_v) == len(values) and now_p == ptrs
                    and all(a is b for a, b in zip(now_t, tensors, strict=True))
                    and all(a is b for a, b in zip(now_v, values, strict=True))):
                if self.optimizers:
                    groups = [g for o in self.optimizers for g in o.param_groups]
                    for cached, live in zip(sd["optim"]["param_groups"], groups, strict=True):
                        for k, v in live.items():
                            if k != "params":
                                cached[k] = v
                return sd
        if not self.optimizers:
            from torch.distributed.checkpoint.state_dict import get_model_state_dict

            sd = {"model": get_model_state_dict(self.model, options=opts)}
        else:
            model_sd, optim_sd = get_state_dict(self.model, self.optimizers, options=opts)
            sd = {"model": model_sd, "optim": optim_sd}
        if cacheable:
            groups = [g for o in self.optimizers for g in o.param_groups]
            if not self.optimizers or len(sd["optim"].get("param_groups", [])) == len(groups):
                self._cache = (*self._sources(), sd)
        return sd

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Load ``state`` into the model and optimizers through DCP's ``set_state_dict``.

        A restore loads into the state dict this object gave out: DCP writes into its tensors in
        place, and they are views of the live parameters and buffers. When every model entry of
        ``state`` is still such a view (the very object given out, over storage the live tensor
        still has), the model already holds the values and its ``load_state_dict`` is skipped: it
        would copy each parameter onto itself through DTensor dispatch, whose sharding
        propagation is not yet cached after the world size changed (measured here: 0.1 s for a
        0.1M-parameter model, 2 ranks). The optimizers are always loaded (their hyperparameters
        are plain values).

        Args:
            state: the state dict to load (what :meth:`state_dict` gave, filled by DCP).
        """
        cache, self._cache = self._cache, None
        if cache is not None and self._model_loaded_in_place(cache, state["model"]):
            if self.optimizers:
                from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

                set_optimizer_state_dict(self.model, self.optimizers, dict(state["optim"]),
                                         options=self.options)
            return
        if not self.optimizers:
            from torch.distributed.checkpoint.state_dict import set_model_state_dict

            set_model_state_dict(self.model, dict(state["model"]), options=self.options)
            return
        set_state_dict(
            self.model,
            self.optimizers,
            model_state_dict=dict(state["model"]),
            optim_state_dict=dict(state["optim"]),
            options=self.options,
        )

    def _model_loaded_in_place(self, cache: tuple[list[Any], list[int], list[Any], dict[str, Any]],
                               model_state: Mapping[str, Any]) -> bool:
        """Whether every entry of ``model_state`` is the tensor of the cached state dict, and
        that state dict still views the live parameters and buffers (see ``state_dict``)."""
        tensors, ptrs, _, sd = cache
        given = sd["model"]
        if len(model_state) != len(given) or not all(
                isinstance(v, torch.Tensor) and given.get(k) is v for k, v in model_state.items()):
            return False
        now_t, now_p, _ = self._sources()
        if not (len(now_t) == len(tensors) and now_p == ptrs
                and all(a is b for a, b in zip(now_t, tensors, strict=True))):
            return False
        # and each a view of one of them (not, say, a tensor of get_extra_state's)
        live = {_local(t).untyped_storage().data_ptr() for t in now_t}
        return all(_local(v).untyped_storage().data_ptr() in live for v in model_state.values())


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


class _Wrapper:
    """Delegates ``state_dict``/``load_state_dict`` to the wrapped object."""

    def __init__(self, obj: Any) -> None:
        if isinstance(obj, _Wrapper):
            raise ConfigError(f"{type(obj).__name__} is already declared; declare an entry once")
        if isinstance(obj, ModelOptimizerState):
            raise ConfigError(
                "ModelOptimizerState is sharded through DCP; per_rank()/replicated() are for other state"
            )
        self.obj = obj

    def state_dict(self) -> Any:
        return self.obj.state_dict()

    def load_state_dict(self, state: Any) -> None:
        self.obj.load_state_dict(state)


class Replicated(_Wrapper):
    """An entry whose state is the same on every rank: saved once, loaded by every rank."""


class PerRank(_Wrapper):
    """An entry whose state differs by rank, with what to do when the world size changes
    (what :func:`per_rank` returns).

    Args:
        obj: the object (``state_dict``/``load_state_dict``).
        on_reshard: ``"error"``, ``"fresh"`` or a function (see :func:`per_rank`).
    """

    def __init__(self, obj: Any, on_reshard: str | Reshard = "error") -> None:
        super().__init__(obj)
        if not (callable(on_reshard) or on_reshard in ("error", "fresh")):
            raise ConfigError(
                f"per_rank(on_reshard={on_reshard!r}): use 'error', 'fresh', or a function "
                "(states, rank, world_size) -> state_dict"
            )
        self.on_reshard = on_reshard

    def resharder(self) -> Reshard | None:
        """The function that computes a new rank's state from the old ranks', if any."""
        if callable(self.on_reshard):
            return self.on_reshard
        return _hook(self.obj)


def _hook(obj: Any) -> Reshard | None:
    fn = getattr(obj, "reshard_state_dicts", None)
    return fn if callable(fn) else None


def replicated(obj: Any) -> Replicated:
    """Declare a state entry the same on every rank (an LR scheduler, a global step counter):
    it is saved once instead of once per rank, and every rank loads that copy. With
    ``Manager(debug=True)`` every snapshot checks that the ranks agree.

    Args:
        obj: the object (``state_dict``/``load_state_dict``).
    """
    return Replicated(obj)


def per_rank(obj: Any, *, on_reshard: str | Reshard = "error") -> PerRank:
    """Declare a state entry per rank (the default for objects that are not model state) and say
    what a restore into a different world size does with it:

    * a function ``(states, rank, world_size) -> state_dict``, or a method
      ``obj.reshard_state_dicts(states, rank, world_size)``: called with the state dicts of every
      rank of the snapshot (in rank order); its result is given to ``load_state_dict``. A sampler
      can recompute each new rank's position from the global sample count.
    * ``"error"`` (default, when the object has no such method): the restore raises
      :class:`~aegis.errors.PerRankStateError` naming the entry and both world sizes, before
      anything is loaded.
    * ``"fresh"``: the entry keeps the state it has now (it starts fresh), with a warning.

    Args:
        obj: the object (``state_dict``/``load_state_dict``).
        on_reshard: what a restore into another world size does (above).

    Raises:
        ConfigError: ``on_reshard`` is none of these.
    """
    return PerRank(obj, on_reshard)


def state_kind(obj: Any, state_dict: Mapping[str, Any] | None = None) -> str:
    """``sharded``, ``per_rank`` or ``replicated`` (see the module docstring)."""
    if isinstance(obj, ModelOptimizerState):
        return "sharded"
    if isinstance(obj, Replicated):
        return "replicated"
    if isinstance(obj, PerRank):
        return "per_rank"
    if isinstance(obj, (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)):
        return "replicated"  # stepped identically on every rank of an SPMD job
    if state_dict is not None and _holds_dtensor(state_dict):
        return "sharded"
    return "per_rank"


def _holds_dtensor(value: Any) -> bool:
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return True
    if isinstance(value, Mapping):
        return any(_holds_dtensor(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_dtensor(v) for v in value)
    return False


def check_state(state: Mapping[str, Any]) -> None:
    """Reject a state mapping the Manager cannot snapshot, before any training time is spent."""
    if not isinstance(state, Mapping) or not state:
        raise ConfigError("state must be a non-empty mapping of name -> stateful object")
    for name, obj in state.items():
        if not isinstance(name, str) or not name or "." in name:
            raise ConfigError(f"state key {name!r}: use a non-empty string without '.'")
        if isinstance(obj, nn.Module):
            raise ConfigError(
                f"state[{name!r}] is a bare nn.Module; wrap it with its optimizer: "
                f"ModelOptimizerState(model, optimizer)"
            )
        if isinstance(obj, ModelOptimizerState):
            continue
        if isinstance(obj, _Wrapper):
            obj = obj.obj
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise ConfigError(
                f"state[{name!r}] ({type(obj).__name__}) has no state_dict()/load_state_dict(); "
                "give it both, or leave it out of the snapshot"
            )


# -- RNG ------------------------------------------------------------------------------------------
# Stored as plain tensors (no pickle), one set per rank: RNG streams differ between ranks.


def rng_state() -> dict[str, torch.Tensor]:
    version, mt, gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state(legacy=True)  # type: ignore[misc]
    assert isinstance(np_keys, np.ndarray)
    assert np_name == "MT19937"
    out = {
        "python": torch.tensor([version, *mt, 0 if gauss is None else 1], dtype=torch.int64),
        "python_gauss": torch.tensor([0.0 if gauss is None else gauss], dtype=torch.float64),
        "numpy": torch.tensor([*np_keys.tolist(), np_pos, np_has_gauss], dtype=torch.int64),
        "numpy_gauss": torch.tensor([np_gauss], dtype=torch.float64),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state()
    return out


def set_rng_state(state: Mapping[str, torch.Tensor]) -> None:
    py = state["python"].tolist()
    gauss = float(state["python_gauss"][0]) if py[-1] else None
    random.setstate((py[0], tuple(py[1:-1]), gauss))
    npv = state["numpy"].tolist()
    np.random.set_state(("MT19937", np.array(npv[:-2], dtype=np.uint32), npv[-2], npv[-1],
                         float(state["numpy_gauss"][0])))
    torch.set_rng_state(state["torch"].to(torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"].to(torch.uint8))
