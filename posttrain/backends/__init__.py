"""Backends: how trained and frozen models are placed, wrapped, stepped and saved across processes.

Everything in a training step that depends on how training is distributed goes through this one seam, so a new
backend (FSDP2, DeepSpeed ZeRO) is a new implementation, not a branch in the loop:

- `train` wraps a model with its optimizer and learning-rate schedule and returns a `Trained` handle;
  `freeze` places an inference-only model (reference);
- `accumulating` skips gradient sync on all but the last micro-batch; `backward` back-propagates a loss that is
  already normalised over the whole step (the backend undoes its own gradient averaging);
- `step` clips, steps the optimizer and the schedule, and clears the gradients;
- `reduce` and `barrier` work across processes;
- `generation_model` and `weights` give the rollout engine the policy's full weights; `save` writes one ordinary
  Hugging Face directory.

`train.backend` picks one by name from `BACKENDS`.
"""

from posttrain.backends.base import BACKENDS, Backend, Trained, get, register

__all__ = ["BACKENDS", "Backend", "Trained", "get", "register"]

from posttrain.backends import ddp, fsdp, zero  # noqa: E402,F401  (the built-in backends register themselves)
