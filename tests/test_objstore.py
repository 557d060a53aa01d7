"""One contract for every object store: a local directory and S3 (moto's server on loopback)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from aegis.errors import AegisError, ConfigError
from aegis.snapshot.objstore import ObjectNotFound, ObjectStore, PreconditionFailed, open_store

pytestmark = pytest.mark.quick  # unit / single-process: make test-quick


@pytest.fixture(params=["file", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> ObjectStore:
    if request.param == "file":
        return open_store(f"file://{tmp_path}/durable")
    bucket = request.getfixturevalue("s3_bucket")
    return open_store(f"s3://{bucket}/some/prefix", part_size=5 << 20)


def test_put_get_range_list_delete(store: ObjectStore) -> None:
    store.check()
    store.put("job/step-00000001/rank-00000/chunk-0000.zst", b"hello world")
    store.put("job/step-00000001/manifest.json", b"{}")
    store.put("job/step-00000002/rank-00000/chunk-0000.zst", b"x" * 10)
    assert store.get("job/step-00000001/rank-00000/chunk-0000.zst") == b"hello world"
    assert store.get_range("job/step-00000001/rank-00000/chunk-0000.zst", 6, 11) == b"world"
    keys = [o.key for o in store.list("job/step-00000001/")]
    assert keys == ["job/step-00000001/manifest.json", "job/step-00000001/rank-00000/chunk-0000.zst"]
    assert [o.size for o in store.list("job/step-00000002")] == [10]
    store.delete(keys + ["job/never-existed"])
    assert [o.key for o in store.list("job/")] == ["job/step-00000002/rank-00000/chunk-0000.zst"]
    with pytest.raises(ObjectNotFound):
        store.get("job/step-00000001/manifest.json")


def test_conditional_put_commits_once(store: ObjectStore) -> None:
    store.put("j/manifest.json", b"first", if_absent=True)
    with pytest.raises(PreconditionFailed):
        store.put("j/manifest.json", b"second", if_absent=True)
    assert store.get("j/manifest.json") == b"first"


def test_large_object_round_trip(store: ObjectStore) -> None:
    data = os.urandom(12 << 20)  # > part size on S3: a multipart upload with parallel parts
    store.put("big/object", data)
    assert store.get("big/object") == data
    assert store.get_range("big/object", (5 << 20) - 3, (5 << 20) + 3) == data[(5 << 20) - 3:(5 << 20) + 3]


def test_hostile_keys_are_rejected(store: ObjectStore) -> None:
    for key in ("../escape", "/abs", "a/../b", "a//b", ""):
        with pytest.raises(AegisError, match="invalid object key"):
            store.put(key, b"x")


def test_missing_bucket_is_a_clear_error_at_check(s3_env: dict) -> None:
    store = open_store("s3://no-such-bucket-aegis/x")
    with pytest.raises(ConfigError, match="bucket 'no-such-bucket-aegis' does not exist"):
        store.check()


def test_missing_credentials_is_a_clear_error_at_check(s3_bucket: str, monkeypatch: pytest.MonkeyPatch,
                                                       tmp_path: Path) -> None:
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    store = open_store(f"s3://{s3_bucket}")
    with pytest.raises(ConfigError, match="no AWS credentials"):
        store.check()


def test_stores_share_one_client_per_configuration(s3_bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # in-process recovery opens a Manager, and its durable store, per round: the boto3 client
    # (~0.15 s of CPU to make) is made once per process and configuration
    a = open_store(f"s3://{s3_bucket}/a")
    b = open_store(f"s3://{s3_bucket}/b")
    assert a.client is b.client  # type: ignore[attr-defined]
    a.put("k", b"1")
    a.close()  # a round's store closed: the other store's requests still go through
    b.put("k", b"2")
    assert b.get("k") == b"2"
    assert open_store(f"s3://{s3_bucket}/a").get("k") == b"1"
    other = open_store(f"s3://{s3_bucket}/a", read_timeout_s=5.0)
    assert other.client is not b.client  # type: ignore[attr-defined]
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "someone-else")  # other credentials: another client
    assert open_store(f"s3://{s3_bucket}/a").client is not b.client  # type: ignore[attr-defined]


def test_bad_urls() -> None:
    for url in ("ftp://x/y", "s3:///nobucket", "file://host/path"):
        with pytest.raises(ConfigError):
            open_store(url)
