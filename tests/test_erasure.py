"""Erasure codes of aegis.snapshot.erasure: every single XOR loss and every RS loss pattern the
parity covers is rebuilt bitwise; anything beyond is a clear error, never wrong bytes."""

from __future__ import annotations

import itertools

import crc32c
import numpy as np
import pytest

from aegis.errors import ConfigError, CorruptShardError
from aegis.snapshot.erasure import (
    RS_DEFAULT_EC_TYPE,
    RS_FALLBACK_EC_TYPE,
    SEGMENT_ALIGN,
    StripeLayout,
    UnrecoverableLossError,
    XorLayout,
    XorParity,
    rs_encode,
    rs_layout,
    rs_piece_size,
    rs_rebuild,
    rs_stripe_decode,
    rs_stripe_encode,
    rs_stripe_layout,
    stripe_layout,
    xor_encode,
    xor_layout,
    xor_rebuild,
    xor_segment,
)

pytestmark = pytest.mark.quick  # unit / single-process: make test-quick


def shards_of(lengths: list[int], seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in lengths]


def xor_group(shards: list[bytes]) -> tuple[XorLayout, dict[int, XorParity]]:
    """Encode as the replication layer would: each holder XORs only the segments it received."""
    layout = xor_layout([len(s) for s in shards])
    parities = {}
    for j in range(layout.members):
        received = {i: bytes(xor_segment(layout, i, j, shards[i])) for i in layout.contributors(j)}

        def from_wire(i: int, stripe: int, received: dict[int, bytes] = received) -> bytes:
            return received[i]

        parities[j] = xor_encode(layout, j, from_wire)
    return layout, parities


XOR_LENGTHS = [
    [3000, 0],
    [1, 5000],
    [4096, 4096, 4096],
    [0, 1, 7001],
    [12345, 0, 1, 9000],
    [2000, 64, 65, 3, 4097],
    [4096 * 6 + 1, 100, 0, 1, 50_000, 333],
]


@pytest.mark.parametrize("lengths", XOR_LENGTHS, ids=lambda ls: f"N{len(ls)}")
def test_xor_every_single_loss_is_rebuilt_bitwise(lengths: list[int]) -> None:
    shards = shards_of(lengths, seed=len(lengths))
    layout, parities = xor_group(shards)
    assert all(len(p.data) == layout.segment_size for p in parities.values())
    for x in range(layout.members):
        survivors = {i: s for i, s in enumerate(shards) if i != x}
        alive = {j: p for j, p in parities.items() if j != x}  # x's own parity went with it
        got = xor_rebuild(layout, x, survivors, alive, expected_crc32c=crc32c.crc32c(shards[x]))
        assert got == shards[x]
        # A replacement fetching only the segments rebuild_needs names gets the same bytes.
        needs = layout.rebuild_needs(x)

        def fetch(i: int, stripe: int, needs: dict[int, tuple[int, ...]] = needs) -> bytes:
            assert stripe in needs and i in needs[stripe]
            return bytes(xor_segment(layout, i, stripe, shards[i]))

        assert xor_rebuild(layout, [x], fetch, {j: alive[j] for j in needs},
                           expected_crc32c=crc32c.crc32c(shards[x])) == shards[x]


def test_xor_layout_sends_each_segment_to_another_member_once() -> None:
    layout = xor_layout([5000, 4000, 1, 0, 4999])
    for i in range(layout.members):
        stripes = [layout.stripe_of(i, s) for s in range(layout.members - 1)]
        assert sorted(stripes) == [j for j in range(layout.members) if j != i]
        # The segments tile the shard in order, without gaps.
        ranges = sorted(layout.segment_range(i, j) for j in stripes)
        assert ranges[0][0] == 0 and ranges[-1][1] == layout.lengths[i]
        assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6])
def test_xor_memory_factor(n: int) -> None:
    shard = 40_000
    layout, parities = xor_group(shards_of([shard] * n))
    for p in parities.values():
        assert len(p.data) / shard <= 1 / (n - 1) + SEGMENT_ALIGN / shard
    assert layout.segment_size * (n - 1) - shard < SEGMENT_ALIGN * (n - 1)


def test_xor_two_losses_is_a_clear_error() -> None:
    shards = shards_of([3000, 2000, 1000, 4000])
    layout, parities = xor_group(shards)
    with pytest.raises(UnrecoverableLossError, match=r"lost member\(s\) 1, 3.*one lost member") as e:
        xor_rebuild(layout, [1, 3], {0: shards[0], 2: shards[2]}, parities, expected_crc32c=0)
    assert e.value.lost == (1, 3) and e.value.coverable == 1
    # A survivor without its shard is a second loss too, named as such.
    with pytest.raises(UnrecoverableLossError, match=r"lost member\(s\) 1, 2"):
        xor_rebuild(layout, 1, {0: shards[0], 3: shards[3]}, parities, expected_crc32c=0)
    # So is a missing parity: member 1's bytes in stripe 2 cannot be recovered without it.
    alive = {j: p for j, p in parities.items() if j not in (1, 2)}
    with pytest.raises(UnrecoverableLossError, match=r"parity of stripe\(s\) \[2\]"):
        xor_rebuild(layout, 1, {i: shards[i] for i in (0, 2, 3)}, alive, expected_crc32c=0)


def test_xor_corrupt_parity_is_a_crc_error() -> None:
    shards = shards_of([3000, 2000, 1000])
    layout, parities = xor_group(shards)
    bad = bytearray(parities[2].data)
    bad[7] ^= 0x01
    parities[2] = XorParity(2, bytes(bad), parities[2].crc32c)
    with pytest.raises(CorruptShardError, match="stripe 2.*crc32c") as e:
        xor_rebuild(layout, 0, {1: shards[1], 2: shards[2]}, parities,
                    expected_crc32c=crc32c.crc32c(shards[0]), step=7)
    assert e.value.rank == 2 and e.value.step == 7


def test_xor_rebuilt_bytes_must_match_the_expected_crc() -> None:
    shards = shards_of([3000, 2000, 1000])
    layout, parities = xor_group(shards)
    stale = bytes(2000)  # member 1's shard from another snapshot (member 0's rebuild needs it)
    assert 1 in layout.rebuild_needs(0)[2]
    with pytest.raises(CorruptShardError, match="member 0 has crc32c") as e:
        xor_rebuild(layout, 0, {1: stale, 2: shards[2]}, parities,
                    expected_crc32c=crc32c.crc32c(shards[0]))
    assert e.value.rank == 0


def test_xor_encode_refuses_a_missing_segment() -> None:
    shards = shards_of([3000, 2000, 1000])
    layout = xor_layout([len(s) for s in shards])
    with pytest.raises(ValueError, match="no segment from member 2"):
        xor_encode(layout, 0, {1: shards[1]})


def test_xor_needs_two_members() -> None:
    with pytest.raises(ConfigError, match="at least 2"):
        xor_layout([100])


RS_LENGTHS = [30_000, 29_999, 1, 0]


@pytest.mark.parametrize("ec_type", [RS_DEFAULT_EC_TYPE, RS_FALLBACK_EC_TYPE])
def test_rs_every_pair_of_losses_is_rebuilt_bitwise(ec_type: str) -> None:
    pytest.importorskip("pyeclib")
    shards = shards_of(RS_LENGTHS, seed=4)
    parities = rs_encode(shards, parity=2, ec_type=ec_type)
    layout = parities[0].layout
    crcs = {i: crc32c.crc32c(s) for i, s in enumerate(shards)}
    # Any 2 of the 6 fragments (4 data + 2 parity) may be gone.
    fragments = [("d", i) for i in range(4)] + [("p", p) for p in range(2)]
    for gone in itertools.combinations(fragments, 2):
        lost = [i for kind, i in gone if kind == "d"]
        survivors = {i: s for i, s in enumerate(shards) if i not in lost}
        alive = [p for p in parities if ("p", p.index) not in gone]
        got = rs_rebuild(layout, survivors, alive, lost, expected_crc32c=crcs)
        assert got == {i: shards[i] for i in lost}, gone


def test_rs_three_losses_is_a_clear_error() -> None:
    pytest.importorskip("pyeclib")
    shards = shards_of(RS_LENGTHS, seed=5)
    parities = rs_encode(shards, parity=2)
    layout = parities[0].layout
    with pytest.raises(UnrecoverableLossError, match=r"member\(s\) \[0, 1, 3\].*at most 2") as e:
        rs_rebuild(layout, {2: shards[2]}, parities, [0, 1, 3], expected_crc32c={})
    assert e.value.lost == (0, 1, 3) and e.value.coverable == 2
    with pytest.raises(UnrecoverableLossError, match=r"\[0, 1\] and parity fragment\(s\) \[1\]"):
        rs_rebuild(layout, {2: shards[2], 3: shards[3]}, parities[:1], [0, 1], expected_crc32c={})


def test_rs_corrupt_parity_and_wrong_crc_are_errors() -> None:
    pytest.importorskip("pyeclib")
    shards = shards_of([5000, 6000, 7000, 8000], seed=6)
    parities = rs_encode(shards, parity=2)
    layout = parities[0].layout
    crcs = {i: crc32c.crc32c(s) for i, s in enumerate(shards)}
    p0 = parities[0]
    bad = bytearray(p0.fragment)
    bad[-1] ^= 0x80
    corrupt = type(p0)(p0.layout, p0.index, bytes(bad), p0.headers, p0.crc32c)
    with pytest.raises(CorruptShardError, match="RS parity fragment 0"):
        rs_rebuild(layout, {i: shards[i] for i in (2, 3)}, [corrupt, parities[1]], [0, 1],
                   expected_crc32c=crcs)
    with pytest.raises(CorruptShardError, match="member 0 has crc32c"):
        rs_rebuild(layout, {i: shards[i] for i in (1, 2, 3)}, parities, [0],
                   expected_crc32c={0: crcs[0] ^ 1})


def test_rs_memory_factor() -> None:
    pytest.importorskip("pyeclib")
    shard = 40_000
    for data, parity in [(4, 2), (4, 1), (6, 3)]:
        parities = rs_encode(shards_of([shard] * data), parity=parity)
        per_member = sum(p.nbytes for p in parities) / data
        # k/m, plus liberasurecode's small per-fragment headers and 64-byte alignment
        assert per_member / shard <= parity / data + 0.02


def test_rs_all_empty_shards() -> None:
    pytest.importorskip("pyeclib")
    parities = rs_encode([b"", b"", b""], parity=1)
    layout = rs_layout([0, 0, 0], 1)
    assert rs_rebuild(layout, {0: b"", 2: b""}, parities, [1], expected_crc32c={1: 0}) == {1: b""}


def test_rs_bad_parity_count_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="parity=0"):
        rs_layout([10, 10], 0)


def test_rs_unknown_backend_is_a_config_error() -> None:
    pytest.importorskip("pyeclib")
    with pytest.raises(ConfigError, match="ec_type 'no_such_rs'.*liberasurecode_rs_vand"):
        rs_encode([b"a" * 100, b"b" * 100], parity=1, ec_type="no_such_rs")


def test_rs_parity_from_another_group_is_refused() -> None:
    pytest.importorskip("pyeclib")
    shards = shards_of([1000, 1000, 1000], seed=7)
    other = rs_encode(shards_of([1000, 1000, 999], seed=8), parity=1)
    layout = rs_layout([1000, 1000, 1000], 1)
    with pytest.raises(ValueError, match="another group layout"):
        rs_rebuild(layout, {1: shards[1], 2: shards[2]}, other, [0],
                   expected_crc32c={0: crc32c.crc32c(shards[0])})


# -- RS over the stripe layout (what the snapshot engine stores) ---------------------------------


def _rs_group(lengths: list[int], parity: int) -> tuple[StripeLayout, list[bytes], dict[int, dict[int, bytes]]]:
    """Encode every stripe as the engine does; returns layout, shards, holder -> stripe -> piece."""
    layout = rs_stripe_layout(lengths, parity)
    shards = shards_of(lengths, seed=len(lengths) + parity)
    stored: dict[int, dict[int, bytes]] = {m: {} for m in range(layout.members)}
    for j in range(layout.members):
        segs = []
        for p in range(layout.data):
            i = layout.contributor_at(j, p)
            a, b = layout.segment_range(i, j)
            segs.append(shards[i][a:b])
        for q, piece in enumerate(rs_stripe_encode(layout, j, segs)):
            stored[layout.holders(j)[q]][j] = piece
    return layout, shards, stored


@pytest.mark.parametrize(("lengths", "parity"), [([5000, 4000, 1, 0, 4999, 4096], 2),
                                                  ([3000, 2999, 3001, 64, 128], 2),
                                                  ([700, 700, 700, 700, 700], 3)])
def test_rs_stripes_every_loss_pattern_is_rebuilt_bitwise(lengths: list[int], parity: int) -> None:
    layout, shards, stored = _rs_group(lengths, parity)
    n, d, size = layout.members, layout.data, layout.segment_size
    # every member stores k pieces of one segment (+ liberasurecode's headers) each
    for m in range(n):
        assert len(stored[m]) == parity
        assert sum(len(p) for p in stored[m].values()) == parity * rs_piece_size(layout)
    assert rs_piece_size(layout) < size + (d + 1) * 128
    for lost in itertools.combinations(range(n), parity):
        for x in lost:
            out = bytearray(d * size)
            for s in range(d):
                j = layout.stripe_of(x, s)
                pieces: dict[int, bytes] = {}
                for p in range(d):
                    i = layout.contributor_at(j, p)
                    if i not in lost:
                        a, b = layout.segment_range(i, j)
                        pieces[p] = shards[i][a:b]
                for q, h in enumerate(layout.holders(j)):
                    if h not in lost:
                        pieces[d + q] = stored[h][j]
                pos = layout.segment_for(x, j)
                assert pos == s
                out[s * size:(s + 1) * size] = rs_stripe_decode(layout, j, pieces, [pos])[pos]
            assert bytes(out[:lengths[x]]) == shards[x], (lost, x)


def test_rs_stripes_too_few_pieces_is_a_clear_error_and_k1_is_the_xor_layout() -> None:
    layout, shards, stored = _rs_group([900] * 5, 2)
    j = 0
    # contributors of stripe 0 are members 4, 3, 2; holders 0, 1. Lose 4, 3 and holder 0
    a, b = layout.segment_range(2, j)
    pieces = {2: shards[2][a:b], 4: stored[1][0]}
    with pytest.raises(UnrecoverableLossError, match="needs 3 to rebuild"):
        rs_stripe_decode(layout, j, pieces, [0])
    with pytest.raises(ConfigError, match="needs at least 4 members"):
        rs_stripe_layout([10, 10, 10], 2)
    assert rs_stripe_layout([10] * 5, 1).segment_size == xor_layout([10] * 5).segment_size
    x = xor_layout([5000, 4000, 1, 0, 4999])
    assert all(x.holders(j) == (j,) for j in range(5))


@pytest.mark.parametrize("lengths,parity", [([100_000, 90_000, 100_000, 77_777, 100_000, 100_000], 2),
                                            ([5000, 4096, 1, 0, 4999], 1)])
def test_rs_decode_is_the_sum_of_each_pieces_share(lengths: list[int], parity: int) -> None:
    """What the reduction rebuild (issue 40) relies on: the decode of a stripe is the XOR, over
    its surviving pieces, of the decode of that piece alone with the others zero (the zero
    stripe's parity pieces, encoded from empty segments, standing in for the parity pieces),
    for every loss pattern the code covers."""
    rng = np.random.default_rng(7)
    layout = stripe_layout(lengths, parity)
    d, k = layout.data, layout.parity
    shards = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in lengths]
    for j in range(layout.members):
        segs = []
        for p in range(d):
            lo, hi = layout.segment_range(layout.contributor_at(j, p), j)
            segs.append(shards[layout.contributor_at(j, p)][lo:hi])
        pieces = rs_stripe_encode(layout, j, segs)
        zero = rs_stripe_encode(layout, j, [b""] * d)
        for lost in itertools.combinations(range(d), min(k, d)):
            have = {p: segs[p] for p in range(d) if p not in lost}
            have.update({d + q: pieces[q] for q in range(k)})
            while len(have) > d:  # exactly d pieces, as the rebuild reads them
                have.pop(max(have))
            full = rs_stripe_decode(layout, j, have, list(lost))
            acc = {w: np.zeros(layout.segment_size, np.uint8) for w in lost}
            for key in have:
                alone = {kk: (v if kk == key else (b"" if kk < d else zero[kk - d]))
                         for kk, v in have.items()}
                for w, seg in rs_stripe_decode(layout, j, alone, list(lost)).items():
                    acc[w] ^= np.frombuffer(seg, np.uint8)
            for w in lost:
                assert acc[w].tobytes() == full[w], (j, lost, w)
                assert full[w][:len(segs[w])] == segs[w]
