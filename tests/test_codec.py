from __future__ import annotations

import pytest
import torch

from aegis.errors import CorruptShardError
from aegis.snapshot.codec import Codec, decode

pytestmark = pytest.mark.quick  # unit / single-process: make test-quick


def weights(dtype: torch.dtype, n: int = 1 << 16) -> bytes:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(n, generator=g) * 0.02).to(dtype).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("dtype, name", [(torch.bfloat16, "bfloat16"), (torch.float32, "float32")])
@pytest.mark.parametrize("mode", ["planes", "zstd", "raw"])
def test_round_trip(dtype: torch.dtype, name: str, mode: str) -> None:
    data = weights(dtype)
    blob, desc = Codec(mode=mode).encode(data, name)
    assert decode(blob, desc, len(data)) == data


def test_byte_planes_beat_plain_zstd_on_bf16() -> None:
    data = weights(torch.bfloat16)
    planes, desc = Codec("planes").encode(data, "bfloat16")
    plain, _ = Codec("zstd").encode(data, "bfloat16")
    assert desc.startswith("xplanes:bfloat16:") and "z" in desc
    assert len(planes) < len(plain) < len(data)
    assert len(planes) / len(data) <= 0.70


def test_incompressible_bytes_stay_raw() -> None:
    import os

    data = os.urandom(4096)
    blob, desc = Codec().encode(data, "bytes")
    assert desc == "raw" and blob == data


def test_plain_byte_planes_for_other_floats() -> None:
    data = weights(torch.float16)
    blob, desc = Codec().encode(data, "float16")
    assert desc.startswith("planes:2:") and decode(blob, desc, len(data)) == data


@pytest.mark.parametrize("desc", ["zstd", "real", "lz4", "planes:3:zzz", "xplanes:int8:zz"])
def test_corrupt_or_unknown_input_is_a_clear_error(desc: str) -> None:
    data = weights(torch.bfloat16, 4096)
    blob, real = Codec().encode(data, "bfloat16")
    assert real.startswith("xplanes:bfloat16:z")  # the exponent plane is a zstd frame
    bad = bytearray(blob)
    bad[16 + 8] ^= 0xFF  # inside the first plane's zstd frame, after the 16-byte header
    with pytest.raises(CorruptShardError, match="cannot decode|decoded"):
        decode(bytes(bad) if desc == "real" else blob[:10], real if desc == "real" else desc, len(data))


def _arith_planes(raw: bytes, dtype: str) -> list[bytes]:
    """The exponent-aligned planes as the arithmetic on each element's integer value defines
    them (the stored format since it was introduced)."""
    import numpy as np

    if dtype == "bfloat16":
        x = np.frombuffer(raw, dtype="<u2")
        return [((x >> 7) & 0xFF).astype(np.uint8).tobytes(),
                (((x >> 8) & 0x80) | (x & 0x7F)).astype(np.uint8).tobytes()]
    x = np.frombuffer(raw, dtype="<u4")
    rest = ((x >> 31) << 23) | (x & 0x7FFFFF)
    return [((x >> 23) & 0xFF).astype(np.uint8).tobytes(), *(
        ((rest >> s) & 0xFF).astype(np.uint8).tobytes() for s in (0, 8, 16))]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_byte_wise_planes_are_the_stored_format(dtype: str) -> None:
    """The split and join work on bytes (issue 39: no widening copies); every bit pattern (signs,
    zeros, denormals, inf, NaN payloads) gives the planes the format defines, and joins back."""
    import numpy as np

    from aegis.snapshot import codec

    width = 2 if dtype == "bfloat16" else 4
    rng = np.random.default_rng(1)
    raw = rng.integers(0, 256, size=width * 50_000, dtype=np.uint8).tobytes()
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-40, -1e-40, 1.0, -2.5])
    raw += special.to(getattr(torch, dtype)).view(torch.uint8).numpy().tobytes()
    split, join = codec._SPLIT[dtype]
    planes = split(raw)
    assert [p.tobytes() for p in planes] == _arith_planes(raw, dtype)
    out = np.empty((len(raw) // width, width), dtype=np.uint8)
    join([np.frombuffer(p.tobytes(), dtype=np.uint8) for p in planes], out)
    assert out.tobytes() == raw
