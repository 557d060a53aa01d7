"""DCP plumbing of the reading layer: a reader for plain DCP directories that never unpickles
anything but DCP's own metadata classes, a load planner that loads full tensors (and non-tensor
items only when asked), and a save planner that writes an aegis snapshot out as a plain DCP
checkpoint with its sharding unchanged.

Used by :mod:`aegis.read`, the ``aegis`` command and :mod:`aegis.integrations.torchtitan`.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    create_default_global_save_plan,
)
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    ReadItem,
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from aegis.errors import ManifestError

__all__ = ["SafeFileSystemReader", "read_dcp_metadata", "CollectPlanner", "CopyPlanner"]

# Everything a DCP ``.metadata`` pickle of torch 2.x refers to. Anything else (an old or custom
# checkpoint) is refused unless the caller asks for unsafe loading (--unsafe-load-objects,
# ``aegis.open(..., unsafe_load_objects=True)``).
_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in ("Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata",
                 "BytesStorageMetadata", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_CLASSES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(
            f"refers to {module}.{name}, which is not one of DCP's metadata classes"
        )


def read_dcp_metadata(path: str | os.PathLike[str], *, unsafe: bool = False) -> Metadata:
    """The ``.metadata`` of a DCP checkpoint directory, unpickled with an allow-list (``unsafe``:
    with plain pickle). Raises :class:`~aegis.errors.ManifestError` naming the file."""
    file = Path(path) / ".metadata"
    try:
        with open(file, "rb") as f:
            md = pickle.load(f) if unsafe else _MetadataUnpickler(f).load()  # noqa: S301
    except OSError as e:
        raise ManifestError(f"cannot read {file}: {e.strerror or e}") from e
    except pickle.UnpicklingError as e:
        raise ManifestError(
            f"{file} {e}; pass --unsafe-load-objects (aegis.open(..., unsafe_load_objects=True)) "
            "to unpickle it anyway (only for a checkpoint you trust)"
        ) from e
    except Exception as e:  # noqa: BLE001 - truncated or garbage: one line, no traceback
        raise ManifestError(f"{file} is not a readable DCP metadata file ({type(e).__name__}: {e})") from e
    if not isinstance(md, Metadata):
        raise ManifestError(f"{file} does not hold DCP Metadata (got {type(md).__name__})")
    if getattr(md, "storage_meta", None) is None:
        md.storage_meta = StorageMeta()
    return md


class SafeFileSystemReader(FileSystemReader):
    """DCP's ``FileSystemReader`` with the allow-listed metadata unpickler. (Tensor payloads are
    read by DCP itself with ``torch.load(weights_only=True)``.)"""

    def __init__(self, path: Path, *, unsafe: bool = False) -> None:
        super().__init__(path)
        self._dir = path
        self._unsafe = unsafe

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        md = read_dcp_metadata(self._dir, unsafe=self._unsafe)
        assert md.storage_meta is not None
        md.storage_meta.load_id = self.load_id
        return md


class CollectPlanner(DefaultLoadPlanner):
    """Loads into a flat state dict of full (unsharded) tensors.

    Non-tensor items are kept as their serialized bytes (``raw``), and unpickled only with
    ``unpickle=True``: ``torch.load(weights_only=weights_only)``; ``weights_only=False`` is
    --unsafe-load-objects. ``on_tensor`` is told the bytes of every tensor read, for progress
    bars."""

    def __init__(self, *, unpickle: bool = False, weights_only: bool = False,
                 on_tensor: Callable[[int], None] | None = None) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.unpickle = unpickle
        self.weights_only = weights_only
        self.on_tensor = on_tensor
        self.raw: dict[str, bytes] = {}

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        data = value.read()
        fqn = read_item.dest_index.fqn
        self.raw[fqn] = data
        if self.unpickle:
            self.state_dict[fqn] = torch.load(io.BytesIO(data), weights_only=self.weights_only)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        super().commit_tensor(read_item, tensor)
        if self.on_tensor is not None:
            self.on_tensor(tensor.numel() * tensor.element_size())


class CopyPlanner(SavePlanner):
    """Saves the storage items of an existing checkpoint as they are: the same tensor chunks
    (offsets and sizes), the same serialized non-tensor items, the same ``planner_data``.

    ``fetch(index)`` returns a chunk as a CPU tensor, or a non-tensor item's serialized bytes.
    Used with ``dcp.save`` and no process group: one writer writes every original rank's items.
    """

    def __init__(self, metadata: Metadata, fetch: Callable[[MetadataIndex], torch.Tensor | bytes]) -> None:
        self.metadata = metadata
        self.fetch = fetch

    def set_up_planner(self, state_dict: Any, storage_meta: StorageMeta | None = None,
                       is_coordinator: bool = False) -> None:
        pass

    def create_local_plan(self) -> SavePlan:
        items: list[WriteItem] = []
        assert isinstance(self.metadata.storage_data, Mapping)
        # In the order of the state dict (the metadata lists entries in plan order).
        order = {fqn: i for i, fqn in enumerate(self.metadata.state_dict_metadata)}
        indices = sorted(self.metadata.storage_data,
                         key=lambda x: (order.get(x.fqn, len(order)), tuple(x.offset or ())))
        for index in indices:
            md = self.metadata.state_dict_metadata[index.fqn]
            if isinstance(md, BytesStorageMetadata):
                items.append(WriteItem(index=MetadataIndex(index.fqn), type=WriteItemType.BYTE_IO))
                continue
            assert isinstance(md, TensorStorageMetadata)
            offsets = torch.Size(index.offset or ())
            chunk = next((c for c in md.chunks if c.offsets == offsets), None)
            if chunk is None:
                raise ManifestError(f"{index.fqn}: no chunk at offsets {tuple(offsets)} in the metadata")
            items.append(WriteItem(
                index=MetadataIndex(index.fqn, offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offsets, sizes=chunk.sizes),
                    properties=md.properties,
                    size=md.size,
                ),
            ))
        planner_data = dict(self.metadata.planner_data or {})
        return SavePlan(items, planner_data=planner_data)

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        plans, md = create_default_global_save_plan(all_plans)
        planner_data: dict[str, Any] = {}
        for p in all_plans:
            planner_data.update(p.planner_data or {})
        return plans, dataclasses.replace(md, planner_data=planner_data)

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        return new_plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        data = self.fetch(write_item.index)
        if isinstance(data, bytes):
            return io.BytesIO(data)
        return data
