"""Online DPO: DPO's loss on pairs the current policy samples and the judge ranks, every step.

Papers: Guo et al. 2024, "Direct Language Model Alignment from Online AI Feedback" (arXiv:2402.04792), Algorithm 1;
DPO's loss from Rafailov et al. 2023 (arXiv:2305.18290), Eq. 7. DeepSeekMath's Table 10 (arXiv:2402.03300) has DPO
with an offline source only; this is the cell beside it, the online source with DPO's gradient coefficient.

Objective: each step, for every prompt q sample G ≥ 2 responses from the current policy πθ (the paper: 2), judge them,
and take the best as o⁺ and the worst as o⁻. With the log-ratios to the reference (the starting policy)

    ℓ± = Σ_t [log πθ(o±_t | q, o±_<t) − log π_ref(o±_t | q, o±_<t)]      (`length_normalize: true`: (1/|o±|) Σ_t)

and z = β(ℓ⁺ − ℓ⁻), minimise the mean over the step's pairs of

    L = d · [−(1 − ε) log σ(z) − ε log σ(−z)],   d = 1[r(o⁺) > r(o⁻)],

treating the samples as data (no gradient through the sampling), as the paper does.

Gradient coefficient: DPO's (algorithms/dpo.py), ±2βw·d per sequence, w = (1 − ε)σ(−z) − εσ(z): + on every token of
o⁺, − on every token of o⁻.

Pairs and ties: `prepare` keeps one pair of each group, the sample with the highest reward (the first of them on a
tie at the top) and the one with the lowest (the last of them on a tie at the bottom), chosen first. Where every
sample of the group got the same reward the judge states no preference: the pair is kept with d = 0, so it adds
nothing to the gradient but counts in the mean over pairs, as GRPO counts a group whose advantages are all 0.
`rollout.dynamic_sampling=true` replaces such groups with ranked ones, as for GRPO. The other G − 2 samples are left
out of the loss (their reference log-probs were scored with the batch's).

Deviations from the paper:
    1. The judge is the run's reward (a rule, a reward model, or both), not an LLM annotator; a tie, which an
       annotator's forced choice never gives, is no preference (above).
    2. G > 2 takes the best and the worst of the group (more pairs are ranked with a 0/1 reward: for a pass rate p,
       a tie has probability p^G + (1 − p)^G).
    3. DPO's options as in algorithms/dpo.py: `length_normalize` (DeepSeekMath Eq. 12), `label_smoothing` (cDPO).
    4. The reference is the starting policy, scored by the engine each step (on the rollout workers with
       `rollout.reference_on=workers`).

Metrics (DPO's, means over the ranked pairs, d = 1: reward_margin, pair_accuracy, chosen_logratio,
rejected_logratio, dpo_loss; plus):
    tie_frac: fraction of the step's pairs whose samples the judge could not rank (d = 0).
    reward_gap: mean of r(o⁺) − r(o⁻) over the step's pairs.
    objective: the mean over pairs of d·L, the quantity minimised.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from posttrain.algorithms.base import register
from posttrain.algorithms.dpo import DPO, PreferenceConfig
from posttrain.core.batch import Batch
from posttrain.core.errors import ConfigError

RANKED = "ranked"  # batch.extra's [B] 1.0 on both rows of a pair the judge ranked, 0.0 on a tie


@dataclass
class OnlineDPOConfig(PreferenceConfig):
    """DPO's loss keys, and the samples drawn per prompt."""

    group_size: int = 2
    """G: samples per prompt each step; the best and the worst make its pair (the paper: 2)."""

    def __post_init__(self):
        super().__post_init__()
        if self.group_size < 2:
            raise ConfigError(f"group_size: online DPO pairs two samples of a prompt, so it needs at least 2 (got "
                              f"{self.group_size})")


def best_and_worst(reward: torch.Tensor, group: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For each group, in order of first appearance: (rows [2·groups] as chosen, rejected, chosen, …; ranked
    [groups] bool). Chosen is the first row with the group's highest reward, rejected the last with its lowest; a
    group whose rewards are all equal gives its first and last rows, unranked. [B] rewards and group ids."""
    rows, ranked = [], []
    _, which = torch.unique(group, return_inverse=True)  # [B] each row's group, numbered 0, 1, …
    for g in dict.fromkeys(which.tolist()):  # groups in order of first appearance
        idx = (which == g).nonzero().flatten()  # [G] this group's rows, in order
        r = reward[idx]
        best = idx[int(torch.argmax((r == r.max()).int()))]  # the first maximum
        worst = idx[len(idx) - 1 - int(torch.argmax((r.flip(0) == r.min()).int()))]  # the last minimum
        rows += [best, worst]
        ranked.append(bool(r.max() > r.min()))
    return torch.stack(rows), torch.tensor(ranked, device=reward.device)


@register("online_dpo")
class OnlineDPO(DPO):
    Config = OnlineDPOConfig
    source = "online"
    unit = 2  # after `prepare`: rows [chosen_i, rejected_i] stay in one micro-batch

    @staticmethod
    def needs(cfg: OnlineDPOConfig) -> frozenset[str]:
        return frozenset({"reward", "ref_logp"})

    @staticmethod
    def samples_per_prompt(cfg: OnlineDPOConfig) -> int:
        return cfg.group_size

    @classmethod
    def rows_per_item(cls, cfg: OnlineDPOConfig) -> int:
        return 2

    @classmethod
    def sized_config(cls, kl_weight: float, group: int) -> OnlineDPOConfig:
        return OnlineDPOConfig(group_size=group)  # β is the loss's temperature, no KL weight: the default stays

    @staticmethod
    def check(cfg) -> None:
        r, n = cfg.rollout, cfg.algorithm.group_size
        if r.adaptive_group_size:
            raise ConfigError("rollout.adaptive_group_size: online DPO keeps one pair of each group, whatever its size; "
                              "sample more per prompt with algorithm.group_size instead")
        if cfg.train.batch_size * n % 2:
            raise ConfigError(f"train.batch_size: online DPO scores its samples in pairs of rows, so train.batch_size "
                              f"× algorithm.group_size must be even (got {cfg.train.batch_size} × {n})")

    @staticmethod
    def prepare(batch: Batch, cfg: OnlineDPOConfig) -> tuple[Batch, dict[str, torch.Tensor]]:
        rows, ranked = best_and_worst(batch.reward, batch.group)  # [2·groups], [groups]
        gap = batch.reward[rows[0::2]] - batch.reward[rows[1::2]]  # [groups]
        pairs = batch.select(rows)  # [chosen_0, rejected_0, chosen_1, …]
        pairs = dataclasses.replace(pairs, extra={**pairs.extra, RANKED: ranked.float().repeat_interleave(2)})
        return pairs, {"tie_frac": 1 - ranked.float().mean(), "reward_gap": gap.float().mean()}

    @staticmethod
    def pair_weight(batch: Batch) -> torch.Tensor:
        return batch.extra[RANKED][0::2]  # [B/2] d of each pair
