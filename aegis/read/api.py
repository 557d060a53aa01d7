"""Snapshots from Python: :func:`open` a job's snapshots, pick a step, read its tensors.

::

    import aegis

    src = aegis.open("s3://bucket/ckpt", job="llama")   # or a node store, file://, a DCP dir
    snap = src.latest()                                 # or src.step(12000)
    snap.load_into(model)                               # a plain nn.Module, no process group
    sd = snap.load(prefix="app.model.model.", dtype=torch.bfloat16)
    w = snap.tensor("app.model.model.head.weight")

A :class:`Source` is one job in one or more places (tiers): a node store directory, a durable
root (``file://``, ``s3://``), or a plain DCP checkpoint directory, with the same URIs as the
``aegis`` command. Opening several URIs of one job (two nodes' stores, a node store and the
durable tier) makes each step readable from every place that holds it: memory first, then
durable, in the order given. A :class:`Snapshot` is one step. Reading checks what restore
checks (crc32c of every chunk read; durable chunks: stored crc32c, decode, raw crc32c; a node
store shard's own index against the manifest), and a chunk that fails in one copy is read from
the next copy that holds it: the snapshot's ``notes`` (and a :class:`DamagedCopyWarning`) name
the damaged copy and the one used.

Tensors are assembled whole from their shards through DCP with no process group, a batch of
entries at a time: a read holds at most ``max_bytes`` besides the tensors it returns: the
verified chunks of one batch and, with a durable copy, each download thread's decoding
(``DECODE_FACTOR`` x the chunk size; at least one thread and one entry are always allowed, so a
single entry, or one decoding thread, larger than the budget overshoots it). ``load_into`` a
preallocated model needs about ``max_bytes`` on top of the model, and ``tensors()`` streams a
state of any size.
Non-tensor entries (optimizer param groups, schedulers, samplers, per-rank state) are data:
their serialized bytes, unpickled only when asked (``weights_only=True`` unless told otherwise).
"""

from __future__ import annotations

from aegis.read.snapshot import (  # noqa: F401 - the reading API, one import away
    DEFAULT_MAX_BYTES,
    ChunkKey,
    LazyTensors,
    LoadResult,
    Snapshot,
    SnapshotEntry,
    VerifyReport,
)
from aegis.read.source import Source, open  # noqa: A004, F401

__all__ = [
    "open",
    "Source",
    "Snapshot",
    "SnapshotEntry",
    "LoadResult",
    "VerifyReport",
    "LazyTensors",
    "DEFAULT_MAX_BYTES",
]
