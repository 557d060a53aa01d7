from __future__ import annotations

import json

import pytest
import torch

from aegis.errors import IncompatibleSnapshotError, ManifestError
from aegis.snapshot.manifest import (
    FORMAT_VERSION,
    BytesEntry,
    ChunkRecord,
    ItemRecord,
    Manifest,
    ShardRecord,
    TensorEntry,
    body_checksum,
)

pytestmark = pytest.mark.quick  # unit / single-process: make test-quick


def sample() -> Manifest:
    shards = tuple(
        ShardRecord(
            rank=r,
            node="n0",
            size=256 + 24 + 100,
            index_crc32c=7,
            chunks=(ChunkRecord(0, 128, 11, "float32"), ChunkRecord(128, 128, 12, "bytes")),
            items=(
                ItemRecord("w", (r * 4, 0), 0, 64, "float32", (4, 4)),
                ItemRecord("lr", None, 128, 10),
            ),
        )
        for r in range(2)
    )
    return Manifest(
        job="j",
        step=5,
        world_size=2,
        shards=shards,
        entries={
            "w": TensorEntry("float32", (8, 4), (((0, 0), (4, 4)), ((4, 0), (4, 4)))),
            "lr": BytesEntry(),
        },
        planner_data={"w": ("w",), "lr": ("lr",)},
        timings={"blocking_s_max": 0.01},
        created=123.0,
    )


def test_round_trip_and_dcp_metadata() -> None:
    m = sample()
    back = Manifest.from_json(m.to_json())
    assert back == m
    md = back.to_dcp_metadata()
    assert md.state_dict_metadata["w"].size == torch.Size([8, 4])
    assert md.state_dict_metadata["w"].properties.dtype == torch.float32
    assert len(md.storage_data) == 3  # two tensor chunks + one byte item (same key on both ranks)
    assert back.entries_from_dcp(md) == dict(m.entries)


def doc() -> dict:
    return json.loads(sample().to_json())


def reseal(d: dict) -> dict:
    d["checksum"] = body_checksum(d)
    return d


def test_newer_format_version_is_rejected() -> None:
    d = doc()
    d["format_version"] = FORMAT_VERSION + 1
    with pytest.raises(IncompatibleSnapshotError, match="newer aegis"):
        Manifest.from_doc(reseal(d))


def test_a_flipped_format_version_is_damage_not_a_newer_format() -> None:
    d = doc()
    d["format_version"] = FORMAT_VERSION + 1
    with pytest.raises(ManifestError, match="fails its checksum") as e:
        Manifest.from_doc(d)
    assert not isinstance(e.value, IncompatibleSnapshotError)


def test_format_1_manifest_is_named_as_older() -> None:
    d = doc()
    d.pop("checksum")
    d.pop("state_kinds")
    d["format_version"] = 1
    with pytest.raises(IncompatibleSnapshotError, match="older aegis"):
        Manifest.from_doc(d)


def test_planner_data_must_spell_its_key() -> None:
    d = doc()
    d["planner_data"]["w"] = ["x"]
    with pytest.raises(ManifestError, match="does not spell its key"):
        Manifest.from_doc(reseal(d))


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d.update(extra=1), "unknown field"),
        (lambda d: d.pop("step"), "missing field"),
        (lambda d: d["shards"][0]["items"][0].update(file_offset=-8), "out of range"),
        (lambda d: d["shards"][0].update(size=1 << 60), "out of range"),
        (lambda d: d["shards"][0]["chunks"][1].__setitem__(0, 100), "gap or overlap"),
        (lambda d: d["shards"][0]["items"][1].update(length=10_000), "past the shard"),
        (lambda d: d["shards"][0]["items"].append(dict(d["shards"][0]["items"][0])), "twice"),
        (lambda d: d["shards"].pop(), "expected exactly"),
        (lambda d: d["entries"]["w"].update(dtype="__import__"), "unknown dtype"),
        (lambda d: d["shards"][0]["items"][0].update(fqn="ghost"), "no entry declares"),
    ],
)
def test_hostile_manifests_are_rejected(mutate, message) -> None:  # type: ignore[no-untyped-def]
    d = doc()
    mutate(d)
    with pytest.raises(ManifestError, match="fails its checksum"):
        Manifest.from_doc(d)
    with pytest.raises(ManifestError, match=message):
        Manifest.from_doc(reseal(d))


def test_not_json() -> None:
    with pytest.raises(ManifestError, match="not valid JSON"):
        Manifest.from_json(b"{oops", where="x/manifest.json")


# -- format 4: the node store's layout + step record (issue 24) ---------------------------------


def test_format4_split_and_assemble_round_trip() -> None:
    from aegis.snapshot.node_manifest import (
        Layout,
        StepManifest,
        assemble,
        load_node_manifest,
        split,
    )

    m = sample()
    layout, step = split(m)
    assert Layout.from_json(layout.to_json()) == layout
    back = load_node_manifest(step.to_json(), where="step")
    assert isinstance(back, StepManifest) and back == step
    whole = assemble(layout, step, {s.rank: s for s in m.shards})
    assert whole == m  # every field but the (unrecorded) replicas, and here there were none
    # a whole manifest reads as before
    assert load_node_manifest(m.to_json(), where="whole") == m
    # constant size: the step record does not grow with the ranks
    assert len(step.to_json()) < 500


def test_format4_rejects_a_shard_record_that_is_not_the_committed_one() -> None:
    import dataclasses

    from aegis.snapshot.node_manifest import assemble, assemble_any, split

    m = sample()
    layout, step = split(m)
    stale = dataclasses.replace(m.shards[1], index_crc32c=8)  # another step's index, say
    with pytest.raises(ManifestError, match="do not match step 5's manifest"):
        assemble(layout, step, {0: m.shards[0], 1: stale})
    with pytest.raises(ManifestError, match="no shard index for rank"):
        assemble(layout, step, {0: m.shards[0]})
    # two copies of rank 1 disagree: the digest picks the committed one
    got = assemble_any(layout, step, {0: [m.shards[0]], 1: [stale, stale, m.shards[1]]})
    assert got.shard(1).index_crc32c == 7
    other = dataclasses.replace(layout, world_size=3, nodes=("a", "b", "c"))
    with pytest.raises(ManifestError, match="not this step's"):
        assemble(other, step, {s.rank: s for s in m.shards})


def test_a_layout_read_again_is_checked_by_its_bytes_and_damage_is_still_found() -> None:
    import dataclasses

    from aegis.snapshot import node_manifest as mf

    layout, _ = mf.split(sample())
    text = layout.to_json().encode()
    first = mf.parse_layout(text, layout.digest, where="a")
    assert first == layout and first.digest == layout.digest == mf._sha(first.doc())[:16]
    # the same bytes under the same name: the layout checked before, not parsed again
    assert mf.parse_layout(bytes(text), layout.digest, where="b") is first
    # bytes written another way (indented) that parse to the same document: checked canonically
    pretty = json.dumps(json.loads(text), indent=1).encode()
    assert mf.parse_layout(pretty, layout.digest, where="p") == layout
    # the same bytes under another name, even with the layout cached: damaged
    with pytest.raises(ManifestError, match="does not hash to its name"):
        mf.parse_layout(text, "0" * 16, where="c")
    # other bytes: parsed and checked (an edited and resealed layout no longer hashes to its name)
    edited = dataclasses.replace(layout, job="other")
    with pytest.raises(ManifestError, match="does not hash to its name"):
        mf.parse_layout(edited.to_json().encode(), layout.digest, where="d")
    with pytest.raises(ManifestError):
        mf.parse_layout(text.replace(b'"job"', b'"jab"'), layout.digest, where="e")
    # bounded: one entry per plan, the oldest goes first
    for i in range(mf._LAYOUT_CACHE_SIZE + 2):
        other = dataclasses.replace(layout, job=f"j{i}")
        mf.parse_layout(other.to_json().encode(), other.digest)
    assert len(mf._layouts) == mf._LAYOUT_CACHE_SIZE
    assert mf.parse_layout(text, layout.digest) is not first  # evicted: parsed again


def test_a_layout_this_process_wrote_is_read_back_without_parsing_and_damage_is_still_found(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from aegis.snapshot import node_manifest as mf
    from aegis.snapshot.node_store import NodeStore

    layout, _ = mf.split(sample())
    store = NodeStore(tmp_path, layout.job)
    store.create()
    mf._layouts.clear()
    store.write_layout(layout)
    assert store.read_layout(layout.digest) is layout  # the object written: nothing parsed
    # a damaged first copy: its bytes are parsed and rejected, the second copy serves
    path = store.layout_path(layout.digest)
    path.write_bytes(path.read_bytes().replace(b'"world_size":2', b'"world_size":3'))
    notes: list[str] = []
    assert store.read_layout(layout.digest, notes) is layout
    assert notes and "damaged" in notes[0], notes


def test_format4_damage_and_version_rules() -> None:
    from aegis.snapshot.node_manifest import Layout, load_node_manifest, split

    layout, step = split(sample())
    text = step.to_json().replace('"total_bytes":', '"total_bytes":1')
    with pytest.raises(ManifestError, match="fails its checksum"):
        load_node_manifest(text, where="step")
    with pytest.raises(ManifestError, match="fails its checksum"):
        Layout.from_json(layout.to_json().replace('"world_size":2', '"world_size":3'))
    # a whole-manifest reader given a format-4 document says what it is
    with pytest.raises(ManifestError, match="format-4 step document"):
        Manifest.from_json(step.to_json())


# -- the fast paths (issue 25: a restore reads every step's manifest on every node) -------------


def test_text_checksum_is_checked_on_the_bytes_and_other_forms_the_usual_way() -> None:
    from aegis.snapshot.manifest import text_checksum_ok
    from aegis.snapshot.node_manifest import load_node_manifest

    m = sample()
    text = m.to_json()
    assert text == json.dumps(json.loads(text), separators=(",", ":"), sort_keys=True)  # canonical
    assert text_checksum_ok(text) and text_checksum_ok(text.encode())
    assert load_node_manifest(text, where="x") == m
    # another writer's whitespace: not the written form, checked on the parsed document
    pretty = json.dumps(json.loads(text), indent=2, sort_keys=True)
    assert not text_checksum_ok(pretty)
    assert Manifest.from_json(pretty) == m
    # a byte changed after the checksum: neither way accepts it
    flipped = text.replace('"job":"j"', '"job":"k"')
    assert not text_checksum_ok(flipped)
    with pytest.raises(ManifestError, match="fails its checksum"):
        load_node_manifest(flipped, where="x")


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda it: it.update(length=65), "length does not match"),
        (lambda it: it.update(shape=[4, True]), "must be an integer"),
        (lambda it: it.update(offset=[-4, 0]), "out of range"),
        (lambda it: it.update(dtype="float64"), "length does not match"),
        (lambda it: it.update(dtype="__import__"), "unknown dtype"),
        (lambda it: it.update(fqn=7), "must be a string"),
        (lambda it: it.update(extra=1), "unknown field"),
        (lambda it: it.update(file_offset=1.0), "must be an integer"),
    ],
)
def test_a_bad_item_is_named_after_well_formed_ones_took_the_quick_path(mutate, message) -> None:  # type: ignore[no-untyped-def]
    from aegis.snapshot.manifest import dumps_with_checksum

    Manifest.from_json(sample().to_json())  # the item checks have seen float32 items
    d = doc()
    d.pop("checksum")
    mutate(d["shards"][1]["items"][0])
    with pytest.raises(ManifestError, match=message):
        Manifest.from_json(dumps_with_checksum(d))  # sealed as a writer would: the checks find it


def test_an_encoded_manifest_is_written_byte_for_byte(store_dir) -> None:  # type: ignore[no-untyped-def]
    from aegis.snapshot.manifest import EncodedManifest
    from aegis.snapshot.node_store import NodeStore

    m = sample()
    a, b = NodeStore(store_dir / "a", "j"), NodeStore(store_dir / "b", "j")
    a.write_manifest(m)
    b.write_manifest(EncodedManifest.of(m))
    assert a.manifest_path(5).read_bytes() == b.manifest_path(5).read_bytes()
    assert b.read_manifest(5) == m
