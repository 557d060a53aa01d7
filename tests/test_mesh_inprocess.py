"""2-D meshes with in-process recovery (issue 38): the reference trainer with an HSDP mesh
``(dp_replicate=nodes, dp_shard=2)`` and with FSDP + tensor parallel ``(dp_shard=nodes, tp=2)``,
3 simulated nodes x 2 processes, rounds of whole nodes (``run_in_process(ranks_per_node=2)``,
the mesh built from ``World.mesh``). Real processes, real SIGKILLs:

* a node killed: the survivors go on in place as world (2, 2), restore bitwise, and the
  replacement node's two processes join whole at a snapshot (world 6 again);
* one worker killed and replaced by its launcher: no round is ever formed with a partial node
  (the node's other worker sits out, waiting), the node rejoins whole, every rank restores the
  join's step bitwise.

Every round is checked to be made of whole nodes (the Scenario's invariant)."""

from __future__ import annotations

from pathlib import Path

import pytest

from aegis.sim.scenario import Kill, Scenario


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mesh, lost", [("hsdp", "node"), ("tp", "worker"), ("hsdp", "worker")])
def test_a_2d_mesh_recovers_in_place_with_whole_nodes(tmp_path: Path, mesh: str, lost: str) -> None:
    kill = Kill(after_step=6, node="node-1", worker=1) if lost == "worker" else \
        Kill(after_step=6, node="node-1")
    result = Scenario(tmp_path / f"{mesh}-{lost}", [kill], nodes=3, nproc_per_node=2, steps=24,
                      step_sleep=0.3, job=f"m2-{mesh}-{lost}", in_process=True,
                      on_worker_failure="replace", whole_nodes=True,
                      extra_args=["--mesh", mesh]).run()
    report = "\n".join(f"[{'PASS' if ok else 'FAIL'}] {what}" for what, ok in result.checks)
    assert result.ok, f"{report}\nlogs: {result.workdir}"
    worlds = [x["world"] for x in result.losses]
    # shrank to two whole nodes, never to a partial one, and grew back to three
    assert worlds[0] == 6 and 4 in worlds and worlds[-1] == 6, worlds
    assert set(worlds) == {4, 6}, worlds
    if lost == "worker":
        k = result.kills[0]
        assert k.replacement is not None and len(k.others) == 5
