"""The ``aegis`` command on snapshots made by the reference trainer.

The trainer runs once per module: 2 ranks under torchrun into a node store and a ``file://``
durable root, and one process into another node store and the loopback S3 server (moto over
HTTP). The checks that the issue names run the installed ``aegis`` console script as a
subprocess; the many small cases (retention matrix, error messages) call ``aegis.cli.main``
in-process, which is the same code path including exit codes.
"""

from __future__ import annotations

import dataclasses
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

from aegis.cli import main
from aegis.snapshot.durable import manifest_key, retention_victims
from aegis.snapshot.manifest import Manifest
from tests.conftest import S3_ENV

ROOT = Path(__file__).resolve().parents[1]
TRAINER = ROOT / "examples" / "train_fsdp.py"
AEGIS = Path(sys.executable).with_name("aegis")
JOB = "cli"

pytestmark = pytest.mark.timeout(240)


@dataclass
class Snaps:
    node: Path  # node store root of the 2-rank run: steps 4, 5, 6 (keep 3)
    file_url: str  # its durable tier: steps 4, 6 (durable every 2, keep last 2)
    s3_url: str  # the 1-rank run's durable tier: steps 2, 4
    bucket: str
    full: Path  # the 2-rank run's full (unsharded) state at step 6, from the trainer
    env: dict[str, str]
    tmp: Path


@pytest.fixture(scope="module")
def snaps(s3_server: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Snaps]:
    import boto3

    tmp = tmp_path_factory.mktemp("cli")
    env = {**os.environ, **S3_ENV, "AWS_ENDPOINT_URL": s3_server, "OMP_NUM_THREADS": "1",
           "COLUMNS": "200", "PYTHONWARNINGS": "ignore"}
    bucket = f"aegis-cli-{uuid.uuid4().hex[:8]}"
    boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1",
                 aws_access_key_id="testing", aws_secret_access_key="testing").create_bucket(Bucket=bucket)
    s = Snaps(node=Path(f"/dev/shm/aegis-cli-{uuid.uuid4().hex[:8]}"), file_url=f"file://{tmp}/durable",
              s3_url=f"s3://{bucket}/ckpt", bucket=bucket, full=tmp / "full.pt", env=env, tmp=tmp)
    common = ["--config", "tiny", "--job", JOB, "--durable-every", "2"]
    two_ranks = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                 str(TRAINER), *common, "--steps", "6", "--keep", "3", "--store-dir", str(s.node),
                 "--durable", s.file_url, "--dump-state", str(s.full)]
    one_rank = [sys.executable, str(TRAINER), *common, "--steps", "4", "--store-dir",
                str(s.node) + "-s3", "--durable", s.s3_url]
    procs = [subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for cmd in (two_ranks, one_rank)]
    try:
        for p in procs:
            out, _ = p.communicate(timeout=180)
            assert p.returncode == 0, out[-3000:]
        yield s
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        shutil.rmtree(s.node, ignore_errors=True)
        shutil.rmtree(str(s.node) + "-s3", ignore_errors=True)


def aegis(snaps: Snaps, *args: str) -> subprocess.CompletedProcess[str]:
    """The installed console script, as an operator runs it."""
    return subprocess.run([str(AEGIS), *args], env=snaps.env, capture_output=True, text=True, timeout=120)


def run_json(p: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert "Traceback" not in p.stderr, p.stderr
    return json.loads(p.stdout)


def inproc(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))


def full_state(snaps: Snaps) -> dict[str, torch.Tensor]:
    """The trainer's full state at step 6 under the snapshot's flat names."""
    dump = torch.load(snaps.full, weights_only=False)
    out = {f"app.model.model.{k}": v for k, v in dump["model"].items()}
    for fqn, st in dump["optim"]["state"].items():
        out.update({f"app.model.optim.state.{fqn}.{k}": v for k, v in st.items()})
    return out


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


# -- ls and inspect ------------------------------------------------------------------------------


def test_ls_lists_every_tier_newest_first(snaps: Snaps, capsys: pytest.CaptureFixture[str],
                                          s3_env: dict[str, str]) -> None:
    p = aegis(snaps, "ls", str(snaps.node), snaps.file_url, snaps.s3_url, "--json")
    assert p.returncode == 0, p.stderr
    doc = run_json(p)
    assert doc["schema"] == "aegis.ls/1"
    got = [(r["tier"], r["step"]) for r in doc["steps"]]
    assert got == [("memory", 6), ("durable", 6), ("memory", 5), ("memory", 4), ("durable", 4),
                   ("durable", 4), ("durable", 2)]
    for r in doc["steps"]:
        assert r["committed"] and r["error"] is None and r["age_s"] >= 0
        assert r["raw_bytes"] > 0 and r["stored_bytes"] > 0
        assert r["world_size"] == (1 if r["uri"].startswith("s3://") else 2)
        if r["tier"] == "durable":  # zstd + byte planes: stored < raw
            assert r["stored_bytes"] < r["raw_bytes"] and r["ratio"] > 1
    # the job directory and the job prefix work as well as the roots; people get a table
    code, out, _ = inproc(capsys, "ls", str(snaps.node / JOB), f"{snaps.s3_url}/{JOB}")
    assert code == 0
    lines = [ln.split() for ln in out.splitlines()[1:]]
    assert [(ln[0], ln[1], ln[2]) for ln in lines] == [
        ("6", "memory", "committed"), ("5", "memory", "committed"), ("4", "memory", "committed"),
        ("4", "durable", "committed"), ("2", "durable", "committed")]


def test_inspect_shows_the_manifest_and_every_entry(snaps: Snaps, capsys: pytest.CaptureFixture[str]) -> None:
    p = aegis(snaps, "inspect", snaps.file_url, "--json")
    assert p.returncode == 0, p.stderr
    doc = run_json(p)
    assert (doc["schema"], doc["tier"], doc["job"], doc["step"], doc["world_size"]) == (
        "aegis.inspect/1", "durable", JOB, 6, 2)
    assert doc["mesh"] == {"world_size": 2} and doc["timings"]
    assert [s["rank"] for s in doc["shards"]] == [0, 1]
    entries = {e["name"]: e for e in doc["entries"]}
    full = full_state(snaps)
    for name, t in full.items():
        e = entries[name]
        assert (e["kind"], e["dtype"], e["shape"], e["bytes"]) == (
            "tensor", str(t.dtype).removeprefix("torch."), list(t.shape), t.numel() * t.element_size())
    assert entries["app.model.model.head.weight"]["shards"] == 2  # FSDP2: one chunk per rank
    assert entries["app.data.consumed"]["kind"] == "object" and entries["app.data.consumed"]["bytes"] > 0
    assert "value" not in entries["app.data.consumed"]

    # --tensor: statistics of one full tensor, equal to the trainer's own
    code, out, _ = inproc(capsys, "inspect", str(snaps.node), "--step", "6", "--tensor",
                          "app.model.model.head.weight", "--json")
    assert code == 0
    stats = json.loads(out)["tensor"]
    w = full["app.model.model.head.weight"].double()
    assert stats["min"] == pytest.approx(float(w.min())) and stats["max"] == pytest.approx(float(w.max()))
    assert stats["mean"] == pytest.approx(float(w.mean())) and stats["norm"] == pytest.approx(float(w.norm()))
    assert (stats["nan"], stats["inf"], stats["shape"]) == (0, 0, list(w.shape))
    code, out, _ = inproc(capsys, "inspect", str(snaps.node), "--tensor", "app.model.model.head.weight")
    assert code == 0 and "app.model.model.head.weight" in out and "norm" in out


def test_objects_are_unpickled_only_when_asked(snaps: Snaps, capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    real_load = torch.load

    def no_unpickling(*a: Any, **k: Any) -> Any:
        raise AssertionError("torch.load called without --unsafe-load-objects")

    monkeypatch.setattr(torch, "load", no_unpickling)
    out_dir = snaps.tmp / "no-pickle"
    out_dir.mkdir()
    for args in (["inspect", str(snaps.node)], ["diff", str(snaps.node), "--step", "5", "--step", "6"],
                 ["export", str(snaps.node), str(out_dir / "dcp"), "--format", "dcp"],
                 ["export", str(snaps.node), str(out_dir / "t.pt"), "--format", "torch"]):
        code, _, err = inproc(capsys, *args)
        assert code in (0, 1), err
    monkeypatch.setattr(torch, "load", real_load)
    code, out, _ = inproc(capsys, "inspect", str(snaps.node), "--unsafe-load-objects", "--json")
    assert code == 0
    values = {e["name"]: e.get("value") for e in json.loads(out)["entries"]}
    assert values["app.data.consumed"] == "6" and values["app.model.model.head.weight"] is None


# -- verify --------------------------------------------------------------------------------------


def test_verify_passes_on_intact_snapshots(snaps: Snaps, capsys: pytest.CaptureFixture[str],
                                           s3_env: dict[str, str]) -> None:
    for uri, steps in ((str(snaps.node), [4, 5, 6]), (snaps.file_url, [4, 6]), (snaps.s3_url, [2, 4])):
        code, out, err = inproc(capsys, "verify", uri, "--all", "--json")
        doc = json.loads(out)
        assert code == 0 and doc["ok"] and not doc["failures"], err
        assert [s["step"] for s in doc["steps"]] == steps and all(s["chunks"] > 0 for s in doc["steps"])


def test_verify_names_a_flipped_byte_in_the_node_store(snaps: Snaps, capsys: pytest.CaptureFixture[str]) -> None:
    copy = snaps.tmp / "flip-node"
    shutil.copytree(snaps.node, copy)
    flip(copy / JOB / "step-00000006" / "rank-00001.shard", 100)  # inside chunk 0
    p = aegis(snaps, "verify", str(copy))
    assert p.returncode == 1, p.stdout + p.stderr
    assert "Traceback" not in p.stderr and "verify failed" in p.stderr
    row = next(ln.split() for ln in p.stdout.splitlines() if ln.startswith("6 "))
    assert row[:4] == ["6", "1", "0", "memory"]
    assert "crc32c mismatch in step 6, rank 1, chunk 0" in p.stdout
    # the other steps are intact, so only the flipped one fails under --all
    code, out, _ = inproc(capsys, "verify", str(copy), "--all", "--json")
    doc = json.loads(out)
    assert code == 1 and not doc["ok"]
    assert [(f["step"], f["rank"], f["chunk"], f["tier"]) for f in doc["failures"]] == [(6, 1, 0, "memory")]
    assert [s["ok"] for s in doc["steps"]] == [True, True, False]


def test_verify_names_a_flipped_byte_in_a_file_durable_root(snaps: Snaps) -> None:
    root = Path(snaps.file_url.removeprefix("file://"))
    copy = snaps.tmp / "flip-file"
    shutil.copytree(root, copy)
    obj = copy / JOB / "step-00000006" / "rank-00000" / "chunk-0001.zst"
    flip(obj, obj.stat().st_size // 2)
    p = aegis(snaps, "verify", f"file://{copy}", "--json")
    doc = run_json(p)
    assert p.returncode == 1 and not doc["ok"]
    [f] = doc["failures"]
    assert (f["step"], f["rank"], f["chunk"], f["tier"]) == (6, 0, 1, "durable")
    assert "chunk-0001.zst" in f["error"] and "rank 0, chunk 1" in f["error"]


def test_verify_names_a_flipped_byte_in_s3(snaps: Snaps) -> None:
    import boto3

    s3 = boto3.client("s3", endpoint_url=snaps.env["AWS_ENDPOINT_URL"], region_name="us-east-1",
                      aws_access_key_id="testing", aws_secret_access_key="testing")
    for obj in s3.list_objects_v2(Bucket=snaps.bucket, Prefix="ckpt/")["Contents"]:
        s3.copy_object(Bucket=snaps.bucket, Key="flip/" + obj["Key"].removeprefix("ckpt/"),
                       CopySource={"Bucket": snaps.bucket, "Key": obj["Key"]})
    key = f"flip/{JOB}/step-00000004/rank-00000/chunk-0000.zst"
    blob = bytearray(s3.get_object(Bucket=snaps.bucket, Key=key)["Body"].read())
    blob[len(blob) // 2] ^= 0x01
    s3.put_object(Bucket=snaps.bucket, Key=key, Body=bytes(blob))
    p = aegis(snaps, "verify", f"s3://{snaps.bucket}/flip", "--all", "--json")
    doc = run_json(p)
    assert p.returncode == 1 and not doc["ok"]
    assert [(f["step"], f["rank"], f["chunk"], f["tier"]) for f in doc["failures"]] == [(4, 0, 0, "durable")]
    assert [s["ok"] for s in doc["steps"]] == [True, False]


# -- diff ----------------------------------------------------------------------------------------


def test_diff_two_steps_and_two_tiers(snaps: Snaps, capsys: pytest.CaptureFixture[str]) -> None:
    p = aegis(snaps, "diff", str(snaps.node), "--step", "5", "--step", "6", "--json")
    doc = run_json(p)
    assert p.returncode == 1 and not doc["identical"]  # diff(1): 1 = they differ
    rows = {e["name"]: e for e in doc["entries"]}
    w = rows["app.model.model.head.weight"]
    assert w["status"] == "changed" and w["max_abs_diff"] > 0 and 0 < w["rel_norm"] < 1
    assert rows["app.data.consumed"]["status"] == "changed"  # an object: compared as its bytes
    assert rows["app.data.seed"]["status"] == "unchanged"
    assert doc["counts"]["only_a"] == doc["counts"]["only_b"] == 0
    # step 6 in memory and on the durable tier: the same bytes
    code, out, _ = inproc(capsys, "diff", str(snaps.node), snaps.file_url, "--step", "6", "--json")
    doc = json.loads(out)
    assert code == 0 and doc["identical"] and doc["counts"]["unchanged"] == len(doc["entries"])
    # entries on one side only: the 1-rank run has one rank's RNG state, the 2-rank run two
    code, out, _ = inproc(capsys, "diff", snaps.file_url, str(snaps.node) + "-s3", "--step", "4")
    assert code == 1
    assert "only_a" in out and "app.model.model.head.weight" in out


# -- export --------------------------------------------------------------------------------------

_PLAIN_LOAD = """
import sys
sys.modules["aegis"] = None  # this process cannot import aegis
import warnings
warnings.simplefilter("ignore")
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

path, out = sys.argv[1], sys.argv[2]
md = FileSystemReader(path).read_metadata()
sd = {k: torch.empty(v.size, dtype=v.properties.dtype) if isinstance(v, TensorStorageMetadata) else None
      for k, v in md.state_dict_metadata.items()}
dcp.load(sd, checkpoint_id=path)
torch.save(sd, out)
"""


def test_export_dcp_loads_with_plain_dcp_bitwise(snaps: Snaps, capsys: pytest.CaptureFixture[str]) -> None:
    out = snaps.tmp / "export-dcp"
    p = aegis(snaps, "export", snaps.file_url, str(out), "--step", "6", "--format", "dcp", "--json")
    doc = run_json(p)
    assert p.returncode == 0 and doc["format"] == "dcp" and doc["tensors"] == 126, p.stderr
    loaded = snaps.tmp / "plain.pt"
    r = subprocess.run([sys.executable, "-c", _PLAIN_LOAD, str(out), str(loaded)], env=snaps.env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    plain = torch.load(loaded, weights_only=False)
    # the snapshot itself, read by the library
    ref = snaps.tmp / "ref.pt"
    code, _, err = inproc(capsys, "export", str(snaps.node), str(ref), "--step", "6", "--format", "torch",
                          "--flat")
    assert code == 0, err
    snap = torch.load(ref)
    assert set(snap) == {k for k, v in plain.items() if isinstance(v, torch.Tensor)}
    for name, t in snap.items():
        assert bitwise_equal(plain[name], t), name
    # non-tensor items went over as their bytes, and plain DCP unpickles them as usual
    assert plain["app.data.consumed"] == 6 and plain["app.model.optim.param_groups.0.lr"] > 0
    # the sharding is kept: two chunks per FSDP2-sharded tensor
    code, out_json, _ = inproc(capsys, "inspect", str(out), "--json")
    entries = {e["name"]: e for e in json.loads(out_json)["entries"]}
    assert entries["app.model.model.head.weight"]["shards"] == 2


def test_export_torch_equals_the_training_state(snaps: Snaps, capsys: pytest.CaptureFixture[str],
                                                s3_env: dict[str, str]) -> None:
    out = snaps.tmp / "full-export.pt"
    p = aegis(snaps, "export", str(snaps.node), str(out), "--format", "torch")
    assert p.returncode == 0 and "exported step 6" in p.stdout, p.stderr
    nested = torch.load(out)  # tensors only: loads with weights_only=True
    dump = torch.load(snaps.full, weights_only=False)
    model = nested["app"]["model"]["model"]
    optim = nested["app"]["model"]["optim"]["state"]
    assert set(model) == set(dump["model"])
    for k, v in dump["model"].items():
        assert bitwise_equal(model[k], v), k
    for fqn, st in dump["optim"]["state"].items():
        for k, v in st.items():
            assert bitwise_equal(optim[fqn][k], v), (fqn, k)
    # with objects (trusted snapshot): the nested state dict as the trainer had it
    code, _, err = inproc(capsys, "export", snaps.file_url, str(snaps.tmp / "objs.pt"), "--format", "torch",
                          "--unsafe-load-objects")
    assert code == 0, err
    objs = torch.load(snaps.tmp / "objs.pt", weights_only=False)
    assert objs["app"]["data"] == dump["data"]
    assert objs["app"]["scheduler"]["last_epoch"] == dump["scheduler"]["last_epoch"]
    # safetensors: flat names, full tensors, from S3
    from safetensors.torch import load_file

    code, _, err = inproc(capsys, "export", snaps.s3_url, str(snaps.tmp / "s3.safetensors"), "--format",
                          "safetensors")
    assert code == 0, err
    st = load_file(str(snaps.tmp / "s3.safetensors"))
    assert st["app.model.model.head.weight"].shape == dump["model"]["head.weight"].shape
    code, _, err = inproc(capsys, "export", snaps.s3_url, str(snaps.tmp / "s3.safetensors"), "--format",
                          "safetensors")
    assert code == 2 and "exists; pass --force" in err


# -- plain DCP checkpoints -----------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_ls_and_inspect_read_a_plain_dcp_directory(snaps: Snaps, capsys: pytest.CaptureFixture[str]) -> None:
    import torch.distributed.checkpoint as dcp

    dump = torch.load(snaps.full, weights_only=False)
    sd = {"model": dump["model"], "extra": {"epoch": 3}}
    parent = snaps.tmp / "dcp-runs"
    for step in (100, 200):
        dcp.save(sd, checkpoint_id=str(parent / f"step-{step}"))
    p = aegis(snaps, "ls", str(parent / "step-200"), "--json")
    doc = run_json(p)
    assert p.returncode == 0, p.stderr
    [row] = doc["steps"]
    nbytes = sum(t.numel() * t.element_size() for t in dump["model"].values())
    assert (row["tier"], row["committed"], row["world_size"], row["step"]) == ("dcp", True, 1, 200)
    assert row["raw_bytes"] > nbytes and row["stored_bytes"] > 0
    code, out, err = inproc(capsys, "inspect", str(parent / "step-200"), "--json")
    doc = json.loads(out)
    assert code == 0, err
    entries = {e["name"]: e for e in doc["entries"]}
    for k, v in dump["model"].items():
        assert (entries[f"model.{k}"]["shape"], entries[f"model.{k}"]["shards"]) == (list(v.shape), 1)
    assert entries["extra.epoch"]["kind"] == "object"
    # a directory of DCP checkpoints: steps from the names, newest first; --tensor works too
    code, out, _ = inproc(capsys, "ls", str(parent), "--json")
    assert code == 0 and [r["step"] for r in json.loads(out)["steps"]] == [200, 100]
    code, out, _ = inproc(capsys, "inspect", str(parent), "--step", "100", "--tensor", "model.head.weight",
                          "--json")
    assert code == 0
    assert json.loads(out)["tensor"]["norm"] == pytest.approx(float(dump["model"]["head.weight"].double().norm()))
    code, _, _ = inproc(capsys, "verify", str(parent), "--all")
    assert code == 0
    code, _, err = inproc(capsys, "export", str(parent), str(snaps.tmp / "again"), "--format", "dcp")
    assert code == 2 and "already a plain DCP checkpoint" in err


# -- prune ---------------------------------------------------------------------------------------


def test_prune_removes_old_steps_of_a_node_store(snaps: Snaps, capsys: pytest.CaptureFixture[str]) -> None:
    copy = snaps.tmp / "prune-node"
    shutil.copytree(snaps.node, copy)
    p = aegis(snaps, "prune", str(copy), "--keep-last", "1", "--json")
    doc = run_json(p)
    assert p.returncode == 0, p.stderr
    assert (doc["committed"], doc["removed"], doc["kept"]) == ([4, 5, 6], [4, 5], [6])
    assert sorted(d.name for d in (copy / JOB).glob("step-*")) == ["step-00000006"]
    code, out, _ = inproc(capsys, "verify", str(copy), "--all", "--json")
    assert code == 0 and [s["step"] for s in json.loads(out)["steps"]] == [6]


def _synthetic(kind: str, base: Path, template: Manifest, steps: list[int]) -> str:
    """A store whose committed steps are ``steps`` (manifests only: retention reads nothing else)."""
    for s in steps:
        text = dataclasses.replace(template, step=s).to_json()
        if kind == "durable":
            path = base / manifest_key(JOB, s)
        else:
            path = base / JOB / f"step-{s:08d}" / "manifest.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return f"file://{base}" if kind == "durable" else str(base)


@pytest.mark.parametrize("kind", ["durable", "memory"])
def test_prune_never_removes_the_newest_committed_step(snaps: Snaps, capsys: pytest.CaptureFixture[str],
                                                       kind: str) -> None:
    root = Path(snaps.file_url.removeprefix("file://"))
    template = Manifest.from_json((root / manifest_key(JOB, 6)).read_text())
    n = 0
    for steps in ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [3, 6, 9, 12], [7]):
        for keep_last in (1, 2, 5):
            for keep_every in (0, 2, 3, 5, 100):
                base = snaps.tmp / f"retention-{kind}-{n}"
                n += 1
                uri = _synthetic(kind, base, template, steps)
                expect = retention_victims(steps, keep_last, keep_every)
                args = ["prune", uri, "--keep-last", str(keep_last), "--keep-every", str(keep_every), "--json"]
                code, out, err = inproc(capsys, *args, "--dry-run")
                doc = json.loads(out)
                assert code == 0 and doc["removed"] == expect and doc["dry_run"], err
                assert steps[-1] in doc["kept"]
                code, out, err = inproc(capsys, *args)
                assert code == 0 and json.loads(out)["removed"] == expect, err
                code, out, _ = inproc(capsys, "ls", uri, "--json")
                left = sorted(r["step"] for r in json.loads(out)["steps"] if r["committed"])
                assert left == [s for s in steps if s not in expect] and steps[-1] in left
                for s in left:
                    assert keep_every and s % keep_every == 0 or s in steps[-keep_last:]
    code, _, err = inproc(capsys, "prune", uri, "--keep-last", "0")
    assert code == 2 and "--keep-last" in err


# -- errors --------------------------------------------------------------------------------------


def test_bad_input_is_one_line_with_exit_code_2(snaps: Snaps, capsys: pytest.CaptureFixture[str]) -> None:
    p = aegis(snaps, "inspect", str(snaps.tmp / "nowhere"))
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.strip() == f"aegis: error: {snaps.tmp / 'nowhere'}: no such file or directory"

    def error(*args: str) -> str:
        code, out, err = inproc(capsys, *args)
        assert code == 2, (args, out, err)
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
        return err

    assert "step 9 is not committed" in error("inspect", str(snaps.node), "--step", "9")
    assert "committed: 4, 6" in error("export", snaps.file_url, str(snaps.tmp / "x.pt"), "--format", "torch",
                                      "--step", "5")
    assert "unsupported scheme 'ftp'" in error("ls", "ftp://host/x")
    assert "did you mean app.model.model.head.weight" in error("inspect", str(snaps.node), "--tensor",
                                                               "app.model.model.head.weigth")
    empty = snaps.tmp / "empty"
    empty.mkdir()
    assert "no aegis snapshots or DCP checkpoints here" in error("ls", str(empty))
    two = snaps.tmp / "two-jobs"
    for j in ("a", "b"):
        (two / j / ".slots").mkdir(parents=True)
    assert "holds several jobs (a, b); choose one with --job" in error("inspect", str(two))
    assert "no job 'c' here" in error("inspect", str(two), "--job", "c")
    # an unreadable manifest: inspect refuses in one line, verify reports it, ls flags it
    bad = snaps.tmp / "bad-manifest"
    shutil.copytree(snaps.node, bad)
    (bad / JOB / "step-00000006" / "manifest.json").write_text('{"format_version": 1, "job": ')
    assert "not valid JSON" in error("inspect", str(bad))
    code, out, _ = inproc(capsys, "verify", str(bad), "--step", "6", "--json")
    [f] = json.loads(out)["failures"]
    assert code == 1 and f["step"] == 6 and "manifest unreadable" in f["error"]
    code, out, _ = inproc(capsys, "ls", str(bad), "--json")
    assert code == 0 and "not valid JSON" in json.loads(out)["steps"][0]["error"]
    # --json: the error is a JSON document on stdout too
    code, out, _ = inproc(capsys, "ls", str(snaps.tmp / "nowhere"), "--json")
    assert code == 2 and json.loads(out) == {"schema": "aegis.error/1", "exit_code": 2,
                                             "error": f"{snaps.tmp / 'nowhere'}: no such file or directory"}
