"""A tiny FSDP2 model + AdamW for tests (about 0.1M parameters)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class Tiny(nn.Module):
    def __init__(self, dim: int = 48, depth: int = 3, vocab: int = 128) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
            for _ in range(depth)
        )
        self.head = nn.Linear(dim, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for b in self.blocks:
            h = h + b(h)
        return self.head(h)


class Counter:
    """A user extra with state_dict/load_state_dict."""

    def __init__(self) -> None:
        self.n = 0
        self.history: list[int] = []

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n, "history": list(self.history)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.n = sd["n"]
        self.history = list(sd["history"])


def build(world: int, seed: int = 0, lr: float = 1e-2) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = Tiny()
    mesh = init_device_mesh("cpu", (world,))
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
    return model, opt, sched


def train_step(model: nn.Module, opt: torch.optim.Optimizer, sched: Any, step: int, rank: int) -> float:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randint(0, 128, (4, 16), generator=g)
    logits = model(x)
    loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 128), x[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach())


def full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Full (unsharded) model + optimizer state on CPU; every rank must call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {"model": msd, "optim": osd}
