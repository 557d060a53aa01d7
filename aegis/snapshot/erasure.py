"""Erasure codes for in-memory redundancy: survive a node loss without a full second copy.

Peer replication keeps a whole second copy of every shard (2x memory). A group of N members
can instead keep XOR parity (SCR's layout, issue 16): each member cuts its shard into N-1
segments and stores one parity segment, the XOR of one segment of every other member, so the
group survives any single loss at 1 + 1/(N-1) memory (1.25x for N=5). Reed-Solomon parity
(through pyeclib/liberasurecode, never hand-written field arithmetic) survives up to ``parity``
losses among ``data`` members at 1 + parity/data.

XOR layout for N members, with segment size ``S`` (the longest shard, padded up, over N-1)::

    segment s of member i  = bytes [s*S, (s+1)*S) of its shard, zero-padded past its length
    it feeds stripe        j = (i + 1 + s) mod N      (never i's own stripe)
    member j stores        parity_j = XOR of the segments of every member i != j feeding j

Who calls what: the replication layer plans with :func:`xor_layout` (pure, from the shard
lengths alone), each member sends ``xor_segment(layout, me, j, shard)`` to member j for every
other j, and member j calls :func:`xor_encode` on what it received. After member x is lost, a
replacement gathers, for every stripe j != x, parity_j and the survivors' segments for j (see
:meth:`XorLayout.rebuild_needs`) and calls :func:`xor_rebuild`. Rebuilt bytes are only returned
once they match the crc32c the caller recorded for the lost shard.

This module only computes: it moves no bytes between nodes and imports neither torch nor the
RS library until RS is used.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import crc32c as _crc32c
import numpy as np

from aegis.errors import AegisError, ConfigError, CorruptShardError

__all__ = [
    "SEGMENT_ALIGN",
    "Buffer",
    "SegmentSource",
    "UnrecoverableLossError",
    "StripeLayout",
    "XorLayout",
    "stripe_layout",
    "XorParity",
    "xor_layout",
    "xor_segment",
    "xor_encode",
    "xor_verify",
    "xor_rebuild",
    "xor_into",
    "RS_DEFAULT_EC_TYPE",
    "RS_FALLBACK_EC_TYPE",
    "RsLayout",
    "RsParity",
    "rs_layout",
    "rs_encode",
    "rs_verify",
    "rs_rebuild",
    "rs_stripe_layout",
    "rs_piece_size",
    "rs_stripe_encode",
    "rs_stripe_decode",
]

# Segment and fragment sizes are rounded up to this so every segment starts on a cache line
# and numpy XORs whole uint64 words; it costs at most 63 bytes of parity per member.
SEGMENT_ALIGN = 64

Buffer = bytes | bytearray | memoryview
# Where a member's segments come from: either the whole shard of each member (segments are cut
# locally), or a callable (member, stripe) -> that member's segment for that stripe, exactly as
# :func:`xor_segment` cut it (what a parity holder receives over the wire).
SegmentSource = Mapping[int, Buffer] | Callable[[int, int], Buffer]

_RS_PACKAGE = "pyeclib"
# ISA-L's Cauchy matrix: MDS for every loss pattern (ISA-L's plain Vandermonde is not, for
# larger parity counts) and SIMD-fast (4+2 encode here: 2.75 GB/s, liberasurecode's own
# rs_vand 0.68 GB/s). pyeclib's manylinux wheels bundle ISA-L.
RS_DEFAULT_EC_TYPE = "isa_l_rs_cauchy"
# Always in liberasurecode, slower; the choice for a pyeclib built without ISA-L.
RS_FALLBACK_EC_TYPE = "liberasurecode_rs_vand"


class UnrecoverableLossError(AegisError):
    """More members of a redundancy group are lost than its parity can rebuild.

    ``lost`` lists the group members (data member indices, or ``parity p`` entries for RS
    parity fragments) that are gone; ``coverable`` is how many losses the parity survives.
    """

    def __init__(self, message: str, *, lost: Sequence[int | str], coverable: int) -> None:
        super().__init__(message)
        self.lost = tuple(lost)
        self.coverable = coverable


def _crc(data: Buffer, value: int = 0) -> int:
    return int(_crc32c.crc32c(data, value))


def _view(buf: Buffer) -> memoryview:
    """A flat byte view of any contiguous buffer (bytes, bytearray, mmap, numpy array)."""
    v = memoryview(buf)
    return v if v.format == "B" and v.ndim == 1 else v.cast("B")


def _align(n: int) -> int:
    return -(-n // SEGMENT_ALIGN) * SEGMENT_ALIGN


def _check_lengths(lengths: Sequence[int], what: str) -> tuple[int, ...]:
    out = tuple(int(n) for n in lengths)
    bad = [i for i, n in enumerate(out) if n < 0]
    if bad:
        raise ConfigError(f"{what}: shard lengths must be >= 0, member(s) {bad} have "
                          f"{[out[i] for i in bad]}")
    return out


def _xor_into(acc: np.ndarray, words: np.ndarray, data: memoryview) -> None:
    """acc[:len(data)] ^= data, on uint64 words where possible (8x fewer numpy element ops)."""
    n = len(data)
    nw = n // 8
    if nw:
        np.bitwise_xor(words[:nw], np.frombuffer(data, dtype=np.uint64, count=nw),
                       out=words[:nw])
    if n > nw * 8:
        tail = slice(nw * 8, n)
        np.bitwise_xor(acc[tail], np.frombuffer(data, dtype=np.uint8, offset=nw * 8),
                       out=acc[tail])


def _xor_all(out: bytearray | memoryview, parts: Sequence[memoryview]) -> None:
    """out ^= each of ``parts`` (each at most ``len(out)`` bytes, zero-padded to it)."""
    acc = np.frombuffer(out, dtype=np.uint8)
    words = acc[: len(acc) // 8 * 8].view(np.uint64)
    for p in parts:
        if len(p) > len(acc):
            raise ValueError(f"segment of {len(p)} bytes is longer than the {len(acc)}-byte "
                             f"stripe")
        _xor_into(acc, words, p)


# --------------------------------------------------------------------------------------------
# XOR parity (one loss per group)


@dataclass(frozen=True)
class StripeLayout:
    """Where every segment of an N-member parity group goes; pure data, from the lengths.

    ``lengths[i]`` is member i's real shard length; ``parity`` (k) is how many members lose
    and still rebuild; ``segment_size`` is the padded segment size. Each member cuts its shard
    into d = N - k segments; stripe j takes one segment from each of its d contributors
    (members j-1, ..., j-d) and its k parity pieces are stored on its holders, members
    j, j+1, ..., j+k-1 (all mod N), so every member holds k pieces (SCR's layout; k = 1 is
    XOR, where the one piece is the XOR of the segments). Segments past a member's length are
    zeros and are never sent. ``ec_type`` names the liberasurecode backend (RS only).
    """

    lengths: tuple[int, ...]
    segment_size: int
    parity: int = 1
    ec_type: str = ""

    @property
    def members(self) -> int:
        return len(self.lengths)

    @property
    def data(self) -> int:
        """Segments per member (= data pieces per stripe): N - k."""
        return self.members - self.parity

    @property
    def parity_size(self) -> int:
        """Bytes of XOR parity each member stores (RS: see :func:`rs_piece_size`)."""
        return self.segment_size

    def _member(self, member: int, what: str = "member") -> int:
        if not 0 <= member < self.members:
            raise ValueError(f"{what} {member} is not in this parity group of {self.members} "
                             f"members (0..{self.members - 1})")
        return member

    def stripe_of(self, member: int, segment: int) -> int:
        """The stripe that ``member``'s ``segment`` feeds (XOR: the member storing its parity)."""
        self._member(member)
        if not 0 <= segment < self.data:
            raise ValueError(f"segment {segment}: a member of a {self.members}-member group with "
                             f"{self.parity} parity has segments 0..{self.data - 1}")
        return (member + 1 + segment) % self.members

    def segment_for(self, member: int, stripe: int) -> int:
        """Which of ``member``'s segments feeds ``stripe`` (never a stripe it holds parity of);
        also its data position in the stripe."""
        self._member(member)
        self._member(stripe, "stripe")
        s = (stripe - member - 1) % self.members
        if s >= self.data:
            raise ValueError(f"member {member} stores parity of stripe {stripe}, so none of its "
                             f"own segments feed it")
        return s

    def contributor_at(self, stripe: int, position: int) -> int:
        """The member whose segment is data position ``position`` of ``stripe``."""
        self._member(stripe, "stripe")
        return (stripe - 1 - position) % self.members

    def holders(self, stripe: int) -> tuple[int, ...]:
        """The members storing parity piece 0..k-1 of ``stripe``."""
        self._member(stripe, "stripe")
        return tuple((stripe + q) % self.members for q in range(self.parity))

    def held_stripes(self, member: int) -> tuple[int, ...]:
        """The stripes whose parity piece q (q = 0..k-1, in order) ``member`` stores."""
        self._member(member)
        return tuple((member - q) % self.members for q in range(self.parity))

    def segment_range(self, member: int, stripe: int) -> tuple[int, int]:
        """Byte range [start, stop) of ``member``'s shard that feeds ``stripe``, clipped to the
        real length (start == stop: nothing to send, the padded segment is all zeros)."""
        s = self.segment_for(member, stripe)
        n = self.lengths[member]
        start = min(s * self.segment_size, n)
        return start, min(start + self.segment_size, n)

    def contributors(self, stripe: int) -> tuple[int, ...]:
        """Members whose segment for ``stripe`` is not empty: what the holder must receive."""
        out = []
        for p in range(self.data):
            i = self.contributor_at(stripe, p)
            start, stop = self.segment_range(i, stripe)
            if stop > start:
                out.append(i)
        return tuple(sorted(out))

    def rebuild_needs(self, lost: int) -> dict[int, tuple[int, ...]]:
        """XOR: for rebuilding ``lost``, stripe j -> the surviving members whose segment for j
        is needed (along with parity_j, stored on member j). Stripes that carry nothing of the
        lost member are left out."""
        self._member(lost)
        needs: dict[int, tuple[int, ...]] = {}
        for j in range(self.members):
            if j == lost:
                continue
            start, stop = self.segment_range(lost, j)
            if stop > start:
                needs[j] = tuple(i for i in self.contributors(j) if i != lost)
        return needs


XorLayout = StripeLayout  # the k = 1 case


def xor_into(out: Buffer, data: Buffer) -> None:
    """``out[:len(data)] ^= data`` in place (``out`` writable): one member's segment folded
    into a parity buffer as it arrives, so a holder needs one segment of scratch, not N-1."""
    _xor_all(_view(out), [_view(data)])


@dataclass(frozen=True)
class XorParity:
    """The parity segment of ``stripe``, stored on member ``stripe``, with its crc32c."""

    stripe: int
    data: bytes
    crc32c: int


def xor_layout(lengths: Sequence[int]) -> XorLayout:
    """Plan XOR parity for a group whose member i holds a shard of ``lengths[i]`` bytes.

    Needs at least 2 members; with 2 it degenerates to mirroring (each parity is the other's
    shard), which is what 1/(N-1) means for N=2.
    """
    lens = _check_lengths(lengths, "xor_layout")
    if len(lens) < 2:
        raise ConfigError(f"XOR parity group of {len(lens)} member(s): a group needs at least 2 "
                          f"members (one to lose, one to rebuild from); group more ranks")
    return stripe_layout(lens, 1)


def stripe_layout(lengths: Sequence[int], parity: int = 1, *, ec_type: str = "") -> StripeLayout:
    """Plan a parity group of N = len(lengths) members surviving ``parity`` losses: segments of
    the longest shard over N - parity, padded to :data:`SEGMENT_ALIGN`."""
    lens = _check_lengths(lengths, "stripe_layout")
    if parity < 1:
        raise ConfigError(f"parity={parity}: must be >= 1 (the number of losses to survive)")
    if len(lens) - parity < 1:
        raise ConfigError(f"a parity group of {len(lens)} members cannot hold {parity} parity "
                          f"pieces per stripe: it needs at least {parity + 1} members (more "
                          f"members per group, or less parity)")
    longest = max(lens)
    return StripeLayout(lens, _align(-(-longest // (len(lens) - parity))) if longest else 0,
                        parity, ec_type)


def xor_segment(layout: XorLayout, member: int, stripe: int, shard: Buffer) -> memoryview:
    """The bytes ``member`` sends to member ``stripe`` for its parity (a zero-copy view; may be
    shorter than ``layout.segment_size`` or empty: the rest is implicit zeros)."""
    v = _view(shard)
    if len(v) != layout.lengths[member]:
        raise ValueError(f"member {member}'s shard is {len(v)} bytes but the XOR layout was "
                         f"planned for {layout.lengths[member]}; plan again with xor_layout")
    start, stop = layout.segment_range(member, stripe)
    return v[start:stop]


def _segment(layout: XorLayout, source: SegmentSource, member: int, stripe: int) -> memoryview:
    start, stop = layout.segment_range(member, stripe)
    if stop == start:
        return memoryview(b"")
    if callable(source):
        seg = _view(source(member, stripe))
        if len(seg) != stop - start:
            raise ValueError(f"member {member}'s segment for stripe {stripe} is {len(seg)} bytes, "
                             f"the layout expects {stop - start}; cut it with xor_segment")
        return seg
    if member not in source:
        raise KeyError(member)
    return xor_segment(layout, member, stripe, source[member])


def xor_encode(layout: XorLayout, stripe: int, source: SegmentSource) -> XorParity:
    """Parity of ``stripe``, computed by member ``stripe`` from the other members' segments.

    ``source`` gives the segment of every member in ``layout.contributors(stripe)``; a missing
    one is an error (never silently taken as zeros, which would store wrong parity).
    """
    parts = []
    for i in layout.contributors(stripe):
        try:
            parts.append(_segment(layout, source, i, stripe))
        except KeyError:
            raise ValueError(f"xor_encode of stripe {stripe}: no segment from member {i}; every "
                             f"member in {list(layout.contributors(stripe))} must send one") from None
    out = bytearray(layout.segment_size)
    _xor_all(out, parts)
    data = bytes(out)
    return XorParity(stripe, data, _crc(data))


def xor_verify(parity: XorParity, *, layout: XorLayout | None = None, step: int = -1) -> None:
    """Raise :class:`CorruptShardError` if ``parity``'s bytes do not match its crc32c (or, given
    the layout, its size). ``step`` only labels the error."""
    if layout is not None and len(parity.data) != layout.segment_size:
        raise CorruptShardError(
            f"XOR parity of stripe {parity.stripe} is {len(parity.data)} bytes, the layout "
            f"expects {layout.segment_size}: it is truncated or from another snapshot; drop it",
            step=step, rank=parity.stripe, where=f"xor parity stripe {parity.stripe}")
    got = _crc(parity.data)
    if got != parity.crc32c:
        raise CorruptShardError(
            f"XOR parity of stripe {parity.stripe} (stored on member {parity.stripe}) has crc32c "
            f"{got:#010x}, recorded {parity.crc32c:#010x}: the parity is corrupt and cannot be "
            f"used to rebuild; fall back to the durable copy",
            step=step, rank=parity.stripe, where=f"xor parity stripe {parity.stripe}")


def xor_rebuild(layout: XorLayout, lost: int | Collection[int], source: SegmentSource,
                parities: Mapping[int, XorParity], *, expected_crc32c: int,
                step: int = -1) -> bytes:
    """Rebuild the shard of the one ``lost`` member from the survivors' segments and parity.

    ``source`` gives the survivors' segments (see :data:`SegmentSource`; a mapping that lacks a
    needed survivor counts that survivor as lost too); ``parities`` maps stripe -> parity for
    the stripes in ``layout.rebuild_needs(lost)``. Every parity used is crc-checked first, and
    the rebuilt shard is returned only if its crc32c equals ``expected_crc32c``.

    Raises :class:`UnrecoverableLossError` for more than one loss (XOR covers one per group),
    :class:`CorruptShardError` for a corrupt parity or a rebuilt shard with the wrong crc32c.
    """
    lost_set = sorted({lost} if isinstance(lost, int) else set(lost))
    if not lost_set:
        raise ValueError("xor_rebuild: no lost member given, nothing to rebuild")
    for x in lost_set:
        layout._member(x)
    needs = layout.rebuild_needs(lost_set[0]) if len(lost_set) == 1 else {}
    if not callable(source):  # a survivor the caller has no shard for is lost as well
        lost_set += sorted({i for ids in needs.values() for i in ids if i not in source})
    missing_parity = sorted(j for j in needs if j not in parities and j not in lost_set)
    if len(lost_set) != 1 or missing_parity:
        gone = ", ".join(str(i) for i in lost_set)
        also = (f" and the parity of stripe(s) {missing_parity} (stored on those members)"
                if missing_parity else "")
        raise UnrecoverableLossError(
            f"XOR group of {layout.members} members lost member(s) {gone}{also}; XOR parity "
            f"rebuilds one lost member per group: restore from the durable tier (or use RS "
            f"parity, which covers more losses)",
            lost=[*lost_set, *(f"parity {j}" for j in missing_parity)], coverable=1)
    x = lost_set[0]
    out = bytearray(layout.lengths[x])
    view = memoryview(out)
    for j, survivors in needs.items():
        p = parities[j]
        if p.stripe != j:
            raise ValueError(f"parities[{j}] holds the parity of stripe {p.stripe}")
        xor_verify(p, layout=layout, step=step)
        start, stop = layout.segment_range(x, j)
        parts = [memoryview(p.data)[: stop - start]]
        parts += [_segment(layout, source, i, j)[: stop - start] for i in survivors]
        _xor_all(view[start:stop], parts)
    rebuilt = bytes(out)
    _check_rebuilt(rebuilt, x, expected_crc32c, step, "XOR")
    return rebuilt


def _check_rebuilt(data: Buffer, member: int, expected: int, step: int, code: str) -> None:
    got = _crc(data)
    if got != expected:
        raise CorruptShardError(
            f"{code}-rebuilt shard of member {member} has crc32c {got:#010x}, expected "
            f"{expected:#010x}: a survivor's segment or a parity does not belong to the same "
            f"snapshot (or the expected crc32c is wrong); do not restore from it, use the "
            f"durable copy",
            step=step, rank=member, where=f"{code} rebuild of member {member}")


# --------------------------------------------------------------------------------------------
# Reed-Solomon parity (several losses per group), through pyeclib / liberasurecode


_local = threading.local()


def _rs_driver(layout: RsLayout) -> Any:
    """A per-thread pyeclib driver (liberasurecode instances are not documented as shareable)."""
    cache = getattr(_local, "rs", None)
    if cache is None:
        cache = _local.rs = {}
    data, parity, ec_type = layout.data, layout.parity, layout.ec_type
    d = cache.get((data, parity, ec_type))
    if d is None:
        try:
            from pyeclib.ec_iface import ECDriver
        except ImportError as e:
            raise ConfigError(f"Reed-Solomon parity needs the {_RS_PACKAGE!r} package "
                              f"(liberasurecode bundled): pip install {_RS_PACKAGE}; "
                              f"or use XOR parity") from e
        try:
            # pyeclib's k is the number of data fragments and m the number of parity fragments.
            d = ECDriver(k=data, m=parity, ec_type=ec_type, chksum_type="none")
        except Exception as e:
            raise ConfigError(f"Reed-Solomon {data}+{parity} with ec_type {ec_type!r} is not "
                              f"available: {e}; choose fewer data members or parity, or "
                              f"ec_type={RS_FALLBACK_EC_TYPE!r} if this {_RS_PACKAGE} lacks "
                              f"ISA-L") from e
        cache[(data, parity, ec_type)] = d
    return d


@dataclass(frozen=True)
class RsLayout:
    """An RS group: ``lengths[i]`` is data member i's real shard length, ``parity`` the number
    of parity fragments, each ``fragment_size`` bytes (the longest shard, padded up), encoded
    with liberasurecode backend ``ec_type`` (fragments only decode with the backend that made
    them, so it is recorded, not assumed)."""

    lengths: tuple[int, ...]
    parity: int
    fragment_size: int
    ec_type: str = RS_DEFAULT_EC_TYPE

    @property
    def data(self) -> int:
        return len(self.lengths)


@dataclass(frozen=True)
class RsParity:
    """Parity fragment ``index`` (0..parity-1) of an RS group.

    ``fragment`` is liberasurecode's fragment (its small header, then ``fragment_size`` bytes
    of parity); ``headers`` holds the headers liberasurecode gave the data fragments, which its
    decoder needs to accept the survivors' shards as fragments. ``crc32c`` covers both.
    """

    layout: RsLayout
    index: int
    fragment: bytes
    headers: bytes
    crc32c: int

    @property
    def nbytes(self) -> int:
        return len(self.fragment) + len(self.headers)


def rs_layout(lengths: Sequence[int], parity: int, *,
              ec_type: str = RS_DEFAULT_EC_TYPE) -> RsLayout:
    """Plan RS parity over data members with shard ``lengths``; survives ``parity`` losses."""
    lens = _check_lengths(lengths, "rs_layout")
    if len(lens) < 2:
        raise ConfigError(f"RS group of {len(lens)} data member(s): needs at least 2 (with one, "
                          f"replicate instead)")
    if parity < 1:
        raise ConfigError(f"RS parity={parity}: must be >= 1 (the number of losses to survive)")
    return RsLayout(lens, int(parity), _align(max(lens)), ec_type)


def _padded(shard: memoryview, size: int) -> list[Buffer]:
    """``shard`` zero-padded to ``size``, as parts for one ``b"".join`` (a single copy)."""
    return [shard, bytes(size - len(shard))] if len(shard) < size else [shard]


def rs_encode(shards: Sequence[Buffer], parity: int = 2, *,
              ec_type: str = RS_DEFAULT_EC_TYPE) -> list[RsParity]:
    """Parity fragments 0..parity-1 over ``shards`` (data member i holds ``shards[i]``).

    Called wherever the whole group's shards are at hand (the replication layer decides where
    each parity fragment is stored). Shorter shards are zero-padded to the longest.
    """
    views = [_view(s) for s in shards]
    layout = rs_layout([len(v) for v in views], parity, ec_type=ec_type)
    size = layout.fragment_size
    if size == 0:
        return [RsParity(layout, p, b"", b"", 0) for p in range(layout.parity)]
    # pyeclib takes one bytes object and cuts it into ``data`` equal fragments.
    frags = _rs_driver(layout).encode(b"".join(part for v in views for part in _padded(v, size)))
    header = len(frags[0]) - size
    # Rebuild hands the survivors' own shards to the decoder as fragments; that is only right
    # while fragment i is exactly header + padded shard i. Check the framing we rely on.
    if (len(frags) != layout.data + layout.parity or header < 0
            or any(len(f) != header + size for f in frags)
            or any(frags[i][header:header + 64] != b"".join(_padded(v[:64], min(64, size)))
                   for i, v in enumerate(views))):
        raise AegisError(f"{_RS_PACKAGE} returned fragments laid out other than one padded "
                         f"shard per data fragment; this {_RS_PACKAGE} version is unsupported")
    headers = b"".join(f[:header] for f in frags[: layout.data])
    out = []
    for p in range(layout.parity):
        frag = frags[layout.data + p]
        out.append(RsParity(layout, p, frag, headers, _crc(headers, _crc(frag))))
    return out


def rs_verify(parity: RsParity, *, step: int = -1) -> None:
    """Raise :class:`CorruptShardError` if ``parity`` does not match its crc32c."""
    got = _crc(parity.headers, _crc(parity.fragment))
    if got != parity.crc32c:
        raise CorruptShardError(
            f"RS parity fragment {parity.index} has crc32c {got:#010x}, recorded "
            f"{parity.crc32c:#010x}: the parity is corrupt and cannot be used to rebuild",
            step=step, rank=-1, where=f"rs parity {parity.index}")


def rs_rebuild(layout: RsLayout, shards: Mapping[int, Buffer], parities: Collection[RsParity],
               lost: Collection[int], *, expected_crc32c: Mapping[int, int],
               step: int = -1) -> dict[int, bytes]:
    """Rebuild the shards of the ``lost`` data members; returns member -> shard bytes.

    ``layout`` is the group's :func:`rs_layout` (recorded with the snapshot, so it is known
    even when every parity fragment is gone); ``shards`` maps every surviving data member to
    its shard; ``parities`` are the surviving parity fragments (each crc-checked before use).
    Each rebuilt shard is returned only if its crc32c equals ``expected_crc32c[member]``.
    Raises :class:`UnrecoverableLossError` when lost data members plus lost parity fragments
    exceed the group's parity count.
    """
    by_index: dict[int, RsParity] = {}
    for p in parities:
        if p.layout != layout:
            raise ValueError(f"RS parity fragment {p.index} was encoded for another group "
                             f"layout ({p.layout}), not {layout}: it is from another snapshot")
        by_index[p.index] = p
    lost_set = set(lost)
    bad = sorted(i for i in lost_set | set(shards) if not 0 <= i < layout.data)
    if bad:
        raise ValueError(f"member(s) {bad} are not data members of this RS group "
                         f"(0..{layout.data - 1})")
    overlap = sorted(lost_set & set(shards))
    if overlap:
        raise ValueError(f"member(s) {overlap} are both lost and given as survivors")
    gone_data = sorted(lost_set | (set(range(layout.data)) - set(shards)))
    gone_parity = [p for p in range(layout.parity) if p not in by_index]
    if len(gone_data) + len(gone_parity) > layout.parity:
        also = f" and parity fragment(s) {gone_parity}" if gone_parity else ""
        raise UnrecoverableLossError(
            f"RS {layout.data}+{layout.parity} group lost data member(s) {gone_data}{also}: "
            f"{len(gone_data) + len(gone_parity)} losses, its parity rebuilds at most "
            f"{layout.parity}; restore from the durable tier",
            lost=gone_data + [f"parity {p}" for p in gone_parity], coverable=layout.parity)
    missing_crc = sorted(lost_set - set(expected_crc32c))
    if missing_crc:
        raise ValueError(f"no expected crc32c for lost member(s) {missing_crc}: rebuilt bytes "
                         f"are only returned once checked")
    for i, s in shards.items():
        if len(_view(s)) != layout.lengths[i]:
            raise ValueError(f"member {i}'s shard is {len(_view(s))} bytes, the RS layout "
                             f"records {layout.lengths[i]}: it is from another snapshot")
    for p in by_index.values():
        rs_verify(p, step=step)
    want = sorted(lost_set)
    rebuilt = _rs_reconstruct(layout, shards, by_index, want)
    for i in want:
        _check_rebuilt(rebuilt[i], i, expected_crc32c[i], step, "RS")
    return rebuilt


def _rs_reconstruct(layout: RsLayout, shards: Mapping[int, Buffer], by_index: Mapping[int, RsParity],
                    want: list[int]) -> dict[int, bytes]:
    """The lost data members ``want`` from the surviving ``shards`` and parity fragments
    (``by_index``, at least one, enough of them: the callers check). Unchecked bytes."""
    size = layout.fragment_size
    if size == 0:
        return {i: b"" for i in want}
    if not want:
        return {}
    first = by_index[min(by_index)]
    header = len(first.fragment) - size
    heads = first.headers
    frags = [b"".join([heads[i * header:(i + 1) * header], *_padded(_view(s), size)])
             for i, s in sorted(shards.items())]
    frags += [p.fragment for _, p in sorted(by_index.items())]
    try:
        got = _rs_driver(layout).reconstruct(frags, want)
    except Exception as e:  # pyeclib's ECDriverError: no fitting aegis class to keep
        raise AegisError(f"{_RS_PACKAGE} could not rebuild member(s) {want}: {e}") from e
    return {i: bytes(memoryview(frag)[header:header + layout.lengths[i]])
            for i, frag in zip(want, got, strict=True)}


# --------------------------------------------------------------------------------------------
# Reed-Solomon over a stripe layout: what the snapshot engine stores (issue 16)
#
# A group of N members with k parity uses :class:`StripeLayout`'s stripes: stripe j's d = N-k
# data pieces are its contributors' segments (data position p = the contributor's segment
# index), zero-padded to the segment size S; RS over them gives k parity fragments, piece q
# stored on holder ``holders(j)[q]``. A stored piece is liberasurecode's parity fragment
# (header + S bytes) followed by the headers of the d data fragments (its decoder wants them
# to accept the contributors' raw segments), so each member stores k * rs_piece_size bytes,
# k/d of its shard: 1.5x for 4+2. Rebuild works a stripe at a time, from any d of its N pieces.


def rs_stripe_layout(lengths: Sequence[int], parity: int, *,
                     ec_type: str = RS_DEFAULT_EC_TYPE) -> StripeLayout:
    """Plan RS parity over a group whose member i holds ``lengths[i]`` bytes: survives any
    ``parity`` lost members (needs at least ``parity + 2`` members: d >= 2 data per stripe)."""
    if len(lengths) < parity + 2:
        raise ConfigError(f"RS group of {len(lengths)} members with {parity} parity: needs at "
                          f"least {parity + 2} members (2 data pieces per stripe); group more "
                          f"nodes, lower the parity, or use XOR / replicas")
    return stripe_layout(lengths, parity, ec_type=ec_type)


def _stripe_rs(layout: StripeLayout) -> RsLayout:
    return RsLayout((layout.segment_size,) * layout.data, layout.parity, layout.segment_size,
                    layout.ec_type or RS_DEFAULT_EC_TYPE)


def _rs_header(layout: StripeLayout) -> int:
    """Bytes of liberasurecode's fragment header for this code."""
    rs = _stripe_rs(layout)
    return _rs_header_of(rs.data, rs.parity, rs.ec_type)


@functools.cache
def _rs_header_of(data: int, parity: int, ec_type: str) -> int:
    """Found once per process, by encoding one small stripe."""
    frags = rs_encode([bytes(SEGMENT_ALIGN)] * data, parity, ec_type=ec_type)
    return len(frags[0].fragment) - SEGMENT_ALIGN


def rs_piece_size(layout: StripeLayout) -> int:
    """Bytes of one stored RS parity piece: fragment header + segment + d data headers."""
    if layout.segment_size == 0:
        return 0
    h = _rs_header(layout)
    return h + layout.segment_size + layout.data * h


def _pad(seg: Buffer, size: int) -> Buffer:
    v = _view(seg)
    if len(v) > size:
        raise ValueError(f"segment of {len(v)} bytes is longer than the {size}-byte stripe")
    return v if len(v) == size else b"".join(_padded(v, size))


def rs_stripe_encode(layout: StripeLayout, stripe: int, segments: Sequence[Buffer]) -> list[bytes]:
    """The k parity pieces of ``stripe``; ``segments[p]`` is data position p's segment (as cut
    by ``segment_range``, possibly short or empty: zero-padded). Piece q is stored on
    ``layout.holders(stripe)[q]``."""
    layout._member(stripe, "stripe")
    if len(segments) != layout.data:
        raise ValueError(f"rs_stripe_encode of stripe {stripe}: {len(segments)} segments, the "
                         f"layout has {layout.data} data positions")
    size = layout.segment_size
    if size == 0:
        return [b""] * layout.parity
    rs = _stripe_rs(layout)
    parities = rs_encode([_pad(s, size) for s in segments], rs.parity, ec_type=rs.ec_type)
    pieces = [p.fragment + p.headers for p in parities]
    if any(len(p) != rs_piece_size(layout) for p in pieces):
        raise AegisError(f"{_RS_PACKAGE} fragment headers changed size within one process")
    return pieces


def rs_stripe_decode(layout: StripeLayout, stripe: int, pieces: Mapping[int, Buffer],
                     want: Collection[int]) -> dict[int, bytes]:
    """Rebuild the data positions ``want`` of ``stripe`` from surviving pieces: ``pieces`` maps
    data position p (0..d-1, a contributor's segment, possibly short: zero-padded) or
    d + q (parity piece q, as stored) to its bytes. Returns position -> the padded segment.

    The bytes are unchecked here (a stripe has no checksum of its own): the caller checks
    them against the shard's chunk crc32c before use. Raises :class:`UnrecoverableLossError`
    when fewer than d pieces survive besides ``want``.
    """
    d, k, size = layout.data, layout.parity, layout.segment_size
    want = sorted(set(want))
    if any(not 0 <= p < d for p in want):
        raise ValueError(f"positions {want}: only data positions 0..{d - 1} are rebuilt")
    data = {p: _pad(b, size) for p, b in pieces.items() if p < d and p not in want}
    par = {p - d: _view(b) for p, b in pieces.items() if d <= p < d + k}
    gone = [p for p in range(d) if p not in data]
    if len(gone) + (k - len(par)) > k:
        raise UnrecoverableLossError(
            f"stripe {stripe} of a {layout.members}-member RS group ({d}+{k}) has "
            f"{len(data) + len(par)} of its {d + k} pieces: it needs {d} to rebuild; restore "
            f"from the durable tier", lost=[*gone, *(f"parity {q}" for q in range(k) if q not in par)],
            coverable=k)
    if size == 0 or not want:
        return {p: bytes(size) for p in want}
    rs = _stripe_rs(layout)
    piece = rs_piece_size(layout)
    h = (piece - size) // (d + 1)  # piece = h + S + d * h
    parities = {}
    for q, v in par.items():
        if len(v) != piece:
            raise ValueError(f"RS parity piece {q} of stripe {stripe} is {len(v)} bytes, "
                             f"expected {piece}: it is from another snapshot or damaged")
        frag, heads = bytes(v[:h + size]), bytes(v[h + size:])
        parities[q] = RsParity(rs, q, frag, heads, _crc(heads, _crc(frag)))
    return _rs_reconstruct(rs, data, parities, want)
