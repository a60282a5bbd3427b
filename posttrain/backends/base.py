"""The backend interface (`Backend`, `Trained`) and the registry of backends; `posttrain.backends` re-exports them."""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from posttrain.backends.loss_scale import LossScale
from posttrain.core.memory import optimizer_bytes, tensor_bytes
from posttrain.core.precision import MIXED
from posttrain.core.registry import Registry
from posttrain.models import lora


@dataclass
class Trained:
    """A model being trained: the wrapped module that forward and backward go through, its optimizer and schedule."""

    module: torch.nn.Module
    optimizer: Any
    scheduler: Any = None
    scale: LossScale | None = None
    """The dynamic loss scale under fp16-mixed (backends/loss_scale.py); None otherwise."""


class Backend:
    """The interface; `ddp` (posttrain.backends.ddp) is the reference implementation.

    Args:
        precision: `train.precision` as resolved for the device (posttrain.core.precision): fp32, bf16-mixed (bf16
            compute, fp32 weights and optimizer state), fp16-mixed (the same in fp16, with a loss scale) or bf16.
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

    zero_stage: int = 0
    """The ZeRO stage (Rajbhandari et al. 2020, arXiv:1910.02054) whose sharding this backend does: 0 every process
    holds everything, 1 the optimizer state is sharded, 2 the gradients too, 3 the weights too. `posttrain estimate
    backend=NAME` sizes memory by it."""

    fp32_master: bool = False
    """True when the optimizer keeps an fp32 master copy of the trained weights even when they are fp32 themselves
    (DeepSpeed's ZeRO optimizer does); `posttrain estimate` counts its 4 bytes a trained weight."""

    precisions: tuple[str, ...] = ("fp32", "bf16-mixed", "fp16-mixed", "bf16")
    """The `train.precision` values this backend runs (`auto` picks among them)."""

    def __init__(self, precision: str = "fp32", offload: str = "none"):
        self.precision, self.offload = precision, offload

    @classmethod
    def check(cls, train) -> None:
        """Raises ConfigError when this backend cannot run the `train.*` settings, or cannot run here; cheap."""
        if train.offload not in cls.offloads:
            from posttrain.core.errors import ConfigError

            raise ConfigError(f"train.offload: {cls.name} supports {' or '.join(cls.offloads)}, not {train.offload!r}")

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype of the forward's matmuls, and of models only scored."""
        return {"fp32": torch.float32, "fp16-mixed": torch.float16}.get(self.precision, torch.bfloat16)

    def autocast(self) -> contextlib.AbstractContextManager:
        """Context for forward passes: bf16 or fp16 compute under bf16-mixed or fp16-mixed; nothing to do otherwise
        (the weights' dtype decides). Backward runs outside it."""
        if self.precision in MIXED:
            return torch.autocast(self.device.type, dtype=MIXED[self.precision])
        return contextlib.nullcontext()

    def loss_scale(self) -> LossScale | None:
        """A new loss scale for a model to train, under fp16-mixed; None otherwise."""
        return LossScale() if self.precision == "fp16-mixed" else None

    def scaled(self, loss: torch.Tensor, trained: Trained) -> torch.Tensor:
        """`loss` times the loss scale of `trained` (itself when there is none), for backward."""
        return trained.scale.scaled(loss) if trained.scale is not None else loss

    def clip_and_step(self, trained: Trained, clip: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The optimizer step every backend but DeepSpeed's takes: gradients unscaled (fp16-mixed), `clip()` returns
        the global norm before clipping; a finite one steps the optimizer and schedule; the gradients are cleared."""
        if trained.scale is not None:
            trained.scale.unscale_(trained.module.parameters())
        norm = clip()
        finite = bool(torch.isfinite(norm))
        if finite:
            trained.optimizer.step()
            if trained.scheduler is not None:
                trained.scheduler.step()
        if trained.scale is not None:
            trained.scale.update(finite)
        trained.optimizer.zero_grad(set_to_none=True)
        return norm

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
              schedule: Callable[[int], float] | None = None, max_grad_norm: float = 0.0) -> Trained:
        """Wraps `model` for training with AdamW; `schedule` gives the factor on `lr` at each optimizer step
        (posttrain.core.schedules; None: a constant rate, no scheduler). `max_grad_norm` is the clipping `step` will
        be asked for (a backend that clips inside its engine needs it up front)."""
        raise NotImplementedError

    def freeze(self, model: torch.nn.Module) -> torch.nn.Module:
        """Places a model that is only scored (no gradients)."""
        raise NotImplementedError

    def accumulating(self, trained: list[Trained], sync: bool) -> contextlib.AbstractContextManager:
        """Context for one micro-batch's backward; gradients are synchronised across processes only when `sync`."""
        raise NotImplementedError

    def backward(self, loss: torch.Tensor, trained: Trained) -> None:
        """Back-propagates `loss` of the model being trained by `trained`, whose denominators already span every
        process."""
        raise NotImplementedError

    def step(self, trained: Trained, max_grad_norm: float) -> torch.Tensor | None:
        """Clips (when `max_grad_norm` > 0), steps the optimizer and schedule, clears gradients; returns the global
        gradient norm before clipping. A non-finite norm skips the optimizer and schedule steps (the gradients are
        cleared all the same), on every process alike, since the norm is global; the engine counts it."""
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

    def whole(self, param: torch.Tensor) -> torch.Tensor:
        """The whole tensor of a weight (or gradient) of a model this backend placed: gathered where it is sharded,
        in a call every process makes; the tensor itself otherwise."""
        return param

    def weights(self, trained: Trained) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, whole tensor) of every weight, one at a time, as the plain model names them (a LoRA adapter merged
        in), for a rollout engine that holds its own copy. Every process iterates it, in the same order."""
        model = self.generation_model(trained)
        if lora.is_adapted(model):
            yield from lora.merged_weights(model, full=self.whole)
            return
        for name, param in model.named_parameters():
            yield name, self.whole(param)

    # -- bytes this process holds, by role (summary.json's memory.roles_bytes) ---------------------------------
    def weight_bytes(self, model: torch.nn.Module) -> int:
        """Bytes of the weights of `model` (trained or frozen) that this process holds between forwards."""
        return tensor_bytes(model.parameters())

    def gradient_bytes(self, trained: Trained) -> int:
        """Bytes of the gradients this process holds after backward, before the optimizer step."""
        return tensor_bytes(p.grad for p in trained.module.parameters())

    def optimizer_bytes(self, trained: Trained) -> int:
        """Bytes of optimizer state this process holds (AdamW's moments and step counters, any master copy)."""
        return optimizer_bytes(trained.optimizer)

    skips_nonfinite: bool = True
    """Whether `step` skips the optimizer step on a non-finite gradient norm (DeepSpeed steps inside its engine)."""

    # -- training state, for checkpoints a run resumes from ------------------------------------------------------
    def save_state(self, trained: Trained, path: Path) -> None:
        """Writes under the directory `path` what continuing to train `trained` needs, bit for bit: its trained
        parameters (every one whose requires_grad is set; the frozen base of a LoRA model is the start's), exactly as
        trained (fp32 master weights, whatever the saved model's dtype), AdamW's state and the schedule's. Every
        process calls it.

        Here every process holds the same whole state, and the first writes it as one file.
        """
        model = self.generation_model(trained)
        if self.is_main:
            path.mkdir(parents=True, exist_ok=True)
            params = {n: p.detach().cpu().clone() for n, p in model.named_parameters() if p.requires_grad}
            torch.save({"parameters": params, "optimizer": _to_cpu(trained.optimizer.state_dict()),
                        "scheduler": scheduler_state(trained), "loss_scale": loss_scale_state(trained)},
                       path / "state.pt")
        self.barrier()

    def load_state(self, trained: Trained, path: Path) -> None:
        """Puts back what `save_state` wrote under `path`, bit for bit (every process calls it).

        Raises:
            ValueError: the state names other parameters than the model trains (another model or LoRA setting).
        """
        state = torch.load(path / "state.pt", map_location="cpu", weights_only=False)
        model = self.generation_model(trained)
        params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        if set(params) != set(state["parameters"]):
            missing = sorted(set(params) ^ set(state["parameters"]))[:3]
            raise ValueError(f"the checkpoint trains other parameters than this run ({', '.join(missing)}, ...)")
        with torch.no_grad():
            for name, param in params.items():
                param.copy_(state["parameters"][name])
        trained.optimizer.load_state_dict(state["optimizer"])
        load_scheduler_state(trained, state["scheduler"])
        load_loss_scale_state(trained, state.get("loss_scale"))

    def save(self, trained: Trained, tokenizer, path: Path, merged: bool = False) -> None:
        """Writes the model and tokenizer as one Hugging Face directory (every process calls it). An adapted model
        writes its adapter, or with `merged` the base with the adapter merged in.

        Here the weights are gathered one at a time, every process taking part, and the first process keeps them in
        CPU memory and writes them, as the unsharded model would save itself.
        """
        model = self.generation_model(trained)
        if lora.is_adapted(model) and merged:
            pairs = lora.merged_weights(model, full=self.whole)
        else:
            pairs = ((name, self.whole(param)) for name, param in model.named_parameters())
        # every process walks all the pairs (each gather is collective); only the first keeps them
        state = {name: tensor.detach().cpu() for name, tensor in pairs if self.is_main}
        if self.is_main:
            write(model, state, path, tokenizer, merged)
        self.barrier()


def adamw(params: list[torch.nn.Parameter], *, lr: float, weight_decay: float,
          schedule: Callable[[int], float] | None) -> tuple[torch.optim.Optimizer, Any]:
    """AdamW over `params` and its learning-rate schedule (None: none, a constant rate)."""
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=True)
    if schedule is None:
        return optimizer, None
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


def scheduler_state(trained: Trained) -> dict | None:
    return trained.scheduler.state_dict() if trained.scheduler is not None else None


def load_scheduler_state(trained: Trained, state: dict | None) -> None:
    if trained.scheduler is not None and state is not None:
        trained.scheduler.load_state_dict(state)


def loss_scale_state(trained: Trained) -> dict | None:
    return trained.scale.state_dict() if trained.scale is not None else None


def load_loss_scale_state(trained: Trained, state: dict | None) -> None:
    if trained.scale is not None and state is not None:
        trained.scale.load_state_dict(state)


def save_schedule(backend: Backend, trained: Trained, path: Path) -> None:
    """The schedule's state and the loss scale beside a sharded backend's own files (`path`/scheduler.pt,
    loss_scale.pt), from the first process: the same on every process."""
    if backend.is_main:
        torch.save(scheduler_state(trained), path / "scheduler.pt")
        if trained.scale is not None:
            torch.save(loss_scale_state(trained), path / "loss_scale.pt")


def load_schedule(trained: Trained, path: Path) -> None:
    load_scheduler_state(trained, torch.load(path / "scheduler.pt", weights_only=True))
    if trained.scale is not None:
        load_loss_scale_state(trained, torch.load(path / "loss_scale.pt", weights_only=True))


def one_process_group(device: torch.device) -> None:
    """A process group of one when no launcher started several, for backends whose tensors need a group."""
    dist = torch.distributed
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                                world_size=1)


def write(model: torch.nn.Module, state: dict[str, torch.Tensor] | None, path: Path, tokenizer, merged: bool) -> None:
    """Writes the model as it would save itself, from `state` when a backend gathered it (None: the weights it
    holds): the model, or when adapted its adapter (`state` names every weight of the peft model) or with `merged`
    the base with the adapter merged in (`state` is `merged_weights`); then the tokenizer."""
    if not lora.is_adapted(model):
        save_plain(model, path, state)
    elif merged:
        lora.save_merged(model, path, state)
    else:
        lora.save_adapter(model, path, state)
    tokenizer.save_pretrained(path)
    honour_umask(path)


def honour_umask(path: Path) -> None:
    """Gives the weights the mode of every other file written (0666 less the umask). safetensors writes each file
    under a temporary name created with mode 0600 and renames it, which leaves the weights readable by their owner
    alone, unlike the config.json beside them."""
    umask = os.umask(0)
    os.umask(umask)
    for file in Path(path).glob("*.safetensors"):
        file.chmod(0o666 & ~umask)


def save_plain(model: torch.nn.Module, path: Path, state: dict[str, torch.Tensor] | None) -> None:
    """`model.save_pretrained` with the gathered `state` (None: its own weights), recording the model's own class,
    not FSDP's subclass."""
    sharded_class = type(model)
    model.__class__ = plain_class(model)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*shared tensors.*")
            model.save_pretrained(path, state_dict=state, safe_serialization=True)
    finally:
        model.__class__ = sharded_class


def plain_class(model: torch.nn.Module) -> type:
    """The model's own class: `fully_shard` swaps it for a subclass named FSDP<class>."""
    from torch.distributed.fsdp import FSDPModule

    cls = type(model)
    return next(c for c in cls.__mro__[1:] if not issubclass(c, FSDPModule)) if isinstance(model, FSDPModule) else cls


BACKENDS = Registry("backend", "train.backend")  # name -> Backend subclass


register, get = BACKENDS.register, BACKENDS.find


def _to_cpu(value):
    """`value` (a state dict: nested dicts, lists and tensors) with every tensor copied to the CPU."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value
