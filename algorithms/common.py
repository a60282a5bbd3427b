"""Tensor functions that more than one method uses, so that no method imports another one's file for them.

A plugin file imports another plugin file only to extend its class (GRPO+PS, RLOO, REINFORCE++ and GSPO extend GRPO).
Everything here is a pure function of tensors and hyperparameters; the papers behind each are cited in the docstrings
of the methods that use them:

- advantages: `group_stats`, `group_median`, `group_advantages` (GRPO and its family, and the judge's
  `rewards.normalize`); `kl_reward`, `gae`, `whiten` (PPO, REINFORCE++);
- the clipped ratio of PPO: `clipped_coefficient` (its GC), `clipped_objective` (its value) and `check_clip_range`
  (its config);
- the k3 KL penalty of GRPO's Eq. 4: `k3_coefficient` (its GC) and `k3_penalty` (its value);
- the indicator of RFT and Online RFT: `indicator_coefficient`.
"""

from __future__ import annotations

import math

import torch

from posttrain.core.aggregation import masked_mean
from posttrain.core.batch import Batch
from posttrain.core.errors import ConfigError

ADV_NORMS = ("mean_std", "median_mad", "none")
MAD_TO_STD = 1.4826  # 1/Φ⁻¹(3/4): σ ≈ 1.4826·MAD for normal data
MEAN_AD_TO_STD = math.sqrt(math.pi / 2)  # σ = √(π/2)·E|x − median| for normal data


def group_stats(reward: torch.Tensor, group: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and unbiased std of each sample's group, for groups of any size and order: [B] rewards and [B] group ids
    -> ([B] group mean, [B] group std), one value per sample."""
    _, idx, size = torch.unique(group, return_inverse=True, return_counts=True)  # idx [B], size [n_groups]
    size = size.to(reward.dtype)
    mean = torch.zeros_like(size).index_add_(0, idx, reward) / size  # [n_groups]
    var = torch.zeros_like(size).index_add_(0, idx, (reward - mean[idx]) ** 2) / (size - 1).clamp(min=1)
    return mean[idx], var.sqrt()[idx]  # [B], [B]


def group_median(x: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """Median of each sample's group, the mean of the two middle values when its size is even; [B] -> [B]."""
    _, idx, size = torch.unique(group, return_inverse=True, return_counts=True)  # idx [B], size [n_groups]
    by_value = torch.argsort(x, stable=True)  # [B]
    order = by_value[torch.argsort(idx[by_value], stable=True)]  # [B] by group, then by value within the group
    start = size.cumsum(0) - size  # [n_groups] where each group begins in `order`
    ranked = x[order]  # [B]
    return ((ranked[start + (size - 1) // 2] + ranked[start + size // 2]) / 2)[idx]  # [B]


def group_advantages(reward: torch.Tensor, group: torch.Tensor, norm: str, eps: float) -> torch.Tensor:
    """Â_i from the rewards of its group, by `norm` (one of ADV_NORMS); [B] -> [B].

    mean_std: (r_i − mean) / (std + eps);  none: r_i − mean;  median_mad: (r_i − median) / (1.4826·MAD + eps), with
    √(π/2)·mean |r − median| as the scale where MAD is 0."""
    if norm == "median_mad":
        median = group_median(reward, group)  # [B]
        dev = (reward - median).abs()  # [B]
        scale = MAD_TO_STD * group_median(dev, group)  # [B]
        scale = torch.where(scale > 0, scale, MEAN_AD_TO_STD * group_stats(dev, group)[0])  # [B]
        return (reward - median) / (scale + eps)
    mean, std = group_stats(reward, group)
    return (reward - mean) / (std + eps) if norm == "mean_std" else reward - mean


def kl_reward(reward, old_logp, ref_logp, mask, beta: float) -> torch.Tensor:
    """Per-token reward of Eq. 2 [B, R]: −β(old_logp − ref_logp) on response tokens, plus `reward` [B] at the last."""
    token_reward = torch.zeros_like(old_logp) if ref_logp is None else -beta * (old_logp - ref_logp) * mask  # [B, R]
    R = mask.shape[1]
    last = (mask * torch.arange(1, R + 1, device=mask.device)).argmax(-1, keepdim=True)  # [B, 1] the last model token
    final = (reward * mask.any(-1)).to(token_reward.dtype)[:, None]  # [B, 1]; empty rows get nothing
    return token_reward.scatter_add(1, last, final)  # [B, R]


def gae(token_reward, values, mask, gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE (arXiv:1506.02438): one reverse pass over t, vectorised over the batch. r_t `token_reward`, V_t `values`
    (the state before token t) and `mask` are [B, R]; V after the last token is 0. The pass runs over the tokens
    where `mask` is 1 and steps over the others: a multi-turn episode's environment tokens are no action of the
    model's, so the token before them bootstraps from the model's next token (as if they were not there).
    Returns ([B, R] advantages A_t, [B, R] returns A_t + V_t), both 0 outside the mask."""
    B, R = values.shape
    adv = torch.zeros_like(values)  # [B, R]
    running, next_value = values.new_zeros(B), values.new_zeros(B)  # [B] A and V at the next masked token
    for t in reversed(range(R)):
        m = mask[:, t].bool()  # [B]
        a = token_reward[:, t] + gamma * next_value - values[:, t] + gamma * lam * running  # [B]
        adv[:, t] = torch.where(m, a, adv.new_zeros(()))
        running = torch.where(m, a, running)
        next_value = torch.where(m, values[:, t], next_value)
    return adv, (adv + values) * mask  # [B, R], [B, R]


def whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x − mean) / std over the positions where `mask` is 1 (population std); [B, R] -> [B, R], 0 outside."""
    mean = masked_mean(x, mask)  # []
    var = masked_mean((x - mean) ** 2, mask)  # []
    return (x - mean) * torch.rsqrt(var + eps) * mask  # [B, R]


def check_clip_range(clip_eps: float, clip_eps_high: float | None) -> None:
    """The ratio is kept in [1 − ε_low, 1 + ε_high]: DAPO's clip-higher widens the upper side (ε_high ≥ ε_low); a
    narrower one is refused, as likely a typo for ε_low, naming both."""
    if clip_eps_high is not None and clip_eps_high < clip_eps:
        raise ConfigError(f"clip_eps_high: {clip_eps_high} is below clip_eps={clip_eps}; the upper bound 1 + ε_high "
                          "clips higher than 1 − ε_low clips low (DAPO's clip-higher, e.g. 0.28 over 0.2): raise it, or "
                          "null for clip_eps on both sides")


def clipped_coefficient(adv, logp, old_logp, mask, clip_eps: float, clip_eps_high: float | None):
    """GC of min(ρA, clip(ρ, 1 − ε, 1 + ε_high)A): A·ρ where the min keeps the unclipped term, else 0 (ρ left the
    trust region on the side that would raise the objective). `adv` is [B, R], or [B, 1] for GRPO; the rest [B, R].
    Returns (gc [B, R], {"clip_frac", "ratio"})."""
    ratio = torch.exp(logp - old_logp)  # [B, R]
    high = 1 + (clip_eps_high if clip_eps_high is not None else clip_eps)
    unclipped = torch.where(adv > 0, ratio <= high, ratio >= 1 - clip_eps)  # [B, R]
    gc = adv * ratio * unclipped  # [B, R]
    metrics = {"clip_frac": masked_mean((~unclipped & (adv != 0)).float(), mask), "ratio": masked_mean(ratio, mask)}
    return gc, metrics


def clipped_objective(adv, logp, old_logp, clip_eps: float, clip_eps_high: float | None) -> torch.Tensor:
    """min(ρA, clip(ρ, 1 − ε, 1 + ε_high)A) per token, ρ = exp(logp − old_logp), differentiable in `logp`: the value
    whose derivative in log πθ is `clipped_coefficient`'s GC. Shapes as there; returns [B, R] (or [B, 1])."""
    rho = (logp - old_logp).exp()  # [B, R]
    upper = 1 + (clip_eps if clip_eps_high is None else clip_eps_high)
    return torch.minimum(rho * adv, rho.clamp(1 - clip_eps, upper) * adv)  # [B, R]


def k3_coefficient(batch: Batch, logp: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """GC of the per-token penalty −β·D_KL (k3, Eq. 4), β(π_ref/πθ − 1) [B, R], and the masked mean of k3 []."""
    ref_ratio = torch.exp(batch.ref_logp - logp)  # [B, R] π_ref / πθ
    return beta * (ref_ratio - 1), masked_mean(ref_ratio - torch.log(ref_ratio) - 1, batch.mask)


def k3_penalty(ref_logp: torch.Tensor, logp: torch.Tensor, beta: float) -> torch.Tensor:
    """β·D_KL per token by the k3 estimate of Eq. 4, β(π_ref/πθ − log(π_ref/πθ) − 1), differentiable in `logp`: the
    value whose derivative in log πθ is minus `k3_coefficient`'s GC; [B, R] -> [B, R]."""
    log_ref_ratio = ref_logp - logp  # [B, R] log(π_ref / πθ)
    return beta * (log_ref_ratio.exp() - log_ref_ratio - 1)  # [B, R]


def indicator_coefficient(batch: Batch, logp: torch.Tensor, threshold: float) -> torch.Tensor:
    """GC = I(o): 1 on every token of a sequence whose reward reaches `threshold`, else 0; [B, R]."""
    B, R = logp.shape
    assert batch.reward.shape == (B,), f"reward must be [B] = [{B}], got {tuple(batch.reward.shape)}"
    correct = (batch.reward >= threshold).to(logp.dtype)  # [B]
    return correct[:, None].expand(B, R)  # [B, R]
