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

# A round's state (256 MB of 8 MB tensors) written, freed, and the next round's written again,
# each round in a thread of its own as run_in_process runs them, with a thread started between
# them (the teardown's and the next round's background threads): the page faults of the second
# writing say whether it got the pages the first one freed.
SCRIPT = """
import json, resource, sys, threading
import torch
from aegis.snapshot import hostmem
applied = hostmem.retain_freed_memory() if sys.argv[1] == "1" else None
def state():
    ts = [torch.empty(2 << 20) for _ in range(32)]  # 32 x 8 MB
    for t in ts:
        t.fill_(1.0)
    return ts
def in_thread(fn):
    box = {}
    t = threading.Thread(target=lambda: box.update(out=fn()))
    t.start()
    t.join()
    return box["out"]
def first():
    old = state()
    del old
in_thread(first)
stop = threading.Event()
def background():
    b = bytearray(1 << 16)  # its first allocation: glibc gives the thread an arena
    stop.wait()
helper = threading.Thread(target=background)
helper.start()
def second():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    new = state()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
faults = in_thread(second)
stop.set()
helper.join()
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
                                 {"MALLOC_TRIM_THRESHOLD_": "131072"},
                                 {"MALLOC_ARENA_MAX": "8"}])
def test_a_users_choice_for_malloc_is_left_alone(env: dict[str, str]) -> None:
    got = _run(True, **env)
    assert got["applied"] is False
    assert int(got["faults"]) > PAGES // 2, got


# A reserve faulted in and freed by one thread, then a state of that size written by another:
# the writing gets the reserve's pages (retain_freed_memory keeps them in the heap).
RESERVE = """
import json, resource, sys, threading
import torch
from aegis.snapshot import hostmem
hostmem.retain_freed_memory()
def in_thread(fn):
    box = {}
    t = threading.Thread(target=lambda: box.update(out=fn()))
    t.start()
    t.join()
    return box["out"]
written = in_thread(lambda: hostmem.prefault_heap(256 << 20)) if sys.argv[1] == "1" else 0
def state():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    ts = [torch.empty(2 << 20) for _ in range(32)]  # 32 x 8 MB
    for t in ts:
        t.fill_(1.0)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(json.dumps({"written": written, "faults": in_thread(state)}))
"""


def _reserve(call: bool) -> dict[str, object]:
    out = subprocess.run([sys.executable, "-c", RESERVE, "1" if call else "0"], check=True,
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def test_a_reserve_faulted_in_ahead_is_what_the_next_state_is_written_into() -> None:
    plain = _reserve(False)
    assert int(plain["faults"]) > PAGES * 9 // 10, plain
    got = _reserve(True)
    assert got["written"] == 256 << 20, got
    assert int(got["faults"]) < PAGES // 4, got


def test_a_reserve_is_the_growth_of_losing_one_node(monkeypatch: pytest.MonkeyPatch) -> None:
    from aegis.snapshot import hostmem
    from aegis.training.inprocess import round as rnd

    asked: list[int] = []
    monkeypatch.setattr(hostmem, "prefault_heap", lambda n: asked.append(n))
    monkeypatch.setattr(rnd.Round, "per_node", 1)
    mb = 1 << 20
    for world in (2, 5):
        t = rnd.reserve_for_shrink(1200 * mb, world)
        assert t is not None
        t.join()
    assert asked == [1200 * mb, 300 * mb]  # world 2 -> 1: the whole state again; 5 -> 4: a quarter
    monkeypatch.setattr(rnd.Round, "per_node", 2)
    t = rnd.reserve_for_shrink(1200 * mb, 6)  # 6 -> 4 ranks: half
    assert t is not None
    t.join()
    assert asked[-1] == 600 * mb
    assert rnd.reserve_for_shrink(1200 * mb, 2) is None  # one node: nothing to shrink to
    assert rnd.reserve_for_shrink(0, 4) is None  # state on the GPU
    assert rnd.reserve_for_shrink(rnd.RESERVE_MIN, 9) is None  # growth too small to pay
    assert len(asked) == 3


def test_no_reserve_without_retained_memory_or_room_for_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from aegis.snapshot import hostmem

    monkeypatch.setattr(hostmem, "_retained", [False])  # malloc left alone: pages would go back
    assert hostmem.prefault_heap(1 << 20) == 0
    monkeypatch.setattr(hostmem, "_retained", [True])
    free = hostmem._available_bytes()
    assert free > 0
    assert hostmem.prefault_heap(free // 2 + (1 << 20)) == 0  # never what runs the host out of memory
    assert hostmem.prefault_heap(1 << 20) == 16 << 20  # whole blocks
