"""aegis: checkpointing-first resiliency for PyTorch distributed training.

Import surface for training scripts::

    from aegis import Manager, ModelOptimizerState
"""

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
from aegis.training.config import ManagerConfig
from aegis.training.inprocess import RecoveryGaveUp, World, run_in_process
from aegis.training.manager import Manager
from aegis.training.state import ModelOptimizerState, PerRank, Replicated, per_rank, replicated

__version__ = "0.1.0"

__all__ = [
    "Manager",
    "ManagerConfig",
    "World",
    "run_in_process",
    "RecoveryGaveUp",
    "ModelOptimizerState",
    "PerRank",
    "Replicated",
    "per_rank",
    "replicated",
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
]
