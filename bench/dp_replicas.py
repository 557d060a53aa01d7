#!/usr/bin/env python
"""Data-parallel replicas as the memory redundancy (issue 38, part 3): ``"replica"`` vs ``"dp"``.

Spawns 4 ranks on 2 simulated nodes (2 each, node stores in /dev/shm), trains the reference
trainer's GPT under HSDP (mesh ``(2, 2)``: replicate across the nodes, shard within one, the
layout torchtitan builds with ``data_parallel_replicate_degree=2``) and per arm runs ``--saves``
snapshots, each followed by a training step that runs beside its background work:

==============  ====================================================================================
replica         ``Manager(replicas=1)``: each shard pushed whole to its twin on the other node
dp              ``Manager(redundancy="dp", replicas=1)``: the same replicas, each built on the twin
                from its own copy of the same tensors; only the unshared part (RNG, index) travels
replica-async,  the same with ``staging="async"``: the copies of tensors an optimizer updates (the
dp-async        twin's share too) are made after ``save()`` returns, before the next optimizer step
==============  ====================================================================================

Measured per arm (median over the timed saves, slowest rank): replica bytes sent per snapshot
and rank, ``save()`` blocking time (``dp``: with its copy of the twin's tensors), background and
replication time, the training step beside it; bytes of the newest committed step in each
node store. Then node-1's store is deleted and the 4 ranks restore: the time, the sources of the
lost node's shards, and every rank's local state bitwise against the saved one.

    .venv/bin/python bench/dp_replicas.py                 # 256 MB of state
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import (  # noqa: E402 - bench/ is on sys.path as a script
    MB,
    RESULTS,
    build_gpt,
    digest,
    f,
    gpt_shape,
    gpt_train_step,
    md_table,
    new_doc,
    run_ranks,
    sharded_state,
    size_arg,
    text_table,
    trainer_module,
    write_doc,
)

NAME = "dp_replicas"
ARMS = ("replica", "dp", "replica-async", "dp-async")
WORLD = 4


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--state-mb", type=float, default=256.0,
                   help="MB of params + AdamW moments over all ranks; default 256")
    size_arg(p)
    p.add_argument("--saves", type=int, default=5, help="timed snapshots per arm (after 1 warm-up)")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--out", type=Path, default=RESULTS / f"{NAME}.json")
    return p.parse_args(argv)


def _setup(rank: int, shape: dict[str, int], root: str, arm: str) -> tuple[Any, Any, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    from aegis import Manager, ModelOptimizerState

    node = f"node-{rank // 2}"
    os.environ["AEGIS_NODE_ID"] = node
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    model, opt, _ = build_gpt(shape, mesh=mesh)
    redundancy, _, staging = arm.partition("-")
    mgr = Manager("bench", {"model": ModelOptimizerState(model, opt)}, every=1, keep=1,
                  store_dir=f"{root}/{arm}/{node}", verbose=False, replicas=1,
                  redundancy=redundancy, staging=staging or "sync")
    return model, opt, mgr


def _save_arm(rank: int, world: int, arm: str, args: argparse.Namespace, shape: dict[str, int],
              root: str) -> dict[str, Any]:
    import torch.distributed as dist

    model, opt, mgr = _setup(rank, shape, root, arm)
    data = trainer_module().SyntheticTokens(shape["vocab_size"], shape["seq_len"], seed=0)
    rows = []
    step = 0
    for i in range(args.saves + 1):
        step += 1
        gpt_train_step(model, opt, data, step, args.batch_size, rank, world)
        mgr.save(step)
        if i == args.saves:
            saved = digest(sharded_state(model, opt))  # this rank's local state as saved last
        t0 = time.perf_counter()
        step += 1
        gpt_train_step(model, opt, data, step, args.batch_size, rank, world)
        train_s = time.perf_counter() - t0
        res = mgr.wait()
        assert res is not None and res.committed, res
        if i:  # the first is the warm-up (plans, faults in the slots)
            rows.append({"blocking_s": res.blocking_s, "copy_s": res.copy_s,
                         "replica_copy_s": res.replica_copy_s, "deferred_s": res.deferred_s,
                         "background_s": res.background_s,
                         "replicate_s": res.replicate_s, "train_step_s": train_s,
                         "shard_bytes": res.shard_bytes, "replica_bytes": res.replica_bytes,
                         "replica_sent_bytes": res.replica_sent_bytes})
    dist.barrier()
    store = Path(root) / arm / f"node-{rank // 2}" / "bench"
    newest = max(store.glob("step-*"))
    out = {"rank": rank, "step": step - 1, "saved": saved, "saves": rows,
           "step_bytes": sum(p.stat().st_size for p in newest.iterdir() if p.is_file())}
    mgr.close()
    return out


def _restore_arm(rank: int, world: int, arm: str, shape: dict[str, int], root: str) -> dict[str, Any]:
    import torch.distributed as dist

    model, opt, mgr = _setup(rank, shape, root, arm)
    dist.barrier()
    t0 = time.perf_counter()
    step = mgr.restore()
    restore_s = time.perf_counter() - t0
    res = mgr.last_restore
    assert res is not None
    mine = [s for s in res.sources if s["shard"] == rank]
    mgr.close()
    return {"rank": rank, "step": step, "restore_s": restore_s, "own": mine[0] if mine else None,
            "restored": digest(sharded_state(model, opt))}


def _median(rows: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parse(argv)
    doc = new_doc(NAME, __file__, argv, args)
    shape = gpt_shape(args.state_mb * args.size)
    doc["shape"] = shape
    root = Path(tempfile.mkdtemp(prefix="aegis-bench-dp-", dir="/dev/shm"))
    env = {"OMP_NUM_THREADS": "1"}
    arms: dict[str, Any] = {}
    try:
        for arm in ARMS:
            per_rank = run_ranks(WORLD, _save_arm, arm, args, shape, str(root),
                                 timeout=args.timeout, env=env)
            saves = [max((r["saves"][i] for r in per_rank), key=lambda x: x["background_s"])
                     for i in range(args.saves)]
            arms[arm] = {
                "sent_bytes_per_rank": max(_median(r["saves"], "replica_sent_bytes") for r in per_rank),
                "shard_bytes": max(r["saves"][-1]["shard_bytes"] for r in per_rank),
                "blocking_s": _median(saves, "blocking_s"),
                "copy_s": _median(saves, "copy_s"),
                "replica_copy_s": _median(saves, "replica_copy_s"),
                "background_s": _median(saves, "background_s"),
                "replicate_s": _median(saves, "replicate_s"),
                "train_step_s": statistics.median(r["train_step_s"] for p in per_rank for r in p["saves"]),
                "node_store_bytes": [per_rank[0]["step_bytes"], per_rank[2]["step_bytes"]],
                "per_rank": per_rank,
            }
            shutil.rmtree(root / arm / "node-1")  # node-1 lost: its shards from node-0's replicas
            rest = run_ranks(WORLD, _restore_arm, arm, shape, str(root), timeout=args.timeout, env=env)
            arms[arm]["restore"] = {
                "restore_s": max(r["restore_s"] for r in rest),
                "steps": sorted({r["step"] for r in rest}),
                "lost_sources": sorted({r["own"]["source"] for r in rest[2:] if r["own"]}),
                "bitwise": all(r["restored"] == p["saved"] for r, p in zip(rest, per_rank, strict=True)),
                "per_rank": rest,
            }
            shutil.rmtree(root / arm, ignore_errors=True)
    except Exception as e:  # noqa: BLE001 - recorded in the document
        doc["errors"]["run"] = f"{type(e).__name__}: {e}"
        print(doc["errors"]["run"], file=sys.stderr)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    doc["arms"] = arms
    print(text_table(*rows_of(doc)))
    write_doc(doc, args.out)
    bad = [a for a, v in arms.items() if not v.get("restore", {}).get("bitwise")]
    if bad:
        doc["errors"]["bitwise"] = f"arms {bad}: a restored state differs from the saved one"
        write_doc(doc, args.out)
    return 0 if not doc["errors"] else 1


def rows_of(doc: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    headers = ["redundancy", "shard MB", "replica MB sent per rank", "save() blocks ms (own copy + twin's)",
               "background ms", "replicate ms", "train step ms", "node store MB (node-0, node-1)",
               "node-1 lost: restore s", "lost shards from", "bitwise"]
    rows = []
    for arm, a in doc.get("arms", {}).items():
        r = a.get("restore", {})
        rows.append([arm, f(a["shard_bytes"] / MB, ".1f"), f(a["sent_bytes_per_rank"] / MB, ".3f"),
                     f"{a['blocking_s'] * 1e3:.1f} ({a['copy_s'] * 1e3:.1f} + {a['replica_copy_s'] * 1e3:.1f})",
                     f(a["background_s"] * 1e3, ".1f"), f(a["replicate_s"] * 1e3, ".1f"),
                     f(a["train_step_s"] * 1e3, ".1f"),
                     ", ".join(f(b / MB, ".1f") for b in a["node_store_bytes"]),
                     f(r.get("restore_s"), ".2f"), "/".join(r.get("lost_sources", [])),
                     "yes" if r.get("bitwise") else "no"])
    return headers, rows


def summary_md(doc: dict[str, Any]) -> str:
    return md_table(*rows_of(doc))


if __name__ == "__main__":
    sys.exit(main())
