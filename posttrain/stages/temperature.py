"""The adaptive temperature stage (`rollout.adaptive_temperature`): after the step's samples are drawn, their
entropy moves the next step's sampling temperature towards a target (the rule is
`posttrain.core.schedules.adapted_temperature`; the temperature is a `SamplingTemperature` controller the run owns).

The entropy is the mean over the step's freshly sampled tokens, on every process, of −log π_τ(o_t): the rollout
engine's own log-probs (`rollout_logp`). Rows replayed from an elite pool are left out: their log-probs are an older
policy's.

Metrics: `temperature` (the step's τ, the one its samples were drawn at), `entropy`.
"""

from __future__ import annotations

import torch

from posttrain.core.errors import ConfigError
from posttrain.stages.base import Judged, Stage
from posttrain.stages.elite import fresh_mask


class AdaptiveTemperature(Stage):
    key = "rollout.adaptive_temperature"

    def __init__(self, temperature, reduce):
        self.temperature, self.reduce = temperature, reduce  # SamplingTemperature; (tensor, op) -> over processes

    @staticmethod
    def check(cfg, plugin) -> None:
        r = cfg.rollout
        if r.adaptive_temperature and plugin.source != "online":
            raise ConfigError(f"rollout.adaptive_temperature: sets the temperature of samples drawn as the run "
                              f"trains; {plugin.name} trains on no such samples")
        if r.adaptive_temperature and not r.min_temperature <= r.temperature <= r.max_temperature:
            raise ConfigError(f"rollout.temperature: {r.temperature} is the adaptive temperature's start and must lie "
                              f"in [rollout.min_temperature, rollout.max_temperature] = [{r.min_temperature}, "
                              f"{r.max_temperature}]")

    @staticmethod
    def on(cfg, needs) -> bool:
        return cfg.rollout.adaptive_temperature

    @classmethod
    def build(cls, deps) -> AdaptiveTemperature:
        return cls(deps.temperature, deps.reduce)

    def __call__(self, judged: Judged, more) -> Judged:
        batch = judged.batch
        fresh = fresh_mask(batch)  # [B, R]
        sums = torch.stack([-(batch.rollout_logp * fresh).sum(), fresh.sum()]).float()  # Σ −log π_τ, tokens
        nats, tokens = self.reduce(sums, "sum").tolist()
        entropy = nats / max(tokens, 1.0)  # per sampled token, over every process
        sampled_at = self.temperature.value
        self.temperature.observe(entropy)
        return judged.replace(metrics={**judged.metrics, "temperature": sampled_at, "entropy": entropy})

