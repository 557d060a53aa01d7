#!/usr/bin/env python
"""What a whole manifest costs per step against the world size (issue 25): a parity scheme
(XOR, RS) writes one at every commit, and a restore reads every step's on every node.

A synthetic manifest of ``--tensors`` fp32 tensors (each with two Adam moments), every one
row-sharded over all W ranks (an item per tensor per rank, like FSDP2's), for each W in
``--worlds``. Per W, the best of ``--repeats`` rounds of ``--iters`` calls, in a process whose
older objects are frozen out of the collector (``gc.freeze``, as ``run_in_process`` does):

- ``encode``: ``Manifest.to_json`` (rank 0, once per commit; the checksum spliced in);
- ``body``: one canonical encoding of the body: what it cost once more before (the body was
  encoded for its checksum, then again with it, and its tensor entries went through
  ``dataclasses.asdict``);
- ``pickle``: the manifest object pickled and unpickled (what every rank paid per commit when
  the broadcast carried the object; it now carries the text, ``EncodedManifest``);
- ``read``: ``load_node_manifest`` of the text (checksum on the bytes, items at C speed);
- ``read_checked``: the same with the checksum checked on the parsed document (what a
  document in another form gets).

    .venv/bin/python bench/manifest_codec.py          # writes bench/results/manifest_codec.json
"""

from __future__ import annotations

import argparse
import gc
import json
import pickle
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, f, new_doc, text_table, write_doc  # noqa: E402

from aegis.snapshot.manifest import ChunkRecord, ItemRecord, Manifest, ShardRecord, TensorEntry
from aegis.snapshot.node_manifest import load_node_manifest


def manifest(world: int, tensors: int, cols: int = 64) -> Manifest:
    rows = max(64, world)  # every rank holds rows of every tensor
    per = -(-rows // world)  # rows per rank (the last ones may hold fewer, or none)
    bounds = [(r * per, max(0, min(per, rows - r * per))) for r in range(world)]
    entries: dict[str, TensorEntry] = {}
    for i in range(tensors):
        for suffix in ("", ".exp_avg", ".exp_avg_sq"):
            entries[f"layers.{i}.weight{suffix}"] = TensorEntry(
                "float32", (rows, cols), tuple(((o, 0), (n, cols)) for o, n in bounds if n))
    shards = []
    for r, (o, n) in enumerate(bounds):
        items, pos = [], 0
        for name in entries if n else ():
            items.append(ItemRecord(name, (o, 0), pos, n * cols * 4, "float32", (n, cols)))
            pos += n * cols * 4
        chunks = (ChunkRecord(0, pos, 1234, "float32"),) if pos else ()
        shards.append(ShardRecord(r, f"node-{r}", pos + 4096, 99, chunks, tuple(items)))
    return Manifest("bench", 7, world, tuple(shards), entries, created=1.0,
                    state_kinds={k: "sharded" for k in entries})


def best(fn: Callable[[], Any], iters: int, repeats: int) -> float:
    out = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(iters):
            fn()
        out = min(out, (time.perf_counter() - t) / iters)
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worlds", default="6,64,256")
    p.add_argument("--tensors", type=int, default=40)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, default=RESULTS / "manifest_codec.json")
    args = p.parse_args(argv)
    doc = new_doc("manifest_codec", __file__, argv, args)
    gc.freeze()
    rows = []
    for world in (int(w) for w in args.worlds.split(",")):
        m = manifest(world, args.tensors)
        text = m.to_json()
        assert load_node_manifest(text, where="bench") == m
        spaced = json.dumps(json.loads(text), indent=1)  # not the written form: checked parsed
        assert load_node_manifest(spaced, where="bench") == m
        items = sum(len(s.items) for s in m.shards)
        body = {k: v for k, v in json.loads(text).items() if k != "checksum"}
        row = {
            "world": world, "items": items, "bytes": len(text),
            "encode_s": best(m.to_json, args.iters, args.repeats),
            "body_s": best(lambda body=body: json.dumps(body, separators=(",", ":"),
                                                                  sort_keys=True),
                                     args.iters, args.repeats),
            "pickle_s": best(lambda m=m: pickle.loads(pickle.dumps(m)), args.iters, args.repeats),
            "read_s": best(lambda text=text: load_node_manifest(text, where="bench"), args.iters, args.repeats),
            "read_checked_s": best(lambda spaced=spaced: load_node_manifest(spaced, where="bench"), args.iters,
                                   args.repeats),
        }
        rows.append(row)
        print(f"W={world}: {items} items, {len(text) / 1e3:.0f} KB", flush=True)
    doc["rows"] = rows
    print(text_table(
        ["world", "items", "KB", "encode ms", "body once more ms", "pickle+unpickle ms", "read ms",
         "read, checked parsed ms"],
        [[str(r["world"]), str(r["items"]), f(r["bytes"] / 1e3, ".0f"), f(r["encode_s"] * 1e3),
          f(r["body_s"] * 1e3), f(r["pickle_s"] * 1e3), f(r["read_s"] * 1e3),
          f(r["read_checked_s"] * 1e3)] for r in rows]))
    write_doc(doc, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
