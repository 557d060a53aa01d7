"""Hardening found by the chaos campaign (tests/chaos): each test failed before its fix.

* a node store that fills up while training runs: the memory snapshot is skipped on every rank
  with a warning, training goes on, and snapshots resume once there is room again;
* an unreachable object store: uploads are buffered up to ``durable_max_pending`` and skipped
  beyond it (never blocking the step), and the tier catches up when the store is back;
* every wait has a bound: ``wait_durable`` and ``close`` return within their timeouts while the
  object store hangs.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

from aegis import Manager, ModelOptimizerState
from aegis.snapshot.node_store import NodeStore
from tests.chaos.campaign import fill
from tests.dist_utils import run_ranks
from tests.models import build, train_step
from tests.servers import mount_tmpfs, start_moto, umount

JOB = "hardening"


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Path:
    mnt = mount_tmpfs(tmp_path / "tmpfs", "16m")
    yield mnt
    umount(mnt)


# -- a node store that fills up mid-run ----------------------------------------------------------


def _fill_mid_run(rank: int, world: int, store: str) -> dict[str, Any]:
    import torch.distributed as dist

    model, opt, sched = build(world, seed=0)
    mgr = Manager(JOB, {"model": ModelOptimizerState(model, opt), "sched": sched},
                  store_dir=store, keep=1, verbose=False)
    results = {}
    ballast = None
    try:
        for step in range(1, 8):
            train_step(model, opt, sched, step, rank)
            dist.barrier()
            if step == 3 and rank == 0:
                ballast = fill(Path(store))
            if step == 6 and rank == 0:
                assert ballast is not None
                ballast.unlink()
            dist.barrier()
            mgr.save(step)  # must not raise while the store is full
            r = mgr.wait()
            assert r is not None
            results[step] = (r.committed, getattr(r, "skipped", False), r.error)
        # a later restore (same world) finds the newest committed step
        mgr.close()
        model2, opt2, sched2 = build(world, seed=1)
        mgr = Manager(JOB, {"model": ModelOptimizerState(model2, opt2), "sched": sched2},
                      store_dir=store, keep=1, verbose=False)
        results["restored"] = mgr.restore()
    finally:
        mgr.close()
    return results


def test_full_node_store_skips_the_snapshot_and_training_goes_on(small_tmpfs: Path) -> None:
    out = run_ranks(2, _fill_mid_run, str(small_tmpfs))
    for res in out:
        assert res[1][0] and res[2][0], res  # committed before the fill
        for step in (3, 4, 5):  # full: skipped everywhere, with the reason
            committed, skipped, error = res[step]
            assert not committed and skipped, res
            assert error and ("No space left" in error or "full" in error), error
        assert res[6][0] and res[7][0], res  # room again: snapshots resume
        assert res["restored"] == 7
    # the events say so too, and the store holds the newest committed step complete
    steps = NodeStore(small_tmpfs, JOB).steps()
    assert [s.step for s in steps if s.committed][0] == 7


def _full_at_the_tail(rank: int, world: int, store: str, replicas: int) -> dict[str, Any]:
    """The shard's own tail write (bytes region + index, past the pre-faulted tensor region)
    runs out of room at step 2 on rank 0 only."""
    import errno

    import torch.distributed as dist

    import aegis.snapshot.engine as engine

    real = engine.complete

    def complete(staged: Any, **kw: Any) -> Any:
        if staged.step == 2 and rank == 0:
            raise OSError(errno.ENOSPC, "No space left on device (injected at the shard's tail)")
        return real(staged, **kw)

    engine.complete = complete  # type: ignore[assignment]
    model, opt, sched = build(world, seed=0)
    mgr = Manager(JOB, {"model": ModelOptimizerState(model, opt), "sched": sched},
                  store_dir=store, keep=1, replicas=replicas, verbose=False)
    out = {}
    try:
        for step in (1, 2, 3):
            train_step(model, opt, sched, step, rank)
            dist.barrier()
            mgr.save(step)
            r = mgr.wait()
            assert r is not None
            out[step] = (r.committed, r.skipped)
    finally:
        mgr.close()
    return out


def test_a_full_store_at_the_shards_tail_skips_the_snapshot(tmp_path: Path) -> None:
    """A rank whose own copy ran out of room, with no replica traffic at all (both ranks on one
    node, replicas=0: no exchange reports on it), makes the step skipped on every rank, not a
    failed snapshot; the steps before and after commit. (Before the redundancy schemes were
    split out of the engine, this aborted the snapshot with a CollectiveError.)"""
    out = run_ranks(2, _full_at_the_tail, str(tmp_path / "store"), 0)
    for res in out:
        assert res[1] == (True, False) and res[3] == (True, False), res
        assert res[2] == (False, True), res  # skipped, on both ranks


# -- an object store that hangs: close() is bounded -----------------------------------------------


@pytest.fixture
def own_s3() -> Any:
    """A moto server of this test's own, so the test can freeze it (SIGSTOP)."""
    import signal

    proc, endpoint = start_moto()
    yield proc, endpoint
    os.kill(proc.pid, signal.SIGCONT)
    proc.terminate()
    proc.wait(timeout=10)


def _close_while_s3_hangs(rank: int, world: int, store: str, moto_pid: int) -> dict[str, Any]:
    import signal
    import time
    from datetime import timedelta

    model, opt, sched = build(world, seed=0)
    mgr = Manager(JOB, {"model": ModelOptimizerState(model, opt), "sched": sched},
                  store_dir=store, durable="s3://hang/job", durable_every=1, verbose=False,
                  timeout=timedelta(seconds=3))
    train_step(model, opt, sched, 1, rank)
    os.kill(moto_pid, signal.SIGSTOP)  # the store hangs: connections open, nothing answers
    try:
        t0 = time.monotonic()
        mgr.save(1)
        r = mgr.wait()
        saved_s = time.monotonic() - t0
        t1 = time.monotonic()
        mgr.close()
        close_s = time.monotonic() - t1
    finally:
        os.kill(moto_pid, signal.SIGCONT)
    return {"committed": r.committed if r else None, "saved_s": saved_s, "close_s": close_s}


def test_close_is_bounded_while_the_object_store_hangs(store_dir: Path, own_s3: Any,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    import boto3

    proc, endpoint = own_s3
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": endpoint}
    boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing",
                 aws_secret_access_key="testing", region_name="us-east-1").create_bucket(Bucket="hang")
    (out,) = run_ranks(1, _close_while_s3_hangs, str(store_dir), proc.pid, env=env, timeout=200)
    assert out["committed"] is True  # the memory snapshot never waits for the object store
    # close() waits for the pending upload at most `timeout` (3 s), then gives up with a
    # warning; before the fix it waited for boto3's read timeouts times the retries (minutes).
    assert out["close_s"] < 15, out


# -- the durable tier catches up right after an outage ----------------------------------------


def _catch_up(rank: int, world: int, store: str, moto_pid: int) -> dict[str, Any]:
    import signal
    import time

    model, opt, sched = build(world, seed=0)
    mgr = Manager(JOB, {"model": ModelOptimizerState(model, opt), "sched": sched},
                  store_dir=store, durable="s3://catchup/job", durable_every=2,
                  durable_max_pending=1, verbose=False)
    uploads: list[tuple[int, bool]] = []
    mgr.uploader.on_result = lambda r: uploads.append((r.step, r.committed))  # type: ignore[union-attr]
    try:
        for step in range(1, 7):
            train_step(model, opt, sched, step, rank)
            if step == 2:
                os.kill(moto_pid, signal.SIGSTOP)  # step 2 hangs, 4 queues, 6 is skipped
            mgr.save(step)
            mgr.wait()
        os.kill(moto_pid, signal.SIGCONT)  # the store is back: step 2's upload finishes
        deadline = time.monotonic() + 60
        while mgr.uploader.pending and time.monotonic() < deadline:  # type: ignore[union-attr]
            time.sleep(0.05)
        train_step(model, opt, sched, 7, rank)
        mgr.save(7)  # not a multiple of durable_every, but uploads are owed since step 4
        mgr.wait()
        mgr.wait_durable(60)
    finally:
        os.kill(moto_pid, signal.SIGCONT)
        mgr.close()
    return {"uploads": uploads}


def test_durable_tier_catches_up_at_the_first_commit_after_an_outage(store_dir: Path, own_s3: Any) -> None:
    import boto3

    proc, endpoint = own_s3
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": endpoint}
    boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing",
                 aws_secret_access_key="testing", region_name="us-east-1").create_bucket(Bucket="catchup")
    (out,) = run_ranks(1, _catch_up, str(store_dir), proc.pid, env=env, timeout=200)
    # steps 2 and 4 went up once the store answered again; 6 was skipped (never blocking a
    # step); step 7, the first commit after the outage, goes up at once instead of waiting
    # for step 8 (before the fix the tier stayed behind until the next multiple of durable_every)
    assert out["uploads"] == [(2, True), (4, True), (7, True)], out


def test_the_simulated_hub_keeps_its_mac_when_a_node_namespace_is_removed() -> None:
    """aegis.sim's network: the bridge that holds the hub (the store's) address has a MAC of
    its own. Without one a Linux bridge takes its ports' lowest, which changed when the node
    whose port held it was killed, and the other nodes reached the store again only when
    their ARP entries expired (33-47 s measured; the chaos campaign's 50 s stalls)."""
    import subprocess

    from aegis.sim.netns import NetnsNetwork, netns_available

    why = netns_available()
    if why is not None:
        pytest.skip(f"network namespaces unavailable here: {why}")

    def mac(dev: str) -> str:
        out = subprocess.run(["ip", "link", "show", dev], capture_output=True, text=True,
                             check=True).stdout
        return out.split("link/ether", 1)[1].split()[0]

    net = NetnsNetwork().setup()
    try:
        first = mac(net.bridge)
        ports = [net.add(k).port for k in range(3)]
        lowest = min(range(3), key=lambda k: mac(ports[k]))
        net.remove(lowest)
        assert mac(net.bridge) == first
    finally:
        net.teardown()


def test_a_simulated_network_avoids_a_subnet_a_stale_bridge_still_holds(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A bridge left by a run that was killed before its teardown keeps its address (DOWN, no
    ports). A new network on the same subnet lost every connection to its hub: the host's
    replies left through the stale bridge's route (a CI run of the in-process chaos slice, every
    node's connect to the store timed out). The new network takes a free subnet; a node in it
    reaches a listener on the hub."""
    import socket
    import subprocess
    import uuid

    from aegis.sim import netns
    from aegis.sim.netns import NetnsNetwork, netns_available

    why = netns_available()
    if why is not None:
        pytest.skip(f"network namespaces unavailable here: {why}")
    fixed = uuid.UUID(int=0x3418700000000000000000000000)
    monkeypatch.setattr(netns.uuid, "uuid4", lambda: fixed)
    first = 100 + int(fixed.hex[:5], 16) % 150  # the subnet this id picks when it is free
    stale = f"aegst{uuid.UUID(int=uuid.getnode()).hex[-5:]}"
    subprocess.run(["ip", "link", "add", stale, "type", "bridge"], check=True)
    net = None
    try:
        subprocess.run(["ip", "addr", "add", f"10.{first}.0.1/24", "dev", stale], check=True)
        subprocess.run(["ip", "link", "set", stale, "up"], check=True)
        net = NetnsNetwork().setup()
        assert net.net != first, "the new network took the subnet the stale bridge holds"
        node = net.add(0)
        with socket.create_server((net.hub, 0)) as srv:
            port = srv.getsockname()[1]
            code = (f"import socket; socket.create_connection(({net.hub!r}, {port}), timeout=5)")
            r = subprocess.run([*net.exec_prefix(0), sys.executable, "-c", code],
                               capture_output=True, text=True, timeout=30)
            assert r.returncode == 0, f"node {node.addr} could not reach the hub: {r.stderr}"
    finally:
        if net is not None:
            net.teardown()
        subprocess.run(["ip", "link", "del", stale], check=False)
