"""One contract for every object store: a local directory and S3 (moto's server on loopback)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from aegis.errors import AegisError, ConfigError
from aegis.snapshot.objstore import ObjectNotFound, ObjectStore, PreconditionFailed, open_store
from aegis.snapshot.s3 import S3Store

pytestmark = pytest.mark.quick  # unit / single-process: make test-quick


@pytest.fixture(params=["file", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> ObjectStore:
    if request.param == "file":
        return open_store(f"file://{tmp_path}/durable")
    bucket = request.getfixturevalue("s3_bucket")
    return open_store(f"s3://{bucket}/some/prefix", part_size=5 << 20, multipart_threshold=5 << 20)


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


def test_get_into_reads_the_object_into_the_buffer_and_says_its_size(store: ObjectStore) -> None:
    data = os.urandom(3 << 20)
    store.put("j/obj", data)
    buf = bytearray(len(data) + 100)
    assert store.get_into("j/obj", memoryview(buf)) == len(data)
    assert bytes(buf[:len(data)]) == data and bytes(buf[len(data):]) == bytes(100)
    small = bytearray(b"\xab" * 1000)  # an object larger than expected is not read into it
    assert store.get_into("j/obj", memoryview(small)) == len(data)
    assert small == bytearray(b"\xab" * 1000)
    with pytest.raises(ObjectNotFound):
        store.get_into("j/missing", memoryview(buf))


def test_get_into_retries_a_body_cut_mid_stream(s3_server: str, s3_bucket: str) -> None:
    """A GetObject whose body stops half way (the connection reset after half the announced
    bytes) is retried and the buffer holds the whole object: a read into a caller's buffer ends
    neither short nor with the first try's bytes."""
    from tests.s3_proxy import FaultProxy

    data = os.urandom(2 << 20)
    with FaultProxy(s3_server, rate=0.0) as proxy:
        store = S3Store(s3_bucket, "cut", endpoint_url=proxy.url)
        store.put("obj", data)
        proxy.cut_bodies = 1
        buf = bytearray(len(data))
        assert store.get_into("obj", memoryview(buf)) == len(data)
        assert proxy.counts["cut"] == 1 and store.stats.retries >= 1, (proxy.counts, store.stats)
        assert bytes(buf) == data


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


def test_unsynced_puts_are_whole_objects_and_sync_makes_them_durable(store: ObjectStore) -> None:
    """A shard's chunks go up with put_unsynced and one sync before the manifest: readers see
    whole objects at once, and sync() leaves nothing pending (S3: every put is durable)."""
    keys = [f"job/step-00000003/rank-00000/chunk-{i:04d}.zst" for i in range(3)]
    for i, k in enumerate(keys):
        store.put_unsynced(k, bytes([i]) * (1000 + i))
    assert [o.key for o in store.list("job/step-00000003/")] == keys
    assert store.get(keys[2]) == b"\x02" * 1002
    store.sync()
    store.sync()  # nothing pending: a no-op
    assert getattr(store, "_unsynced", set()) == set()


def test_a_directory_store_syncs_a_batch_once_or_fsyncs_each_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With syncfs (Linux): one call for the batch. Without it: an fsync of every file written
    since the last sync and of each of their directories, none before."""
    import aegis.snapshot.objstore as objstore

    store = open_store(f"file://{tmp_path}/durable")
    calls: list[int] = []
    real = objstore._syncfs()
    assert real is not None, "this test expects Linux's syncfs"
    monkeypatch.setattr(objstore, "_syncfs", lambda: lambda fd: calls.append(fd) or real(fd))
    store.put_unsynced("j/a/x", b"1")
    store.put_unsynced("j/b/y", b"2")
    store.sync()
    assert len(calls) == 1
    synced: list[str] = []
    real_fsync = os.fsync
    monkeypatch.setattr(objstore, "_syncfs", lambda: None)
    monkeypatch.setattr(objstore.os, "fsync", lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}"))
                        or real_fsync(fd))
    store.put_unsynced("j/a/z", b"3")
    store.put_unsynced("j/b/w", b"4")
    assert synced == []  # nothing flushed per put
    store.sync()
    root = tmp_path / "durable"
    assert sorted(synced) == sorted(str(p) for p in (root / "j/a/z", root / "j/b/w", root / "j/a", root / "j/b"))


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


def test_a_checksum_given_with_the_data_is_the_objects_checksum(store: ObjectStore) -> None:
    """``put_unsynced(crc32c=)``: S3 receives the caller's CRC32C (the uploader's, computed over
    the node store's bytes) as the object's checksum, which S3 checks against the bytes it
    received (moto stores it without that check: its source says so). A file store ignores it
    (its bytes are checked on every read)."""
    import base64

    import crc32c as crc

    data = os.urandom(3000)
    store.put_unsynced("j/ok", data, crc32c=crc.crc32c(data))
    store.sync()
    assert store.get("j/ok") == data
    if isinstance(store, S3Store):
        head = store.client.head_object(Bucket=store.bucket, Key=store._key("j/ok"), ChecksumMode="ENABLED")
        assert head["ChecksumCRC32C"] == base64.b64encode(crc.crc32c(data).to_bytes(4, "big")).decode()


def test_a_directory_listing_skips_an_object_deleted_while_it_lists(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Retention deletes a step's chunks while another process lists the store (found by
    test_kill's poll: a FileNotFoundError out of ``list``): the object the walk saw but that is
    gone by its stat is not listed, as S3's listing would not list it."""
    store = open_store(f"file://{tmp_path}/d")
    store.put("a/1", b"x")
    store.put("a/2", b"yy")
    walk = os.walk

    def walk_then_delete(top, *args, **kwargs):  # type: ignore[no-untyped-def]
        for dirpath, dirs, files in walk(top, *args, **kwargs):
            if "1" in files:
                (Path(dirpath) / "1").unlink()  # gone between the walk and the stat
            yield dirpath, dirs, files

    monkeypatch.setattr(os, "walk", walk_then_delete)
    assert [(o.key, o.size) for o in store.list("a/")] == [("a/2", 2)]
