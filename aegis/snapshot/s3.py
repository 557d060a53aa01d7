"""S3 (and any S3-compatible endpoint) as a durable object store. The only module importing boto3.

* endpoint and credentials: boto3's usual chain (``AWS_ENDPOINT_URL``, ``AWS_PROFILE``,
  ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, instance roles ...);
* botocore's own retries are off: one :class:`RetryPolicy` (tenacity) retries throttling
  (503 SlowDown, 429), 5xx, timeouts and connection errors, and counts the attempts;
* large objects go up as multipart uploads with parallel parts; every request carries an S3
  CRC32C checksum; reads of parts of an object are ranged GETs;
* ``put(..., if_absent=True)`` is ``If-None-Match: *``: a step's manifest is committed once.
"""

from __future__ import annotations

import builtins
import contextlib
import threading
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta, timezone
from typing import Any

import boto3
import botocore.exceptions as bexc
from botocore.config import Config

from aegis.errors import AegisError, ConfigError
from aegis.snapshot.objstore import (
    ObjectInfo,
    ObjectNotFound,
    ObjectStore,
    PreconditionFailed,
    StoreStats,
    check_key,
)
from aegis.snapshot.retry import RetryPolicy

__all__ = ["S3Store", "is_retryable"]

_RETRY_CODES = {
    "SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "RequestTimeTooSkewed",
    "InternalError", "ServiceUnavailable", "503", "500", "502", "504", "429",
    "RequestLimitExceeded", "TooManyRequests",
}
_CONN_ERRORS = (
    bexc.ConnectionError,  # EndpointConnectionError, ConnectionClosedError, timeouts, proxy ...
    bexc.HTTPClientError,
    bexc.IncompleteReadError,
    bexc.ResponseStreamingError,
    bexc.ReadTimeoutError,
    bexc.ConnectTimeoutError,
)


def _code(e: BaseException) -> str:
    if isinstance(e, bexc.ClientError):
        return str(e.response.get("Error", {}).get("Code", ""))
    return type(e).__name__


def _status(e: BaseException) -> int:
    if isinstance(e, bexc.ClientError):
        return int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
    return 0


def is_retryable(e: BaseException) -> bool:
    if isinstance(e, _CONN_ERRORS):
        return True
    if isinstance(e, bexc.ClientError):
        return _code(e) in _RETRY_CODES or _status(e) >= 500 or _status(e) == 429
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
        max_concurrency: int = 8,
        connect_timeout_s: float = 10.0,
        read_timeout_s: float = 60.0,
    ) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.url = f"s3://{bucket}" + (f"/{self.prefix}" if self.prefix else "")
        self.retry = retry or RetryPolicy()
        self.part_size = part_size
        self.stats = StoreStats()
        self._lock = threading.Lock()
        config = Config(
            retries={"total_max_attempts": 1, "mode": "standard"},  # tenacity retries instead
            connect_timeout=connect_timeout_s,
            read_timeout=read_timeout_s,
            max_pool_connections=max(max_concurrency * 2, 10),
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        self.client = boto3.session.Session().client("s3", endpoint_url=endpoint_url, config=config)
        self._pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="aegis-s3")

    # -- plumbing ------------------------------------------------------------------------------

    def _key(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _on_retry(self, e: BaseException) -> None:
        with self._lock:
            self.stats.retries += 1
            reason = _code(e) or type(e).__name__
            self.stats.retry_reasons[reason] = self.stats.retry_reasons.get(reason, 0) + 1

    def _call(self, what: str, fn: Any, **kwargs: Any) -> Any:
        def once() -> Any:
            with self._lock:
                self.stats.requests += 1
            return fn(**kwargs)

        try:
            return self.retry.call(once, retryable=is_retryable, on_retry=self._on_retry)
        except bexc.NoCredentialsError as e:
            raise ConfigError(
                f"{self.url}: no AWS credentials found; set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or run where an instance role is available"
            ) from e
        except bexc.ClientError as e:
            if _code(e) in ("NoSuchKey", "404", "NotFound"):
                raise ObjectNotFound(f"{self.url}/{kwargs.get('Key', '')} does not exist") from e
            if _code(e) in ("PreconditionFailed", "412") or _status(e) == 412:
                raise PreconditionFailed(f"{self.url}/{kwargs.get('Key', '')} already exists") from e
            raise AegisError(f"{self.url}: {what} failed: {e}") from e
        except _CONN_ERRORS as e:
            raise AegisError(f"{self.url}: {what} failed after retries: {e}") from e

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
            if status == 403:
                raise ConfigError(
                    f"durable store {self.url}: access denied to bucket {self.bucket!r}; check the "
                    "credentials and the bucket policy"
                ) from e
            raise ConfigError(f"durable store {self.url}: cannot reach the bucket: {e}") from e
        except _CONN_ERRORS as e:
            raise ConfigError(f"durable store {self.url}: endpoint unreachable: {e}") from e

    def put(self, key: str, data: bytes | memoryview, *, if_absent: bool = False) -> None:
        full = self._key(key)
        n = len(data)
        if n <= self.part_size or if_absent:
            extra = {"IfNoneMatch": "*"} if if_absent else {}
            self._call("put", self.client.put_object, Bucket=self.bucket, Key=full, Body=bytes(data),
                       ChecksumAlgorithm="CRC32C", **extra)
        else:
            self._multipart(full, memoryview(data))
        with self._lock:
            self.stats.bytes_up += n

    def _multipart(self, full: str, data: memoryview) -> None:
        up = self._call("create multipart upload", self.client.create_multipart_upload,
                        Bucket=self.bucket, Key=full, ChecksumAlgorithm="CRC32C")
        upload_id = up["UploadId"]

        def part(i: int) -> dict[str, Any]:
            body = bytes(data[i * self.part_size:(i + 1) * self.part_size])
            r = self._call("upload part", self.client.upload_part, Bucket=self.bucket, Key=full,
                           UploadId=upload_id, PartNumber=i + 1, Body=body, ChecksumAlgorithm="CRC32C")
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

    def get(self, key: str) -> bytes:
        full = self._key(key)

        def fetch() -> bytes:
            r = self.client.get_object(Bucket=self.bucket, Key=full)
            return r["Body"].read()

        data = self._call("get", lambda **_: fetch(), Key=full)
        with self._lock:
            self.stats.bytes_down += len(data)
        return data

    def get_range(self, key: str, start: int, end: int) -> bytes:
        full = self._key(key)

        def fetch() -> bytes:
            r = self.client.get_object(Bucket=self.bucket, Key=full, Range=f"bytes={start}-{end - 1}")
            return r["Body"].read()

        data = self._call("ranged get", lambda **_: fetch(), Key=full)
        with self._lock:
            self.stats.bytes_down += len(data)
        return data

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
        r = self._call("delete", self.client.delete_objects, Bucket=self.bucket,
                       Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True})
        if r.get("Errors"):
            raise AegisError(f"{self.url}: could not delete {len(r['Errors'])} object(s): {r['Errors'][:3]}")

    def abort_stale_uploads(self, prefix: str, older_than_s: float) -> int:
        full_prefix = f"{self.prefix}/{prefix}" if self.prefix else prefix
        r = self._call("list multipart uploads", self.client.list_multipart_uploads,
                       Bucket=self.bucket, Prefix=full_prefix)
        cutoff = datetime.now(timezone.utc) - timedelta(seconds=older_than_s)
        n = 0
        for u in r.get("Uploads", []):
            if u["Initiated"] <= cutoff:
                self._call("abort multipart upload", self.client.abort_multipart_upload,
                           Bucket=self.bucket, Key=u["Key"], UploadId=u["UploadId"])
                n += 1
        return n

    def close(self) -> None:
        self._pool.shutdown(wait=False)
