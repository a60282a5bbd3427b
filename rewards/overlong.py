"""DAPO's soft overlong punishment (Yu et al. 2025, arXiv:2503.14476, §3.4, Eq. 13), a length-aware reward term.

With L_max the token budget (`rollout.max_new_tokens`) and L_cache the punishment buffer (`rewards.overlong_buffer`),
a completion of |y| tokens gets

    R_length(y) = 0                                    if |y| ≤ L_max − L_cache
                = ((L_max − L_cache) − |y|) / L_cache  if L_max − L_cache < |y| ≤ L_max
                = −1                                   if it was cut off at L_max (no end token)

added to its reward with weight `rewards.overlong_penalty`: the longer a completion runs into the buffer, the more
it loses, so the policy learns to finish within the budget without the hard cliff of scoring truncated answers 0.
It needs token counts, which the rule rewards (text in, score out) do not see, so the online source adds it after
the judge. In DAPO the buffer sits beyond the expected length (16,384 + 4,096 tokens); here the budget is the hard
stop, so the buffer is its last L_cache tokens.
"""

from __future__ import annotations

import torch


def overlong_penalty(lengths: torch.Tensor, truncated: torch.Tensor, budget: int, buffer: int) -> torch.Tensor:
    """R_length of each completion: [B] response lengths and [B] truncated flags -> [B] in [−1, 0]."""
    start = budget - buffer
    inside = ((start - lengths.float()) / buffer).clamp(min=-1.0, max=0.0)  # [B] 0 before the buffer, −1 at its end
    return torch.where(truncated, torch.full_like(inside, -1.0), inside)
