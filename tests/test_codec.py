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
    planes, desc = Codec("planes", min_gain=0).encode(data, "bfloat16")
    plain, _ = Codec("zstd", min_gain=0).encode(data, "bfloat16")
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
    blob, desc = Codec(min_gain=0).encode(data, "float16")
    assert desc.startswith("planes:2:") and decode(blob, desc, len(data)) == data


@pytest.mark.parametrize("desc", ["zstd", "real", "lz4", "planes:3:zzz", "xplanes:int8:zz"])
def test_corrupt_or_unknown_input_is_a_clear_error(desc: str) -> None:
    data = weights(torch.bfloat16, 4096)
    blob, real = Codec(min_gain=0).encode(data, "bfloat16")
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


def test_a_chunk_that_compression_would_shrink_too_little_is_stored_raw() -> None:
    """``min_gain`` (issue 39): fp32 weights shrink to ~0.85 in planes, under the default 25%
    saving, so they are stored raw (their decoding would cost a restore more than the bytes
    save); bf16 weights (0.68) and zeros stay compressed; ``min_gain=0`` compresses them all."""
    for n in (4096, 1 << 20):  # too small to sample, and sampled
        fp32 = weights(torch.float32, n)
        blob, desc = Codec().encode(fp32, "float32")
        assert (blob, desc) == (fp32, "raw")
        blob, desc = Codec(min_gain=0).encode(fp32, "float32")
        assert desc.startswith("xplanes:float32:") and len(blob) < len(fp32)
        assert decode(blob, desc, len(fp32)) == fp32
        bf16 = weights(torch.bfloat16, n)
        blob, desc = Codec().encode(bf16, "bfloat16")
        assert desc.startswith("xplanes:bfloat16:") and len(blob) <= 0.75 * len(bf16)
        zeros = bytes(4 * n)
        blob, desc = Codec().encode(zeros, "float32")
        assert desc != "raw" and len(blob) < len(zeros) // 100 and decode(blob, desc, len(zeros)) == zeros


def test_the_sampled_estimate_is_checked_on_the_whole_chunk() -> None:
    """Samples that compress well do not make a chunk that does not compressed: the encoded chunk
    is measured again (here the samples' windows hold zeros, the rest is noise)."""
    import os

    from aegis.snapshot import codec

    n = 4 << 20
    data = bytearray(os.urandom(n))
    size = codec.SAMPLE_BYTES
    stride = (n - size) // (codec.SAMPLES - 1)
    for i in range(codec.SAMPLES):
        data[i * stride:i * stride + size] = bytes(size)
    c = Codec("zstd")
    assert c._sampled_gain(bytes(data), "bytes") > 0.9  # the estimate alone would compress it
    blob, desc = c.encode(bytes(data), "bytes")
    assert desc == "raw" and blob == bytes(data)


def test_min_gain_out_of_range_is_a_clear_error() -> None:
    from aegis.errors import ConfigError
    from aegis.training.config import ManagerConfig

    for bad in (-0.1, 1.0, 2):
        with pytest.raises(ValueError, match="min_gain"):
            Codec(min_gain=bad)
    for bad in (-0.1, 1.0, "0.2", True):
        with pytest.raises(ConfigError, match="durable_min_gain"):
            ManagerConfig(job="j", durable_min_gain=bad)  # type: ignore[arg-type]
