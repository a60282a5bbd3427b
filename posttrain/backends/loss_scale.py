"""The dynamic loss scale of `train.precision=fp16-mixed`: fp16's range, kept for the gradients.

fp16 holds magnitudes from 6e-8 to 65504 only, and small gradients underflow to zero in an fp16 backward. So the loss
is multiplied by a scale S before backward (Micikevicius et al. 2018, "Mixed Precision Training", arXiv:1710.03740)
and the fp32 master gradients divided by S before clipping and the optimizer step. S starts high; a step whose
gradient norm is not finite is skipped (weights, AdamW state and schedule unchanged, as for any non-finite step) and
halves S; after `growth_interval` finite steps in a row S doubles. These are the defaults of torch's GradScaler.

The skip is decided on the global gradient norm, which every backend already computes across processes, so every
process skips the same steps and keeps the same S, sharded or not. (torch's GradScaler decides on each process's own
shard, which a sharded backend would have to reconcile.) DeepSpeed (zero2, zero3) scales inside its engine instead.
"""

from __future__ import annotations

import torch


class LossScale:
    """S, and the bookkeeping that moves it.

    Args:
        init: the first S (2^16).
        growth_interval: finite steps in a row after which S doubles.
    """

    def __init__(self, init: float = 2.0**16, growth_interval: int = 2000):
        self.scale, self.growth_interval, self.good_steps = float(init), growth_interval, 0

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    def unscale_(self, params) -> None:
        """Divides every gradient of `params` by S, in place (before the norm is taken)."""
        with torch.no_grad():
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(1.0 / self.scale)

    def update(self, finite: bool) -> None:
        """After a step: halve S on a non-finite gradient norm (the step was skipped), double it after
        `growth_interval` finite ones."""
        if not finite:
            self.scale, self.good_steps = self.scale / 2, 0
            return
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale, self.good_steps = self.scale * 2, 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.good_steps = float(state["scale"]), int(state["good_steps"])
