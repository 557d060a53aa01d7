"""The training-loop contract (Manager), state adapters and recovery. Never touches bytes or
sockets directly: that is aegis.snapshot's job."""

from aegis.training.config import ManagerConfig
from aegis.training.manager import Manager
from aegis.training.state import ModelOptimizerState

__all__ = ["Manager", "ManagerConfig", "ModelOptimizerState"]
