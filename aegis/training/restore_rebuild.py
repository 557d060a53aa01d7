"""Recovery, step 3 for a shard no node holds: rebuilt from its parity group's survivors (XOR,
Reed-Solomon), only the stripes of the byte ranges the restore reads, reduced along a chain of
the survivors (issue 40), verified on arrival.
"""

from __future__ import annotations

import contextlib
import dataclasses
import mmap
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from aegis._dist import Group
from aegis.errors import (
    CorruptShardError,
    ManifestError,
)
from aegis.snapshot.erasure import (
    StripeLayout,
    rs_piece_size,
    rs_stripe_decode,
    rs_stripe_encode,
    xor_into,
)
from aegis.snapshot.manifest import (
    ChunkRecord,
    Manifest,
    Redundancy,
    ShardRecord,
)
from aegis.snapshot.node_store import NodeStore, Slot
from aegis.snapshot.shard import FOOTER_SIZE, decode_footer, decode_index
from aegis.snapshot.transport import Recv, Send, Transport
from aegis.training.restore_fetch import (
    REBUILD,
    _check_partial,
    _fixed,
    _map_local,
    _runs,
)

_Part = tuple[str, int, int, int]  # ("shard" | "parity", member index, lo, hi) of a file


def _run_rebuilds(
    store: NodeStore,
    group: Group,
    transport: Transport,
    manifest: Manifest,
    jobs: list[tuple[int, str, str, set[int] | None]],
    worker: Callable[[str, int], int],
    holders: Callable[[int], list[str]],
    parity_holders: Callable[[int], list[str]],
    *,
    tails: dict[int, ShardRecord] | None = None,
) -> list[tuple[int, str, str, str | None, int, float, bool]]:
    """Rebuild lost shards from their parity groups (collective, like a transfer round).

    With ``tails``, each job's ``manifest`` record of the lost shard is a skeleton (its size and
    one chunk ending where its index starts) and only the index and footer are rebuilt: the
    receiver checks them (:func:`_rebuilt_record`) and puts the shard's record in ``tails``
    (:func:`_rebuild_tails`).

    For each job (shard ``s`` for node ``dst``, the chunks its DCP plan reads), only what
    covers the byte runs of those chunks plus the shard's index is rebuilt. XOR: each run is
    cut at the group's segment boundaries; a piece is the XOR of the parity of its stripe and
    the same bytes of every surviving contributor. RS: each segment the runs touch is decoded
    from d surviving pieces of its stripe (the other contributors' segments first, then
    parity pieces). Each piece is reduced along a chain of the ranks that hold its parts
    (read from their own node stores), ending at the receiving rank: a link adds its share
    (XOR: its parts; RS: the decode of its pieces alone) to the sum it received and sends it
    on, so the receiver gets the rebuilt bytes once, not d pieces. The receiver writes the sums
    into a sparse partial file; every rebuilt chunk's crc32c and the index are then checked
    against the manifest before the file may be loaded. The parity files used are first
    checked against their recorded crc32c by the ranks that hold them. Per rebuild: inbound
    about 1x the rebuilt bytes on the receiver and on each link, rounds = the longest chain
    (at most the group's members), independent of the world size."""
    step = manifest.step
    red = manifest.redundancy
    assert red is not None
    scheme = red.scheme
    me = group.rank
    t0 = time.perf_counter()
    files: dict[tuple[str, int], torch.Tensor | None] = {}
    opened: list[mmap.mmap] = []

    def local(kind: str, r: int) -> torch.Tensor | None:
        if (kind, r) not in files:
            path = store.shard_path(step, r) if kind == "shard" else store.parity_path(step, r, scheme)
            files[(kind, r)], m = _map_local(path)
            if m is not None:
                opened.append(m)
        return files[(kind, r)]

    def source(kind: str, r: int, dst: str) -> str:
        nodes = holders(r) if kind == "shard" else parity_holders(r)
        return dst if dst in nodes else nodes[0]

    def lost(g: Any) -> set[int]:  # member indices whose shard no node holds
        return {i for i, m in enumerate(g.members) if not holders(m)}

    def no_parity(g: Any) -> set[int]:  # member indices whose parity file no node holds
        return {i for i, m in enumerate(g.members) if not parity_holders(m)}

    # 1. every parity file held for the groups involved, checked where it is held
    checks = sorted({(r, source("parity", r, dst), g.stored, g.parity_crc32c[i])
                     for s, _, dst, _ in jobs for g in [red.group_of(s)] if g is not None
                     for i, r in enumerate(g.members) if parity_holders(r)})
    mine = []
    for r, n, size, crc in checks:
        if worker(n, r) == me:
            try:
                store.verify_parity(step, r, size, crc, scheme)
            except CorruptShardError as e:
                mine.append((r, f"{n}: {e}"))
    bad = dict(x for xs in group.all_gather(mine, "rebuild parity check") for x in xs)
    # 2. what each job reads: (kind, member index, lo, hi) per piece, per rebuilt range; RS
    # reads around missing or corrupt parity while the group's losses stay within k
    plans = []
    for s, _, dst, ids in jobs:
        g = red.group_of(s)
        assert g is not None
        layout = red.layout([manifest.shard(m).size for m in g.members])
        x = g.members.index(s)
        rec = manifest.shard(s)
        wanted = set(range(len(rec.chunks))) if ids is None else ids
        runs = _runs(list(rec.chunks), wanted, size=rec.size)
        corrupt = {i for i, m in enumerate(g.members) if m in bad}
        if scheme == "rs":
            ranges = (_rs_ranges(layout, x, runs, lost(g), no_parity(g) | corrupt)
                      if len(lost(g) | no_parity(g) | corrupt) <= layout.parity else [])
            used = corrupt if not ranges else set()
        else:  # XOR has no other piece: a corrupt parity the runs need ends the rebuild
            ranges = _xor_ranges(layout, x, runs)
            used = corrupt & {i for _, parts in ranges for kind, i, _, _ in parts if kind == "parity"}
            ranges = [] if used else ranges
        why = "; ".join(bad[g.members[i]] for i in sorted(used)) or (
            None if ranges else f"more than {layout.parity} member(s) of group {list(g.members)} lost")
        plans.append((s, dst, wanted, g, layout, ranges, why))
    # 3. each piece reduced along a chain of the ranks that hold its parts, ending at the
    # receiver: a link folds its parts into what it received and sends the sum on, so every
    # rank receives at most one piece's bytes per piece it links (the receiver: the rebuilt
    # bytes once, not N-1 contributions). XOR sums the parts; RS sums each holder's share of
    # the decode (linear over GF(2^8): the decode of its own pieces with the others zero).
    # One transport exchange per link: rounds = the longest chain (<= the group's members).
    chains: list[tuple[int, str, int, list[tuple[int, list[_Part], list[int], dict[int, list[int]]]]]] = []
    for k, (s, dst, _wanted, g, _layout, ranges, unusable) in enumerate(plans):
        if unusable:
            continue
        receiver = worker(dst, s)
        pieces: list[tuple[int, list[_Part], list[int], dict[int, list[int]]]] = []
        for pos, parts in ranges:
            by_rank: dict[int, list[int]] = {}
            for pi, (kind, i, lo, hi) in enumerate(parts):
                if hi == lo:  # an empty segment (a short shard): zeros, from nobody
                    continue
                src = source(kind, g.members[i], dst)
                by_rank.setdefault(receiver if src == dst else worker(src, g.members[i]), []).append(pi)
            order = [r for r in sorted(by_rank) if r != receiver] + [receiver]
            pieces.append((pos, parts, order, by_rank))
        chains.append((k, dst, receiver, pieces))
    templates: dict[tuple[int, int], list[bytes]] = {}

    def share(k: int, pos: int, parts: list[_Part], mine: list[int]) -> torch.Tensor:
        """This rank's part of piece ``pos`` of plan ``k``: the XOR of its parts (RS: the decode
        of its pieces, the stripe's other pieces zero). A file that cannot be read counts as
        zeros and an error as a zero share: the receiver's crc32c checks reject the result."""
        s, _dst, _w, g, layout, _r, _u = plans[k]
        x = g.members.index(s)
        size = parts[0][3] - parts[0][2] if red.scheme == "xor" else layout.segment_size
        out = torch.zeros(size, dtype=torch.uint8)
        try:
            def part(n: int) -> torch.Tensor:
                kind, i, lo, hi = parts[n]
                data = local(kind, g.members[i])
                return data[lo:hi] if data is not None and data.numel() >= hi else \
                    torch.zeros(hi - lo, dtype=torch.uint8)

            if red.scheme == "xor":
                for n in mine:
                    v = part(n)
                    xor_into(out.numpy()[:v.numel()], v.numpy())  # type: ignore[arg-type]
                return out
            j = layout.stripe_of(x, pos // layout.segment_size)
            if (id(layout), j) not in templates:  # the parity pieces of an all-zero stripe
                templates[(id(layout), j)] = rs_stripe_encode(layout, j, [b""] * layout.data)
            zero = templates[(id(layout), j)]
            have: dict[int, Any] = {}
            for n, (kind, i, _lo, _hi) in enumerate(parts):
                key = layout.segment_for(i, j) if kind == "shard" else \
                    layout.data + (i - j) % layout.members
                have[key] = memoryview(part(n).numpy()) if n in mine else (  # type: ignore[arg-type]
                    b"" if kind == "shard" else zero[key - layout.data])
            want = layout.segment_for(x, j)
            out.numpy()[:] = np.frombuffer(rs_stripe_decode(layout, j, have, [want])[want], dtype=np.uint8)
        except Exception:  # noqa: BLE001 - a zero share: the receiver's checks name the shard
            out.zero_()
        return out

    inbox: dict[tuple[int, int], torch.Tensor] = {}
    received: dict[int, int] = {}
    rounds = max((len(order) - 1 for _, _, _, ps in chains for _, _, order, _ in ps), default=0)
    for t in range(rounds):
        sends: list[Send] = []
        recvs: list[Recv] = []
        for k, _dst, receiver, ps in chains:
            for pi, (pos, parts, order, by_rank) in enumerate(ps):
                if len(order) <= t + 1:
                    continue
                a, b = order[t], order[t + 1]
                if a == me:
                    acc = share(k, pos, parts, by_rank.get(me, []))
                    if t > 0:
                        got = inbox.pop((k, pi))
                        xor_into(acc.numpy(), got.numpy())  # type: ignore[arg-type]
                    sends.append(Send(b, [acc]))
                if b == me:
                    buf = torch.empty(parts[0][3] - parts[0][2] if red.scheme == "xor"
                                      else plans[k][4].segment_size, dtype=torch.uint8)
                    recvs.append(Recv(a, _fixed(buf)))
                    inbox[(k, pi)] = buf
                    if b == receiver:
                        received[k] = received.get(k, 0) + buf.numel()
        transport.exchange(sends, recvs)
    # 4. the receiver: its own share folded into the chain's sum
    todo: dict[tuple[int, str], tuple[list[tuple[int, torch.Tensor]], int]] = {}
    for k, dst, receiver, ps in chains:
        if receiver != me:
            continue
        sums = []
        for pi, (pos, parts, order, by_rank) in enumerate(ps):
            acc = share(k, pos, parts, by_rank.get(me, []))
            if len(order) > 1:
                xor_into(acc.numpy(), inbox.pop((k, pi)).numpy())  # type: ignore[arg-type]
            sums.append((pos, acc))
        todo[(plans[k][0], dst)] = (sums, received.get(k, 0))
    try:
        secs = time.perf_counter() - t0
        return _fold_rebuilds(store, manifest, plans, todo, worker, me, secs, tails)
    finally:
        inbox.clear()
        todo.clear()
        files.clear()
        for m in opened:
            with contextlib.suppress(BufferError):
                m.close()


def _xor_ranges(layout: StripeLayout, x: int, runs: list[tuple[int, int]]
                ) -> list[tuple[int, list[_Part]]]:
    """XOR: the runs of member ``x``'s shard cut at segment boundaries; each piece at ``pos``
    is the XOR of its stripe's parity bytes and the same bytes of every other contributor."""
    out: list[tuple[int, list[_Part]]] = []
    seg_size = layout.segment_size
    for a, b in runs:
        pos = a
        while pos < b:
            seg = pos // seg_size
            end = min(b, (seg + 1) * seg_size)
            off, length = pos - seg * seg_size, end - pos
            j = layout.stripe_of(x, seg)
            parts: list[_Part] = [("parity", j, off, off + length)]
            for i in layout.contributors(j):
                if i != x:
                    start = layout.segment_for(i, j) * seg_size + off
                    lo, hi = min(start, layout.lengths[i]), min(start + length, layout.lengths[i])
                    if hi > lo:
                        parts.append(("shard", i, lo, hi))
            out.append((pos, parts))
            pos = end
    return out


def _rs_ranges(layout: StripeLayout, x: int, runs: list[tuple[int, int]], lost: set[int],
               no_parity: set[int]) -> list[tuple[int, list[_Part]]]:
    """RS: every segment of member ``x`` the runs touch, each read from d surviving pieces of
    its stripe, listed as data positions 0..d-1 then parity pieces (the decoder's order):
    the contributors that survive (an empty segment needs no bytes) first, then the pieces of
    holders whose parity file some node holds (``_rebuild_blocker`` made sure enough do)."""
    seg_size, d = layout.segment_size, layout.data
    piece = rs_piece_size(layout)
    segs = sorted({p // seg_size for a, b in runs for p in range(a - a % seg_size, b, seg_size)})
    out: list[tuple[int, list[_Part]]] = []
    for seg in segs:
        j = layout.stripe_of(x, seg)
        parts: list[_Part] = []
        for p in range(d):
            i = layout.contributor_at(j, p)
            lo, hi = layout.segment_range(i, j)
            if i != x and (i not in lost or hi == lo):
                parts.append(("shard", i, lo, hi))
        for q, h in enumerate(layout.holders(j)):
            if len(parts) < d and h not in lost and h not in no_parity:
                parts.append(("parity", h, q * piece, (q + 1) * piece))
        out.append((seg * seg_size, parts))
    return out


def _fold_rebuilds(store: NodeStore, manifest: Manifest, plans: list[Any],
                   todo: dict[tuple[int, str], tuple[list[tuple[int, torch.Tensor]], int]],
                   worker: Callable[[str, int], int], me: int, secs: float,
                   tails: dict[int, ShardRecord] | None = None,
                   ) -> list[tuple[int, str, str, str | None, int, float, bool]]:
    """The receiving side of :func:`_run_rebuilds`: the rebuilt pieces (XOR: the bytes of a
    run; RS: a whole segment, cut at the shard's end) written into a sparse partial file, and
    every rebuilt chunk and the index checked against the manifest."""
    step = manifest.step
    red = manifest.redundancy
    assert red is not None
    results: list[tuple[int, str, str, str | None, int, float, bool]] = []
    for s, dst, wanted, g, _layout, _ranges, unusable in plans:
        if unusable:
            if worker(dst, s) == me:
                results.append((s, REBUILD, dst, "parity unusable: " + unusable, 0, 0.0, True))
            continue
        if (s, dst) not in todo:
            continue  # another rank rebuilds this one
        pieces, nbytes = todo[(s, dst)]
        rec = manifest.shard(s)
        path = store.partial_path(step, s)
        err = None
        slot: Slot | None = None
        code = red.scheme.upper()
        try:  # every failure is a result, never raised on this rank alone (peers wait for it)
            store.step_dir(step).mkdir(mode=0o700, parents=True, exist_ok=True)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # a sparse file of zeros: XOR starts from nothing
            slot = Slot(path)
            slot.ensure(rec.size, prefault=False)
            with slot.memory as mem:
                for pos, piece in pieces:
                    n = min(piece.numel(), rec.size - pos)
                    mem[pos:pos + n] = memoryview(piece.numpy())[:n]  # type: ignore[arg-type]
                where = f"{code} rebuild from parity group {list(g.members)}"
                if tails is None:
                    _check_partial(mem, rec, step, wanted, where)
                else:
                    tails[s] = _rebuilt_record(mem, rec, step, where)
        except CorruptShardError as e:
            err = str(e)
        except Exception as e:  # noqa: BLE001 - e.g. a full tmpfs: the next source is tried
            err = f"{code} rebuild on node {dst!r}: {type(e).__name__}: {e}"
        finally:
            if slot is not None:
                slot.close()
        if err is not None or tails is not None:  # a rebuilt index alone loads nothing
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        results.append((s, REBUILD, dst, err, nbytes, secs, True))
    return results


def _rebuilt_record(mem: memoryview, rec: ShardRecord, step: int, where: str) -> ShardRecord:
    """The record of a shard from its rebuilt index and footer: the index must pass its
    footer's crc32c, start where the step records, and name that step and rank (its size and
    crc32c are then checked with every rank's against the step's digest, by the assembly)."""
    size = len(mem)
    try:
        start, icrc = decode_footer(bytes(mem[size - FOOTER_SIZE:]), size=size, where=where)
        expected = rec.chunks[-1].offset + rec.chunks[-1].length if rec.chunks else 0
        if start != expected:
            raise ManifestError(f"{where}: the rebuilt footer puts the index at byte {start}, the "
                                f"step records {expected}")
        index = decode_index(bytes(mem[start:size - FOOTER_SIZE]), crc=icrc, size=size, where=where)
    except ManifestError as e:
        raise CorruptShardError(f"index of rank {rec.rank}'s shard at step {step}: {e}", step=step,
                                rank=rec.rank, where=where) from e
    if (index.step, index.rank) != (step, rec.rank):
        raise CorruptShardError(f"{where}: the rebuilt index is of rank {index.rank} at step "
                                f"{index.step}", step=step, rank=rec.rank, where=where)
    return ShardRecord(rec.rank, "", size, icrc, index.chunks, index.items)


def _rebuild_tails(
    store: NodeStore,
    group: Group,
    transport: Transport,
    layout_nodes: Sequence[str],
    step: int,
    red: Redundancy,
    members: Mapping[int, tuple[int, int]],
    records: Mapping[int, ShardRecord],
    missing: list[int],
    dst: str,
    worker: Callable[[str, int], int],
    holders: Callable[[int], list[str]],
    parity_holders: Callable[[int], list[str]],
) -> tuple[dict[int, ShardRecord], list[str]]:
    """The records of lost shards of a format-4 step with parity groups (collective): no
    surviving node holds their indexes, so each one's index and footer (its bytes from the
    index start the step records to its end) are rebuilt from its group like any byte run,
    received on node ``dst``, checked against its footer's crc32c and decoded; every rank gets
    the records (which the assembly then checks against the step's digest). Costs a rebuild of O(index) bytes per lost shard, rounds <=
    the group's members; nothing per step."""
    shards = []
    for r in range(len(layout_nodes)):
        if r in records:
            shards.append(dataclasses.replace(records[r], rank=r, node=layout_nodes[r]))
        elif r in members:
            size, start = members[r]  # one chunk that ends where its index starts: the
            chunks = (ChunkRecord(0, start, 0),) if start > 0 else ()  # rebuild reads the rest
            shards.append(ShardRecord(r, layout_nodes[r], size, 0, chunks, ()))
        else:
            shards.append(ShardRecord(r, layout_nodes[r], 0, 0, (), ()))
    skeleton = Manifest(job=store.job, step=step, world_size=len(layout_nodes), shards=tuple(shards),
                        entries={}, redundancy=red)
    rebuilt: dict[int, ShardRecord] = {}
    jobs: list[tuple[int, str, str, set[int] | None]] = [(s, REBUILD, dst, set()) for s in missing]
    results = _run_rebuilds(store, group, transport, skeleton, jobs, worker, holders,
                            parity_holders, tails=rebuilt)
    out = [(r, rebuilt.get(r), err) for r, _, _, err, _, _, _ in results]
    records_out: dict[int, ShardRecord] = {}
    notes = []
    for r, rec, err in (x for xs in group.all_gather(out, "rebuild indexes") for x in xs):
        if rec is not None:
            records_out[r] = rec
        elif err is not None:
            notes.append(f"step {step}: the index of rank {r}'s shard could not be rebuilt: {err}")
    return records_out, notes
