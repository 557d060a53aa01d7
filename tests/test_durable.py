"""The durable tier end to end on real gloo ranks: uploads to a local directory and to S3 (moto's
server over HTTP), whole-job loss restored from the object store, retention, bad input."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from aegis.snapshot.durable import chunk_key, list_steps, manifest_key, retention_victims
from aegis.snapshot.manifest import body_checksum
from aegis.snapshot.objstore import CAPABILITY_FALLBACKS, open_store
from tests.dist_utils import run_ranks
from tests.models import build, full_state, train_step
from tests.test_manager import _tensors, assert_bitwise_equal

JOB = "d"


def _mgr(store: str, url: str, model, opt, sched, **kw):  # type: ignore[no-untyped-def]
    from aegis import Manager, ModelOptimizerState

    return Manager(JOB, {"model": ModelOptimizerState(model, opt), "sched": sched}, store_dir=store,
                   durable=url, verbose=False, **kw)


def _train_upload(rank: int, world: int, store: str, url: str, steps: int, env: dict,
                  kw: dict[str, Any] | None = None) -> Any:
    import os

    os.environ.update(env)
    model, opt, sched = build(world)
    mgr = _mgr(store, url, model, opt, sched, durable_every=2, durable_keep_last=2, durable_keep_every=4,
               **(kw or {}))
    start = mgr.restore()  # 0 on a fresh store; a relaunch goes on from its newest snapshot
    for step in range(start + 1, steps + 1):
        train_step(model, opt, sched, step, rank)
        mgr.save(step)
    mgr.wait()
    mgr.wait_durable()
    full = _tensors(full_state(model, opt))
    nxt = train_step(model, opt, sched, steps + 1, rank)
    mgr.close()
    return full if rank == 0 else None, nxt


def _restore(rank: int, world: int, store: str, url: str, env: dict) -> Any:
    import os

    os.environ.update(env)
    model, opt, sched = build(world, seed=5)
    try:
        mgr = _mgr(store, url, model, opt, sched)
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    try:
        step = mgr.restore()
    except Exception as e:  # noqa: BLE001
        mgr.close()
        return f"{type(e).__name__}: {e}"
    res = mgr.last_restore
    full = _tensors(full_state(model, opt))
    nxt = train_step(model, opt, sched, step + 1, rank)
    mgr.close()
    return {"step": step, "full": full if rank == 0 else None, "next": nxt,
            "tiers": sorted({s["tier"] for s in res.sources}) if res else [],
            "in_place": sorted((s["shard"], bool(s.get("in_place"))) for s in res.sources) if res else []}


@pytest.fixture(params=["file", "s3"])
def durable_url(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, dict]:
    if request.param == "file":
        return f"file://{tmp_path}/durable", {}
    bucket = request.getfixturevalue("s3_bucket")
    env = request.getfixturevalue("s3_env")
    return f"s3://{bucket}/ckpt", env


@pytest.mark.parametrize("min_gain", [None, 0.0], ids=["default", "planes"])
def test_whole_job_loss_restores_the_newest_durable_step_bitwise(store_dir: Path,
                                                                 durable_url: tuple[str, dict],
                                                                 min_gain: float | None) -> None:
    """Restored into the state from raw chunks (the default: the model's fp32 state does not
    compress by 25%) and from byte-plane chunks (``durable_min_gain=0``)."""
    url, env = durable_url
    kw = {} if min_gain is None else {"durable_min_gain": min_gain}
    (saved, nxt0), (_, nxt1) = run_ranks(2, _train_upload, str(store_dir), url, 6, env, kw)
    store = open_store(url)
    committed, uncommitted = list_steps(store, JOB)
    # uploads at 2, 4, 6; retention keeps the last 2 and every 4th
    assert committed == [4, 6] and uncommitted == []
    m = json.loads(store.get(manifest_key(JOB, 6)))
    codecs = {row[4].split(":")[0] for s in m["shards"] for row in s["chunks"]}
    # float32 chunks went raw by default, through the byte-plane codec with min_gain=0
    assert ("xplanes" if min_gain == 0 else "raw") in codecs, codecs
    shutil.rmtree(store_dir)  # every node store is gone: only the object store survives
    out = run_ranks(2, _restore, str(store_dir), url, env)
    assert [o["step"] for o in out] == [6, 6]
    assert out[0]["tiers"] == ["durable"]
    # both ways in: a shard with one reader on the node straight into the state, a shard two
    # ranks read (replicated items de-duplicated into it) through a partial file
    ways = {p for o in out for _, p in o["in_place"]}
    assert ways == {True, False}, [o["in_place"] for o in out]
    assert_bitwise_equal(saved, out[0]["full"])
    assert [o["next"] for o in out] == [nxt0, nxt1]  # training continues with the same losses


def test_corrupt_durable_object_names_the_key(store_dir: Path, tmp_path: Path) -> None:
    url = f"file://{tmp_path}/durable"
    run_ranks(2, _train_upload, str(store_dir), url, 2, {})
    key = chunk_key(JOB, 2, 1, 0)
    path = tmp_path / "durable" / key
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))
    shutil.rmtree(store_dir)
    out = run_ranks(2, _restore, str(store_dir), url, {})
    for e in out:
        assert isinstance(e, str) and e.startswith("CorruptShardError"), e
        assert key in e and "crc32c mismatch" in e


def test_newer_format_durable_manifest_is_rejected(store_dir: Path, tmp_path: Path) -> None:
    url = f"file://{tmp_path}/durable"
    run_ranks(2, _train_upload, str(store_dir), url, 2, {})
    path = tmp_path / "durable" / manifest_key(JOB, 2)
    doc = json.loads(path.read_text())
    doc["format_version"] = 42
    doc["checksum"] = body_checksum(doc)  # intact, of a newer format: never skipped past
    path.write_text(json.dumps(doc))
    shutil.rmtree(store_dir)
    out = run_ranks(2, _restore, str(store_dir), url, {})
    assert all(isinstance(e, str) and e.startswith("IncompatibleSnapshotError") and "newer aegis" in e
               for e in out), out


def test_missing_bucket_fails_at_manager_start(store_dir: Path, s3_env: dict) -> None:
    out = run_ranks(2, _restore, str(store_dir), "s3://no-such-bucket/x", s3_env)
    for e in out:
        assert isinstance(e, str) and e.startswith("ConfigError") and "does not exist" in e


@pytest.mark.quick
def test_retention_rules() -> None:
    assert retention_victims([], 2, 0) == []
    assert retention_victims([1, 2, 3, 4, 5], 2, 0) == [1, 2, 3]
    assert retention_victims([2, 4, 6, 8, 10], 1, 4) == [2, 6]
    assert retention_victims([3], 1, 0) == []
    for steps in ([1], [1, 5, 9], list(range(1, 30))):
        for last in (1, 2, 5):
            for every in (0, 1, 3, 7):
                assert max(steps) not in retention_victims(steps, last, every)


def _upload_through(rank: int, world: int, store: str, url: str, env: dict) -> Any:
    import os

    os.environ.update(env)
    model, opt, sched = build(world)
    mgr = _mgr(store, url, model, opt, sched, durable_every=1)
    for step in range(1, 4):
        train_step(model, opt, sched, step, rank)
        mgr.save(step)
    mgr.wait()
    mgr.wait_durable()
    events = [json.loads(x) for x in Path(mgr.events.path).read_text().splitlines()]
    full = _tensors(full_state(model, opt))
    mgr.close()
    uploads = [e for e in events if e["event"] == "upload"]
    return {"uploads": uploads, "full": full if rank == 0 else None}


def test_uploads_complete_through_throttling_errors_resets_and_latency(
        store_dir: Path, s3_server: str, s3_bucket: str, s3_env: dict) -> None:
    from tests.s3_proxy import FaultProxy

    with FaultProxy(s3_server, rate=0.2, seed=3) as proxy:
        env = {**s3_env, "AWS_ENDPOINT_URL": proxy.url}
        url = f"s3://{s3_bucket}/flaky"
        out = run_ranks(2, _upload_through, str(store_dir), url, env)
    injected = {k: v for k, v in proxy.counts.items() if k != "forwarded"}
    assert sum(injected.values()) >= 5, proxy.counts
    uploads = [u for o in out for u in o["uploads"]]
    assert [u["step"] for u in out[0]["uploads"]] == [1, 2, 3]
    assert all(u["committed"] and u["error"] is None for u in uploads), uploads
    assert sum(u["retries"] for u in uploads) > 0  # the retry counts show in the events
    assert any(u["retry_reasons"] for u in uploads)
    # what went up through the faults restores bitwise (straight to the server this time)
    shutil.rmtree(store_dir)
    restored = run_ranks(2, _restore, str(store_dir), url, s3_env)
    assert restored[0]["step"] == 3
    assert_bitwise_equal(out[0]["full"], restored[0]["full"])


def test_sigkill_during_upload_leaves_no_committed_step_and_the_next_run_cleans_up(
        store_dir: Path, tmp_path: Path) -> None:
    from aegis._fault import fail_at

    url = f"file://{tmp_path}/durable"
    env = {"AEGIS_FAIL_AT": fail_at(0, 2, "upload")}  # rank 0, chunks up, manifest not yet put
    with pytest.raises(RuntimeError, match="died"):
        run_ranks(2, _train_upload, str(store_dir), url, 3, env, env=env)
    store = open_store(url)
    assert list_steps(store, JOB) == ([], [2])  # objects of step 2, no manifest: not a step
    # The next run discards the half-uploaded step, restores from memory and uploads again.
    (_, _), (_, _) = run_ranks(2, _train_upload, str(store_dir), url, 4, {})
    committed, uncommitted = list_steps(store, JOB)
    assert uncommitted == [] and committed[-1] == 4


# -- S3-compatible servers without some optional operations ------------------------------------

REDUCED = [("list_multipart_uploads",), ("batch_delete",), ("conditional_put",), ("crc32c",),
           ("list_multipart_uploads", "batch_delete", "conditional_put", "crc32c")]


@pytest.mark.parametrize("unsupported", REDUCED, ids=lambda u: "no-" + "+".join(u) if len(u) < 4 else "none")
def test_durable_tier_on_a_reduced_server(store_dir: Path, s3_server: str, s3_bucket: str, s3_env: dict,
                                          unsupported: tuple[str, ...], capfd: pytest.CaptureFixture[str],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Half-uploaded step cleanup, uploads, retention, whole-job-loss restore (bitwise), `aegis
    verify` and `aegis prune`, on a server answering 501 to the operations in ``unsupported``."""
    from aegis._fault import fail_at
    from aegis.cli import main
    from tests.s3_proxy import FaultProxy

    with FaultProxy(s3_server, rate=0.0, unsupported=unsupported) as proxy:
        env = {**s3_env, "AWS_ENDPOINT_URL": proxy.url}
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        url = f"s3://{s3_bucket}/ckpt"
        kill = {**env, "AEGIS_FAIL_AT": fail_at(0, 2, "upload")}  # chunks up, no manifest
        with pytest.raises(RuntimeError, match="died"):
            run_ranks(2, _train_upload, str(store_dir), url, 3, kill, env=kill)
        store = open_store(url)
        assert list_steps(store, JOB) == ([], [2])
        # The next run starts (cleanup of the half-uploaded step included), uploads and prunes.
        capfd.readouterr()
        (saved, nxt0), (_, nxt1) = run_ranks(2, _train_upload, str(store_dir), url, 6, env)
        assert list_steps(store, JOB) == ([4, 6], [])  # retention: last 2 and every 4th
        err = capfd.readouterr().err
        for op in unsupported:  # the console says what each missing operation costs, once
            assert err.count(f"does not implement {CAPABILITY_FALLBACKS[op][0]}") == 1, (op, err)
        shutil.rmtree(store_dir)  # whole-job loss
        out = run_ranks(2, _restore, str(store_dir), url, env)
        assert [o["step"] for o in out] == [6, 6], out
        assert out[0]["tiers"] == ["durable"]
        assert_bitwise_equal(saved, out[0]["full"])
        assert [o["next"] for o in out] == [nxt0, nxt1]
        capfd.readouterr()
        assert main(["verify", url, "--job", JOB, "--all"]) == 0
        assert main(["prune", url, "--job", JOB, "--keep-last", "1"]) == 0
        assert list_steps(store, JOB) == ([6], [])
        err = capfd.readouterr().err
        assert "error" not in err, err
        # Every missing operation was really asked for, answered 501, and never retried: per
        # process at most the requests already in flight when the first 501 came back (4
        # chunk uploads at a time), in 4 uploading rank processes (9 retries each would be 100s).
        assert set(proxy.refused) == set(unsupported), proxy.refused
        assert max(proxy.refused.values()) <= 4 * 4, proxy.refused


def _upload_n(rank: int, world: int, store: str, url: str, env: dict, steps: int) -> Any:
    import os

    os.environ.update(env)
    model, opt, sched = build(world)
    mgr = _mgr(store, url, model, opt, sched, durable_every=1, durable_keep_last=1)
    t = []
    for step in range(1, steps + 1):
        train_step(model, opt, sched, step, rank)
        mgr.save(step)
        mgr.wait()
        t0 = time.monotonic()
        mgr.wait_durable()
        t.append(time.monotonic() - t0)
    events = [json.loads(x) for x in Path(mgr.events.path).read_text().splitlines()]
    mgr.close()
    return {"uploads": [e for e in events if e["event"] == "upload"],
            "skipped": [e for e in events if e["event"] == "upload_skipped"]}


def test_retention_failure_is_a_warning_once_and_never_holds_up_uploads(
        store_dir: Path, s3_server: str, s3_bucket: str, s3_env: dict,
        capfd: pytest.CaptureFixture[str]) -> None:
    from tests.s3_proxy import FaultProxy

    with FaultProxy(s3_server, rate=0.0, deny_delete=True) as proxy:  # a policy without delete
        env = {**s3_env, "AWS_ENDPOINT_URL": proxy.url}
        url = f"s3://{s3_bucket}/keep"
        out = run_ranks(2, _upload_n, str(store_dir), url, env, 5)
    uploads = out[0]["uploads"]
    assert [u["step"] for u in uploads] == [1, 2, 3, 4, 5]
    assert all(u["committed"] and u["error"] is None for u in uploads), uploads
    assert out[0]["skipped"] == [] and out[1]["skipped"] == []
    assert proxy.counts["denied"] > 0
    assert any(u["prune_error"] and "AccessDenied" in u["prune_error"] for u in uploads), uploads
    assert list_steps(open_store(url), JOB)[0] == [1, 2, 3, 4, 5]  # nothing deleted, nothing lost
    err = capfd.readouterr().err
    warnings = [line for line in err.splitlines() if "durable retention" in line]
    assert len(warnings) == 1, err  # once per cause, not once per upload
    assert "could not delete step(s) 1" in warnings[0] and "AccessDenied" in warnings[0]
