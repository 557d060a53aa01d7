"""The reading layer: snapshots outside a training job, from Python and for the ``aegis`` command.

::

    import aegis

    src = aegis.open("/dev/shm/aegis/llama", "s3://bucket/ckpt")  # one job, memory + durable
    snap = src.latest()
    snap.load_into(model)  # a plain nn.Module: full tensors, bitwise, no process group

Modules: :mod:`~aegis.read.api` (:func:`open`, :class:`Source`, :class:`Snapshot`),
:mod:`~aegis.read.locations` (a URI resolved to node stores, durable roots and DCP directories;
verified chunks per place), :mod:`~aegis.read.tensors` (full tensors through DCP with no process
group, from verified chunks), :mod:`~aegis.read.export` (plain DCP / torch / safetensors files),
:mod:`~aegis.read.dcp_meta` (DCP metadata read through an allow-list, load and copy planners),
:mod:`~aegis.read.progress` (rich progress bars) and :mod:`~aegis.read.errors`.

It imports :mod:`aegis.snapshot` and :mod:`aegis.errors`, never :mod:`aegis.training` or
:mod:`aegis.cli`. Names are imported on first use: ``import aegis.read.progress`` (the command's
``aegis plan`` path) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from aegis.read.api import (
        DEFAULT_MAX_BYTES,
        LazyTensors,
        LoadResult,
        Snapshot,
        SnapshotEntry,
        Source,
        VerifyReport,
        open,
    )
    from aegis.read.errors import DamagedCopyWarning, ReadError, SourceError

_LAZY = {
    "open": "aegis.read.api",
    "Source": "aegis.read.api",
    "Snapshot": "aegis.read.api",
    "SnapshotEntry": "aegis.read.api",
    "LoadResult": "aegis.read.api",
    "VerifyReport": "aegis.read.api",
    "LazyTensors": "aegis.read.api",
    "DEFAULT_MAX_BYTES": "aegis.read.api",
    "SourceError": "aegis.read.errors",
    "ReadError": "aegis.read.errors",
    "DamagedCopyWarning": "aegis.read.errors",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'aegis.read' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "open",
    "Source",
    "Snapshot",
    "SnapshotEntry",
    "LoadResult",
    "VerifyReport",
    "LazyTensors",
    "DEFAULT_MAX_BYTES",
    "SourceError",
    "ReadError",
    "DamagedCopyWarning",
]
