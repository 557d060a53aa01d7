"""S3 (and any S3-compatible endpoint) as a durable object store. The only module importing boto3.

* endpoint and credentials: boto3's usual chain (``AWS_ENDPOINT_URL``, ``AWS_PROFILE``,
  ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, instance roles ...);
* botocore's own retries are off: one :class:`RetryPolicy` (tenacity) retries what may pass:
  throttling (503 SlowDown, 429), 500/502/503/504, timeouts and connection resets. Other 4xx
  and 501 NotImplemented are answers, not accidents: never retried;
* large objects go up as multipart uploads with parallel parts; reads of parts of an object are
  ranged GETs;
* optional operations (:class:`~aegis.snapshot.objstore.Capabilities`): batch delete,
  ListMultipartUploads, conditional put (``If-None-Match: *``, a step's manifest is committed
  once) and CRC32C checksums. Each is used until the endpoint answers 501 NotImplemented; from
  then on this store uses its fallback (one delete per object, its own upload-id markers, a
  check-put-read-back commit, no transport checksum) and says so once in :meth:`take_notes`.
"""

from __future__ import annotations

import base64
import builtins
import contextlib
import hashlib
import json
import os
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta, timezone
from typing import Any

import boto3
import botocore.exceptions as bexc
from botocore.config import Config

from aegis.errors import AegisError, ConfigError
from aegis.snapshot.objstore import (
    CAPABILITY_FALLBACKS,
    Capabilities,
    ObjectInfo,
    ObjectNotFound,
    ObjectStore,
    PreconditionFailed,
    StoreStats,
    UnsupportedOperation,
    check_key,
)
from aegis.snapshot.retry import RetryPolicy

__all__ = ["S3Store", "is_retryable", "is_not_implemented"]

# Codes worth another attempt, whatever their status (S3 answers RequestTimeout and some
# throttling with a 400).
_RETRY_CODES = {
    "SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "InternalError",
    "ServiceUnavailable", "RequestLimitExceeded", "TooManyRequests", "503", "500", "502", "504",
    "429",
}
_RETRY_STATUS = {429, 500, 502, 503, 504}
_NOT_IMPLEMENTED_CODES = {"NotImplemented", "NotImplementedError", "501"}
_CONN_ERRORS = (
    bexc.ConnectionError,  # EndpointConnectionError, ConnectionClosedError, timeouts, proxy ...
    bexc.HTTPClientError,
    bexc.IncompleteReadError,
    bexc.ResponseStreamingError,
    bexc.ReadTimeoutError,
    bexc.ConnectTimeoutError,
)
MARKERS = ".aegis/uploads/"  # own upload-id records, where ListMultipartUploads is missing

_clients: dict[str, Any] = {}
_clients_lock = threading.Lock()


def shared_client(endpoint_url: str | None, options: dict[str, Any]) -> Any:
    """The process's boto3 S3 client for ``endpoint_url``, botocore ``Config(**options)`` and
    the ``AWS_*`` variables of the environment: made once, then shared by every :class:`S3Store` that
    asks for the same (boto3 clients are thread-safe; sessions are not, so each is made under a
    lock). Making one loads botocore's service model: ~0.15 s of CPU and a large heap of objects
    (measured in the 6-node chaos campaign: 10 of the 12.6 s its Managers spent starting). An
    in-process round opens a Manager, and with it the durable store, per round; the client
    outlives the round. Credentials are resolved by the client's provider as before (an
    instance role's refresh included); changing the AWS variables gives a new client."""
    # what boto3 reads from the environment when it makes a client (credentials, region,
    # endpoint, config files): a client made under other values is another client
    env = sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_"))
    key = repr((endpoint_url, sorted(options.items()), env))
    with _clients_lock:
        client = _clients.get(key)
        if client is None:
            client = boto3.session.Session().client("s3", endpoint_url=endpoint_url,
                                                    config=Config(**options))
            _clients[key] = client
        return client


def _code(e: BaseException) -> str:
    if isinstance(e, bexc.ClientError):
        return str(e.response.get("Error", {}).get("Code", ""))
    return type(e).__name__


def _status(e: BaseException) -> int:
    if isinstance(e, bexc.ClientError):
        return int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
    return 0


def is_not_implemented(e: BaseException) -> bool:
    """The endpoint does not implement the operation (or an option of it): 501 NotImplemented."""
    return isinstance(e, bexc.ClientError) and (_status(e) == 501 or _code(e) in _NOT_IMPLEMENTED_CODES)


def is_retryable(e: BaseException) -> bool:
    """Throttling, 500/502/503/504, timeouts and resets: yes. Other 4xx and 501: no."""
    if isinstance(e, _CONN_ERRORS):
        return True
    if isinstance(e, bexc.ClientError):
        if is_not_implemented(e):
            return False
        return _code(e) in _RETRY_CODES or _status(e) in _RETRY_STATUS
    return isinstance(e, (ConnectionError, TimeoutError))


class S3Store(ObjectStore):
    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        retry: RetryPolicy | None = None,
        part_size: int = 8 << 20,
        multipart_threshold: int = 64 << 20,
        max_concurrency: int = 8,
        connect_timeout_s: float = 10.0,
        read_timeout_s: float = 60.0,
        sign_payload: bool | None = None,
    ) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.url = f"s3://{bucket}" + (f"/{self.prefix}" if self.prefix else "")
        self.retry = retry or RetryPolicy()
        self.part_size = part_size
        # Objects up to this size go in one PutObject. A chunk (16 MiB by default) cut into
        # parts costs 4 requests instead of 1, and gains no parallelism: the uploader already
        # puts several chunks at once (measured against moto here: 16 MiB objects, 4 threads,
        # 137 MiB/s in 8 MiB parts, 244 MiB/s whole).
        self.multipart_threshold = multipart_threshold
        self.stats = StoreStats()
        self.capabilities = Capabilities()
        self._notes: list[str] = []
        self._lock = threading.Lock()
        self._closed = False
        self._endpoint = endpoint_url
        self._options: dict[str, Any] = dict(
            retries={"total_max_attempts": 1, "mode": "standard"},  # tenacity retries instead
            connect_timeout=connect_timeout_s,
            read_timeout=read_timeout_s,
            max_pool_connections=max(max_concurrency * 2, 10),
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        self.client = shared_client(endpoint_url, self._options)
        # Bodies with a CRC32C checksum the endpoint has shown it checks go up unsigned (see
        # _body_client); ``sign_payload`` signs every body, as botocore does over plain HTTP.
        self.sign_payload = (os.environ.get("AEGIS_S3_SIGN_PAYLOAD", "").strip().lower()
                             not in ("", "0", "false", "no") if sign_payload is None else sign_payload)
        self._crc_echoed = False  # a put's response carried back the CRC32C it was sent
        self._unsigned: Any = None
        self._pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="aegis-s3")

    # -- plumbing ------------------------------------------------------------------------------

    def _key(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _body_client(self, crc32c: int | None) -> Any:
        """The client for a PutObject carrying ``crc32c``: once a response has carried back the
        CRC32C it was sent (the endpoint takes the header: S3 checks the body against it; moto
        only echoes it), a client that does not sign the body (``UNSIGNED-PAYLOAD``): SigV4
        over plain HTTP otherwise hashes every byte with SHA-256 (1.4 GB/s here, a core's 0.7 s
        per GB uploaded) for an integrity the checksum gives, and every read checks again (the
        manifest's crc32c of each stored chunk). Over HTTPS botocore never signs a checksummed
        body; the headers, the checksum among them, stay signed either way. Anything else: the
        signing client."""
        if crc32c is None or self.sign_payload or not self._crc_echoed:
            return self.client
        if self._unsigned is None:
            self._unsigned = shared_client(
                self._endpoint, {**self._options, "s3": {"payload_signing_enabled": False}})
        return self._unsigned

    def _where(self, full: str) -> str:
        """``s3://bucket/prefix/key`` for a full key (the prefix once)."""
        return f"s3://{self.bucket}/{full}" if full else self.url

    def _on_retry(self, e: BaseException) -> None:
        with self._lock:
            self.stats.retries += 1
            reason = _code(e) or type(e).__name__
            self.stats.retry_reasons[reason] = self.stats.retry_reasons.get(reason, 0) + 1

    def _learn(self, capability: str, supported: bool) -> None:
        with self._lock:
            if getattr(self.capabilities, capability) is supported:
                return
            setattr(self.capabilities, capability, supported)
            if not supported:
                what, fallback = CAPABILITY_FALLBACKS[capability]
                self._notes.append(f"{self.url}: the endpoint does not implement {what}; aegis {fallback}")

    def _say(self, note: str) -> None:
        with self._lock:
            self._notes.append(note)

    def take_notes(self) -> list[str]:
        with self._lock:
            notes, self._notes = self._notes, []
        return notes

    def _call(self, what: str, fn: Any, **kwargs: Any) -> Any:
        def once() -> Any:
            with self._lock:
                self.stats.requests += 1
            return fn(**kwargs)

        where = self._where(str(kwargs.get("Key", "")))

        def retryable(e: BaseException) -> bool:
            # a closed store (a Manager aborted by in-process recovery) stops retrying at once:
            # its uploader thread must not spend the policy's 300 s on a dead endpoint
            return not self._closed and is_retryable(e)

        try:
            return self.retry.call(once, retryable=retryable, on_retry=self._on_retry)
        except bexc.NoCredentialsError as e:
            raise ConfigError(
                f"{self.url}: no AWS credentials found; set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or run where an instance role is available"
            ) from e
        except bexc.ClientError as e:
            if _code(e) in ("NoSuchKey", "NoSuchUpload", "404", "NotFound"):
                raise ObjectNotFound(f"{where} does not exist") from e
            if _code(e) in ("PreconditionFailed", "412") or _status(e) == 412:
                raise PreconditionFailed(f"{where} already exists") from e
            if is_not_implemented(e):
                raise UnsupportedOperation(f"{where}: {what}: the endpoint does not implement it "
                                           f"(501 {_code(e)})") from e
            raise AegisError(f"{where}: {what} failed: {e}") from e
        except _CONN_ERRORS as e:
            raise AegisError(f"{where}: {what} failed after retries: {e}") from e

    # -- interface -----------------------------------------------------------------------------

    def check(self) -> None:
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except bexc.NoCredentialsError as e:
            raise ConfigError(
                f"durable store {self.url}: no AWS credentials found; set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or run where an instance role is available"
            ) from e
        except bexc.ClientError as e:
            status = _status(e)
            if status == 404 or _code(e) in ("404", "NoSuchBucket"):
                raise ConfigError(
                    f"durable store {self.url}: bucket {self.bucket!r} does not exist at this "
                    "endpoint; create it or fix the durable URL / AWS_ENDPOINT_URL"
                ) from e
            if status in (401, 403):
                raise ConfigError(
                    f"durable store {self.url}: access denied to bucket {self.bucket!r} ({_code(e)}); "
                    "check the credentials and the bucket policy"
                ) from e
            raise ConfigError(f"durable store {self.url}: cannot reach the bucket: {e}") from e
        except _CONN_ERRORS as e:
            raise ConfigError(f"durable store {self.url}: endpoint unreachable: {e}") from e

    def put_unsynced(self, key: str, data: bytes | memoryview, *, crc32c: int | None = None) -> None:
        self.put(key, data, crc32c=crc32c)

    def put(self, key: str, data: bytes | memoryview, *, if_absent: bool = False,
            crc32c: int | None = None) -> None:
        """``crc32c`` (the data's, known to the caller): sent as the object's CRC32C checksum,
        which S3 checks against the bytes it received, instead of botocore computing it again
        over the body (a pass over every byte uploaded); without it botocore computes it."""
        full = self._key(key)
        n = len(data)
        if n <= self.multipart_threshold or if_absent:
            if not self._put_object(full, bytes(data), if_absent=if_absent, crc32c=crc32c) and if_absent:
                self._put_checked(full, bytes(data))  # no conditional put at this endpoint
        else:
            self._multipart(full, memoryview(data))
        with self._lock:
            self.stats.bytes_up += n

    def _put_object(self, full: str, body: bytes, *, if_absent: bool, crc32c: int | None = None) -> bool:
        """One PutObject with the optional parts the endpoint takes; returns whether the
        If-None-Match condition was part of it (False: nothing was put, the caller commits by
        its fallback). A 501 drops the least proven option."""
        crc_tentative = False
        while True:
            caps = self.capabilities
            if if_absent and caps.conditional_put is False:
                return False
            use_crc = caps.crc32c is not False
            use_cond = if_absent and caps.conditional_put is not False
            extra: dict[str, Any] = {}
            if use_crc:
                extra["ChecksumAlgorithm"] = "CRC32C"
                if crc32c is not None:  # botocore sends it as given, computes nothing
                    extra["ChecksumCRC32C"] = base64.b64encode(crc32c.to_bytes(4, "big")).decode()
            if use_cond:
                extra["IfNoneMatch"] = "*"
            try:
                sent = crc32c if use_crc else None
                r = self._call("put", self._body_client(sent).put_object, Bucket=self.bucket, Key=full,
                               Body=body, **extra)
                if sent is not None and not self._crc_echoed and r.get("ChecksumCRC32C") == \
                        extra["ChecksumCRC32C"]:
                    self._crc_echoed = True
            except UnsupportedOperation:
                if use_cond and (not use_crc or caps.crc32c):
                    self._learn("conditional_put", False)
                    if crc_tentative:  # the condition was the culprit, not the checksum
                        with self._lock:
                            caps.crc32c = None
                        crc_tentative = False
                elif use_crc and not use_cond:
                    self._learn("crc32c", False)
                elif use_crc and use_cond:  # both unproven: try the condition alone first
                    with self._lock:
                        caps.crc32c = False
                    crc_tentative = True
                else:
                    raise
                continue
            if crc_tentative:
                self._learn("crc32c", False)
            if use_crc:
                self._learn("crc32c", True)
            if use_cond:
                self._learn("conditional_put", True)
            return use_cond

    def _put_checked(self, full: str, body: bytes) -> None:
        """Commit without a conditional put: absent -> put -> read back (see CAPABILITY_FALLBACKS)."""
        try:
            self._call("head", self.client.head_object, Bucket=self.bucket, Key=full)
            raise PreconditionFailed(f"{self._where(full)} already exists")
        except ObjectNotFound:
            pass
        self._put_object(full, body, if_absent=False)
        back = self._get(full, None)
        if back != body:  # another writer came in between: its manifest stands, not ours
            raise PreconditionFailed(f"{self._where(full)} already exists (written by another writer "
                                     "at the same time)")

    def _marker(self, full: str, upload_id: str) -> str:
        return MARKERS + hashlib.sha256(f"{full}\0{upload_id}".encode()).hexdigest()[:32] + ".json"

    def _multipart(self, full: str, data: memoryview) -> None:
        while True:
            use_crc = self.capabilities.crc32c is not False
            extra: dict[str, Any] = {"ChecksumAlgorithm": "CRC32C"} if use_crc else {}
            try:
                up = self._call("create multipart upload", self.client.create_multipart_upload,
                                Bucket=self.bucket, Key=full, **extra)
                break
            except UnsupportedOperation:
                if not use_crc:
                    raise
                self._learn("crc32c", False)
        upload_id = up["UploadId"]
        marker = None
        if self.capabilities.list_multipart_uploads is False:
            # No way to list uploads later: record this one until it is completed or aborted.
            marker = self._marker(full, upload_id)
            rel = full[len(self.prefix) + 1:] if self.prefix else full
            self._put_object(self._key(marker), json.dumps(
                {"key": rel, "upload_id": upload_id, "initiated": time.time()}).encode(), if_absent=False)

        def part(i: int) -> dict[str, Any]:
            body = bytes(data[i * self.part_size:(i + 1) * self.part_size])
            r = self._call("upload part", self.client.upload_part, Bucket=self.bucket, Key=full,
                           UploadId=upload_id, PartNumber=i + 1, Body=body, **extra)
            return {"PartNumber": i + 1, "ETag": r["ETag"], "ChecksumCRC32C": r.get("ChecksumCRC32C")}

        count = (len(data) + self.part_size - 1) // self.part_size
        try:
            parts = list(self._pool.map(part, range(count)))
            parts = [{k: v for k, v in p.items() if v is not None} for p in parts]
            self._call("complete multipart upload", self.client.complete_multipart_upload,
                       Bucket=self.bucket, Key=full, UploadId=upload_id,
                       MultipartUpload={"Parts": parts})
        except BaseException:
            with contextlib.suppress(Exception):  # the original error matters more
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=full, UploadId=upload_id)
            raise
        finally:
            if marker is not None:
                with contextlib.suppress(Exception):  # a left marker only costs one abort later
                    self._delete_one(self._key(marker))
        if use_crc:
            self._learn("crc32c", True)

    def _get(self, full: str, byte_range: str | None) -> bytes:
        def fetch() -> bytes:
            extra = {"Range": byte_range} if byte_range else {}
            r = self.client.get_object(Bucket=self.bucket, Key=full, **extra)
            return r["Body"].read()

        data: bytes = self._call("ranged get" if byte_range else "get", lambda **_: fetch(), Key=full)
        with self._lock:
            self.stats.bytes_down += len(data)
        return data

    def get(self, key: str) -> bytes:
        return self._get(self._key(key), None)

    def get_into(self, key: str, out: memoryview) -> int:
        """GetObject, its body read with ``readinto`` straight into ``out``: no object-sized
        ``bytes`` built from the socket's reads and then copied (one pass over the bytes less
        than :meth:`get`). A body cut short raises botocore's IncompleteReadError: retried,
        from the start of ``out``."""
        full = self._key(key)

        def fetch() -> int:
            body = None
            try:
                r = self.client.get_object(Bucket=self.bucket, Key=full)
                body = r["Body"]
                size = int(r["ContentLength"])
                got = 0
                while size <= len(out) and got < size:
                    n = body.readinto(out[got:size])
                    if not n:
                        raise bexc.IncompleteReadError(actual_bytes=got, expected_bytes=size)
                    got += n
                return size
            finally:
                if body is not None:
                    body.close()

        size: int = self._call("get", lambda **_: fetch(), Key=full)
        with self._lock:
            self.stats.bytes_down += min(size, len(out))
        return size

    def get_range(self, key: str, start: int, end: int) -> bytes:
        return self._get(self._key(key), f"bytes={start}-{end - 1}")

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        full_prefix = f"{self.prefix}/{prefix}" if self.prefix else prefix
        token: str | None = None
        strip = len(self.prefix) + 1 if self.prefix else 0
        while True:
            kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": full_prefix}
            if token:
                kwargs["ContinuationToken"] = token
            r = self._call("list", self.client.list_objects_v2, **kwargs)
            for obj in r.get("Contents", []):
                yield ObjectInfo(obj["Key"][strip:], int(obj["Size"]))
            if not r.get("IsTruncated"):
                return
            token = r["NextContinuationToken"]

    def delete(self, keys: Iterable[str]) -> None:
        batch: builtins.list[str] = []
        for key in keys:
            batch.append(self._key(key))
            if len(batch) == 1000:  # S3's limit per DeleteObjects request
                self._delete(batch)
                batch = []
        if batch:
            self._delete(batch)

    def _delete(self, batch: builtins.list[str]) -> None:
        if self.capabilities.batch_delete is not False:
            try:
                r = self._call("delete", self.client.delete_objects, Bucket=self.bucket,
                               Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True})
            except UnsupportedOperation:
                self._learn("batch_delete", False)
            else:
                self._learn("batch_delete", True)
                if r.get("Errors"):
                    errs = r["Errors"]
                    raise AegisError(f"{self.url}: could not delete {len(errs)} object(s): "
                                     + "; ".join(f"{e.get('Key')}: {e.get('Code')}" for e in errs[:3]))
                return
        list(self._pool.map(self._delete_one, batch))

    def _delete_one(self, full: str) -> None:
        with contextlib.suppress(ObjectNotFound):  # deleting what is gone is done
            self._call("delete", self.client.delete_object, Bucket=self.bucket, Key=full)

    def abort_stale_uploads(self, prefix: str, older_than_s: float) -> int:
        full_prefix = f"{self.prefix}/{prefix}" if self.prefix else prefix
        cutoff = datetime.now(timezone.utc) - timedelta(seconds=older_than_s)
        stale: builtins.list[tuple[str, str]] = []
        if self.capabilities.list_multipart_uploads is not False:
            try:
                kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": full_prefix}
                while True:
                    r = self._call("list multipart uploads", self.client.list_multipart_uploads, **kwargs)
                    stale += [(u["Key"], u["UploadId"]) for u in r.get("Uploads", [])
                              if u["Initiated"] <= cutoff]
                    if not r.get("IsTruncated"):
                        break
                    kwargs.update(KeyMarker=r["NextKeyMarker"], UploadIdMarker=r["NextUploadIdMarker"])
            except UnsupportedOperation:
                self._learn("list_multipart_uploads", False)
            else:
                self._learn("list_multipart_uploads", True)
        markers: dict[tuple[str, str], str] = {}
        if self.capabilities.list_multipart_uploads is False:
            for obj in self.list(MARKERS):
                try:
                    rec = json.loads(self.get(obj.key))
                    if not str(rec["key"]).startswith(prefix):
                        continue
                    if float(rec["initiated"]) <= cutoff.timestamp():
                        markers[(self._key(rec["key"]), str(rec["upload_id"]))] = obj.key
                except (ObjectNotFound, ValueError, KeyError, TypeError):
                    continue  # gone meanwhile, or not ours
            stale += list(markers)
        n = 0
        for full, upload_id in stale:
            try:
                self._call("abort multipart upload", self.client.abort_multipart_upload,
                           Bucket=self.bucket, Key=full, UploadId=upload_id)
                n += 1
            except ObjectNotFound:
                pass  # finished or aborted meanwhile
            except UnsupportedOperation:
                self._say(f"{self.url}: the endpoint does not implement AbortMultipartUpload: aegis "
                          "cannot remove stale multipart uploads; set a bucket lifecycle rule "
                          "(AbortIncompleteMultipartUpload) or remove them with the server's tools")
                return n
            if (full, upload_id) in markers:
                self._delete_one(self._key(markers[(full, upload_id)]))
        return n

    def probe(self) -> Capabilities:
        """Try each optional operation once on a probe key under ``.aegis/`` and learn the
        answers (``aegis doctor``). Writes and removes one small object."""
        key = f".aegis/probe-{uuid.uuid4().hex[:12]}"
        full = self._key(key)
        with self._lock:
            self.capabilities = Capabilities()
        try:
            self._put_object(full, b"aegis probe", if_absent=False)  # learns crc32c
            try:
                self._call("conditional put", self.client.put_object, Bucket=self.bucket, Key=full,
                           Body=b"aegis probe 2", IfNoneMatch="*")
                # Accepted over an existing key: the condition is ignored, which is worse than
                # a 501 because nothing says so.
                self._learn("conditional_put", False)
                self._say(f"{self.url}: the endpoint accepted If-None-Match: * over an existing "
                          "object (the condition is ignored)")
            except PreconditionFailed:
                self._learn("conditional_put", True)
            except UnsupportedOperation:
                self._learn("conditional_put", False)
            with contextlib.suppress(UnsupportedOperation):
                list(self._call("list multipart uploads", self.client.list_multipart_uploads,
                                Bucket=self.bucket, Prefix=full).get("Uploads", []))
                self._learn("list_multipart_uploads", True)
            if self.capabilities.list_multipart_uploads is None:
                self._learn("list_multipart_uploads", False)
            self._delete([full])  # learns batch_delete
        finally:
            with contextlib.suppress(Exception):
                self._delete_one(full)
        return self.capabilities

    def close(self) -> None:
        self._closed = True
        self._pool.shutdown(wait=False)
