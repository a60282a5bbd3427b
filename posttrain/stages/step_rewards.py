"""The step-reward stage: process supervision's rewards on the sampled tokens, for a plugin that asks for
"step_reward" (GRPO+PS); `rewards.process` says where they come from (`steps`: the embedded task's rule per line,
`model`: a process reward model, `turns`: an episode's turns, as `posttrain.sources.episodes` put them on the
tokens, the outcome on the last one).

The judge scores each step of a completion's text (`Judge.score_steps`); the stage puts the scores on the sampled
tokens as two [B, R] tensors in `batch.extra`: `step_reward` (each step's reward at its end token, 0 elsewhere) and
`step_end` (1.0 at the end tokens). A step's end token is found in the sampled ids themselves
(`posttrain.data.steps`). It runs after dynamic sampling and the elite pool, on the samples trained on only: a process
reward model costs a forward per sample.
"""

from __future__ import annotations

import time

import torch

from posttrain.core.errors import ConfigError
from posttrain.data.steps import step_tensors
from posttrain.stages.base import Judged, Stage

# The [B, R] tensors in `batch.extra` of an episode's turns (posttrain/sources/episodes.py), the outcome on the last:
TURN_REWARD, TURN_END = "turn_reward", "turn_end"  # each turn's reward at its last token; 1.0 there


def outcome_on_last_turn(turn_reward: torch.Tensor, turn_end: torch.Tensor,
                         outcome: torch.Tensor) -> torch.Tensor:
    """[B, R] turn rewards with each row's [B] outcome added at its last turn's end, so that a row's steps sum to its
    reward as judged (an episode whose first turn was empty has no turn, and its outcome no step)."""
    last = turn_end.cumsum(1).argmax(1)  # [B] the first column where the count of ends peaks: the last end
    has = turn_end.bool().any(1)  # [B]
    out = turn_reward.clone()
    out[has, last[has]] += outcome[has].to(out.dtype)
    return out


class StepRewards(Stage):
    key = "rewards.process"

    def __init__(self, score_steps, tokenizer):
        self.score_steps, self.tokenizer = score_steps, tokenizer  # (rows, texts) -> [(char_end, score)] per sample

    @staticmethod
    def check(cfg, plugin) -> None:
        process = cfg.rewards.process
        if "step_reward" in plugin.needs(cfg.algorithm) and process == "none":
            if cfg.env.name is not None:
                raise ConfigError(f"rewards.process: {plugin.name} trains on step rewards; set rewards.process=turns "
                                  "(each turn of an episode a step)")
            raise ConfigError(f"rewards.process: {plugin.name} trains on step rewards; set rewards.process=steps (the "
                              "embedded task's rule) or model (a process reward model at reward_model.process_path)")
        if process == "turns" and cfg.env.name is None:
            raise ConfigError("rewards.process: turns are an episode's; set env.name (an environment)")
        if process == "turns" and cfg.rollout.elite_pool:
            raise ConfigError("rollout.elite_pool: a replayed elite would keep none of its turns' rewards (they are "
                              "put on the tokens as the episode is sampled); use it without rewards.process=turns")
        if process == "model" and not cfg.reward_model.process_path:
            raise ConfigError("reward_model.process_path: rewards.process=model needs a process reward model "
                              "directory")

    @staticmethod
    def on(cfg, needs) -> bool:
        return "step_reward" in needs

    @classmethod
    def build(cls, deps) -> StepRewards:
        return cls(deps.judge.score_steps, deps.tokenizer)

    def __call__(self, judged: Judged, more) -> Judged:
        t0 = time.perf_counter()
        batch = judged.batch
        if TURN_REWARD in batch.extra:  # rewards.process=turns: the steps are already on the tokens
            batch.extra["step_reward"] = batch.extra.pop(TURN_REWARD)
            batch.extra["step_end"] = batch.extra.pop(TURN_END)
            return judged
        steps = self.score_steps(judged.rows, judged.texts)
        batch.extra["step_reward"], batch.extra["step_end"] = step_tensors(self.tokenizer, batch, judged.texts, steps)
        spent = judged.metrics.get("time/reward", 0.0) + time.perf_counter() - t0
        return judged.replace(metrics={**judged.metrics, "time/reward": spent})
