"""The contract every :class:`aegis.training.inprocess.abandon.Abandon` implementation meets
(issue 23: one seam, one implementation per backend, one contract test).

Real ranks (separate processes), real process groups, a real TCPStore for what the ranks publish:

1. *leave*: a process that leaves the round's groups (without entering a collective) makes a
   peer's pending collective with it fail at once, not at the group's timeout;
2. *fence*: a process whose peer went silent (here: never enters the collective) fences it off
   from another thread, and its own pending collective fails at once;
3. after either, every process forms a new group from the store and its collectives work;
4. a fence works without the silent peer's published sockets (the store restarted empty and
   lost them): the fencing process shuts its own connections of the round down;
5. a process fencing *itself* (its peers declared it dead: it was frozen or cut off, and the
   round went on) makes its own pending collective fail at once, although the peer it waits on
   is alive and never closes the connection.

Parametrized over the implementations this machine can run: gloo always; NCCL needs two GPUs
(one GPU cannot host two NCCL ranks), so on a CPU machine it is not generated, not skipped.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch

from tests.dist_utils import free_port, run_ranks

GROUP_TIMEOUT_S = 60.0
PROMPT_S = 10.0  # "at once": far below the group's timeout


def _backends() -> list[str]:
    out = ["gloo"]
    if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
        out.append("nccl")
    return out


def _store(port: int) -> Any:
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30),
                         wait_for_workers=False)


def _group_and_tensor(backend: str, rank: int) -> tuple[Any, torch.Tensor]:
    import torch.distributed as dist

    if backend == "nccl":
        torch.cuda.set_device(rank)
        return dist.new_group(backend="nccl", timeout=timedelta(seconds=GROUP_TIMEOUT_S)), \
            torch.ones(4, device="cuda")
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=GROUP_TIMEOUT_S)), torch.ones(4)


def _reform(store: Any, backend: str, rank: int, world: int, r: int) -> float:
    """A new default group for round ``r`` from the store; one all-reduce on it."""
    import torch.distributed as dist

    dist.init_process_group(backend, store=dist.PrefixStore(f"round/{r}/pg", store), rank=rank,
                            world_size=world, timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    t = torch.ones(4, device="cuda") if backend == "nccl" else torch.ones(4)
    dist.all_reduce(t)
    return float(t.sum())


def _case(rank: int, world: int, port: int, backend: str, how: str) -> dict[str, Any]:
    import torch.distributed as dist

    from aegis.training.inprocess import abandon
    from aegis.training.inprocess.round import PeerLost, Round

    store = _store(port)
    uid = f"p{rank}"
    ab = abandon.for_backend(backend)
    ab.begin(store, 0, uid)
    group, t = _group_and_tensor(backend, rank)
    dist.barrier(group=group)  # every connection of the group exists now
    ab.publish()
    store.set(f"published/{rank}", "1")
    store.wait([f"published/{r}" for r in range(world)])
    members = [f"p{r}" for r in range(world)]
    out: dict[str, Any] = {"rank": rank}
    if rank == 0:  # never enters the collective: leaves (case leave) or stays silent (fence)
        if how == "leave":
            time.sleep(1.0)
            ab.leave(members)
        else:
            store.wait(["fenced"], timedelta(seconds=60))
            ab.leave(members)
    else:
        Round.thread = threading.current_thread()
        Round.active = True
        Round.members = members
        if how in ("fence", "fence-store-lost", "fence-self"):
            def fence_later() -> None:
                time.sleep(1.0)
                if how == "fence-store-lost":  # restarted empty: p0's published sockets gone
                    store.delete_key("aegis/round/0/ports/p0")
                out["cut"] = ab.fence(uid if how == "fence-self" else "p0")
            threading.Thread(target=fence_later, daemon=True).start()
        t0 = time.monotonic()
        try:
            dist.all_reduce(t, group=group)
            if backend == "nccl":
                torch.cuda.synchronize()
            out["error"] = None
        except (RuntimeError, PeerLost) as e:
            out["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        out["failed_after_s"] = time.monotonic() - t0
        Round.active = False
        if how != "leave":
            store.set("fenced", "1")
        ab.leave(members)
    out["reformed_sum"] = _reform(store, backend, rank, world, 1)
    return out


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("how", ["leave", "fence", "fence-store-lost", "fence-self"])
def test_abandon_contract(backend: str, how: str) -> None:
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=60))
    res = run_ranks(2, _case, server.port, backend, how, timeout=90)
    blocked = res[1]
    print(f"{backend}/{how}: the pending collective failed after {blocked['failed_after_s']:.2f} s "
          f"({blocked['error']})")
    assert blocked["error"] is not None, "the collective with the leaving/silent peer completed"
    assert blocked["failed_after_s"] < PROMPT_S, blocked
    if how != "leave":
        assert blocked["cut"] > 0, "fence() cut nothing"
    assert [r["reformed_sum"] for r in res] == [8.0, 8.0]


@pytest.mark.quick
def test_for_backend_names_what_it_cannot_abandon() -> None:
    from aegis.errors import ConfigError
    from aegis.training.inprocess import abandon

    assert abandon.for_backend("gloo").name == "gloo"
    assert abandon.for_backend("cpu:gloo,cuda:nccl").name == "nccl+gloo"
    with pytest.raises(ConfigError, match="mpi"):
        abandon.for_backend("mpi")


@pytest.mark.quick
def test_nccl_environment_checked_before_the_first_round(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's default TORCH_NCCL_ASYNC_ERROR_HANDLING (3) kills a survivor at the first NCCL
    error: refused when set so, set to 2 when unset; a collective timeout that would fire before
    aegis fences a silent peer is refused. gloo needs none of it."""
    from aegis.errors import ConfigError
    from aegis.training.inprocess.loop import check_nccl_env

    long, short = timedelta(seconds=30), timedelta(seconds=1.5)
    assert check_nccl_env("gloo", short, 1.0) == []
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    said = check_nccl_env("cpu:gloo,cuda:nccl", long, 1.0)
    assert said and "=2" in said[0]
    import os

    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"
    for bad in ("1", "3"):
        monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", bad)
        with pytest.raises(ConfigError, match="tears the process down"):
            check_nccl_env("nccl", long, 1.0)
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
    assert check_nccl_env("nccl", long, 1.0) == []
    with pytest.raises(ConfigError, match="collective timeout must exceed"):
        check_nccl_env("nccl", short, 1.0)
    monkeypatch.setenv("TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", "5")
    with pytest.raises(ConfigError, match="at least 30 s"):
        check_nccl_env("nccl", long, 1.0)


@pytest.mark.quick
def test_a_teardown_aborts_only_the_managers_of_the_round_that_ended() -> None:
    """A Manager of an earlier round that something still holds (its uploader stuck on an object
    store that hangs) was aborted again at every later teardown, each time waiting for its
    thread: teardown grew round after round (issue 25). Each Manager is aborted by the teardown
    of its own round only."""
    from aegis.training.inprocess import abandon
    from aegis.training.inprocess.loop import teardown
    from aegis.training.inprocess.round import register_manager

    class Held:
        def __init__(self) -> None:
            self.calls: list[bool] = []

        def abort(self, *, begin: bool = True) -> None:
            self.calls.append(begin)

    round0, round1 = Held(), Held()
    register_manager(round0)
    teardown(abandon.GlooAbandon(), [])
    register_manager(round1)
    teardown(abandon.GlooAbandon(), [])  # round0 is still alive (held here), not aborted again
    assert round0.calls == [True, False]
    assert round1.calls == [True, False]


@pytest.mark.quick
def test_a_snapshot_thread_says_where_it_is_while_a_teardown_waits_on_it() -> None:
    """What the ``abort_wait`` event reports: the snapshot thread's innermost frames while it is
    still busy, and None once it has ended."""
    from aegis.snapshot.engine_plan import _DaemonWorker

    release, entered = threading.Event(), threading.Event()

    def busy_replicating() -> None:
        entered.set()
        release.wait(60)

    worker = _DaemonWorker("aegis-test")
    worker.submit(busy_replicating)
    assert entered.wait(60)
    where = worker.where()
    assert where is not None and "busy_replicating" in where, where
    release.set()
    worker.shutdown(wait=True, timeout=60)
    assert not worker.alive and worker.where() is None


def _proc_rows(inodes: set[int]) -> list[tuple[str, str, str, int]]:
    """This process's rows of /proc/net/tcp{,6}, as the kernel writes them."""
    rows = []
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(name) as fh:
            for line in list(fh)[1:]:
                f = line.split()
                if int(f[9]) in inodes:
                    rows.append((f[1], f[2], f[3], int(f[9])))
    return rows


@pytest.mark.parametrize("family,host", [("AF_INET", "127.0.0.1"), ("AF_INET6", "::1")])
def test_socket_endpoints_asked_of_each_socket_read_as_proc_writes_them(family: str, host: str) -> None:
    """``_sockets.endpoints`` asks each of this process's sockets (no walk of the namespace's
    table); what it returns is what /proc/net/tcp says of them, to the letter: a peer's
    published endpoints are matched against it."""
    import socket

    from aegis.training.inprocess import _sockets

    fam = getattr(socket, family)
    try:
        listener = socket.socket(fam, socket.SOCK_STREAM)
        listener.bind((host, 0))
    except OSError as e:  # no IPv6 loopback here
        pytest.skip(f"{family} loopback unavailable: {e}")
    listener.listen()
    client = socket.create_connection(listener.getsockname()[:2])
    server, _ = listener.accept()
    try:
        got = _sockets.endpoints()
        mine = {ino for *_, ino in got}
        ours = {ino for ino, fd in _sockets.my_sockets().items()
                if fd in (listener.fileno(), client.fileno(), server.fileno())}
        assert len(ours) == 3 and ours <= mine
        assert sorted(r for r in got if r[3] in ours) == sorted(_proc_rows(ours))
        states = sorted(r[2] for r in got if r[3] in ours)
        assert states == [_sockets.TCP_ESTABLISHED] * 2 + [_sockets.TCP_LISTEN]
    finally:
        for s in (client, server, listener):
            s.close()
