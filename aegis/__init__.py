"""aegis: checkpointing-first resiliency for PyTorch distributed training.

Import surface for training scripts::

    from aegis import Manager, ModelOptimizerState

and for reading snapshots outside a job (a notebook, an evaluation job)::

    snap = aegis.open("s3://bucket/ckpt", job="llama").latest()
    snap.load_into(model)
"""

from typing import TYPE_CHECKING, Any

from aegis.errors import (
    AegisError,
    CollectiveError,
    ConfigError,
    CorruptShardError,
    IncompatibleSnapshotError,
    ManifestError,
    NoSnapshotError,
    PerRankStateError,
    SnapshotTimeoutError,
    StateMismatchError,
    StepOrderError,
    StoreFullError,
)

if TYPE_CHECKING:
    from aegis.read.api import Snapshot, SnapshotEntry, Source
    from aegis.read.api import open as open  # noqa: A004 - aegis.open, kept out of __all__
    from aegis.read.errors import ReadError, SourceError
    from aegis.training.config import ManagerConfig
    from aegis.training.inprocess import PeerLost, RecoveryGaveUp, Regroup, World, run_in_process
    from aegis.training.manager import Manager
    from aegis.training.state import ModelOptimizerState, per_rank, replicated

# Imported on first use: the training API imports torch (seconds), which the ``aegis`` command
# needs only for the commands that read snapshots (``aegis plan --help`` starts without it).
_LAZY = {
    "ManagerConfig": "aegis.training.config",
    "RecoveryGaveUp": "aegis.training.inprocess",
    "Regroup": "aegis.training.inprocess",
    "PeerLost": "aegis.training.inprocess",
    "World": "aegis.training.inprocess",
    "run_in_process": "aegis.training.inprocess",
    "Manager": "aegis.training.manager",
    "ModelOptimizerState": "aegis.training.state",
    "per_rank": "aegis.training.state",
    "replicated": "aegis.training.state",
    "open": "aegis.read.api",
    "Source": "aegis.read.api",
    "Snapshot": "aegis.read.api",
    "SnapshotEntry": "aegis.read.api",
    "SourceError": "aegis.read.errors",
    "ReadError": "aegis.read.errors",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'aegis' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__version__ = "0.1.0"

__all__ = [
    "Manager",
    "ManagerConfig",
    "World",
    "run_in_process",
    "RecoveryGaveUp",
    "Regroup",
    "PeerLost",
    "ModelOptimizerState",
    "per_rank",
    "replicated",
    # "open" too is aegis.open, but stays out of __all__: `from aegis import *` must not
    # shadow the builtin open()
    "Source",
    "Snapshot",
    "SnapshotEntry",
    "AegisError",
    "CollectiveError",
    "ConfigError",
    "CorruptShardError",
    "IncompatibleSnapshotError",
    "ManifestError",
    "NoSnapshotError",
    "PerRankStateError",
    "SnapshotTimeoutError",
    "StateMismatchError",
    "StepOrderError",
    "StoreFullError",
    "SourceError",
    "ReadError",
]
