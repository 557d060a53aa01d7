"""In-process recovery: surviving ranks re-form their process groups and go on training in the
same process when a peer dies, instead of being restarted.

::

    def train(world: aegis.World) -> None:          # aegis may call it again after a failure
        mesh = init_device_mesh("cpu", (world.size,))  # everything bound to the process group
        model = build_model(); fully_shard(model, mesh=mesh)   # is built inside
        optim = torch.optim.AdamW(model.parameters())
        mgr = aegis.Manager(job, {"model": aegis.ModelOptimizerState(model, optim)})
        start = mgr.restore()
        for step in range(start + 1, total + 1):
            ...
            mgr.save(step)
        mgr.close()

    aegis.run_in_process(train, min_world=2)        # instead of init_process_group + train()

The package, one phase of a recovery per module (docs/architecture.md, "In-process recovery"):

==============  ===============================================================================
``round``       what code inside a round sees: :class:`World`, the current :class:`~.round.Round`,
                the Managers to abort, joiners waiting, :class:`Regroup`, what a peer failure is
``membership``  heartbeats, rounds agreed through one c10d ``TCPStore``, joiners; no training
``abandon``     leaving a round's groups without collectives, one implementation per backend:
                gloo shuts its sockets down, NCCL aborts its communicators (one contract test)
``loop``        :func:`run_in_process`: form a round, run ``train``, tear down, form the next
``_sockets``    this process's TCP sockets from ``/proc`` (the gloo implementation's tools)
==============  ===============================================================================

Anything raised by ``train`` that is not a lost peer (a bug in the script, an error of aegis that
is not a peer failure) is re-raised: the process exits and the launcher restarts it, as without
this wrapper; so does a CUDA context left unusable by a fault.
"""

from __future__ import annotations

from aegis.training.inprocess.loop import run_in_process
from aegis.training.inprocess.round import (
    PeerLost,
    RecoveryGaveUp,
    Regroup,
    Round,
    World,
    check_round,
    in_process_round,
    in_round,
    is_peer_failure,
    joiners_registered,
    joiners_waiting,
    register_manager,
)

__all__ = ["World", "run_in_process", "RecoveryGaveUp", "Regroup", "PeerLost", "is_peer_failure"]


def publish_ports() -> None:
    """After a Manager created its groups: publish what peers need to fence this process off
    (the round's :class:`~.abandon.Abandon`)."""
    if Round.abandon is not None:
        Round.abandon.publish()


def round_failure() -> str | None:
    """Why the running round must end (a member fenced off by NCCL's abort), else None."""
    return Round.failed if Round.active else None


__all__ += ["publish_ports", "round_failure", "check_round", "in_process_round", "in_round",
            "joiners_registered", "joiners_waiting", "register_manager"]
