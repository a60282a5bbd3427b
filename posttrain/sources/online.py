"""The online source: n samples of the current policy per prompt, judged, every step (GRPO, PPO, Online RFT)."""

from __future__ import annotations

import time

from posttrain.core.batch import Batch
from posttrain.data import RowSampler, completion_texts, prompt_ids
from posttrain.judge import Judge
from posttrain.rollout import RolloutEngine
from posttrain.schema import DataConfig, RolloutConfig
from posttrain.sources.base import Source, register


@register("online")
class Online(Source):
    on_policy = True

    def __init__(self, sampler: RowSampler, tokenizer, data: DataConfig, batch_size: int, rollout: RolloutEngine,
                 sampling: RolloutConfig, judge: Judge, n: int):
        self.sampler, self.tokenizer, self.data, self.batch_size = sampler, tokenizer, data, batch_size
        self.rollout, self.sampling, self.judge, self.n = rollout, sampling, judge, n

    @classmethod
    def from_deps(cls, d) -> Online:
        return cls(d.sampler, d.tokenizer, d.data, d.batch_size, d.rollout, d.sampling, d.judge, d.samples_per_prompt)

    def next(self) -> tuple[Batch, dict]:
        rows = self.sampler.next(self.batch_size)
        s = self.sampling
        t0 = time.perf_counter()
        batch = self.rollout.generate(prompt_ids(self.tokenizer, rows, self.data), self.n,
                                      max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p)
        stats = {"time/rollout": time.perf_counter() - t0, "generated_tokens": float(batch.mask.sum()),
                 "response_len": float(batch.mask.sum(-1).mean()),
                 "truncated_frac": float(batch.truncated.float().mean())}
        t0 = time.perf_counter()
        batch.reward, reward_stats = self.judge.score([r for r in rows for _ in range(self.n)],
                                                      completion_texts(self.tokenizer, batch))
        stats.update(reward_stats, **{"time/reward": time.perf_counter() - t0})
        return batch, stats
