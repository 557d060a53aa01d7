"""What every benchmark records about the machine it ran on (shared by the bench scripts)."""

from __future__ import annotations

import contextlib
import os
import platform
import shutil
import subprocess
from importlib.metadata import version
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
_PACKAGES = ("torch", "boto3", "botocore", "s3fs", "aiobotocore", "fsspec", "moto", "zstandard",
             "matplotlib")


def machine_basics(mem_keys: tuple[str, ...] = ("MemTotal", "MemAvailable")) -> dict[str, object]:
    """CPU count and model, and the /proc/meminfo fields ``mem_keys`` (as ``<key>_kib``)."""
    mem: dict[str, int] = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in mem_keys:
                mem[key + "_kib"] = int(rest.split()[0])
    cpu = ""
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.partition(":")[2].strip()
                break
    return {"cpu_count": os.cpu_count(), "cpu_model": cpu, **mem}


def device_info() -> dict[str, Any]:
    """``device``: "cpu" or "cuda"; for CUDA the GPU's name, memory and the CUDA version."""
    import torch

    if not torch.cuda.is_available():
        return {"device": "cpu"}
    p = torch.cuda.get_device_properties(0)
    return {"device": "cuda", "gpu": p.name, "gpu_count": torch.cuda.device_count(),
            "gpu_memory_bytes": p.total_memory, "cuda": torch.version.cuda}


def machine() -> dict[str, Any]:
    """Cores, memory, tmpfs size, transparent huge pages, versions and the device of this run."""
    import torch

    thp = {}
    for name in ("enabled", "shmem_enabled"):
        p = Path("/sys/kernel/mm/transparent_hugepage") / name
        thp[name] = p.read_text().strip() if p.exists() else None
    packages = {}
    for name in _PACKAGES:
        with contextlib.suppress(Exception):
            packages[name] = version(name)
    return {**machine_basics(("MemTotal", "MemAvailable", "Shmem")),
            "dev_shm_total": shutil.disk_usage("/dev/shm").total, "thp": thp,
            "torch": torch.__version__, "python": platform.python_version(),
            "platform": platform.platform(), **device_info(), "packages": packages,
            "git": git_info()}


def describe(m: dict[str, Any]) -> str:
    """One line for tables and the README: cores, memory, torch, device."""
    dev = m["device"] if m.get("device") == "cpu" else f"{m.get('gpu')} (CUDA {m.get('cuda')})"
    return (f"{m['cpu_count']} cores ({m['cpu_model']}), {m['MemTotal_kib'] / 2**20:.0f} GiB, "
            f"torch {m['torch']}, device {dev}")


def git_info() -> dict[str, Any]:
    """The commit this run measured, and whether aegis/ or examples/ had uncommitted changes."""
    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True,
                              timeout=30).stdout.strip()

    with contextlib.suppress(Exception):
        return {"commit": git("rev-parse", "HEAD"),
                "dirty": git("status", "--porcelain", "--", "aegis", "examples").splitlines()}
    return {}


def load1() -> float:
    """1-minute load average: other work on the machine distorts timings."""
    return os.getloadavg()[0]


def replace_block(readme: Path, begin: str, end: str, block: str) -> bool:
    """Rewrite what lies between the ``begin`` and ``end`` markers of ``readme``."""
    text = readme.read_text()
    if begin not in text or end not in text:
        print(f"{readme}: no {begin} ... {end} block; left alone")
        return False
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    new = f"{head}{begin}\n{block}{end}{tail}"
    if new != text:
        tmp = readme.with_name(readme.name + ".tmp")
        tmp.write_text(new)
        os.replace(tmp, readme)
    print(f"updated the {begin} block of {readme}")
    return True
