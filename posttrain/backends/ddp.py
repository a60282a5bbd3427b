"""Data parallel through accelerate: one process by default, DDP when launched with several (torchrun).

Every process holds the whole model, its gradients and its AdamW state (of the adapters alone under LoRA). DDP
averages gradients over processes; the engine's losses are already divided by the token and sequence counts of the
whole step across processes, so `backward` multiplies by the process count to turn that average back into the sum,
and the update does not depend on how a batch is split over processes or micro-batches.
"""

from __future__ import annotations

import atexit
import contextlib
import math
import os
import sys
from pathlib import Path

import torch

from posttrain.backends.base import Backend, Trained, adamw, register, write
from posttrain.core.precision import resolve


def _close_process_group() -> None:
    """Several processes over gloo hang at interpreter exit unless the process group is destroyed first."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def exit_process(code: int) -> None:
    """Ends a process of a multi-process run with `code`, once its work is written; returns when there is none.

    The process group is destroyed, then the process exits without the interpreter's teardown: there, now and then
    (1 run in 6 here, over gloo), a native thread of the distributed runtime is destroyed while still joinable and
    the process dies of SIGABRT after finishing its work, which makes the launcher report a failure.
    """
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    _close_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


@register("ddp")
class DDP(Backend):
    def __init__(self, precision: str = "fp32", offload: str = "none"):
        from accelerate import Accelerator

        super().__init__(precision, offload)
        self.acc = Accelerator(cpu=not torch.cuda.is_available())
        self.device, self.rank, self.world_size = self.acc.device, self.acc.process_index, self.acc.num_processes
        if self.precision == "auto":  # given the config's own value (a run settles it first, and says why)
            self.precision = resolve("auto", self.device, self.precisions).precision
        if self.world_size > 1:
            atexit.unregister(_close_process_group)  # once, however many runs this process makes
            atexit.register(_close_process_group)

    def train(self, model, *, lr, weight_decay, schedule=None, max_grad_norm=0.0) -> Trained:
        if self.precision == "bf16":  # weights, gradients and AdamW state all in bf16
            model = model.to(torch.bfloat16)
        model = self.place(model)
        trained = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters (and a value head) only
        optimizer, scheduler = adamw(trained, lr=lr, weight_decay=weight_decay, schedule=schedule)
        if scheduler is None:
            return Trained(*self.acc.prepare(model, optimizer), scale=self.loss_scale())
        return Trained(*self.acc.prepare(model, optimizer, scheduler), scale=self.loss_scale())

    def freeze(self, model):
        return self.place(model.eval().requires_grad_(False).to(self.device, self.compute_dtype))

    @contextlib.contextmanager
    def accumulating(self, trained, sync):
        with contextlib.ExitStack() as stack:
            if not sync:
                for t in trained:
                    stack.enter_context(self.acc.no_sync(t.module))
            yield

    def backward(self, loss, trained):
        self.acc.backward(self.scaled(loss * self.world_size, trained))

    def step(self, trained, max_grad_norm):
        # the global norm: DDP's gradients are already all-reduced
        return self.clip_and_step(trained, lambda: self.acc.clip_grad_norm_(trained.module.parameters(),
                                                                              max_grad_norm or math.inf))

    def reduce(self, tensor, op):
        if op in ("max", "min"):  # accelerate reduces by sum or mean only
            if self.world_size > 1:
                tensor = tensor.clone()
                torch.distributed.all_reduce(tensor, op=getattr(torch.distributed.ReduceOp, op.upper()))
            return tensor
        return self.acc.reduce(tensor, op)

    def barrier(self):
        self.acc.wait_for_everyone()

    def generation_model(self, trained):
        # DDP's wrapper off by hand: accelerate's `unwrap_model` imports DeepSpeed, where it is installed, to check
        # for its engine: half a second at the start of every run (AVX-512 with AMX, 2 cores)
        module = trained.module
        return module.module if isinstance(module, torch.nn.parallel.DistributedDataParallel) else module

    def save(self, trained, tokenizer, path: Path, merged: bool = False):
        if self.is_main:  # every process holds the same weights, whole: the first writes them as they are
            write(self.generation_model(trained), None, path, tokenizer, merged)
