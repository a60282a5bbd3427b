"""The backend interface (`Backend`, `Trained`) and the registry of backends; `posttrain.backends` re-exports them."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from posttrain.core.registry import Registry


@dataclass
class Trained:
    """A model being trained: the wrapped module that forward and backward go through, its optimizer and schedule."""

    module: torch.nn.Module
    optimizer: Any
    scheduler: Any = None


class Backend:
    """The interface; `ddp` (posttrain.backends.ddp) is the reference implementation.

    Args:
        precision: `train.precision`: fp32, bf16-mixed (bf16 compute, fp32 weights and optimizer state) or bf16.
        offload: `train.offload`: none, optimizer or params (what stays in CPU memory between uses).
    """

    name: str = ""
    device: torch.device
    rank: int
    world_size: int
    sharded: bool = False
    """True when each process holds only a shard of the weights, so every forward is collective: all processes
    must run the same number of forward passes (`agree` ends a decode loop on all of them at once)."""

    offloads: tuple[str, ...] = ("none",)
    """The `train.offload` values this backend supports."""

    def __init__(self, precision: str = "fp32", offload: str = "none"):
        self.precision, self.offload = precision, offload

    @classmethod
    def check(cls, train) -> None:
        """Raises ConfigError when this backend cannot run the `train.*` settings, or cannot run here; cheap."""
        if train.offload not in cls.offloads:
            from posttrain.core.errors import ConfigError

            raise ConfigError(f"train.offload: {cls.name} supports {' or '.join(cls.offloads)}, not {train.offload!r}")

    def autocast(self) -> contextlib.AbstractContextManager:
        """Context for forward passes: bf16 compute under bf16-mixed; nothing to do otherwise (the weights' dtype
        decides). Backward runs outside it."""
        if self.precision == "bf16-mixed":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def place(self, model: torch.nn.Module) -> torch.nn.Module:
        """Chooses how the model computes attention here. On CPU in bf16 it is eager attention: torch's fused CPU
        attention runs its bf16 backward about 10x slower than its fp32 one (230 ms against 21 ms for one GRPO
        update of the embedded model, torch 2.13), while eager attention's bf16 matmuls are fast. Elsewhere the
        model keeps what it was loaded with (SDPA by default)."""
        if self.device.type == "cpu" and self.precision != "fp32" and hasattr(model, "set_attn_implementation"):
            model.set_attn_implementation("eager")
        return model

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def train(self, model: torch.nn.Module, *, lr: float, weight_decay: float,
              warmup_steps: int | None = None) -> Trained:
        """Wraps `model` for training with AdamW; `warmup_steps` adds a linear warm-up, then a constant rate."""
        raise NotImplementedError

    def freeze(self, model: torch.nn.Module) -> torch.nn.Module:
        """Places a model that is only scored (no gradients)."""
        raise NotImplementedError

    def accumulating(self, trained: list[Trained], sync: bool) -> contextlib.AbstractContextManager:
        """Context for one micro-batch's backward; gradients are synchronised across processes only when `sync`."""
        raise NotImplementedError

    def backward(self, loss: torch.Tensor) -> None:
        """Back-propagates `loss`, whose denominators already span every process."""
        raise NotImplementedError

    def step(self, trained: Trained, max_grad_norm: float) -> torch.Tensor | None:
        """Clips (when `max_grad_norm` > 0), steps the optimizer and schedule, clears gradients; returns the norm."""
        raise NotImplementedError

    def reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        """`op` ("sum", "mean", "max" or "min") of `tensor` over every process."""
        raise NotImplementedError

    def barrier(self) -> None:
        raise NotImplementedError

    def agree(self, flag: bool) -> bool:
        """True when `flag` is true on every process (a collective call on every process when sharded)."""
        if not self.sharded or self.world_size == 1:
            return flag
        return bool(self.reduce(torch.tensor(float(flag), device=self.device), "min"))

    def generation_model(self, trained: Trained) -> torch.nn.Module:
        """The plain model whose parameters are the trained ones, for sampling."""
        raise NotImplementedError

    def weights(self, trained: Trained) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, full tensor) of every weight, layer by layer, as the plain model names them (a LoRA adapter merged
        in), for a rollout engine that holds its own copy."""
        raise NotImplementedError

    def save(self, trained: Trained, tokenizer, path: Path, merged: bool = False) -> None:
        """Writes the model and tokenizer as one Hugging Face directory (every process calls it). An adapted model
        writes its adapter, or with `merged` the base with the adapter merged in."""
        raise NotImplementedError


def adamw(params: list[torch.nn.Parameter], *, lr: float, weight_decay: float,
          warmup_steps: int | None) -> tuple[torch.optim.Optimizer, Any]:
    """AdamW over `params` and its schedule: a linear warm-up over `warmup_steps`, then constant (None: no schedule)."""
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=True)
    if warmup_steps is None:
        return optimizer, None
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / (warmup_steps + 1)))


BACKENDS = Registry("backend", "train.backend")  # name -> Backend subclass


register, get = BACKENDS.register, BACKENDS.find
