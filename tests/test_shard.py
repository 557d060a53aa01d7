from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    BytesIOWriteData,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from aegis.errors import CorruptShardError, ManifestError
from aegis.snapshot.manifest import ChunkRecord
from aegis.snapshot.shard import (
    ALIGN,
    ShardIndex,
    crc32c,
    decode_footer,
    decode_index,
    encode_tail,
    finish_layout,
    plan_layout,
    verify_chunks,
)

pytestmark = pytest.mark.quick  # unit / single-process: make test-quick


def titem(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> WriteItem:
    return WriteItem(
        index=MetadataIndex(name, (0,) * len(shape)),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(torch.Size((0,) * len(shape)), torch.Size(shape)),
            properties=TensorProperties(dtype=dtype),
            size=torch.Size(shape),
        ),
    )


def test_layout_aligns_groups_by_dtype_and_tiles_chunks() -> None:
    items = [
        titem("a", (3, 5), torch.float32),
        titem("b", (7,), torch.bfloat16),
        titem("c", (100,), torch.float32),
        WriteItem(index=MetadataIndex("lr"), type=WriteItemType.BYTE_IO, bytes_io_data=BytesIOWriteData(9)),
    ]
    layout = plan_layout(items, chunk_bytes=256)
    assert all(t.file_offset % ALIGN == 0 for t in layout.tensors)
    assert [t.item.index.fqn for t in layout.tensors] == ["a", "c", "b"]  # float32 first, then bf16
    # chunks tile the tensor region, never mixing dtypes
    pos = 0
    for off, length, _dtype in layout.tensor_chunks:
        assert off == pos and 0 < length <= 256
        pos += length
    assert pos == layout.tensor_end
    by_dtype = {d for _, _, d in layout.tensor_chunks}
    assert by_dtype == {"float32", "bfloat16"}
    records, chunks, offsets, end = finish_layout(layout, [b"123456789"])
    assert offsets == [layout.tensor_end] and end % ALIGN == 0 and chunks[-1][2] == "bytes"
    assert records[-1].length == 9


def test_tail_round_trip_and_corruption() -> None:
    idx = ShardIndex("j", 3, 1, (ChunkRecord(0, 64, crc32c(bytes(64)), "float32"),), ())
    tail, crc = encode_tail(idx)
    blob = bytes(64) + tail
    start, fcrc = decode_footer(blob[-24:], size=len(blob), where="t")
    assert fcrc == crc
    first = decode_index(blob[start:-24], crc=fcrc, size=len(blob), where="t")
    assert first == idx
    # the same bytes again are not parsed again (a restore reads a local index twice) ...
    assert decode_index(bytes(blob[start:-24]), crc=fcrc, size=len(blob), where="t") is first
    # ... but the cache never vouches for them against another crc
    with pytest.raises(ManifestError, match="crc32c"):
        decode_index(blob[start:-24], crc=fcrc ^ 1, size=len(blob), where="t")
    bad = bytearray(blob)
    bad[start + 3] ^= 1
    with pytest.raises(ManifestError, match="crc32c"):
        decode_index(bytes(bad[start:-24]), crc=fcrc, size=len(blob), where="t")
    with pytest.raises(ManifestError, match="bad magic"):
        decode_footer(b"X" * 24, size=len(blob), where="t")


def test_verify_chunks_names_step_rank_chunk() -> None:
    data = bytearray(range(256)) * 2
    chunks = [ChunkRecord(0, 256, crc32c(data[:256])), ChunkRecord(256, 256, crc32c(data[256:]))]
    verify_chunks(bytes(data), chunks, step=4, rank=2, where="mem")
    data[300] ^= 0x10
    with pytest.raises(CorruptShardError, match=r"step 4, rank 2, chunk 1") as e:
        verify_chunks(bytes(data), chunks, step=4, rank=2, where="mem")
    assert (e.value.step, e.value.rank, e.value.chunk) == (4, 2, 1)
    with pytest.raises(CorruptShardError, match="truncated"):
        verify_chunks(bytes(data[:300]), chunks, step=4, rank=2, where="mem")
