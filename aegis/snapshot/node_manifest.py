"""The node store's manifest format 4 (issue 24): a step's manifest split in two, a
:class:`Layout` written once per plan (entries, planner data, state kinds, the shard layout) and
a :class:`StepManifest` of constant size per step (step, the layout's digest, a digest of every
shard's size and index crc); each shard's own index holds its records, and :func:`assemble`
rebuilds the whole :class:`~.manifest.Manifest` from the three.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from aegis.errors import ManifestError
from aegis.snapshot.manifest import (
    _PLAIN_FORMAT_VERSION,
    FORMAT_VERSION,
    MAX_WORLD_SIZE,
    NODE_FORMAT_VERSION,
    BytesEntry,
    Manifest,
    Redundancy,
    ShardRecord,
    TensorEntry,
    _check_items_against_entries,
    _entry_to_doc,
    _Parser,
    _redundancy_from_doc,
    body_checksum,
    check_checksum,
    dataclasses_replace,
    dumps_with_checksum,
    load_json,
    redundancy_to_doc,
    text_checksum_ok,
)

__all__ = ["Layout", "StepManifest", "shards_digest", "assemble", "assemble_any", "split", "load_node_manifest",
           "merge_parity", "pool_groups"]


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
    _cache_layout(key, layout)
    return layout


def _cache_layout(key: bytes, layout: Layout) -> None:
    """``layout`` under ``key`` (the sha256 of its file's bytes), the most recently used, the
    oldest dropped past :data:`_LAYOUT_CACHE_SIZE`."""
    _layouts.pop(key, None)  # re-inserted below: the most recently used is last
    while len(_layouts) >= _LAYOUT_CACHE_SIZE:
        _layouts.pop(next(iter(_layouts)))
    _layouts[key] = layout


def remember_layout(text: bytes, layout: Layout) -> None:
    """Put ``layout``, which this process built and wrote as ``text`` (its ``to_json``), in the
    cache :func:`parse_layout` reads: a restore in the process that saved the step (an
    in-process recovery's survivor; the restore benchmark) then finds the file's bytes checked,
    instead of parsing and checking 0.05-0.1 s of a 1,177-entry layout (issue 39, profiled).
    Bytes other than these, a damaged copy's, are still parsed and checked."""
    import hashlib

    _cache_layout(hashlib.sha256(text).digest(), layout)


@dataclass(frozen=True)
class StepManifest:
    """A committed step in a node store (format 4): constant size whatever the world size.

    With parity groups (issue 40) a node's record also holds the groups that have a member on
    that node (``parity``: members, segment size, each member's parity size and crc32c) and,
    for each of their members, ``members[rank] = (shard size, index start)``: what rebuilding
    a lost member's index (and footer) from parity needs, since no surviving shard holds it;
    the rebuilt index is then checked by its footer's crc32c and, with every rank's, against
    ``shards_digest``. O(group size x local ranks) per node per step: flat in the world size."""

    job: str
    step: int
    world_size: int
    layout: str  # Layout.digest
    shards_digest: str  # shards_digest() of every rank's (size, index crc32c)
    total_bytes: int
    created: float = 0.0
    timings: Mapping[str, float] = field(default_factory=dict)
    parity: Redundancy | None = None
    members: Mapping[int, tuple[int, int]] = field(default_factory=dict)

    def for_ranks(self, ranks: Sequence[int]) -> StepManifest:
        """This record as a node holding ``ranks`` keeps it: only the parity groups that have a
        member among them (with their members' shard records)."""
        if self.parity is None:
            return self
        mine = set(ranks)
        groups = tuple(g for g in self.parity.groups if mine.intersection(g.members))
        members = {m: self.members[m] for g in groups for m in g.members}
        return dataclasses.replace(self, parity=dataclasses.replace(self.parity, groups=groups),
                                   members=members)

    def to_json(self) -> str:
        d: dict[str, Any] = {
            "format_version": NODE_FORMAT_VERSION, "kind": "step", "job": self.job,
            "step": self.step, "world_size": self.world_size, "layout": self.layout,
            "shards_digest": self.shards_digest, "total_bytes": self.total_bytes,
            "created": self.created, "timings": dict(self.timings),
        }
        if self.parity is not None:  # [size, index start] per member, in the groups' order
            d["parity"] = redundancy_to_doc(self.parity)
            d["parity_shards"] = [list(self.members[m]) for g in self.parity.groups for m in g.members]
        return dumps_with_checksum(d)

    @classmethod
    def from_doc(cls, d: dict[str, Any], *, where: str) -> StepManifest:
        p = _Parser(where)
        p.fields(d, "manifest", required={"format_version", "kind", "job", "step", "world_size",
                                          "layout", "shards_digest", "total_bytes", "checksum"},
                 optional={"created", "timings", "parity", "parity_shards"})
        layout = p.str_(d["layout"], "layout")
        digest = p.str_(d["shards_digest"], "shards_digest")
        if len(layout) != 16 or not all(c in "0123456789abcdef" for c in layout) \
                or not digest.startswith("sha256:"):
            raise p.fail("layout / shards_digest are not digests")
        world = p.int_(d["world_size"], "world_size", lo=1, hi=MAX_WORLD_SIZE)
        parity, members = None, {}
        if ("parity" in d) != ("parity_shards" in d):
            raise p.fail("parity and parity_shards come together")
        if "parity" in d:
            rows = [p.ints(row, f"parity_shards[{i}]")
                    for i, row in enumerate(p.list_(d["parity_shards"], "parity_shards"))]
            ranks = [p.int_(m, "parity.groups[].members[]", hi=world - 1)
                     for g in p.list_(p.obj(d["parity"], "parity").get("groups", []), "parity.groups")
                     for m in p.list_(p.obj(g, "parity.groups[]").get("members", []), "members")]
            if len(rows) != len(ranks) or any(len(v) != 2 or v[1] > v[0] for v in rows):
                raise p.fail("parity_shards must hold [size, index start <= size] for each member "
                             "of the parity groups, in their order")
            members = {r: (v[0], v[1]) for r, v in zip(ranks, rows, strict=True)}
            parity = _redundancy_from_doc(p, d["parity"], {r: v[0] for r, v in members.items()})
        return cls(job=p.str_(d["job"], "job"), step=p.int_(d["step"], "step"),
                   world_size=world, layout=layout, shards_digest=digest,
                   total_bytes=p.int_(d["total_bytes"], "total_bytes"),
                   created=float(p.num(d.get("created", 0.0), "created")),
                   timings={k: float(p.num(v, f"timings[{k!r}]"))
                            for k, v in p.obj(d.get("timings", {}), "timings").items()},
                   parity=parity, members=members)


def pool_groups(reds: Sequence[Redundancy | None]) -> Redundancy | None:
    """Parity groups pooled from several nodes' records: every group once (the first that has
    it), so a lost node's groups come from its surviving members' nodes (a format-4 node keeps
    only its own groups; a whole manifest has them all)."""
    found = [r for r in reds if r is not None]
    if not found:
        return None
    groups: dict[tuple[int, ...], Any] = {}
    for red in found:
        for g in red.groups:
            groups.setdefault(g.members, g)
    return dataclasses.replace(found[0], groups=tuple(groups.values()))


def merge_parity(records: Sequence[StepManifest]) -> tuple[Redundancy | None,
                                                            dict[int, tuple[int, int]]]:
    """:func:`pool_groups` of several nodes' step records, with their members' shard records."""
    members: dict[int, tuple[int, int]] = {}
    for m in records:
        for r, v in m.members.items():
            members.setdefault(r, v)
    return pool_groups([m.parity for m in records]), members


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
             where: str = "manifest", redundancy: Redundancy | None = None) -> Manifest:
    """The whole manifest of ``step`` from its layout and one shard record per rank (read from
    the shards' own indexes), checked against the step's digest: a stale, foreign or damaged
    shard index cannot pass for the committed one. Its parity groups are ``redundancy`` (pooled
    from several nodes' records by :func:`merge_parity`) or the step record's own."""
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
    red = redundancy if redundancy is not None else step.parity
    got = shards_digest([(r.size, r.index_crc32c) for r in ordered])
    if got != step.shards_digest:
        raise ManifestError(f"{where}: the shards' sizes and index crc32c do not match step "
                            f"{step.step}'s manifest: a shard is stale, foreign or damaged")
    m = Manifest(job=step.job, step=step.step, world_size=step.world_size,
                 shards=tuple(dataclasses_replace(r, rank=i, node=layout.nodes[i], replicas=())
                              for i, r in enumerate(ordered)),
                 entries=layout.entries, planner_data=layout.planner_data, mesh=layout.mesh,
                 timings=step.timings, created=step.created, state_kinds=layout.state_kinds,
                 redundancy=red, format_version=_PLAIN_FORMAT_VERSION if red is None else FORMAT_VERSION)
    _check_items_against_entries(m, where)
    return m


def assemble_any(layout: Layout, step: StepManifest,
                 candidates: Mapping[int, Sequence[ShardRecord]], *, where: str = "manifest",
                 tries: int = 256, redundancy: Redundancy | None = None) -> Manifest:
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
            return assemble(layout, step, pick, where=where, redundancy=redundancy)
        except ManifestError as e:
            last = e
            if "do not match" not in str(e):
                raise
    assert last is not None
    raise last
