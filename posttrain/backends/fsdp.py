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
import math
from pathlib import Path

import torch

from posttrain.backends.base import (
    Backend,
    Trained,
    adamw,
    load_schedule,
    one_process_group,
    register,
    save_schedule,
)
from posttrain.backends.ddp import DDP
from posttrain.models import lora


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a sharded parameter (a DTensor: a collective call), the tensor itself otherwise. DTensor
    is not imported here: its module takes about a second to import (2 cores, AVX-512 with AMX), which every process
    would pay with FSDP2 unused."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks: the modules whose classes it names as never to be split across devices (its
    decoder layers), outermost first."""
    names: set[str] = set()
    for m in model.modules():
        names.update(getattr(m, "_no_split_modules", None) or ())
    found = [m for m in model.modules() if type(m).__name__ in names]
    return [m for m in found if not any(m is not o and any(c is m for c in o.modules()) for o in found)]


@register("fsdp2")
class FSDP2(DDP):
    sharded = True
    offloads = ("none", "params")  # FSDP2 offloads weights, gradients and AdamW state together, never one alone
    zero_stage = 3  # weights, gradients and AdamW state, each 1/N a process

    def __init__(self, precision: str = "fp32", offload: str = "none"):
        super().__init__(precision, offload)
        one_process_group(self.device)  # the weights are sharded tensors with one process too
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

    def train(self, model, *, lr, weight_decay, schedule=None, max_grad_norm=0.0) -> Trained:
        if self.precision == "bf16":
            model = model.to(torch.bfloat16)
        model = self.shard(self.place(model))
        trained = [p for p in model.parameters() if p.requires_grad]  # this process's shards
        return Trained(model, *adamw(trained, lr=lr, weight_decay=weight_decay, schedule=schedule),
                       scale=self.loss_scale())

    def freeze(self, model):
        return self.shard(self.place(model.eval().requires_grad_(False).to(self.compute_dtype)))

    def accumulating(self, trained, sync):
        return contextlib.nullcontext()  # gradients are reduce-scattered every micro-batch: they stay sharded

    def backward(self, loss, trained):
        self.scaled(loss * self.world_size, trained).backward()

    def step(self, trained, max_grad_norm):
        params = [p for p in trained.module.parameters() if p.grad is not None]
        # global, on every process, so every process skips alike and keeps the same loss scale
        return self.clip_and_step(trained, lambda: full(torch.nn.utils.clip_grad_norm_(params,
                                                                                      max_grad_norm or math.inf)))

    def whole(self, param):
        return full(param)

    def generation_model(self, trained):
        return trained.module  # sampling runs the sharded module: each block is gathered for its own forward

    save = Backend.save  # gathered one weight at a time, not DDP's (whole weights on process 0)

    def save_state(self, trained, path: Path) -> None:
        """Each process writes its own shards of the trained parameters and of AdamW's state, never gathered
        (torch.distributed.checkpoint: one `__<rank>_0.distcp` file per process and the `.metadata` that maps
        them); the first writes the schedule's state. `path` must be on a file system every process sees."""
        import torch.distributed.checkpoint as dcp

        path.mkdir(parents=True, exist_ok=True)
        dcp.save(sharded_state(trained), checkpoint_id=path)
        save_schedule(self, trained, path)
        self.barrier()

    def load_state(self, trained, path: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        state = sharded_state(trained)  # the shards to fill in, in place
        dcp.load(state, checkpoint_id=path)
        set_state_dict(trained.module, trained.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"], options=trained_only())
        load_schedule(trained, path)


def trained_only():
    """State-dict options that leave out frozen parameters (a LoRA model's base: the start model has it). Loading
    is then not strict, as the frozen ones are missing; `dcp.load` has already failed on any trained one that the
    checkpoint lacks."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(ignore_frozen_params=True, strict=False)


def sharded_state(trained: Trained) -> dict:
    """{"model", "optimizer"}: this process's shards of the trained parameters and of AdamW's state, as sharded
    tensors keyed by parameter name."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optimizer = get_state_dict(trained.module, trained.optimizer, options=trained_only())
    # the state dict also names a tied weight a second time (lm_head.weight for the embeddings), frozen or not
    names = {name for name, p in trained.module.named_parameters() if p.requires_grad}
    return {"model": {k: v for k, v in model.items() if k in names}, "optimizer": optimizer}
