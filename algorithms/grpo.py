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
    1. The std gets `eps` added (as in most implementations) so groups with equal rewards give Â = 0, not NaN.
       `adv_norm` picks the group normalisation (`group_advantages`): `mean_std`, the paper's; `none`, r − mean
       (Dr. GRPO, arXiv:2503.20783); `median_mad`, the robust (r − median) / (1.4826·MAD + eps) with
       MAD = median |r − median| over the group (Hampel 1974, JASA 69:383; 1.4826 = 1/Φ⁻¹(3/4) makes 1.4826·MAD a
       consistent estimate of σ for normal data). The median of a group of even size is the mean of its two middle
       values. MAD is 0 once more than half of a group agree (most groups of 0/1 rewards), and Â would be ±1/eps;
       the scale is then √(π/2)·mean |r − median|, also consistent for σ.
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
    objective: −J, the per-token −min(ρÂ, clip(ρ)Â) + β·k3 under `train.loss_agg` (the loss's sign: lower is
        better). At ρ = 1 its first term is −mean Â, about 0 as Â is centred in each group, so at μ = 1 it moves
        mostly with the KL term.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch

from posttrain.algorithms.base import Algorithm, register
from posttrain.algorithms.common import (
    ADV_NORMS,
    check_clip_range,
    clipped_coefficient,
    clipped_objective,
    group_advantages,
    group_stats,
    k3_coefficient,
    k3_penalty,
)
from posttrain.core.batch import Batch
from posttrain.core.errors import ConfigError
from posttrain.core.frozen import Freezable


@dataclass
class GRPOConfig(Freezable):
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
    adv_norm: str = "mean_std"
    """Group normalisation of Â: mean_std (paper), none (r − mean, Dr. GRPO) or median_mad (robust; see deviation 1)."""
    eps: float = 1e-4
    """Added to the group's scale (std, or 1.4826·MAD) before dividing."""
    mask_truncated: bool = False
    """Leave completions that hit `rollout.max_new_tokens` without EOS out of the loss."""

    MIN_GROUP: ClassVar[int] = 2  # G below this leaves nothing to compare with; a method without groups lowers it

    @property
    def kl_in_loss(self) -> bool:
        """Whether β weighs the k3 penalty in the loss (GRPO); methods that put the KL in the reward instead, scored
        with the sampling policy's log-probs, say false (RLOO, REINFORCE++: `kl_in_reward`)."""
        return True

    def check_clip(self) -> None:
        """The clip range of the ratio (`common.check_clip_range`); a method that bounds the ratio otherwise (CISPO's
        weight, SAPO's gate) checks its own keys instead."""
        check_clip_range(self.clip_eps, self.clip_eps_high)

    def __post_init__(self):
        if self.group_size < self.MIN_GROUP:
            method = type(self).__name__.removesuffix("Config")
            raise ConfigError(f"group_size: {method} needs at least {self.MIN_GROUP} samples per prompt (got "
                              f"{self.group_size})")
        if self.adv_norm not in ADV_NORMS:
            raise ConfigError(f"adv_norm: unknown {self.adv_norm!r}; known: {', '.join(ADV_NORMS)}")
        if self.beta < 0:
            raise ConfigError(f"beta: must be ≥ 0 (got {self.beta})")
        for key in ("clip_eps", "clip_eps_high", "eps"):
            value = getattr(self, key)
            if value is not None and value <= 0:
                raise ConfigError(f"{key}: must be > 0 (got {value})")
        self.check_clip()
        if self.mu < 1:
            raise ConfigError(f"mu: must be ≥ 1 (got {self.mu})")


@register("grpo")
class GRPO(Algorithm):
    Config = GRPOConfig
    source = "online"
    kl_penalty = True
    clips_ratio = True

    @classmethod
    def sized_config(cls, kl_weight: float, group: int) -> GRPOConfig:
        return dataclasses.replace(cls.Config(), beta=kl_weight, group_size=group)

    @staticmethod
    def needs(cfg: GRPOConfig) -> frozenset[str]:
        old = cfg.mu > 1 or (cfg.beta > 0 and not cfg.kl_in_loss)  # the KL in the reward is π_old's
        return frozenset({"reward"} | ({"ref_logp"} if cfg.beta > 0 else set()) | ({"old_logp"} if old else set()))

    @staticmethod
    def samples_per_prompt(cfg: GRPOConfig) -> int:
        return cfg.group_size

    @staticmethod
    def epochs(cfg: GRPOConfig) -> int:
        return cfg.mu

    @staticmethod
    def prepare(batch: Batch, cfg: GRPOConfig) -> tuple[Batch, dict[str, torch.Tensor]]:
        # Group statistics use the whole batch, before it is split into micro-batches.
        adv = group_advantages(batch.reward, batch.group, cfg.adv_norm, cfg.eps)  # [B]
        mask = batch.mask
        if cfg.mask_truncated:
            mask = mask * (~batch.truncated)[:, None].to(mask.dtype)  # [B, R]
        _, std = group_stats(batch.reward, batch.group)  # [B]
        metrics = {"reward_std": std.mean(), "zero_std_frac": (std == 0).float().mean()}
        return dataclasses.replace(batch, adv=adv, mask=mask), metrics

    @staticmethod
    def token_advantage(batch: Batch, logp: torch.Tensor) -> torch.Tensor:
        """Â per token, broadcast against [B, R]: outcome supervision gives one per sample, [B] -> [B, 1]. A method
        of the family with a per-token advantage (GRPO+PS, REINFORCE++) overrides this alone."""
        B, R = logp.shape
        assert batch.adv.shape == (B,) and batch.mask.shape == (B, R), "GRPO expects adv [B] and mask [B, R]"
        return batch.adv[:, None]  # [B, 1]

    @staticmethod
    def policy_coefficient(adv, logp, old_logp, mask, cfg: GRPOConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """GC of the policy term alone, from Â ([B, 1] or [B, R]), log πθ and log π_old ([B, R]): PPO's clipped ratio,
        Â·ρ·1[unclipped]. A method of the family that weighs the ratio otherwise (CISPO, SAPO) overrides this and
        `policy_objective` alone. Returns (gc [B, R], metrics)."""
        return clipped_coefficient(adv, logp, old_logp, mask, cfg.clip_eps, cfg.clip_eps_high)

    @staticmethod
    def policy_objective(adv, logp, old_logp, cfg: GRPOConfig) -> torch.Tensor:
        """The policy term of J per token, min(ρÂ, clip(ρ)Â), differentiable in `logp`: the value whose derivative in
        log πθ is `policy_coefficient`'s GC. [B, R]."""
        return clipped_objective(adv, logp, old_logp, cfg.clip_eps, cfg.clip_eps_high)

    @classmethod
    def coefficient(cls, batch: Batch, logp: torch.Tensor, cfg: GRPOConfig) -> tuple[torch.Tensor, dict]:
        adv = cls.token_advantage(batch, logp)  # [B, 1] (or [B, R] where a subclass says so)
        old_logp = batch.old_logp if batch.old_logp is not None else logp  # [B, R]
        gc, metrics = cls.policy_coefficient(adv, logp, old_logp, batch.mask, cfg)  # [B, R]
        if cfg.beta > 0 and cfg.kl_in_loss:
            kl_gc, metrics["kl"] = k3_coefficient(batch, logp, cfg.beta)  # [B, R], []
            gc = gc + kl_gc
        return gc, metrics

    @classmethod
    def objective(cls, batch: Batch, logp: torch.Tensor, cfg: GRPOConfig) -> torch.Tensor:
        """−min(ρÂ, clip(ρ)Â) + β·k3 per token, the negated term of Eq. 3 (k3 only where the KL is in the loss)."""
        adv = cls.token_advantage(batch, logp)  # [B, 1] (or [B, R])
        old_logp = logp.detach() if batch.old_logp is None else batch.old_logp  # [B, R]; at μ = 1 π_old is πθ
        value = -cls.policy_objective(adv, logp, old_logp, cfg)  # [B, R]
        if cfg.kl_in_loss and cfg.beta > 0:
            value = value + k3_penalty(batch.ref_logp, logp, cfg.beta)  # [B, R]
        return value
