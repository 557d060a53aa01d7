"""The fault matrix on the simulated cluster: real SIGKILLs of whole nodes (agent, workers and
node store) at chosen moments. Every case must resume from the newest committed step with the
state bitwise equal to what was saved at that step; a half-replicated step is never loaded."""

from __future__ import annotations

from pathlib import Path

import pytest

from aegis.sim.scenario import Kill, Scenario

CASES = {
    # name: (kills, replicas)
    "idle-replacement": ([Kill(after_step=6, node="node-1")], 1),
    "idle-shrink": ([Kill(after_step=6, node="node-1", replace=False)], 1),
    "while-staging": ([Kill(fault="1:6:stage")], 1),
    "while-replicating": ([Kill(fault="1:6:replicate")], 1),
    "while-committing-manifest": ([Kill(fault="1:6:commit")], 1),
    # a second node lost while the first recovery is restoring; 2 replicas keep every shard
    # on every node, so one node is enough to restore from
    "during-another-recovery": ([Kill(after_step=5, node="node-1"), Kill(fault="0:*:restore")], 2),
}


@pytest.mark.timeout(420)
@pytest.mark.parametrize("name", list(CASES))
def test_node_loss(name: str, tmp_path: Path) -> None:
    kills, replicas = CASES[name]
    result = Scenario(tmp_path / name, kills, replicas=replicas, steps=12, job=name).run()
    report = "\n".join(f"[{'PASS' if ok else 'FAIL'}] {what}" for what, ok in result.checks)
    assert result.ok, f"{report}\nlogs: {result.workdir}"
    assert len(result.kills) == len(kills)
