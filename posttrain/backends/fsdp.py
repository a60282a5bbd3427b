"""Fully sharded data parallel with torch's FSDP2 (`fully_shard`): each of N processes holds 1/N of every weight, of
its gradient and of its AdamW state.

Each decoder block is one unit, and the root (embeddings, final norm, head) another. A unit's weights are
all-gathered just before its forward and freed after it, then gathered again for its backward, whose gradients are
reduce-scattered at once, every micro-batch, so whole gradients never pile up. At most one block's weights are whole
at a time besides the root's, in training, scoring and sampling alike. Frozen models (the reference) are sharded
the same way, without gradients or optimizer.

Because every forward is collective, all processes run the same forwards in the same order: the decode loop stops
only when every process's rows have stopped (`agree`), and evaluation pads the shorter shards with a dummy call.
The loss is already normalised over the whole step and FSDP averages the reduce-scattered gradients, so `backward`
multiplies by the process count, as for DDP.

Driven directly rather than through accelerate, whose FSDP plugin only runs on GPU backends: on a CPU machine it
silently falls back to unsharded training. One process runs too, over a one-process group, so that `fsdp2` is the
same code with one process or many.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from posttrain.backends.base import Trained, adamw, register
from posttrain.backends.ddp import DDP
from posttrain.models import lora


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a sharded parameter (a collective call), the tensor itself otherwise."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks: the modules whose classes it names as never to be split across devices (its
    decoder layers), outermost first."""
    names: set[str] = set()
    for m in model.modules():
        names.update(getattr(m, "_no_split_modules", None) or ())
    found = [m for m in model.modules() if type(m).__name__ in names]
    return [m for m in found if not any(m is not o and any(c is m for c in o.modules()) for o in found)]


def plain_class(model: torch.nn.Module) -> type:
    """The model's own class: `fully_shard` swaps it for a subclass named FSDP<class>."""
    from torch.distributed.fsdp import FSDPModule

    cls = type(model)
    return next(c for c in cls.__mro__[1:] if not issubclass(c, FSDPModule)) if isinstance(model, FSDPModule) else cls


@register("fsdp2")
class FSDP2(DDP):
    sharded = True
    offloads = ("none", "params")  # FSDP2 offloads weights, gradients and AdamW state together, never one alone

    def __init__(self, precision: str = "fp32", offload: str = "none"):
        super().__init__(precision, offload)
        dist = torch.distributed
        if not dist.is_initialized():  # one process: a group of one, so the weights are DTensors all the same
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo", store=dist.HashStore(),
                                    rank=0, world_size=1)
        from torch.distributed.device_mesh import init_device_mesh

        self.mesh = init_device_mesh(self.device.type, (self.world_size,))

    def shard(self, model: torch.nn.Module) -> torch.nn.Module:
        """Shards `model` in place over every process: each block a unit, then the rest as the root unit."""
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

        model.to(self.device)
        # params: the shards live in CPU memory and are copied to the device for each unit's forward and backward;
        # gradients come back to CPU, where AdamW steps.
        policy = CPUOffloadPolicy(pin_memory=self.device.type == "cuda") if self.offload == "params" else OffloadPolicy()
        for block in blocks(model):
            fully_shard(block, mesh=self.mesh, offload_policy=policy)
        # The root unit is the transformers model, inside a peft wrapper if any: sampling calls it directly.
        fully_shard(lora.hf_model(model), mesh=self.mesh, offload_policy=policy)
        return model

    def train(self, model, *, lr, weight_decay, warmup_steps=None) -> Trained:
        if self.precision == "bf16":
            model = model.to(torch.bfloat16)
        model = self.shard(self.place(model))
        trained = [p for p in model.parameters() if p.requires_grad]  # this process's shards
        return Trained(model, *adamw(trained, lr=lr, weight_decay=weight_decay, warmup_steps=warmup_steps))

    def freeze(self, model):
        dtype = torch.float32 if self.precision == "fp32" else torch.bfloat16
        return self.shard(self.place(model.eval().requires_grad_(False).to(dtype)))

    def accumulating(self, trained, sync):
        return contextlib.nullcontext()  # gradients are reduce-scattered every micro-batch: they stay sharded

    def backward(self, loss):
        (loss * self.world_size).backward()

    def step(self, trained, max_grad_norm):
        norm = None
        if max_grad_norm > 0:
            params = [p for p in trained.module.parameters() if p.grad is not None]
            norm = full(torch.nn.utils.clip_grad_norm_(params, max_grad_norm))  # the global norm, on every process
        trained.optimizer.step()
        if trained.scheduler is not None:
            trained.scheduler.step()
        trained.optimizer.zero_grad(set_to_none=True)
        return norm

    def generation_model(self, trained):
        return trained.module  # sampling runs the sharded module: each block is gathered for its own forward

    def weights(self, trained) -> Iterator[tuple[str, torch.Tensor]]:
        """Every weight gathered whole, one at a time, in the same order on every process."""
        model = trained.module
        if lora.is_adapted(model):
            yield from lora.merged_weights(model, full=full)
            return
        for name, param in model.named_parameters():
            yield name, full(param)

    def save(self, trained, tokenizer, path: Path, merged: bool = False):
        """Gathers the weights (every process takes part; only the first keeps them, on CPU) and writes them from
        the first process, as the unsharded model would."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        model = trained.module
        if lora.is_adapted(model) and merged:
            state = {name: t.detach().cpu() for name, t in lora.merged_weights(model, full=full)}
        else:
            state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.is_main:
            if not lora.is_adapted(model):
                save_plain(model, path, state)
            elif merged:
                lora.peft_model(model).get_base_model().save_pretrained(path, state_dict=state,
                                                                         safe_serialization=True)
            else:
                lora.peft_model(model).save_pretrained(path, state_dict=state, safe_serialization=True)
            tokenizer.save_pretrained(path)
        self.barrier()


def save_plain(model: torch.nn.Module, path: Path, state: dict[str, torch.Tensor]) -> None:
    """`model.save_pretrained` with the gathered `state`, recording the model's own class, not FSDP's subclass."""
    sharded_class = type(model)
    model.__class__ = plain_class(model)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*shared tensors.*")
            model.save_pretrained(path, state_dict=state, safe_serialization=True)
    finally:
        model.__class__ = sharded_class
