"""Snapshots written out for tools that have never heard of aegis: a plain DCP checkpoint
directory, one ``torch.save`` file, or one safetensors file. Called by
:meth:`aegis.read.api.Snapshot.export` (and so by ``aegis export``)."""

from __future__ import annotations

import contextlib
import json
import mmap
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint._nested_dict import unflatten_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import MetadataIndex

from aegis.read.dcp_meta import CopyPlanner
from aegis.read.errors import ReadError, SourceError
from aegis.read.locations import STATE_KINDS_FILE
from aegis.read.tensors import checkpoint_error, quiet
from aegis.snapshot import hostmem
from aegis.snapshot.manifest import ItemRecord, dtype_from_name

if TYPE_CHECKING:
    from aegis.read.api import Snapshot

__all__ = ["export_dcp", "export_torch", "export_safetensors"]

Progress = Callable[[int], None]


def _nop(n: int) -> None:
    pass


def _atomic_path(out: Path) -> Path:
    return out.with_name(f".{out.name}.tmp{os.getpid()}")


def export_torch(snap: Snapshot, out: Path, *, flat: bool, unpickle: bool,
                 progress: Progress = _nop) -> dict[str, Any]:
    """One ``torch.save`` file of full tensors: nested like the training state (DCP's
    ``planner_data``), or flat fully-qualified names with ``flat``. Non-tensor entries only with
    ``unpickle`` (``weights_only=False``: --unsafe-load-objects)."""
    flat_sd: dict[str, Any] = dict(snap.load(progress=progress))
    objects = [n for n, e in snap.entries.items() if e.kind == "object"]
    if unpickle and objects:
        flat_sd.update(snap.objects(objects, unpickle=True, weights_only=False, progress=False))
    flat_sd = {k: flat_sd[k] for k in snap.entries if k in flat_sd}
    if flat:
        obj: dict[str, Any] = flat_sd
    else:
        mapping = {k: tuple(snap.planner_data.get(k, (k,))) for k in flat_sd}
        obj = unflatten_state_dict(flat_sd, mapping)  # type: ignore[arg-type]
    tmp = _atomic_path(out)
    try:
        torch.save(obj, tmp)
        os.replace(tmp, out)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    return {"tensors": len(snap.keys()), "objects": len(objects) if unpickle else 0,
            "objects_skipped": [] if unpickle else objects}


def export_safetensors(snap: Snapshot, out: Path, *, progress: Progress = _nop) -> dict[str, Any]:
    """One safetensors file of full tensors under their flat names; non-tensor entries have no
    place in the format and are left out."""
    from safetensors.torch import save_file

    names = snap.keys()
    tensors = snap.load(names, progress=progress)
    meta = {"format": "pt", "aegis.step": str(snap.step), "aegis.tier": snap.tier}
    if snap.job:
        meta["aegis.job"] = snap.job
    if snap.state_kinds:  # which entries are per rank (keyed per_rank.rankNNNNN.<name>), as in the manifest
        meta["aegis.state_kinds"] = json.dumps(snap.state_kinds, sort_keys=True)
    tmp = _atomic_path(out)
    try:
        save_file({n: tensors[n].contiguous() for n in names}, str(tmp), metadata=meta)
        os.replace(tmp, out)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    objects = [n for n, e in snap.entries.items() if e.kind == "object"]
    return {"tensors": len(names), "objects": 0, "objects_skipped": objects}


def export_dcp(snap: Snapshot, out: Path, *, progress: Progress = _nop) -> dict[str, Any]:
    """Write the snapshot as a plain DCP checkpoint directory: the same tensor chunks, the same
    serialized non-tensor items (copied, never unpickled), the same ``planner_data``. Every
    chunk's crc32c is checked on the way (a damaged chunk is read from the next copy)."""
    manifest = snap.manifest
    if manifest is None:
        raise SourceError(f"{snap.uri} is already a plain DCP checkpoint: copy the directory, or "
                          "export --format torch/safetensors")
    items: dict[tuple[int, str, tuple[int, ...] | None], ItemRecord] = {
        (s.rank, i.fqn, i.offset): i for s in manifest.shards for i in s.items
    }
    storage = snap.metadata.storage_data
    assert isinstance(storage, dict)
    written = 0
    with snap.local_files(progress=progress) as paths:
        maps: dict[int, mmap.mmap] = {}

        def mapped(rank: int) -> mmap.mmap:
            if rank not in maps:
                with open(paths[rank], "rb") as f:
                    maps[rank] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            return maps[rank]

        def fetch(index: MetadataIndex) -> torch.Tensor | bytes:
            nonlocal written
            loc = storage[index]
            offset = tuple(index.offset) if index.offset is not None else None
            rec = items[(loc.rank, index.fqn, offset)]
            m = mapped(loc.rank)
            written += 1
            if not rec.is_tensor:
                return bytes(m[rec.file_offset:rec.file_offset + rec.length])
            dtype = dtype_from_name(rec.dtype or "uint8")
            shape = rec.shape or ()
            if rec.length == 0:
                return torch.empty(shape, dtype=dtype)
            t = hostmem.tensor_of(m, dtype, count=rec.length // dtype.itemsize, offset=rec.file_offset)
            return t.view(shape).clone()

        try:
            with quiet():
                dcp.save({}, storage_writer=FileSystemWriter(out, single_file_per_rank=True),
                         planner=CopyPlanner(snap.metadata, fetch))
        except CheckpointException as e:
            raise ReadError(f"writing {out} failed: {checkpoint_error(e)}") from None
        finally:
            for m in maps.values():
                with contextlib.suppress(BufferError):
                    m.close()
    if snap.state_kinds:  # beside DCP's own files, which dcp.load ignores: which entries are per rank
        (out / STATE_KINDS_FILE).write_text(json.dumps({"state_kinds": snap.state_kinds}, sort_keys=True) + "\n")
    return {"tensors": len(snap.keys()), "objects": len(snap.entries) - len(snap.keys()),
            "objects_skipped": [], "items": written}
