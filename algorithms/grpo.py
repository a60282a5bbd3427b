"""Group Relative Policy Optimization (GRPO) with outcome supervision.

Paper: DeepSeekMath (arXiv:2402.03300), §4.1, Eq. 3–4 and Appendix A.1.6.

Objective: for each question q sample G outputs {o_i} from π_old, score them with the reward r_i, and maximise

    J(θ) = E[ (1/G) Σ_i (1/|o_i|) Σ_t { min(ρ_{i,t} Â_{i,t}, clip(ρ_{i,t}, 1−ε, 1+ε) Â_{i,t}) − β D_KL[πθ‖π_ref] } ]

with ρ_{i,t} = πθ(o_{i,t}|q,o_{i,<t}) / π_old(o_{i,t}|q,o_{i,<t}), the group-relative advantage of outcome supervision
Â_{i,t} = (r_i − mean(r)) / std(r) for every token of o_i, and the unbiased k3 estimator (Eq. 4)

    D_KL = π_ref/πθ − log(π_ref/πθ) − 1.

Gradient coefficient (unified view, Eq. 21): d/dlogπθ of the per-token term gives

    GC_{i,t} = Â_{i,t} · ρ_{i,t} · 1[ρ on the unclipped side of the min] + β (π_ref/πθ − 1),

which with μ = 1 (ρ = 1, never clipped) is the paper's Â_{i,t} + β(π_ref/πθ − 1).

Deviations from the paper:
    1. The std gets `eps` added (as in most implementations) so groups with equal rewards give Â = 0, not NaN;
       `scale_std=false` drops the division altogether (Dr. GRPO, arXiv:2503.20783).
    2. `clip_eps_high` allows a separate upper clip bound (DAPO "clip-higher", arXiv:2503.14476); off by default.
    3. `mask_truncated` drops completions that ran out of tokens from the loss (DAPO's overlong filtering); off by
       default.
    4. The 1/|o_i| and 1/G averages are the engine's `train.loss_agg` (`seq_mean_token_mean` is the paper's form).
    5. With β = 0 no reference model is loaded; with μ = 1 no old log-probs are computed (ρ = 1 exactly).

Metrics:
    reward_std: mean over samples of the reward std within their group (0: nothing to learn from that group).
    zero_std_frac: fraction of samples whose group all got the same reward (their advantage is 0).
    kl: masked mean of the k3 estimate of KL(πθ‖π_ref) per token (only with β > 0).
    clip_frac: fraction of response tokens whose gradient the clip removed.
    ratio: masked mean of ρ.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from posttrain.algorithms.base import Algorithm, register
from posttrain.algorithms.ppo import clipped_coefficient
from posttrain.core.aggregation import masked_mean
from posttrain.core.batch import Batch
from posttrain.core.errors import ConfigError


@dataclass
class GRPOConfig:
    group_size: int = 8
    """G: completions sampled per prompt (at least 2, or there is no group to compare with)."""
    beta: float = 0.04
    """β: weight of the k3 KL penalty to the reference model; 0 loads no reference."""
    clip_eps: float = 0.2
    """ε: the ratio is clipped to [1 − ε, 1 + ε]."""
    clip_eps_high: float | None = None
    """Upper ε if different from `clip_eps` (DAPO clip-higher); null uses `clip_eps`."""
    mu: int = 1
    """μ: optimizer steps on each batch of samples, against the stored old log-probs."""
    scale_std: bool = True
    """Divide advantages by the group's reward std; false is Dr. GRPO's unscaled advantage."""
    eps: float = 1e-4
    """Added to the group std before dividing."""
    mask_truncated: bool = False
    """Leave completions that hit `rollout.max_new_tokens` without EOS out of the loss."""

    def __post_init__(self):
        if self.group_size < 2:
            raise ConfigError(f"group_size: GRPO needs at least 2 samples per prompt (got {self.group_size})")
        if self.beta < 0:
            raise ConfigError(f"beta: must be ≥ 0 (got {self.beta})")
        for key in ("clip_eps", "clip_eps_high", "eps"):
            value = getattr(self, key)
            if value is not None and value <= 0:
                raise ConfigError(f"{key}: must be > 0 (got {value})")
        if self.mu < 1:
            raise ConfigError(f"mu: must be ≥ 1 (got {self.mu})")


def group_stats(reward: torch.Tensor, group: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and (unbiased) std of each sample's group, for groups of any size and order.

    Args:
        reward: [B] rewards.
        group: [B] long, group index of each sample.

    Returns:
        ([B] group mean, [B] group std), one value per sample.
    """
    _, idx, size = torch.unique(group, return_inverse=True, return_counts=True)  # idx [B], size [n_groups]
    size = size.to(reward.dtype)
    mean = torch.zeros_like(size).index_add_(0, idx, reward) / size  # [n_groups]
    var = torch.zeros_like(size).index_add_(0, idx, (reward - mean[idx]) ** 2) / (size - 1).clamp(min=1)
    return mean[idx], var.sqrt()[idx]  # [B], [B]


def group_advantages(reward: torch.Tensor, group: torch.Tensor, scale_std: bool, eps: float) -> torch.Tensor:
    """Â_i = (r_i − mean of its group) / (std of its group + eps); [B] -> [B]."""
    mean, std = group_stats(reward, group)
    return (reward - mean) / (std + eps) if scale_std else reward - mean


@register("grpo")
class GRPO(Algorithm):
    Config = GRPOConfig
    source = "online"
    kl_penalty = True

    @staticmethod
    def needs(cfg: GRPOConfig) -> frozenset[str]:
        return frozenset({"reward"} | ({"ref_logp"} if cfg.beta > 0 else set()) | ({"old_logp"} if cfg.mu > 1 else set()))

    @staticmethod
    def samples_per_prompt(cfg: GRPOConfig) -> int:
        return cfg.group_size

    @staticmethod
    def epochs(cfg: GRPOConfig) -> int:
        return cfg.mu

    @staticmethod
    def prepare(batch: Batch, cfg: GRPOConfig) -> tuple[Batch, dict[str, torch.Tensor]]:
        # Group statistics use the whole batch, before it is split into micro-batches.
        adv = group_advantages(batch.reward, batch.group, cfg.scale_std, cfg.eps)  # [B]
        mask = batch.mask
        if cfg.mask_truncated:
            mask = mask * (~batch.truncated)[:, None].to(mask.dtype)  # [B, R]
        _, std = group_stats(batch.reward, batch.group)  # [B]
        metrics = {"reward_std": std.mean(), "zero_std_frac": (std == 0).float().mean()}
        return dataclasses.replace(batch, adv=adv, mask=mask), metrics

    @staticmethod
    def coefficient(batch: Batch, logp: torch.Tensor, cfg: GRPOConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        B, R = logp.shape
        assert batch.adv.shape == (B,) and batch.mask.shape == (B, R), "GRPO expects adv [B] and mask [B, R]"
        adv = batch.adv[:, None]  # [B, 1]
        old_logp = batch.old_logp if batch.old_logp is not None else logp  # [B, R]
        gc, metrics = clipped_coefficient(adv, logp, old_logp, batch.mask, cfg.clip_eps, cfg.clip_eps_high)  # [B, R]
        if cfg.beta > 0:
            ref_ratio = torch.exp(batch.ref_logp - logp)  # [B, R] π_ref / πθ
            gc = gc + cfg.beta * (ref_ratio - 1)
            metrics["kl"] = masked_mean(ref_ratio - torch.log(ref_ratio) - 1, batch.mask)
        return gc, metrics
