"""Plain DCP checkpoints (tier ``dcp``): a directory holding ``.metadata``, or a directory of
them; read by DCP with the safe metadata reader.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
)
from torch.distributed.checkpoint.storage import StorageReader

from aegis.errors import ManifestError, NoSnapshotError
from aegis.read._base import (  # noqa: F401
    _DISTCP_RANK,
    STATE_KINDS_FILE,
    TIER_DCP,
    Copy,
    Failure,
    Location,
    Progress,
    StepRow,
    VerifyResult,
)
from aegis.read.dcp_meta import SafeFileSystemReader, read_dcp_metadata
from aegis.snapshot.manifest import Manifest

__all__ = ["DcpLocation", "DcpCopy"]


class DcpLocation(Location):
    """One plain DCP checkpoint directory, or a directory of them (``step-N``-like names)."""

    tier = TIER_DCP

    def __init__(self, uri: str, checkpoints: list[tuple[int | None, Path]], *, unsafe: bool) -> None:
        self.uri = uri
        self.job = None
        self.checkpoints = sorted(checkpoints, key=lambda c: (c[0] is not None, c[0] or 0))
        self.unsafe = unsafe
        self._md: dict[Path, Metadata] = {}

    def metadata(self, path: Path) -> Metadata:
        if path not in self._md:
            self._md[path] = read_dcp_metadata(path, unsafe=self.unsafe)
        return self._md[path]

    def rows(self) -> list[StepRow]:
        out = []
        for step, path in reversed(self.checkpoints):
            row = StepRow(str(path), self.tier, None, step, True)
            try:
                md = self.metadata(path)
            except ManifestError as e:
                row.error = str(e)
            else:
                snap = DcpCopy(self, step, path, md)
                row.world_size = snap.world_size()
                row.shards = len(snap.files())
                row.raw_bytes = sum(snap.entry_bytes(n) for n in snap.entries)
                row.stored_bytes = sum((path / f).stat().st_size for f in snap.files() if (path / f).exists())
                row.created = (path / ".metadata").stat().st_mtime
            out.append(row)
        return out

    def committed(self) -> list[int]:
        return [s for s, _ in self.checkpoints if s is not None]

    def open(self, step: int | None) -> Copy:
        if step is None:
            s, path = self.checkpoints[-1]
            return DcpCopy(self, s, path, self.metadata(path))
        for s, path in self.checkpoints:
            if s == step:
                return DcpCopy(self, s, path, self.metadata(path))
        steps = ", ".join(str(s) for s in self.committed()) or "none: its name has no step number"
        raise NoSnapshotError(f"step {step} is not in {self.uri} (steps: {steps})")

    def _open(self, step: int) -> Copy:
        return self.open(step)

    def _path(self, step: int | None) -> Path:
        for s, path in self.checkpoints:
            if s == step:
                return path
        raise NoSnapshotError(f"step {step} is not in {self.uri}")

    def all_steps(self) -> list[int | None]:
        return [s for s, _ in self.checkpoints]

    def verify_bytes(self, step: int | None) -> int:
        path = self._path(step)
        try:
            snap = DcpCopy(self, step, path, self.metadata(path))
        except ManifestError:
            return 0
        return sum(info.length for info in snap.storage_infos().values())

    def verify(self, step: int | None, progress: Progress) -> VerifyResult:
        """DCP keeps no checksums: check that every item's bytes exist in its file."""
        res = VerifyResult()
        path = self._path(step)
        try:
            snap = DcpCopy(self, step, path, self.metadata(path))
        except ManifestError as e:
            res.failures.append(Failure(None, step, None, None, self.tier, str(path), str(e)))
            return res
        sizes: dict[str, int | None] = {}
        for n, (index, info) in enumerate(snap.storage_infos().items()):
            rel = info.relative_path
            if rel not in sizes:
                try:
                    sizes[rel] = (path / rel).stat().st_size
                except OSError:
                    sizes[rel] = None
            rank_m = _DISTCP_RANK.match(rel)
            rank = int(rank_m.group(1)) if rank_m else None
            size = sizes[rel]
            if size is None:
                res.failures.append(Failure(None, step, rank, n, self.tier, str(path),
                                            f"{index.fqn}: file {rel} is missing"))
            elif info.offset + info.length > size:
                res.failures.append(Failure(None, step, rank, n, self.tier, str(path),
                                            f"{index.fqn}: {rel} is truncated ({size} bytes, the item "
                                            f"ends at {info.offset + info.length})"))
            res.chunks += 1
            res.bytes += info.length
            progress(info.length)
        return res


class DcpCopy(Copy):
    """A plain DCP checkpoint directory. Its ``state_kinds`` come from ``aegis_state.json`` when
    it is an aegis export (``aegis export --format dcp``), else they are empty."""

    location: DcpLocation

    def __init__(self, location: DcpLocation, step: int | None, path: Path, md: Metadata) -> None:
        self.location = location
        self.step = step
        self.path = path
        self.metadata = md
        self.entries = Manifest.entries_from_dcp(md)
        self.planner_data = {k: tuple(v) for k, v in (md.planner_data or {}).items()}
        sizes: dict[str, int] = {}
        for index, info in self.storage_infos().items():
            if isinstance(md.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
                sizes[index.fqn] = sizes.get(index.fqn, 0) + int(getattr(info, "length", 0))
        self.object_sizes = sizes
        self.state_kinds = self._state_kinds()

    def _state_kinds(self) -> dict[str, str]:
        try:
            doc = json.loads((self.path / STATE_KINDS_FILE).read_text())
            kinds = doc["state_kinds"]
        except (OSError, ValueError, KeyError, TypeError):
            return {}
        if not isinstance(kinds, dict):
            return {}
        return {str(k): str(v) for k, v in kinds.items() if isinstance(v, str)}

    def storage_infos(self) -> dict[MetadataIndex, Any]:
        data = self.metadata.storage_data
        return dict(data) if isinstance(data, Mapping) else {}

    def files(self) -> list[str]:
        return sorted({info.relative_path for info in self.storage_infos().values()})

    def world_size(self) -> int | None:
        ranks = {int(m.group(1)) for f in self.files() if (m := _DISTCP_RANK.match(f))}
        return len(ranks) or None

    def summary(self) -> dict[str, Any]:
        try:
            created: float | None = (self.path / ".metadata").stat().st_mtime
        except OSError:
            created = None
        return {
            "world_size": self.world_size(),
            "created": created,
            "format_version": getattr(self.metadata, "version", None),
            "mesh": {},
            "timings": {},
            "shards": [
                {"file": f, "size": (self.path / f).stat().st_size if (self.path / f).exists() else None}
                for f in self.files()
            ],
        }

    @contextlib.contextmanager
    def reader(self) -> Iterator[StorageReader]:
        yield SafeFileSystemReader(self.path, unsafe=self.location.unsafe)
