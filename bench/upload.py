#!/usr/bin/env python
"""The durable upload alone against the S3 server's own floor, same bytes, same server.

``--world`` ranks (gloo, one simulated node each; ``--replicas`` copies of each shard on other
nodes, none by default: with 1, the save's replication runs beside its upload) each hold ``--mb-per-rank`` of
fp32 tensors (noise of a trained model's magnitude: stored raw by the default
``durable_min_gain``) and save them ``--saves`` times with a ``Manager`` uploading every save to
moto's S3 server on loopback. Timed per save: the blocking save + memory commit (``save`` to
``wait``), then the upload (``wait`` to ``wait_durable``), with the ``upload`` event's encode
seconds and request count. Then, on the same server, every rank puts the same bytes with plain
boto3 (``put_object``, 16 MiB objects, 4 threads: the uploader's chunk size and concurrency):
the floor. The first save also plans and pre-faults; the last one is the one compared.

    .venv/bin/python bench/upload.py
    .venv/bin/python bench/upload.py --mb-per-rank 2048
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import (  # noqa: E402 - bench/ is on sys.path as a script
    RESULTS,
    MotoServer,
    new_doc,
    run_ranks,
    write_doc,
)

NAME = "upload"
PART = 16 << 20


def _rank(rank: int, world: int, args: argparse.Namespace, bucket: str, work: str) -> dict[str, Any]:
    from concurrent.futures import ThreadPoolExecutor

    import boto3
    import torch
    import torch.distributed as dist

    from aegis import Manager

    os.environ["AEGIS_NODE_ID"] = f"node-{rank}"
    g = torch.Generator().manual_seed(rank)
    n = int(args.mb_per_rank * (1 << 20)) // 4
    per = 16 << 20  # elements per tensor (64 MiB)
    state = {f"t{i}": torch.randn(min(per, n - i * per), generator=g) * 0.02
             for i in range((n + per - 1) // per)}

    class Holder:
        def state_dict(self) -> dict[str, Any]:
            return state

        def load_state_dict(self, sd: dict[str, Any]) -> None:
            pass

    mgr = Manager("upload", {"s": Holder()}, every=1, keep=1, replicas=args.replicas,
                  store_dir=f"{work}/store-{rank}", events_dir=f"{work}/events-{rank}",
                  durable=f"s3://{bucket}/aegis", durable_every=1, verbose=False)
    saves = []
    for step in range(1, args.saves + 1):
        dist.barrier()
        t0 = time.perf_counter()
        mgr.save(step)
        mgr.wait()
        t1 = time.perf_counter()
        mgr.wait_durable()
        saves.append({"step": step, "commit_s": t1 - t0, "upload_s": time.perf_counter() - t1})
    mgr.close()
    for path in glob.glob(f"{work}/events-{rank}/**/*.jsonl", recursive=True):
        for line in Path(path).read_text().splitlines():
            e = json.loads(line)
            for s in saves:
                if s["step"] != e.get("step"):
                    continue
                if e.get("event") == "upload":
                    s.update({k: e.get(k) for k in ("encode_s", "requests", "retries", "raw_bytes",
                                                    "stored_bytes", "chunks")})
                elif e.get("event") == "snapshot":  # where the memory commit's time went
                    s["snapshot_ms"] = {k: e.get(k) for k in (
                        "blocking_ms", "copy_ms", "background_ms", "replicate_ms", "commit_ms")}
    s3 = boto3.client("s3", region_name="us-east-1")
    body = memoryview(torch.cat(list(state.values())).view(torch.uint8).numpy())  # type: ignore[arg-type]
    keys = [(f"floor/rank-{rank}/{i:05d}", a) for i, a in enumerate(range(0, len(body), PART))]
    with ThreadPoolExecutor(max_workers=4) as pool:
        dist.barrier()
        t0 = time.perf_counter()
        list(pool.map(lambda k: s3.put_object(Bucket=bucket, Key=k[0], Body=bytes(body[k[1]:k[1] + PART])),
                      keys))
        floor = time.perf_counter() - t0
    dist.barrier()
    return {"rank": rank, "bytes": len(body), "saves": saves, "boto3_put_s": floor}


def main(argv: list[str] | None = None) -> int:
    import sys

    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--mb-per-rank", type=float, default=1024.0)
    p.add_argument("--saves", type=int, default=2)
    p.add_argument("--replicas", type=int, default=0,
                   help="peer copies of each shard, made while the upload runs (default 0)")
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--out", type=Path, default=RESULTS / f"{NAME}.json")
    args = p.parse_args(argv)
    doc = new_doc(NAME, __file__, argv, args)
    work = tempfile.mkdtemp(prefix="aegis-upload-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    server = MotoServer()
    try:
        os.environ.update(server.env)
        ranks = run_ranks(args.world, _rank, args, server.bucket(), work, timeout=args.timeout)
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    doc["ranks"] = ranks
    last = [r["saves"][-1] for r in ranks]
    doc["summary"] = {
        "commit_s": max(s["commit_s"] for s in last),
        "upload_s": max(s["upload_s"] for s in last),
        "boto3_put_s": max(r["boto3_put_s"] for r in ranks),
    }
    sm = doc["summary"]
    sm["upload / boto3 put"] = sm["upload_s"] / sm["boto3_put_s"]
    sm["commit + upload / boto3 put"] = (sm["commit_s"] + sm["upload_s"]) / sm["boto3_put_s"]
    for r in ranks:
        for s in r["saves"]:
            print(f"rank {r['rank']} save {s['step']}: commit {s['commit_s']:.2f} s, upload "
                  f"{s['upload_s']:.2f} s (encode {s.get('encode_s', 0):.2f} s over the threads, "
                  f"{s.get('requests')} requests)"
                  + "".join(f", {k[:-3]} {v / 1e3:.2f} s" for k, v in s.get("snapshot_ms", {}).items() if v))
        print(f"rank {r['rank']}: plain boto3 put of the same {r['bytes'] / 1e6:.0f} MB: {r['boto3_put_s']:.2f} s")
    print(f"slowest rank, last save: upload {sm['upload_s']:.2f} s = {sm['upload / boto3 put']:.2f}x the "
          f"boto3 put floor ({sm['boto3_put_s']:.2f} s); with the memory commit "
          f"{sm['commit + upload / boto3 put']:.2f}x")
    write_doc(doc, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
