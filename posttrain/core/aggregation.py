"""Loss aggregation: how per-token terms become one scalar. The engine calls `aggregate` once per micro-batch.

Modes (B sequences, |o_i| response tokens of sequence i, ℓ_{i,t} a per-token term):

- ``seq_mean_token_mean``: (1/B) Σ_i (1/|o_i|) Σ_t ℓ_{i,t}, the paper's form (DeepSeekMath Eq. 3).
- ``token_mean``: Σ_{i,t} ℓ_{i,t} / Σ_i |o_i|, every token weighs the same (DAPO, arXiv:2503.14476).
- ``seq_mean_token_sum_norm``: (1/B) Σ_i Σ_t ℓ_{i,t} / L with a constant L, no length bias (Dr. GRPO,
  arXiv:2503.20783); with L = 1 it is the per-sequence sum that DPO uses.

When a batch is split into micro-batches (and across data-parallel processes) the denominators must be those of the
whole batch, or the sum of the micro-batch losses is not the batch loss: the engine counts them once (`Totals`) and
passes them in. Sequences whose mask is all zero (filtered out) do not count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: posttrain.schema imports MODES, and listing recipes loads no torch
    import torch

MODES = ("seq_mean_token_mean", "token_mean", "seq_mean_token_sum_norm")


@dataclass(frozen=True)
class Totals:
    """Denominators of a whole optimizer step: sequences and tokens that enter the loss."""

    seqs: float
    tokens: float

    @staticmethod
    def of(mask: torch.Tensor) -> Totals:
        return Totals(seqs=float((mask.sum(-1) > 0).sum()), tokens=float(mask.sum()))


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `x` over the positions where `mask` is 1 (0 when the mask is empty)."""
    return (x * mask).sum() / mask.sum().clamp(min=1)


def aggregate(
    values: torch.Tensor, mask: torch.Tensor, mode: str, totals: Totals | None = None, norm: float = 1.0
) -> torch.Tensor:
    """Reduces per-token `values` [B, R] under `mask` [B, R] to a scalar.

    Args:
        values: per-token terms.
        mask: 1.0 where a token counts.
        mode: one of MODES.
        totals: denominators of the whole step; defaults to those of this batch.
        norm: the constant L of ``seq_mean_token_sum_norm``.
    """
    totals = totals or Totals.of(mask)
    masked = values * mask  # [B, R]
    if mode == "token_mean":
        return masked.sum() / max(totals.tokens, 1.0)
    if mode == "seq_mean_token_mean":
        per_seq = masked.sum(-1) / mask.sum(-1).clamp(min=1)  # [B]
        return per_seq.sum() / max(totals.seqs, 1.0)
    if mode == "seq_mean_token_sum_norm":
        return masked.sum() / (norm * max(totals.seqs, 1.0))
    raise ValueError(f"unknown aggregation mode {mode!r}; known: {', '.join(MODES)}")
