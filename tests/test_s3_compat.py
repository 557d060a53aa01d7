"""S3-compatible endpoints without some optional operations: the store learns from a 501 answer
(never by retrying it) and uses its fallback. moto's server over HTTP behind the fault proxy's
reduced-server mode; real boto3 clients."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import boto3
import botocore.exceptions as bexc
import pytest

from aegis.errors import AegisError, ConfigError
from aegis.snapshot.objstore import CAPABILITY_FALLBACKS, PreconditionFailed, open_store
from aegis.snapshot.retry import RetryPolicy
from aegis.snapshot.s3 import MARKERS, S3Store, is_not_implemented, is_retryable
from tests.s3_proxy import OPERATIONS, FaultProxy

REDUCED = [(op,) for op in OPERATIONS] + [OPERATIONS]


def _ids(ops: tuple[str, ...]) -> str:
    return "no-" + "+".join(ops) if len(ops) < len(OPERATIONS) else "none-of-them"


@pytest.fixture(params=REDUCED, ids=_ids)
def reduced(request: pytest.FixtureRequest, s3_server: str, s3_bucket: str,
            monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[S3Store, FaultProxy]]:
    with FaultProxy(s3_server, rate=0.0, unsupported=request.param) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        store = open_store(f"s3://{s3_bucket}/pre", part_size=5 << 20, multipart_threshold=5 << 20)
        assert isinstance(store, S3Store)
        yield store, proxy
        store.close()


def _error(status: int, code: str) -> bexc.ClientError:
    return bexc.ClientError({"Error": {"Code": code, "Message": "x"},
                             "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject")


@pytest.mark.quick
def test_retry_classification() -> None:
    for status, code in [(500, "InternalError"), (502, "BadGateway"), (503, "SlowDown"),
                         (504, "GatewayTimeout"), (429, "TooManyRequests"), (400, "RequestTimeout"),
                         (400, "ThrottlingException")]:
        assert is_retryable(_error(status, code)), (status, code)
    for status, code in [(501, "NotImplemented"), (400, "InvalidArgument"), (403, "AccessDenied"),
                         (404, "NoSuchBucket"), (412, "PreconditionFailed"), (505, "HTTPVersion"),
                         (403, "RequestTimeTooSkewed")]:
        assert not is_retryable(_error(status, code)), (status, code)
    assert is_not_implemented(_error(501, "NotImplemented"))
    assert is_not_implemented(_error(400, "NotImplemented"))
    assert not is_not_implemented(_error(500, "InternalError"))
    assert is_retryable(bexc.EndpointConnectionError(endpoint_url="http://x"))
    assert is_retryable(ConnectionResetError())


def test_contract_on_a_reduced_server(reduced: tuple[S3Store, FaultProxy]) -> None:
    store, proxy = reduced
    store.check()
    store.put("job/step-00000001/rank-00000/chunk-0000.zst", b"hello world")
    store.put("job/step-00000001/manifest.json", b"{}", if_absent=True)
    with pytest.raises(PreconditionFailed):
        store.put("job/step-00000001/manifest.json", b"other", if_absent=True)
    assert store.get("job/step-00000001/manifest.json") == b"{}"
    big = os.urandom(11 << 20)  # multipart
    store.put("job/big", big)
    assert store.get_range("job/big", (5 << 20) - 2, (5 << 20) + 2) == big[(5 << 20) - 2:(5 << 20) + 2]
    assert store.abort_stale_uploads("job/", 0.0) == 0
    store.delete([o.key for o in store.list("job/")] + ["job/never-existed"])
    assert list(store.list("job/")) == []
    # Each missing operation was asked once, answered 501 once, and never retried.
    caps = store.capabilities.to_json()
    for op in OPERATIONS:
        assert caps[op] is (op not in proxy.unsupported), (op, caps)
    assert proxy.refused == {op: 1 for op in proxy.unsupported}, proxy.refused
    assert store.stats.retries == 0
    # ... and the console learns once what each costs.
    notes = store.take_notes()
    assert len(notes) == len(proxy.unsupported)
    for op in proxy.unsupported:
        assert any(CAPABILITY_FALLBACKS[op][0] in n for n in notes), (op, notes)
    assert store.take_notes() == []


def test_probe_reports_what_the_endpoint_supports(reduced: tuple[S3Store, FaultProxy]) -> None:
    store, proxy = reduced
    caps = store.probe().to_json()
    assert caps == {op: op not in proxy.unsupported for op in OPERATIONS}
    assert [o.key for o in store.list(".aegis/")] == []  # the probe object is gone


@pytest.mark.parametrize("sign,unsupported,unsigned", [
    (None, (), 2),  # the first response carries the CRC32C back: the next bodies go unsigned
    (True, (), 0),  # sign_payload: every body signed, as botocore does over HTTP
    (None, ("crc32c",), 0),  # no checksum taken: the signature is the body's only check
], ids=["default", "sign_payload", "no-crc32c"])
def test_checksummed_bodies_go_up_unsigned_once_the_endpoint_shows_it_takes_crc32c(
        s3_server: str, s3_bucket: str, monkeypatch: pytest.MonkeyPatch, sign: bool | None,
        unsupported: tuple[str, ...], unsigned: int) -> None:
    """SigV4 over plain HTTP hashes every body byte with SHA-256; a body that carries its
    CRC32C to an endpoint that takes it needs no second check (botocore skips the hash over
    HTTPS for the same reason). The bytes read back are the bytes put, either way."""
    from aegis.snapshot.shard import crc32c

    with FaultProxy(s3_server, rate=0.0, unsupported=unsupported) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        store = open_store(f"s3://{s3_bucket}/sig", sign_payload=sign)
        bodies = [os.urandom(1000 + i) for i in range(3)]
        for i, body in enumerate(bodies):
            store.put(f"k{i}", body, crc32c=crc32c(body))
        assert [store.get(f"k{i}") for i in range(3)] == bodies
        store.close()
    assert len(proxy.body_hashes) == 3, proxy.body_hashes
    assert proxy.body_hashes.count("UNSIGNED-PAYLOAD") == unsigned, proxy.body_hashes
    assert all(len(h) == 64 for h in proxy.body_hashes[:3 - unsigned]), proxy.body_hashes


@pytest.mark.quick
def test_stale_uploads_are_aborted_from_markers_without_list_multipart_uploads(
        s3_server: str, s3_bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with FaultProxy(s3_server, rate=0.0, unsupported=("list_multipart_uploads",)) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        store = open_store(f"s3://{s3_bucket}/pre", part_size=5 << 20, multipart_threshold=5 << 20)
        assert isinstance(store, S3Store)
        assert store.abort_stale_uploads("job/", 0.0) == 0  # learns: no listing
        assert store.capabilities.list_multipart_uploads is False

        # A run dies in the middle of a multipart upload: its parts are up, never completed.
        def killed(**kwargs: object) -> None:
            raise KeyboardInterrupt  # stands in for the process dying: no abort either

        with monkeypatch.context() as m:
            m.setattr(store.client, "complete_multipart_upload", killed)
            m.setattr(store.client, "abort_multipart_upload", killed)
            m.setattr(store, "_delete_one", killed)
            with pytest.raises(KeyboardInterrupt):
                store.put("job/step-00000003/rank-00000/chunk-0000.zst", os.urandom(6 << 20))
        # The marker of the killed upload stays (the process that would remove it is gone).
        markers = [o.key for o in store.list(MARKERS)]
        assert len(markers) == 1

        direct = boto3.client("s3", endpoint_url=s3_server)
        assert len(direct.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", [])) == 1
        fresh = open_store(f"s3://{s3_bucket}/pre")  # the next run
        assert fresh.abort_stale_uploads("other-job/", 0.0) == 0  # another job's: not touched
        assert fresh.abort_stale_uploads("job/", 0.0) == 1
        assert direct.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", []) == []
        assert list(fresh.list(MARKERS)) == []
        assert proxy.refused["list_multipart_uploads"] == 2  # once per store, never retried


@pytest.mark.quick
def test_error_messages_name_the_key_once(s3_bucket: str) -> None:
    store = open_store(f"s3://{s3_bucket}/pre")
    with pytest.raises(AegisError) as e:
        store.get("j/m")
    assert f"s3://{s3_bucket}/pre/j/m does not exist" in str(e.value)


@pytest.mark.quick
def test_missing_bucket_and_no_credentials_fail_fast(s3_env: dict, s3_bucket: str,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     tmp_path: object) -> None:
    # Not after 9 retries and their backoff: one answer is enough.
    store = open_store("s3://no-such-bucket-aegis/x", retry=RetryPolicy(max_attempts=10))
    t = time.monotonic()
    with pytest.raises(ConfigError, match="does not exist"):
        store.check()
    with pytest.raises(AegisError, match="NoSuchBucket"):
        store.put("a/b", b"x")
    assert time.monotonic() - t < 2.0
    assert store.stats.retries == 0
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", f"{tmp_path}/none")
    monkeypatch.setenv("AWS_CONFIG_FILE", f"{tmp_path}/none")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    store = open_store(f"s3://{s3_bucket}")
    t = time.monotonic()
    with pytest.raises(ConfigError, match="no AWS credentials"):
        store.check()
    with pytest.raises(ConfigError, match="no AWS credentials"):
        store.put("a/b", b"x")
    assert time.monotonic() - t < 2.0


@pytest.mark.quick
def test_doctor_shows_what_the_endpoint_supports(s3_server: str, s3_bucket: str,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from aegis.cli import main

    with FaultProxy(s3_server, rate=0.0, unsupported=("batch_delete", "crc32c")) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        assert main(["doctor", f"s3://{s3_bucket}/ckpt", "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert doc["schema"] == "aegis.doctor/1"
        assert doc["capabilities"] == {"batch_delete": False, "list_multipart_uploads": True,
                                       "conditional_put": True, "crc32c": False}
        assert set(doc["fallbacks"]) == {"batch_delete", "crc32c"}
        assert main(["doctor", f"s3://{s3_bucket}/ckpt"]) == 0
        out = capsys.readouterr().out
        assert "deletes one object per request" in out and "2 optional operation(s) missing" in out
        assert main(["doctor", "s3://no-such-bucket-aegis/x"]) == 2  # a wrong URL is bad input
        assert "does not exist" in capsys.readouterr().err


def test_plan_and_doctor_do_not_import_torch() -> None:
    import subprocess
    import sys

    code = ("import sys\nfrom aegis.cli import main\n"
            "for args in (['--help'], ['plan', '--help'], ['doctor', '--help'],\n"
            "             ['plan', '--nodes', '4', '--mtbf-node-hours', '1000', '--snapshot-s', '1', '--restart-s', '60', '--restore-s', '5']):\n"
            "    assert main(args) == 0, args\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n"
            "main(['ls', '/nonexistent-aegis-dir'])\n"
            "assert 'torch' in sys.modules  # the commands reading snapshots do import it\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_prune_on_reduced_and_refusing_servers(s3_server: str, s3_bucket: str,
                                               monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    from aegis.cli import main
    from aegis.snapshot.durable import list_steps, manifest_key

    store = open_store(f"s3://{s3_bucket}/ckpt")
    for step in (1, 2, 3):
        store.put(manifest_key("j", step), b"{}")
        store.put(f"j/step-{step:08d}/rank-00000/chunk-0000.zst", b"x")
    url = f"s3://{s3_bucket}/ckpt"
    # A store that refuses deletes (403): exit 1, the steps named, nothing lost.
    with FaultProxy(s3_server, rate=0.0, deny_delete=True) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        assert main(["prune", url, "--job", "j", "--keep-last", "1"]) == 1
    err = capsys.readouterr().err
    assert "could not delete step(s) 1, 2" in err and "AccessDenied" in err, err
    assert list_steps(store, "j") == ([1, 2, 3], [])
    # A server without batch delete: prune works (exit 0), one request per object.
    with FaultProxy(s3_server, rate=0.0, unsupported=("batch_delete",)) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        assert main(["prune", url, "--job", "j", "--keep-last", "1"]) == 0
    assert "does not implement DeleteObjects" in capsys.readouterr().err
    assert list_steps(store, "j") == ([3], [])
