"""The online source's pipeline: each step's rollouts are sampled, judged, then passed through an explicit, ordered
list of stages, each switched on by its own key and kept in its own file.

    sample -> judge -> pass rates -> overlong penalty -> dynamic sampling -> elite replay -> step rewards
                       -> adaptive temperature

The order is part of the method: the stages before dynamic sampling shape or record every round it draws (pass rates
learn from every sample, the penalty is added to every reward); dynamic sampling keeps groups by their own samples'
rewards, before an elite can be replayed into them; step rewards are scored on the samples trained on only; the
temperature adapts to what was drawn. Each stage's refusals (a key that cannot take effect, or clashes with another)
live in its own `check`, which `posttrain.config.load` runs before any work. The package sits below `config` in the
layers so that it can.
"""

from __future__ import annotations

from posttrain.stages.base import Judged, Pipeline, Stage
from posttrain.stages.dynamic_sampling import DynamicSampling
from posttrain.stages.elite import ElitePool, EliteReplay
from posttrain.stages.overlong import OverlongPenalty
from posttrain.stages.pass_rates import PassRateUpdates
from posttrain.stages.step_rewards import StepRewards
from posttrain.stages.temperature import AdaptiveTemperature

STAGES: list[type[Stage]] = [PassRateUpdates, OverlongPenalty, DynamicSampling, EliteReplay, StepRewards,
                             AdaptiveTemperature]

__all__ = ["STAGES", "ElitePool", "Judged", "Pipeline", "Stage", "build", "check"]


def check(cfg, plugin) -> None:
    """Every stage's refusals for the validated config (on or off: a key set for a method it cannot serve is one)."""
    for stage in STAGES:
        stage.check(cfg, plugin)


def build(deps) -> list[Stage]:
    """The stages the run's plan switches on (`deps.stages`, their keys), in order."""
    return [stage.build(deps) for stage in STAGES if stage.key in deps.stages]
