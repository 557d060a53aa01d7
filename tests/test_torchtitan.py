"""The torchtitan checkpointer backend against torchtitan 0.3.0's own components and its DCP
backend, on real gloo ranks (see tests/titan_job.py for what of the Trainer this drives).

* a 2-rank job SIGKILLed mid-run resumes from the newest snapshot and its losses and final
  state equal an uninterrupted run's, bitwise;
* the backend saves the same keys as torchtitan's ``CheckpointManager`` (DCP) on the same state,
  and both load back the same values;
* ``aegis export --format dcp`` + ``to_torchtitan_dcp`` is resumed by torchtitan's own
  ``CheckpointManager``; a torchtitan DCP checkpoint seeds an aegis job (``initial_load_path``);
* bad config fails with a ValueError naming the field; importing aegis never imports torchtitan.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from aegis.sim.procs import kill_tree
from tests.dist_utils import run_ranks
from tests.titan_job import STEPS, build, digest, flat_state, optimizer_step, train_step

ROOT = Path(__file__).resolve().parent.parent
ENV = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def _env() -> dict[str, str]:
    return {**os.environ, **ENV}


# -- importing and configuring ------------------------------------------------------------------


def test_importing_aegis_never_imports_torchtitan() -> None:
    code = ("import sys, aegis, aegis.cli, aegis.integrations; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torchtitan'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(),
                         cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_python_dash_m_aegis_and_version() -> None:
    import aegis

    for cmd in (["-m", "aegis", "--version"], ["-m", "aegis.cli", "--version"]):
        out = subprocess.run([sys.executable, *cmd], capture_output=True, text=True, env=_env(),
                             cwd=ROOT, timeout=60)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == f"aegis, version {aegis.__version__}"
    out = subprocess.run([sys.executable, "-m", "aegis", "ls", "/nonexistent-aegis-dir"],
                         capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=60)
    assert out.returncode == 2 and out.stderr.startswith("aegis: error:"), out


@pytest.mark.quick
@pytest.mark.parametrize(("kwargs", "field"), [
    ({}, "job"),
    ({"job": "j", "every": 0}, "every"),
    ({"job": "j", "keep": 0}, "keep"),
    ({"job": "j", "replicas": -1}, "replicas"),
    ({"job": "j", "timeout_s": 0}, "timeout_s"),
    ({"job": "j", "durable": "gs://b"}, "durable"),
    ({"job": "j", "durable_keep_last": 0}, "durable_keep_last"),
    ({"job": "j", "create_seed_checkpoint": True}, "create_seed_checkpoint"),
    ({"job": "j", "last_save_in_hf": True}, "last_save_in_hf"),
])
def test_bad_config_names_the_field(kwargs: dict[str, Any], field: str) -> None:
    from aegis.integrations.torchtitan import AegisCheckpointManager

    with pytest.raises(ValueError, match=rf"^checkpoint\.{field}="):
        AegisCheckpointManager.Config(**kwargs)


@pytest.mark.quick
def test_config_every_is_interval_and_maps_retention() -> None:
    from aegis.integrations.torchtitan import AegisCheckpointManager

    c = AegisCheckpointManager.Config(job="j", every=7)
    assert (c.every, c.interval, c.enable) == (7, 7, True)  # the trainer sizes dataloader snapshots by interval
    c = AegisCheckpointManager.Config(job="j", interval=20, keep_latest_k=4, durable="file:///x")
    kw = c.manager_kwargs()
    assert (c.every, kw["every"], kw["durable_keep_last"]) == (20, 1, 4)
    assert AegisCheckpointManager.Config(job="j", keep_latest_k=0, durable="file:///x") \
        .manager_kwargs()["durable_keep_last"] >= 2**31 - 1
    assert AegisCheckpointManager.Config(job="j", durable="file:///x", durable_keep_last=3) \
        .manager_kwargs()["durable_keep_last"] == 3


@pytest.mark.quick
def test_torchtitan_key_mapping() -> None:
    from aegis.integrations.torchtitan import torchtitan_key

    assert torchtitan_key("app.model.layers.0.attention.qkv_linear.wqkv.weight") == \
        "layers.0.attention.qkv_linear.wqkv.weight"
    assert torchtitan_key("app.optimizer.state.norm.weight.exp_avg") == "optimizer.state.norm.weight.exp_avg"
    assert torchtitan_key("per_rank.rank00001.dataloader.dp_rank_1") == "dataloader.dp_rank_1"
    assert torchtitan_key("app.train_state.step") == "train_state.step"
    assert torchtitan_key("rng.rank00000.torch") is None


# -- SIGKILL and bitwise resume -----------------------------------------------------------------


def _torchrun(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "tests" / "titan_job.py"), *args]
    out = open(log, "ab")  # noqa: SIM115 - handed to the child
    return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=_env(), cwd=ROOT,
                            start_new_session=True)


def _losses(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


@pytest.mark.timeout(240)
def test_sigkill_then_resume_is_bitwise(store_dir: Path, tmp_path: Path) -> None:
    ref_log, log = tmp_path / "ref.jsonl", tmp_path / "run.jsonl"
    p = _torchrun(["--job", "ref", "--store-dir", str(store_dir), "--loss-log", str(ref_log)],
                  tmp_path / "ref.out")
    assert p.wait(timeout=120) == 0, (tmp_path / "ref.out").read_text()[-3000:]
    reference = {r["step"]: r["loss_hex"] for r in _losses(ref_log)}
    assert sorted(reference) == list(range(1, STEPS + 1))

    args = ["--job", "kill", "--store-dir", str(store_dir), "--loss-log", str(log)]
    p = _torchrun([*args, "--step-sleep", "0.3"], tmp_path / "run.out")
    deadline = time.monotonic() + 90
    while p.poll() is None and len(_losses(log)) < 4:
        assert time.monotonic() < deadline, (tmp_path / "run.out").read_text()[-3000:]
        time.sleep(0.02)
    assert p.poll() is None, "the run ended before the kill"
    kill_tree(p.pid)  # SIGKILL: the agent and both ranks, no cleanup
    p.wait(timeout=30)
    killed_at = len(_losses(log))
    assert killed_at < STEPS

    p = _torchrun(args, tmp_path / "resume.out")
    assert p.wait(timeout=120) == 0, (tmp_path / "resume.out").read_text()[-3000:]
    out = (tmp_path / "resume.out").read_text()
    resumed = _losses(log)[killed_at:]
    first = resumed[0]["step"]
    assert f"restored step {first - 1} " in out, out[-3000:]
    assert first - 1 >= killed_at - 1  # at most the step in flight is lost (every=1)
    assert [r["step"] for r in resumed] == list(range(first, STEPS + 1))
    for r in resumed:
        assert r["loss_hex"] == reference[r["step"]], f"step {r['step']} differs after the resume"
    for rank in (0, 1):  # the whole final state: model, optimizer, schedulers, dataloader
        ref = json.loads(Path(f"{ref_log}.rank{rank}.digest.json").read_text())
        got = json.loads(Path(f"{log}.rank{rank}.digest.json").read_text())
        assert got == ref, sorted(k for k in ref if got.get(k) != ref[k])[:5]


# -- the save/load contract against torchtitan's DCP backend ------------------------------------

SAVE_STEP = 3


def _save_both(rank: int, world: int, store: str, folder: str) -> dict[str, Any]:
    """3 steps, then a save of the same state by torchtitan's DCP backend and by aegis."""
    from torchtitan.components.checkpointer import CheckpointManager

    from aegis.integrations.torchtitan import AegisCheckpointManager

    job = build(seed=0)
    titan = job.checkpointer(CheckpointManager.Config(enable=True, folder="ckpt", interval=SAVE_STEP,
                                                      keep_latest_k=0), dump=folder)
    ours = job.checkpointer(AegisCheckpointManager.Config(job="contract", every=SAVE_STEP,
                                                          store_dir=store, timeout_s=60))
    assert ours.load() is False and titan.load() is False
    for _ in range(SAVE_STEP):
        train_step(job)
        optimizer_step(job, ours)
        step = job.train_state.step
        assert titan.save(step) is (step == SAVE_STEP)
        assert ours.save(step) is (step == SAVE_STEP)
    ours.maybe_wait_for_saving()
    titan.close()
    ours.close()
    return digest(job)


def _load_all(rank: int, world: int, store: str, folder: str) -> dict[str, Any]:
    """Fresh jobs (other init, untrained) loaded four ways."""
    from torchtitan.components.checkpointer import CheckpointManager

    from aegis.integrations.torchtitan import AegisCheckpointManager

    out: dict[str, Any] = {"fresh": digest(build(seed=1))}

    job = build(seed=1)  # aegis resumes its own snapshot
    c = job.checkpointer(AegisCheckpointManager.Config(job="contract", store_dir=store, timeout_s=60))
    out["aegis_loaded"] = c.load()
    out["aegis"] = digest(job)
    c.close()

    job = build(seed=1)  # torchtitan resumes its own checkpoint
    c = job.checkpointer(CheckpointManager.Config(enable=True, folder="ckpt"), dump=folder)
    out["titan_loaded"] = c.load()
    out["titan"] = digest(job)
    c.close()

    job = build(seed=1)  # torchtitan resumes an aegis snapshot exported as DCP
    c = job.checkpointer(CheckpointManager.Config(enable=True, folder="exported"), dump=folder)
    out["export_loaded"] = c.load()
    out["export"] = digest(job)
    c.close()

    job = build(seed=1)  # a new aegis job seeded from torchtitan's checkpoint folder
    c = job.checkpointer(AegisCheckpointManager.Config(
        job="seeded", store_dir=store, timeout_s=60, every=1,
        initial_load_path=str(Path(folder) / "ckpt"), initial_load_model_only=False))
    out["seed_loaded"] = c.load()
    out["seed"] = digest(job)
    train_step(job)  # and it trains on, snapshotting as usual
    optimizer_step(job, c)
    out["seed_saved"] = c.save(job.train_state.step)
    c.close()
    return out


@pytest.fixture(scope="module")
def contract(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    import tempfile

    from aegis.integrations.torchtitan import to_torchtitan_dcp

    tmp = tmp_path_factory.mktemp("contract")
    store = Path(tempfile.mkdtemp(prefix="aegis-titan-", dir="/dev/shm"))
    try:
        saved = run_ranks(2, _save_both, str(store), str(tmp), timeout=120, env=ENV)
        exported = tmp / "exported"
        exported.mkdir()
        plain = tmp / "plain"
        for dest, layout in ((plain, []), (exported / f"step-{SAVE_STEP}", ["--layout", "torchtitan"])):
            cli = subprocess.run(
                [sys.executable, "-m", "aegis", "export", str(store), str(dest),
                 "--format", "dcp", "--job", "contract", "--json", *layout],
                capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=120)
            assert cli.returncode == 0, cli.stderr
            assert json.loads(cli.stdout)["step"] == SAVE_STEP
        from aegis.cli._dcp import read_dcp_metadata

        aegis_keys = set(read_dcp_metadata(plain).state_dict_metadata)
        assert to_torchtitan_dcp(plain) > 0  # the same renaming, after the fact
        titan_md = read_dcp_metadata(tmp / "ckpt" / f"step-{SAVE_STEP}")
        rekeyed_md = read_dcp_metadata(exported / f"step-{SAVE_STEP}")
        loaded = run_ranks(2, _load_all, str(store), str(tmp), timeout=180, env=ENV)
        return {"saved": saved, "loaded": loaded, "aegis_keys": aegis_keys,
                "titan_keys": set(titan_md.state_dict_metadata),
                "rekeyed_keys": set(rekeyed_md.state_dict_metadata),
                "titan_md": titan_md, "rekeyed_md": rekeyed_md}
    finally:
        import shutil

        shutil.rmtree(store, ignore_errors=True)


def test_same_keys_as_torchtitans_dcp_backend(contract: dict[str, Any]) -> None:
    from aegis.integrations.torchtitan import torchtitan_key

    titan = contract["titan_keys"]
    assert any(k.startswith("optimizer.state.") for k in titan)
    assert {"lr_scheduler.last_epoch", "train_state.step", "dataloader.dp_rank_0",
            "dataloader.dp_rank_1", "tok_embeddings.weight"} <= titan
    mapped = {torchtitan_key(k) for k in contract["aegis_keys"]} - {None}
    assert mapped == titan, (sorted(mapped - titan)[:5], sorted(titan - mapped)[:5])
    assert contract["rekeyed_keys"] == titan
    for k in titan:  # same global shapes and dtypes
        a, b = contract["titan_md"].state_dict_metadata[k], contract["rekeyed_md"].state_dict_metadata[k]
        assert type(a) is type(b), k
        if hasattr(a, "size"):
            assert (a.size, a.properties.dtype) == (b.size, b.properties.dtype), k


def _differs(saved: dict[str, str], got: dict[str, str]) -> list[str]:
    return sorted(k for k in set(saved) | set(got) if saved.get(k) != got.get(k))


def test_both_backends_load_the_same_values(contract: dict[str, Any]) -> None:
    for rank, (saved, loaded) in enumerate(zip(contract["saved"], contract["loaded"], strict=True)):
        assert len(_differs(saved, loaded["fresh"])) > 10, "the fresh job must start elsewhere"
        assert loaded["aegis_loaded"] and loaded["titan_loaded"]
        assert _differs(saved, loaded["aegis"]) == [], f"rank {rank}: aegis"
        assert _differs(saved, loaded["titan"]) == [], f"rank {rank}: torchtitan DCP"


def test_torchtitan_resumes_an_aegis_export(contract: dict[str, Any]) -> None:
    for rank, (saved, loaded) in enumerate(zip(contract["saved"], contract["loaded"], strict=True)):
        assert loaded["export_loaded"]
        assert _differs(saved, loaded["export"]) == [], f"rank {rank}"


def test_torchtitan_checkpoint_seeds_an_aegis_job(contract: dict[str, Any]) -> None:
    for rank, (saved, loaded) in enumerate(zip(contract["saved"], contract["loaded"], strict=True)):
        assert loaded["seed_loaded"] and loaded["seed_saved"]
        assert _differs(saved, loaded["seed"]) == [], f"rank {rank}"


# -- 2-D layouts: torchtitan's ParallelDims (HSDP, FSDP + TP) -------------------------------------

LAYOUTS: dict[str, dict[str, int]] = {"fsdp": {}, "hsdp": {"dp_replicate": 2}, "tp": {"tp": 2}}


def _full_digest(job: Any) -> dict[str, str]:
    """Per key: sha1 of the full (unsharded) tensor, or of the value: the same whatever the
    layout. Collective (``full_tensor`` of each DTensor, in key order on every rank). The
    dataloader's per-dp-rank keys are left out: they follow the data-parallel layout."""
    from torch.distributed.tensor import DTensor

    out: dict[str, str] = {}
    flat = flat_state(job)
    for k in sorted(flat):
        v = flat[k]
        if k.startswith("dataloader."):
            continue
        if isinstance(v, DTensor):
            v = v.full_tensor()
        if isinstance(v, torch.Tensor):
            data = v.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
        else:
            data = repr(v).encode()
        out[k] = hashlib.sha1(data).hexdigest()
    return out


def _save_and_load_2d(rank: int, world: int, store: str, save: str, load: str) -> dict[str, Any]:
    """Two simulated nodes of two ranks (a node store each): 3 steps in the ``save`` layout
    through the aegis backend, then a fresh job (other init) in the ``load`` layout resumes."""
    from aegis.integrations.torchtitan import AegisCheckpointManager

    node = f"node-{rank // 2}"
    os.environ["AEGIS_NODE_ID"] = node

    def config(exclude: list[str] | None = None) -> Any:
        return AegisCheckpointManager.Config(job="titan2d", every=1, store_dir=f"{store}/{node}",
                                             timeout_s=60, exclude_from_loading=exclude or [])

    job = build(seed=0, **LAYOUTS[save])
    c = job.checkpointer(config())
    assert c.load() is False
    for _ in range(3):
        train_step(job)
        optimizer_step(job, c)
        c.save(job.train_state.step)
    c.maybe_wait_for_saving()
    out: dict[str, Any] = {"saved": digest(job), "saved_full": _full_digest(job)}
    out["next_loss"] = float.hex(train_step(job))  # the step the resumed job must repeat
    c.close()
    job = build(seed=1, **LAYOUTS[load])
    out["fresh_full"] = _full_digest(job)
    # torchtitan keys the dataloader's state by data-parallel rank: another data-parallel
    # layout resumes without it (as with torchtitan's own checkpointer)
    c = job.checkpointer(config(None if load == save else ["dataloader"]))
    out["loaded"] = c.load()
    out["step"] = job.train_state.step
    out["got"] = digest(job)
    out["got_full"] = _full_digest(job)
    out["resumed_loss"] = float.hex(train_step(job))
    c.close()
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("save, load", [("hsdp", "hsdp"), ("tp", "tp"), ("hsdp", "tp"),
                                        ("tp", "fsdp")])
def test_2d_layouts_of_parallel_dims_save_and_resume(save: str, load: str) -> None:
    """torchtitan's own 2-D layouts, built from ``ParallelDims`` as its ``Trainer`` builds them
    (``data_parallel_replicate_degree`` 2: HSDP; ``tensor_parallel_degree`` 2: the model's own
    TP plan, FSDP over the rest), 4 ranks on gloo: saved through the aegis backend, resumed in
    the same layout bitwise (every rank's local state, and the next step's loss), and resharded
    into another layout with the full state bitwise the saved one (the dataloader, keyed by
    data-parallel rank, excluded from loading there, as torchtitan's own checkpointer needs)."""
    import shutil
    import tempfile

    store = tempfile.mkdtemp(prefix="aegis-titan2d-", dir="/dev/shm")
    try:
        out = run_ranks(4, _save_and_load_2d, store, save, load, timeout=240, env=ENV)
    finally:
        shutil.rmtree(store, ignore_errors=True)
    for rank, o in enumerate(out):
        assert o["loaded"] is True and o["step"] == 3, (rank, o["step"])
        assert len(_differs(o["saved_full"], o["fresh_full"])) > 10, "the fresh job must start elsewhere"
        assert _differs(o["saved_full"], o["got_full"]) == [], f"rank {rank}: full state"
        if save == load:
            assert _differs(o["saved"], o["got"]) == [], f"rank {rank}: local state"
            assert o["resumed_loss"] == o["next_loss"], rank
