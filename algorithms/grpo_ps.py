"""GRPO with process supervision (GRPO+PS): a reward at the end of every step, normalised over the group's steps.

Paper: DeepSeekMath (arXiv:2402.03300), §4.1.3, with GRPO's objective (§4.1.1, Eq. 3–4).

Objective: for each question q sample G outputs {o_i} from π_old; a process reward scores step j of o_i, which ends at
token index(j), with r_i^{index(j)}. With R the step rewards of all G outputs together,

    r̃_i^{index(j)} = (r_i^{index(j)} − mean(R)) / std(R),      Â_{i,t} = Σ_{index(j) ≥ t} r̃_i^{index(j)},

so a token's advantage sums the normalised rewards of its own step and of every step after it. J(θ) is GRPO's Eq. 3
with this token-level Â_{i,t}:

    J(θ) = E[ (1/G) Σ_i (1/|o_i|) Σ_t { min(ρ_{i,t} Â_{i,t}, clip(ρ_{i,t}, 1−ε, 1+ε) Â_{i,t}) − β D_KL[πθ‖π_ref] } ].

Gradient coefficient (unified view, GRPO's Eq. 21 with a per-token advantage):

    GC_{i,t} = Â_{i,t} · ρ_{i,t} · 1[ρ on the unclipped side of the min] + β (π_ref/πθ − 1),

which is `GRPO.coefficient` itself, given a [B, R] advantage: only `prepare` (and what it needs) and the shape of Â
(`token_advantage`) differ.

Step rewards come from `rewards.process` through the judge (`Judge.score_steps`): `steps`, the embedded task's rule
(rewards/steps.py), or `model`, a process reward model (rewards/process_model.py); or, `turns`, from an episode's
environment, each model turn a step (posttrain/sources/episodes.py). The online source puts them on the sampled
tokens as `batch.extra["step_reward"]` (each step's reward at its end token) and `["step_end"]` (1.0 there).

Deviations from the paper, and choices where it is silent:
    1. The normalisation is GRPO's (`adv_norm`, `eps`; algorithms/common.py `group_advantages`) over each group's step
       rewards pooled: mean_std by default, the std unbiased with `eps` added, so a group whose step rewards are all
       equal gets Â = 0. Groups may have any size and order.
    2. A step ends at the token that completes its text (a line's newline); the last step at the response's last
       token, its stop token included, so stopping is credited with the last step. Steps ending on one token are one
       step there, with the lowest of their rewards (posttrain/data/steps.py).
    3. The outcome reward (`rewards.*`) is still computed and logged (`reward`, `reward/accuracy`) but not trained on;
       no outcome reward model is loaded. Dynamic sampling, if on, still keeps groups by their outcome rewards.
    4. `clip_eps_high`, `mask_truncated`, μ, β and the 1/|o_i|, 1/G averages (`train.loss_agg`) are GRPO's.

Metrics:
    step_reward: mean reward of the batch's steps.
    steps_per_sample: mean number of steps per completion.
    zero_std_frac: fraction of samples whose group's step rewards are all equal (their Â is 0).
    kl, clip_frac, ratio, objective: as GRPO's, with the per-token Â_{i,t}.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from posttrain.algorithms.base import register
from posttrain.algorithms.common import group_advantages, group_stats
from posttrain.algorithms.grpo import GRPO, GRPOConfig
from posttrain.core.batch import Batch


@dataclass
class GRPOPSConfig(GRPOConfig):
    """GRPO's keys (algorithms/grpo.py); the method's own class, so that a config names its plugin."""


def step_advantages(step_reward: torch.Tensor, step_end: torch.Tensor, group: torch.Tensor, norm: str,
                    eps: float) -> torch.Tensor:
    """Â_{i,t} = Σ_{index(j) ≥ t} r̃_i^{index(j)}, r̃ the step rewards normalised over each group's steps.

    Args:
        step_reward: [B, R] each step's reward at its end token.
        step_end: [B, R] 1.0 at each step's end token.
        group: [B] long, the group of each sample.
        norm, eps: GRPO's `adv_norm` and `eps` (`group_advantages`).

    Returns:
        [B, R] advantages (0 after a row's last step end).
    """
    row, col = step_end.nonzero(as_tuple=True)  # [S], [S]: the steps, in any order
    normed = torch.zeros_like(step_reward)  # [B, R]
    normed[row, col] = group_advantages(step_reward[row, col], group[row], norm, eps)  # r̃ at each step's end
    return normed.flip(1).cumsum(1).flip(1)  # [B, R] the sum over steps ending at or after t


@register("grpo_ps")
class GRPOPS(GRPO):
    Config = GRPOPSConfig

    @staticmethod
    def needs(cfg: GRPOPSConfig) -> frozenset[str]:
        return GRPO.needs(cfg) - {"reward"} | {"step_reward"}

    @staticmethod
    def prepare(batch: Batch, cfg: GRPOPSConfig) -> tuple[Batch, dict[str, torch.Tensor]]:
        B, R = batch.mask.shape
        reward, end = batch.extra.get("step_reward"), batch.extra.get("step_end")  # [B, R], [B, R]
        assert reward is not None and reward.shape == end.shape == (B, R), "GRPO+PS expects step_reward, step_end [B, R]"
        mask = batch.mask
        if cfg.mask_truncated:
            mask = mask * (~batch.truncated)[:, None].to(mask.dtype)  # [B, R]
        adv = step_advantages(reward, end, batch.group, cfg.adv_norm, cfg.eps) * mask  # [B, R]
        row, col = end.nonzero(as_tuple=True)  # [S], [S]
        steps = reward[row, col]  # [S]
        zero = torch.ones(B, dtype=torch.bool, device=end.device)  # [B]; a sample without steps has nothing to learn
        zero[row] = group_stats(steps, batch.group[row])[1] == 0
        metrics = {"step_reward": steps.sum() / max(len(steps), 1), "steps_per_sample": end.sum() / B,
                   "zero_std_frac": zero.float().mean()}
        return dataclasses.replace(batch, adv=adv, mask=mask), metrics

    @staticmethod
    def token_advantage(batch: Batch, logp: torch.Tensor) -> torch.Tensor:
        """Â_{i,t} of every token, as `prepare` left it: [B, R]."""
        assert batch.adv.shape == batch.mask.shape == logp.shape, "GRPO+PS expects adv and mask [B, R]"
        return batch.adv  # [B, R]
