"""The manifest: what a committed snapshot holds, as versioned dataclasses <-> JSON.

The manifest is data. Nothing here does I/O: callers read and write the bytes. A step without
a manifest does not exist, so the manifest is always the last thing written for a step.

Parsing is strict: duplicate JSON keys, unknown or missing fields, wrong types, negative or
absurd sizes and offsets, chunks that overlap or run past the end of their shard, and items that
disagree with the entries they belong to are rejected with a :class:`ManifestError` before any
byte of a shard is trusted.

A manifest carries the crc32c of its own canonical body (the compact, key-sorted JSON of every
field but ``checksum``), checked before any field is used: a manifest damaged in a way that
still parses (a digit of an offset, two names swapped) is a damaged manifest, not a different
snapshot. Every format version keeps this rule, so a flipped ``format_version`` reads as damage.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import crc32c as _crc32c
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from aegis.errors import IncompatibleSnapshotError, ManifestError
from aegis.snapshot.erasure import StripeLayout, stripe_layout

__all__ = [
    "FORMAT_VERSION",
    "MAX_WORLD_SIZE",
    "ChunkRecord",
    "ItemRecord",
    "ShardRecord",
    "TensorEntry",
    "BytesEntry",
    "Manifest",
    "ShardLocation",
    "ParityGroup",
    "Redundancy",
    "STATE_KINDS",
    "dtype_name",
    "dtype_from_name",
    "NODE_FORMAT_VERSION",
    "Layout",
    "StepManifest",
    "shards_digest",
    "assemble",
    "assemble_any",
    "split",
    "Commit",
    "load_node_manifest",
]

FORMAT_VERSION = 3  # 2: manifest checksum, per-rank state kinds; 3: parity groups
# Manifests without parity groups are still written as format 2, so an older aegis reads them.
_PLAIN_FORMAT_VERSION = 2
# 4: a node store's step manifest splits in two (issue 24): a Layout written once per plan and a
# StepManifest of constant size per step; each shard's own index holds its records.
NODE_FORMAT_VERSION = 4
REDUNDANCY_SCHEMES = ("xor", "rs")
SHARD_FORMAT_VERSION = 1  # the shard index's own format (unchanged by 2)

# How an entry of the training state is stored (``Manifest.state_kinds``):
#   sharded     DTensor / model + optimizer state through DCP: one global tensor, chunked by rank
#   per_rank    every rank's own state_dict(), under ``per_rank.rankNNNNN.<name>``
#   replicated  the same on every rank: saved once (DCP de-duplicates), loaded by every rank
STATE_KINDS = ("sharded", "per_rank", "replicated")

_MAX_SIZE = 1 << 50  # 1 PiB: anything larger in a manifest is corrupt, not a real snapshot
MAX_WORLD_SIZE = 100_000  # shard paths and keys hold the rank in 5 digits ("rank-00042")


def load_json(text: str | bytes, *, what: str, where: str) -> Any:
    """``json.loads`` for bytes nobody vouches for: a key given twice (which ``json.loads`` would
    silently resolve to the last one) and nesting too deep for the decoder are
    :class:`ManifestError`, like any text that is not JSON."""
    try:
        return json.loads(text, object_pairs_hook=_unique_keys)
    except _DuplicateKey as e:
        raise ManifestError(
            f"{where}: {what} has the duplicate key {e.key!r}; a writer never repeats a key, so the "
            "file is damaged or forged"
        ) from None
    except RecursionError:
        raise ManifestError(f"{where}: {what} is nested too deep to be a real one; the file is damaged") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ManifestError(f"{where}: {what} is not valid JSON ({e}); the file is damaged") from e


class _DuplicateKey(Exception):
    def __init__(self, key: str) -> None:
        self.key = key


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(k)
        out[k] = v
    return out


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str, *, where: str = "manifest") -> torch.dtype:
    value = getattr(torch, name, None) if name.isidentifier() else None
    if not isinstance(value, torch.dtype):
        raise ManifestError(f"{where}: unknown dtype {name!r}")
    return value


@dataclass(frozen=True)
class ChunkRecord:
    """A byte range of a shard with its checksum.

    ``dtype`` names what the bytes are ("float32", ..., or "bytes" for serialized objects and
    padding-only ranges) so that a codec can choose a transform; ``codec`` says how the chunk is
    stored on the tier that wrote this manifest ("raw" in memory).
    """

    offset: int
    length: int
    crc32c: int
    dtype: str = "bytes"
    codec: str = "raw"
    stored_length: int | None = None  # durable tier: size and crc32c of the stored object
    stored_crc32c: int | None = None


@dataclass(frozen=True)
class ItemRecord:
    """Where one DCP storage item lives inside a shard.

    ``fqn``/``offset`` are DCP's ``MetadataIndex`` (offset: the chunk's offsets in the global
    tensor, None for byte items). Tensor items also record dtype and shape of the stored chunk
    so the bytes can be viewed without unpickling anything.
    """

    fqn: str
    offset: tuple[int, ...] | None
    file_offset: int
    length: int
    dtype: str | None = None
    shape: tuple[int, ...] | None = None

    @property
    def is_tensor(self) -> bool:
        return self.dtype is not None


@dataclass(frozen=True)
class ShardRecord:
    """One rank's shard of a snapshot."""

    rank: int
    node: str
    size: int
    index_crc32c: int
    chunks: tuple[ChunkRecord, ...]
    items: tuple[ItemRecord, ...]
    replicas: tuple[str, ...] = ()

    @property
    def data_bytes(self) -> int:
        return sum(c.length for c in self.chunks)


@dataclass(frozen=True)
class TensorEntry:
    """A tensor of the state dict: global dtype/shape and how it was chunked across ranks."""

    dtype: str
    size: tuple[int, ...]
    chunks: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]  # (offsets, sizes) per chunk
    requires_grad: bool = False

    @property
    def nbytes(self) -> int:
        return math.prod(self.size) * dtype_from_name(self.dtype).itemsize


@dataclass(frozen=True)
class BytesEntry:
    """A non-tensor object of the state dict, stored as a serialized byte item."""


@dataclass(frozen=True)
class ParityGroup:
    """One parity group of a snapshot: ``members[i]`` is the rank of member i, which stores
    its parity file (``parity_size`` bytes, crc32c ``parity_crc32c[i]``) in its node store:
    XOR, the parity of stripe i (``segment_size`` bytes); RS, its k parity pieces. The stripe
    layout follows from the members' shard sizes (``erasure.stripe_layout``)."""

    members: tuple[int, ...]
    segment_size: int
    parity_crc32c: tuple[int, ...]
    parity_size: int = -1  # bytes of each member's parity file; -1: segment_size (XOR)

    @property
    def stored(self) -> int:
        return self.segment_size if self.parity_size < 0 else self.parity_size


@dataclass(frozen=True)
class Redundancy:
    """How a snapshot survives node losses besides whole replicas (``ShardRecord.replicas``)."""

    scheme: str
    groups: tuple[ParityGroup, ...]
    parity: int = 1  # losses per group it rebuilds (XOR: 1; RS: k)
    ec_type: str = ""  # RS: the liberasurecode backend that encoded the parity

    def layout(self, sizes: Sequence[int]) -> StripeLayout:
        """The stripe layout of a group whose members' shards have ``sizes`` bytes."""
        return stripe_layout(sizes, self.parity, ec_type=self.ec_type)

    def group_of(self, rank: int) -> ParityGroup | None:
        for g in self.groups:
            if rank in g.members:
                return g
        return None


@dataclass(frozen=True)
class ShardLocation:
    """DCP ``storage_data`` value: which rank's shard holds an item and where."""

    rank: int
    file_offset: int
    length: int


@dataclass(frozen=True)
class Manifest:
    """A committed snapshot of one job at one step."""

    job: str
    step: int
    world_size: int
    shards: tuple[ShardRecord, ...]
    entries: Mapping[str, TensorEntry | BytesEntry]
    planner_data: Mapping[str, tuple[str | int, ...]] = field(default_factory=dict)
    mesh: Mapping[str, Any] = field(default_factory=dict)
    timings: Mapping[str, float] = field(default_factory=dict)
    created: float = 0.0
    state_kinds: Mapping[str, str] = field(default_factory=dict)  # entry name -> STATE_KINDS
    redundancy: Redundancy | None = None  # parity groups (None: whole replicas only)
    # as read; a manifest is written in the oldest format that holds it (2 without parity
    # groups), so it is no part of what the snapshot is
    format_version: int = field(default=FORMAT_VERSION, compare=False)

    # -- derived views -------------------------------------------------------------------------

    @property
    def total_bytes(self) -> int:
        return sum(s.size for s in self.shards)

    def shard(self, rank: int) -> ShardRecord:
        for s in self.shards:
            if s.rank == rank:
                return s
        raise ManifestError(f"manifest of step {self.step} has no shard for rank {rank}")

    def nodes(self) -> dict[int, str]:
        return {s.rank: s.node for s in self.shards}

    def to_dcp_metadata(self) -> Metadata:
        """The DCP ``Metadata`` that a ``StorageReader`` hands to ``dcp.load``."""
        state: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
        for name, entry in self.entries.items():
            if isinstance(entry, TensorEntry):
                state[name] = TensorStorageMetadata(
                    properties=TensorProperties(
                        dtype=dtype_from_name(entry.dtype), requires_grad=entry.requires_grad
                    ),
                    size=torch.Size(entry.size),
                    chunks=[
                        ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s))
                        for o, s in entry.chunks
                    ],
                )
            else:
                state[name] = BytesStorageMetadata()
        storage: dict[MetadataIndex, ShardLocation] = {}
        for shard in self.shards:
            for item in shard.items:
                storage[MetadataIndex(item.fqn, item.offset)] = ShardLocation(
                    shard.rank, item.file_offset, item.length
                )
        planner = {k: tuple(v) for k, v in self.planner_data.items()} or None
        return Metadata(state_dict_metadata=state, planner_data=planner, storage_data=storage)

    @staticmethod
    def entries_from_dcp(metadata: Metadata) -> dict[str, TensorEntry | BytesEntry]:
        out: dict[str, TensorEntry | BytesEntry] = {}
        for name, md in metadata.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):
                out[name] = TensorEntry(
                    dtype=dtype_name(md.properties.dtype),
                    size=tuple(md.size),
                    chunks=tuple((tuple(c.offsets), tuple(c.sizes)) for c in md.chunks),
                    requires_grad=bool(md.properties.requires_grad),
                )
            else:
                out[name] = BytesEntry()
        return out

    # -- JSON ----------------------------------------------------------------------------------

    def to_json(self) -> str:
        version = self.format_version
        if self.redundancy is None:
            version = min(version, _PLAIN_FORMAT_VERSION)
        doc: dict[str, Any] = {
            "format_version": version,
            "job": self.job,
            "step": self.step,
            "world_size": self.world_size,
            "created": self.created,
            "mesh": dict(self.mesh),
            "timings": dict(self.timings),
            "shards": [_shard_to_doc(s) for s in self.shards],
            "entries": {k: _entry_to_doc(v) for k, v in self.entries.items()},
            "planner_data": {k: list(v) for k, v in self.planner_data.items()},
            "state_kinds": dict(self.state_kinds),
        }
        if self.redundancy is not None:
            red = self.redundancy
            doc["redundancy"] = {
                "scheme": red.scheme,
                "groups": [{"members": list(g.members), "segment_size": g.segment_size,
                            "parity_crc32c": list(g.parity_crc32c)}
                           | ({"parity_size": g.parity_size} if g.parity_size >= 0 else {})
                           for g in red.groups],
            } | ({"parity": red.parity, "ec_type": red.ec_type} if red.scheme == "rs" else {})
        return dumps_with_checksum(doc)

    @classmethod
    def from_json(cls, text: str | bytes, *, where: str = "manifest") -> Manifest:
        return cls.from_doc(load_json(text, what="manifest", where=where), where=where,
                            _checked=text_checksum_ok(text))

    @classmethod
    def from_doc(cls, doc: Any, *, where: str = "manifest", _stored: bool = True,
                 _checked: bool = False) -> Manifest:
        p = _Parser(where)
        d = p.obj(doc, "manifest")
        if not _checked:  # (checked: its text carried the checksum of its own bytes)
            check_checksum(d, where)
        if "format_version" not in d:
            raise p.fail("manifest is missing field(s) ['format_version']")
        version = p.int_(d["format_version"], "format_version")
        if version == NODE_FORMAT_VERSION and d.get("kind") in ("step", "layout"):
            raise ManifestError(
                f"{where}: a node store's format-4 {d.get('kind')} document, not a whole manifest: "
                "read it through aegis.snapshot.node_store.NodeStore.read_manifest")
        if version > FORMAT_VERSION:
            raise IncompatibleSnapshotError(
                f"{where}: written by a newer aegis (format version {version}, this aegis reads "
                f"up to {FORMAT_VERSION}); upgrade aegis to read it"
            )
        if version < 1:
            raise ManifestError(f"{where}: invalid format_version {version}")
        p.fields(
            d,
            "manifest",
            required={"format_version", "job", "step", "world_size", "shards", "entries", "checksum"},
            optional={"created", "mesh", "timings", "planner_data", "state_kinds"}
            | ({"redundancy"} if version >= 3 else set()),
        )
        job = p.str_(d["job"], "job")
        step = p.int_(d["step"], "step")
        world = p.int_(d["world_size"], "world_size", lo=1, hi=MAX_WORLD_SIZE)
        shard_docs = p.list_(d["shards"], "shards")
        if len(shard_docs) != world:
            raise ManifestError(
                f"{where}: {len(shard_docs)} shard record(s) for world_size {world}, expected exactly "
                f"one per rank 0..{world - 1}"
            )
        shards = tuple(_shard_from_doc(p, s, f"shards[{i}]") for i, s in enumerate(shard_docs))
        ranks = sorted(s.rank for s in shards)
        if ranks != list(range(world)):
            raise ManifestError(
                f"{where}: shards are for ranks {ranks}, expected exactly 0..{world - 1}"
            )
        entries: dict[str, TensorEntry | BytesEntry] = {}
        for name, e in p.obj(d["entries"], "entries").items():
            ed = p.obj(e, f"entries[{name!r}]")
            kind = ed.get("kind")
            if kind == "bytes":
                p.fields(ed, f"entries[{name!r}]", required={"kind"}, optional=set())
                entries[name] = BytesEntry()
            elif kind == "tensor":
                p.fields(
                    ed,
                    f"entries[{name!r}]",
                    required={"kind", "dtype", "size", "chunks"},
                    optional={"requires_grad"},
                )
                dtype = p.str_(ed["dtype"], f"entries[{name!r}].dtype")
                dtype_from_name(dtype, where=where)
                size = p.ints(ed["size"], f"entries[{name!r}].size")
                chunks = []
                for c in p.list_(ed["chunks"], f"entries[{name!r}].chunks"):
                    pair = p.list_(c, f"entries[{name!r}].chunks[]")
                    if len(pair) != 2:
                        raise ManifestError(f"{where}: entries[{name!r}] chunk is not [offsets, sizes]")
                    offs = p.ints(pair[0], "chunk offsets")
                    sizes = p.ints(pair[1], "chunk sizes")
                    if len(offs) != len(size) or len(sizes) != len(size) or any(
                        o + s > n for o, s, n in zip(offs, sizes, size, strict=True)
                    ):
                        raise ManifestError(
                            f"{where}: entries[{name!r}] has a chunk outside the tensor's shape"
                        )
                    chunks.append((offs, sizes))
                entries[name] = TensorEntry(
                    dtype=dtype,
                    size=size,
                    chunks=tuple(chunks),
                    requires_grad=p.bool_(ed.get("requires_grad", False), f"entries[{name!r}].requires_grad"),
                )
            else:
                raise ManifestError(f"{where}: entries[{name!r}] has unknown kind {kind!r}")
        planner_data: dict[str, tuple[str | int, ...]] = {}
        for k, v in p.obj(d.get("planner_data", {}), "planner_data").items():
            path = p.list_(v, f"planner_data[{k!r}]")
            if not all(isinstance(x, (str, int)) and not isinstance(x, bool) for x in path):
                raise ManifestError(f"{where}: planner_data[{k!r}] must be a list of str/int")
            if ".".join(map(str, path)) != k or k not in entries:
                # DCP names a flattened key by joining its path with dots: a path that does not
                # spell its key would load (or export) a tensor under another name.
                raise ManifestError(
                    f"{where}: planner_data[{k!r}] = {path!r} does not spell its key or names no entry"
                )
            planner_data[k] = tuple(path)
        state_kinds: dict[str, str] = {}
        for k, v in p.obj(d.get("state_kinds", {}), "state_kinds").items():
            if v not in STATE_KINDS:
                raise ManifestError(f"{where}: state_kinds[{k!r}] = {v!r}, expected one of {STATE_KINDS}")
            state_kinds[k] = v
        timings = {
            k: float(p.num(v, f"timings[{k!r}]"))
            for k, v in p.obj(d.get("timings", {}), "timings").items()
        }
        manifest = cls(
            job=job,
            step=step,
            world_size=world,
            shards=tuple(sorted(shards, key=lambda s: s.rank)),
            entries=entries,
            planner_data=planner_data,
            mesh=p.obj(d.get("mesh", {}), "mesh"),
            timings=timings,
            created=float(p.num(d.get("created", 0.0), "created")),
            state_kinds=state_kinds,
            redundancy=_redundancy_from_doc(p, d["redundancy"], shards) if "redundancy" in d else None,
            format_version=version,
        )
        if _stored:
            _check_items_against_entries(manifest, where)
        return manifest


# -- helpers -------------------------------------------------------------------------------------


def _redundancy_from_doc(p: _Parser, doc: Any, shards: Sequence[ShardRecord]) -> Redundancy:
    """Parity groups, checked against the shards: every member a rank of the snapshot, in one
    group at most, and the segment size the one its members' shard sizes give (so a damaged
    record cannot make a rebuild read the wrong bytes)."""
    d = p.obj(doc, "redundancy")
    p.fields(d, "redundancy", required={"scheme", "groups"}, optional={"parity", "ec_type"})
    scheme = p.str_(d["scheme"], "redundancy.scheme")
    if scheme not in REDUNDANCY_SCHEMES:
        raise p.fail(f"redundancy.scheme {scheme!r} is not one of {REDUNDANCY_SCHEMES}")
    rs = scheme == "rs"
    p.fields(d, "redundancy", required={"scheme", "groups"} | ({"parity", "ec_type"} if rs else set()),
             optional=set())
    parity = p.int_(d["parity"], "redundancy.parity") if rs else 1
    ec_type = p.str_(d["ec_type"], "redundancy.ec_type") if rs else ""
    if parity < 1 or (rs and not ec_type):
        raise p.fail(f"redundancy: parity {parity} must be >= 1 and RS needs its ec_type")
    sizes = {s.rank: s.size for s in shards}
    seen: set[int] = set()
    groups = []
    for i, g in enumerate(p.list_(d["groups"], "redundancy.groups")):
        what = f"redundancy.groups[{i}]"
        gd = p.obj(g, what)
        p.fields(gd, what, required={"members", "segment_size", "parity_crc32c"}
                 | ({"parity_size"} if rs else set()), optional=set())
        members = p.ints(gd["members"], f"{what}.members")
        crcs = p.ints(gd["parity_crc32c"], f"{what}.parity_crc32c")
        seg = p.int_(gd["segment_size"], f"{what}.segment_size")
        if len(members) < parity + 1 or len(crcs) != len(members) or any(c > 0xFFFFFFFF for c in crcs):
            raise p.fail(f"{what}: needs >= {parity + 1} members and one 32-bit parity crc32c per member")
        bad = [m for m in members if m not in sizes or m in seen]
        if bad or len(set(members)) != len(members):
            raise p.fail(f"{what}: member(s) {bad or list(members)} are not distinct ranks of this "
                         "snapshot outside every other group")
        seen.update(members)
        if stripe_layout([sizes[m] for m in members], parity).segment_size != seg:
            raise p.fail(f"{what}: segment_size {seg} does not match its members' shard sizes")
        psize = -1
        if rs:
            psize = p.int_(gd["parity_size"], f"{what}.parity_size")
            if psize % parity or (seg and psize // parity <= seg) or (not seg and psize):
                raise p.fail(f"{what}: parity_size {psize} is not {parity} pieces of more than "
                             f"the {seg}-byte segment")
        groups.append(ParityGroup(members, seg, crcs, psize))
    return Redundancy(scheme, tuple(groups), parity, ec_type)


@dataclass(frozen=True)
class EncodedManifest:
    """A whole manifest as its JSON text: what rank 0 sends the node leaders at a commit. Bytes
    pickle at memcpy speed, where a :class:`Manifest`'s object graph (O(world x items)) was
    pickled by rank 0, unpickled by every rank and encoded again by every leader, at every step
    of a parity scheme (measured in the 6-node RS campaign: the manifest's encoding alone was
    a tenth of the trainers' CPU). The ranks that need the object have it (rank 0, which
    made it) or their own record (the others)."""

    step: int
    text: bytes
    total_bytes: int

    @classmethod
    def of(cls, m: Manifest) -> EncodedManifest:
        return cls(m.step, m.to_json().encode(), m.total_bytes)


def body_checksum(doc: Mapping[str, Any]) -> str:
    """``crc32c:<8 hex digits>`` of the canonical JSON of ``doc`` without its ``checksum``."""
    body = {k: v for k, v in doc.items() if k != "checksum"}
    text = json.dumps(body, separators=(",", ":"), sort_keys=True).encode()
    return f"crc32c:{_crc32c.crc32c(text):08x}"


def dumps_with_checksum(body: Mapping[str, Any]) -> str:
    """The canonical JSON of ``body`` with its :func:`body_checksum` added, encoded once: the
    checksum is spliced in before the body's first key (``checksum`` sorts before every key a
    manifest, layout or step record has; else the document is encoded again). Byte for byte
    what ``json.dumps({**body, "checksum": ...}, sort_keys=True)`` writes, at half the cost
    (a parity scheme's whole manifest is written at every step: ~10 ms for 6 ranks idle)."""
    text = json.dumps(body, separators=(",", ":"), sort_keys=True)
    tag = f"crc32c:{_crc32c.crc32c(text.encode()):08x}"
    if not body or min(body) <= "checksum":
        return json.dumps({**body, "checksum": tag}, separators=(",", ":"), sort_keys=True)
    return '{"checksum":' + json.dumps(tag) + "," + text[1:]


def _entry_to_doc(v: TensorEntry | BytesEntry) -> dict[str, Any]:
    if isinstance(v, TensorEntry):  # what dataclasses.asdict gives, without its deep copy
        return {"kind": "tensor", "dtype": v.dtype, "size": v.size, "chunks": v.chunks,
                "requires_grad": v.requires_grad}
    return {"kind": "bytes"}


_SUM_PREFIX = b'{"checksum":"crc32c:'
_HEX8 = re.compile(rb"[0-9a-f]{8}")


def text_checksum_ok(text: str | bytes) -> bool:
    """True when ``text`` is a document as :func:`dumps_with_checksum` writes it (the checksum
    first, then the canonical body) and the checksum matches the body's bytes as they are:
    verified at C speed, without encoding the parsed document again (a restore reads every
    step's manifest on every node). False: not in that form, or not matching; the caller checks
    the parsed document the usual way (:func:`check_checksum`), which names what is wrong."""
    b = text if isinstance(text, bytes) else text.encode()
    n = len(_SUM_PREFIX)
    if not b.startswith(_SUM_PREFIX) or b[n + 8:n + 10] != b'",' or not _HEX8.fullmatch(b[n:n + 8]):
        return False
    return _crc32c.crc32c(memoryview(b)[n + 10:], _crc32c.crc32c(b"{")) == int(b[n:n + 8], 16)


def check_checksum(d: dict[str, Any], where: str) -> None:
    """Raise ManifestError unless ``d`` carries the checksum of its own canonical body."""
    got = d.get("checksum")
    if got is None:
        version = d.get("format_version")
        if version == 1:
            raise IncompatibleSnapshotError(
                f"{where}: written by an older aegis (format version 1, before manifests carried a "
                f"checksum); this aegis reads format {FORMAT_VERSION}. Restore or export it with the "
                "aegis that wrote it, or start a new job name"
            )
        raise ManifestError(f"{where}: manifest has no checksum; the file is damaged or forged")
    try:
        want = body_checksum(d)
    except (TypeError, ValueError) as e:  # a doc that did not come from JSON text
        raise ManifestError(f"{where}: manifest is not a JSON document ({e})") from None
    if got != want:
        raise ManifestError(
            f"{where}: manifest fails its checksum ({got!r} recorded, {want!r} computed): it was "
            "damaged after it was written; this copy is not used"
        )


def _shard_to_doc(s: ShardRecord) -> dict[str, Any]:
    return {
        "rank": s.rank,
        "node": s.node,
        "size": s.size,
        "index_crc32c": s.index_crc32c,
        "replicas": list(s.replicas),
        "chunks": [chunk_to_row(c) for c in s.chunks],
        "items": [item_to_doc(i) for i in s.items],
    }


def item_to_doc(i: ItemRecord) -> dict[str, Any]:
    doc: dict[str, Any] = {"fqn": i.fqn, "file_offset": i.file_offset, "length": i.length}
    if i.offset is not None:
        doc["offset"] = list(i.offset)
    if i.dtype is not None:
        doc["dtype"] = i.dtype
        doc["shape"] = list(i.shape or ())
    return doc


_TENSOR_ITEM_KEYS = frozenset({"fqn", "offset", "file_offset", "length", "dtype", "shape"})
_itemsizes: dict[str, int] = {}  # dtype names seen valid -> bytes per element


def _plain_ints(v: Any) -> tuple[int, ...] | None:
    """``v`` as a tuple when it is a list of ints in range (checked at C speed), else None."""
    if type(v) is not list:
        return None
    t = tuple(v)
    if set(map(type, t)) <= {int} and (not t or (min(t) >= 0 and max(t) <= _MAX_SIZE)):
        return t
    return None


def _fast_tensor_item(d: Any) -> ItemRecord | None:
    """The common item (a tensor chunk, every field well formed) with the checks of
    :func:`item_from_doc` made at C speed (a manifest holds an item per tensor chunk per rank:
    tens of thousands); None for anything else, which the full checks then name."""
    if type(d) is not dict or d.keys() != _TENSOR_ITEM_KEYS:
        return None
    fqn, dtype, fo, ln = d["fqn"], d["dtype"], d["file_offset"], d["length"]
    if type(fqn) is not str or type(dtype) is not str or type(fo) is not int \
            or type(ln) is not int or not (0 <= fo <= _MAX_SIZE and 0 <= ln <= _MAX_SIZE):
        return None
    offset, shape = _plain_ints(d["offset"]), _plain_ints(d["shape"])
    itemsize = _itemsizes.get(dtype)
    if offset is None or shape is None or itemsize is None or ln != math.prod(shape) * itemsize:
        return None
    return ItemRecord(fqn=fqn, offset=offset, file_offset=fo, length=ln, dtype=dtype, shape=shape)


def item_from_doc(p: _Parser, d: Any, what: str) -> ItemRecord:
    fast = _fast_tensor_item(d)
    if fast is not None:
        return fast
    d = p.obj(d, what)
    p.fields(d, what, required={"fqn", "file_offset", "length"}, optional={"offset", "dtype", "shape"})
    dtype = d.get("dtype")
    shape = None
    if dtype is not None:  # a tensor item: its bytes are viewed as dtype and shape
        p.fields(d, what, required={"fqn", "file_offset", "length", "dtype", "shape"}, optional={"offset"})
        _itemsizes[dtype] = dtype_from_name(p.str_(dtype, f"{what}.dtype"), where=p.where).itemsize
        shape = p.ints(d["shape"], f"{what}.shape")
    elif "shape" in d:
        raise p.fail(f"{what} has a shape without a dtype (only tensor items have one)")
    item = ItemRecord(
        fqn=p.str_(d["fqn"], f"{what}.fqn"),
        offset=p.ints(d["offset"], f"{what}.offset") if "offset" in d else None,
        file_offset=p.int_(d["file_offset"], f"{what}.file_offset"),
        length=p.int_(d["length"], f"{what}.length"),
        dtype=dtype,
        shape=shape,
    )
    if item.is_tensor and item.length != math.prod(item.shape or ()) * dtype_from_name(
        item.dtype or "uint8"
    ).itemsize:
        raise ManifestError(f"{p.where}: {what} length does not match its dtype and shape")
    return item


def chunk_to_row(c: ChunkRecord) -> list[Any]:
    row: list[Any] = [c.offset, c.length, c.crc32c, c.dtype, c.codec]
    if c.stored_length is not None:
        row += [c.stored_length, c.stored_crc32c]
    return row


def chunk_from_doc(p: _Parser, c: Any, what: str) -> ChunkRecord:
    row = p.list_(c, what)
    if len(row) not in (5, 7):
        raise ManifestError(
            f"{p.where}: {what} must be [offset, length, crc32c, dtype, codec(, stored length, "
            "stored crc32c)]"
        )
    return ChunkRecord(
        offset=p.int_(row[0], f"{what}.offset"),
        length=p.int_(row[1], f"{what}.length"),
        crc32c=p.int_(row[2], f"{what}.crc32c", hi=0xFFFFFFFF),
        dtype=p.str_(row[3], f"{what}.dtype"),
        codec=p.str_(row[4], f"{what}.codec"),
        stored_length=p.int_(row[5], f"{what}.stored_length") if len(row) == 7 else None,
        stored_crc32c=p.int_(row[6], f"{what}.stored_crc32c", hi=0xFFFFFFFF) if len(row) == 7 else None,
    )


def check_layout(p: _Parser, size: int, chunks: Sequence[ChunkRecord],
                 items: Sequence[ItemRecord], what: str) -> None:
    """Chunks must tile [0, data_end) in order; every item must lie inside the data region."""
    pos = 0
    for i, c in enumerate(chunks):
        if c.offset != pos:
            raise ManifestError(
                f"{p.where}: {what} chunk {i} starts at {c.offset}, expected {pos} (gap or overlap)"
            )
        pos = c.offset + c.length
    if pos > size:
        raise ManifestError(f"{p.where}: {what} chunks end at {pos}, past the shard size {size}")
    seen: set[tuple[str, tuple[int, ...] | None]] = set()
    for item in items:
        if item.file_offset + item.length > pos:
            raise ManifestError(
                f"{p.where}: {what} item {item.fqn!r} ends at {item.file_offset + item.length}, "
                f"past the shard's data ({pos} bytes)"
            )
        key = (item.fqn, item.offset)
        if key in seen:
            raise ManifestError(f"{p.where}: {what} has item {item.fqn!r} twice")
        seen.add(key)


def _shard_from_doc(p: _Parser, doc: Any, what: str) -> ShardRecord:
    d = p.obj(doc, what)
    p.fields(
        d,
        what,
        required={"rank", "node", "size", "index_crc32c", "chunks", "items"},
        optional={"replicas"},
    )
    chunks = tuple(chunk_from_doc(p, c, f"{what}.chunks[{i}]") for i, c in enumerate(p.list_(d["chunks"], "chunks")))
    items = tuple(item_from_doc(p, it, f"{what}.items[{i}]") for i, it in enumerate(p.list_(d["items"], "items")))
    size = p.int_(d["size"], f"{what}.size")
    check_layout(p, size, chunks, items, what)
    return ShardRecord(
        rank=p.int_(d["rank"], f"{what}.rank"),
        node=p.str_(d["node"], f"{what}.node"),
        size=size,
        index_crc32c=p.int_(d["index_crc32c"], f"{what}.index_crc32c", hi=0xFFFFFFFF),
        chunks=chunks,
        items=items,
        replicas=tuple(p.str_(x, f"{what}.replicas[]") for x in p.list_(d.get("replicas", []), "replicas")),
    )


def _check_items_against_entries(m: Manifest, where: str) -> None:
    """Every item is one chunk of its entry (same dtype and shape), and every chunk of every
    entry is stored by some shard: what DCP will ask the reader for exists, and the reader views
    bytes with the dtype and shape DCP expects."""
    stored: set[tuple[str, tuple[int, ...] | None]] = set()
    chunk_sizes = {
        name: {offs: sizes for offs, sizes in e.chunks}
        for name, e in m.entries.items() if isinstance(e, TensorEntry)
    }
    for shard in m.shards:
        for item in shard.items:
            entry = m.entries.get(item.fqn)
            what = f"item {item.fqn!r} of the shard of rank {shard.rank}"
            if entry is None:
                raise ManifestError(
                    f"{where}: shard of rank {shard.rank} holds {item.fqn!r}, which no entry declares"
                )
            if isinstance(entry, TensorEntry) != item.is_tensor:
                raise ManifestError(f"{where}: item {item.fqn!r} does not match its entry's kind")
            if isinstance(entry, TensorEntry):
                sizes = chunk_sizes[item.fqn].get(item.offset) if item.offset is not None else None
                if sizes is None:
                    raise ManifestError(
                        f"{where}: {what} is at offset {item.offset}, but no chunk of the entry starts "
                        "there"
                    )
                if item.dtype != entry.dtype:
                    raise ManifestError(
                        f"{where}: {what} has dtype {item.dtype}, its entry has dtype {entry.dtype}"
                    )
                if item.shape != sizes:
                    raise ManifestError(
                        f"{where}: {what} has shape {item.shape}, its chunk of the entry has shape {sizes}"
                    )
            elif item.offset is not None:
                raise ManifestError(f"{where}: {what} is a byte item with a tensor offset {item.offset}")
            stored.add((item.fqn, item.offset))
    for name, entry in m.entries.items():
        offsets = [o for o, _ in entry.chunks] if isinstance(entry, TensorEntry) else [None]
        for o in offsets:
            if (name, o) not in stored:
                at = "" if o is None else f" (chunk at offset {o})"
                raise ManifestError(f"{where}: entry {name!r}{at} is declared, but no shard stores it")


class _Parser:
    """Strict JSON field checks with messages that name the file and the field."""

    def __init__(self, where: str) -> None:
        self.where = where

    def fail(self, msg: str) -> ManifestError:
        return ManifestError(f"{self.where}: {msg}")

    def obj(self, v: Any, what: str) -> dict[str, Any]:
        if not isinstance(v, dict):
            raise self.fail(f"{what} must be an object")
        return v

    def list_(self, v: Any, what: str) -> list[Any]:
        if not isinstance(v, list):
            raise self.fail(f"{what} must be a list")
        return v

    def str_(self, v: Any, what: str) -> str:
        if not isinstance(v, str):
            raise self.fail(f"{what} must be a string")
        return v

    def bool_(self, v: Any, what: str) -> bool:
        if not isinstance(v, bool):
            raise self.fail(f"{what} must be a boolean, got {v!r}")
        return v

    def num(self, v: Any, what: str) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise self.fail(f"{what} must be a finite number")
        return v

    def int_(self, v: Any, what: str, *, lo: int = 0, hi: int = _MAX_SIZE) -> int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise self.fail(f"{what} must be an integer, got {v!r}")
        if not lo <= v <= hi:
            raise self.fail(f"{what} = {v} is out of range [{lo}, {hi}]")
        return v

    def ints(self, v: Any, what: str) -> tuple[int, ...]:
        # the common case checked at C speed (a manifest holds tens of thousands of these);
        # anything else goes the way that names the bad value
        t = _plain_ints(self.list_(v, what))
        return t if t is not None else tuple(self.int_(x, what) for x in v)

    def fields(self, d: dict[str, Any], what: str, *, required: set[str], optional: set[str]) -> None:
        missing = required - d.keys()
        unknown = d.keys() - required - optional
        if missing:
            raise self.fail(f"{what} is missing field(s) {sorted(missing)}")
        if unknown:
            raise self.fail(f"{what} has unknown field(s) {sorted(unknown)}")


# -- format 4: a node store's manifest split into a layout and a step record (issue 24) ----------
#
# A whole manifest holds every rank's shard record (chunks and items: about 140 bytes per item,
# 0.4 MB per rank of a 70B model), and every node wrote it at every step: O(world) per node per
# step. Between two steps of one plan nothing in it changes but sizes, checksums and the step.
# So a node store keeps, per plan, one Layout (what the state is and where each rank sits: DCP's
# entries and planner data, state kinds, each rank's node), written once, and per step one
# StepManifest of constant size: the step, its layout's digest, and a digest over every rank's
# (shard size, index crc32c). Each shard's own index (crc-checked, at the end of its file)
# already holds that rank's chunk and item records; :func:`assemble` puts a whole Manifest back
# together from the layout, the step record and the shards' indexes wherever they are, and
# checks them against the digest. The durable tier keeps whole manifests (formats 2 and 3).


def _sha(doc: Any) -> str:
    import hashlib

    text = json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()
    return hashlib.sha256(text).hexdigest()


def shards_digest(pairs: Sequence[tuple[int, int]]) -> str:
    """``sha256:<hex>`` of every rank's (shard size, index crc32c), in rank order."""
    return "sha256:" + _sha([[int(a), int(b)] for a, b in pairs])


@dataclass(frozen=True)
class Layout:
    """What one plan of a job's snapshots is: written once per plan to
    ``<job>/layouts/layout-<digest>.json`` on every node (O(world x tensors), once)."""

    job: str
    world_size: int
    nodes: tuple[str, ...]  # node of each rank
    entries: Mapping[str, TensorEntry | BytesEntry]
    planner_data: Mapping[str, tuple[str | int, ...]] = field(default_factory=dict)
    state_kinds: Mapping[str, str] = field(default_factory=dict)
    mesh: Mapping[str, Any] = field(default_factory=dict)

    def doc(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "format_version": NODE_FORMAT_VERSION,
            "kind": "layout",
            "job": self.job,
            "world_size": self.world_size,
            "nodes": list(self.nodes),
            "entries": {k: _entry_to_doc(v) for k, v in self.entries.items()},
            "planner_data": {k: list(v) for k, v in self.planner_data.items()},
            "state_kinds": dict(self.state_kinds),
            "mesh": dict(self.mesh),
        }
        d["checksum"] = body_checksum(d)
        return d

    @cached_property
    def digest(self) -> str:
        """16 hex digits of the sha256 of the canonical document: its file name. Computed once
        per object (a layout is immutable): the engine names the layout at every commit, and
        building the document cost 14 ms for the 131 entries of the example's tiny model
        (O(world x tensors))."""
        return _sha(self.doc())[:16]

    def to_json(self) -> str:
        return json.dumps(self.doc(), separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes, *, where: str = "layout") -> Layout:
        p = _Parser(where)
        d = p.obj(load_json(text, what="layout", where=where), "layout")
        check_checksum(d, where)
        version = p.int_(d.get("format_version", -1), "format_version")
        if version != NODE_FORMAT_VERSION or d.get("kind") != "layout":
            raise ManifestError(f"{where}: not a format-{NODE_FORMAT_VERSION} layout")
        p.fields(d, "layout", required={"format_version", "kind", "job", "world_size", "nodes",
                                        "entries", "checksum"},
                 optional={"planner_data", "state_kinds", "mesh"})
        world = p.int_(d["world_size"], "world_size", lo=1, hi=MAX_WORLD_SIZE)
        nodes = tuple(p.str_(x, "nodes[]") for x in p.list_(d["nodes"], "nodes"))
        if len(nodes) != world:
            raise p.fail(f"{len(nodes)} nodes for world_size {world}")
        # the entries, planner data and kinds parse exactly as a whole manifest's do
        skeleton = {"format_version": _PLAIN_FORMAT_VERSION, "job": d["job"], "step": 0,
                    "world_size": 1, "entries": d["entries"], "planner_data": d.get("planner_data", {}),
                    "state_kinds": d.get("state_kinds", {}), "mesh": d.get("mesh", {}),
                    "shards": [{"rank": 0, "node": "", "size": 0, "index_crc32c": 0, "chunks": [],
                                "items": []}]}
        skeleton["checksum"] = body_checksum(skeleton)
        # a layout has no shards: that some shard stores each entry is checked by assemble()
        m = Manifest.from_doc(skeleton, where=where, _stored=False)
        return cls(job=m.job, world_size=world, nodes=nodes, entries=m.entries,
                   planner_data=m.planner_data, state_kinds=m.state_kinds, mesh=m.mesh)


_LAYOUT_CACHE_SIZE = 8
_layouts: dict[bytes, Layout] = {}  # sha256 of a layout file's bytes -> the Layout they parsed to


def parse_layout(text: bytes, digest: str, *, where: str = "layout") -> Layout:
    """The layout in ``text``, checked to hash to its name ``digest`` (a
    :class:`ManifestError` if it does not: damaged).

    Bytes already checked by this process are not parsed and hashed again: a layout is content
    addressed, so the same bytes (their sha256) under the same name are the same checked layout.
    A restore reads a plan's layout once per node store it inventories, and the parse and the
    canonical re-hash cost 28 ms each time for the 131 entries of the example's tiny model.
    The cache holds the last ``_LAYOUT_CACHE_SIZE`` layouts (one per plan: O(world x tensors)
    each, as the file)."""
    import hashlib

    sha = hashlib.sha256(text)
    key = sha.digest()
    # the bytes written under this name (``to_json``) hash to it: checked without building the
    # canonical document again; other bytes that parse (re-serialized by hand) must still have
    # the canonical document of the name
    raw_ok = sha.hexdigest()[:16] == digest
    layout = _layouts.get(key)
    if layout is None or not (raw_ok or layout.digest == digest):
        layout = Layout.from_json(text, where=where)
        if not raw_ok and layout.digest != digest:
            raise ManifestError(f"{where} does not hash to its name ({layout.digest}): damaged")
        if raw_ok:  # the canonical bytes: their document's digest is the name (round trip)
            object.__setattr__(layout, "digest", digest)
        _layouts.pop(key, None)
        while len(_layouts) >= _LAYOUT_CACHE_SIZE:
            _layouts.pop(next(iter(_layouts)))
    else:
        del _layouts[key]  # re-inserted below: the most recently used is last
    _layouts[key] = layout
    return layout


@dataclass(frozen=True)
class StepManifest:
    """A committed step in a node store (format 4): constant size whatever the world size."""

    job: str
    step: int
    world_size: int
    layout: str  # Layout.digest
    shards_digest: str  # shards_digest() of every rank's (size, index crc32c)
    total_bytes: int
    created: float = 0.0
    timings: Mapping[str, float] = field(default_factory=dict)

    def to_json(self) -> str:
        d: dict[str, Any] = {
            "format_version": NODE_FORMAT_VERSION, "kind": "step", "job": self.job,
            "step": self.step, "world_size": self.world_size, "layout": self.layout,
            "shards_digest": self.shards_digest, "total_bytes": self.total_bytes,
            "created": self.created, "timings": dict(self.timings),
        }
        return dumps_with_checksum(d)

    @classmethod
    def from_doc(cls, d: dict[str, Any], *, where: str) -> StepManifest:
        p = _Parser(where)
        p.fields(d, "manifest", required={"format_version", "kind", "job", "step", "world_size",
                                          "layout", "shards_digest", "total_bytes", "checksum"},
                 optional={"created", "timings"})
        layout = p.str_(d["layout"], "layout")
        digest = p.str_(d["shards_digest"], "shards_digest")
        if len(layout) != 16 or not all(c in "0123456789abcdef" for c in layout) \
                or not digest.startswith("sha256:"):
            raise p.fail("layout / shards_digest are not digests")
        return cls(job=p.str_(d["job"], "job"), step=p.int_(d["step"], "step"),
                   world_size=p.int_(d["world_size"], "world_size", lo=1, hi=MAX_WORLD_SIZE),
                   layout=layout, shards_digest=digest,
                   total_bytes=p.int_(d["total_bytes"], "total_bytes"),
                   created=float(p.num(d.get("created", 0.0), "created")),
                   timings={k: float(p.num(v, f"timings[{k!r}]"))
                            for k, v in p.obj(d.get("timings", {}), "timings").items()})


def load_node_manifest(text: str | bytes, *, where: str) -> Manifest | StepManifest:
    """A node store's ``manifest.json``: a whole manifest (formats 2 and 3, written before
    format 4 or with parity groups) or a format-4 step record."""
    d = load_json(text, what="manifest", where=where)
    checked = text_checksum_ok(text)
    if isinstance(d, dict) and d.get("format_version") == NODE_FORMAT_VERSION \
            and d.get("kind") == "step":
        if not checked:
            check_checksum(d, where)
        return StepManifest.from_doc(d, where=where)
    return Manifest.from_doc(d, where=where, _checked=checked)


def split(m: Manifest) -> tuple[Layout, StepManifest]:
    """A whole manifest (without parity groups) as its node-store layout and step record."""
    if m.redundancy is not None:
        raise ValueError("manifests with parity groups are written whole (format 3)")
    layout = Layout(job=m.job, world_size=m.world_size,
                    nodes=tuple(s.node for s in sorted(m.shards, key=lambda s: s.rank)),
                    entries=m.entries, planner_data=m.planner_data, state_kinds=m.state_kinds,
                    mesh=m.mesh)
    step = StepManifest(job=m.job, step=m.step, world_size=m.world_size, layout=layout.digest,
                        shards_digest=shards_digest([(s.size, s.index_crc32c) for s in
                                                     sorted(m.shards, key=lambda s: s.rank)]),
                        total_bytes=m.total_bytes, created=m.created, timings=m.timings)
    return layout, step


def assemble(layout: Layout, step: StepManifest, records: Mapping[int, ShardRecord], *,
             where: str = "manifest") -> Manifest:
    """The whole manifest of ``step`` from its layout and one shard record per rank (read from
    the shards' own indexes), checked against the step's digest: a stale, foreign or damaged
    shard index cannot pass for the committed one."""
    if layout.job != step.job or layout.world_size != step.world_size:
        raise ManifestError(f"{where}: layout {step.layout} is for job {layout.job!r} with "
                            f"{layout.world_size} rank(s), not this step's")
    if layout.digest != step.layout:
        raise ManifestError(f"{where}: layout digest {layout.digest} is not {step.layout}")
    missing = [r for r in range(step.world_size) if r not in records]
    if missing:
        raise ManifestError(f"{where}: no shard index for rank(s) {missing[:8]}"
                            + (" ..." if len(missing) > 8 else ""))
    ordered = [records[r] for r in range(step.world_size)]
    got = shards_digest([(r.size, r.index_crc32c) for r in ordered])
    if got != step.shards_digest:
        raise ManifestError(f"{where}: the shards' sizes and index crc32c do not match step "
                            f"{step.step}'s manifest: a shard is stale, foreign or damaged")
    m = Manifest(job=step.job, step=step.step, world_size=step.world_size,
                 shards=tuple(dataclasses_replace(r, rank=i, node=layout.nodes[i], replicas=())
                              for i, r in enumerate(ordered)),
                 entries=layout.entries, planner_data=layout.planner_data, mesh=layout.mesh,
                 timings=step.timings, created=step.created, state_kinds=layout.state_kinds,
                 format_version=_PLAIN_FORMAT_VERSION)
    _check_items_against_entries(m, where)
    return m


def assemble_any(layout: Layout, step: StepManifest,
                 candidates: Mapping[int, Sequence[ShardRecord]], *, where: str = "manifest",
                 tries: int = 256) -> Manifest:
    """:func:`assemble` when some rank has several candidate records (copies on several nodes
    whose indexes differ: one is stale or damaged): the most common first, then other
    combinations, at most ``tries``; the digest decides."""
    import itertools
    from collections import Counter

    options: dict[int, list[ShardRecord]] = {}
    for r, found in candidates.items():
        counts = Counter((x.size, x.index_crc32c) for x in found)
        seen: dict[tuple[int, int], ShardRecord] = {}
        for x in found:
            seen.setdefault((x.size, x.index_crc32c), x)
        options[r] = [seen[k] for k, _ in counts.most_common()]
    multi = [r for r, o in options.items() if len(o) > 1]
    first = {r: o[0] for r, o in options.items()}
    last: ManifestError | None = None
    for n, combo in enumerate(itertools.product(*(options[r] for r in multi))):
        if n >= tries:
            break
        pick = dict(first)
        pick.update(zip(multi, combo, strict=True))
        try:
            return assemble(layout, step, pick, where=where)
        except ManifestError as e:
            last = e
            if "do not match" not in str(e):
                raise
    assert last is not None
    raise last


@dataclass
class Commit:
    """What every rank learns of a committed step, for the durable uploader (``on_commit``):
    its own shard record, and the step's manifest: whole (with parity groups: on rank 0 only,
    which made it; the durable tier's manifest is built from it), or the format-4 step record
    (and on rank 0 the layout, from which rank 0 builds the durable tier's whole manifest with
    every rank's record, gathered by the upload)."""

    step: int
    record: ShardRecord | None
    whole: Manifest | None = None
    step_manifest: StepManifest | None = None
    layout: Layout | None = None


def dataclasses_replace(obj: Any, **kw: Any) -> Any:
    import dataclasses

    return dataclasses.replace(obj, **kw)
