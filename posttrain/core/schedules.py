"""Schedules over a run: the learning rate's, the KL weight β's and the sampling temperature's, and the controllers that
hold the last two as the run goes (`KLWeight`, `SamplingTemperature`).

The learning rate: the factor on `train.lr` at each optimizer step (what torch's LambdaLR multiplies by).

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

import dataclasses
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


BETA_SCHEDULES = ("constant", "piecewise", "cosine")


def beta_at(step: int, *, schedule: str, values: list[float], total: int, beta: float) -> float:
    """β at step `step` (1-based) of `total`: the KL weight of a method that penalises KL to the reference.

    - ``constant``: `beta` (the algorithm's own) throughout.
    - ``piecewise``: `values` over equal stages of the run, e.g. [0.05, 0.02, 0.01] over 300 steps is 0.05 for steps
      1-100, 0.02 for 101-200 and 0.01 after: a weak pull early would let the policy drift, a strong one late would
      hold back what it has learnt (the seed's schedule).
    - ``cosine``: from values[0] at step 1 to values[1] at the last step, v1 + (v0 − v1)·½(1 + cos(π(s − 1)/(T − 1))).
    """
    if schedule == "constant":
        return beta
    if schedule == "piecewise":
        return values[min((step - 1) * len(values) // max(total, 1), len(values) - 1)]
    if schedule == "cosine":
        start, end = values
        return end + (start - end) * 0.5 * (1.0 + math.cos(math.pi * (step - 1) / max(total - 1, 1)))
    raise ValueError(f"unknown β schedule {schedule!r}")


# η: a step's entropy 10% off target moves τ by a factor e^{±0.01}. Small, because a peaked policy's entropy is very
# sensitive to τ (d log H / d log τ was about 8 on the embedded task): η = 0.5 made τ swing 0.73–1.24 in 8 steps.
TEMPERATURE_GAIN = 0.1


def adapted_temperature(temperature: float, entropy: float, target: float, low: float, high: float) -> float:
    """The next step's sampling temperature from this step's (`rollout.adaptive_temperature`).

        log τ_{k+1} = clip(log τ_k + η (H* − H_k) / H*, log τ_min, log τ_max),   η = TEMPERATURE_GAIN,

    with H_k the mean over this step's sampled tokens of −log π_τ(o_t) (the rollout engine's own log-probs: a
    Monte-Carlo estimate of the per-token entropy of the distribution sampled from) and H* the target: the first
    step's H unless `rollout.target_entropy` is given. The entropy of softmax(z/τ) grows with τ, so the loop settles
    where the samples have the target entropy: as training sharpens the policy, τ rises to keep its exploration,
    within [τ_min, τ_max]. The same rule adjusts SAC's entropy temperature toward a target (Haarnoja et al. 2018,
    arXiv:1812.05905); here it is the sampling temperature, against the entropy collapse of RL on reasoning
    (Cui et al. 2025, arXiv:2505.22617).

    Why not the seed's τ = clip(std(Â), 0.5, 2.0): with group-normalised advantages std(Â) over a batch is about
    √(share of groups whose rewards differ), so that rule lowers τ exactly as groups collapse to equal rewards, when
    more exploration is wanted. Its bounds are kept as the defaults of [τ_min, τ_max].
    """
    if not math.isfinite(entropy) or not target > 0:  # nothing measured, or no entropy to aim at: hold
        return min(max(temperature, low), high)
    step = TEMPERATURE_GAIN * (target - entropy) / target
    return min(max(temperature * math.exp(step), low), high)


class KLWeight:
    """The controller of β under `train.beta_schedule`: the loop calls `at(step)` before each step, and the step
    trains with `apply(cfg.algorithm)`, a copy of the plugin's config with this step's β (the validated config stays
    as it was). Saved in checkpoints, like every controller."""

    def __init__(self, beta: float, *, schedule: str, values: list[float], total: int):
        self.schedule, self.values, self.total = schedule, list(values), total
        self.beta = beta  # the algorithm's own until the first step

    def at(self, step: int) -> None:
        """Sets β for step `step` (1-based)."""
        self.beta = beta_at(step, schedule=self.schedule, values=self.values, total=self.total, beta=self.beta)

    def apply(self, algorithm):
        """The plugin's config (a dataclass with a `beta` field) with this step's β."""
        return dataclasses.replace(algorithm, beta=self.beta)

    def state_dict(self) -> dict:
        return {"beta": self.beta}

    def load_state_dict(self, state: dict) -> None:
        self.beta = state["beta"]


class SamplingTemperature:
    """The controller of the online source's sampling temperature τ: fixed at `rollout.temperature`, or moved after
    each step by the adaptive-temperature stage (`observe`, with `adapted_temperature`'s rule) towards the entropy
    target. The sampler reads `value` when it draws; a batch records the τ it was drawn at."""

    def __init__(self, temperature: float, *, target: float | None = None, low: float = 0.0,
                 high: float = math.inf):
        self.value, self.target, self.low, self.high = temperature, target, low, high

    def observe(self, entropy: float) -> None:
        """Sets the next step's τ from this step's mean per-token entropy; with no target given, the first step's
        entropy becomes it."""
        if self.target is None:
            self.target = entropy
        self.value = adapted_temperature(self.value, entropy, self.target, self.low, self.high)

    def state_dict(self) -> dict:
        return {"value": self.value, "target": self.target}

    def load_state_dict(self, state: dict) -> None:
        self.value, self.target = state["value"], state["target"]
