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
