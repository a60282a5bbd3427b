"""Test helpers: the paper's aggregations written out as loops, and the surrogate gradient of a plugin."""

from __future__ import annotations

import torch

from posttrain.core.aggregation import aggregate
from posttrain.core.batch import Batch


def written_out_mean(per_token: torch.Tensor, mask: torch.Tensor, mode: str, norm: float = 1.0) -> torch.Tensor:
    """The aggregation modes as plain loops over sequences and tokens, independent of posttrain.core.aggregation."""
    seqs = [i for i in range(per_token.shape[0]) if mask[i].sum() > 0]
    if mode == "seq_mean_token_mean":  # (1/G) Σ_i (1/|o_i|) Σ_t
        return sum(sum(per_token[i, t] for t in range(mask.shape[1]) if mask[i, t]) / mask[i].sum() for i in seqs) / len(seqs)
    if mode == "token_mean":  # Σ_i Σ_t / Σ_i |o_i|
        return sum(per_token[i, t] for i in seqs for t in range(mask.shape[1]) if mask[i, t]) / mask.sum()
    if mode == "seq_mean_token_sum_norm":  # (1/G) Σ_i Σ_t / L
        return sum(per_token[i, t] for i in seqs for t in range(mask.shape[1]) if mask[i, t]) / (norm * len(seqs))
    raise ValueError(mode)


def surrogate_grad(plugin, batch, logp0: torch.Tensor, cfg, mode: str, norm: float = 1.0) -> torch.Tensor:
    """∂/∂logp of the engine's loss −aggregate(stopgrad(GC) · logp), with GC from the plugin."""
    logp = logp0.clone().requires_grad_(True)
    gc, _ = plugin.coefficient(batch, logp.detach(), cfg)
    loss = -aggregate(gc.detach() * logp, batch.mask, mode, norm=norm)
    (grad,) = torch.autograd.grad(loss, logp)
    return grad


def micro_batched_grad(plugin, batch, logp0: torch.Tensor, cfg, mode: str, norm: float, size: int) -> torch.Tensor:
    """`surrogate_grad` as the engine takes it: the rows cut into consecutive micro-batches of `size` rows (whole
    units: `size` a multiple of the plugin's), each micro-batch's GC computed from its own rows alone, and the losses
    summed under the whole batch's token and sequence counts."""
    from posttrain.core.aggregation import Totals

    logp = logp0.clone().requires_grad_(True)
    totals, loss = Totals.of(batch.mask), 0.0
    for start in range(0, len(batch), size):
        rows = slice(start, start + size)
        mb, part = batch.select(rows), logp[rows]
        gc, _ = plugin.coefficient(mb, part.detach(), cfg)
        loss = loss - aggregate(gc.detach() * part, mb.mask, mode, totals, norm=norm)
    (grad,) = torch.autograd.grad(loss, logp)
    return grad


def objective_grad(objective, logp0: torch.Tensor) -> torch.Tensor:
    """∂/∂logp of −objective(logp), by autograd."""
    logp = logp0.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(-objective(logp), logp)
    return grad


def clipped_objective(batch, cfg, adv: torch.Tensor, mode: str, norm: float):
    """J(logp) = the aggregate of min(ρ Â, clip(ρ, 1 − ε, 1 + ε_high) Â) per token, with ρ = πθ/π_old, minus β·k3
    per token when the KL is in the loss (`cfg.kl_in_reward` false): the objective of RLOO and REINFORCE++, written
    out, for the advantages `adv` ([B, 1] or [B, R]) computed apart."""
    high = cfg.clip_eps_high if cfg.clip_eps_high is not None else cfg.clip_eps

    def J(logp):
        ratio = torch.exp(logp - batch.old_logp)
        per_token = torch.min(ratio * adv, torch.clamp(ratio, 1 - cfg.clip_eps, 1 + high) * adv)
        if not cfg.kl_in_reward:
            log_ref_ratio = batch.ref_logp - logp
            per_token = per_token - cfg.beta * (torch.exp(log_ref_ratio) - log_ref_ratio - 1)
        return written_out_mean(per_token, batch.mask, mode, norm)

    return J


def weighted_grpo_objective(batch, cfg, adv: torch.Tensor, weight: torch.Tensor, mode: str, norm: float):
    """J(logp) = GRPO's Eq. 3 + 4 with every token's term times a constant `weight` [B, R] (an importance weight),
    written out; π_old is batch.old_logp, or this logp detached (a step's only update)."""

    def J(lp):
        old = batch.old_logp if batch.old_logp is not None else lp.detach()
        ratio = torch.exp(lp - old)
        surrogate = torch.min(ratio * adv, torch.clamp(ratio, 1 - cfg.clip_eps, 1 + cfg.clip_eps) * adv)
        kl = torch.exp(batch.ref_logp - lp) - (batch.ref_logp - lp) - 1
        return written_out_mean(weight * (surrogate - cfg.beta * kl), batch.mask, mode, norm)

    return J


LENGTHS = [3, 5, 1, 4, 0, 2, 5, 3, 4]  # response lengths of `ragged_batch`, one row empty (a filtered sample)


def ragged_batch(G: int = 3, seed: int = 0, spread: float = 0.0) -> tuple[Batch, torch.Tensor]:
    """Groups of G with 0/1 rewards and ragged masks, and log πθ. π_old is always given (a KL in the reward reads it
    even at μ = 1, where the engine scores it with the update's weights): `spread` = 0 makes it equal to πθ (ρ = 1),
    `spread` > 0 moves it away so that ratios leave [1 − ε, 1 + ε]."""
    g = torch.Generator().manual_seed(seed)
    B, R = len(LENGTHS), 5
    logp = -torch.rand(B, R, generator=g) * 3
    old = logp + spread * torch.randn(B, R, generator=g)
    mask = (torch.arange(R)[None, :] < torch.tensor(LENGTHS)[:, None]).float()  # [B, R]
    batch = Batch(input_ids=torch.zeros(B, R + 2, dtype=torch.long), attention_mask=torch.ones(B, R + 2), mask=mask,
                  prompt_len=2, group=torch.arange(B // G).repeat_interleave(G),
                  reward=torch.tensor([1.0, 0, 0, 1, 1, 0, 0, 1, 1]), truncated=torch.zeros(B, dtype=torch.bool),
                  old_logp=old, ref_logp=old + 0.3 * torch.randn(B, R, generator=g))
    return batch, logp
