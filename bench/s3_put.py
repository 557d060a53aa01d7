#!/usr/bin/env python
"""PutObject throughput of ``S3Store`` against moto's server, bodies signed and unsigned.

SigV4 over plain HTTP signs each body: botocore hashes every byte with SHA-256 before the request
goes out. ``S3Store`` sends a chunk's CRC32C with it and, once the endpoint has answered with that
checksum, leaves the body unsigned (``sign_payload=False``, the default; botocore does the same
over HTTPS). This script puts ``--mb`` of 16 MiB objects on 4 threads (the uploader's chunk size
and concurrency) through two stores on one server, one signing and one not, alternating
``--repeats`` times, and records the wall time and this process's CPU time of each. It does not
go through the Manager (see ``bench/upload.py`` for the whole upload against a plain boto3 put).

    .venv/bin/python bench/s3_put.py
    .venv/bin/python bench/s3_put.py --mb 1024 --repeats 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from _common import RESULTS, MotoServer, new_doc, write_doc  # noqa: E402 - bench/ is on sys.path

NAME = "s3_put"
PART = 16 << 20


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=float, default=512.0, help="bytes put per arm and repeat, in MiB")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=RESULTS / f"{NAME}.json")
    args = p.parse_args(argv)
    doc = new_doc(NAME, __file__, argv, args)

    from aegis.snapshot.s3 import S3Store
    from aegis.snapshot.shard import crc32c

    count = max(1, int(args.mb * (1 << 20)) // PART)
    body = os.urandom(PART)
    crc = crc32c(body)
    server = MotoServer()
    runs: dict[str, list[dict[str, float]]] = {"signed": [], "unsigned": []}
    try:
        os.environ.update(server.env)
        bucket = server.bucket()
        for rep in range(args.repeats):
            for arm in ("signed", "unsigned"):
                store = S3Store(bucket, f"{arm}-{rep}", sign_payload=arm == "signed")
                store.put("warm", body, crc32c=crc)  # the endpoint answers with the checksum
                keys = [f"k{i:05d}" for i in range(count)]
                t, cpu = time.perf_counter(), time.process_time()
                with ThreadPoolExecutor(max_workers=4) as pool:
                    list(pool.map(lambda k, s=store: s.put(k, body, crc32c=crc), keys))
                rec = {"seconds": time.perf_counter() - t, "client_cpu_s": time.process_time() - cpu}
                runs[arm].append(rec)
                print(f"repeat {rep} {arm:>8}: {count * PART / 2**20:.0f} MiB in {rec['seconds']:.2f} s "
                      f"({count * PART / 2**20 / rec['seconds']:.0f} MiB/s), client CPU "
                      f"{rec['client_cpu_s']:.2f} s", flush=True)
                store.delete([*keys, "warm"])
                store.close()
    finally:
        server.stop()
    doc["runs"] = runs
    doc["bytes_per_run"] = count * PART
    med = {arm: statistics.median(r["seconds"] for r in rs) for arm, rs in runs.items()}
    summary: dict[str, Any] = {f"{arm}_median_s": v for arm, v in med.items()}
    summary["unsigned / signed"] = med["unsigned"] / med["signed"]
    summary["client_cpu_s_median"] = {arm: statistics.median(r["client_cpu_s"] for r in rs)
                                      for arm, rs in runs.items()}
    doc["summary"] = summary
    print(f"median: signed {med['signed']:.2f} s, unsigned {med['unsigned']:.2f} s "
          f"({summary['unsigned / signed']:.2f}x)")
    write_doc(doc, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
