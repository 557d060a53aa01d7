"""The CLI and issue 12: per-rank entries are shown and exported as such; verify reads the shard's
own index and the manifest checksum; on a plain DCP directory it says, in its main output, that
flipped bytes cannot be detected there."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from aegis.cli import main
from aegis.snapshot.node_store import NodeStore
from tests.dist_utils import run_ranks
from tests.models import build, train_step

JOB = "cli-kinds"


class Sampler:
    def __init__(self, rank: int) -> None:
        self.pos = 100 + rank

    def state_dict(self) -> dict[str, Any]:
        return {"pos": self.pos}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.pos = sd["pos"]


def _save(rank: int, world: int, store: str) -> None:
    from aegis import Manager, ModelOptimizerState

    model, opt, sched = build(world)
    mgr = Manager(JOB, {"model": ModelOptimizerState(model, opt), "sched": sched, "data": Sampler(rank)},
                  store_dir=store, verbose=False, keep=2)
    mgr.restore()
    for step in (1, 2):
        train_step(model, opt, sched, step, rank)
        mgr.save(step)
    mgr.close()


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("cli-kinds")
    run_ranks(2, _save, str(root))
    yield root


def inproc(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_inspect_shows_which_entries_are_per_rank(node: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = inproc(capsys, "inspect", str(node), "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["state_kinds"] == {"model": "sharded", "sched": "replicated", "data": "per_rank"}
    names = {e["name"] for e in doc["entries"]}
    assert {"per_rank.rank00000.data.pos", "per_rank.rank00001.data.pos"} <= names
    code, out, err = inproc(capsys, "inspect", str(node))
    assert code == 0, err
    assert "data (per-rank), model (sharded), sched (replicated)" in out


def test_export_keeps_the_per_rank_entries(node: Path, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    from safetensors import safe_open

    out_dir = tmp_path / "dcp"
    code, _, err = inproc(capsys, "export", str(node), str(out_dir), "--format", "dcp")
    assert code == 0, err
    kinds = json.loads((out_dir / "aegis_state.json").read_text())["state_kinds"]
    assert kinds["data"] == "per_rank"
    import torch.distributed.checkpoint as dcp

    md = dcp.FileSystemReader(str(out_dir)).read_metadata()
    assert {"per_rank.rank00000.data.pos", "per_rank.rank00001.data.pos"} <= set(md.state_dict_metadata)
    st = tmp_path / "x.safetensors"
    code, _, err = inproc(capsys, "export", str(node), str(st), "--format", "safetensors")
    assert code == 0, err
    with safe_open(str(st), "pt") as f:
        assert json.loads(f.metadata()["aegis.state_kinds"])["data"] == "per_rank"


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_verify_reads_the_shards_own_index(node: Path, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    copy = tmp_path / "idx"
    shutil.copytree(node, copy)
    shard = NodeStore(copy, JOB).shard_path(2, 1)
    data = shard.read_bytes()
    _flip(shard, data.rfind(b'"file_offset":') + 14)  # a digit inside the index, not a chunk
    code, out, _ = inproc(capsys, "verify", str(copy), "--json")
    doc = json.loads(out)
    assert code == 1 and not doc["ok"]
    [f] = doc["failures"]
    assert (f["step"], f["rank"]) == (2, 1) and "index" in f["error"], f


def test_verify_names_a_manifest_edited_after_it_was_written(node: Path, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    copy = tmp_path / "man"
    shutil.copytree(node, copy)
    path = NodeStore(copy, JOB).manifest_path(2)
    d = json.loads(path.read_text())
    d["total_bytes"] += 64  # still parses (format 4's step record); the checksum says no
    path.write_text(json.dumps(d, separators=(",", ":"), sort_keys=True))
    code, out, _ = inproc(capsys, "verify", str(copy), "--all", "--json")
    doc = json.loads(out)
    assert code == 1
    assert any(f["step"] == 2 and "fails its checksum" in f["error"] for f in doc["failures"]), doc


@pytest.mark.quick
def test_verify_on_a_plain_dcp_directory_says_what_it_cannot_detect(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import torch.distributed.checkpoint as dcp

    d = tmp_path / "plain"
    dcp.save({"w": torch.arange(16.0)}, checkpoint_id=str(d))
    code, out, err = inproc(capsys, "verify", str(d))
    assert code == 0, err
    assert "cannot detect flipped bytes" in out
    code, out, _ = inproc(capsys, "verify", str(d), "--json")
    assert json.loads(out)["checksums"] is False
