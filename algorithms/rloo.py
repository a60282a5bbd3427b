"""REINFORCE Leave-One-Out (RLOO): REINFORCE on whole sequences, each baselined by the other samples of its prompt.

Paper: Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization for Learning from Human
Feedback in LLMs" (arXiv:2402.14740), the RLOO_k estimator; the leave-one-out baseline is Kool et al. 2019.

Objective: sample G outputs {o_i} per question q, with the KL to the reference folded into each sequence's reward,

    R_i = r_i − β Σ_t (log π_old(o_{i,t}|q,o_{i,<t}) − log π_ref(o_{i,t}|q,o_{i,<t})),

and follow the REINFORCE gradient with the leave-one-out baseline

    ∇J = E[ (1/G) Σ_i Â_i ∇log πθ(o_i|q) ],   Â_i = R_i − (1/(G−1)) Σ_{j≠i} R_j = G/(G−1) · (R_i − mean_j R_j),

with log πθ(o_i|q) = Σ_t log πθ(o_{i,t}|q,o_{i,<t}). Here, as in GRPO, each token's term is clipped PPO-style:

    J(θ) = E[ (1/G) Σ_i Σ_t min(ρ_{i,t} Â_i, clip(ρ_{i,t}, 1 − ε, 1 + ε_high) Â_i) ],   ρ_{i,t} = πθ/π_old per token.

Gradient coefficient: GC_{i,t} = Â_i · ρ_{i,t} · 1[ρ on the unclipped side of the min]; with μ = 1 (ρ = 1) it is the
paper's Â_i. With `kl_in_reward=false` the reward is r_i alone and GRPO's k3 penalty adds β(π_ref/πθ − 1). This is
`GRPO.coefficient` itself (`kl_in_loss` says where the KL is): only the advantage (`prepare`) differs.

Deviations from the paper:
    1. The KL in the reward is the k1 estimate of the sampled sequence under the sampling policy, a constant of the
       batch, so it needs the old log-probs even at μ = 1: the engine scores them before the update with the same
       weights and micro-batches as the update's own forward, so ρ = 1 there. `kl_in_reward=false` puts GRPO's
       per-token k3 in the loss instead.
    2. The paper's ∇log πθ(o_i|q) is a sum over tokens: `train.loss_agg=seq_mean_token_sum_norm` with
       `train.loss_agg_norm=1` gives exactly its gradient; otherwise the engine's aggregation applies (as in TRL's
       and verl's RLOO): the default `seq_mean_token_mean` divides each sequence's term by |o_i|.
    3. The token ratio is clipped as in PPO (`common.clipped_coefficient`), which only acts when μ > 1.
    4. Groups of any size and order (`common.group_stats`); a group of one has Â = 0. Â is not normalised, so
       `adv_norm` must be `none`.

Metrics:
    reward_std, zero_std_frac: GRPO's, of the rule reward r_i.
    kl: mean over sequences of Σ_t (log π_old − log π_ref) (KL in the reward), or GRPO's per-token k3 (in the loss).
    clip_frac, ratio: fraction of response tokens whose gradient the clip removed, and the mean of ρ.
    objective: −J, −min(ρ_{i,t} Â_i, clip(ρ_{i,t}) Â_i) per token under `train.loss_agg` (+ β·k3 per token with
        `kl_in_reward=false`): GRPO's `objective`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from posttrain.algorithms.base import register
from posttrain.algorithms.common import group_stats
from posttrain.algorithms.grpo import GRPO, GRPOConfig
from posttrain.core.batch import Batch
from posttrain.core.errors import ConfigError


@dataclass
class RLOOConfig(GRPOConfig):
    """GRPO's keys (G ≥ 2), with the KL in the sequence reward by default."""

    adv_norm: str = "none"
    """RLOO's Â is the leave-one-out difference, not normalised: only `none`."""
    kl_in_reward: bool = True
    """Subtract β·Σ_t (log π_old − log π_ref) from each sequence's reward (paper); false: GRPO's k3 in the loss."""

    def __post_init__(self):
        super().__post_init__()
        if self.adv_norm != "none":
            raise ConfigError(f"adv_norm: RLOO's advantage is not normalised; only none (got {self.adv_norm})")

    @property
    def kl_in_loss(self) -> bool:
        return not self.kl_in_reward


def leave_one_out(reward: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """Â_i = r_i − mean of the other n − 1 rewards of its group = n/(n − 1)·(r_i − group mean), 0 for a group of one;
    [B] -> [B]."""
    _, idx, size = torch.unique(group, return_inverse=True, return_counts=True)  # idx [B], size [n_groups]
    n = size.to(reward.dtype)[idx]  # [B]
    mean, _ = group_stats(reward, group)  # [B]
    return (reward - mean) * n / (n - 1).clamp(min=1)


@register("rloo")
class RLOO(GRPO):
    Config = RLOOConfig

    @staticmethod
    def prepare(batch: Batch, cfg: RLOOConfig) -> tuple[Batch, dict[str, torch.Tensor]]:
        reward, metrics = batch.reward, {}  # [B]
        if cfg.beta > 0 and cfg.kl_in_reward:
            kl = ((batch.old_logp - batch.ref_logp) * batch.mask).sum(-1)  # [B] k1 of each whole sequence
            reward, metrics["kl"] = reward - cfg.beta * kl, kl.mean()
        batch, group_metrics = GRPO.prepare(batch, cfg)  # the loss mask (mask_truncated) and the group metrics
        return dataclasses.replace(batch, adv=leave_one_out(reward, batch.group)), {**group_metrics, **metrics}
