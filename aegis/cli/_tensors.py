"""What the commands do with full tensors read through :mod:`aegis.read`: statistics
(``inspect --tensor``) and differences (``diff``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from aegis.read.api import Snapshot

__all__ = ["BATCH_BYTES", "batches", "tensor_stats", "compare"]

BATCH_BYTES = 512 << 20  # diff loads both sides batch by batch: bounded memory


def batches(snap: Snapshot, names: list[str], max_bytes: int = BATCH_BYTES) -> Iterator[list[str]]:
    """``names`` in order, cut into groups of at most ``max_bytes`` of tensors (at least one
    name each): the same groups from both sides of a diff."""
    from aegis.read.snapshot import by_bytes

    yield from by_bytes(names, snap.entry_bytes, max_bytes)


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
