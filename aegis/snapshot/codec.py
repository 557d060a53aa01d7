"""Chunk codec for the durable tier: zstd, with a byte-plane transform for floating dtypes.

A float element's bytes differ in entropy: the exponent byte compresses, the low mantissa bytes
are noise. Splitting each chunk into byte planes (plane i = byte i of every element) and
compressing only the planes that shrink beats plain zstd (measured here on bf16 weights: plain
zstd 1.28x, byte planes 1.46x). The descriptor written per chunk into the manifest says how to
decode it, so old snapshots stay readable when defaults change:

* ``raw``                 stored as is
* ``zstd``                one zstd frame
* ``planes:<n>:<mask>``   n byte planes, mask[i] = ``z`` (zstd frame) or ``r`` (raw); the blob is
                          a little-endian u64 length per plane, then the planes in order
* ``xplanes:<dtype>:<mask>`` the same, but for bfloat16/float32 the planes are cut at the
                          exponent: plane 0 is the 8 exponent bits, the other planes hold the
                          sign and mantissa. In little-endian byte planes the exponent's lowest
                          bit sits in the mantissa's byte and spoils it; aligned, the exponent
                          plane compresses alone (bf16 weights of a 21M-parameter model trained
                          here, zstd level 1: 0.68 of raw; plain zstd 0.78).

A chunk is stored compressed only when that saves at least ``Codec.min_gain`` of its bytes
(0.25 by default; issue 39). Decoding byte planes runs at 0.6-0.8 GB/s per core here against
several GB/s for a copy, so the fp32 state of a trained model (weights and Adam moments: 0.80-0.84
of raw in planes, ``bench/codec.py``) is stored raw: on restore the 16-20% fewer bytes pay for
their decoding only where a core's share of the store's bandwidth is below ~0.15 GB/s. bf16
weights (0.68) and chunks of zeros stay compressed. ``min_gain=0`` compresses whatever shrinks.
The decision is made on :data:`SAMPLES` samples spread over the chunk before the chunk is split
(an fp32 chunk otherwise costs its whole encoding, 4 ms per MiB, to end up raw) and checked again
on the encoded chunk.
"""

from __future__ import annotations

import struct
import threading
from dataclasses import dataclass

import numpy as np
import zstandard

from aegis.errors import CorruptShardError

__all__ = ["Codec", "decode", "decode_into", "FLOAT_DTYPES"]


# The splits and joins work on the element's bytes (uint8 planes), not on its integer value:
# the same planes as the arithmetic on u2/u4 (the stored format is unchanged; a test checks the
# two against each other), with no widening copies. Little-endian: byte 0 is the lowest.
# bfloat16 bytes: b0 = e0 m6..m0, b1 = s e7..e1. float32: b0, b1 = m7..m0, m15..m8;
# b2 = e0 m22..m16; b3 = s e7..e1.


def _byte_planes(raw: bytes | memoryview, n: int) -> np.ndarray:
    return np.frombuffer(raw, dtype=np.uint8).reshape(-1, n)


def _bf16_split(raw: bytes) -> list[np.ndarray]:
    b = _byte_planes(raw, 2)
    b0, b1 = b[:, 0], b[:, 1]
    exponent = (b1 << 1) | (b0 >> 7)
    sign_mantissa = (b1 & 0x80) | (b0 & 0x7F)
    return [exponent, sign_mantissa]


def _bf16_join(planes: list[np.ndarray], out: np.ndarray) -> None:
    e, sm = planes
    out[:, 0] = (sm & 0x7F) | (e << 7)
    out[:, 1] = (sm & 0x80) | (e >> 1)


def _f32_split(raw: bytes) -> list[np.ndarray]:
    b = _byte_planes(raw, 4)
    b2, b3 = b[:, 2], b[:, 3]
    exponent = (b3 << 1) | (b2 >> 7)
    top = (b3 & 0x80) | (b2 & 0x7F)  # sign + mantissa bits 22..16
    return [exponent, np.ascontiguousarray(b[:, 0]), np.ascontiguousarray(b[:, 1]), top]


def _f32_join(planes: list[np.ndarray], out: np.ndarray) -> None:
    e, r0, r1, r2 = planes
    out[:, 0] = r0
    out[:, 1] = r1
    out[:, 2] = (r2 & 0x7F) | (e << 7)
    out[:, 3] = (r2 & 0x80) | (e >> 1)


_SPLIT = {"bfloat16": (_bf16_split, _bf16_join), "float32": (_f32_split, _f32_join)}

FLOAT_DTYPES = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}
# A part of a chunk (a byte plane, or the whole chunk) is compressed only when a probe of its
# first PROBE_BYTES saves at least PROBE_GAIN of them (parts under 4 probes: always tried).
PROBE_BYTES = 64 << 10
PROBE_GAIN = 0.03
# The chunk-level estimate: SAMPLES pieces of SAMPLE_BYTES, evenly spaced, encoded together.
SAMPLES = 4
SAMPLE_BYTES = 64 << 10
_local = threading.local()


def _decompressor() -> zstandard.ZstdDecompressor:
    d = getattr(_local, "d", None)
    if d is None:
        d = _local.d = zstandard.ZstdDecompressor()
    return d


@dataclass(frozen=True)
class Codec:
    """``mode``: ``planes`` (default: byte planes for floats, zstd otherwise), ``zstd``, ``raw``;
    ``min_gain``: the share of a chunk's bytes compression must save, else it is stored raw."""

    mode: str = "planes"
    level: int = 1
    threads: int = 0
    min_gain: float = 0.25

    def __post_init__(self) -> None:
        if self.mode not in ("planes", "zstd", "raw"):
            raise ValueError(f"codec mode {self.mode!r}: use planes, zstd or raw")
        if not 0.0 <= self.min_gain < 1.0:
            raise ValueError(f"codec min_gain={self.min_gain!r}: use a share of the chunk in [0, 1)")

    def _compressor(self) -> zstandard.ZstdCompressor:
        key = (self.level, self.threads)
        cache = getattr(_local, "c", None)
        if cache is None:
            cache = _local.c = {}
        c = cache.get(key)
        if c is None:
            c = cache[key] = zstandard.ZstdCompressor(
                level=self.level, threads=self.threads, write_checksum=True)
        return c

    def encode(self, data: bytes | memoryview, dtype: str) -> tuple[bytes, str]:
        """(stored bytes, descriptor) for one chunk: raw where compressing it would save less
        than ``min_gain`` of its bytes."""
        raw = bytes(data)
        if self.mode == "raw" or not raw:
            return raw, "raw"
        if self.min_gain > 0 and self._sampled_gain(raw, dtype) < self.min_gain:
            return raw, "raw"
        blob, desc = self._encode(raw, dtype)
        if len(raw) - len(blob) < self.min_gain * len(raw):
            return raw, "raw"
        return blob, desc

    def _sampled_gain(self, raw: bytes, dtype: str) -> float:
        """The share of ``raw`` that compression would save, estimated from :data:`SAMPLES`
        evenly spaced samples (1.0, i.e. "try", for chunks too small to sample)."""
        n = len(raw)
        if n < 4 * SAMPLES * SAMPLE_BYTES:
            return 1.0
        unit = FLOAT_DTYPES.get(dtype, 1)
        size = SAMPLE_BYTES - SAMPLE_BYTES % unit
        stride = (n - size) // (SAMPLES - 1)
        stride -= stride % unit
        sample = b"".join(raw[i * stride:i * stride + size] for i in range(SAMPLES))
        blob, _ = self._encode(sample, dtype)
        return 1.0 - len(blob) / len(sample)

    def _encode(self, raw: bytes, dtype: str) -> tuple[bytes, str]:
        itemsize = FLOAT_DTYPES.get(dtype)
        if self.mode == "planes" and itemsize and len(raw) % itemsize == 0 and raw:
            if dtype in _SPLIT:
                planes = _SPLIT[dtype][0](raw)
                kind = f"xplanes:{dtype}"
            else:
                planes = list(np.frombuffer(raw, dtype=np.uint8).reshape(-1, itemsize).T)
                kind = f"planes:{itemsize}"
            parts, mask = [], []
            for p in planes:
                plane = p.tobytes()
                z = self._shrunk(plane)
                parts.append(plane if z is None else z)
                mask.append("r" if z is None else "z")
            header = struct.pack(f"<{len(parts)}Q", *(len(p) for p in parts))
            return header + b"".join(parts), f"{kind}:{''.join(mask)}"
        z = self._shrunk(raw)
        return (raw, "raw") if z is None else (z, "zstd")

    def _shrunk(self, data: bytes) -> bytes | None:
        """``data`` as a zstd frame, or None where compression does not pay: the frame would
        not be smaller, or a probe of its first ``PROBE_BYTES`` saved under ``PROBE_GAIN`` (the
        low mantissa planes of trained weights: noise, which the whole-plane attempt used to
        compress in vain, a third of a float32 chunk's encoding time)."""
        c = self._compressor()
        if len(data) >= 4 * PROBE_BYTES and len(c.compress(data[:PROBE_BYTES])) > (1 - PROBE_GAIN) * PROBE_BYTES:
            return None
        z = c.compress(data)
        return z if len(z) < len(data) else None


def decode(blob: bytes, descriptor: str, length: int, *, where: str = "chunk") -> bytes:
    """The original ``length`` bytes of a chunk; CorruptShardError on damaged input."""
    if descriptor == "raw":
        if len(blob) != length:
            raise CorruptShardError(f"{where}: decoded {len(blob)} bytes, expected {length}",
                                    step=-1, rank=-1, where=where)
        return blob
    out = bytearray(length)
    decode_into(blob, descriptor, memoryview(out), where=where)
    return bytes(out)


def decode_into(blob: bytes | memoryview, descriptor: str, out: memoryview, *,
                where: str = "chunk") -> None:
    """Decode a chunk straight into ``out`` (writable, exactly the chunk's length: e.g. its
    place in a shard file being rebuilt), with no intermediate copy of the whole chunk;
    CorruptShardError on damaged input (``out`` then holds garbage)."""
    length = len(out)
    try:
        if descriptor == "raw":
            if len(blob) != length:
                raise ValueError(f"decoded {len(blob)} bytes, expected {length}")
            out[:] = blob
        elif descriptor == "zstd":
            data = _decompressor().decompress(blob, max_output_size=length)
            if len(data) != length:
                raise ValueError(f"decoded {len(data)} bytes, expected {length}")
            out[:] = data
        elif descriptor.startswith(("planes:", "xplanes:")):
            kind, n_s, mask = descriptor.split(":")
            xsplit = _SPLIT.get(n_s) if kind == "xplanes" else None
            if kind == "xplanes" and xsplit is None:
                raise ValueError(f"bad descriptor {descriptor!r}")
            n = FLOAT_DTYPES[n_s] if xsplit else int(n_s)
            if n not in (2, 4, 8) or len(mask) != n or set(mask) - {"z", "r"} or length % n:
                raise ValueError(f"bad descriptor {descriptor!r}")
            sizes = struct.unpack_from(f"<{n}Q", blob)
            pos = 8 * n
            if pos + sum(sizes) != len(blob):
                raise ValueError("plane lengths do not add up")
            count = length // n
            planes = []
            for i in range(n):
                part = blob[pos:pos + sizes[i]]
                pos += sizes[i]
                plane = _decompressor().decompress(part, max_output_size=count) if mask[i] == "z" else part
                if len(plane) != count:
                    raise ValueError(f"plane {i} has {len(plane)} bytes, expected {count}")
                planes.append(np.frombuffer(plane, dtype=np.uint8))
            dest = np.frombuffer(out, dtype=np.uint8).reshape(count, n)
            if xsplit is not None:
                xsplit[1](planes, dest)
            else:
                for i, plane_arr in enumerate(planes):
                    dest[:, i] = plane_arr
        else:
            raise ValueError(f"unknown codec {descriptor!r}")
    except (ValueError, struct.error, zstandard.ZstdError) as e:
        raise CorruptShardError(f"{where}: cannot decode ({e})", step=-1, rank=-1, where=where) from e
