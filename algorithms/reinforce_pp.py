"""REINFORCE++: PPO's clipped token objective with REINFORCE returns normalised over the batch, and no critic.

Paper: Hu et al. 2025, "REINFORCE++" (arXiv:2501.03262); the group-baseline form ("REINFORCE++-baseline", for
several samples per prompt) is in its later versions.

Objective: sample o ~ π_old for each question q (G samples with the baseline), give every response token the
reward of PPO's Eq. 2, the outcome r at the last token and a k1 KL penalty on each token,

    r_t = r·1[t = |o|] − β (log π_old(o_t|q,o_<t) − log π_ref(o_t|q,o_<t)),   r ← r − mean of its group (baseline),
    G_t = Σ_{s≥t} γ^(s−t) r_s,   Â_t = (G_t − mean) / std  (mean and std over all response tokens of the batch),

and maximise the PPO-clipped objective  J(θ) = E[ (1/|o|) Σ_t min(ρ_t Â_t, clip(ρ_t, 1 − ε, 1 + ε_high) Â_t) ].

Gradient coefficient: GC_t = Â_t · ρ_t · 1[ρ on the unclipped side of the min] (the KL is in the reward, as in PPO);
with μ = 1 (ρ = 1) it is Â_t, REINFORCE with a normalised return. With `kl_in_reward=false` the reward has no KL
term and GRPO's k3 penalty adds β(π_ref/πθ − 1) to GC. This is `GRPO.coefficient` itself, given the token-level
Â (`kl_in_loss` says where the KL is): only the advantage (`prepare`, and its shape: `token_advantage`) differs.

Deviations from the paper:
    1. Â is normalised over the batch this process holds (`common.whiten`: population std, eps 1e-8 inside the square
       root), not over the global batch of all data-parallel processes.
    2. The KL in the reward is the k1 estimate under the sampling policy, a constant of the batch (`common.kl_reward`),
       so the old log-probs are scored even at μ = 1 (ρ = 1 there: same weights, same micro-batches).
    3. `baseline` (null: on when `group_size` > 1) subtracts the group's mean outcome reward before the returns
       (`common.group_advantages` with `none`); a group of one (`group_size=1`, allowed here) has no baseline.
    4. γ = 1 by default (`gamma`); returns are GAE with V = 0 and λ = 1 (`common.gae`). The 1/|o| average is the
       engine's `train.loss_agg`. GRPO's group normalisation does not apply: `adv_norm` must be `none`.

Metrics:
    reward_std, zero_std_frac: GRPO's, of the outcome reward (trivially 0 and 1 with groups of one).
    kl: masked mean of the per-token k1 in the reward, or of GRPO's k3 in the loss (`kl_in_reward=false`).
    clip_frac, ratio: fraction of response tokens whose gradient the clip removed, and the mean of ρ.
    objective: −J, −min(ρ_t Â_t, clip(ρ_t) Â_t) per token under `train.loss_agg` (+ β·k3 per token with
        `kl_in_reward=false`): GRPO's `objective` with the token-level Â.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch

from posttrain.algorithms.base import register
from posttrain.algorithms.common import gae, group_advantages, kl_reward, whiten
from posttrain.algorithms.grpo import GRPO, GRPOConfig
from posttrain.core.aggregation import masked_mean
from posttrain.core.batch import Batch
from posttrain.core.errors import ConfigError


@dataclass
class ReinforcePPConfig(GRPOConfig):
    """GRPO's keys, with groups of one allowed, the KL in the per-token reward, γ, and the group baseline."""

    adv_norm: str = "none"
    """Â is normalised over the batch's tokens, not per group: only `none`."""
    kl_in_reward: bool = True
    """Put −β·k1 in every token's reward (paper); false: GRPO's k3 in the loss instead."""
    gamma: float = 1.0
    """γ: discount of later tokens' rewards in the return G_t."""
    baseline: bool | None = None
    """Subtract the group's mean outcome reward (REINFORCE++-baseline); null: when group_size > 1."""

    MIN_GROUP: ClassVar[int] = 1

    def __post_init__(self):
        super().__post_init__()
        if self.adv_norm != "none":
            raise ConfigError(f"adv_norm: REINFORCE++ normalises over the batch, not per group; only none "
                              f"(got {self.adv_norm})")
        if not 0 <= self.gamma <= 1:
            raise ConfigError(f"gamma: must be in [0, 1] (got {self.gamma})")
        if self.baseline and self.group_size == 1:
            raise ConfigError("baseline: a group of one is its own mean, so every outcome reward would be 0; "
                              "use group_size > 1 or baseline=false")

    @property
    def kl_in_loss(self) -> bool:
        return not self.kl_in_reward


@register("reinforce_pp")
class ReinforcePP(GRPO):
    Config = ReinforcePPConfig

    @staticmethod
    def prepare(batch: Batch, cfg: ReinforcePPConfig) -> tuple[Batch, dict[str, torch.Tensor]]:
        batch, metrics = GRPO.prepare(batch, cfg)  # the loss mask (mask_truncated) and the group metrics
        mask = batch.mask  # [B, R]
        baseline = cfg.baseline if cfg.baseline is not None else cfg.group_size > 1
        reward = group_advantages(batch.reward, batch.group, "none", cfg.eps) if baseline else batch.reward  # [B]
        in_reward = cfg.beta > 0 and cfg.kl_in_reward
        # Without a reference, kl_reward reads only the shape of its old_logp argument.
        token_reward = kl_reward(reward, batch.old_logp if in_reward else mask, batch.ref_logp if in_reward else None,
                                 mask, cfg.beta)  # [B, R]
        returns, _ = gae(token_reward, torch.zeros_like(token_reward), mask, cfg.gamma, 1.0)  # [B, R] G_t
        if in_reward:
            metrics["kl"] = masked_mean(batch.old_logp - batch.ref_logp, mask)
        return dataclasses.replace(batch, adv=whiten(returns, mask)), metrics  # whole batch, before it is split

    @staticmethod
    def token_advantage(batch: Batch, logp: torch.Tensor) -> torch.Tensor:
        """Â_t of every token, the normalised return `prepare` left: [B, R]."""
        assert batch.adv.shape == batch.mask.shape == logp.shape, "REINFORCE++ expects adv and mask [B, R]"
        return batch.adv  # [B, R]
