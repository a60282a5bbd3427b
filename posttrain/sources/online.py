"""The online source: n samples of the current policy per prompt, judged, every step (GRPO, PPO, Online RFT).

Each step runs a pipeline (`posttrain.stages`): a round is drawn (`draw`: `batch_size` prompts from the row draws,
their group sizes, sampled at the controller's temperature by the rollout engine, judged), then passed through the
stages the config switches on, in their fixed order: pass-rate updates, the overlong penalty, dynamic sampling
(which asks for more rounds), elite replay, step rewards, the adaptive temperature. Each feature is its own stage
and key; this file knows none of them.

A round's batch is a rollout record: the token ids exactly as sampled, the sampler's log-probs (`rollout_logp`), the
policy version that sampled each row (`version`), the temperature it was drawn at, and the judge's reward.
"""

from __future__ import annotations

import time

import torch

from posttrain.core.batch import Batch
from posttrain.data import completion_texts, prompt_ids
from posttrain.data.difficulty import FixedGroups, tracks_pass_rates
from posttrain.sources.base import Source, register
from posttrain.stages import Judged, Pipeline, build
from posttrain.stages.step_rewards import TURN_END, TURN_REWARD, outcome_on_last_turn


@register("online")
class Online(Source):
    on_policy = True

    def __init__(self, d):
        self.sampler, self.tokenizer, self.data, self.batch_size = d.sampler, d.tokenizer, d.data, d.batch_size
        self.rollout, self.sampling, self.judge = d.rollout, d.sampling, d.judge
        self.group_sizes = d.group_sizes or FixedGroups(d.samples_per_prompt)
        self.temperature = d.temperature  # SamplingTemperature: read at each draw
        self.pipeline = Pipeline(self.draw, build(d))
        self.episodes = d.episodes  # multi-turn: each sample an episode in the environment (env.name)

    @staticmethod
    def judges_rows(cfg) -> bool:
        return "accuracy" in cfg.rewards.weights or tracks_pass_rates(cfg)  # a reward, or the pass rates' verdicts

    @classmethod
    def from_deps(cls, d) -> Online:
        return cls(d)

    def draw(self) -> Judged:
        """One round: `batch_size` new prompts, their samples, judged."""
        rows = self.sampler.next(self.batch_size)
        n, stats = self.group_sizes(rows)  # an int, or each prompt's own
        s, temperature = self.sampling, self.temperature.value
        t0 = time.perf_counter()
        prompts, env_stats = prompt_ids(self.tokenizer, rows, self.data), {}
        if self.episodes is None:
            batch = self.rollout.generate(prompts, n, max_new_tokens=s.max_new_tokens, temperature=temperature,
                                          top_p=s.top_p)
        else:
            batch, env_stats = self.episodes.generate(rows, prompts, n, max_new_tokens=s.max_new_tokens,
                                                      temperature=temperature, top_p=s.top_p)
        batch.temperature = temperature
        if batch.version is None:  # rollout workers stamp the version that sampled each row themselves
            batch.version = torch.full((len(batch),), self.rollout.version, dtype=torch.long)  # [B]
        stats = {"time/rollout": time.perf_counter() - t0, "generated_tokens": float(batch.mask.sum()), **stats,
                 **env_stats}
        t0 = time.perf_counter()
        sizes = n if isinstance(n, list) else [n] * len(rows)
        rows, texts = [r for r, k in zip(rows, sizes) for _ in range(k)], completion_texts(self.tokenizer, batch)
        outcome, reward_stats = self.judge.score(rows, texts, group=batch.group.cpu())  # [B] on the CPU
        if TURN_REWARD in batch.extra:  # rewards.process=turns: the outcome is the last turn's reward too
            batch.extra[TURN_REWARD] = outcome_on_last_turn(batch.extra[TURN_REWARD], batch.extra[TURN_END], outcome)
        if "env_reward" in batch.extra:  # an episode's reward: the judge's outcome and the environment's turns
            outcome = outcome + batch.extra.pop("env_reward").to(outcome.dtype)
        batch.reward = outcome
        stats.update(reward_stats, **{"time/reward": time.perf_counter() - t0})
        return Judged(batch, rows, texts, outcome, stats)

    def next(self) -> tuple[Batch, dict]:
        judged = self.pipeline()
        batch = judged.batch
        return batch, {**judged.metrics, "response_len": float(batch.mask.sum(-1).mean()),
                       "truncated_frac": float(batch.truncated.float().mean())}
