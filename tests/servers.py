"""Real servers and mounts the tests start: moto's S3 server over HTTP, small tmpfs mounts."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def start_moto(host: str = "127.0.0.1", env: dict[str, str] | None = None
               ) -> tuple[subprocess.Popen[bytes], str]:
    """moto's S3 server as a separate process listening on ``host``; returns it and its URL."""
    port = free_port(host)
    moto = Path(sys.executable).with_name("moto_server")
    proc = subprocess.Popen([str(moto), "-H", host, "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env={**os.environ, **(env or {})})
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection((host, port), timeout=0.5).close()
            return proc, f"http://{host}:{port}"
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError("moto_server did not start") from None
            time.sleep(0.1)


def mount_tmpfs(path: Path, size: str) -> Path:
    """A tmpfs of ``size`` (e.g. "16m") at ``path``; the test is skipped without root."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    return path


def umount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], check=False)


def tcp_store_server() -> Any:
    """A c10d TCPStore server on loopback, a port of its own."""
    from datetime import timedelta

    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=30))


class RestartingClient:
    """A store client for a synthetic store restart: every call goes to its server until
    :meth:`restart` points it at a new (empty) one, after which its next call raises
    ``StoreRestarted`` once, as a ``StoreClient`` does when it finds the store's epoch gone."""

    def __init__(self, server: Any) -> None:
        self.s, self.restarted = server, False

    def restart(self, server: Any) -> None:
        self.s, self.restarted = server, True

    def __getattr__(self, name: str) -> Any:
        if self.restarted:
            from aegis.training.inprocess.storeclient import StoreRestarted

            self.restarted = False
            raise StoreRestarted("synthetic restart")
        return getattr(self.s, name)
