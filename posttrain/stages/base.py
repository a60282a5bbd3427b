"""The record the online source's stages pass on (`Judged`), the stage interface (`Stage`) and the runner
(`Pipeline`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from posttrain.core.batch import Batch


@dataclass
class Judged:
    """Rollouts and their judgement, as one stage hands them to the next.

    `batch` carries the token ids exactly as sampled, the sampler's log-probs (`rollout_logp`), the policy version
    that sampled each row (`version`), the temperature they were drawn at, and `reward`: the reward trained on, which
    a stage may shape. `outcome` keeps the judge's reward as it was, before any stage shaped it.
    """

    batch: Batch
    rows: list[dict]  # [B] each sample's data row
    texts: list[str]  # [B] each sample's completion, decoded once
    outcome: torch.Tensor  # [B] the judge's reward alone, on the CPU
    metrics: dict[str, float] = field(default_factory=dict)

    def replace(self, **changes) -> Judged:
        return dataclasses.replace(self, **changes)


class Stage:
    """One stage of the online source's pipeline: judged rollouts in, judged rollouts out, with its metrics added.

    A stage is switched on by its own config key: `build` returns None when the config leaves it off, and `check`
    refuses, in one line naming the key, a config where the stage cannot take effect or clashes with another feature
    (`posttrain.config.load` calls it for every stage, on or off, before any work).

    `__call__` gets `more`, which draws a fresh round of rollouts and passes it through the stages before this one:
    a stage that filters (dynamic sampling) asks it for more rounds.
    """

    key: str = ""  # the config key that switches the stage on

    @staticmethod
    def check(cfg: Any, plugin: Any) -> None:
        """Raises ConfigError when the validated config asks for this stage where it cannot work."""

    @staticmethod
    def on(cfg: Any, needs: frozenset[str]) -> bool:
        """Whether the validated config switches the stage on (with what the plugin needs): the plan's decision
        (posttrain.train.plan), which the online source follows."""
        raise NotImplementedError

    @classmethod
    def build(cls, deps: Any) -> Stage:
        """The stage for a run the plan switches it on for, from the online source's dependencies
        (`posttrain.sources.Deps`)."""
        raise NotImplementedError

    def __call__(self, judged: Judged, more: Callable[[], Judged]) -> Judged:
        raise NotImplementedError


class Pipeline:
    """Draws a round (`draw`: prompts sampled and judged) and passes it through `stages` in order."""

    def __init__(self, draw: Callable[[], Judged], stages: list[Stage]):
        self.draw, self.stages = draw, stages

    def __call__(self) -> Judged:
        return self.through(len(self.stages))

    def through(self, k: int) -> Judged:
        """A fresh round through the first `k` stages; stage i's `more` is `through(i)`."""
        judged = self.draw()
        for i, stage in enumerate(self.stages[:k]):
            judged = stage(judged, lambda i=i: self.through(i))
        return judged
