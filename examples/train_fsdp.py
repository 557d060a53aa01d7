#!/usr/bin/env python
"""Reference FSDP2 trainer for aegis: a small decoder-only transformer on synthetic tokens.

Runs under ``torchrun`` (any world size) or as a plain single process (world 1)::

    torchrun --standalone --nproc_per_node=2 examples/train_fsdp.py --config tiny --steps 20
    python examples/train_fsdp.py --config tiny --steps 20 --no-aegis

Same seed and world size -> bitwise identical loss sequence on CPU. With aegis enabled a run
that is killed and resumed produces the same losses as an uninterrupted one.

The reusable pieces (``CONFIGS``, ``GPTConfig``, ``TinyGPT``, ``build_model``, ``init_weights``,
``SyntheticTokens``, ``ResumableSampler``, ``build_optimizer_and_scheduler``) are importable by
path, e.g. with ``importlib.util.spec_from_file_location``; importing has no side effects.
"""

import argparse
import dataclasses
import faulthandler
import json
import math
import os
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

# --------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    seq_len: int
    mlp_ratio: int = 4
    dropout: float = 0.0
    lr: float = 3e-3  # default peak learning rate for this size (--lr overrides)


CONFIGS: dict[str, GPTConfig] = {
    # ~0.11M params
    "tiny": GPTConfig(vocab_size=256, dim=56, n_layers=2, n_heads=2, seq_len=32),
    # ~3.7M params
    "small": GPTConfig(vocab_size=1024, dim=256, n_layers=4, n_heads=4, seq_len=128, lr=1e-3),
    # ~21M params
    "medium": GPTConfig(vocab_size=2048, dim=512, n_layers=6, n_heads=8, seq_len=256, lr=6e-4),
    # ~50M params
    "50m": GPTConfig(vocab_size=8192, dim=640, n_layers=8, n_heads=10, seq_len=256, lr=6e-4),
}


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        if cfg.dim % cfg.n_heads:
            raise ValueError(f"dim {cfg.dim} is not divisible by n_heads {cfg.n_heads}")
        self.n_heads = cfg.n_heads
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q = q.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2)
        k = k.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2)
        v = v.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.dim, cfg.mlp_ratio * cfg.dim)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.dim, cfg.dim)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """Decoder-only transformer: token + learned positional embedding, pre-LN blocks,
    final LayerNorm, untied LM head."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.dim)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if self.head.weight.is_meta:
            # built on the meta device (build_model): values come later (the restore or
            # init_weights); running the initialisers here would compute nothing, in Python, op
            # by op (0.6 s of a 1 GB-per-rank in-process rebuild of 1.65 s, py-spy)
            return
        self.apply(self._init_weights)
        # GPT-2 style scaled init of the residual projections.
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layers))

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence length {t} > model seq_len {self.cfg.seq_len}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def count_params(model: nn.Module) -> int:
    """Number of parameters (the full count, also for FSDP2-sharded DTensor params)."""
    return sum(p.numel() for p in model.parameters())


def build_model(
    config: str | GPTConfig,
    *,
    seed: int = 0,
    dropout: float | None = None,
    mesh: Any = None,
    tp_mesh: Any = None,
    init: bool = True,
) -> TinyGPT:
    """Build ``TinyGPT`` with a deterministic init (seeded here, identical on every rank and at
    every world size).

    With ``mesh`` (the data-parallel DeviceMesh: 1-D FSDP, or 2-D ``(dp_replicate, dp_shard)``
    for HSDP) each block and then the root are wrapped with FSDP2 ``fully_shard``; parameters
    live on the mesh's device type. With ``tp_mesh`` each block's MLP is tensor parallel first
    (``fc`` column-wise, ``proj`` row-wise; attention stays whole on every TP rank).

    A sharded model is built on the meta device, sharded there and only then given memory: no
    full-size copy is initialised and then split (173M parameters, one core, a loaded machine:
    3.6 s to build and shard that way, 0.3 s this way). ``init=False`` leaves its values unset, for a caller that is about
    to restore every one of them (see :func:`init_weights` for the case where nothing was).
    """
    cfg = CONFIGS[config] if isinstance(config, str) else config
    if dropout is not None:
        cfg = dataclasses.replace(cfg, dropout=dropout)
    if mesh is None and tp_mesh is None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return TinyGPT(cfg)
    with torch.device("meta"):
        model = TinyGPT(cfg)
    if tp_mesh is not None:
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        for block in model.blocks:
            parallelize_module(block.mlp, tp_mesh, {"fc": ColwiseParallel(), "proj": RowwiseParallel()})
    if mesh is not None:
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    # every value is set next (init_weights, or the restore): under deterministic algorithms
    # (main() turns them on) torch would fill the new memory with NaN first, for nothing
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.utils.deterministic.fill_uninitialized_memory = False
    try:
        model.to_empty(device=(mesh if mesh is not None else tp_mesh).device_type)
    finally:
        torch.utils.deterministic.fill_uninitialized_memory = fill
    if init:
        init_weights(model, seed)
    return model


def init_weights(model: TinyGPT, seed: int) -> None:
    """Give ``model`` (sharded or not) the values ``TinyGPT`` takes when built whole after
    ``torch.manual_seed(seed)``: the same at every world size and mesh. A full reference model
    is built on the CPU and each rank copies its own shard of every tensor out of it locally (no
    collective; ``distribute_tensor`` would take ~80 ms per 9 MB tensor here). The global RNG is
    left as it was."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        ref = dict(TinyGPT(model.cfg).state_dict())
    with torch.no_grad():
        for name, t in model.state_dict().items():
            full = ref.pop(name)
            if isinstance(t, DTensor):
                # each rank's part is one block of the full tensor, also under FSDP over TP (the
                # FSDP shard of a TP shard): what DCP reads a full tensor into shards with
                shape, offset = compute_local_shape_and_global_offset(
                    full.shape, t.device_mesh, t.placements)
                block = tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))
                t.to_local().copy_(full[block])
            else:
                t.copy_(full)


def build_optimizer_and_scheduler(
    model: nn.Module,
    *,
    lr: float,
    total_steps: int,
    warmup_steps: int | None = None,
    weight_decay: float = 0.1,
    min_lr_ratio: float = 0.1,
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW (no decay on biases, norms) + LambdaLR: linear warmup, then cosine to
    ``min_lr_ratio * lr`` at ``total_steps``.

    ``scheduler.step()`` is called once per training step, so training step ``s`` (1-based)
    runs with factor ``lr_lambda(s - 1)``.
    """
    if warmup_steps is None:
        warmup_steps = max(1, total_steps // 10)
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=lr,
        betas=(0.9, 0.95),
        foreach=True,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, WarmupCosine(warmup_steps, total_steps, min_lr_ratio)
    )
    return optimizer, scheduler


class WarmupCosine:
    """LR factor: linear warmup over ``warmup`` steps, cosine decay to ``min_ratio`` at
    ``total``. A callable object (not a lambda) so LambdaLR's state_dict records it."""

    def __init__(self, warmup: int, total: int, min_ratio: float = 0.1) -> None:
        self.warmup = int(warmup)
        self.total = int(total)
        self.min_ratio = float(min_ratio)

    def __call__(self, i: int) -> float:
        if i < self.warmup:
            return (i + 1) / self.warmup
        span = max(1, self.total - self.warmup)
        progress = min(1.0, (i - self.warmup) / span)
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


# --------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------

_MASK63 = (1 << 63) - 1


def _mix_seed(seed: int, index: int) -> int:
    """A 63-bit generator seed derived from (seed, index) only (splitmix64 finaliser)."""
    z = (int(seed) * 0x9E3779B97F4A7C15 + int(index) + 0x632BE59BD9B4E019) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & _MASK63


class SyntheticTokens:
    """Infinite deterministic token dataset; sample ``i`` depends only on ``(seed, i)``.

    Each sample is a noisy repeating pattern: a random motif of 2..``max_period`` tokens,
    repeated to ``seq_len + 1`` tokens, with each token replaced by a uniform random one with
    probability ``noise``. Motif tokens are drawn from a seed-dependent Zipf-like distribution so
    that the loss drops early (unigram statistics) and keeps dropping (in-context copying).
    """

    def __init__(
        self,
        vocab_size: int,
        seq_len: int,
        seed: int = 0,
        *,
        noise: float = 0.1,
        max_period: int = 8,
    ) -> None:
        self.vocab_size = int(vocab_size)
        self.seq_len = int(seq_len)
        self.seed = int(seed)
        self.noise = float(noise)
        self.max_period = int(max_period)
        g = torch.Generator().manual_seed(_mix_seed(self.seed, -1))
        ranks = torch.randperm(self.vocab_size, generator=g).to(torch.float64)
        self._probs = 1.0 / (ranks + 1.0)  # token -> Zipf weight, order set by the seed

    def __getitem__(self, index: int) -> torch.Tensor:
        """``seq_len + 1`` int64 tokens (inputs are ``[:-1]``, targets ``[1:]``)."""
        g = torch.Generator().manual_seed(_mix_seed(self.seed, index))
        n = self.seq_len + 1
        period = int(torch.randint(2, self.max_period + 1, (1,), generator=g))
        motif = torch.multinomial(self._probs, period, replacement=True, generator=g)
        seq = motif.repeat(-(-n // period))[:n]
        noisy = torch.rand(n, generator=g) < self.noise
        random_tokens = torch.randint(0, self.vocab_size, (n,), generator=g)
        return torch.where(noisy, random_tokens, seq)

    def batch(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each ``[len(indices), seq_len]`` int64 on CPU."""
        data = torch.stack([self[i] for i in indices])
        return data[:, :-1].contiguous(), data[:, 1:].contiguous()


class ResumableSampler:
    """Yields global batches of sample indices; its position is counted in global batches.

    Global batch ``g`` holds samples ``[g * G, (g + 1) * G)`` with ``G = batch_size *
    world_size``; rank ``r`` uses ``[r * batch_size, (r + 1) * batch_size)`` of it
    (``local_indices``). The state is ``{"consumed": <global batches yielded>, "seed": ...}``,
    independent of the world size, so a run saved at world N resumes at the same global batch
    number at world M (later batches then use the new global batch size).
    """

    def __init__(self, batch_size: int, world_size: int = 1, rank: int = 0, seed: int = 0) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} out of range for world size {world_size}")
        self.batch_size = int(batch_size)
        self.world_size = int(world_size)
        self.rank = int(rank)
        self.seed = int(seed)
        self.consumed = 0

    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.world_size

    def global_indices(self, g: int) -> list[int]:
        start = g * self.global_batch_size
        return list(range(start, start + self.global_batch_size))

    def local_indices(self, global_batch: list[int]) -> list[int]:
        lo = self.rank * self.batch_size
        return global_batch[lo : lo + self.batch_size]

    def next_global_batch(self) -> list[int]:
        batch = self.global_indices(self.consumed)
        self.consumed += 1
        return batch

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            yield self.next_global_batch()

    def state_dict(self) -> dict[str, int]:
        return {"consumed": int(self.consumed), "seed": int(self.seed)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.consumed = int(state_dict["consumed"])
        self.seed = int(state_dict["seed"])


class PerRankStream:
    """Each rank reads its own stream (like ``DistributedSampler`` shards or a per-rank
    dataloader): rank ``r`` takes samples ``[base_r + pos, base_r + pos + batch_size)`` and
    advances ``pos``; the streams start at positions that differ by rank, so every rank's state
    is its own. Same interface as :class:`ResumableSampler` for the training loop.

    ``reshard_state_dicts`` is aegis' hook for a restore into another world size: a rank that
    existed keeps its stream, a new rank starts its own stream at the step reached."""

    _STREAM = 1 << 40  # samples per stream: streams never overlap

    def __init__(self, batch_size: int, world_size: int = 1, rank: int = 0, seed: int = 0) -> None:
        self.batch_size = int(batch_size)
        self.rank = int(rank)
        self.seed = int(seed)
        self.consumed = 0
        self.pos = self._start(self.rank)

    @staticmethod
    def _start(rank: int) -> int:
        return 37 * rank

    def next_global_batch(self) -> list[int]:
        base = (self.rank + 1) * self._STREAM
        batch = list(range(base + self.pos, base + self.pos + self.batch_size))
        self.pos += self.batch_size
        self.consumed += 1
        return batch

    def local_indices(self, batch: list[int]) -> list[int]:
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"consumed": int(self.consumed), "pos": int(self.pos), "seed": int(self.seed)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.consumed = int(state_dict["consumed"])
        self.pos = int(state_dict["pos"])
        self.seed = int(state_dict["seed"])

    def reshard_state_dicts(self, states: list[dict[str, Any]], rank: int, world_size: int) -> dict[str, Any]:
        consumed = int(states[0]["consumed"])
        if rank < len(states):
            return dict(states[rank])
        return {"consumed": consumed, "pos": self._start(rank) + consumed * self.batch_size,
                "seed": int(states[0]["seed"])}


# --------------------------------------------------------------------------------------------
# Distributed setup
# --------------------------------------------------------------------------------------------


def init_distributed(device: str, timeout_s: float | None = None) -> tuple[int, int, int, str | None]:
    """Initialise the default process group; returns (rank, world, local_rank, filestore path).

    Under torchrun the env:// rendezvous is used. Without it a world-1 group is created on a
    temporary FileStore (the returned path, to delete at the end).
    """
    backend = "cpu:gloo,cuda:nccl" if device == "cuda" else "gloo"
    kw: dict[str, Any] = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        rank = int(os.environ["RANK"])
        world = int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if device == "cuda":
            torch.cuda.set_device(local_rank)
        dist.init_process_group(backend=backend, **kw)
        return rank, world, local_rank, None
    if device == "cuda":
        torch.cuda.set_device(0)
    fd, path = tempfile.mkstemp(prefix="train_fsdp_store_")
    os.close(fd)
    os.unlink(path)  # FileStore creates it
    store = dist.FileStore(path, 1)
    dist.init_process_group(backend=backend, store=store, rank=0, world_size=1, **kw)
    return 0, 1, 0, path


def global_mean(value: torch.Tensor, world: int) -> float:
    """Mean of a scalar over all ranks (SUM / world in float64; every rank gets the same)."""
    t = value.detach().to(torch.float64).reshape(1)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return float(t.item()) / world


def dump_state(path: str, model: nn.Module, optimizer: torch.optim.Optimizer, extra: dict) -> None:
    """Collective: gather the full unsharded model + optimizer state; rank 0 writes ``path``."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_sd, optim_sd = get_state_dict(
        model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if dist.get_rank() == 0:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        torch.save({"model": model_sd, "optim": optim_sd, **extra}, tmp)
        os.replace(tmp, path)
    dist.barrier()


def _raw(t: torch.Tensor) -> bytes:
    """A tensor's bytes (row-major): what the digest hashes, and what a gather pickles ~10x
    faster than the tensor itself."""
    return t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def _local_parts(local: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """This rank's part of each value of ``local`` (name -> tensor, DTensor or other), as one
    gather carries it: (name, where the part lies in the full value, the part). A DTensor's local
    chunk travels as its bytes with its global offset and the full shape (any mesh: FSDP's row
    shards, HSDP's and TP's 2-D placements), sent only by the ranks at coordinate 0 of every
    dimension it is replicated over, so a replicated chunk crosses once and no per-tensor
    collective (``full_tensor()``) runs; a plain tensor or another value travels whole, and
    rank 0 keeps its own."""
    from torch.distributed.tensor import DTensor

    parts: list[tuple[str, Any, Any]] = []
    for name, t in local.items():
        if isinstance(t, DTensor):
            coord = t.device_mesh.get_coordinate() or []
            if any(p.is_replicate() and c != 0 for p, c in zip(t.placements, coord, strict=True)):
                continue  # another rank sends this copy
            (chunk,) = t.__create_chunk_list__()  # the offsets and sizes DCP plans with
            where = (tuple(t.shape), t.dtype, tuple(chunk.offsets), tuple(chunk.sizes))
            parts.append((name, where, _raw(t.to_local())))
        elif isinstance(t, torch.Tensor):
            parts.append((name, None, _raw(t)))
        else:
            parts.append((name, None, t))
    return parts


def _joined(pieces: list[tuple[Any, Any]]) -> Any:
    """The full value from its pieces ((where, part) per rank that sent one, in rank order): a
    DTensor's chunks put in place (a chunk two ranks sent is taken once), else rank 0's value."""
    where0, first = pieces[0]
    if where0 is None:
        return first
    shape, dtype = where0[0], where0[1]
    full = torch.empty(shape, dtype=dtype)
    filled = 0
    seen: set[tuple[int, ...]] = set()
    for (_, _, offsets, sizes), part in pieces:
        n = math.prod(sizes)
        if offsets in seen or n == 0:
            continue
        seen.add(offsets)
        region = full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))]
        region.copy_(torch.frombuffer(bytearray(part), dtype=dtype).view(sizes))
        filled += n
    if filled != full.numel():
        raise RuntimeError(f"state digest: the chunks cover {filled} of {full.numel()} elements")
    return _raw(full)


def state_digest(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                 sampler: Any) -> str | None:
    """Collective: crc32c of the full (unsharded) training state, on rank 0; None elsewhere.

    Independent of the world size, so a state restored onto fewer ranks can be compared with
    the state that was saved. One gather of every rank's shards (rank 0 joins them along their
    shard dim), not a gather per tensor: the chaos campaign takes a digest at every step and
    after every restore, and a per-tensor full state dict made a step of the tiny model 3x
    slower (105 ms against 36 ms, 2 ranks idle), which the campaign's resume times counted."""
    import crc32c
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    flat: dict[str, Any] = dict(model_sd)
    for fqn, st in optim_sd["state"].items():
        for k, v in st.items():
            flat[f"{fqn}.{k}"] = v
    parts = _local_parts(flat)
    rank = dist.get_rank()
    gathered: list[Any] | None = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(parts, gathered, dst=0)
    if rank != 0:
        return None
    assert gathered is not None
    pieces: dict[str, list[tuple[Any, Any]]] = {}
    for g in gathered:
        for n, where, part in g:
            pieces.setdefault(n, []).append((where, part))

    def full(name: str) -> Any:
        return _joined(pieces[name])

    def add(crc: int, label: str, v: Any) -> int:
        crc = crc32c.crc32c(label.encode(), crc)
        if isinstance(v, bytes):  # a tensor's bytes
            return crc32c.crc32c(v, crc)
        return crc32c.crc32c(repr(v).encode(), crc)

    crc = 0
    for name in sorted(model_sd):
        crc = add(crc, name, full(name))
    for fqn, st in sorted(optim_sd["state"].items()):
        for k in sorted(st):
            crc = add(crc, f"{fqn}.{k}", full(f"{fqn}.{k}"))
    other = json.dumps([optim_sd["param_groups"], scheduler.state_dict(), sampler.state_dict()],
                       sort_keys=True, default=repr)
    return f"{crc32c.crc32c(other.encode(), crc):08x}"


def write_digest(path: str, phase: str, step: int, *parts: Any) -> None:
    digest = state_digest(*parts)
    if digest is not None:
        with open(path, "a") as f:
            f.write(json.dumps({"step": step, "phase": phase, "digest": digest,
                                "world": dist.get_world_size(), "time": time.time()}) + "\n")
            f.flush()
            os.fsync(f.fileno())


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def last_step(args: argparse.Namespace, device: torch.device) -> int:
    """``--steps``, or the step in ``--end-file`` where a harness gave one. Collective with an
    end file: the ranks take the smallest value any of them read (one all-reduce of an integer
    per step), so they stop at the same step even when the harness replaces the file while
    some have read it and others not (the value only ever goes down, once)."""
    if not args.end_file:
        return int(args.steps)
    try:
        with open(args.end_file) as f:
            n = int(f.read())
    except (OSError, ValueError):
        n = int(args.steps)
    t = torch.tensor([n], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="tiny", choices=sorted(CONFIGS))
    p.add_argument("--steps", type=int, default=100, help="last step to run (steps start at 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=None, help="peak LR (default: per config)")
    p.add_argument("--warmup-steps", type=int, default=None, help="default: steps // 10")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--job", default="train_fsdp")
    p.add_argument("--store-dir", default=None, help="aegis node store (default /dev/shm/aegis)")
    p.add_argument("--every", type=int, default=1, help="aegis snapshot every N steps")
    p.add_argument("--keep", type=int, default=1, help="aegis in-memory snapshots to keep")
    p.add_argument("--replicas", type=int, default=1, help="aegis replicas on other nodes")
    p.add_argument("--redundancy", choices=("replica", "dp", "xor", "rs"), default="replica",
                   help="aegis memory redundancy: whole replicas (dp: each built on its holder from "
                        "the data-parallel copy it holds, e.g. with --mesh hsdp), XOR or "
                        "Reed-Solomon parity groups")
    p.add_argument("--group-size", type=int, default=5, help="nodes per parity group")
    p.add_argument("--parity", type=int, default=2, help="RS: lost nodes per group it rebuilds")
    p.add_argument("--durable", default=None, help="aegis durable tier URL (file:// or s3://)")
    p.add_argument("--durable-every", type=int, default=10, help="upload every N steps")
    p.add_argument("--durable-keep-last", type=int, default=None,
                   help="durable retention: keep the newest N steps (default: aegis' default)")
    p.add_argument("--durable-max-pending", type=int, default=None,
                   help="uploads queued behind the running one before further ones are skipped")
    p.add_argument("--timeout", type=float, default=None,
                   help="aegis: bound on every snapshot collective, seconds (default 300)")
    p.add_argument("--pg-timeout", type=float, default=None,
                   help="timeout of the training process group's collectives, seconds (a peer "
                   "silent for longer fails the step, and torchrun restarts the job without it)")
    p.add_argument(
        "--digest-log",
        default=None,
        help="append a digest of the full state after every save and after restore (rank 0)",
    )
    p.add_argument("--sampler", choices=["global", "per-rank"], default="global",
                   help="global: one stream, global batches (the same state on every rank); "
                        "per-rank: each rank its own stream and position (per-rank state)")
    p.add_argument("--in-process", action="store_true",
                   help="recover in place: survivors of a lost peer re-form their groups and go on "
                        "in the same processes (aegis.run_in_process; needs AEGIS_MEMBERSHIP)")
    p.add_argument("--mesh", choices=("fsdp", "hsdp", "tp"), default="fsdp",
                   help="fsdp: 1-D FSDP; hsdp: replicate across nodes x shard within one; tp: "
                        "FSDP across nodes x tensor parallel (the MLPs) within one")
    p.add_argument("--inner", type=int, default=None,
                   help="hsdp/tp: the within-node dimension (default LOCAL_WORLD_SIZE)")
    p.add_argument("--whole-nodes", action="store_true",
                   help="--in-process: rounds of whole nodes (always with --mesh hsdp/tp)")
    p.add_argument("--min-world", type=int, default=1, help="--in-process: smallest world to go on with")
    p.add_argument("--max-world", type=int, default=None,
                   help="--in-process: the most processes that train; more wait as spares and "
                        "step in after a loss (in the survivors' round or at their next snapshot)")
    p.add_argument("--dead-after", type=float, default=1.0,
                   help="--in-process: a peer silent this long (s) is declared dead and fenced off")
    p.add_argument("--no-aegis", action="store_true", help="train without checkpointing")
    p.add_argument("--loss-log", default=None, help="append one JSON line per step (rank 0)")
    p.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cuda" if torch.cuda.is_available() else "cpu",
    )
    p.add_argument("--step-sleep", type=float, default=0.0, help="sleep after each step (s)")
    p.add_argument("--dump-state", default=None, help="rank 0 torch.saves full state at the end")
    p.add_argument("--end-file", default=None,
                   help="a file holding the last step, read before every step; it overrides "
                        "--steps (a test harness ends the run at an event it waits for, e.g. a "
                        "replacement's join, not after a count of steps; the LR schedule still "
                        "spans --steps). The ranks agree on the smallest value read (one "
                        "all-reduce of an integer a step)")
    args = p.parse_args(argv)
    if args.steps < 0 or args.batch_size < 1 or args.every < 1:
        p.error("--steps must be >= 0, --batch-size and --every >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # `kill -USR1 <pid>` prints every thread's Python stack to stderr: what a hung worker waits on
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
    if args.device == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    else:
        torch.use_deterministic_algorithms(True)

    if args.in_process:
        return _run_in_process(args)
    rank, world, local_rank, store_path = init_distributed(args.device, args.pg_timeout)
    try:
        rc = _train(args, rank, world, local_rank)
        # Every rank leaves together: a rank tearing gloo down while a peer still finishes its
        # last collective was seen to abort that peer at exit (SIGABRT, "terminate called").
        dist.barrier()
        return rc
    finally:
        dist.destroy_process_group()
        if store_path is not None and os.path.exists(store_path):
            os.unlink(store_path)


def _run_in_process(args: argparse.Namespace) -> int:
    """``--in-process``: aegis forms the process groups and calls ``_train`` again, in this
    process, on the survivors whenever a peer is lost; everything bound to the groups (mesh,
    model, optimizer, Manager) is built inside ``_train``."""
    try:
        import aegis
    except ImportError:  # running from a checkout without the package installed
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        import aegis
    if args.no_aegis or args.device == "cuda":
        raise SystemExit("--in-process needs aegis and gloo (CPU) here: NCCL's abort path is not "
                         "built yet")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))

    def train(w: aegis.World) -> int:
        if w.restarts and w.rank == 0:
            phases = ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in w.timings.items())
            print(f"[train_fsdp] in-process recovery: round {w.round}, world {w.size} ({phases})",
                  flush=True)
        rc = _train(args, w.rank, w.size, local_rank, w)
        dist.barrier()  # leave together (see main)
        return rc

    # a 2-D mesh keeps its inner dimension within a node: rounds of whole nodes only
    whole = args.whole_nodes or args.mesh != "fsdp"
    rc = aegis.run_in_process(
        train, min_world=args.min_world, max_world=args.max_world, dead_after_s=args.dead_after,
        collective_timeout=timedelta(seconds=args.pg_timeout or 30),
        ranks_per_node=_local_world() if whole else None,
    )
    if rc is None:  # started (or came back) after the job had finished
        print("[train_fsdp] the job finished before this process could join it", flush=True)
        return 0
    return int(rc)


def _local_world() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def build_meshes(args: argparse.Namespace, world: int, w: Any = None) -> tuple[Any, Any, int, int]:
    """``--mesh``: (the data-parallel mesh FSDP shards over, the TP mesh or None, this rank's
    data-parallel rank, the data-parallel size). HSDP replicates across nodes and shards within
    one (``dp_shard`` = ``--inner``); TP runs within a node (``tp`` = ``--inner``) and FSDP
    across. In place (``w``, the round's ``aegis.World``), the mesh comes from ``w.mesh``."""
    from torch.distributed.device_mesh import init_device_mesh

    rank = dist.get_rank()
    if args.mesh == "fsdp":
        return init_device_mesh(args.device, (world,)), None, rank, world
    inner = args.inner or _local_world()
    dims = {"dp_replicate": -1, "dp_shard": inner} if args.mesh == "hsdp" else \
        {"dp_shard": -1, "tp": inner}
    if w is not None:
        mesh = w.mesh(args.device, within_node=tuple(dims)[-1:], **dims)
    else:
        from aegis.training.inprocess.layout import infer_dims

        shape = infer_dims(world, dims)  # a clear error for a world the mesh does not fit
        mesh = init_device_mesh(args.device, tuple(shape.values()), mesh_dim_names=tuple(shape))
    if args.mesh == "hsdp":
        return mesh, None, rank, world
    dp = mesh["dp_shard"]
    return dp, mesh["tp"], dp.get_local_rank(), dp.size()


def _train(args: argparse.Namespace, rank: int, world: int, local_rank: int, w: Any = None) -> int:
    device = torch.device("cuda", local_rank) if args.device == "cuda" else torch.device("cpu")
    mesh, tp_mesh, dp_rank, dp_size = build_meshes(args, world, w)
    # with aegis the values are set by the restore, or by init_weights when there is none
    model = build_model(args.config, seed=args.seed, dropout=args.dropout, mesh=mesh,
                        tp_mesh=tp_mesh, init=args.no_aegis)
    cfg = model.cfg
    # Distinct (but seed-determined) RNG stream per data-parallel rank for dropout; aegis
    # checkpoints it. The ranks of one TP group share theirs: they compute the replicated parts
    # (attention here) each, and different dropout masks would make those copies drift apart.
    torch.manual_seed(args.seed + 1 + dp_rank)
    optimizer, scheduler = build_optimizer_and_scheduler(
        model,
        lr=args.lr if args.lr is not None else cfg.lr,
        total_steps=args.steps,
        warmup_steps=args.warmup_steps,
    )
    data = SyntheticTokens(cfg.vocab_size, cfg.seq_len, seed=args.seed)
    sampler_cls = PerRankStream if args.sampler == "per-rank" else ResumableSampler
    # a batch per data-parallel rank (TP ranks of one group read the same one)
    sampler = sampler_cls(args.batch_size, world_size=dp_size, rank=dp_rank, seed=args.seed)
    if rank == 0:
        print(
            f"[train_fsdp] config={args.config} params={count_params(model):,} world={world} "
            f"mesh={args.mesh} device={args.device} batch={args.batch_size}x{dp_size} seq={cfg.seq_len} "
            f"aegis={'off' if args.no_aegis else 'on'}",
            flush=True,
        )

    mgr = None
    start = 0
    if not args.no_aegis:
        try:
            from aegis import Manager, ModelOptimizerState, replicated
        except ImportError:  # running from a checkout without the package installed
            sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
            from aegis import Manager, ModelOptimizerState, replicated

        mgr = Manager(
            args.job,
            {
                "model": ModelOptimizerState(model, optimizer),
                "scheduler": scheduler,
                # global: its position counts global batches, the same on every rank at any world
                # size; per-rank: each rank's own (aegis' default for objects)
                "data": replicated(sampler) if args.sampler == "global" else sampler,
            },
            every=args.every,
            keep=args.keep,
            replicas=args.replicas,
            redundancy=args.redundancy,
            group_size=args.group_size,
            parity=args.parity,
            store_dir=args.store_dir,
            durable=args.durable,
            durable_every=args.durable_every,
            **{k: v for k, v in {
                "durable_keep_last": args.durable_keep_last,
                "durable_max_pending": args.durable_max_pending,
                "timeout": timedelta(seconds=args.timeout) if args.timeout else None,
            }.items() if v is not None},
        )
        t0 = time.perf_counter()
        start = mgr.restore()
        if not start:  # a new job: nothing restored, the model has no values yet
            init_weights(model, args.seed)
        if rank == 0:
            print(
                f"[train_fsdp] restored step {start} in {time.perf_counter() - t0:.3f}s"
                if start
                else "[train_fsdp] no snapshot, starting from scratch",
                flush=True,
            )
        # Guard against data/step drift; aegis restores the sampler together with the step.
        if sampler.consumed != start:
            raise RuntimeError(f"sampler at {sampler.consumed} global batches, step {start}")
        if args.digest_log and start:
            write_digest(args.digest_log, "restored", start, model, optimizer, scheduler, sampler)

    log = open(args.loss_log, "a") if (args.loss_log and rank == 0) else None  # noqa: SIM115
    try:
        model.train()
        loss = float("nan")
        step = start
        while step < last_step(args, device):
            step += 1
            t0 = time.perf_counter()
            indices = sampler.local_indices(sampler.next_global_batch())
            inputs, targets = data.batch(indices)
            inputs, targets = inputs.to(device), targets.to(device)
            lr = scheduler.get_last_lr()[0]
            logits = model(inputs)
            loss_t = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
            loss_t.backward()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            loss = global_mean(loss_t, world)
            if args.digest_log and step % args.every == 0:
                # Before save(): a step can be committed even if this process is then lost (the
                # digest is itself a collective that a lost peer would block).
                write_digest(args.digest_log, "saved", step, model, optimizer, scheduler, sampler)
            t1 = time.perf_counter()
            if mgr is not None:
                # in-process recovery: a save() may end the round at its start (processes wait
                # to join); this step was not saved and is trained again in the next round
                mgr.save(step)
            t2 = time.perf_counter()
            if rank == 0:
                print(
                    f"step {step:>6}/{args.steps} loss {loss:.6f} lr {lr:.3e} "
                    f"{(t1 - t0) * 1e3:7.1f} ms  save {(t2 - t1) * 1e3:6.1f} ms",
                    flush=True,
                )
                if log is not None:
                    rec = {
                        "step": step,
                        "loss": loss,
                        "loss_hex": float.hex(loss),
                        "world": world,
                        "time": time.time(),
                        "lr": lr,
                        "step_time": t1 - t0,
                        "save_time": t2 - t1,
                    }
                    log.write(json.dumps(rec) + "\n")
                    log.flush()
                    os.fsync(log.fileno())
            if args.step_sleep > 0:
                time.sleep(args.step_sleep)
        if mgr is not None:
            mgr.close()
            mgr = None
        if args.dump_state:
            final_step = step
            dump_state(
                args.dump_state,
                model,
                optimizer,
                {
                    "step": final_step,
                    "world": world,
                    "scheduler": scheduler.state_dict(),
                    "data": sampler.state_dict(),
                    "config": args.config,
                },
            )
            if rank == 0:
                print(f"[train_fsdp] dumped state at step {final_step} to {args.dump_state}")
    finally:
        if log is not None:
            log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
