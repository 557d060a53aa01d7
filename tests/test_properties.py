"""Property-based tests: the codec round-trips any bytes, and the manifest parser either accepts a
document or rejects it with a ManifestError — never another exception, never a crash."""

from __future__ import annotations

import contextlib
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aegis.errors import CorruptShardError, ManifestError
from aegis.snapshot.codec import FLOAT_DTYPES, Codec, decode
from aegis.snapshot.manifest import Manifest
from tests.test_manifest import sample

DTYPES = ["bytes", "int64", *FLOAT_DTYPES]


@pytest.mark.quick
@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=4096), dtype=st.sampled_from(DTYPES),
       mode=st.sampled_from(["planes", "zstd", "raw"]))
def test_codec_round_trips_any_bytes(data: bytes, dtype: str, mode: str) -> None:
    blob, desc = Codec(mode=mode).encode(data, dtype)
    assert decode(blob, desc, len(data)) == data


@pytest.mark.quick
@settings(max_examples=200, deadline=None)
@given(data=st.binary(min_size=64, max_size=2048), flips=st.lists(st.integers(0, 10**6), min_size=1, max_size=4))
def test_codec_corrupt_input_is_a_clear_error_or_detected_later(data: bytes, flips: list[int]) -> None:
    blob, desc = Codec().encode(data, "bfloat16" if len(data) % 2 == 0 else "bytes")
    bad = bytearray(blob)
    for f in flips:
        bad[f % len(bad)] ^= 0x5A
    try:
        out = decode(bytes(bad), desc, len(data))
    except CorruptShardError:
        return
    # a raw plane cannot detect a flip itself; the chunk's crc32c does (checked by callers)
    assert len(out) == len(data)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**62), 2**62) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(doc=JSON)
def test_manifest_parser_rejects_arbitrary_json_cleanly(doc: object) -> None:
    with contextlib.suppress(ManifestError):
        Manifest.from_doc(doc)


@pytest.mark.quick
@settings(max_examples=300, deadline=None)
@given(path=st.lists(st.sampled_from(["shards", 0, 1, "chunks", "items", 0, "entries", "w", "size",
                                      "offset", "file_offset", "length", "rank", "step"]), min_size=1, max_size=5),
       value=JSON)
def test_manifest_parser_with_one_field_mutated(path: list, value: object) -> None:
    doc = json.loads(sample().to_json())
    node = doc
    for key in path[:-1]:
        try:
            node = node[key]
        except (KeyError, IndexError, TypeError):
            return
    try:
        node[path[-1]] = value
    except (IndexError, TypeError):
        return
    try:
        m = Manifest.from_doc(doc)
    except ManifestError:
        return
    assert Manifest.from_json(m.to_json()) == m  # whatever is accepted round-trips
