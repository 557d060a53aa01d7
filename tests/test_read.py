"""Issue 26: snapshots from Python (``aegis.open``) and the reading layer below the CLI.

A real job (2 gloo ranks, FSDP2 model + AdamW + scheduler + a per-rank sampler) writes two
jobs into one node store: ``read-file`` with a ``file://`` durable tier, then ``read-s3`` with
the loopback S3 server (moto) as its durable tier; rank 0 dumps the live model's full state at
each job's last step. Here, with no process group, each tier (node store, ``file://``, ``s3://``
and an ``aegis export --format dcp`` directory) is opened and loaded into a plain ``nn.Module``,
compared bitwise. A second small job writes a 48 MiB state with 1 MiB chunks, and subprocesses
measure the peak RSS of reading it under an 8 MiB budget.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import aegis
from aegis.errors import CorruptShardError, NoSnapshotError, StateMismatchError
from aegis.read.errors import DamagedCopyWarning, SourceError
from tests.conftest import S3_ENV
from tests.dist_utils import run_ranks
from tests.models import Tiny, build, train_step

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(300)


class Sampler:
    def __init__(self, rank: int) -> None:
        self.pos = 100 + rank

    def state_dict(self) -> dict[str, Any]:
        return {"pos": self.pos}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.pos = sd["pos"]


def _train(rank: int, world: int, store: str, file_url: str, s3_url: str, out: str) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from aegis import Manager, ModelOptimizerState

    model, opt, sched = build(world)
    sampler = Sampler(rank)
    for job, url, steps in (("read-file", file_url, (1, 2, 3, 4)), ("read-s3", s3_url, (5, 6))):
        mgr = Manager(job, {"model": ModelOptimizerState(model, opt), "sched": sched, "data": sampler},
                      store_dir=store, verbose=False, keep=2, durable=url, durable_every=2)
        for step in steps:
            train_step(model, opt, sched, step, rank)
            sampler.pos += 1
            mgr.save(step)
        mgr.close()  # waits for the uploads
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            torch.save(full, Path(out) / f"{job}.pt")


@dataclass
class Job:
    store: Path
    file_url: str
    s3_url: str
    out: Path


@pytest.fixture(scope="module")
def job(s3_server: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Job]:
    import boto3

    tmp = tmp_path_factory.mktemp("read")
    env = {**S3_ENV, "AWS_ENDPOINT_URL": s3_server}
    bucket = f"aegis-read-{uuid.uuid4().hex[:8]}"
    boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1", aws_access_key_id="testing",
                 aws_secret_access_key="testing").create_bucket(Bucket=bucket)
    j = Job(store=Path(f"/dev/shm/aegis-read-{uuid.uuid4().hex[:8]}"), file_url=f"file://{tmp}/durable",
            s3_url=f"s3://{bucket}/ckpt", out=tmp)
    try:
        run_ranks(2, _train, str(j.store), j.file_url, j.s3_url, str(tmp), timeout=180, env=env)
        yield j
    finally:
        shutil.rmtree(j.store, ignore_errors=True)


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def assert_model_is(model: nn.Module, dump: dict[str, torch.Tensor]) -> None:
    sd = model.state_dict()
    assert set(sd) == set(dump)
    for k, v in dump.items():
        assert bitwise_equal(sd[k], v), k


def fresh_model() -> nn.Module:
    torch.manual_seed(123)  # not the job's seed: every value must come from the snapshot
    return Tiny()


# -- every tier into a plain nn.Module -----------------------------------------------------------


def test_newest_step_of_each_tier_loads_bitwise_into_a_plain_module(
        job: Job, s3_env: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from aegis.cli import main

    dumps = {name: torch.load(job.out / f"{name}.pt") for name in ("read-file", "read-s3")}
    exported = tmp_path / "exported"
    capsys.readouterr()
    assert main(["export", str(job.store), str(exported), "--format", "dcp", "--job", "read-file"]) == 0
    cases: list[tuple[tuple[str | Path, ...], str | None, str, int | None, str]] = [
        # (what is opened, job, tier, newest step, whose state)
        ((job.store / "read-file",), None, "memory", 4, "read-file"),
        ((str(job.store),), "read-s3", "memory", 6, "read-s3"),
        ((job.file_url,), "read-file", "durable", 4, "read-file"),
        ((job.s3_url,), None, "durable", 6, "read-s3"),
        ((exported,), None, "dcp", None, "read-file"),
    ]
    for uris, name, tier, step, whose in cases:
        with aegis.open(*uris, job=name) as src:
            snap = src.latest()
            assert (snap.tier, snap.step) == (tier, step), (uris, snap)
            model = fresh_model()
            got = snap.load_into(model)
            assert got.missing == got.unexpected == [] and len(got.loaded) == len(dumps[whose])
            assert got.prefix == "app.model.model."
            assert_model_is(model, dumps[whose])
    # the steps per tier, and both tiers of one job opened together (memory first)
    with aegis.open(job.store, job.file_url, job="read-file") as src:
        assert src.steps_by_tier == {"memory": [3, 4], "durable": [2, 4]} and src.steps == [2, 3, 4]
        snap = src.step(2)  # only on the durable tier
        assert (snap.tier, snap.step, len(snap.copies)) == ("durable", 2, 1)
        snap = src.step(4)
        assert [c.tier for c in snap.copies] == ["memory", "durable"] and snap.notes == []


def test_entries_tensors_and_per_rank_state_are_data(job: Job, tmp_path: Path) -> None:
    dump = torch.load(job.out / "read-file.pt")
    with aegis.open(job.store / "read-file") as src:
        snap = src.latest()
        e = snap.entries["app.model.model.head.weight"]
        assert (e.kind, e.dtype, e.shape, e.shards, e.state, e.state_kind) == (
            "tensor", "float32", (128, 48), 2, "model", "sharded")
        pos = snap.entries["per_rank.rank00001.data.pos"]
        assert (pos.kind, pos.state, pos.state_kind, pos.rank) == ("object", "data", "per_rank", 1)
        assert snap.state_kinds == {"model": "sharded", "sched": "replicated", "data": "per_rank"}
        # tensors: full, by name, by prefix, lazily, streamed; dtype converted on the way
        head = snap.tensor("app.model.model.head.weight")
        assert bitwise_equal(head, dump["head.weight"])
        model_sd = snap.load(prefix="app.model.model.")
        assert set(model_sd) == set(dump) and all(bitwise_equal(model_sd[k], v) for k, v in dump.items())
        half = snap.load(["app.model.model.blocks.0"], dtype=torch.bfloat16)
        names = snap.keys()
        assert set(half) == {k for k in names if k.startswith("app.model.model.blocks.0.")}
        assert all(t.dtype == torch.bfloat16 for t in half.values())
        lazy = snap.lazy(prefix="app.model.model.")
        assert sorted(lazy) == sorted(dump) and bitwise_equal(lazy.get_tensor("emb.weight"), dump["emb.weight"])
        streamed = dict(snap.tensors(prefix="app.model.model.", max_bytes=4096))
        assert all(bitwise_equal(streamed[k], v) for k, v in dump.items())
        with pytest.raises(KeyError, match="did you mean app.model.model.head.weight"):
            snap.tensor("app.model.model.head.weigth")
        # objects: bytes unless asked; per-rank state per rank; torch.load never called for bytes
        raw = snap.objects(["app.sched"])
        assert raw and all(isinstance(v, bytes) for v in raw.values())
        assert snap.state("sched", unpickle=True)["last_epoch"] == 4
        assert snap.state("data", unpickle=True) == {0: {"pos": 104}, 1: {"pos": 105}}
        assert snap.state("data", rank=1) == {"pos": raw_pos(snap, 1)}
        # a state dict target, in place, not strict
        target = {k: torch.zeros_like(v) for k, v in dump.items() if k.startswith("blocks.")}
        target["not.in.snapshot"] = torch.zeros(3)
        got = snap.load_into(target, strict=False)
        assert got.missing == ["not.in.snapshot"] and "head.weight" in got.unexpected
        assert all(bitwise_equal(target[k], dump[k]) for k in target if k in dump)
        with pytest.raises(StateMismatchError, match="missing from the snapshot: not.in.snapshot"):
            snap.load_into(target)
        small = Tiny(dim=32)
        with pytest.raises(StateMismatchError, match="shapes differ"):
            snap.load_into(small)
        report = snap.verify()
        assert report.ok and report.checksums and report.chunks > 0 and not report.failures
    # lazily from the durable tier: small tensors share chunks, each chunk is downloaded once
    with aegis.open(job.file_url, job="read-file") as src:
        snap = src.latest()
        assert snap.manifest is not None
        store = snap.copies[0].location.store  # type: ignore[attr-defined]
        before = store.stats.requests
        with snap.lazy(prefix="app.model.model.") as lazy:
            lazily = {k: lazy[k] for k in lazy}
        assert all(bitwise_equal(lazily[k], v) for k, v in dump.items()) and set(lazily) == set(dump)
        assert 0 < store.stats.requests - before <= sum(len(s.chunks) for s in snap.manifest.shards) < len(dump)


def raw_pos(snap: aegis.Snapshot, rank: int) -> bytes:
    return snap.objects([f"per_rank.rank{rank:05d}.data.pos"])[f"per_rank.rank{rank:05d}.data.pos"]


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))


def test_a_damaged_copy_is_read_around_and_named(job: Job, tmp_path: Path) -> None:
    dump = torch.load(job.out / "read-file.pt")
    copy = tmp_path / "store"
    shutil.copytree(job.store / "read-file", copy / "read-file")
    _flip(copy / "read-file" / "step-00000004" / "rank-00001.shard", 100)  # chunk 0
    # alone, the damage is an error that names step, rank, chunk and the copy
    with aegis.open(copy / "read-file") as src:
        snap = src.latest()
        with pytest.raises(CorruptShardError, match=r"crc32c mismatch in step 4, rank 1, chunk 0 .*node store"):
            snap.load_into(fresh_model())
        report = snap.verify()
        assert not report.ok and [(f.rank, f.chunk) for f in report.failures] == [(1, 0)]
    # with the durable tier opened too, the next copy is used, and both are named
    with aegis.open(copy / "read-file", job.file_url) as src:
        snap = src.latest()
        assert snap.step == 4 and [c.tier for c in snap.copies] == ["memory", "durable"]
        model = fresh_model()
        with pytest.warns(DamagedCopyWarning, match="read from durable"):
            snap.load_into(model)
        assert_model_is(model, dump)
        [note] = snap.notes
        assert "step 4, rank 1: chunk(s) 0 damaged in memory" in note and str(copy / "read-file") in note
        assert f"read from durable {job.file_url}/read-file instead" in note and "crc32c mismatch" in note
        report = snap.verify()
        assert report.ok and len(report.failures) == 1 and "intact in durable" in report.notes[0]
    # an unreadable manifest in memory: the durable copy of that step is read, and said so
    (copy / "read-file" / "step-00000004" / "manifest.json").write_text("{")
    with aegis.open(copy / "read-file", job.file_url) as src, pytest.warns(DamagedCopyWarning):
        snap = src.step(4)
        assert snap.tier == "durable" and "manifest in memory" in snap.notes[0]
        model = fresh_model()
        snap.load_into(model)
        assert_model_is(model, dump)


def test_clear_errors_for_a_missing_step_and_a_wrong_uri(job: Job, tmp_path: Path) -> None:
    with aegis.open(job.store / "read-file") as src, \
            pytest.raises(NoSnapshotError, match=r"step 9 is not committed in .* \(committed: 3, 4\)"):
        src.step(9)
    with aegis.open(job.store / "read-file", job.file_url) as src, \
            pytest.raises(NoSnapshotError, match=r"step 5 is not committed in any of .*committed: 2, 3, 4"):
        src.step(5)
    (tmp_path / "file").write_text("x")
    wrong: list[tuple[str | Path, str]] = [
        (tmp_path / "nowhere", "no such file or directory"),
        (tmp_path / "file", "not a directory"),
        ("ftp://host/x", "unsupported scheme 'ftp'"),
        (str(job.store), r"holds several jobs \(read-file, read-s3\); choose one with job="),
    ]
    for uri, message in wrong:
        with pytest.raises(SourceError, match=message):
            aegis.open(uri)
    with pytest.raises(SourceError, match="no job 'nope' here"):
        aegis.open(job.store, job="nope")
    with pytest.raises(SourceError, match="different jobs"):
        aegis.open(job.store / "read-file", job.store / "read-s3")
    # one node's store of a two-node job: the missing shard is named, with what to open
    lone = tmp_path / "lone"
    shutil.copytree(job.store / "read-file", lone / "read-file")
    (lone / "read-file" / "step-00000004" / "rank-00001.shard").unlink()
    with aegis.open(lone / "read-file") as src:
        snap = src.step(4)
        assert snap.missing_shards() == [1]
        with pytest.raises(SourceError, match="rank.s. 1 at step 4 are in none of the opened copies"):
            snap.load_into(fresh_model())
        with pytest.warns(DamagedCopyWarning, match="step 4 passed over: the shards of rank.s. 1"):
            assert src.latest().step == 3  # latest() passes over a step it cannot read whole


# -- bounded memory ------------------------------------------------------------------------------

LAYERS, WIDTH = 16, 1024  # 16 x 1024 x 1024 fp32 = 64 MiB, in 1 MiB chunks
BUDGET = 16 << 20  # max_bytes: chunks held, and (durable) one decoding thread's 10 x 1 MiB
SLACK = 4 << 20  # what the budget does not count: the allocator, DCP's plan, Python objects


class Wide(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS))


def _save_wide(rank: int, world: int, store: str, url: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from aegis import Manager, ModelOptimizerState

    torch.manual_seed(0)
    model = Wide()
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    mgr = Manager("wide", {"model": ModelOptimizerState(model)}, store_dir=store, verbose=False,
                  durable=url, durable_every=1, chunk_bytes=1 << 20, rng=False)
    mgr.save(1)
    mgr.close()


_MEASURE = """
import gc, json, sys
import torch
from torch import nn
import aegis

torch.set_num_threads(1)
uri, mode, budget = sys.argv[1], sys.argv[2], int(sys.argv[3])
LAYERS, WIDTH = int(sys.argv[4]), 1024

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024

model = nn.ModuleList(nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS))
holder = nn.Module()
holder.layers = model
snap = aegis.open(uri).latest()
snap.tensor(snap.keys()[0], progress=False)  # every code path imported and warmed up once
gc.collect()
base = status("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # VmHWM := VmRSS
if mode == "load_into":
    snap.load_into(holder, max_bytes=budget, progress=False)
else:
    sd = snap.load(max_bytes=budget, progress=False)
peak = status("VmHWM")
nbytes = sum(e.nbytes for e in snap.entries.values() if e.kind == "tensor")
print(json.dumps({"base": base, "peak": peak, "state": nbytes}))
"""


def _measure(uri: str, mode: str, budget: int) -> dict[str, int]:
    r = subprocess.run([sys.executable, "-c", _MEASURE, uri, mode, str(budget), str(LAYERS)], capture_output=True,
                       text=True, timeout=120, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_load_streams_a_state_larger_than_the_budget_within_it(tmp_path: Path) -> None:
    store = Path(f"/dev/shm/aegis-wide-{uuid.uuid4().hex[:8]}")
    url = f"file://{tmp_path}/durable"
    mib = 1 << 20
    state = LAYERS * WIDTH * WIDTH * 4
    try:
        run_ranks(2, _save_wide, str(store), url, timeout=180)
        print(f"\nstate {state / mib:.0f} MiB (2 FSDP shards, 1 MiB chunks), max_bytes {BUDGET / mib:.0f} "
              "MiB; peak RSS above the baseline while reading (VmHWM):")
        for uri, tier in ((str(store / "wide"), "memory"), (f"{url}/wide", "durable")):
            m = _measure(uri, "load_into", BUDGET)
            grew = m["peak"] - m["base"]
            print(f"  {tier:8s} load_into(plain module)  +{grew / mib:6.1f} MiB")
            assert m["state"] == state >= 4 * BUDGET
            assert grew <= BUDGET + SLACK, (tier, m)
            m = _measure(uri, "load", BUDGET)
            grew = m["peak"] - m["base"]
            print(f"  {tier:8s} load() -> dict           +{grew / mib:6.1f} MiB (of which the result "
                  f"{state / mib:.0f} MiB)")
            assert state <= grew <= state + BUDGET + SLACK, (tier, m)
        # the measurement sees what a read holds: with a budget above the state, every chunk at once
        m = _measure(str(store / "wide"), "load_into", 1 << 30)
        grew = m["peak"] - m["base"]
        print(f"  memory   load_into, max_bytes 1 GiB +{grew / mib:6.1f} MiB")
        assert grew > 0.9 * state > BUDGET + SLACK, m
    finally:
        shutil.rmtree(store, ignore_errors=True)


# -- layers --------------------------------------------------------------------------------------


def cli_imports(source: str, module: str) -> list[str]:
    """The ``aegis.cli`` imports in ``source`` (the module ``module``), relative ones resolved."""
    found = []
    package = module.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str) and getattr(node.func, "attr", getattr(node.func, "id", "")) \
                in ("import_module", "__import__"):
            names = [node.args[0].value]
        found += [n for n in names if n == "aegis.cli" or n.startswith("aegis.cli.")]
    return found


def test_no_module_outside_the_cli_imports_it() -> None:
    # the checker itself finds each way of importing the CLI
    for src in ("from aegis.cli._dcp import x", "import aegis.cli", "from aegis import cli",
                "from ..cli import _dcp", "importlib.import_module('aegis.cli._dcp')"):
        assert cli_imports(src, "aegis.integrations.torchtitan"), src
    assert not cli_imports("from aegis.read.dcp_meta import read_dcp_metadata", "aegis.integrations.x")
    pkg = ROOT / "aegis"
    offenders = {}
    for path in sorted(pkg.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[1] == "cli" or rel == Path("aegis/__main__.py"):  # the command and `python -m aegis`
            continue
        module = ".".join(rel.with_suffix("").parts)
        found = cli_imports(path.read_text(), module)
        if found:
            offenders[str(rel)] = found
    assert offenders == {}
    # and aegis.open costs no boto3 until an s3:// URI is opened
    code = "import sys, aegis; aegis.open; print('boto3' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stderr
