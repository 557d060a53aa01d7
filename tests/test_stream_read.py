"""stream_chunks: a shard's chunks read straight into their destinations, every chunk's crc32c
computed on the bytes as they land and checked; gaps (bytes no destination wants) checked too."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from aegis.errors import CorruptShardError
from aegis.snapshot import stream_read
from aegis.snapshot.manifest import ChunkRecord
from aegis.snapshot.shard import crc32c
from aegis.snapshot.stream_read import byte_view, stream_chunks

pytestmark = pytest.mark.quick


def _shard(tmp_path: Path, size: int, chunk: int) -> tuple[Path, bytes, list[ChunkRecord]]:
    data = os.urandom(size)
    path = tmp_path / "shard"
    path.write_bytes(data)
    chunks = [ChunkRecord(offset=a, length=min(chunk, size - a), crc32c=crc32c(data[a:a + chunk]))
              for a in range(0, size, chunk)]
    return path, data, chunks


@pytest.mark.parametrize("parallel", [False, True])
def test_segments_across_chunk_and_block_boundaries_land_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               parallel: bool) -> None:
    monkeypatch.setattr(stream_read, "BLOCK", 4096)  # many blocks per segment
    monkeypatch.setattr(stream_read, "_PARALLEL_MIN", 0 if parallel else 1 << 40)
    path, data, chunks = _shard(tmp_path, 100_000, 30_000)
    # one segment inside a chunk, one across two chunk boundaries, gaps between and after
    spans = [(100, 9_000), (25_000, 70_001), (70_001, 70_005)]
    dsts = [torch.zeros(b - a, dtype=torch.uint8) for a, b in spans]
    segs = [(a, b, byte_view(d)) for (a, b), d in zip(spans, dsts, strict=True)]
    fd = os.open(path, os.O_RDONLY)
    try:
        n = stream_chunks(fd, chunks, range(len(chunks)), segs, step=3, rank=1, where="test")  # type: ignore[arg-type]
    finally:
        os.close(fd)
    assert n == len(data)
    for (a, b), d in zip(spans, dsts, strict=True):
        assert bytes(d.numpy()) == data[a:b]


def test_a_damaged_gap_or_segment_names_the_chunk(tmp_path: Path) -> None:
    path, data, chunks = _shard(tmp_path, 64_000, 16_000)
    dst = torch.zeros(1_000, dtype=torch.uint8)
    segs = [(20_000, 21_000, byte_view(dst))]
    for where, chunk in ((20_500, 1), (40_000, 2)):  # inside the segment; a gap of chunk 2
        damaged = bytearray(data)
        damaged[where] ^= 1
        path.write_bytes(bytes(damaged))
        fd = os.open(path, os.O_RDONLY)
        try:
            with pytest.raises(CorruptShardError, match=f"rank 4, chunk {chunk} ") as e:
                stream_chunks(fd, chunks, [1, 2], segs, step=9, rank=4, where="test")  # type: ignore[arg-type]
        finally:
            os.close(fd)
        assert e.value.chunk == chunk and e.value.step == 9


def test_a_truncated_file_is_reported_not_read_short(tmp_path: Path) -> None:
    path, data, chunks = _shard(tmp_path, 50_000, 16_000)
    path.write_bytes(data[:40_000])
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(CorruptShardError, match="truncated"):
            stream_chunks(fd, chunks, range(len(chunks)), [], step=1, rank=0, where="test")
    finally:
        os.close(fd)


def test_byte_view_only_for_plain_cpu_tensors() -> None:
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    v = byte_view(t)
    assert v is not None and len(v) == 48
    v[0:4] = bytes(torch.tensor([7.0]).numpy().tobytes())
    assert t[0, 0] == 7.0  # writes reach the tensor
    assert byte_view(t.t()) is None  # not contiguous
    assert byte_view(torch.zeros(0)) is None
    assert byte_view(torch.ones(2, dtype=torch.bfloat16)) is not None


def test_a_destination_outside_the_chunks_read_is_refused(tmp_path: Path) -> None:
    path, _, chunks = _shard(tmp_path, 48_000, 16_000)
    dst = torch.zeros(2_000, dtype=torch.uint8)
    fd = os.open(path, os.O_RDONLY)
    try:  # bytes 31_000..33_000 run into chunk 2, which is not read: never left unwritten
        with pytest.raises(ValueError, match="not in the chunks read"):
            stream_chunks(fd, chunks, [1], [(31_000, 33_000, byte_view(dst))], step=1, rank=0, where="t")  # type: ignore[list-item]
    finally:
        os.close(fd)


def test_chunk_check_fed_piece_by_piece_finds_a_flip_and_a_gap() -> None:
    """``ChunkCheck`` (a peer's copy received into the state, checked message by message as it
    lands): pieces cut anywhere, fed in order, pass; one flipped byte names its chunk; a piece
    that never came names the first byte missing."""
    import os

    import torch

    from aegis.errors import CorruptShardError
    from aegis.snapshot.manifest import ChunkRecord
    from aegis.snapshot.shard import crc32c
    from aegis.training.restore_direct import ChunkCheck, pieces

    data = torch.frombuffer(bytearray(os.urandom(10_000)), dtype=torch.uint8)
    bounds = [(0, 3000), (3000, 6500), (6500, 10_000)]
    chunks = [ChunkRecord(a, b - a, crc32c(memoryview(data[a:b].numpy())), "bytes") for a, b in bounds]
    cut = pieces([(0, 10_000)], [(100, 2900), (2950, 7000), (9000, 9999)])
    parts = [(a, b, data[a:b].clone()) for a, b, _ in cut]

    def run(ps: list, ids: list[int] = [0, 1, 2]) -> None:  # noqa: B006 - read only
        check = ChunkCheck(chunks, ids, step=3, rank=1, where="test")
        for i in range(0, len(ps), 2):  # two pieces per message
            check.feed(ps[i:i + 2])
        check.finish()

    run(parts)
    run([p for p in parts if p[1] > 3000], [1, 2])  # a chunk not asked for is not needed
    bad = [(a, b, t.clone()) for a, b, t in parts]
    k = next(i for i, (a, b, _) in enumerate(bad) if a <= 5000 < b)
    bad[k][2][5000 - bad[k][0]] ^= 0xFF
    with pytest.raises(CorruptShardError, match="chunk 1 "):
        run(bad)
    missing = [p for p in parts if p[0] != 2950]  # the piece 2950..7000 never came
    with pytest.raises(CorruptShardError, match="chunk 0 .*bytes from 2950 were not received"):
        run(missing)
    with pytest.raises(CorruptShardError, match="chunk 2 .*bytes from 9999 were not received"):
        run(parts[:-1])
