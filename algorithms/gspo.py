"""Group Sequence Policy Optimization (GSPO): GRPO with the importance ratio and its clip at the sequence level.

Paper: Zheng et al. 2025, "Group Sequence Policy Optimization" (arXiv:2507.18071), §4.1 (Eq. 5, 7).

Objective: sample G outputs {o_i} per question q from π_old, give each GRPO's group advantage Â_i, and maximise

    J(θ) = E[ (1/G) Σ_i min(s_i Â_i, clip(s_i, 1 − ε_low, 1 + ε_high) Â_i) ],
    s_i(θ) = (πθ(o_i|q) / π_old(o_i|q))^(1/|o_i|) = exp((1/|o_i|) Σ_t (log πθ(o_{i,t}|q,o_{i,<t}) − log π_old(·))),

the length-normalised sequence likelihood ratio, over the response tokens of o_i alone (its mask).

Gradient coefficient: ∇s_i = s_i (1/|o_i|) Σ_t ∇log πθ(o_{i,t}), so

    ∇J = E[ (1/G) Σ_i s_i Â_i 1[s_i on the unclipped side of the min] (1/|o_i|) Σ_t ∇log πθ(o_{i,t}) ],

    GC_{i,t} = s_i · Â_i · 1[unclipped_i], the same for every token of o_i (GRPO's is ρ_{i,t} · Â_i per token),

aggregated as (1/G) Σ_i (1/|o_i|) Σ_t: the plugin fixes `seq_mean_token_mean`, as the objective is per sequence.
With μ = 1 and no old log-probs, s_i = 1 and the gradient is GRPO's under `seq_mean_token_mean` (Â_i (1/|o_i|)
Σ_t ∇log πθ); the two differ only once updates are off-policy (μ > 1), which is why `mu` defaults to 2 here.

Deviations from the paper:
    1. β > 0 adds GRPO's per-token k3 penalty to the reference, GC + β(π_ref/πθ − 1) (`common.k3_coefficient`); the
       paper has no KL term, so β defaults to 0.
    2. Â_i is GRPO's `group_advantages`: the paper's (r_i − mean)/std by default, with `adv_norm`, `eps` and
       `mask_truncated` as in GRPO.
    3. One form only: TRL's "GSPO-token" variant (a per-token ratio s_i·πθ/sg[πθ]) is not implemented.
    4. μ counts passes over the whole batch; the paper splits each rollout batch into minibatches instead.

Metrics (GRPO's reward_std, zero_std_frac and, with β > 0, kl, plus):
    clip_frac: fraction of sequences whose gradient the clip removed, among those with Â ≠ 0.
    ratio: mean of s_i over the sequences in the loss.
    objective: −J, the mean over sequences of −min(s_i Â_i, clip(s_i) Â_i) (+ β times the k3 of each token, averaged
        over the sequence's tokens, with β > 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from posttrain.algorithms.base import register
from posttrain.algorithms.common import clipped_coefficient, clipped_objective, k3_coefficient, k3_penalty
from posttrain.algorithms.grpo import GRPO, GRPOConfig
from posttrain.core.aggregation import masked_mean
from posttrain.core.batch import Batch
from posttrain.core.errors import ConfigError


@dataclass
class GSPOConfig(GRPOConfig):
    """GRPO's keys, with the paper's defaults for the clip and the KL, and μ = 2 so that the sequence ratio acts."""

    beta: float = 0.0
    """β: weight of GRPO's per-token k3 penalty to the reference; the paper has none (0 loads no reference)."""
    clip_eps: float = 3e-4
    """ε_low: s_i is clipped below at 1 − ε_low (the paper's 3e-4: s_i is a per-token geometric mean, close to 1)."""
    clip_eps_high: float | None = 4e-4
    """ε_high: s_i is clipped above at 1 + ε_high (the paper's 4e-4); null uses `clip_eps`."""
    mu: int = 2
    """μ: optimizer steps on each batch; at μ = 1, s_i = 1 and GSPO's gradient is GRPO's."""

    def __post_init__(self):
        if self.clip_eps_high is not None and self.clip_eps_high < self.clip_eps:
            # what `recipe=grpo_math algorithm.name=gspo` gives: GRPO's token ε with GSPO's sequence ε_high
            raise ConfigError(f"clip_eps_high: {self.clip_eps_high} is below clip_eps={self.clip_eps}; GSPO clips a "
                              "sequence ratio, with its own range (the paper's 3e-4 and 4e-4): use recipe=gspo_math, "
                              "or set both")
        super().__post_init__()  # after GSPO's own range check, whose message says more than GRPO's


def sequence_log_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log s_i = (1/|o_i|) Σ_t (logp − old_logp) over each sequence's response tokens; [B, R] -> [B, 1]."""
    return ((logp - old_logp) * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)


@register("gspo")
class GSPO(GRPO):
    Config = GSPOConfig

    @staticmethod
    def aggregation(cfg: GSPOConfig) -> tuple[str, float]:
        return "seq_mean_token_mean", 1.0

    @staticmethod
    def coefficient(batch: Batch, logp: torch.Tensor, cfg: GSPOConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        B, R = logp.shape
        assert batch.adv.shape == (B,) and batch.mask.shape == (B, R), "GSPO expects adv [B] and mask [B, R]"
        old_logp = batch.old_logp if batch.old_logp is not None else logp  # [B, R]
        log_s = sequence_log_ratio(logp, old_logp, batch.mask)  # [B, 1]
        # PPO's clip with one "token" per sequence: exp(log_s − 0) is s_i; the metrics count sequences with Â ≠ 0.
        counted = ((batch.adv != 0) & (batch.mask.sum(-1) > 0)).to(logp.dtype)[:, None]  # [B, 1]
        gc, metrics = clipped_coefficient(batch.adv[:, None], log_s, torch.zeros_like(log_s), counted, cfg.clip_eps,
                                          cfg.clip_eps_high)  # [B, 1] s_i Â_i 1[unclipped_i]
        metrics["ratio"] = masked_mean(log_s.exp(), (batch.mask.sum(-1, keepdim=True) > 0).to(logp.dtype))
        gc = gc.expand(B, R)  # [B, R] every token of o_i
        if cfg.beta > 0:
            kl_gc, metrics["kl"] = k3_coefficient(batch, logp, cfg.beta)  # [B, R], []
            gc = gc + kl_gc
        return gc, metrics

    @staticmethod
    def objective(batch: Batch, logp: torch.Tensor, cfg: GSPOConfig) -> torch.Tensor:
        """−min(s_i Â_i, clip(s_i) Â_i) on every token of o_i (its mean over the tokens is the sequence's term), plus
        β·k3 per token."""
        B, R = logp.shape
        old_logp = logp.detach() if batch.old_logp is None else batch.old_logp  # [B, R]; at μ = 1 π_old is πθ
        log_s = sequence_log_ratio(logp, old_logp, batch.mask)  # [B, 1] log s_i
        value = -clipped_objective(batch.adv[:, None], log_s, torch.zeros_like(log_s), cfg.clip_eps,
                                   cfg.clip_eps_high).expand(B, R)  # [B, R]
        if cfg.beta > 0:
            value = value + k3_penalty(batch.ref_logp, logp, cfg.beta)  # [B, R]
        return value
