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

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

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
from aegis.snapshot.checked_json import (  # noqa: F401 - re-exported
    _HEX8,
    _SUM_PREFIX,
    body_checksum,
    check_checksum,
    dumps_with_checksum,
    load_json,
    text_checksum_ok,
)
from aegis.snapshot.erasure import StripeLayout, stripe_layout

if TYPE_CHECKING:  # Commit's fields (format 4 builds on this module)
    from aegis.snapshot.node_manifest import Layout, StepManifest

__all__ = [
    "FORMAT_VERSION", "MAX_WORLD_SIZE", "NODE_FORMAT_VERSION", "STATE_KINDS",
    "ChunkRecord", "ItemRecord", "ShardRecord", "TensorEntry", "BytesEntry", "Manifest",
    "ShardLocation", "ParityGroup", "Redundancy", "Commit",
    "dtype_name", "dtype_from_name", "redundancy_to_doc",
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
            doc["redundancy"] = redundancy_to_doc(self.redundancy)
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


def redundancy_to_doc(red: Redundancy) -> dict[str, Any]:
    """Parity groups as JSON (a whole manifest's ``redundancy``, a step record's ``parity``)."""
    groups = [{"members": list(g.members), "segment_size": g.segment_size,
               "parity_crc32c": list(g.parity_crc32c)}
              | ({"parity_size": g.parity_size} if g.parity_size >= 0 else {}) for g in red.groups]
    rs = {"parity": red.parity, "ec_type": red.ec_type} if red.scheme == "rs" else {}
    return {"scheme": red.scheme, "groups": groups} | rs


def _redundancy_from_doc(p: _Parser, doc: Any, shards: Sequence[ShardRecord] | Mapping[int, int]
                         ) -> Redundancy:
    """Parity groups, checked against the shards (or each rank's size): every member a rank, in
    one group at most, the segment size its members' sizes give (no rebuild of wrong bytes)."""
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
    sizes = dict(shards) if isinstance(shards, Mapping) else {s.rank: s.size for s in shards}
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


def _entry_to_doc(v: TensorEntry | BytesEntry) -> dict[str, Any]:
    if isinstance(v, TensorEntry):  # what dataclasses.asdict gives, without its deep copy
        return {"kind": "tensor", "dtype": v.dtype, "size": v.size, "chunks": v.chunks,
                "requires_grad": v.requires_grad}
    return {"kind": "bytes"}


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
