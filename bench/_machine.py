"""What every benchmark records about the machine it ran on (shared by the bench scripts)."""

from __future__ import annotations

import os


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
