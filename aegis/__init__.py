"""aegis: checkpointing-first resiliency for PyTorch distributed training.

Import surface for training scripts::

    from aegis import Manager, ModelOptimizerState
"""

from aegis.errors import (
    AegisError,
    CollectiveError,
    ConfigError,
    CorruptShardError,
    ManifestError,
    NoSnapshotError,
    SnapshotTimeoutError,
    StateMismatchError,
    StoreFullError,
)
from aegis.training.config import ManagerConfig
from aegis.training.manager import Manager
from aegis.training.state import ModelOptimizerState

__version__ = "0.1.0"

__all__ = [
    "Manager",
    "ManagerConfig",
    "ModelOptimizerState",
    "AegisError",
    "CollectiveError",
    "ConfigError",
    "CorruptShardError",
    "ManifestError",
    "NoSnapshotError",
    "SnapshotTimeoutError",
    "StateMismatchError",
    "StoreFullError",
]
