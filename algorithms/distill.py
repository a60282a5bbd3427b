"""On-policy distillation: the student samples, a frozen teacher scores every sampled token, and the per-token reverse
KL to the teacher is the signal.

Papers: Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from Self-Generated Mistakes" (GKD,
arXiv:2306.13649), with the reverse KL as the divergence and only the student's own samples (λ = 1); Thinking
Machines Lab 2025, "On-Policy Distillation", which samples, scores with the teacher and trains on the per-token
reverse KL as the advantage, with a discount of 0. Qwen3 (arXiv:2505.09388) distils its small models from its large
ones on-policy (its strong-to-weak distillation).

Objective: for prompts q, sample o ~ πθ(·|q) and minimise the reverse KL to the teacher π_T along the sampled
sequence, estimated per token on the tokens drawn:

    J(θ) = E_{o~πθ}[ (1/|o|) Σ_t ( log πθ(o_t | q, o_<t) − log π_T(o_t | q, o_<t) ) ].

Gradient coefficient (unified view): the per-token reverse KL, negated, is each token's advantage,

    A_t = log π_T(o_t | q, o_<t) − log π_old(o_t | q, o_<t),   GC_t = A_t · ρ_t · 1[ρ_t on the unclipped side],

computed with the log-probs of the policy that sampled (π_old, detached) and weighed by PPO's clipped ratio
ρ_t = πθ/π_old where a batch is trained on more than once (μ > 1). With μ = 1, ρ = 1 and

    GC_t = log π_T(o_t | q, o_<t) − log πθ(o_t | q, o_<t),

the formula of the unified view with a stop-gradient: positive where the teacher finds the student's token likelier
than the student does (push it up), negative where the student is overconfident (push it down).

Deviations from the papers:
    1. Each token's advantage is its own reverse KL only (a discount of 0, as Thinking Machines'): the exact score-function gradient of
       the sequence's reverse KL would also credit each token with the KL of the tokens after it. GKD back-propagates
       through the full per-token divergence over the vocabulary instead; this is its sampled, single-token estimate,
       which needs the teacher's log-prob of the drawn token only.
    2. The teacher's log-probs are scored at the sampling temperature, as the reference's are (the engine's rule for
       every frozen model), so at τ = 1 they are the teacher's own distribution.
    3. No reward is trained on: the judge's reward of the samples is logged (its mean shows the student's training
       accuracy), and no reference or KL penalty is used (the teacher plays that part).
    4. The 1/|o| average is the engine's `train.loss_agg` (`seq_mean_token_mean`, the default).

Metrics:
    reverse_kl: masked mean over the sampled tokens of log π_old − log π_T, the per-token estimate of
        KL(πθ ‖ π_T) at sampling time (0 when the student matches the teacher).
    teacher_logp: masked mean of log π_T of the sampled tokens.
    clip_frac, ratio: as GRPO's (μ > 1 only; 0 and 1 at μ = 1).
    objective: the clipped −ρ·A per token under `train.loss_agg`; at ρ = 1 its value is the reverse-KL estimate
        log πθ − log π_T.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from posttrain.algorithms.base import Algorithm, register
from posttrain.algorithms.common import check_clip_range, clipped_coefficient, clipped_objective
from posttrain.core.aggregation import masked_mean
from posttrain.core.batch import Batch
from posttrain.core.errors import ConfigError
from posttrain.core.frozen import Freezable


@dataclass
class DistillConfig(Freezable):
    samples_per_prompt: int = 1
    """Completions the student samples per prompt each step (at least 1)."""
    mu: int = 1
    """μ: optimizer steps on each batch; above 1 the advantage is kept from sampling time and PPO's clipped ratio
    weighs it."""
    clip_eps: float = 0.2
    """ε: with μ > 1, the ratio πθ/π_old is clipped to [1 − ε, 1 + ε_high]."""
    clip_eps_high: float | None = None
    """Upper ε if different from `clip_eps`; null uses `clip_eps`."""

    def __post_init__(self):
        if self.samples_per_prompt < 1:
            raise ConfigError(f"samples_per_prompt: must be ≥ 1 (got {self.samples_per_prompt})")
        if self.mu < 1:
            raise ConfigError(f"mu: must be ≥ 1 (got {self.mu})")
        for key in ("clip_eps", "clip_eps_high"):
            value = getattr(self, key)
            if value is not None and value <= 0:
                raise ConfigError(f"{key}: must be > 0 (got {value})")
        check_clip_range(self.clip_eps, self.clip_eps_high)


def advantage(batch: Batch, logp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(A = log π_T − log π_old, log π_old), each [B, R] and detached; π_old is the stored old log-probs, or `logp`
    itself where the step trains once on its batch."""
    B, R = logp.shape
    assert batch.teacher_logp is not None and batch.teacher_logp.shape == (B, R), "distill expects teacher_logp [B, R]"
    old = (batch.old_logp if batch.old_logp is not None else logp).detach()  # [B, R]
    return batch.teacher_logp - old, old  # [B, R], [B, R]


@register("distill")
class Distill(Algorithm):
    Config = DistillConfig
    source = "online"
    clips_ratio = True

    @staticmethod
    def needs(cfg: DistillConfig) -> frozenset[str]:
        return frozenset({"teacher_logp"} | ({"old_logp"} if cfg.mu > 1 else set()))

    @staticmethod
    def samples_per_prompt(cfg: DistillConfig) -> int:
        return cfg.samples_per_prompt

    @staticmethod
    def epochs(cfg: DistillConfig) -> int:
        return cfg.mu

    @classmethod
    def sized_config(cls, kl_weight: float, group: int) -> DistillConfig:
        return DistillConfig(samples_per_prompt=group)

    @staticmethod
    def coefficient(batch: Batch, logp: torch.Tensor, cfg: DistillConfig) -> tuple[torch.Tensor, dict]:
        adv, old = advantage(batch, logp)  # [B, R]
        gc, metrics = clipped_coefficient(adv, logp, old, batch.mask, cfg.clip_eps, cfg.clip_eps_high)  # [B, R]
        metrics["reverse_kl"] = masked_mean(-adv, batch.mask)
        metrics["teacher_logp"] = masked_mean(batch.teacher_logp, batch.mask)
        return gc, metrics

    @staticmethod
    def objective(batch: Batch, logp: torch.Tensor, cfg: DistillConfig) -> torch.Tensor:
        """−min(ρA, clip(ρ)A) per token, A = log π_T − log π_old held fixed; at ρ = 1, log πθ − log π_T."""
        adv, old = advantage(batch, logp)  # [B, R]
        return -clipped_objective(adv, logp, old, cfg.clip_eps, cfg.clip_eps_high)  # [B, R]
