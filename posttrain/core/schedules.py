"""Learning-rate schedules: the factor on `train.lr` at each optimizer step (what torch's LambdaLR multiplies by).

Every schedule starts with `train.warmup_steps` of linear warm-up, (s + 1)/(w + 1) at step s, then over the
remaining T − w optimizer steps, with progress p = (s − w)/(T − w) in [0, 1) and the floor m = train.min_lr/train.lr:

- ``constant``: 1.
- ``cosine``: m + (1 − m)·½(1 + cos πp), from the full rate down to the floor (Loshchilov & Hutter 2017,
  arXiv:1608.03983, one cycle).
- ``cosine_restarts``: the same curve over each of `train.lr_cycles` equal cycles, p replaced by the progress within
  the cycle, so the rate jumps back to its peak at each restart (SGDR's warm restarts, arXiv:1608.03983): 4 cycles
  are 3 warm restarts.
"""

from __future__ import annotations

import math

SCHEDULES = ("constant", "cosine", "cosine_restarts")


def lr_factor(step: int, *, schedule: str, warmup: int, total: int, cycles: int = 1, floor: float = 0.0) -> float:
    """The factor on the peak rate at optimizer step `step` (0-based) of `total`.

    Args:
        schedule: one of SCHEDULES.
        warmup: linear warm-up steps.
        total: optimizer steps of the whole run.
        cycles: cosine cycles after the warm-up (``cosine_restarts``).
        floor: the factor a cosine decays to (min_lr / lr).
    """
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if schedule == "constant":
        return 1.0
    progress = (step - warmup) / max(total - warmup, 1)  # [0, 1)
    if schedule == "cosine_restarts":
        progress = progress * cycles % 1.0
    elif schedule != "cosine":
        raise ValueError(f"unknown schedule {schedule!r}")
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
