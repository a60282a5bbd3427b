"""Backends: how trained and frozen models are placed, wrapped, stepped and saved across processes.

Everything in a training step that depends on how training is distributed goes through this one seam, so each
backend (`ddp`, `fsdp2`, `zero2`, `zero3`; docs/distributed.md) is an implementation, not a branch in the loop:

- `train` wraps a model with its optimizer and learning-rate schedule and returns a `Trained` handle;
  `freeze` places an inference-only model (reference, reward model), sharded where weights are;
- `accumulating` skips gradient sync on all but the last micro-batch where the backend can; `backward`
  back-propagates a loss that is already normalised over the whole step (the backend undoes its own averaging);
- `step` clips, steps the optimizer and the schedule, and clears the gradients;
- `reduce`, `barrier` and `agree` work across processes (`sharded` backends make every forward collective);
- `whole`, `generation_model` and `weights` give the rollout engine the policy's weights, one whole tensor at a
  time; `save` writes one ordinary Hugging Face directory;
- `save_state` and `load_state` write and read what continuing to train needs (sharded where the backend shards);
- `weight_bytes`, `gradient_bytes` and `optimizer_bytes` count what this process holds, for summary.json.

`train.backend` picks one by name from `BACKENDS`; `check` refuses settings a backend cannot run when the config loads.
"""

from posttrain.backends.base import BACKENDS, Backend, Trained, get, register

__all__ = ["BACKENDS", "Backend", "Trained", "get", "register"]

from posttrain.backends import ddp, fsdp, zero  # noqa: E402,F401  (the built-in backends register themselves)
