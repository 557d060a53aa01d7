"""Full tensors out of a snapshot (through DCP, no process group), and what the commands do
with them: statistics, differences, exports."""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import warnings
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint._nested_dict import unflatten_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import MetadataIndex

from aegis.cli._common import CliError, FailedError
from aegis.cli._dcp import CollectPlanner, CopyPlanner
from aegis.cli._sources import Snapshot, _AegisSnapshot
from aegis.snapshot.manifest import ItemRecord, TensorEntry, dtype_from_name

__all__ = [
    "Loaded",
    "load",
    "batches",
    "tensor_stats",
    "compare",
    "export_dcp",
    "export_torch",
    "export_safetensors",
]

Progress = Callable[[int], None]
BATCH_BYTES = 512 << 20  # diff loads both sides batch by batch: bounded memory


def _nop(n: int) -> None:
    pass


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """DCP warns that it runs without a process group: that is the point here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed.*")
        warnings.filterwarnings("ignore", message=".*process group.*")
        yield


@dataclass
class Loaded:
    """What :func:`load` returns: full tensors, unpickled objects (only when asked), and the
    serialized bytes of every non-tensor item that was read."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    objects: dict[str, Any] = field(default_factory=dict)
    raw: dict[str, bytes] = field(default_factory=dict)


def load(snap: Snapshot, names: Collection[str], *, progress: Progress = _nop,
         objects: bool = False, unpickle: bool = False) -> Loaded:
    """Load ``names`` as full tensors with ``dcp.load`` and no process group.

    Non-tensor entries are read only with ``objects`` (kept as serialized bytes) and unpickled
    only with ``unpickle`` (--unsafe-load-objects)."""
    sd: dict[str, Any] = {}
    for name in names:
        entry = snap.entries[name]
        if isinstance(entry, TensorEntry):
            sd[name] = torch.empty(entry.size, dtype=dtype_from_name(entry.dtype))
        elif objects or unpickle:
            sd[name] = 0  # a non-tensor leaf: DCP plans a bytes read for it
    planner = CollectPlanner(unpickle=unpickle, on_tensor=progress)
    out = Loaded()
    if sd:
        with snap.reader(list(sd), progress) as reader, _quiet():
            try:
                dcp.load(sd, storage_reader=reader, planner=planner)
            except CheckpointException as e:  # a BaseException: one line, no traceback
                raise FailedError(f"loading step {snap.step} failed: {_checkpoint_error(e)}") from None
    for name, value in sd.items():
        if isinstance(snap.entries[name], TensorEntry):
            out.tensors[name] = value
        elif unpickle:
            out.objects[name] = value
    out.raw = planner.raw
    return out


def _checkpoint_error(e: CheckpointException) -> str:
    failures = getattr(e, "failures", {}) or {}
    parts = []
    for rank, wrapped in sorted(failures.items()):
        exc = wrapped[0] if isinstance(wrapped, tuple) else wrapped
        parts.append(f"{type(exc).__name__}: {exc}" + (f" (rank {rank})" if len(failures) > 1 else ""))
    return "; ".join(parts) or str(e)


def batches(snap: Snapshot, names: list[str], max_bytes: int = BATCH_BYTES) -> Iterator[list[str]]:
    """``names`` in order, cut into groups of at most ``max_bytes`` (at least one name each)."""
    group: list[str] = []
    size = 0
    for name in names:
        n = snap.entry_bytes(name)
        if group and size + n > max_bytes:
            yield group
            group, size = [], 0
        group.append(name)
        size += n
    if group:
        yield group


# -- statistics and differences -----------------------------------------------------------------


def _as_float(t: torch.Tensor) -> torch.Tensor:
    if t.is_complex():
        return t.abs().to(torch.float64)
    return t.to(torch.float64)


def tensor_stats(t: torch.Tensor) -> dict[str, Any]:
    """min / max / mean / L2 norm over the finite values, and the NaN and Inf counts."""
    x = _as_float(t.detach()).reshape(-1)
    nan = int(torch.isnan(x).sum()) if t.is_floating_point() or t.is_complex() else 0
    inf = int(torch.isinf(x).sum()) if t.is_floating_point() or t.is_complex() else 0
    finite = x[torch.isfinite(x)] if nan or inf else x
    out: dict[str, Any] = {
        "dtype": str(t.dtype).removeprefix("torch."),
        "shape": list(t.shape),
        "numel": t.numel(),
        "min": None,
        "max": None,
        "mean": None,
        "norm": None,
        "nan": nan,
        "inf": inf,
    }
    if finite.numel():
        if not (t.is_floating_point() or t.is_complex()) and t.dtype != torch.bool:
            out["min"], out["max"] = int(t.min()), int(t.max())  # exact for int64
        else:
            out["min"], out["max"] = float(finite.min()), float(finite.max())
        out["mean"] = float(finite.mean())
        out["norm"] = float(torch.linalg.vector_norm(finite))
    return out


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.numel() == 0:
        return True
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def compare(a: torch.Tensor, b: torch.Tensor) -> dict[str, Any]:
    """status (unchanged / changed / incompatible), max |a - b| and ||a - b|| / ||a||, both over
    positions where a and b are finite (null when undefined)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return {"status": "incompatible", "max_abs_diff": None, "rel_norm": None,
                "detail": f"{str(a.dtype).removeprefix('torch.')}{list(a.shape)} vs "
                          f"{str(b.dtype).removeprefix('torch.')}{list(b.shape)}"}
    if _bitwise_equal(a, b):
        return {"status": "unchanged", "max_abs_diff": 0.0, "rel_norm": 0.0}
    x, y = _as_float(a).reshape(-1), _as_float(b).reshape(-1)
    ok = torch.isfinite(x) & torch.isfinite(y)
    d = (x - y)[ok]
    max_abs = float(d.abs().max()) if d.numel() else None
    base = float(torch.linalg.vector_norm(x[ok])) if d.numel() else 0.0
    diff = float(torch.linalg.vector_norm(d)) if d.numel() else 0.0
    rel = diff / base if base > 0 else None
    return {"status": "changed", "max_abs_diff": max_abs, "rel_norm": rel}


# -- exports ------------------------------------------------------------------------------------


def _atomic_path(out: Path) -> Path:
    return out.with_name(f".{out.name}.tmp{os.getpid()}")


def export_torch(snap: Snapshot, out: Path, *, flat: bool, unpickle: bool,
                 progress: Progress = _nop) -> Loaded:
    """One ``torch.save`` file of full tensors: nested like the training state (DCP's
    ``planner_data``), or flat fully-qualified names with ``flat``."""
    loaded = load(snap, list(snap.entries), progress=progress, unpickle=unpickle)
    flat_sd: dict[str, Any] = {**loaded.tensors, **loaded.objects}
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
    return loaded


def export_safetensors(snap: Snapshot, out: Path, *, progress: Progress = _nop) -> Loaded:
    """One safetensors file of full tensors under their flat names; non-tensor entries have no
    place in the format and are left out."""
    from safetensors.torch import save_file

    names = [n for n, e in snap.entries.items() if isinstance(e, TensorEntry)]
    loaded = load(snap, names, progress=progress)
    meta = {"format": "pt", "aegis.step": str(snap.step), "aegis.tier": snap.source.tier}
    if snap.job:
        meta["aegis.job"] = snap.job
    kinds = _state_kinds(snap)
    if kinds:  # which entries are per rank (keyed per_rank.rankNNNNN.<name>), as in the manifest
        meta["aegis.state_kinds"] = json.dumps(kinds, sort_keys=True)
    tmp = _atomic_path(out)
    try:
        save_file({n: loaded.tensors[n].contiguous() for n in names}, str(tmp), metadata=meta)
        os.replace(tmp, out)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    return loaded


def export_dcp(snap: Snapshot, out: Path, *, progress: Progress = _nop) -> int:
    """Write the snapshot as a plain DCP checkpoint directory: the same tensor chunks, the same
    serialized non-tensor items (copied, never unpickled), the same ``planner_data``. Every
    chunk's crc32c is checked on the way. Returns the number of storage items written."""
    if not isinstance(snap, _AegisSnapshot):
        raise CliError(f"{snap.source.uri} is already a plain DCP checkpoint: copy the directory, or "
                       "export --format torch/safetensors")
    manifest = snap.manifest
    assert manifest is not None
    items: dict[tuple[int, str, tuple[int, ...] | None], ItemRecord] = {
        (s.rank, i.fqn, i.offset): i for s in manifest.shards for i in s.items
    }
    storage = snap.metadata.storage_data
    assert isinstance(storage, dict)
    written = 0
    with snap.local_files(None, progress) as paths:
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
            t = torch.frombuffer(m, dtype=dtype, count=rec.length // dtype.itemsize, offset=rec.file_offset)
            return t.view(shape).clone()

        try:
            with _quiet():
                dcp.save({}, storage_writer=FileSystemWriter(out, single_file_per_rank=True),
                         planner=CopyPlanner(snap.metadata, fetch))
        except CheckpointException as e:
            raise FailedError(f"writing {out} failed: {_checkpoint_error(e)}") from None
        finally:
            for m in maps.values():
                with contextlib.suppress(BufferError):
                    m.close()
    kinds = _state_kinds(snap)
    if kinds:  # beside DCP's own files, which dcp.load ignores: which entries are per rank
        (out / STATE_KINDS_FILE).write_text(json.dumps({"state_kinds": kinds}, sort_keys=True) + "\n")
    return written


STATE_KINDS_FILE = "aegis_state.json"


def _state_kinds(snap: Snapshot) -> dict[str, str]:
    m = getattr(snap, "manifest", None)
    return dict(m.state_kinds) if m is not None else {}
