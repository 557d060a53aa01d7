"""aegis as a torchtitan checkpointer: change ``config.checkpoint``, nothing else.

::

    from aegis.integrations.torchtitan import AegisCheckpointManager

    config.checkpoint = AegisCheckpointManager.Config(
        enable=True, job="llama3-8b", every=1, keep=1, replicas=1,
        durable="s3://bucket/ckpt", durable_every=100,
    )

torchtitan's ``Trainer`` builds it with ``config.checkpoint.build(dataloader=..., model_parts=...,
optimizers=..., lr_schedulers=..., states={"train_state": trainer}, sd_adapter=...,
base_folder=...)`` on every rank and then calls, on every rank and in this order, ``load(step=
config.checkpoint.load_step)`` once, ``maybe_wait_for_staging()`` before each optimizer step,
``save(step, last_step=...)`` after each step, and ``close()`` at the end. Every one of them is
collective (an :class:`aegis.Manager` call underneath).

What is saved is what torchtitan's DCP backend (``checkpointer/dcp.py``) saves, entry for entry:
the model parts through ``ModelWrapper`` (one flat dict of canonical FQNs), the
``OptimizersContainer`` (flat FQN-keyed state), the ``LRSchedulersContainer``, the dataloader
and every extra entry of ``states`` (``train_state``). Each is one entry of the aegis snapshot;
the LR schedulers and ``train_state`` are declared replicated (the same on every rank), the
dataloader is per rank (its state names its dp rank, as in torchtitan). The RNG states of every
rank are added by aegis, so a resumed run is bitwise the uninterrupted one.

Leaving aegis: ``aegis export STORE OUT --format dcp`` writes a plain DCP checkpoint with aegis'
key layout (``app.model.<fqn>``, ...); :func:`to_torchtitan_dcp` (or ``python -m
aegis.integrations.torchtitan OUT``) renames its keys to torchtitan's (``<fqn>``,
``optimizer.<key>``, ``dataloader.dp_rank_N``, ...) by rewriting ``.metadata`` only. Put OUT at
``<dump_folder>/<checkpoint.folder>/step-N`` and torchtitan's own ``CheckpointManager`` resumes
from it. Entering aegis: ``initial_load_path`` (a torchtitan DCP step directory, or a checkpoint
folder of ``step-N`` directories) seeds a job that has no snapshot yet.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import re
import sys
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata
from torchtitan.components.checkpointer.base import (
    DATALOADER,
    LR_SCHEDULER,
    MODEL,
    OPTIMIZER,
    TRAIN_STATE,
    BaseCheckpointManager,
    ModelWrapper,
)
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.tools.logging import logger

from aegis import Manager, replicated

__all__ = ["AegisCheckpointManager", "find_dcp_checkpoint", "to_torchtitan_dcp", "torchtitan_key"]

# Entries that are the same on every rank (saved once, loadable into any world size).
_REPLICATED = (LR_SCHEDULER, TRAIN_STATE)
_STEP_DIR = re.compile(r"step-(\d+)")


def _bad(field: str, value: Any, fix: str) -> ValueError:
    return ValueError(f"checkpoint.{field}={value!r}: {fix}")


class _NoLoad:
    """An entry of ``exclude_from_loading``: saved as usual, left as it is on restore (the
    Manager neither loads nor key-checks it: another data-parallel layout names the
    dataloader's per-dp-rank state differently, and torchtitan resumes without it)."""

    aegis_skip_restore = True

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def state_dict(self) -> dict[str, Any]:
        return self.obj.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass


class AegisCheckpointManager(BaseCheckpointManager):
    """torchtitan's checkpointer contract on top of an :class:`aegis.Manager`.

    Snapshots go into host memory (the node store, ``store_dir``) every ``every`` steps, with
    ``replicas`` copies on other nodes and, with ``durable``, uploads to object storage every
    ``durable_every`` steps; ``load()`` resumes from the newest committed snapshot wherever it
    is (this node, a peer, the durable tier). Construction is collective.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):
        """torchtitan's checkpoint policies plus aegis' own (see :class:`aegis.ManagerConfig`).

        Inherited fields keep their torchtitan meaning: ``interval`` (the same as ``every``:
        setting ``every`` sets it, since the trainer sizes its dataloader snapshots by it),
        ``load_step``, ``keep_latest_k`` (the durable retention unless ``durable_keep_last``
        is set; 0 keeps every durable step), ``exclude_from_loading``, ``load_only``,
        ``enable_first_step_checkpoint``, ``last_save_model_only`` / ``export_dtype`` (at the
        last step, besides the snapshot, a model-only DCP checkpoint in
        ``<dump_folder>/<folder>/step-N``, as torchtitan writes it), ``initial_load_path`` /
        ``initial_load_model_only`` (seed a job that has no snapshot from a DCP checkpoint).
        ``folder`` is only where that last model-only checkpoint goes.
        """

        enable: bool = True
        """Whether to enable checkpointing (on by default: choosing aegis means wanting it)."""

        job: str = ""
        """The job name: snapshots live under ``<store_dir>/<job>/``; a restart with the same
        name resumes. Required."""

        every: int | None = None
        """Snapshot every N steps (default: ``interval``)."""

        keep: int = 1
        """Committed snapshots kept in memory per node (plus one in flight)."""

        replicas: int = 1
        """Copies of each shard on other nodes; 1 survives the loss of any one node."""

        store_dir: str | None = None
        """Node store root, a tmpfs (default ``$AEGIS_STORE_DIR`` or ``/dev/shm/aegis``)."""

        timeout_s: float = 300.0
        """Bound in seconds on every snapshot collective; a peer silent longer is gone."""

        events_dir: str | None = None
        """Per-rank JSON-lines events (default ``<store_dir>/<job>/events``)."""

        durable: str | None = None
        """Durable tier URL (``s3://bucket/prefix`` or ``file:///path``); None: memory only."""

        durable_every: int = 100
        """Upload the committed snapshot every N steps."""

        durable_keep_last: int | None = None
        """Durable retention: the last N steps (default: ``keep_latest_k``; 0 there: all)."""

        durable_keep_every: int = 0
        """Durable retention: also every K-th step (0: none)."""

        def __post_init__(self) -> None:
            BaseCheckpointManager.Config.__post_init__(self)
            if not isinstance(self.job, str) or not self.job.strip():
                raise _bad("job", self.job, "name the job (e.g. job='llama3-8b'); a restart with "
                           "the same name resumes from its snapshots")
            if self.every is None:
                self.every = self.interval  # type: ignore[has-type]  # torchtitan's slots
            elif isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
                raise _bad("every", self.every, "an integer >= 1 (snapshot every N steps)")
            else:
                self.interval = self.every  # type: ignore[misc]  # inherited slot: mypy misreads it
            for name in ("keep", "durable_every"):
                v = getattr(self, name)
                if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                    raise _bad(name, v, "an integer >= 1")
            for name in ("replicas", "durable_keep_every"):
                v = getattr(self, name)
                if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                    raise _bad(name, v, "an integer >= 0")
            if self.durable_keep_last is not None and (
                isinstance(self.durable_keep_last, bool) or not isinstance(self.durable_keep_last, int)
                or self.durable_keep_last < 1
            ):
                raise _bad("durable_keep_last", self.durable_keep_last,
                           "an integer >= 1, or None for keep_latest_k")
            if not self.timeout_s > 0:
                raise _bad("timeout_s", self.timeout_s, "seconds > 0")
            if self.durable is not None and not re.match(r"^(s3|file)://.", str(self.durable)):
                raise _bad("durable", self.durable, "an s3://bucket/prefix or file:///path URL, "
                           "or None for memory only")
            if self.create_seed_checkpoint:
                raise _bad("create_seed_checkpoint", True, "not supported by the aegis backend; "
                           "create the seed with torchtitan's CheckpointManager and pass it as "
                           "initial_load_path")
            if self.last_save_in_hf:
                raise _bad("last_save_in_hf", True, "not supported by the aegis backend; export "
                           "with `aegis export STORE OUT --format safetensors`, or set it False")
            if self.initial_load_in_hf:
                raise _bad("initial_load_in_hf", True, "not supported by the aegis backend; seed "
                           "from a DCP checkpoint (initial_load_path) or set it False")

        def manager_kwargs(self) -> dict[str, Any]:
            """The :class:`aegis.Manager` keyword arguments of this config (``every=1``: the
            backend decides which steps to snapshot, as torchtitan's ``_should_save``)."""
            keep_last = self.durable_keep_last
            if keep_last is None:
                keep_last = self.keep_latest_k if self.keep_latest_k > 0 else 2**31 - 1
            kw: dict[str, Any] = dict(
                every=1, keep=self.keep, replicas=self.replicas, store_dir=self.store_dir,
                timeout=timedelta(seconds=self.timeout_s), events_dir=self.events_dir,
            )
            if self.durable:
                kw.update(durable=self.durable, durable_every=self.durable_every,
                          durable_keep_last=keep_last, durable_keep_every=self.durable_keep_every)
            return kw

    def __init__(
        self,
        config: Config,
        *,
        dataloader: Any,
        model_parts: list[torch.nn.Module],
        optimizers: Any,
        lr_schedulers: Any,
        states: dict[str, Any],
        sd_adapter: Any = None,
        base_folder: str = "",
    ) -> None:
        self.enable = config.enable
        self.save_future: Future[None] | None = None
        if not self.enable:
            return
        self.config = config
        self.folder = os.path.join(base_folder, config.folder)
        self.every = int(config.every or config.interval)
        self.states: dict[str, Any] = dict(states)
        self.states.update({MODEL: ModelWrapper(model_parts), OPTIMIZER: optimizers,
                            LR_SCHEDULER: lr_schedulers})
        if dataloader is not None:
            self.states[DATALOADER] = dataloader
        unknown = [k for k in config.exclude_from_loading if k not in self.states]
        if unknown:
            raise _bad("exclude_from_loading", config.exclude_from_loading,
                       f"{unknown} not among the saved states {sorted(self.states)}")
        bad = [k for k in self.states if not k or "." in k]
        if bad:
            raise ValueError(f"states {bad}: aegis entry names are non-empty and have no '.'; "
                             "rename them in the trainer's states dict")
        entries: dict[str, Any] = {}
        for name, obj in self.states.items():
            if name in config.exclude_from_loading:
                obj = _NoLoad(obj)
            entries[name] = replicated(obj) if name in _REPLICATED or name in states else obj
        self.manager = Manager(config.job, entries, **config.manager_kwargs())
        self._last_saved = -1

    # -- torchtitan's hooks ----------------------------------------------------------------------

    @torch.no_grad()
    def _load(self, step: int = -1) -> bool:
        """Resume from the newest committed snapshot of the job (``step=-1``), or from exactly
        ``step`` (a rollback: newer snapshots leave the node stores; NoSnapshotError when that
        step is not committed and intact). With no snapshot at all: seed from
        ``initial_load_path`` if set."""
        restored = self.manager.restore(step=None if step == -1 else step)
        if restored:
            self._last_saved = restored
            return True
        if self.config.initial_load_path:
            self._seed(self.config.initial_load_path)
            return True
        logger.info("aegis: no snapshot of job %r and no initial_load_path: fresh start",
                    self.config.job)
        return False

    def _seed(self, path: str) -> None:
        """Load a torchtitan DCP checkpoint the way torchtitan's ``dcp_load`` does."""
        ckpt = find_dcp_checkpoint(path)
        if ckpt is None:
            raise _bad("initial_load_path", path, "no DCP checkpoint there (a directory with "
                       ".metadata, or a folder of step-N directories with one)")
        model = self.states[MODEL]
        if self.config.initial_load_model_only:
            states = model.state_dict()
        else:
            states = {k: v for k, v in self.states.items()
                      if k != MODEL and k not in self.config.exclude_from_loading}
            states.update(model.state_dict())
        logger.info("aegis: seeding job %r from %s (%s)", self.config.job, ckpt,
                    "model only" if self.config.initial_load_model_only else "full state")
        dcp.load(states, checkpoint_id=str(ckpt))
        model.load_state_dict(states)

    def _should_save(self, step: int, last_step: bool) -> bool:
        if self.config.load_only or step <= self._last_saved:
            return False
        return (last_step or step % self.every == 0
                or (step == 1 and self.config.enable_first_step_checkpoint))

    @torch.no_grad()
    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        """Snapshot the state as ``curr_step`` when due (every ``every`` steps, the first step
        with ``enable_first_step_checkpoint``, the last step). Returns once this rank's shard
        is copied into host memory; checksums, replicas and the commit run in the background.
        At the last step it waits for the commit (and writes the model-only checkpoint when
        ``last_save_model_only``)."""
        if not self._should_save(curr_step, last_step):
            return False
        self.manager.save(curr_step)
        self._last_saved = curr_step
        self.save_future = Future()  # done when maybe_wait_for_saving() saw the commit
        if last_step:
            self._wait_for_saving()
            if self.config.last_save_model_only:
                self._save_model_only(curr_step)
        return True

    def _save_model_only(self, step: int) -> None:
        dtype = TORCH_DTYPE_MAP[self.config.export_dtype]
        states = {
            k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dtype != dtype
            else v
            for k, v in self.states[MODEL].state_dict().items()
        }
        out = os.path.join(self.folder, f"step-{step}")
        logger.info("aegis: last step %d: model-only checkpoint in %s (%s)", step, out, dtype)
        dcp.save(states, checkpoint_id=out)

    def _maybe_wait_for_staging(self) -> None:
        """Nothing to wait for: ``save`` returns only after the shard is copied to host memory,
        so the optimizer step that follows cannot change a snapshot."""

    def _wait_for_saving(self) -> None:
        """Wait until the last snapshot is committed on every rank; raise its error if it failed.
        Collective."""
        fut, self.save_future = self.save_future, None
        try:
            self.manager.wait()
        except BaseException as e:
            if fut is not None:
                fut.set_exception(e)
            raise
        if fut is not None:
            fut.set_result(None)

    def _close(self) -> None:
        """Finish the in-flight snapshot (and, bounded by ``timeout_s``, the durable uploads)
        and release aegis' process groups. Collective."""
        self.save_future = None
        self.manager.close()


# -- DCP interchange -------------------------------------------------------------------------------


def find_dcp_checkpoint(path: str | os.PathLike[str]) -> Path | None:
    """``path`` if it is a DCP checkpoint (has ``.metadata``), else its newest ``step-N``
    subdirectory that is one (torchtitan's ``_find_load_step`` rule), else None."""
    p = Path(path)
    if (p / ".metadata").is_file():
        return p
    if not p.is_dir():
        return None
    steps = [(int(m.group(1)), d) for d in p.iterdir()
             if (m := _STEP_DIR.fullmatch(d.name)) and (d / ".metadata").is_file()]
    return max(steps)[1] if steps else None


def torchtitan_key(fqn: str) -> str | None:
    """torchtitan's DCP key of an aegis snapshot key, or None for aegis' own entries (RNG).

    ``app.model.<fqn>`` -> ``<fqn>`` (torchtitan flattens the model to the top level);
    ``app.<entry>.<key>`` and ``per_rank.rankNNNNN.<entry>.<key>`` -> ``<entry>.<key>``.
    """
    if fqn.startswith(f"app.{MODEL}."):
        return fqn[len(MODEL) + 5:]
    m = re.fullmatch(r"(?:app|per_rank\.rank\d+)\.(.+)", fqn)
    return m.group(1) if m else None


def _titan_path(old: tuple[Any, ...]) -> tuple[Any, ...]:
    path = old[1:] if old[:1] == ("app",) else old[2:]
    return path[1:] if path[:1] == (MODEL,) else path


def to_torchtitan_dcp(path: str | os.PathLike[str]) -> int:
    """Rename the keys of a DCP checkpoint exported from an aegis snapshot of this backend
    (``aegis export STORE OUT --format dcp``) to torchtitan's, in place: only ``.metadata`` is
    rewritten (atomically); the data files stay as they are. aegis' RNG entries are left out.
    Returns the number of keys. Idempotent."""
    from aegis.read.dcp_meta import read_dcp_metadata

    d = Path(path)
    md = read_dcp_metadata(d)
    rename: dict[str, str] = {}
    state: dict[str, Any] = {}
    for fqn, meta in md.state_dict_metadata.items():
        new = torchtitan_key(fqn)
        if new is None and not fqn.startswith(("app.", "per_rank.", "rng.")):
            new = fqn  # already torchtitan's
        if new is None or new in state:  # the same entry saved by several ranks: one copy
            continue
        rename[fqn] = new
        state[new] = meta
    storage = md.storage_data
    assert isinstance(storage, dict)
    new_storage = {dataclasses.replace(i, fqn=rename[i.fqn]): info for i, info in storage.items()
                   if i.fqn in rename}
    planner = md.planner_data if isinstance(md.planner_data, dict) else {}
    new_planner = {rename[k]: (_titan_path(tuple(v)) if rename[k] != k else v)
                   for k, v in planner.items() if k in rename}
    out = Metadata(state_dict_metadata=state, planner_data=new_planner, storage_data=new_storage,
                   storage_meta=md.storage_meta)
    tmp = d / ".metadata.tmp"
    with open(tmp, "wb") as f:
        pickle.dump(out, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, d / ".metadata")
    return len(state)


def main(argv: list[str] | None = None) -> int:
    """``python -m aegis.integrations.torchtitan DIR``: :func:`to_torchtitan_dcp` on DIR."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0] in ("-h", "--help"):
        print("usage: python -m aegis.integrations.torchtitan DIR\n  rename the keys of a DCP "
              "checkpoint written by `aegis export ... --format dcp` to torchtitan's (in place)")
        return 0 if args[:1] in (["-h"], ["--help"]) else 2
    n = to_torchtitan_dcp(args[0])
    print(f"{args[0]}: {n} keys in torchtitan's layout")
    return 0


if __name__ == "__main__":
    sys.exit(main())
