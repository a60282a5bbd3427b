"""Proximal Policy Optimization (PPO) with a learned critic and a KL-shaped per-token reward.

Paper: DeepSeekMath (arXiv:2402.03300), §4.1, Eq. 1–2 and Appendix A.1.5; the KL-shaped reward follows Ouyang et al.
2022 (InstructGPT, arXiv:2203.02155); advantages are GAE (Schulman et al. 2016, arXiv:1506.02438).

Objective: sample o ~ π_old for each question q and maximise (Eq. 1)

    J(θ) = E[ (1/|o|) Σ_t min(ρ_t A_t, clip(ρ_t, 1−ε, 1+ε) A_t) ],   ρ_t = πθ(o_t|q,o_<t) / π_old(o_t|q,o_<t),

where A_t is GAE over the per-token reward of Eq. 2, the sequence reward r_φ(q, o) at the last token and a KL
penalty to the reference model on every token:

    r_t = r_φ(q, o)·1[t = |o|] − β log(π_old(o_t|q,o_<t) / π_ref(o_t|q,o_<t)),
    δ_t = r_t + γ V_{t+1} − V_t (V_{|o|+1} = 0),   A_t = δ_t + γλ A_{t+1},   returns R_t = A_t + V_t.

Gradient coefficient (unified view, Eq. 18): d/dlogπθ of the per-token term gives GC_t = A_t · ρ_t · 1[ρ on the
unclipped side of the min], which with one update per batch (ρ = 1) is the paper's A_t; the KL is in the reward, not GC.

Critic: V_ψ (the policy's architecture with a scalar head per position) minimises, as a `token_mean` over response
tokens (`critic_aggregation`), the clipped value loss L_V = 0.5·max((V_t − R_t)², (clip(V_t, V_old,t ± ε_v) − R_t)²).

Deviations from the paper:
    1. The KL in the reward is the k1 estimate log π_old − log π_ref of the sampled token, fixed for the batch (as in
       Ouyang et al.); Eq. 2 writes πθ, which is π_old when the batch is sampled. r_φ is the rule reward, plus a
       reward model's score if the run's `reward_model.path` is set.
    2. Advantages are whitened over the batch's response tokens (`whiten_advantages`), as common implementations do.
    3. The value loss is clipped around the sampling-time values (`value_clip`; null or 0: off); the critic has its
       own optimizer and learning rate (`critic_lr`).
    4. Each batch gets `ppo_epochs` passes of `num_minibatches` optimizer steps (the paper's μ is their product).
       The 1/|o| average is the engine's `train.loss_agg`.
    5. `clip_eps_high` allows a separate upper clip bound (DAPO "clip-higher", arXiv:2503.14476); off by default.

Metrics (means over response tokens unless said otherwise):
    kl: the k1 estimate log π_old − log π_ref per token (only with β > 0).
    seq_reward: mean over sequences of the sequence reward r_φ(q, o) that enters the shaped reward.
    value, returns: the sampling-time critic's values V_old, and the GAE returns R_t (the critic's targets).
    clip_frac, ratio: fraction of tokens whose policy gradient the clip removed, and ρ.
    value_clip_frac, value_error: fraction of tokens whose value gradient the value clip removed, and |V − R|.
    explained_variance: 1 − Var(R − V) / Var(R) (1: perfect critic, ≤ 0: no better than a constant).
    objective: −J, the mean of −min(ρA, clip(ρ, 1−ε, 1+ε)A) under `train.loss_agg` (at ρ = 1, −mean A: about 0
        with whitened advantages).
    critic_loss: the value loss L_V under its `token_mean`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from posttrain.algorithms.base import Algorithm, register
from posttrain.algorithms.common import check_clip_range, clipped_coefficient, clipped_objective, gae, kl_reward, whiten
from posttrain.core.aggregation import masked_mean
from posttrain.core.batch import Batch
from posttrain.core.errors import ConfigError
from posttrain.core.frozen import Freezable


@dataclass
class PPOConfig(Freezable):
    samples_per_prompt: int = 1
    """Completions sampled per prompt."""
    beta: float = 0.05
    """β: weight of the KL penalty to the reference model in the per-token reward; 0 loads no reference."""
    clip_eps: float = 0.2
    """ε: the ratio is clipped to [1 − ε, 1 + ε]."""
    clip_eps_high: float | None = None
    """Upper ε if different from `clip_eps` (DAPO clip-higher); null uses `clip_eps`."""
    value_clip: float | None = 0.2
    """ε_v: new values are clipped to within ε_v of the sampling-time values in the value loss; null or 0: no clip."""
    gamma: float = 1.0
    """γ: discount of future rewards in GAE."""
    lam: float = 0.95
    """λ: GAE's bias–variance trade-off (1: Monte-Carlo returns, 0: one-step TD)."""
    ppo_epochs: int = 2
    """Passes over each batch of samples."""
    num_minibatches: int = 2
    """Minibatches each pass is split into, one optimizer step each."""
    whiten_advantages: bool = True
    """Normalise advantages to mean 0 and std 1 over the batch's response tokens."""
    critic_lr: float = 1e-4
    """Learning rate of the critic's optimizer."""
    critic_path: str | None = None
    """Local HF directory of the critic's starting weights; null: the policy's weights with a new scalar head."""

    def __post_init__(self):
        rules = [(("samples_per_prompt", "ppo_epochs", "num_minibatches"), "≥ 1", lambda v: v >= 1),
                 (("beta", "value_clip"), "≥ 0", lambda v: v >= 0),
                 (("clip_eps", "clip_eps_high", "critic_lr"), "> 0", lambda v: v > 0),
                 (("gamma", "lam"), "in [0, 1]", lambda v: 0 <= v <= 1)]
        for keys, rule, ok in rules:
            for key in keys:
                value = getattr(self, key)  # None (where allowed) means "off" and is always valid
                if value is not None and not ok(value):
                    raise ConfigError(f"{key}: must be {rule} (got {value})")
        check_clip_range(self.clip_eps, self.clip_eps_high)


@register("ppo")
class PPO(Algorithm):
    Config = PPOConfig
    source = "online"
    learned_reward = True
    kl_penalty = True
    clips_ratio = True

    @classmethod
    def sized_config(cls, kl_weight: float, group: int) -> PPOConfig:
        """β is the KL weight; samples per prompt keep their default (`group` is GRPO's G)."""
        return dataclasses.replace(cls.Config(), beta=kl_weight)

    @staticmethod
    def needs(cfg: PPOConfig) -> frozenset[str]:
        return frozenset({"reward", "old_logp", "values"} | ({"ref_logp"} if cfg.beta > 0 else set()))

    @staticmethod
    def samples_per_prompt(cfg: PPOConfig) -> int:
        return cfg.samples_per_prompt

    @staticmethod
    def epochs(cfg: PPOConfig) -> int:
        return cfg.ppo_epochs

    @staticmethod
    def minibatches(cfg: PPOConfig) -> int:
        """Optimizer steps per epoch: the engine splits each batch into this many minibatches."""
        return cfg.num_minibatches

    @staticmethod
    def prepare(batch: Batch, cfg: PPOConfig) -> tuple[Batch, dict[str, torch.Tensor]]:
        mask, values = batch.mask, batch.extra["values"]  # [B, R], [B, R] V_old
        assert batch.old_logp.shape == mask.shape == values.shape, "PPO expects old_logp, values and mask [B, R]"
        ref_logp = batch.ref_logp if cfg.beta > 0 else None  # [B, R] or None
        token_reward = kl_reward(batch.reward, batch.old_logp, ref_logp, mask, cfg.beta)  # [B, R]
        # GAE runs over the whole batch before it is split, so whitening sees every token.
        adv, returns = gae(token_reward, values, mask, cfg.gamma, cfg.lam)  # [B, R], [B, R]
        if cfg.whiten_advantages:
            adv = whiten(adv, mask)  # [B, R]
        metrics = {"seq_reward": batch.reward.float().mean(), "value": masked_mean(values, mask),
                   "returns": masked_mean(returns, mask)}
        if ref_logp is not None:
            metrics["kl"] = masked_mean(batch.old_logp - ref_logp, mask)
        return dataclasses.replace(batch, adv=adv, extra={**batch.extra, "returns": returns}), metrics

    @staticmethod
    def coefficient(batch: Batch, logp: torch.Tensor, cfg: PPOConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        assert batch.adv.shape == batch.mask.shape == batch.old_logp.shape == logp.shape, "PPO expects adv [B, R]"
        return clipped_coefficient(batch.adv, logp, batch.old_logp, batch.mask, cfg.clip_eps, cfg.clip_eps_high)

    @staticmethod
    def objective(batch: Batch, logp: torch.Tensor, cfg: PPOConfig) -> torch.Tensor:
        """−min(ρA, clip(ρ)A) per token, the negated term of Eq. 1 (the KL is in the reward, so in A)."""
        return -clipped_objective(batch.adv, logp, batch.old_logp, cfg.clip_eps, cfg.clip_eps_high)  # [B, R]

    @staticmethod
    def critic_aggregation(cfg: PPOConfig) -> tuple[str, float]:
        """Every response token's value error weighs the same (`token_mean`), whatever `train.loss_agg` says."""
        return "token_mean", 1.0

    @staticmethod
    def critic_loss(batch: Batch, values: torch.Tensor, cfg: PPOConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Clipped value loss per token, with grad through `values` [B, R], aggregated by `critic_aggregation`."""
        old, returns, mask = batch.extra["values"], batch.extra["returns"], batch.mask  # [B, R] each
        assert values.shape == old.shape == returns.shape == mask.shape, "PPO expects values, returns, mask [B, R]"
        loss = (values - returns) ** 2  # [B, R]
        clip_frac = torch.zeros((), device=values.device)  # []
        if cfg.value_clip:
            clipped = old + (values - old).clamp(-cfg.value_clip, cfg.value_clip)  # [B, R]
            clipped_loss = (clipped - returns) ** 2  # [B, R]
            clip_frac = masked_mean((clipped_loss > loss).float(), mask)
            loss = torch.maximum(loss, clipped_loss)  # [B, R]
        error = (returns - values.detach()) * mask  # [B, R]
        var_error = masked_mean((error - masked_mean(error, mask)) ** 2, mask)  # []
        var_returns = masked_mean((returns - masked_mean(returns, mask)) ** 2, mask)  # []
        metrics = {"value_clip_frac": clip_frac, "value_error": masked_mean(error.abs(), mask),
                   "explained_variance": 1 - var_error / var_returns.clamp(min=1e-8)}
        return 0.5 * loss, metrics
