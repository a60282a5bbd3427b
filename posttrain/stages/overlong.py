"""The overlong penalty stage (`rewards.overlong_buffer`): DAPO's soft overlong punishment added to each sample's
reward by its length (the formula is in `posttrain.rewards.overlong`). The rule rewards see text only, so it is added
here, after the judge, where the sampled token counts are known.

Metrics: `reward` (the mean reward with the penalty), `reward/overlong` (the mean penalty).
"""

from __future__ import annotations

from posttrain.core.errors import ConfigError
from posttrain.rewards.overlong import overlong_penalty
from posttrain.stages.base import Judged, Stage


class OverlongPenalty(Stage):
    key = "rewards.overlong_buffer"

    def __init__(self, buffer: int, weight: float, budget: int):
        self.buffer, self.weight, self.budget = buffer, weight, budget

    @staticmethod
    def check(cfg, plugin) -> None:
        r = cfg.rewards
        if r.overlong_buffer > cfg.rollout.max_new_tokens:
            raise ConfigError(f"rewards.overlong_buffer: {r.overlong_buffer} is more than the budget it is the end "
                              f"of (rollout.max_new_tokens={cfg.rollout.max_new_tokens})")
        if r.overlong_buffer and plugin.source != "online":
            raise ConfigError(f"rewards.overlong_buffer: the overlong punishment shapes the rewards of samples drawn "
                              f"as the run trains; {plugin.name} trains on no such samples")

    @staticmethod
    def on(cfg, needs) -> bool:
        return bool(cfg.rewards.overlong_buffer)

    @classmethod
    def build(cls, deps) -> OverlongPenalty:
        r = deps.rewards
        return cls(r.overlong_buffer, r.overlong_penalty, deps.sampling.max_new_tokens)

    def __call__(self, judged: Judged, more) -> Judged:
        batch = judged.batch
        penalty = self.weight * overlong_penalty(batch.mask.sum(-1).cpu(), batch.truncated.cpu(), self.budget,
                                                 self.buffer)  # [B]
        batch.reward = judged.outcome + penalty
        return judged.replace(metrics={**judged.metrics, "reward": float(batch.reward.mean()),
                                       "reward/overlong": float(penalty.mean())})
