"""Backends that plug aegis into training frameworks.

Each integration lives in its own module and imports its framework only there, so importing
:mod:`aegis` never imports a framework:

* :mod:`aegis.integrations.torchtitan`: ``AegisCheckpointManager``, a torchtitan checkpointer
  (``pip install aegis[torchtitan]``).
"""

__all__: list[str] = []
