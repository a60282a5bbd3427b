"""The online source: n samples of the current policy per prompt, judged, every step (GRPO, PPO, Online RFT).

With `rollout.dynamic_sampling` (DAPO's dynamic sampling, Yu et al. 2025, arXiv:2503.14476, §3.2) a step keeps only
the groups whose rewards differ: a group of equal rewards has zero group-relative advantage and adds no policy
gradient, so as more prompts become always-solved (or never-solved) the effective batch shrinks. The source samples
`batch_size` more prompts, round after round, until it holds `batch_size` groups whose outcome rewards differ (the
judge's, before the overlong punishment: DAPO filters on accuracy), and trains on the first `batch_size` of them.
After `rollout.max_sampling_rounds` rounds it fills what is missing with equal-reward groups rather than train on
fewer rows (every process then runs the same number of forward passes). Where weights are
sharded, a round is sampled on every process until every process has enough (`Deps.agree`). The reward figures
(`reward`, `reward/*`) are over every completion sampled, the filtered-out ones too: what the policy produced, not
what the filter kept.

With `rewards.overlong_buffer` the source adds DAPO's soft overlong punishment to each reward (rewards/overlong.py):
it needs the completions' token counts, which the judge's rules do not see.

When the plugin needs step rewards ("step_reward", process supervision), the judge also scores each step
(`Judge.score_steps`) and the source puts them on the sampled tokens as two [B, R] tensors in `batch.extra`:
`step_reward` (each step's reward at its end token, 0 elsewhere) and `step_end` (1.0 at the end tokens); the end
token of a step is found in the sampled ids themselves (`posttrain.data.steps`). They are scored for the samples
trained on only, after dynamic sampling has chosen them by their outcome rewards.

With `rollout.adaptive_group_size` each prompt gets its own group size from its running pass rate
(`posttrain.data.difficulty`), the step's samples still batch_size × n; the judge's verdicts on every sample then
update the pass rates (`PassRates`, shared with a pass-rate curriculum). With `rollout.adaptive_temperature` the
engine sets `temperature` before each step (`posttrain.core.schedules.adapted_temperature`). With
`rollout.elite_pool` each step's groups are compared with the best completion stored for their prompt and may get it
back (`posttrain.sources.elite`), after dynamic sampling and before step rewards are scored.
"""

from __future__ import annotations

import time

import torch

from posttrain.core.batch import Batch, concat
from posttrain.data import RowSampler, completion_texts, prompt_ids
from posttrain.data.difficulty import PassRates, group_sizes
from posttrain.data.steps import step_tensors
from posttrain.judge import Judge
from posttrain.rewards.base import COUNTS
from posttrain.rewards.overlong import overlong_penalty
from posttrain.rollout import RolloutEngine
from posttrain.schema import DataConfig, RewardsConfig, RolloutConfig
from posttrain.sources.base import Source, register
from posttrain.sources.elite import ElitePool


@register("online")
class Online(Source):
    on_policy = True

    def __init__(self, sampler: RowSampler, tokenizer, data: DataConfig, batch_size: int, rollout: RolloutEngine,
                 sampling: RolloutConfig, judge: Judge, n: int, agree=None, rewards: RewardsConfig | None = None,
                 step_rewards: bool = False, pass_rates: PassRates | None = None):
        self.sampler, self.tokenizer, self.data, self.batch_size = sampler, tokenizer, data, batch_size
        self.rollout, self.sampling, self.judge, self.n = rollout, sampling, judge, n
        self.agree = agree or (lambda flag: flag)
        self.rewards = rewards or RewardsConfig()
        self.step_rewards = step_rewards
        self.pass_rates = pass_rates  # updated from the judge's verdicts when given
        self.temperature = sampling.temperature  # the next round's (the engine adapts it, if asked)
        self.elite = ElitePool(sampling.elite_pool, tokenizer.pad_token_id) if sampling.elite_pool else None
        self.target_entropy = sampling.target_entropy  # adaptive_temperature's target; the engine sets a null one

    @classmethod
    def from_deps(cls, d) -> Online:
        return cls(d.sampler, d.tokenizer, d.data, d.batch_size, d.rollout, d.sampling, d.judge, d.samples_per_prompt,
                   d.agree, d.rewards, "step_reward" in d.needs, d.pass_rates)

    def sample(self) -> tuple[Batch, dict, list[dict], list[str], torch.Tensor]:
        """One round: `batch_size` new prompts, n samples each, judged. Returns the batch (its rewards with the
        overlong punishment, if on), its stats, each sample's row and text, and the judge's rewards alone [B]."""
        rows = self.sampler.next(self.batch_size)
        s, sizes = self.sampling, [self.n] * self.batch_size
        if s.adaptive_group_size:
            sizes = group_sizes([self.pass_rates.get(r) for r in rows], size=self.n, low=s.min_group_size,
                                high=s.max_group_size, target=s.group_size_target)
        t0 = time.perf_counter()
        batch = self.rollout.generate(prompt_ids(self.tokenizer, rows, self.data), sizes if s.adaptive_group_size
                                      else self.n, max_new_tokens=s.max_new_tokens, temperature=self.temperature,
                                      top_p=s.top_p)
        stats = {"time/rollout": time.perf_counter() - t0, "generated_tokens": float(batch.mask.sum())}
        if s.adaptive_group_size:
            stats.update({"group_size/min": float(min(sizes)), "group_size/max": float(max(sizes))})
        t0 = time.perf_counter()
        rows, texts = [r for r, k in zip(rows, sizes) for _ in range(k)], completion_texts(self.tokenizer, batch)
        outcome, reward_stats = self.judge.score(rows, texts, group=batch.group.cpu())  # [B] on the CPU
        if self.pass_rates is not None:
            correct = self.judge.correct(rows, texts)
            self.pass_rates.observe(rows, correct)
            reward_stats["pass_rate"] = sum(correct) / len(correct)
        batch.reward = outcome
        if self.rewards.overlong_buffer:
            penalty = self.rewards.overlong_penalty * overlong_penalty(batch.mask.sum(-1).cpu(), batch.truncated.cpu(),
                                                                       s.max_new_tokens, self.rewards.overlong_buffer)
            batch.reward = outcome + penalty
            reward_stats.update(reward=float(batch.reward.mean()), **{"reward/overlong": float(penalty.mean())})
        stats.update(reward_stats, **{"time/reward": time.perf_counter() - t0})
        return batch, stats, rows, texts, outcome

    def next(self) -> tuple[Batch, dict]:
        if self.sampling.dynamic_sampling:
            batch, stats, rows, texts = self.dynamic()
        else:
            batch, stats, rows, texts, _ = self.sample()
        if self.elite is not None:  # after dynamic sampling has kept groups by their own samples' rewards
            batch, replayed = self.elite.inject(batch)
            self.elite.update(batch)
            stats.update(self.elite.metrics(replayed))
            if replayed:
                texts = completion_texts(self.tokenizer, batch)
        if self.step_rewards:  # of the samples trained on only (the process reward model is a forward each)
            t0 = time.perf_counter()
            steps = self.judge.score_steps(rows, texts)
            batch.extra["step_reward"], batch.extra["step_end"] = step_tensors(self.tokenizer, batch, texts, steps)
            stats["time/reward"] += time.perf_counter() - t0
        stats.update(response_len=float(batch.mask.sum(-1).mean()), truncated_frac=float(batch.truncated.float().mean()))
        return batch, stats

    def dynamic(self) -> tuple[Batch, dict, list[dict], list[str]]:
        """Rounds of `sample` until `batch_size` groups whose outcome rewards differ (or the rounds run out); the
        step's batch of exactly `batch_size` groups: those that differ in the order drawn, then any that fill, each
        renumbered by its place. Whether a group differs is judged on the judge's rewards, before the overlong
        punishment, as DAPO filters on accuracy."""
        rounds, varied, equal = [], [], []  # rounds; per round, the groups whose rewards differ / are all equal
        for _ in range(self.sampling.max_sampling_rounds):
            batch, stats, rows, texts, outcome = self.sample()
            rounds.append((batch, stats, rows, texts))
            group = batch.group.cpu()  # [B]
            low = torch.full((self.batch_size,), torch.inf).scatter_reduce(0, group, outcome, "amin")  # [G]
            high = torch.full((self.batch_size,), -torch.inf).scatter_reduce(0, group, outcome, "amax")  # [G]
            varied.append((high > low).nonzero().flatten().tolist())
            equal.append((high <= low).nonzero().flatten().tolist())
            if self.agree(sum(map(len, varied)) >= self.batch_size):
                break
        stats = merged([r[1] for r in rounds])
        kept, filled, need = [], 0, self.batch_size  # (round, its groups kept), varied ones first
        for choice in (varied, equal):
            for r, groups in enumerate(choice):
                take, need = groups[:need], need - len(groups[:need])
                kept.append((r, take))
                filled += len(take) if choice is equal else 0
        stats.update(sampling_rounds=float(len(rounds)), filled_groups=float(filled),
                     dropped_groups=float(len(rounds) * self.batch_size - self.batch_size))
        if len(rounds) == 1 and not filled:  # the first round had nothing to drop: its batch as it is
            batch, _, rows, texts = rounds[0]
            return batch, stats, rows, texts
        parts, rows, texts = [], [], []
        for r, groups in kept:
            if not groups:
                continue
            batch, _, round_rows, round_texts = rounds[r]
            index = torch.cat([(batch.group.cpu() == g).nonzero().flatten() for g in groups])  # [b], group by group
            parts.append(batch.select(index))
            rows += [round_rows[i] for i in index.tolist()]
            texts += [round_texts[i] for i in index.tolist()]
        batch = concat(parts, self.tokenizer.pad_token_id)
        batch.group = (torch.arange(len(batch)) // self.n).to(batch.group.device)  # rows i·n … i·n + n − 1: group i
        return batch, stats, rows, texts


    def state_dict(self) -> dict:
        """The sampler's position, and what adapts over the run: the pass rates and the temperature."""
        state = {**super().state_dict(), "temperature": self.temperature, "target_entropy": self.target_entropy}
        if self.elite is not None:
            state["elite"] = self.elite.state_dict()
        return {**state, "pass_rates": self.pass_rates.state_dict()} if self.pass_rates is not None else state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.temperature = state.get("temperature", self.temperature)
        self.target_entropy = state.get("target_entropy", self.target_entropy)
        if self.pass_rates is not None:
            self.pass_rates.load_state_dict(state["pass_rates"])
        if self.elite is not None:
            self.elite.load_state_dict(state["elite"])


def merged(stats: list[dict]) -> dict[str, float]:
    """The stats of several rounds as one: times, token and failure counts add up; means (of equal-sized rounds)
    are averaged."""
    sums = {"time/rollout", "time/reward", "generated_tokens", *(f"reward/{k}" for k in COUNTS)}
    return {k: (sum if k in sums else lambda v: sum(v) / len(v))([s[k] for s in stats]) for k in stats[0]}
