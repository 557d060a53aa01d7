"""A torchtitan training job on CPU/gloo, driven the way torchtitan's ``Trainer`` drives it.

``Trainer`` itself does not run on CPU (its llama3 attention backends are FlexAttention, which
has no CPU backward, and varlen, which is CUDA-only; its dataloaders need a Hugging Face dataset
and tokenizer that the wheel does not ship). So this builds the same components with
torchtitan's own code and calls them in the trainer's order:

* ``Trainer.__init__``: ``model_registry("debugmodel")`` (2 of its 6 layers, SDPA inner
  attention, the maskless backend its graph_trainer tests use), built on meta, FSDP2 through
  torchtitan's ``apply_fsdp_to_decoder``, ``to_empty`` + ``init_weights``, ``optimizer.build``
  (``default_adamw``), ``lr_scheduler.build`` (the debugmodel's warmup + linear decay), a
  ``ParallelAwareDataloader`` over a small local stateful dataset, and
  ``config.checkpoint.build(dataloader=, model_parts=, optimizers=, lr_schedulers=,
  states={"train_state": ...}, sd_adapter=None, base_folder=dump)``;
* ``Trainer.train``: ``checkpointer.load(step=load_step)``, then per step: forward with
  positions, sum cross-entropy / global tokens, backward, torchtitan's ``clip_grad_norm_``,
  ``checkpointer.maybe_wait_for_staging()``, ``optimizers.step()``, ``lr_schedulers.step()``,
  ``checkpointer.save(step, last_step=...)``; ``checkpointer.close()``.

One difference: gloo has no ``PREMUL_SUM``, so FSDP reduces gradients with a plain sum
(``set_force_sum_reduction_for_comms``), which is what torchtitan's divide factor of 1 means.

Run as a script under torchrun it trains and logs one JSON line per step on rank 0.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import pickle
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

VOCAB = 2048
SEQ = 17
BATCH = 2
STEPS = 8


class TokenDataset(torch.utils.data.IterableDataset, Stateful):
    """Deterministic token rows per dp rank: a small local stand-in for torchtitan's
    ``HuggingFaceTextDataset`` (same sample format, same ``state_dict`` role)."""

    def __init__(self, dp_rank: int) -> None:
        self.dp_rank = dp_rank
        self.index = 0

    def __iter__(self) -> Any:
        while True:
            g = torch.Generator().manual_seed(1000 * self.dp_rank + self.index)
            row = torch.randint(0, VOCAB, (SEQ,), generator=g)
            self.index += 1
            yield {"input": row[:-1], "positions": torch.arange(SEQ - 1)}, row[1:]

    def state_dict(self) -> dict[str, Any]:
        return {"index": self.index}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.index = int(state_dict["index"])


class TrainState:
    """The trainer's own checkpointed state (``Trainer.state_dict``)."""

    def __init__(self) -> None:
        self.step = 0
        self.ntokens_seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = state_dict["step"]
        self.ntokens_seen = state_dict["ntokens_seen"]


@dataclass
class Job:
    model: Any
    optimizers: Any
    lr_schedulers: Any
    dataloader: Any
    train_state: TrainState
    data_iter: Any = None

    def checkpointer(self, config: Any, dump: str | os.PathLike[str] = "") -> Any:
        return config.build(dataloader=self.dataloader, model_parts=[self.model],
                            optimizers=self.optimizers, lr_schedulers=self.lr_schedulers,
                            states={"train_state": self.train_state}, sd_adapter=None,
                            base_folder=str(dump))


def build(seed: int = 0, layers: int = 2, *, dp_replicate: int = 1, tp: int = 1) -> Job:
    """Every rank, after ``init_process_group``. ``dp_replicate`` / ``tp`` > 1: the 2-D layouts
    of torchtitan's ``ParallelDims`` (HSDP: ``dp_replicate`` x the rest sharded; FSDP + TP:
    the model's own ``parallelize`` on the ``tp`` mesh, the innermost), built as ``Trainer``
    builds them from ``parallelism.data_parallel_replicate_degree`` and
    ``tensor_parallel_degree`` (``spmd_backend="partial_dtensor"``: DTensor for the
    model-parallel axes only, its classic path)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import model_registry

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = model_registry("debugmodel").model
    cfg.layers = cfg.layers[:layers]
    for layer in cfg.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    if tp > 1:  # the Trainer fills the sharding config from parallelism.* before building
        from torchtitan.models.llama3.sharding import set_llama3_sharding_config

        set_llama3_sharding_config(cfg, enable_sp=False)
    with torch.device("meta"):
        model = cfg.build()
    dp_rank, dp_world = rank, world
    if dp_replicate == 1 and tp == 1:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    else:
        import torchtitan.distributed.parallel_dims as titan_dims
        from torchtitan.distributed import ParallelDims

        # torchtitan falls back to "cuda" when no accelerator is found (tools.utils.device_type)
        # and ParallelDims builds its mesh on it; this machine has none
        titan_dims.device_type = "cpu"
        dims = ParallelDims(dp_replicate=dp_replicate, dp_shard=-1, cp=1, tp=tp, pp=1, ep=1,
                            world_size=world, spmd_backend="partial_dtensor")
        dims.build_mesh()
        if dims.tp_enabled:
            model.parallelize(dims)
        mesh = dims.get_mesh(["dp_replicate", "fsdp"] if dims.dp_replicate_enabled else ["fsdp"])
        dp = dims.get_mesh("batch") if dims.dp_enabled else None
        dp_rank, dp_world = (dp.get_local_rank(), dp.size()) if dp is not None else (0, 1)
    apply_fsdp_to_decoder(model, mesh, torch.float32, torch.float32, pp_enabled=False)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    opt_config = default_adamw(lr=8e-4)
    opt_config.implementation = "for-loop"
    optimizers = opt_config.build(model_parts=[model])
    lr_schedulers = LRSchedulersContainer.Config(
        warmup_steps=2, decay_ratio=0.8, decay_type="linear", min_lr_factor=0.0,
    ).build(optimizers=optimizers, training_steps=STEPS)
    dataloader = ParallelAwareDataloader(TokenDataset(dp_rank), dp_rank=dp_rank,
                                         dp_world_size=dp_world, batch_size=BATCH)
    return Job(model, optimizers, lr_schedulers, dataloader, TrainState())


def train_step(job: Job) -> float:
    """One step of ``Trainer.train_step``; returns the global loss (every rank)."""
    from torchtitan.distributed.utils import clip_grad_norm_

    if job.data_iter is None:
        job.data_iter = iter(job.dataloader)
    inputs, labels = next(job.data_iter)
    job.train_state.step += 1
    job.train_state.ntokens_seen += labels.numel()
    dp_world = getattr(job.dataloader, "dp_world_size", dist.get_world_size())
    global_tokens = torch.tensor(labels.numel() * dp_world)
    pred = job.model(inputs["input"], positions=inputs["positions"])
    ctx: Any = contextlib.nullcontext()
    if isinstance(pred, DTensor):  # TP: the output is sharded over the vocabulary
        from torch.distributed.tensor.parallel import loss_parallel

        ctx = loss_parallel()
    with ctx:
        loss = torch.nn.functional.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(),
                                                 reduction="sum") / global_tokens
        loss.backward()
    if isinstance(loss, DTensor):
        loss = loss.full_tensor()
    clip_grad_norm_(list(job.model.parameters()), 1.0, foreach=True)
    return float(loss.detach())


def optimizer_step(job: Job, checkpointer: Any) -> None:
    checkpointer.maybe_wait_for_staging()
    job.optimizers.step()
    job.lr_schedulers.step()
    job.optimizers.zero_grad()


def flat_state(job: Job) -> dict[str, Any]:
    """torchtitan's flattened checkpoint view of the job (``_flattened_model_states_sd``)."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torchtitan.components.checkpointer import ModelWrapper

    sd: dict[str, Any] = {"optimizer": job.optimizers.state_dict(),
                          "lr_scheduler": job.lr_schedulers.state_dict(),
                          "dataloader": job.dataloader.state_dict(),
                          "train_state": job.train_state.state_dict()}
    sd.update(ModelWrapper([job.model]).state_dict())
    return flatten_state_dict(sd)[0]


def digest(job: Job) -> dict[str, str]:
    """Per key: sha1 of this rank's local bytes (tensors) or of the value (objects)."""
    from torch.distributed.tensor import DTensor

    out: dict[str, str] = {}
    for k, v in flat_state(job).items():
        if isinstance(v, DTensor):
            v = v.to_local()
        if isinstance(v, torch.Tensor):
            data = v.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes() + str(v.dtype).encode()
        elif k.startswith("dataloader.dp_rank_"):
            data = repr(pickle.loads(v)).encode()
        else:
            data = repr(v).encode()
        out[k] = hashlib.sha1(data).hexdigest()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--job", default="titan")
    ap.add_argument("--store-dir", required=True)
    ap.add_argument("--loss-log", required=True)
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--step-sleep", type=float, default=0.0)
    args = ap.parse_args(argv)
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    from aegis.integrations.torchtitan import AegisCheckpointManager

    job = build()
    ckpt = job.checkpointer(AegisCheckpointManager.Config(
        job=args.job, every=1, store_dir=args.store_dir, last_save_model_only=False,
        timeout_s=60))
    ckpt.load(step=-1)
    rank = dist.get_rank()
    with open(args.loss_log, "a") as log:
        while job.train_state.step < args.steps:
            loss = train_step(job)
            optimizer_step(job, ckpt)
            step = job.train_state.step
            ckpt.save(step, last_step=step == args.steps)
            if rank == 0:
                log.write(json.dumps({"step": step, "loss_hex": float.hex(loss)}) + "\n")
                log.flush()
            time.sleep(args.step_sleep)
    final = digest(job)
    ckpt.close()
    Path(f"{args.loss_log}.rank{rank}.digest.json").write_text(json.dumps(final, sort_keys=True))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
