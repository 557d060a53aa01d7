#!/usr/bin/env python
"""Case 3: restore time by source, aegis and DCP side by side on the same state.

``--world`` spawned ranks (gloo), each a simulated node (``AEGIS_NODE_ID=node-<rank>``, its own
node store on tmpfs), train the reference trainer's TinyGPT (``examples/train_fsdp.py``; fp32
params + AdamW moments = ``--state-mb`` x ``--size`` MB over all ranks) for a few steps with
FSDP2, then save that one state everywhere:

* aegis ``Manager(replicas=1, durable=s3://...)``: node stores + replicas + a moto S3 server on
  loopback, and a second job with ``durable=file://<dir>``;
* ``dcp.save`` into a directory (the same disk as the ``file://`` tier) and through
  fsspec/s3fs (``FsspecWriter``) into the same S3 server.

Every save runs twice on the same state and the second is the one compared ("until durable":
from ``save()`` to ``wait_durable()``; DCP: the call), as a job saves at every interval after
the first; the first (aegis: plan, slots pre-faulted; DCP: plan) is kept in the JSON as
``first_*``.

Then each source is restored ``--repeats`` times into the live model (perturbed first, so a
no-op cannot pass) and checked bit for bit against the saved state (crc32 of every local
tensor):

============  ==================================================================================
own memory    ``Manager.restore()``, every shard in its own node store
peer memory   node-1's store emptied (a replacement node): node-1 fetches from node-0's replica
durable S3    every node store emptied: ``Manager.restore()`` from the S3 server
durable dir   every node store emptied: ``Manager.restore()`` from ``file://``
dcp dir       ``get_state_dict`` + ``dcp.load`` from the directory + ``set_state_dict``
dcp s3fs      the same through ``FsspecReader`` from the S3 server
============  ==================================================================================

Timed per rank from a barrier to the end of the restore; the slowest rank counts, median over
repetitions. ``Manager`` construction (gloo groups, the durable store check) is outside the
timing and reported apart. Files were just written, so directories are read from the page cache,
like tmpfs; MB = 1e6 bytes, MB/s of raw (uncompressed) state bytes.

    .venv/bin/python bench/restore.py
    .venv/bin/python bench/restore.py --size 4 --repeats 5
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
    MotoServer,
    build_gpt,
    digest,
    f,
    gpt_shape,
    gpt_train_step,
    have_s3fs,
    md_table,
    new_doc,
    plt,
    run_ranks,
    sharded_state,
    size_arg,
    text_table,
    trainer_module,
    write_doc,
)

NAME = "restore"
SOURCES = ("own memory", "peer memory", "durable S3", "durable dir", "dcp dir", "dcp s3fs")
EXPECTED_TIER = {"own memory": "local", "peer memory": "peer", "durable S3": "durable",
                 "durable dir": "durable"}


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2, help="ranks = simulated nodes; default 2")
    p.add_argument("--state-mb", type=lambda v: [float(x) for x in v.split(",")], default=[96.0],
                   help="MB of params + AdamW moments over all ranks; default 96; several "
                        "(comma-separated, e.g. 256,1024,2048) measure the growth in state size, "
                        "each in its own ranks; the largest is the summary")
    size_arg(p)
    p.add_argument("--train-steps", type=int, default=3, help="steps before the save")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3, help="restores per source")
    p.add_argument("--work-dir", default=None,
                   help="parent of the file:// tier and the DCP directory (default: /tmp)")
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--out", type=Path, default=RESULTS / f"{NAME}.json")
    return p.parse_args(argv)


def _hide(d: Path) -> None:
    if d.exists():
        d.rename(d.with_name(d.name + ".hidden"))


def _unhide(d: Path) -> None:
    shutil.rmtree(d, ignore_errors=True)
    h = d.with_name(d.name + ".hidden")
    if h.exists():
        h.rename(d)


def _rank_main(rank: int, world: int, args: argparse.Namespace, shape: dict[str, int],
               paths: dict[str, str], s3kw: dict[str, Any] | None) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    from aegis import Manager, ModelOptimizerState

    store = Path(paths["stores"]) / f"node-{rank}"
    events = str(Path(paths["events"]) / f"node-{rank}")
    model, opt, _ = build_gpt(shape, mesh=init_device_mesh("cpu", (world,)))
    data = trainer_module().SyntheticTokens(shape["vocab_size"], shape["seq_len"], seed=0)
    for step in range(1, args.train_steps + 1):
        gpt_train_step(model, opt, data, step, args.batch_size, rank, world)
    saved, nbytes = digest(sharded_state(model, opt))
    out: dict[str, Any] = {"rank": rank, "tensor_bytes": nbytes, "save": {}, "restore": {}}

    def manager(job: str, durable: str | None) -> Any:
        kw: dict[str, Any] = {"durable": durable, "durable_every": 1} if durable else {}
        return Manager(job, {"model": ModelOptimizerState(model, opt)}, every=1, keep=1,
                       replicas=1, store_dir=str(store), events_dir=events, verbose=False, **kw)

    # -- save the same state to every source ---------------------------------------------------
    # Each save is timed at its second run, as a job saves at every interval after the first: a
    # first save also plans and pre-faults its slots (aegis) and plans (DCP); it is recorded
    # beside (`first_*`). The second save holds the same state (no step in between).
    for job, url in (("s3", paths["s3"]), ("file", paths["file"])):
        mgr = manager(job, url)
        rec = {}
        for i, step in enumerate((args.train_steps - 1, args.train_steps)):
            dist.barrier()
            t0 = time.perf_counter()
            mgr.save(step)
            mgr.wait()
            t1 = time.perf_counter()
            mgr.wait_durable()
            first = "first_" if i == 0 else ""
            rec |= {f"{first}commit_s": t1 - t0, f"{first}durable_s": time.perf_counter() - t0}
        mgr.close()
        # the uploads' own account (encode seconds over the threads, requests, retries), to tell
        # the upload from what runs beside it (the peer replica: replicas=1 here)
        mine = [e for e in _events(events) if e.get("job") == job]
        rec["uploads"] = [{k: e.get(k) for k in ("step", "seconds", "encode_s", "requests", "retries",
                                                 "raw_bytes", "stored_bytes", "chunks")}
                          for e in mine if e.get("event") == "upload"]
        # where each save's memory commit went (the first one plans and pre-faults)
        rec["snapshots"] = [{k: e.get(k) for k in ("step", "blocking_ms", "plan_ms", "copy_ms",
                                                   "background_ms", "replicate_ms", "commit_ms")}
                            for e in mine if e.get("event") == "snapshot"]
        out["save"][f"aegis {job}"] = rec
    dcp_targets: dict[str, Any] = {"dcp dir": None}
    if s3kw is not None:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

        dcp_targets["dcp s3fs"] = (FsspecWriter, FsspecReader)
    for name, io in dcp_targets.items():
        rec = {}
        for first in ("first_", ""):
            sd = sharded_state(model, opt)
            dist.barrier()
            t0 = time.perf_counter()
            if io is None:
                dcp.save(sd, checkpoint_id=paths["dcp_dir"])
            else:
                dcp.save(sd, storage_writer=io[0](paths["dcp_s3"], **s3kw))
            dist.barrier()
            rec[f"{first}seconds"] = time.perf_counter() - t0
        out["save"][name] = rec

    out["floors"] = _floors(rank, world, store, args.train_steps, paths)

    # -- restore from each source ---------------------------------------------------------------
    def perturb() -> None:
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.5)
                for v in opt.state[p].values():
                    if isinstance(v, torch.Tensor) and v.dim():
                        v.mul_(0.5)

    def restore(source: str) -> dict[str, Any]:
        rec: dict[str, Any] = {}
        job = "file" if source == "durable dir" else "s3"
        hide = {"peer memory": [1], "durable S3": list(range(world)),
                "durable dir": list(range(world))}.get(source, [])
        if source.startswith("dcp"):
            dist.barrier()
            t0 = time.perf_counter()
            sd = sharded_state(model, opt)
            if source == "dcp dir":
                dcp.load(sd, checkpoint_id=paths["dcp_dir"])
            else:
                dcp.load(sd, storage_reader=dcp_targets[source][1](paths["dcp_s3"], **s3kw))
            set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
            rec["seconds"] = time.perf_counter() - t0
        else:
            if rank in hide:
                _hide(store / job)
            t0 = time.perf_counter()
            url = paths[job] if source.startswith("durable") else None
            mgr = manager(job, url)
            rec["manager_init_s"] = time.perf_counter() - t0
            dist.barrier()
            t0 = time.perf_counter()
            step = mgr.restore()
            rec["seconds"] = time.perf_counter() - t0
            r = mgr.last_restore
            rec["step"] = step
            rec["tiers"] = sorted({s["source"] for s in r.sources}) if r else []  # sources (local, peer, ...)
            rec["bytes_read"] = r.bytes_read if r else 0
            rec["bytes_fetched"] = r.bytes_fetched if r else 0
            rec["timings"] = dict(r.timings) if r else {}
            mgr.close()
            dist.barrier()
            if rank in hide:
                _unhide(store / job)
        rec["bitwise_equal"] = digest(sharded_state(model, opt))[0] == saved
        return rec

    for source in SOURCES:
        if source == "dcp s3fs" and s3kw is None:
            continue
        for _ in range(args.repeats):
            perturb()
            dist.barrier()
            out["restore"].setdefault(source, []).append(restore(source))
    return out


def _events(events_dir: str) -> list[dict[str, Any]]:
    """Every event this rank logged under ``events_dir``."""
    import json

    return [json.loads(line) for path in sorted(Path(events_dir).rglob("*.jsonl"))
            for line in path.read_text().splitlines() if line.strip()]


def _floors(rank: int, world: int, store: Path, step: int, paths: dict[str, str]) -> dict[str, float]:
    """What the hardware and the servers allow for this rank's own shard (the ``s3`` job's),
    measured in the same run, every rank at once as in the restores:

    * ``copy_s`` + ``crc_s``: one memcpy of the shard's bytes out of its (populated) tmpfs
      mapping into private memory, and one crc32c over them (one thread each): what a restore
      from own memory cannot go below;
    * ``transport_s``: the shard's bytes from rank 0 to rank 1 over a fresh gloo group of the
      same kind as aegis' transport (the peer restore moves rank 1's shard from node 0);
    * ``boto3_put_s`` / ``boto3_get_s``: the same bytes put and got with plain boto3
      (``put_object`` / ``get_object``) against the same moto server, as objects of aegis' chunk
      size (16 MiB) on as many threads as aegis uses (4): the server's own floor at the
      granularity aegis uses. (One object of the whole shard through boto3's managed transfer
      was no floor: moto serves each ranged part by slicing the whole object, 20 s for 1 GB.)"""
    import mmap
    from concurrent.futures import ThreadPoolExecutor

    import boto3
    import crc32c
    import torch
    import torch.distributed as dist

    from aegis.snapshot.node_store import NodeStore

    path = NodeStore(store, "s3").shard_path(step, rank)
    out: dict[str, float] = {"shard_bytes": float(path.stat().st_size)}
    with open(path, "rb") as fh:
        m = mmap.mmap(fh.fileno(), 0, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                      prot=mmap.PROT_READ)
    try:
        src = torch.frombuffer(m, dtype=torch.uint8)
        dst = torch.empty_like(src)
        dst.fill_(1)  # pages faulted in before the timing, as a restore's targets are
        dist.barrier()
        t0 = time.perf_counter()
        dst.copy_(src)
        out["copy_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        crc32c.crc32c(memoryview(m))
        out["crc_s"] = time.perf_counter() - t0
        del src
    finally:
        m.close()
    if world > 1:
        g = dist.new_group(backend="gloo")
        n = int(dst.numel())
        sizes = [torch.tensor([n]) for _ in range(world)]
        dist.all_gather(sizes, torch.tensor([n]), group=g)
        n1 = int(sizes[1])
        buf = dst[:n1] if n1 <= n else torch.ones(n1, dtype=torch.uint8)
        warm = torch.zeros(1 << 20, dtype=torch.uint8)
        if rank == 0:
            dist.send(warm, 1, group=g)
        elif rank == 1:
            dist.recv(warm, 0, group=g)
        dist.barrier(group=g)
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(buf, 1, group=g)
        elif rank == 1:
            dist.recv(buf, 0, group=g)
        dist.barrier(group=g)
        out["transport_s"] = time.perf_counter() - t0
        dist.destroy_process_group(g)
    s3 = boto3.client("s3", region_name="us-east-1")
    bucket = paths["s3"].split("/")[2]
    part = 16 << 20
    body = memoryview(dst.numpy())  # type: ignore[arg-type]
    keys = [(f"floor/rank-{rank}/{i:05d}", a) for i, a in enumerate(range(0, len(body), part))]

    def put(k: tuple[str, int]) -> None:
        s3.put_object(Bucket=bucket, Key=k[0], Body=bytes(body[k[1]:k[1] + part]))

    def get(k: tuple[str, int]) -> int:
        return len(s3.get_object(Bucket=bucket, Key=k[0])["Body"].read())

    with ThreadPoolExecutor(max_workers=4) as pool:
        dist.barrier()
        t0 = time.perf_counter()
        list(pool.map(put, keys))
        out["boto3_put_s"] = time.perf_counter() - t0
        body.release()
        dist.barrier()
        t0 = time.perf_counter()
        got = sum(pool.map(get, keys))
        out["boto3_get_s"] = time.perf_counter() - t0
    assert got == out["shard_bytes"], (got, out["shard_bytes"])
    for i in range(0, len(keys), 1000):
        s3.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": k} for k, _ in keys[i:i + 1000]]})
    dist.barrier()
    return out


def summarize(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    state = sum(r["tensor_bytes"] for r in ranks)
    rows: dict[str, Any] = {}
    for source in SOURCES:
        if source not in ranks[0]["restore"]:
            continue
        reps = list(zip(*(r["restore"][source] for r in ranks), strict=True))
        per_rep = [max(x["seconds"] for x in rep) for rep in reps]
        med = statistics.median(per_rep)
        tiers = sorted({t for rep in reps for x in rep for t in x.get("tiers", [])})
        rows[source] = {
            "median_s": med, "min_s": min(per_rep), "per_rep_s": per_rep,
            "mbps": state / MB / med,
            "bitwise_equal": all(x["bitwise_equal"] for rep in reps for x in rep),
            "tiers": tiers,
            "tier_ok": EXPECTED_TIER.get(source, "") in tiers if source in EXPECTED_TIER else True,
            "manager_init_s": max((x.get("manager_init_s", 0.0) for rep in reps for x in rep),
                                  default=None) if source in EXPECTED_TIER else None,
            "bytes_fetched_from_peers": max((x.get("bytes_fetched", 0) for rep in reps
                                             for x in rep), default=0),
        }
    save = {k: max(r["save"][k].get("durable_s", r["save"][k].get("seconds", 0.0))
                   for r in ranks) for k in ranks[0]["save"]}
    floors = {k: max(r["floors"][k] for r in ranks if k in r["floors"])
              for k in ranks[0]["floors"] if k != "shard_bytes"}
    floors["memory_s"] = max(r["floors"]["copy_s"] + r["floors"]["crc_s"] for r in ranks)
    med = {k: v["median_s"] for k, v in rows.items()}
    # the ratios the criteria are stated in (issue 39)
    ratios = {
        "own memory / dcp dir": _ratio(med.get("own memory"), med.get("dcp dir")),
        "own memory / memcpy+crc32c floor": _ratio(med.get("own memory"), floors["memory_s"]),
        "peer memory / transport floor": _ratio(med.get("peer memory"), floors.get("transport_s")),
        "durable dir / dcp dir": _ratio(med.get("durable dir"), med.get("dcp dir")),
        "durable S3 / boto3 download": _ratio(med.get("durable S3"), floors.get("boto3_get_s")),
        "durable save dir / dcp.save dir": _ratio(save.get("aegis file"), save.get("dcp dir")),
        "durable save S3 / boto3 upload": _ratio(save.get("aegis s3"), floors.get("boto3_put_s")),
    }
    return {"state_bytes": state, "sources": rows, "save_s": save, "floors": floors, "ratios": ratios}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def report(doc: dict[str, Any]) -> str:
    s = doc["summary"]
    rows = [[k, f(v["median_s"], ".3f"), f(v["min_s"], ".3f"), f(v["mbps"], ".0f"),
             "+".join(v["tiers"]) or "-", "yes" if v["bitwise_equal"] else "NO",
             f(v["manager_init_s"], ".2f")] for k, v in s["sources"].items()]
    out = text_table(["source", "median s", "min s", "MB/s", "tiers", "bitwise",
                      "Manager() s"], rows)
    out += "\nsave (second save; until durable / complete), slowest rank: " + ", ".join(
        f"{k} {v:.2f} s" for k, v in s["save_s"].items())
    out += "\nfloors, slowest rank (same run): " + ", ".join(
        f"{k} {v:.3f} s" for k, v in s["floors"].items())
    out += "\nratios: " + ", ".join(f"{k} {f(v, '.2f')}" for k, v in s["ratios"].items())
    return out


def summary_md(doc: dict[str, Any]) -> str:
    """One table: every source (and the durable saves, and the floors) at every measured state
    size, median seconds of the slowest rank; the issue-39 ratios at the largest size."""
    sizes = doc.get("by_size") or [{"summary": doc["summary"]}]
    s = sizes[-1]["summary"]
    cols = [f"{x['summary']['state_bytes'] / MB:.0f} MB" for x in sizes]

    def row(name: str, get: Any) -> list[str]:
        return [name, *(f(get(x["summary"]), ".2f") for x in sizes)]

    rows = [row(f"restore: {k}" + ("" if all(v["bitwise_equal"] for v in (
                x["summary"]["sources"].get(k, {"bitwise_equal": True}) for x in sizes)) else " (**NOT bitwise equal**)"),
                lambda x, k=k: x["sources"].get(k, {}).get("median_s")) for k in s["sources"]]
    rows += [row(f"save until durable: {k}", lambda x, k=k: x["save_s"].get(k)) for k in s["save_s"]]
    if "floors" in s:
        rows += [row("floor: memcpy + crc32c", lambda x: x.get("floors", {}).get("memory_s")),
                 row("floor: gloo transport", lambda x: x.get("floors", {}).get("transport_s")),
                 row("floor: boto3 get / put", lambda x: None)]
        rows[-1] = ["floor: boto3 get / put", *(
            f"{f(x['summary'].get('floors', {}).get('boto3_get_s'), '.2f')} / "
            f"{f(x['summary'].get('floors', {}).get('boto3_put_s'), '.2f')}" for x in sizes)]
    out = md_table([f"{doc['args']['world']} ranks, median s (slowest rank)", *cols], rows)
    out += "\n\nAll restores bitwise equal to the saved state unless marked."
    if "ratios" in s:
        out += f" Ratios at {cols[-1]}: " + "; ".join(
            f"{k} {f(v, '.2f')}" for k, v in s["ratios"].items()) + "."
    for k, why in doc.get("not_measured", {}).items():
        out += f"\n\n{k}: not measured: {why}"
    return out


def plot(doc: dict[str, Any], path: Path) -> None:
    pyplot = plt()
    s = doc["summary"]
    names = list(s["sources"])
    vals = [s["sources"][n]["median_s"] for n in names]
    colors = ["tab:green" if not n.startswith("dcp") else "tab:gray" for n in names]
    fig, ax = pyplot.subplots(figsize=(7, 4.5))
    bars = ax.bar(names, vals, color=colors)
    for b, v in zip(bars, vals, strict=True):
        ax.annotate(f"{v:.2f} s", (b.get_x() + b.get_width() / 2, v), ha="center",
                    va="bottom", fontsize=8)
    ax.set_ylabel("restore time (s, slowest rank, median)")
    m = doc["machine"]
    ax.set_title(f"Restore by source: {s['state_bytes'] / MB:.0f} MB, {doc['args']['world']} "
                 f"ranks, {m['device']}, {m['cpu_count']} cores (green: aegis, gray: DCP)",
                 fontsize=10)
    ax.tick_params(axis="x", labelsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot.close(fig)


def _one_size(args: argparse.Namespace, shape: dict[str, int], no_s3fs: str | None) -> list[dict[str, Any]]:
    work = Path(tempfile.mkdtemp(prefix="aegis-bench-restore-", dir=args.work_dir))
    shm = Path(tempfile.mkdtemp(prefix="aegis-bench-restore-", dir="/dev/shm"))
    paths = {"stores": str(shm / "stores"), "events": str(work / "events"),
             "file": f"file://{work}/durable", "dcp_dir": str(work / "dcp")}
    print(f"{NAME}: {args.world} nodes, TinyGPT {shape['params'] / 1e6:.1f}M params "
          f"({shape['state_bytes'] / MB:.0f} MB state), {args.repeats} restores per source",
          flush=True)
    moto = MotoServer()
    try:
        bucket = moto.bucket()
        paths.update(s3=f"s3://{bucket}/aegis", dcp_s3=f"s3://{bucket}/dcp")
        s3kw = None if no_s3fs else moto.s3fs_kwargs()  # aegis reaches S3 through boto3
        return run_ranks(args.world, _rank_main, args, shape, paths, s3kw,
                         timeout=args.timeout, env=moto.env,
                         rank_env=lambda r: {"AEGIS_NODE_ID": f"node-{r}"})
    finally:
        moto.stop()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)


def growth_table(doc: dict[str, Any], *, md: bool = True) -> str:
    """Median restore (and durable save) seconds of every source at every measured size."""
    sizes = doc.get("by_size") or [{"summary": doc["summary"]}]
    names = list(sizes[-1]["summary"]["sources"])
    saves = list(sizes[-1]["summary"]["save_s"])
    head = ["state MB", *names, *(f"save {k}" for k in saves), "floor memcpy+crc32c"]
    rows = [[f"{s['summary']['state_bytes'] / MB:.0f}",
             *(f(s["summary"]["sources"].get(n, {}).get("median_s"), ".3f") for n in names),
             *(f(s["summary"]["save_s"].get(k), ".2f") for k in saves),
             f(s["summary"].get("floors", {}).get("memory_s"), ".3f")] for s in sizes]
    return md_table(head, rows) if md else text_table(head, rows)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parse(argv)
    doc = new_doc(NAME, __file__, argv, args)
    no_s3fs = have_s3fs()
    doc["not_measured"] = {"dcp s3fs": no_s3fs} if no_s3fs else {}
    doc["by_size"] = []
    bad: dict[str, Any] = {}
    for mb in sorted(args.state_mb):
        shape = gpt_shape(mb * args.size)
        ranks = _one_size(args, shape, no_s3fs)
        summary = summarize(ranks)
        doc["by_size"].append({"model": shape, "summary": summary, "ranks": ranks})
        doc["model"], doc["summary"] = shape, summary  # the largest size's
        print(report(doc), flush=True)
        bad.update({f"{k} ({mb:g} MB)": v for k, v in summary["sources"].items()
                    if not (v["bitwise_equal"] and v["tier_ok"])})
    if len(doc["by_size"]) > 1:
        print(growth_table(doc, md=False))
    if bad:
        doc["errors"]["restore"] = f"not bitwise equal or wrong tier: {sorted(bad)}"
        print(f"ERROR: {doc['errors']['restore']}")
    write_doc(doc, args.out)
    plot(doc, args.out.with_suffix(".png"))
    return 1 if bad else 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
