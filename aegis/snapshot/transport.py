"""Transports move shard bytes between ranks, for replication and peer restore.

A transport is a small interface so a faster one (RDMA, NCCL on GPU) can replace the gloo one.
Every implementation passes the same contract tests (``tests/test_transport.py``).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from aegis.errors import AegisError, SnapshotTimeoutError

__all__ = ["Send", "Recv", "Transport", "GlooTransport"]

_MAX_PARTS = 4


def _work(w: dist.Work | None) -> dist.Work:
    assert w is not None, "p2p op on a group this rank is not in"
    return w


@dataclass
class Send:
    """Send ``parts`` (contiguous uint8 tensors, sent back to back) to rank ``dst``;
    ``ready()``, when given, runs just before they are handed over (e.g. to fault in the
    pages they lie in), while the messages before it are on the wire."""

    dst: int
    parts: Sequence[torch.Tensor]
    ready: Callable[[], object] | None = None


@dataclass
class Recv:
    """Receive from ``src``; ``alloc(part_sizes)`` returns one uint8 tensor per part to fill;
    ``done()``, when given, runs once they are filled (in list order, while later messages may
    still arrive: e.g. to checksum them). It must not raise."""

    src: int
    alloc: Callable[[list[int]], Sequence[torch.Tensor]]
    done: Callable[[], None] | None = None


class Transport(abc.ABC):
    """Collective: every rank calls :meth:`exchange` in the same order. Between any two ranks,
    sends and receives are matched in list order."""

    @abc.abstractmethod
    def exchange(self, sends: Sequence[Send], recvs: Sequence[Recv]) -> int:
        """Run all transfers; return the bytes this rank received. Raises SnapshotTimeoutError
        when a peer does not answer within the transport's timeout."""

    def close(self) -> None:  # noqa: B027 - optional
        pass


class GlooTransport(Transport):
    """Point-to-point send/recv on a dedicated gloo group (never the training group)."""

    def __init__(self, pg: dist.ProcessGroup | None, timeout: timedelta) -> None:
        self.pg = pg
        self.timeout = timeout

    def _global(self, rank: int) -> int:
        assert self.pg is not None
        return dist.get_global_rank(self.pg, rank)

    def _wait(self, works: list[dist.Work], what: str) -> None:
        try:
            for w in works:
                if not w.wait(self.timeout):
                    raise SnapshotTimeoutError(f"{what}: a peer did not answer within {self.timeout}")
        except SnapshotTimeoutError:
            raise
        except Exception as e:  # gloo raises RuntimeError on timeouts and closed peers
            text = str(e).lower()
            if "timed out" in text or "timeout" in text:
                raise SnapshotTimeoutError(
                    f"{what}: a peer did not answer within {self.timeout} ({e}); it is frozen or dead"
                ) from e
            raise AegisError(f"{what}: transfer failed ({e}); a peer is likely gone") from e

    def exchange(self, sends: Sequence[Send], recvs: Sequence[Recv]) -> int:
        if not sends and not recvs:
            return 0
        if self.pg is None:
            raise AegisError("GlooTransport needs torch.distributed to be initialized")
        # 1. headers: the part sizes of every message
        works: list[dist.Work] = []
        for s in sends:
            if len(s.parts) > _MAX_PARTS:
                raise ValueError(f"at most {_MAX_PARTS} parts per message")
            header = torch.zeros(_MAX_PARTS + 1, dtype=torch.int64)
            header[0] = len(s.parts)
            for i, p in enumerate(s.parts):
                header[i + 1] = p.numel()
            works.append(_work(dist.isend(header, self._global(s.dst), group=self.pg)))
        headers = []
        for r in recvs:
            h = torch.zeros(_MAX_PARTS + 1, dtype=torch.int64)
            headers.append(h)
            works.append(_work(dist.irecv(h, self._global(r.src), group=self.pg)))
        self._wait(works, "transfer header")
        # 2. payloads, in the same order on both sides: receives posted first, so no sender's
        # ready() (run here, message by message) holds up a peer's sends into them
        works = []
        received = 0
        pending: list[tuple[Recv, list[dist.Work]]] = []
        for r, h in zip(recvs, headers, strict=True):
            n = int(h[0])
            sizes = [int(x) for x in h[1:1 + n]]
            bufs = r.alloc(sizes)
            mine = []
            for buf, size in zip(bufs, sizes, strict=True):
                if buf.numel() != size or buf.dtype != torch.uint8:
                    raise ValueError("alloc() must return uint8 tensors of the announced sizes")
                if size:
                    mine.append(_work(dist.irecv(buf, self._global(r.src), group=self.pg)))
                received += size
            pending.append((r, mine))
        for s in sends:
            if s.ready is not None:
                s.ready()
            for p in s.parts:
                if p.numel():
                    works.append(_work(dist.isend(p, self._global(s.dst), group=self.pg)))
        for r, mine in pending:
            if r.done is not None:
                self._wait(mine, "transfer")
                r.done()
            else:
                works.extend(mine)
        self._wait(works, "transfer")
        return received
