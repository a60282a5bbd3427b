"""DeepSpeed ZeRO (Rajbhandari et al. 2020, arXiv:1910.02054): `zero2` shards gradients and AdamW state (with its
fp32 master weights) over the processes, `zero3` the weights too, frozen models included.

posttrain drives DeepSpeed's engine itself, configured from the run (`config`):

- The optimizer is torch's AdamW, handed to DeepSpeed, which wraps it in its ZeRO optimizer; the learning-rate
  schedule stays posttrain's. DeepSpeed's own AdamW would first compile a C++ op (a minute or more on CPU).
- Gradient accumulation is posttrain's: DeepSpeed's managed accumulation is off, so backward only adds up gradients
  and `step` reduces them (ZeRO-2) or has reduce-scattered them after each backward (ZeRO-3) before AdamW steps.
  The loss is already normalised over the whole step and DeepSpeed averages over processes, so `backward`
  multiplies it by the process count, as for DDP.
- Clipping is DeepSpeed's (`gradient_clipping`): with ZeRO the module's `.grad` is empty, the gradients live in
  DeepSpeed's partitions.
- Precision: fp32, or bf16-mixed as DeepSpeed's bf16 (bf16 weights and gradients, fp32 master weights and AdamW
  state in the optimizer). DeepSpeed always keeps that fp32 master copy, even of fp32 weights, so `bf16` (everything
  in bf16) is refused.
- Offload: `optimizer` keeps the fp32 master weights and AdamW state in CPU memory and steps there; `params` (ZeRO-3)
  also keeps the weights' shards there between uses.

On a CPU machine DeepSpeed picks its CPU accelerator and talks over gloo. Its communication layer would first
compile a shared-memory all-reduce (another C++ op, for CPU inference), which `_no_shm_compile` turns off: gloo
carries every collective instead.

Under ZeRO-3 every forward is collective, sampling included, as under FSDP2: the decode loop stops only when every
process's rows have stopped. Weights reach a rollout engine and the saved model one parameter at a time, gathered.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import warnings
from collections.abc import Iterator
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
from posttrain.core.errors import ConfigError
from posttrain.core.memory import tensor_bytes


def _no_shm_compile() -> None:
    """DeepSpeed's torch communication backend compiles a shared-memory op whenever it starts on the CPU accelerator;
    without it, gloo carries every collective."""
    import deepspeed.comm.torch  # noqa: F401  (the module; `import … as` would bind the torch package it shadows)

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None


STATE_TAG = "deepspeed"  # the folder DeepSpeed writes its checkpoint in


def _bytes(tensors) -> int:
    return tensor_bytes(t for t in tensors if t is not None)


class ZeRO(DDP):
    skips_nonfinite = False  # its engine steps before the norm is known here: a non-finite one stops the run
    fp32_master = True  # its ZeRO optimizer keeps one whatever the weights' dtype
    precisions = ("fp32", "bf16-mixed")  # fp16-mixed's loss scale is posttrain's, which DeepSpeed's engine skips

    def __init__(self, precision: str = "fp32", offload: str = "none"):
        super().__init__(precision, offload)
        import deepspeed

        # DeepSpeed calls torch collectives that torch 2.13 renamed, and torch warns at every call (hundreds per
        # step under ZeRO-3); nothing a user can act on
        warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
        if self.device.type == "cpu":
            _no_shm_compile()
        if self.world_size == 1:  # no launcher: DeepSpeed's engine asserts that one set the local rank
            os.environ.setdefault("LOCAL_RANK", "0")
        one_process_group(self.device)
        deepspeed.init_distributed(dist_backend="nccl" if self.device.type == "cuda" else "gloo")

    @classmethod
    def check(cls, train) -> None:
        super().check(train)
        if train.precision == "bf16":
            raise ConfigError(f"train.precision: {cls.name} keeps fp32 master weights; use bf16-mixed (DeepSpeed's "
                              "bf16: bf16 weights and gradients, fp32 master and AdamW state) or fp32")
        if train.precision == "fp16-mixed":
            raise ConfigError(f"train.precision: {cls.name} runs fp32 or bf16-mixed; fp16-mixed (with its loss scale) "
                              "runs under ddp or fsdp2")
        if importlib.util.find_spec("deepspeed") is None:
            raise ConfigError(f"train.backend: {cls.name} needs DeepSpeed: pip install 'posttrain[deepspeed]'")

    def config(self, model: torch.nn.Module, *, trained: bool, max_grad_norm: float = 0.0) -> dict:
        """The DeepSpeed config of one model. Buckets are sized by the model, as transformers' integration does
        ("auto"), not DeepSpeed's defaults (5e8 elements: a 2 GB buffer whatever the model)."""
        hidden = getattr(getattr(model, "config", None), "hidden_size", 1024)
        zero = {"stage": self.zero_stage, "reduce_bucket_size": hidden * hidden}
        if self.zero_stage == 3:
            # weights of fewer elements than this stay whole on every process (norms, biases)
            zero.update(stage3_param_persistence_threshold=10 * hidden,
                        stage3_prefetch_bucket_size=int(0.9 * hidden * hidden))
        pin = self.device.type == "cuda"
        if trained and self.offload in ("optimizer", "params"):
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": pin}
        if self.offload == "params":
            zero["offload_param"] = {"device": "cpu", "pin_memory": pin}
        return {
            "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,  # bookkeeping only: see above
            "managed_gradient_accumulation": False, "gradient_clipping": max_grad_norm,
            "zero_optimization": zero, "bf16": {"enabled": self.precision == "bf16-mixed"},
            "zero_allow_untested_optimizer": True,  # torch's AdamW
            "zero_force_ds_cpu_optimizer": False,  # and with offload too, rather than compiling DeepSpeed's CPU Adam
            "steps_per_print": 2**62, "wall_clock_breakdown": False,
        }

    def train(self, model, *, lr, weight_decay, schedule=None, max_grad_norm=0.0) -> Trained:
        import deepspeed

        model = self.place(model)
        trained = [p for p in model.parameters() if p.requires_grad]
        optimizer, scheduler = adamw(trained, lr=lr, weight_decay=weight_decay, schedule=schedule)
        engine, zero_optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, model_parameters=trained,
            config=self.config(model, trained=True, max_grad_norm=max_grad_norm))
        return Trained(engine, zero_optimizer, scheduler)  # the schedule acts on torch's AdamW inside

    def accumulating(self, trained, sync):
        return contextlib.nullcontext()  # gradients add up until `step`, which ends the accumulation

    def backward(self, loss, trained):
        trained.module.backward(loss * self.world_size, scale_wrt_gas=False)

    def step(self, trained, max_grad_norm):
        engine = trained.module
        engine.step()  # clips (its config's gradient_clipping), steps AdamW, clears the gradients
        if trained.scheduler is not None:
            trained.scheduler.step()
        norm = engine.get_global_grad_norm()  # before clipping, as clip_grad_norm_ returns it
        return torch.as_tensor(float(norm)) if max_grad_norm > 0 and norm is not None else None

    def save_state(self, trained, path: Path) -> None:
        """DeepSpeed's own checkpoint: each process writes its partition of the fp32 master weights and AdamW's
        state (`zero_pp_rank_<rank>_…_optim_states.pt`), never gathered, and the trained module's weights; the first
        writes the schedule's state. `path` must be on a file system every process sees."""
        path.mkdir(parents=True, exist_ok=True)
        trained.module.save_checkpoint(str(path), tag=STATE_TAG, save_latest=False, exclude_frozen_parameters=True)
        save_schedule(self, trained, path)
        self.barrier()

    def load_state(self, trained, path: Path) -> None:
        from posttrain.models import lora

        # the fp32 master partitions are loaded and copied into the weights; a LoRA model's frozen base is not in
        # the checkpoint (the start model has it), so only then may the module's weights be partial
        loaded, _ = trained.module.load_checkpoint(str(path), tag=STATE_TAG, load_optimizer_states=True,
                                                   load_lr_scheduler_states=False,
                                                   load_module_strict=not lora.is_adapted(self.generation_model(trained)))
        if loaded is None:
            raise ValueError(f"no DeepSpeed checkpoint in {path / STATE_TAG}")
        load_schedule(trained, path)

    def generation_model(self, trained):
        return trained.module.module  # the model inside DeepSpeed's engine (its hooks gather ZeRO-3 shards)

    def optimizer_bytes(self, trained) -> int:
        """AdamW's state and the fp32 master partition DeepSpeed keeps beside the weights."""
        zero = trained.optimizer
        master = getattr(zero, "single_partition_of_fp32_groups", None) or getattr(zero,
                                                                                "fp32_partitioned_groups_flat", [])
        state = (v for s in zero.optimizer.state.values() for v in s.values() if torch.is_tensor(v))
        return _bytes(state) + _bytes(master)


@register("zero2")
class ZeRO2(ZeRO):
    zero_stage = 2
    offloads = ("none", "optimizer")

    def freeze(self, model):
        return super().freeze(model)  # ZeRO-2 shards no weights: a frozen model is whole on every process

    def gradient_bytes(self, trained) -> int:
        """Gradients summed so far of the weights in this process's partition, each whole (a weight cut by the
        partition's edge is held whole by both sides); with the optimizer offloaded, the partition's gradient in
        CPU memory and the pieces summed into it."""
        zero = trained.optimizer
        if zero.cpu_offload:
            return (_bytes(g.grad for g in zero.single_partition_of_fp32_groups)
                    + _bytes(getattr(zero, "accumulated_grads_in_cpu", {}).values()))
        return _bytes(t for v in zero.all_grad_tensors.values() if v is not None for t in v)


@register("zero3")
class ZeRO3(ZeRO):
    zero_stage = 3
    sharded = True
    offloads = ("none", "optimizer", "params")

    def freeze(self, model):
        """Partitioned for inference: DeepSpeed's engine without an optimizer."""
        import deepspeed

        model = self.place(model.eval().requires_grad_(False).to(self.compute_dtype))
        engine, *_ = deepspeed.initialize(model=model, config=self.config(model, trained=False))
        return engine.module

    def whole(self, param):
        return gathered(param)

    def weight_bytes(self, model) -> int:
        """This process's shards (a whole weight for those kept whole)."""
        return _bytes(getattr(p, "ds_tensor", p) for p in model.parameters())

    def gradient_bytes(self, trained) -> int:
        return _bytes([trained.optimizer.grad_partitions_flat_buffer])

    def weights(self, trained) -> Iterator[tuple[str, torch.Tensor]]:
        trained.module.empty_partition_cache()  # weights still being fetched for the forward it predicted come back
        yield from super().weights(trained)

    def save(self, trained, tokenizer, path: Path, merged: bool = False):
        trained.module.empty_partition_cache()
        Backend.save(self, trained, tokenizer, path, merged)  # gathered, not DDP's (whole weights on process 0)


def gathered(param: torch.Tensor) -> torch.Tensor:
    """A copy of the whole of a ZeRO-3 weight (a collective call), the weight itself when it is not partitioned."""
    if not hasattr(param, "ds_id"):
        return param
    import deepspeed

    with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
        return param.data.clone()
