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

import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3 server as a separate process on a loopback port; yields its endpoint URL."""
    port = _free_port()
    moto = Path(sys.executable).with_name("moto_server")
    proc = subprocess.Popen([str(moto), "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            break
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError("moto_server did not start") from None
            time.sleep(0.1)
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
