"""Soft Adaptive Policy Optimization (SAPO): GRPO with a smooth, temperature-controlled gate on the ratio in place of
the hard clip, with one temperature for positive advantages and another for negative ones.

Paper: Gao et al. 2025, "Soft Adaptive Policy Optimization" (arXiv:2511.20347), §3.

Objective: sample G outputs {o_i} per question q from π_old, give each GRPO's group advantage Â_i, and maximise

    J(θ) = E[ (1/G) Σ_i (1/|o_i|) Σ_t f_{i,t}(ρ_{i,t}) Â_{i,t} ],     f_{i,t}(x) = (4/τ_{i,t}) σ(τ_{i,t} (x − 1)),
    τ_{i,t} = τ_pos if Â_{i,t} > 0 else τ_neg,

with ρ_{i,t} = πθ(o_{i,t}|q,o_{i,<t}) / π_old(o_{i,t}|q,o_{i,<t}) and σ the logistic function. Where PPO's clip cuts a
token's gradient to 0 the moment ρ leaves [1 − ε, 1 + ε] on the side that would raise the objective, the gate fades
it smoothly as ρ moves away from 1, on either side; τ_neg > τ_pos fades a token of negative advantage faster, as
lowering one token's probability moves mass onto every other token of the vocabulary.

Gradient coefficient: d f(ρ)/d log πθ = (4/τ) · τ σ(1 − σ) · ρ, so

    GC_{i,t} = w_{i,t} · ρ_{i,t} · Â_{i,t},   w_{i,t} = 4 σ(τ_{i,t}(ρ_{i,t} − 1)) (1 − σ(τ_{i,t}(ρ_{i,t} − 1))),

a weight w in (0, 1] that is 1 at ρ = 1: with μ = 1 the gradient is GRPO's, Â_{i,t}. SAPO differs from GRPO only once
updates are off-policy (μ > 1, stale samples, or π_old the sampler's), which is why `mu` defaults to 2 here.

Deviations from the paper:
    1. β > 0 adds GRPO's per-token k3 penalty to the reference, GC + β(π_ref/πθ − 1) (`common.k3_coefficient`); the
       paper has no KL term, so β defaults to 0.
    2. Â_i is GRPO's `group_advantages`, with `adv_norm`, `eps` and `mask_truncated` as in GRPO; the 1/G and 1/|o_i|
       averages are the engine's `train.loss_agg` (`seq_mean_token_mean`, the default, is the paper's).
    3. GRPO's `clip_eps` and `clip_eps_high` have no meaning here and are refused if set.

Metrics (GRPO's reward_std, zero_std_frac and, with β > 0, kl, plus):
    gate: masked mean of w over the tokens with Â ≠ 0 (1 on-policy; lower as the ratios leave 1).
    ratio: masked mean of ρ.
    objective: −J per token, −f(ρ)·Â (+ β·k3), under `train.loss_agg`. At ρ = 1 f = 2/τ, so its first term is about
        −(2/τ)·mean Â: near 0, as Â is centred in each group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from posttrain.algorithms.base import register
from posttrain.algorithms.grpo import GRPO, GRPOConfig
from posttrain.core.aggregation import masked_mean
from posttrain.core.errors import ConfigError


@dataclass
class SAPOConfig(GRPOConfig):
    """GRPO's keys, less the clip, plus the gate's two temperatures."""

    beta: float = 0.0
    """β: weight of GRPO's per-token k3 penalty to the reference; the paper has none (0 loads no reference)."""
    clip_eps: float | None = None
    """Not used: SAPO has no clip (its gate's temperatures set how off-policy tokens fade); must stay null."""
    clip_eps_high: float | None = None
    """Not used, as `clip_eps`; must stay null."""
    mu: int = 2
    """μ: optimizer steps on each batch; at μ = 1, ρ = 1, the gate's weight is 1 and SAPO's gradient is GRPO's."""
    tau_pos: float = 1.0
    """τ_pos: the gate's temperature on tokens of positive advantage (the paper's 1.0); larger fades faster (> 0)."""
    tau_neg: float = 1.05
    """τ_neg: the gate's temperature on tokens of negative advantage (the paper's 1.05, above τ_pos) (> 0)."""

    def check_clip(self) -> None:
        for key in ("clip_eps", "clip_eps_high"):
            if getattr(self, key) is not None:
                raise ConfigError(f"{key}: SAPO has no clip; its gate's temperatures tau_pos and tau_neg set how fast "
                                  "off-policy tokens fade (use recipe=sapo_math, or drop the key)")
        for key in ("tau_pos", "tau_neg"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"{key}: must be > 0 (got {getattr(self, key)})")


def gate(adv, logp, old_logp, cfg: SAPOConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(τ, σ(τ(ρ − 1)), ρ) per token, broadcast to [B, R], from Â ([B, 1] or [B, R]) and the log-probs [B, R]."""
    ratio = torch.exp(logp - old_logp)  # [B, R]
    tau = torch.where(adv > 0, cfg.tau_pos, cfg.tau_neg).to(ratio.dtype)  # [B, 1] or [B, R]
    return tau, torch.sigmoid(tau * (ratio - 1)), ratio  # [B, R] each (τ broadcast)


@register("sapo")
class SAPO(GRPO):
    Config = SAPOConfig

    @staticmethod
    def policy_coefficient(adv, logp, old_logp, mask, cfg: SAPOConfig) -> tuple[torch.Tensor, dict]:
        _, s, ratio = gate(adv, logp, old_logp, cfg)  # [B, R]
        weight = 4 * s * (1 - s)  # [B, R] w in (0, 1], 1 at ρ = 1
        gc = weight * ratio * adv  # [B, R]
        counted = mask * (adv != 0)  # [B, R]
        return gc, {"gate": masked_mean(weight, counted) if counted.any() else weight.new_ones(()),
                    "ratio": masked_mean(ratio, mask)}

    @staticmethod
    def policy_objective(adv, logp, old_logp, cfg: SAPOConfig) -> torch.Tensor:
        """f(ρ)·Â = (4/τ) σ(τ(ρ − 1))·Â per token."""
        tau, s, _ = gate(adv, logp, old_logp, cfg)  # [B, R]
        return 4 / tau * s * adv  # [B, R]
