"""Process memory policy for in-process recovery (``hostmem.retain_freed_memory``), checked in
fresh subprocesses: it is process-wide, and must not change the test runner's own malloc."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt only")

# A round's state (256 MB of 8 MB tensors) written, freed, and the next round's written again:
# the page faults of the second writing say whether it got the pages the first one freed.
SCRIPT = """
import json, resource, sys
import torch
from aegis.snapshot import hostmem
applied = hostmem.retain_freed_memory() if sys.argv[1] == "1" else None
def state():
    ts = [torch.empty(2 << 20) for _ in range(32)]  # 32 x 8 MB
    for t in ts:
        t.fill_(1.0)
    return ts
old = state()
del old
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
new = state()
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(json.dumps({"applied": applied, "faults": faults}))
"""

PAGES = (256 << 20) // os.sysconf("SC_PAGE_SIZE")


def _run(call: bool, **env: str) -> dict[str, object]:
    out = subprocess.run([sys.executable, "-c", SCRIPT, "1" if call else "0"], check=True,
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1", **env})
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def test_freed_state_is_reused_by_the_next_without_new_page_faults() -> None:
    kept = _run(True)
    assert kept["applied"] is True
    plain = _run(False)
    assert int(plain["faults"]) > PAGES * 9 // 10, plain  # glibc returned them: every page new
    # most of the freed pages come back already faulted in (75-85% here: malloc's bins do not
    # hand every block back in the same place)
    assert int(kept["faults"]) < PAGES // 2, kept


@pytest.mark.parametrize("env", [{"AEGIS_RETAIN_FREED_MEMORY": "0"},
                                 {"MALLOC_TRIM_THRESHOLD_": "131072"}])
def test_a_users_choice_for_malloc_is_left_alone(env: dict[str, str]) -> None:
    got = _run(True, **env)
    assert got["applied"] is False
    assert int(got["faults"]) > PAGES // 2, got
