from __future__ import annotations

import shutil
import tempfile
import warnings
from pathlib import Path

import pytest

warnings.filterwarnings("ignore", message=".*FSDP2-wrapped module.*")


@pytest.fixture
def store_dir() -> Path:
    """A fresh node-store root on tmpfs, removed afterwards."""
    d = Path(tempfile.mkdtemp(prefix="aegis-test-", dir="/dev/shm"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


# -- a real S3 server on loopback (moto's server over HTTP) -------------------------------------

from tests.servers import S3_ENV, start_moto  # noqa: E402


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3 server as a separate process on a loopback port; yields its endpoint URL."""
    proc, endpoint = start_moto()
    yield endpoint
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    """Environment under which boto3 reaches the loopback server exactly as it reaches AWS."""
    for k, v in {**S3_ENV, "AWS_ENDPOINT_URL": s3_server}.items():
        monkeypatch.setenv(k, v)
    return {**S3_ENV, "AWS_ENDPOINT_URL": s3_server}


@pytest.fixture
def s3_bucket(s3_env) -> str:
    """A fresh bucket; returns its name."""
    import uuid

    import boto3

    name = f"aegis-{uuid.uuid4().hex[:12]}"
    boto3.client("s3").create_bucket(Bucket=name)
    return name
