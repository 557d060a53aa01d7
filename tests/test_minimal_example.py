"""``examples/minimal.py`` as its docstring says to run it: the membership store (``aegis store
serve``), two workers under ``python -m aegis.launch``, in-process recovery on. It trains and
snapshots every step; run again, it resumes from the last snapshot in the node store."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist_utils import free_port

ROOT = Path(__file__).resolve().parents[1]


def _run(env: dict[str, str], steps: int) -> str:
    p = subprocess.run(
        [sys.executable, "-m", "aegis.launch", "--standalone", "--nproc-per-node=2",
         "--max-restarts=0", str(ROOT / "examples" / "minimal.py"), "--steps", str(steps)],
        env=env, capture_output=True, text=True, timeout=240)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    return out


def _store() -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "aegis.cli", "store", "serve", "--host",
                             "127.0.0.1", "--port", str(port), "--quiet"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                            start_new_session=True)
    return proc, port


@pytest.mark.timeout(600)
def test_the_minimal_example_trains_and_resumes(tmp_path: Path) -> None:
    assert len((ROOT / "examples" / "minimal.py").read_text().splitlines()) < 80
    outs = []
    for steps in (4, 6):  # a launch, then the job launched again (a new membership store)
        store, port = _store()
        env = {**os.environ, "AEGIS_MEMBERSHIP": f"127.0.0.1:{port}", "OMP_NUM_THREADS": "1",
               "AEGIS_STORE_DIR": str(tmp_path / "store"), "PYTHONWARNINGS": "ignore"}
        try:
            outs.append(_run(env, steps))
        finally:
            os.killpg(store.pid, signal.SIGTERM)
            store.wait(timeout=30)
    first, again = outs
    assert "world 2: resumed at step 0" in first, first[-3000:]
    assert "[minimal] step 4 loss" in first
    assert "world 2: resumed at step 4" in again, again[-3000:]
    assert "[minimal] step 6 loss" in again and "[minimal] step 4 loss" not in again
