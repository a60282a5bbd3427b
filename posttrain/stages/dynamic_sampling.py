"""The dynamic sampling stage (`rollout.dynamic_sampling`): DAPO's filter of equal-reward groups (Yu et al. 2025,
arXiv:2503.14476, §3.2).

A group of equal rewards has zero group-relative advantage and adds no policy gradient, so as more prompts become
always-solved (or never-solved) the effective batch shrinks. The stage keeps the groups whose rewards differ and asks
for more rounds of `batch_size` prompts until it holds `batch_size` of them, then trains on the first `batch_size`.
Whether a group differs is judged on the judge's rewards (`Judged.outcome`), before any shaping such as the overlong
penalty: DAPO filters on accuracy. After `rollout.max_sampling_rounds` rounds it fills what is missing with
equal-reward groups rather than train on fewer rows (every process then runs the same number of forward passes).
Where weights are sharded, a round is sampled on every process until every process has enough (`agree`).

The stages before this one run on every round; those after it, on the kept batch. The reward figures (`reward`,
`reward/*`) are over every completion sampled, the filtered-out ones too: what the policy produced, not what the
filter kept.

Metrics: `sampling_rounds`, `filled_groups` (equal-reward groups that filled the batch), `dropped_groups`.
"""

from __future__ import annotations

import torch

from posttrain.core.batch import concat
from posttrain.core.errors import ConfigError
from posttrain.rewards.base import COUNTS
from posttrain.stages.base import Judged, Stage


class DynamicSampling(Stage):
    key = "rollout.dynamic_sampling"

    def __init__(self, batch_size: int, n: int, max_rounds: int, pad_id: int, agree=None):
        self.batch_size, self.n, self.max_rounds, self.pad_id = batch_size, n, max_rounds, pad_id
        self.agree = agree or (lambda flag: flag)

    @staticmethod
    def check(cfg, plugin) -> None:
        if cfg.rollout.dynamic_sampling and (plugin.source != "online" or plugin.samples_per_prompt(cfg.algorithm) < 2):
            raise ConfigError(f"rollout.dynamic_sampling: keeps the groups of samples whose rewards differ; "
                              f"{plugin.name} with these settings samples no groups (one completion per prompt, or "
                              "none)")
        if cfg.rollout.dynamic_sampling and cfg.rollout.adaptive_group_size:
            raise ConfigError("rollout.adaptive_group_size: not with rollout.dynamic_sampling (groups of unequal size "
                              "would give each process a different number of rows); choose one")

    @staticmethod
    def on(cfg, needs) -> bool:
        return cfg.rollout.dynamic_sampling

    @classmethod
    def build(cls, deps) -> DynamicSampling:
        s = deps.sampling
        return cls(deps.batch_size, deps.samples_per_prompt, s.max_sampling_rounds, deps.tokenizer.pad_token_id,
                   deps.agree)

    def __call__(self, judged: Judged, more) -> Judged:
        """Rounds until `batch_size` groups whose outcomes differ (or the rounds run out); the step's batch of exactly
        `batch_size` groups: those that differ in the order drawn, then any that fill, each renumbered by its place."""
        rounds, varied, equal = [], [], []  # rounds; per round, the groups whose rewards differ / are all equal
        for r in range(self.max_rounds):
            round_ = judged if r == 0 else more()
            rounds.append(round_)
            group = round_.batch.group.cpu()  # [B]
            low = torch.full((self.batch_size,), torch.inf).scatter_reduce(0, group, round_.outcome, "amin")  # [G]
            high = torch.full((self.batch_size,), -torch.inf).scatter_reduce(0, group, round_.outcome, "amax")  # [G]
            varied.append((high > low).nonzero().flatten().tolist())
            equal.append((high <= low).nonzero().flatten().tolist())
            if self.agree(sum(map(len, varied)) >= self.batch_size):
                break
        metrics = merged([r.metrics for r in rounds])
        kept, filled, need = [], 0, self.batch_size  # (round, its groups kept), varied ones first
        for choice in (varied, equal):
            for r, groups in enumerate(choice):
                take, need = groups[:need], need - len(groups[:need])
                kept.append((r, take))
                filled += len(take) if choice is equal else 0
        metrics.update(sampling_rounds=float(len(rounds)), filled_groups=float(filled),
                       dropped_groups=float(len(rounds) * self.batch_size - self.batch_size))
        if len(rounds) == 1 and not filled:  # the first round had nothing to drop: its batch as it is
            return rounds[0].replace(metrics=metrics)
        parts, rows, texts, outcome = [], [], [], []
        for r, groups in kept:
            if not groups:
                continue
            round_ = rounds[r]
            index = torch.cat([(round_.batch.group.cpu() == g).nonzero().flatten() for g in groups])  # [b]
            parts.append(round_.batch.select(index))
            rows += [round_.rows[i] for i in index.tolist()]
            texts += [round_.texts[i] for i in index.tolist()]
            outcome.append(round_.outcome[index])
        batch = concat(parts, self.pad_id)
        batch.group = (torch.arange(len(batch)) // self.n).to(batch.group.device)  # rows i·n … i·n + n − 1: group i
        return Judged(batch, rows, texts, torch.cat(outcome), metrics)


def merged(stats: list[dict]) -> dict[str, float]:
    """The metrics of several rounds as one: times, token and failure counts add up; means (of equal-sized rounds)
    are averaged."""
    sums = {"time/rollout", "time/reward", "generated_tokens", *(f"reward/{k}" for k in COUNTS)}
    return {k: (sum if k in sums else lambda v: sum(v) / len(v))([s[k] for s in stats]) for k in stats[0]}
