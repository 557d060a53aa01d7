"""The transport's contract on real gloo ranks: messages of several parts matched in list order
between each pair, every rank sending and receiving at once (a ring), ``ready()`` run before a
message is handed over and ``done()`` once its parts are filled."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from tests.dist_utils import run_ranks


def _ring(rank: int, world: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from aegis.snapshot.transport import GlooTransport, Recv, Send

    t = GlooTransport(dist.new_group(backend="gloo"), timedelta(seconds=60))
    nxt, prev = (rank + 1) % world, (rank - 1) % world
    log: list[str] = []
    # three messages to the next rank, of 1, 4 and 2 parts, each part's bytes naming its origin
    msgs = [[torch.full((n + 1 + 1000 * k,), (rank * 16 + k * 4 + n) % 251, dtype=torch.uint8)
             for n in range(parts)] for k, parts in enumerate((1, 4, 2))]

    def ready(k: int) -> None:
        log.append(f"ready {k}")

    got: list[list[torch.Tensor]] = []

    def alloc(sizes: list[int]) -> list[torch.Tensor]:
        bufs = [torch.empty(n, dtype=torch.uint8) for n in sizes]
        got.append(bufs)
        return bufs

    def done(k: int) -> None:
        # this message's parts are filled when done() runs
        log.append(f"done {k}: " + ",".join(str(int(b[0])) + "x" + str(b.numel()) for b in got[k]))

    sends = [Send(nxt, parts, ready=lambda k=k: ready(k)) for k, parts in enumerate(msgs)]
    recvs = [Recv(prev, alloc, done=lambda k=k: done(k)) for k in range(3)]
    n = t.exchange(sends, recvs)
    return {"received": n, "log": log,
            "bytes": [[(int(b[0]), b.numel(), bool((b == b[0]).all())) for b in m] for m in got]}


def test_a_ring_of_multi_part_messages_arrives_in_order_with_ready_and_done() -> None:
    world = 3
    out = run_ranks(world, _ring)
    for rank, o in enumerate(out):
        prev = (rank - 1) % world
        want = [[((prev * 16 + k * 4 + n) % 251, n + 1 + 1000 * k, True) for n in range(parts)]
                for k, parts in enumerate((1, 4, 2))]
        assert o["bytes"] == want
        assert o["received"] == sum(n for m in want for _, n, _ in m)
        # every ready() before the sends were handed over, in order; done() in order, each
        # after its own message's parts were filled with the sender's bytes
        assert [x for x in o["log"] if x.startswith("ready")] == ["ready 0", "ready 1", "ready 2"]
        dones = [x for x in o["log"] if x.startswith("done")]
        assert dones == [f"done {k}: " + ",".join(f"{v}x{n}" for v, n, _ in m) for k, m in enumerate(want)]
