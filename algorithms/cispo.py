"""Clipped IS-weight Policy Optimization (CISPO): GRPO whose importance weight is clipped and detached, so that no
token loses its gradient.

Paper: MiniMax-M1 (arXiv:2506.13585), §3.1, Eq. 4–5.

Objective: sample G outputs {o_i} per question q from π_old, give each GRPO's group advantage Â_i, and maximise

    J(θ) = E[ (1 / Σ_i |o_i|) Σ_i Σ_t sg(r̂_{i,t}) · Â_{i,t} · log πθ(o_{i,t} | q, o_{i,<t}) ],
    r̂_{i,t} = clip(ρ_{i,t}, 1 − ε_low, 1 + ε_high),   ρ_{i,t} = πθ(o_{i,t}|q,o_{i,<t}) / π_old(o_{i,t}|q,o_{i,<t}),

with sg the stop-gradient. PPO's and GRPO's min(ρÂ, clip(ρ)Â) gives a token outside the trust region no gradient at
all; the paper finds that the tokens clipped so are the rare, high-entropy "reflective" ones (However, Wait,
Recheck), which then stop being learned after the first update of a batch. CISPO bounds how much such a token weighs
instead of dropping it.

Gradient coefficient: J is already in the unified form, so

    GC_{i,t} = clip(ρ_{i,t}, 1 − ε_low, 1 + ε_high) · Â_{i,t}   (a constant of the gradient: detached),

which with μ = 1 (ρ = 1) is Â_{i,t}, GRPO's: CISPO differs from GRPO only once updates are off-policy (μ > 1, stale
samples, or π_old the sampler's), which is why `mu` defaults to 2 here.

Deviations from the paper:
    1. The 1 / Σ_i |o_i| of Eq. 4 is the engine's `train.loss_agg=token_mean`, which recipe=cispo_math sets; the
       plugin leaves the aggregation to the run, so that CISPO can be compared with GRPO under GRPO's.
    2. ε_low = 1 (the lower bound 0 never acts: the paper sets no lower bound); the paper tunes ε_high and publishes no
       value: 0.28 here, DAPO's upper ε.
    3. β > 0 adds GRPO's per-token k3 penalty to the reference, GC + β(π_ref/πθ − 1) (`common.k3_coefficient`); the
       paper has no KL term, so β defaults to 0.
    4. Â_i is GRPO's `group_advantages`, with `adv_norm`, `eps` and `mask_truncated` as in GRPO. The paper's optional
       token mask M_{i,t} (Eq. 6, which recovers PPO's clip) is not implemented: that is `algorithm.name=grpo`.

Metrics (GRPO's reward_std, zero_std_frac and, with β > 0, kl, plus):
    clip_frac: fraction of tokens with Â ≠ 0 whose weight the clip bounded (their gradient is kept, at the bound).
    ratio: masked mean of ρ.
    objective: −J per token, −sg(r̂)·Â·log πθ (+ β·k3), under `train.loss_agg`: the paper's J, whose gradient is the
        update's; its value moves with log πθ itself, not only with the advantage.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from posttrain.algorithms.base import register
from posttrain.algorithms.grpo import GRPO, GRPOConfig
from posttrain.core.aggregation import masked_mean
from posttrain.core.errors import ConfigError


@dataclass
class CISPOConfig(GRPOConfig):
    """GRPO's keys; `clip_eps` and `clip_eps_high` bound the importance weight, not the objective's ratio."""

    beta: float = 0.0
    """β: weight of GRPO's per-token k3 penalty to the reference; the paper has none (0 loads no reference)."""
    clip_eps: float = 1.0
    """ε_low: the weight is clipped below at 1 − ε_low, in (0, 1]; 1 sets no lower bound, as the paper."""
    clip_eps_high: float | None = 0.28
    """ε_high: the weight is clipped above at 1 + ε_high; null uses `clip_eps`."""
    mu: int = 2
    """μ: optimizer steps on each batch; at μ = 1, ρ = 1 and CISPO's gradient is GRPO's."""

    def check_clip(self) -> None:
        if self.clip_eps > 1:
            raise ConfigError(f"clip_eps: CISPO clips its weight below at 1 − ε_low, so ε_low is at most 1 (no lower "
                              f"bound); got {self.clip_eps}")


def clipped_weight(logp, old_logp, cfg: CISPOConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(r̂ = clip(ρ, 1 − ε_low, 1 + ε_high) detached, ρ), each [B, R], from log πθ and log π_old [B, R]."""
    ratio = torch.exp(logp - old_logp).detach()  # [B, R]
    high = cfg.clip_eps if cfg.clip_eps_high is None else cfg.clip_eps_high
    return ratio.clamp(1 - cfg.clip_eps, 1 + high), ratio  # [B, R], [B, R]


@register("cispo")
class CISPO(GRPO):
    Config = CISPOConfig

    @staticmethod
    def policy_coefficient(adv, logp, old_logp, mask, cfg: CISPOConfig) -> tuple[torch.Tensor, dict]:
        weight, ratio = clipped_weight(logp, old_logp, cfg)  # [B, R]
        gc = weight * adv  # [B, R] sg(r̂)·Â
        bounded = (weight != ratio) & (adv != 0)  # [B, R]
        return gc, {"clip_frac": masked_mean(bounded.float(), mask), "ratio": masked_mean(ratio, mask)}

    @staticmethod
    def policy_objective(adv, logp, old_logp, cfg: CISPOConfig) -> torch.Tensor:
        """sg(r̂)·Â·log πθ per token, Eq. 4's term."""
        weight, _ = clipped_weight(logp, old_logp, cfg)  # [B, R]
        return weight * adv * logp  # [B, R]
