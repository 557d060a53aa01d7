"""Manager end to end on real gloo ranks: save, restore, reshard, corruption, bad input."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions

from aegis import AegisError, ConfigError, Manager, ModelOptimizerState
from aegis.snapshot.manifest import body_checksum
from aegis.snapshot.node_store import NodeStore
from tests.dist_utils import run_ranks
from tests.models import Counter, build, full_state, train_step
from tests.servers import mount_tmpfs, umount

JOB = "t"


def _tensors(sd: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Flatten nested dicts/lists to name -> tensor (non-tensors as 0-d float64 tensors)."""
    out: dict[str, torch.Tensor] = {}
    if isinstance(sd, dict):
        for k, v in sd.items():
            out.update(_tensors(v, f"{prefix}{k}."))
    elif isinstance(sd, (list, tuple)):
        for i, v in enumerate(sd):
            out.update(_tensors(v, f"{prefix}{i}."))
    elif isinstance(sd, torch.Tensor):
        out[prefix[:-1]] = sd.detach().clone()
    elif isinstance(sd, (int, float, bool)):
        out[prefix[:-1]] = torch.tensor(float(sd), dtype=torch.float64)
    return out


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert torch.equal(a[k].view(torch.uint8) if a[k].dim() else a[k], b[k].view(torch.uint8) if b[k].dim() else b[k]), k


def _manager(store: str, model, opt, sched, extra=None, **kw) -> Manager:  # type: ignore[no-untyped-def]
    state = {"model": ModelOptimizerState(model, opt), "sched": sched}
    if extra is not None:
        state["extra"] = extra
    return Manager(JOB, state, store_dir=store, verbose=False, **kw)


# -- save -> restore (same world), RNG and extras, in-place edits after save -----------------


def _save_then_restore(rank: int, world: int, store: str) -> dict[str, Any]:
    model, opt, sched = build(world, seed=0)
    extra = Counter()
    mgr = _manager(store, model, opt, sched, extra)
    assert mgr.restore() == 0
    for step in range(1, 4):
        train_step(model, opt, sched, step, rank)
        extra.n += 1
        extra.history.append(step)
        mgr.save(step)
    # Change every parameter in place right after save() returns: the snapshot must not see it.
    saved = _tensors(full_state(model, opt))
    rng_after_save = torch.rand(3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    mgr.wait()
    mgr.close()

    # A fresh model (other seed), fresh optimizer, restored from the node store.
    model2, opt2, sched2 = build(world, seed=123)
    extra2 = Counter()
    mgr2 = _manager(store, model2, opt2, sched2, extra2)
    step = mgr2.restore()
    restored = _tensors(full_state(model2, opt2))
    out = {
        "step": step,
        "extra": extra2.state_dict(),
        "sched": sched2.state_dict()["last_epoch"],
        "rng_equal": torch.equal(torch.rand(3), rng_after_save),
    }
    if rank == 0:
        assert_bitwise_equal(saved, restored)
        out["n_tensors"] = len(restored)
    # Training continues identically from the restored state.
    out["next_loss"] = train_step(model2, opt2, sched2, 4, rank)
    mgr2.close()
    return out


def test_save_restore_bitwise_with_rng_extras_and_inplace_edits(store_dir: Path) -> None:
    results = run_ranks(2, _save_then_restore, str(store_dir))
    for r in results:
        assert r["step"] == 3
        assert r["extra"] == {"n": 3, "history": [1, 2, 3]}
        assert r["sched"] == 3
        assert r["rng_equal"], "RNG state was not restored"
    assert results[0]["n_tensors"] > 10
    # Event lines: one per snapshot and per restore per rank.
    events = [json.loads(x) for x in (store_dir / JOB / "events" / "rank-00001.jsonl").read_text().splitlines()]
    snaps = [e for e in events if e["event"] == "snapshot"]
    assert [e["step"] for e in snaps] == [1, 2, 3] and all(e["committed"] for e in snaps)
    assert all(e["blocking_ms"] > 0 and e["bytes"] > 0 and "staging_gbps" in e for e in snaps)
    restores = [e for e in events if e["event"] == "restore"]
    assert restores[-1]["step"] == 3 and restores[-1]["sources"]


def _continue_reference(rank: int, world: int) -> float:
    model, opt, sched = build(world, seed=0)
    for step in range(1, 4):
        train_step(model, opt, sched, step, rank)
    return train_step(model, opt, sched, 4, rank)


def test_restored_training_matches_uninterrupted(store_dir: Path) -> None:
    restored = run_ranks(2, _save_then_restore, str(store_dir))
    reference = run_ranks(2, _continue_reference)
    # The in-place +1 edit happened after save(): the resumed step-4 loss is the reference one.
    assert [r["next_loss"] for r in restored] == reference


# -- resharding: 2 ranks -> 3 and -> 1 ----------------------------------------------------------


def _save_only(rank: int, world: int, store: str) -> dict[str, torch.Tensor] | None:
    model, opt, sched = build(world, seed=0)
    mgr = _manager(store, model, opt, sched)
    for step in range(1, 3):
        train_step(model, opt, sched, step, rank)
        mgr.save(step)
    mgr.wait()
    full = _tensors(full_state(model, opt))
    mgr.close()
    return full if rank == 0 else None


def _restore_only(rank: int, world: int, store: str) -> tuple[int, dict[str, torch.Tensor] | None]:
    model, opt, sched = build(world, seed=7)
    mgr = _manager(store, model, opt, sched)
    step = mgr.restore()
    full = _tensors(full_state(model, opt))
    mgr.close()
    return step, (full if rank == 0 else None)


@pytest.mark.parametrize("new_world", [3, 1])
def test_reshard_from_two_ranks(store_dir: Path, new_world: int) -> None:
    saved = run_ranks(2, _save_only, str(store_dir))[0]
    results = run_ranks(new_world, _restore_only, str(store_dir))
    assert all(step == 2 for step, _ in results)
    restored = results[0][1]
    assert saved is not None and restored is not None
    assert_bitwise_equal(saved, restored)


# -- corruption --------------------------------------------------------------------------------


def _save_steps(rank: int, world: int, store: str, steps: int, keep: int) -> None:
    model, opt, sched = build(world, seed=0)
    mgr = _manager(store, model, opt, sched, keep=keep)
    for step in range(1, steps + 1):
        train_step(model, opt, sched, step, rank)
        mgr.save(step)
    mgr.close()


def _restore_step(rank: int, world: int, store: str) -> tuple[int, list[str]]:
    model, opt, sched = build(world, seed=7)
    mgr = _manager(store, model, opt, sched, keep=2)
    try:
        step = mgr.restore()
        assert mgr.last_restore is not None
        return step, mgr.last_restore.skipped
    finally:
        mgr.close()


def _restore_error(rank: int, world: int, store: str, state: str = "same") -> str:
    model, opt, sched = build(world, seed=7)
    if state == "same":
        mgr = _manager(store, model, opt, sched)
    else:  # another set of state names than the snapshot's
        mgr = Manager(JOB, {"model": ModelOptimizerState(model, opt), "other": Counter()},
                      store_dir=store, verbose=False)
    try:
        mgr.restore()
    except Exception as e:  # noqa: BLE001 - returned to the test
        return f"{type(e).__name__}: {e}"
    finally:
        mgr.close()
    return "no error"


def flip_byte(store: Path, step: int, rank: int, chunk_offset: int = 100) -> None:
    path = NodeStore(store, JOB).shard_path(step, rank)
    with open(path, "r+b") as f:
        f.seek(chunk_offset)
        b = f.read(1)
        f.seek(chunk_offset)
        f.write(bytes([b[0] ^ 0x01]))


def test_flipped_byte_falls_back_to_previous_committed_step(store_dir: Path) -> None:
    run_ranks(2, _save_steps, str(store_dir), 3, 2)
    store = NodeStore(store_dir, JOB)
    assert [s.step for s in store.steps() if s.committed] == [3, 2]
    flip_byte(store_dir, 3, 1)
    (step, skipped), _ = run_ranks(2, _restore_step, str(store_dir))
    assert step == 2
    assert any("step 3, rank 1, chunk 0" in s for s in skipped), skipped
    # The corrupt step is gone, the restored one is kept.
    assert [s.step for s in store.steps()] == [2]


def test_flipped_byte_with_nothing_to_fall_back_to_fails_clearly(store_dir: Path) -> None:
    run_ranks(2, _save_steps, str(store_dir), 2, 1)
    flip_byte(store_dir, 2, 0)
    errors = run_ranks(2, _restore_error, str(store_dir))
    for e in errors:
        assert e.startswith("CorruptShardError")
        assert "step 2, rank 0, chunk 0" in e
        # each chunk is checked as it is streamed into the state: the error says the state changed
        assert "partly overwritten by a damaged copy" in e and "do not train from it" in e


def test_committed_step_with_a_missing_shard_is_never_loaded(store_dir: Path) -> None:
    run_ranks(2, _save_steps, str(store_dir), 1, 1)
    NodeStore(store_dir, JOB).shard_path(1, 1).unlink()
    errors = run_ranks(2, _restore_error, str(store_dir))
    for e in errors:
        assert e.startswith("CorruptShardError"), e
        assert "step 1: shards of rank(s) [1] missing" in e and "Nothing was loaded" in e


def test_manifest_of_another_job_or_newer_format_is_rejected(store_dir: Path) -> None:
    run_ranks(2, _save_steps, str(store_dir), 1, 1)
    path = NodeStore(store_dir, JOB).manifest_path(1)
    original = path.read_text()
    # intact manifests (checksums recomputed): not damage, so never skipped past
    doc = json.loads(original)
    doc["job"] = "someone-else"
    doc["checksum"] = body_checksum(doc)
    path.write_text(json.dumps(doc))
    errors = run_ranks(2, _restore_error, str(store_dir))
    assert all(e.startswith("IncompatibleSnapshotError") and "belongs to job 'someone-else'" in e
               for e in errors), errors
    doc = json.loads(original)
    doc["format_version"] = 99
    doc["checksum"] = body_checksum(doc)
    path.write_text(json.dumps(doc))
    errors = run_ranks(2, _restore_error, str(store_dir))
    assert all(e.startswith("IncompatibleSnapshotError") and "newer aegis" in e for e in errors), errors


def test_state_keys_that_do_not_match_are_named(store_dir: Path) -> None:
    run_ranks(2, _save_extra, str(store_dir))
    errors = run_ranks(2, _restore_error, str(store_dir), "other")
    for e in errors:
        assert e.startswith("StateMismatchError"), e
        assert "missing from the snapshot: ['other']" in e
        assert "unexpected (in the snapshot, not in this state): ['extra']" in e


def _save_extra(rank: int, world: int, store: str) -> None:
    model, opt, sched = build(world, seed=0)
    extra = Counter()
    mgr = Manager(JOB, {"model": ModelOptimizerState(model, opt), "extra": extra},
                  store_dir=store, verbose=False)
    train_step(model, opt, sched, 1, rank)
    mgr.save(1)
    mgr.close()


# -- eviction and slot reuse -------------------------------------------------------------------


def test_keep_evicts_old_snapshots_and_reuses_slots(store_dir: Path) -> None:
    run_ranks(2, _save_steps, str(store_dir), 6, 2)
    store = NodeStore(store_dir, JOB)
    infos = store.steps()
    assert [(s.step, s.committed, s.shard_ranks) for s in infos] == [(6, True, (0, 1)), (5, True, (0, 1))]
    m = store.read_manifest(6)
    assert m.world_size == 2 and m.step == 6
    for rec in m.shards:
        store.verify_shard(6, rec)
    # close() deletes the free slots; only the kept snapshots remain in memory.
    assert list(store.slots_dir.iterdir()) == []


# -- tmpfs too small ---------------------------------------------------------------------------


def _save_one(rank: int, world: int, store: str) -> str:
    model, opt, sched = build(world, seed=0)
    mgr = _manager(store, model, opt, sched)
    try:
        train_step(model, opt, sched, 1, rank)
        mgr.save(1)
        mgr.wait()
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    finally:
        mgr.close()
    return "no error"


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Path:
    mnt = mount_tmpfs(tmp_path / "tmpfs", "2m")
    yield mnt
    umount(mnt)


def test_tmpfs_too_small_fails_before_the_first_save_with_the_numbers(tiny_tmpfs: Path) -> None:
    errors = run_ranks(2, _save_one, str(tiny_tmpfs))
    for e in errors:
        assert e.startswith("StoreFullError"), e
        assert "needs" in e and "free" in e and "lower keep" in e and "AEGIS_STORE_DIR" in e
    # Nothing was written but the (empty) store directories.
    assert not list((tiny_tmpfs / JOB).glob("step-*"))


# -- configuration is checked up front (single process, no torch.distributed) -----------------


@pytest.mark.quick
@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"job": "../escape"}, "not a valid job name"),
        ({"every": 0}, "every=0"),
        ({"keep": 0}, "keep=0"),
        ({"chunk_bytes": 1000}, "chunk_bytes=1000"),
    ],
)
def test_bad_config_is_rejected_with_the_field(store_dir: Path, kwargs: dict[str, Any], message: str) -> None:
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    job = kwargs.pop("job", "ok")
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        Manager(job, {"m": ModelOptimizerState(model, opt)}, store_dir=str(store_dir), **kwargs)


@pytest.mark.quick
def test_bad_state_is_rejected(store_dir: Path) -> None:
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="bare nn.Module"):
        Manager("ok", {"m": model}, store_dir=str(store_dir))
    with pytest.raises(ConfigError, match="has no state_dict"):
        Manager("ok", {"x": object()}, store_dir=str(store_dir))


@pytest.mark.quick
def test_single_process_without_distributed(store_dir: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    mgr = Manager("solo", {"m": ModelOptimizerState(model, opt)}, store_dir=str(store_dir), verbose=False)
    assert mgr.restore() == 0
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    mgr.save(1)
    want = model.weight.detach().clone()
    mgr.close()
    model2 = torch.nn.Linear(4, 4)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.1)
    mgr2 = Manager("solo", {"m": ModelOptimizerState(model2, opt2)}, store_dir=str(store_dir), verbose=False)
    assert mgr2.restore() == 1
    assert torch.equal(model2.weight, want)
    # Saving the restored step again would replace a committed snapshot: refused, nothing lost.
    with pytest.raises(AegisError, match="steps must increase"):
        mgr2.save(1)
    store = NodeStore(store_dir, "solo")
    for rec in store.read_manifest(1).shards:
        store.verify_shard(1, rec)
    m = store.read_manifest(1)  # format 4: the step record + layout + the shard's own index
    assert m.world_size == 1
    mgr2.close()


class _WithExtra(torch.nn.Module):
    """A module whose state dict holds a tensor that is no view of a parameter or buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.scale = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale

    def get_extra_state(self) -> torch.Tensor:
        return torch.tensor([self.scale])

    def set_extra_state(self, state: torch.Tensor) -> None:
        self.scale = float(state[0])


@pytest.mark.quick
@pytest.mark.parametrize("extra", [False, True], ids=["views", "extra-state"])
def test_a_restore_loads_in_place_and_skips_only_a_copy_onto_itself(store_dir: Path, extra: bool) -> None:
    """DCP loads into the state dict's tensors in place; they are views of the live parameters,
    so the model's own load_state_dict (a copy of each parameter onto itself) is skipped. A state
    dict entry that is not such a view (a tensor from get_extra_state) still goes through it."""

    def make(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model: torch.nn.Module = _WithExtra() if extra else torch.nn.Linear(4, 4)
        return model, torch.optim.AdamW(model.parameters(), lr=0.1)

    model, opt = make(0)
    mgr = Manager("inplace", {"m": ModelOptimizerState(model, opt)}, store_dir=str(store_dir), verbose=False)
    assert mgr.restore() == 0
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    if extra:
        model.scale = 2.5
    mgr.save(1)
    want = {k: v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    want_opt = [t.clone() for s in opt.state.values() for t in s.values()]
    mgr.close()

    model2, opt2 = make(1)
    loads: list[str] = []
    model2.register_load_state_dict_pre_hook(lambda *a, **k: loads.append("model"))
    mgr2 = Manager("inplace", {"m": ModelOptimizerState(model2, opt2)}, store_dir=str(store_dir), verbose=False)
    assert mgr2.restore() == 1
    got = {k: v for k, v in model2.state_dict().items() if isinstance(v, torch.Tensor)}
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert all(torch.equal(a, b) for a, b in zip(
        [t for s in opt2.state.values() for t in s.values()], want_opt, strict=True))
    assert opt2.param_groups[0]["lr"] == 0.1
    if extra:
        assert model2.scale == 2.5 and loads == ["model"]
    else:
        assert loads == []
    mgr2.close()


class _Sized:
    """Per-rank state holding a tensor whose size the test sets (a rank-dependent plan)."""

    def __init__(self, n: int) -> None:
        self.t = torch.zeros(n)

    def state_dict(self) -> dict[str, Any]:
        return {"t": self.t}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.t = sd["t"].clone()


def _plans_across_managers(rank: int, world: int, store: str) -> dict[str, Any]:
    """One Manager after another in the same processes, as in-process recovery builds them."""
    model, opt, sched = build(world, seed=0)
    out: dict[str, Any] = {}

    def first_save(name: str, step: int, size: int, **kw: Any) -> Manager:
        mgr = _manager(store, model, opt, sched, _Sized(size), **kw)
        if not kw.get("fresh"):
            assert mgr.restore() == step - 1
        train_step(model, opt, sched, step, rank)
        handle = mgr.save(step)
        assert handle is not None
        r = handle.wait()
        out[name] = (r.plan_reused, r.plan_s > 0)
        return mgr

    mgr = first_save("first", 1, 1, fresh=True)
    train_step(model, opt, sched, 2, rank)
    mgr.save(2)
    mgr.close()
    # a new Manager, the same world and states: the plan of the first is taken again
    mgr = first_save("again", 3, 1)
    saved = _tensors(full_state(model, opt))
    mgr.close()
    # ... and the snapshot it made restores bitwise
    model2, opt2, sched2 = build(world, seed=7)
    mgr = _manager(store, model2, opt2, sched2, _Sized(1))
    assert mgr.restore() == 3
    restored = _tensors(full_state(model2, opt2))  # collective: on every rank
    out["bitwise"] = saved.keys() == restored.keys() and all(
        torch.equal(saved[k], restored[k]) for k in saved)
    mgr.close()
    # rank 1's state changed shape: rank 0 holds a matching plan, rank 1 does not; nobody reuses
    mgr = first_save("changed", 1, 2 if rank == 1 else 1, fresh=True)
    mgr.close()
    return out


def test_a_new_manager_reuses_the_plan_only_when_every_rank_has_it(store_dir: Path) -> None:
    results = run_ranks(2, _plans_across_managers, str(store_dir))
    for r in results:
        assert r["first"] == (False, True)
        assert r["again"][0] is True, "the second Manager planned again"
        assert r["bitwise"]
        assert r["changed"] == (False, True)


class _TwoHeads(torch.nn.Module):
    def __init__(self, wrap: bool) -> None:
        super().__init__()
        self.used = torch.nn.Linear(4, 4)
        if wrap:  # activation checkpointing: a prefix in the module's names, none in DCP's
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
                checkpoint_wrapper,
            )

            self.used = checkpoint_wrapper(self.used)
        self.unused = torch.nn.Linear(4, 4)  # no gradient ever: Adam keeps no state for it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


@pytest.mark.quick
@pytest.mark.parametrize("wrap", [False, True], ids=["plain", "checkpoint-wrapped"])
@pytest.mark.parametrize("steps", [0, 2], ids=["before-the-first-step", "after-two-steps"])
def test_optimizer_state_the_snapshot_lacks_is_never_left_uninitialised(
        store_dir: Path, monkeypatch: pytest.MonkeyPatch, steps: int, wrap: bool) -> None:
    """A restore makes Adam's state tensors empty (not zeroed) only where the snapshot holds
    their values; uninitialised memory is simulated here with NaNs, so that any empty tensor the
    load leaves unwritten shows. A parameter that never had a gradient has no saved state and
    gets none (zeros for it made the state's keys differ from the snapshot's: no restore). The
    restored state equals the saved one, entry by entry, and the next step is the uninterrupted
    run's."""
    def run(restore_first: bool) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        torch.manual_seed(0)
        model = _TwoHeads(wrap)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        # strict=False: DCP refuses a parameter without saved optimizer state otherwise
        options = StateDictOptions(strict=False)
        mgr = Manager("adam", {"m": ModelOptimizerState(model, opt, options=options)},
                      store_dir=str(store_dir), verbose=False)
        if restore_first:
            assert mgr.restore() == 1
        else:
            assert mgr.restore() == 0
            for _ in range(steps):
                model(torch.ones(2, 4)).sum().backward()
                opt.step()
                opt.zero_grad()
            mgr.save(1)
        state = _tensors({str(i): s for i, s in enumerate(opt.state.values())})
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        mgr.close()
        return state, next(model.parameters()).detach().clone()

    saved, want = run(restore_first=False)
    real = torch.empty_like
    monkeypatch.setattr(torch, "empty_like", lambda t, **kw: real(t, **kw).fill_(float("nan")))
    got, after = run(restore_first=True)
    bad = [k for k, v in got.items() if v.is_floating_point() and v.isnan().any()]
    assert not bad, f"optimizer state left unwritten by the restore: {bad}"
    zeros_or_saved = {k: v for k, v in got.items() if k not in saved and bool(v.count_nonzero())}
    assert not zeros_or_saved, f"state the snapshot lacks is not zeros: {sorted(zeros_or_saved)}"
    assert all(torch.equal(got[k], saved[k]) for k in saved if k in got)
    assert torch.equal(after, want), "the step after the restore differs from the uninterrupted one"


def test_empty_optimizer_state_for_a_load_is_not_filled_under_deterministic_algorithms() -> None:
    """``torch.use_deterministic_algorithms(True)`` fills every new empty tensor (NaN); the AdamW
    moments a restore is about to overwrite are made without that fill (it cost a 1 GB-per-rank
    in-process restore 1.1-2.2 s), the setting put back after, and state the snapshot lacks is
    still zeros."""
    from torch.overrides import TorchFunctionMode

    from aegis import ModelOptimizerState

    seen: list[bool] = []

    class Watch(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if func is torch.empty_like:
                seen.append(bool(torch.utils.deterministic.fill_uninitialized_memory))
            return func(*args, **(kwargs or {}))

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        with Watch():
            ModelOptimizerState(model, opt).prepare_for_load(
                lambda key: not key.startswith("optim.state.1."))  # the second layer: no state saved
        assert torch.utils.deterministic.fill_uninitialized_memory is True
    finally:
        torch.use_deterministic_algorithms(before)
    assert seen and not any(seen), seen  # every empty moment made unfilled
    first = [opt.state[p] for p in model[0].parameters()]
    assert all(set(st) == {"step", "exp_avg", "exp_avg_sq"} for st in first)
    assert not any(p in opt.state for p in model[1].parameters())
