"""Hostile and malformed inputs (issue 8, part 3): unit tests, no cluster.

Every reader of bytes that aegis did not just produce itself (manifest JSON, shard index and
footer, node-store directory names, durable manifests and chunk objects, object keys, pickled
non-tensor items) must reject hostile input with the library's own error and a message that says
what is wrong, before any byte of a shard is trusted. Groups:

* manifest JSON: duplicate keys, unknown/missing fields, absurd sizes, negative offsets,
  inconsistent entries and items, pathological nesting;
* shard tail: index and footer of a shard file or of a received replica;
* node store: job and directory names, another job's manifest or shard, sizes beyond the file,
  private permissions under any umask;
* durable tier: object keys, listings, another job's manifest, hostile chunk objects;
* non-tensor state: a malicious pickle is refused without running;
* credentials: never in a store's description, its errors, or the events.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import stat
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from aegis.errors import AegisError, ConfigError, CorruptShardError, ManifestError
from aegis.snapshot.durable import chunk_key, fetch_chunks, list_steps, manifest_key, read_manifest
from aegis.snapshot.manifest import (
    BytesEntry,
    ChunkRecord,
    ItemRecord,
    Manifest,
    ShardRecord,
    body_checksum,
    chunk_to_row,
    item_to_doc,
)
from aegis.snapshot.node_store import NodeStore, Slot
from aegis.snapshot.objstore import FileStore, ObjectStore, check_key, open_store
from aegis.snapshot.shard import FOOTER_SIZE, check_blob, crc32c
from tests.test_manifest import sample

pytestmark = pytest.mark.quick  # unit / single-process: make test-quick

Doc = dict[str, Any]


def good_doc() -> Doc:
    return json.loads(sample().to_json())


def parse(doc_or_text: Doc | str) -> Manifest:
    """Parse a manifest edited *and resealed* (its checksum recomputed, as a forger would): the
    checks past the checksum must hold on their own. ``test_any_edit_without_reseal_...`` covers
    edits that leave the checksum as it was."""
    if isinstance(doc_or_text, str):
        text = doc_or_text
    else:
        if "checksum" in doc_or_text:
            doc_or_text["checksum"] = body_checksum(doc_or_text)
        text = json.dumps(doc_or_text)
    return Manifest.from_json(text, where="hostile/manifest.json")


def test_the_unmodified_sample_parses() -> None:  # every case below is one change away from this
    assert parse(good_doc()) == sample()


# -- manifest JSON -------------------------------------------------------------------------------


def _dup(text: str, old: str, new: str) -> str:
    assert old in text, old
    return text.replace(old, new, 1)


DUPLICATE_KEYS: list[tuple[str, Callable[[str], str]]] = [
    # json.loads keeps the last of two equal keys: the first one would be silently ignored
    ("top-level step twice", lambda t: _dup(t, '"step":5', '"step":5,"step":6')),
    ("top-level job twice", lambda t: _dup(t, '"job":"j"', '"job":"other","job":"j"')),
    ("entry name twice", lambda t: _dup(t, '"entries":{', '"entries":{"w":{"kind":"bytes"},')),
    ("shard field twice", lambda t: _dup(t, '"node":"n0"', '"node":"n0","node":"n1"')),
    ("item field twice", lambda t: _dup(t, '"file_offset":0', '"file_offset":0,"file_offset":0')),
]


@pytest.mark.parametrize("mutate", [m for _, m in DUPLICATE_KEYS], ids=[n for n, _ in DUPLICATE_KEYS])
def test_manifest_with_duplicate_json_keys_is_rejected(mutate: Callable[[str], str]) -> None:
    with pytest.raises(ManifestError, match="duplicate key"):
        parse(mutate(sample().to_json()))


def _set(path: list[Any], value: Any) -> Callable[[Doc], None]:
    def mutate(d: Doc) -> None:
        node: Any = d
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = value

    return mutate


def _pop(path: list[Any]) -> Callable[[Doc], None]:
    def mutate(d: Doc) -> None:
        node: Any = d
        for k in path[:-1]:
            node = node[k]
        node.pop(path[-1])

    return mutate


S0 = ["shards", 0]
ITEM_W = [*S0, "items", 0]  # the float32 tensor item "w" of rank 0
ITEM_LR = [*S0, "items", 1]  # the bytes item "lr" of rank 0
CHUNK0 = [*S0, "chunks", 0]

HOSTILE_FIELDS: list[tuple[str, Callable[[Doc], object], str]] = [
    # unknown fields, at every level
    ("unknown top-level field", _set(["extra"], 1), "unknown field"),
    ("unknown shard field", _set([*S0, "extra"], 1), "unknown field"),
    ("unknown item field", _set([*ITEM_W, "extra"], 1), "unknown field"),
    ("unknown entry field", _set(["entries", "w", "extra"], 1), "unknown field"),
    ("unknown entry kind", _set(["entries", "lr", "kind"], "pickle"), "unknown kind"),
    ("shape without dtype", _set([*ITEM_LR, "shape"], [10]), "shape without a dtype"),
    # missing fields
    ("missing format_version", _pop(["format_version"]), "missing field"),
    ("missing job", _pop(["job"]), "missing field"),
    ("missing step", _pop(["step"]), "missing field"),
    ("missing shard size", _pop([*S0, "size"]), "missing field"),
    ("missing item length", _pop([*ITEM_W, "length"]), "missing field"),
    ("missing entry chunks", _pop(["entries", "w", "chunks"]), "missing field"),
    ("tensor item without shape", _pop([*ITEM_W, "shape"]), "missing field"),
    # wrong types
    ("step is a string", _set(["step"], "5"), "must be an integer"),
    ("step is a bool", _set(["step"], True), "must be an integer"),
    ("size is a float", _set([*S0, "size"], 380.0), "must be an integer"),
    ("requires_grad is a string", _set(["entries", "w", "requires_grad"], "yes"), "must be a boolean"),
    ("created is infinite", _set(["created"], float("inf")), "finite number"),
    ("chunk row too short", _set(CHUNK0, [0, 128, 11]), "must be"),
    # absurd sizes
    ("chunk length 2**62", _set([*CHUNK0, 1], 2**62), "out of range"),
    ("shard size 2**62", _set([*S0, "size"], 2**62), "out of range"),
    ("world_size 10**9", _set(["world_size"], 10**9), "world_size"),
    ("world_size 0", _set(["world_size"], 0), "out of range"),
    ("negative tensor dim", _set(["entries", "w", "size"], [-8, 4]), "out of range"),
    ("negative item shape", _set([*ITEM_W, "shape"], [-4, -4]), "out of range"),
    ("crc32c over 32 bits", _set([*CHUNK0, 2], 2**40), "out of range"),
    ("chunks beyond the shard size", _set([*S0, "size"], 200), "past the shard size"),
    ("item beyond the data", _set([*ITEM_LR, "length"], 10_000), "past the shard"),
    # negative offsets
    ("negative step", _set(["step"], -1), "out of range"),
    ("negative rank", _set([*S0, "rank"], -1), "out of range"),
    ("negative chunk offset", _set([*CHUNK0, 0], -64), "out of range"),
    ("negative item file_offset", _set([*ITEM_W, "file_offset"], -8), "out of range"),
    ("negative tensor chunk offset", _set(["entries", "w", "chunks", 0, 0], [-4, 0]), "out of range"),
    # layout and consistency
    ("overlapping chunks", _set([*S0, "chunks", 1, 0], 100), "gap or overlap"),
    ("two shards for one rank", _set([*S0, "rank"], 1), "expected exactly"),
    ("a shard missing", lambda d: d["shards"].pop(), "expected exactly"),
    ("item stored twice in a shard", lambda d: d["shards"][0]["items"].append(d["shards"][0]["items"][0]),
     "twice"),
    ("item no entry declares", _set([*ITEM_W, "fqn"], "ghost"), "no entry declares"),
    ("dtype naming a torch attribute", _set(["entries", "w", "dtype"], "__import__"), "unknown dtype"),
    ("item dtype differs from its entry", _set([*ITEM_W, "dtype"], "int32"), "has dtype int32, its entry"),
    ("item shape differs from its chunk", _set([*ITEM_W, "shape"], [2, 8]), r"has shape \(2, 8\), its chunk"),
    ("item at an offset no chunk of its entry has", _set([*ITEM_W, "offset"], [2, 0]), "no chunk of"),
    ("entry chunk that no shard stores", lambda d: (
        d["entries"]["w"]["chunks"].__setitem__(1, [[4, 0], [4, 4]]),
        d["shards"][1]["items"].pop(0)), "no shard stores"),
    ("bytes entry that no shard stores", lambda d: (
        d["shards"][0]["items"].pop(1), d["shards"][1]["items"].pop(1)), "no shard stores"),
    ("bytes item with a tensor offset", _set([*ITEM_LR, "offset"], [0]), "byte item with a tensor offset"),
]


@pytest.mark.parametrize(("mutate", "message"), [(m, msg) for _, m, msg in HOSTILE_FIELDS],
                         ids=[n for n, _, _ in HOSTILE_FIELDS])
def test_manifest_with_hostile_field_is_rejected(mutate: Callable[[Doc], object], message: str) -> None:
    d = good_doc()
    mutate(d)
    with pytest.raises(ManifestError, match=message) as e:
        parse(d)
    assert "hostile/manifest.json" in str(e.value)  # the message names the file


@pytest.mark.parametrize(("mutate", "message"), [(m, msg) for _, m, msg in HOSTILE_FIELDS],
                         ids=[n for n, _, _ in HOSTILE_FIELDS])
def test_any_edit_without_reseal_fails_the_checksum(mutate: Callable[[Doc], object], message: str) -> None:
    d = good_doc()
    mutate(d)
    with pytest.raises(ManifestError, match="fails its checksum|no checksum") as e:
        Manifest.from_json(json.dumps(d), where="hostile/manifest.json")
    assert "hostile/manifest.json" in str(e.value)


def test_manifest_nested_too_deep_is_rejected() -> None:
    # the JSON decoder recurses: 100k nested lists would raise RecursionError, not ManifestError
    d = sample().to_json()
    text = _dup(d, '"mesh":{}', '"mesh":{"x":' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(ManifestError, match="nested too deep"):
        parse(text)


@pytest.mark.parametrize("text", [b"\xff\xfe\x00garbage", b"", b"{oops", b"[1, 2]", b"null",
                                  b'{"format_version": 1' + b"0" * 5000 + b"}"],
                         ids=["binary", "empty", "broken", "a list", "null", "5000-digit integer"])
def test_manifest_that_is_not_a_json_object_is_rejected(text: bytes) -> None:
    with pytest.raises(ManifestError):
        Manifest.from_json(text, where="hostile/manifest.json")


HOSTILE_NAMES = ["../../etc/passwd", "/abs/path", "a\x00b", "a\\..\\b", "..", "a/../../b"]


@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_entry_and_node_names_never_become_paths_or_keys(name: str, tmp_path: Path) -> None:
    """Entry names (state-dict FQNs) and node names are data: a hostile one parses (it is just a
    dict key), but every path and object key built for the manifest stays inside its prefix."""
    d = good_doc()
    d["entries"][name] = d["entries"].pop("lr")
    d["planner_data"][name] = [name]
    d["planner_data"].pop("lr")
    for s in d["shards"]:
        s["items"][1]["fqn"] = name
        s["node"] = name
        s["replicas"] = [name]
    m = parse(d)
    ns = NodeStore(tmp_path, "j")
    paths = [ns.step_dir(m.step), ns.manifest_path(m.step)] + [
        p for s in m.shards for p in (ns.shard_path(m.step, s.rank), ns.partial_path(m.step, s.rank))]
    for p in paths:
        assert p.resolve().is_relative_to(ns.dir.resolve()), p
        assert name not in str(p)
    keys = [manifest_key(m.job, m.step)] + [
        chunk_key(m.job, m.step, s.rank, i) for s in m.shards for i in range(len(s.chunks))]
    for k in keys:
        assert check_key(k) == k and k.startswith("j/step-") and name not in k


# -- shard tail: index + footer -----------------------------------------------------------------

_DATA = bytes(range(64)) + b"0123456789" + bytes(54)  # "w": 4x4 float32, then "lr": 10 bytes


def index_doc(*, job: str = "j", step: int = 3, rank: int = 1) -> Doc:
    chunks = [ChunkRecord(0, 64, crc32c(_DATA[:64]), "float32"), ChunkRecord(64, 64, crc32c(_DATA[64:]))]
    items = [ItemRecord("w", (0, 0), 0, 64, "float32", (4, 4)), ItemRecord("lr", None, 64, 10)]
    return {"format_version": 1, "job": job, "step": step, "rank": rank,
            "chunks": [chunk_to_row(c) for c in chunks], "items": [item_to_doc(i) for i in items]}


def blob_with(body: bytes, *, data: bytes = _DATA, length: int | None = None) -> bytes:
    """A shard: data, then ``body`` as its index, then a footer with the index's crc32c."""
    n = len(body) if length is None else length
    return data + body + struct.pack("<8sQI4x", b"AEGSHRD1", n, crc32c(body))


def blob(doc: Doc) -> bytes:
    return blob_with(json.dumps(doc, separators=(",", ":")).encode())


def test_the_unmodified_shard_tail_parses() -> None:
    index, _ = check_blob(blob(index_doc()), step=3, rank=1, where="replica")
    assert index.data_end == len(_DATA) and len(index.items) == 2


def _index_mut(mutate: Callable[[Doc], object]) -> bytes:
    d = index_doc()
    mutate(d)
    return blob(d)


HOSTILE_TAILS: list[tuple[str, Callable[[], bytes], str]] = [
    ("empty", lambda: b"", "truncated"),
    ("shorter than a footer", lambda: b"AEGSHRD1" * 2, "truncated"),
    ("bad magic", lambda: blob(index_doc())[:-FOOTER_SIZE] + b"X" * FOOTER_SIZE, "bad magic"),
    ("index length beyond the file", lambda: blob_with(b"{}", length=2**63), "exceeds the shard size"),
    ("index crc32c mismatch", lambda: blob(index_doc())[:-FOOTER_SIZE - 3] + b"}}}" + blob(index_doc())[-FOOTER_SIZE:],
     "crc32c"),
    ("index is not JSON", lambda: blob_with(b"\x80\x81not json"), "not valid JSON"),
    ("index is a list", lambda: blob_with(b"[]"), "must be an object"),
    ("index nested too deep", lambda: blob_with(b"[" * 100_000 + b"]" * 100_000), "nested too deep"),
    ("duplicate key in the index", lambda: blob_with(
        json.dumps(index_doc(), separators=(",", ":")).replace('"rank":1', '"rank":0,"rank":1').encode()),
     "duplicate key"),
    ("unknown index field", lambda: _index_mut(_set(["extra"], 1)), "unknown field"),
    ("missing index field", lambda: _index_mut(_pop(["job"])), "missing field"),
    ("newer format", lambda: _index_mut(_set(["format_version"], 99)), "newer aegis"),
    ("format version 0", lambda: _index_mut(_set(["format_version"], 0)), "format_version"),
    ("negative chunk offset", lambda: _index_mut(_set(["chunks", 0, 0], -64)), "out of range"),
    ("chunk past the end of the file", lambda: _index_mut(_set(["chunks", 1, 1], 2**40)), "past the shard"),
    ("chunk running into the index and footer", lambda: _index_mut(_set(["chunks", 1, 1], 64 + 40)),
     "overlaps the shard index"),
    ("item past the data", lambda: _index_mut(_set(["items", 1, "length"], 100)), "past the shard's data"),
    ("negative item offset", lambda: _index_mut(_set(["items", 0, "file_offset"], -1)), "out of range"),
    ("another step's shard", lambda: blob(index_doc(step=4)), "expected the shard of rank 1 at step 3"),
    ("another rank's shard", lambda: blob(index_doc(rank=0)), "expected the shard of rank 1 at step 3"),
]


@pytest.mark.parametrize(("make", "message"), [(m, msg) for _, m, msg in HOSTILE_TAILS],
                         ids=[n for n, _, _ in HOSTILE_TAILS])
def test_shard_with_hostile_tail_is_rejected(make: Callable[[], bytes], message: str) -> None:
    with pytest.raises(CorruptShardError, match=message) as e:
        check_blob(make(), step=3, rank=1, where="replica from node n1")
    assert (e.value.step, e.value.rank) == (3, 1)


# -- node store ----------------------------------------------------------------------------------


@pytest.mark.parametrize("job", ["", ".", "..", "../x", "/abs", "a/b", "a\\b", "a\x00b", "job\n", "jöb",
                                 "-lead", "x" * 129, "a..b"])
def test_hostile_job_names_are_rejected(job: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not a valid job name"):
        NodeStore(tmp_path, job)


def foreign_manifest(job: str = "other", step: int = 5) -> bytes:
    d = good_doc()
    d["job"], d["step"] = job, step
    d["checksum"] = body_checksum(d)  # an intact manifest, of another job
    return json.dumps(d).encode()


def test_node_store_refuses_another_jobs_manifest_under_its_directory(store_dir: Path) -> None:
    ns = NodeStore(store_dir, "j")
    ns.create()
    ns.manifest_path(5).parent.mkdir(parents=True)
    ns.manifest_path(5).write_bytes(foreign_manifest())
    with pytest.raises(ManifestError, match="belongs to job 'other', not 'j'"):
        ns.read_manifest(5)


def test_node_store_refuses_a_manifest_in_another_steps_directory(store_dir: Path) -> None:
    ns = NodeStore(store_dir, "j")
    ns.manifest_path(4).parent.mkdir(parents=True)
    ns.manifest_path(4).write_bytes(foreign_manifest(job="j", step=5))
    with pytest.raises(ManifestError, match="says step 5"):
        ns.read_manifest(4)


@pytest.mark.parametrize(("doc", "message"), [
    (index_doc(job="other", step=3, rank=1), "belongs to job 'other'"),
    (index_doc(job="j", step=4, rank=1), "step 4"),
    (index_doc(job="j", step=3, rank=0), "rank 0"),
], ids=["another job", "another step", "another rank"])
def test_node_store_refuses_a_foreign_shard_file(store_dir: Path, doc: Doc, message: str) -> None:
    ns = NodeStore(store_dir, "j")
    path = ns.shard_path(3, 1)
    path.parent.mkdir(parents=True)
    path.write_bytes(blob(doc))
    with pytest.raises(ManifestError, match=message):
        ns.read_shard_index(3, 1)


def test_node_store_shard_smaller_than_its_record_is_rejected(store_dir: Path) -> None:
    ns = NodeStore(store_dir, "j")
    data = blob(index_doc())
    path = ns.shard_path(3, 1)
    path.parent.mkdir(parents=True)
    path.write_bytes(data)
    index, size, icrc = ns.read_shard_index(3, 1)
    record = ShardRecord(1, "n0", size + 4096, icrc, index.chunks, index.items)
    with pytest.raises(CorruptShardError, match=f"has {size} bytes, the manifest says {size + 4096}"):
        ns.verify_shard(3, record)


@pytest.mark.parametrize("name", ["step-00000007\n", "step-0000000\u0667", "step-\u0660\u0660\u0660\u0660\u0660\u0660\u0660\u0667",
                                  "step-000000007", "step-0000007", "step-00000007.tmp"],
                         ids=["trailing newline", "arabic-indic digit", "all arabic-indic", "9 digits",
                              "7 digits", "suffix"])
def test_node_store_ignores_step_directories_it_did_not_name(store_dir: Path, name: str) -> None:
    ns = NodeStore(store_dir, "j")
    ns.create()
    (ns.dir / name).mkdir()
    (ns.dir / name / "manifest.json").write_bytes(foreign_manifest(job="j", step=7))
    assert ns.steps() == []


@pytest.mark.parametrize("name", ["rank-00001.shard\n", "rank-0000\u0661.shard", "rank-00001.shard.tmp"],
                         ids=["trailing newline", "arabic-indic digit", "suffix"])
def test_node_store_ignores_shard_files_it_did_not_name(store_dir: Path, name: str) -> None:
    ns = NodeStore(store_dir, "j")
    ns.step_dir(3).mkdir(parents=True)
    (ns.step_dir(3) / name).write_bytes(blob(index_doc()))
    [info] = ns.steps()
    assert info.shard_ranks == ()


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


@pytest.fixture
def umask0() -> Iterator[None]:
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


def test_node_store_is_private_even_with_umask_0(store_dir: Path, umask0: None) -> None:
    ns = NodeStore(store_dir / "a" / "root", "j")
    ns.create()
    m = sample()
    ns.write_manifest(m)
    slot = Slot(ns.slot_path(0, 0))
    slot.ensure(128)
    slot.move(ns.shard_path(m.step, 0))
    slot.close()
    part = Slot(ns.partial_path(m.step, 1))
    part.close()
    for d in (ns.root, ns.dir, ns.slots_dir, ns.step_dir(m.step)):
        assert _mode(d) == 0o700, d
    for f in (ns.manifest_path(m.step), ns.shard_path(m.step, 0), ns.partial_path(m.step, 1)):
        assert _mode(f) == 0o600, f


def test_node_store_tightens_its_own_job_directory(store_dir: Path, umask0: None) -> None:
    ns = NodeStore(store_dir, "j")
    ns.dir.mkdir(mode=0o777)
    ns.create()
    assert _mode(ns.dir) == 0o700


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another user needs root")
def test_node_store_refuses_a_job_directory_owned_by_another_user(store_dir: Path) -> None:
    ns = NodeStore(store_dir, "j")
    ns.dir.mkdir(mode=0o777)
    os.chown(ns.dir, 65534, 65534)  # nobody
    with pytest.raises(ConfigError, match="belongs to another user"):
        ns.create()


def test_file_store_is_private_even_with_umask_0(tmp_path: Path, umask0: None) -> None:
    store = FileStore(tmp_path / "durable" / "root")
    store.check()
    store.put(chunk_key("j", 1, 0, 0), b"x")
    store.put(manifest_key("j", 1), b"{}", if_absent=True)
    root = tmp_path / "durable" / "root"
    for d in (root, root / "j", root / "j/step-00000001", root / "j/step-00000001/rank-00000"):
        assert _mode(d) == 0o700, d
    for f in (root / chunk_key("j", 1, 0, 0), root / manifest_key("j", 1)):
        assert _mode(f) == 0o600, f


# -- durable tier --------------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["", "/abs", "../escape", "a/../b", "a/./b", "a//b", "a/", "a\\b",
                                 "..\\..\\x", "C:\\x", "a\x00b", "a/b\n", "\na", "é", "a b"])
def test_hostile_object_keys_are_rejected(key: str, tmp_path: Path) -> None:
    with pytest.raises(AegisError, match="invalid object key"):
        check_key(key)
    store = FileStore(tmp_path)
    with pytest.raises(AegisError, match="invalid object key"):
        store.put(key, b"x")
    assert list(store.list()) == []


@pytest.mark.parametrize("step_dir", ["step-0000000\u0665", "step-\u0660\u0660\u0660\u0660\u0660\u0660\u0660\u0665",
                                      "step-000000005", "step-5"])
def test_durable_listing_ignores_step_names_it_did_not_write(tmp_path: Path, step_dir: str) -> None:
    (tmp_path / "j" / step_dir).mkdir(parents=True)
    (tmp_path / "j" / step_dir / "manifest.json").write_bytes(foreign_manifest(job="j"))
    (tmp_path / "j" / step_dir / "chunk").write_bytes(b"x")
    assert list_steps(FileStore(tmp_path), "j") == ([], [])


def _foreign_under_this_prefix(store: ObjectStore) -> None:
    store.put(manifest_key("j", 5), foreign_manifest(job="other"))
    with pytest.raises(ManifestError, match="belongs to job 'other', not 'j'"):
        read_manifest(store, "j", 5)


def test_durable_file_store_refuses_another_jobs_manifest(tmp_path: Path) -> None:
    _foreign_under_this_prefix(FileStore(tmp_path))


def test_durable_s3_store_refuses_another_jobs_manifest(s3_bucket: str) -> None:
    store = open_store(f"s3://{s3_bucket}/prefix")
    try:
        _foreign_under_this_prefix(store)
    finally:
        store.close()


def test_durable_manifest_in_another_steps_key_is_rejected(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    store.put(manifest_key("j", 4), foreign_manifest(job="j", step=5))
    with pytest.raises(ManifestError, match="says step 5"):
        read_manifest(store, "j", 4)


def test_durable_manifest_without_stored_sizes_is_rejected(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    store.put(manifest_key("j", 5), sample().to_json().encode())  # a memory manifest: no stored sizes
    with pytest.raises(ManifestError, match="no stored size"):
        read_manifest(store, "j", 5)


def test_durable_read_with_a_hostile_job_name_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(AegisError, match="invalid object key"):
        read_manifest(FileStore(tmp_path), "../j", 5)


def _zstd_frame_claiming(content_size: int, payload: bytes) -> bytes:
    """A zstd frame whose header declares ``content_size`` decoded bytes (one raw block)."""
    header = struct.pack("<IBQ", 0xFD2FB528, (3 << 6) | (1 << 5), content_size)
    return header + (1 | (len(payload) << 3)).to_bytes(3, "little") + payload


_BIG_PLANE = _zstd_frame_claiming(1 << 40, bytes(32))


def durable_with_chunk(tmp_path: Path, stored: bytes, codec: str, raw: bytes) -> tuple[FileStore, Manifest]:
    """A durable step of job "j" whose one shard holds one chunk stored as ``stored``."""
    store = FileStore(tmp_path)
    n = len(raw)
    m = Manifest(
        job="j", step=5, world_size=1,
        shards=(ShardRecord(0, "n0", n + 200, 0, (ChunkRecord(0, n, crc32c(raw), "bytes", codec, len(stored),
                                                              crc32c(stored)),),
                            (ItemRecord("x", None, 0, n),)),),
        entries={"x": BytesEntry()},
    )
    store.put(manifest_key("j", 5), m.to_json().encode())
    store.put(chunk_key("j", 5, 0, 0), stored)
    return store, read_manifest(store, "j", 5)


@pytest.mark.parametrize(("codec", "stored"), [
    ("zstd", _zstd_frame_claiming(1 << 40, bytes(64))),  # 1 TiB declared: decoding would allocate it
    ("planes:2:zz", struct.pack("<QQ", len(_BIG_PLANE), len(_BIG_PLANE)) + _BIG_PLANE * 2),
    ("planes:2:zz", struct.pack("<QQ", 2**62, 2**62)),
    ("planes:9:zzzzzzzzz", bytes(64)),
    ("xplanes:__import__:zz", bytes(64)),
    ("pickle", bytes(64)),
], ids=["zstd frame declaring 1 TiB", "plane declaring 1 TiB", "plane lengths 2**62", "9 planes",
        "xplanes of a non-dtype", "unknown codec"])
def test_hostile_durable_chunk_object_is_rejected(tmp_path: Path, codec: str, stored: bytes) -> None:
    raw = bytes(64)
    store, m = durable_with_chunk(tmp_path, stored, codec, raw)
    out = bytearray(m.shard(0).size)
    with pytest.raises(CorruptShardError, match="cannot decode") as e:
        fetch_chunks(store, "j", m, 0, [0], memoryview(out), threads=1)
    assert chunk_key("j", 5, 0, 0) in str(e.value)
    assert out == bytearray(len(out))  # nothing was written


def test_durable_chunk_object_replaced_is_rejected_before_decoding(tmp_path: Path) -> None:
    raw = bytes(64)
    store, m = durable_with_chunk(tmp_path, raw, "raw", raw)
    store.put(chunk_key("j", 5, 0, 0), _zstd_frame_claiming(1 << 40, raw))
    out = bytearray(m.shard(0).size)
    with pytest.raises(CorruptShardError, match="truncated or corrupt"):
        fetch_chunks(store, "j", m, 0, [0], memoryview(out), threads=1)


# -- non-tensor state ----------------------------------------------------------------------------


class _Payload:
    """Pickles as ``os.system("touch <path>")``: loading it with plain pickle runs the command."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {shlex.quote(str(self.path))}",))


def test_the_pickle_payload_is_live(tmp_path: Path) -> None:
    """Control: the payload does run under an unsafe load, so the next test proves something."""
    import io

    buf = io.BytesIO()
    torch.save({"extra": _Payload(tmp_path / "pwned")}, buf)
    buf.seek(0)
    torch.load(buf, weights_only=False)
    assert (tmp_path / "pwned").exists()


@pytest.mark.parametrize("force_unsafe_env", [False, True], ids=["default", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1"])
def test_malicious_pickle_in_a_snapshot_is_refused_without_running(
        store_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, force_unsafe_env: bool) -> None:
    import torch.distributed.checkpoint as dcp

    from aegis.snapshot.dcp_io import SafeLoadPlanner, ShardReader, ShardWriter

    if force_unsafe_env:  # an environment that makes torch.load unsafe by default changes nothing
        monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    marker = tmp_path / "pwned"
    ns = NodeStore(store_dir, "j")
    dcp.save({"w": torch.arange(16.0), "extra": _Payload(marker)}, storage_writer=ShardWriter(ns, 1))
    assert not marker.exists()  # saving only pickled it
    m = ns.read_manifest(1)
    for s in m.shards:
        ns.verify_shard(1, s)  # the bytes are intact: what protects the load is weights_only
    target: dict[str, Any] = {"w": torch.zeros(16), "extra": None}
    reader = ShardReader(m, {s.rank: ns.shard_path(1, s.rank) for s in m.shards})
    with pytest.raises(BaseException) as e:  # noqa: PT011 - DCP wraps it; the cause is checked below
        dcp.load(target, storage_reader=reader, planner=SafeLoadPlanner())
    assert not marker.exists(), "the snapshot executed code"
    causes = [exc for exc, _ in getattr(e.value, "failures", {}).values()] or [e.value]
    assert any(isinstance(c, AegisError) and "'extra'" in str(c) and "weights_only" in str(c)
               and "nothing in it was executed" in str(c) for c in causes), causes
    assert target["extra"] is None


def test_safe_load_planner_refuses_a_bare_malicious_pickle(tmp_path: Path) -> None:
    import io
    import pickle

    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

    from aegis.snapshot.dcp_io import SafeLoadPlanner

    marker = tmp_path / "pwned"
    item = ReadItem(type=LoadItemType.BYTE_IO, dest_index=MetadataIndex("extra"), dest_offsets=torch.Size([]),
                    storage_index=MetadataIndex("extra"), storage_offsets=torch.Size([]), lengths=torch.Size([]))
    planner = SafeLoadPlanner()
    planner.flatten_state_dict = False
    planner.state_dict = {}
    with pytest.raises(AegisError, match="'extra'.*weights_only"):
        planner.load_bytes(item, io.BytesIO(pickle.dumps(_Payload(marker))))
    assert not marker.exists() and planner.state_dict == {}


# -- credentials ---------------------------------------------------------------------------------

KEY_ID = "AKIAAEGISTESTKEY0042"
SECRET = "aegisTestSecretDoNotLog/0123456789abcdefgh"


@pytest.mark.parametrize("url", [
    f"s3://{KEY_ID}:{SECRET}@bucket/prefix",
    f"s3://{KEY_ID}@bucket/prefix",
    f"s3://:{SECRET}@bucket",
    f"file://{KEY_ID}:{SECRET}@localhost/tmp/x",
    f"ftp://{KEY_ID}:{SECRET}@host/x",
], ids=["s3 key and secret", "s3 key only", "s3 secret only", "file", "unsupported scheme"])
def test_durable_url_with_credentials_is_rejected_without_echoing_them(url: str) -> None:
    with pytest.raises(ConfigError) as e:
        open_store(url)
    assert KEY_ID not in str(e.value) and SECRET not in str(e.value)
    assert "credentials" in str(e.value) or "unsupported scheme" in str(e.value)


def test_credentials_never_appear_in_store_descriptions_errors_logs_or_events(
        s3_bucket: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from aegis.snapshot.durable import UploadResult
    from aegis.training.events import EventLog, read_events

    caplog.set_level(logging.INFO)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", KEY_ID)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    store = open_store(f"s3://{s3_bucket}/prefix")
    missing = open_store("s3://no-such-bucket-aegis-hostile/prefix")
    texts = [repr(store), str(store), store.url]
    try:
        store.check()
        store.put("a/b", b"x")
        assert store.get("a/b") == b"x"
        errors: list[BaseException] = []
        for call in (lambda: store.get("a/none"), lambda: store.get_range("a/none", 0, 1),
                     lambda: store.put("a/b", b"y", if_absent=True), missing.check,
                     lambda: missing.put("k", b"x"), lambda: list(missing.list())):
            with pytest.raises(AegisError) as e:
                call()
            errors.append(e.value)
        texts += [f"{type(x).__name__}: {x}" for x in errors]
        texts += [repr(x.__cause__) for x in errors if x.__cause__ is not None]
        # what Manager._on_upload writes: the store's url and the upload error
        events = EventLog(tmp_path / "events", job="j", rank=0, verbose=True)
        result = UploadResult(5, 0, error=texts[-1])
        events.emit("upload", step=result.step, error=result.error, store=store.url)
        texts.append((tmp_path / "events" / "rank-00000.jsonl").read_text())
        assert read_events(tmp_path / "events" / "rank-00000.jsonl")[0]["store"] == f"s3://{s3_bucket}/prefix"
        texts.append(caplog.text)
    finally:
        store.close()
        missing.close()
    for t in texts:
        assert KEY_ID not in t and SECRET not in t, t
