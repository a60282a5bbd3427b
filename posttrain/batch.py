"""The batch every stage passes on: token ids, masks and per-sample tensors, all with B rows.

Layout: prompts are left-padded to P columns and responses right-padded to R columns, so every response starts at
column P of `input_ids` and the response region is `input_ids[:, P:]`. Per-token tensors (`mask`, `logp`, `old_logp`,
`ref_logp`, ...) cover that region only: [B, R].
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, T] prompt (left-padded to P) then response (right-padded to R = T - P)
    attention_mask: torch.Tensor  # [B, T] 1 on real tokens
    mask: torch.Tensor  # [B, R] float, 1.0 on response tokens that enter the loss (EOS included)
    prompt_len: int  # P
    group: torch.Tensor | None = None  # [B] long, index of the prompt a sample answers (its group)
    reward: torch.Tensor | None = None  # [B] scalar reward per sequence
    truncated: torch.Tensor | None = None  # [B] bool, no EOS within the token budget
    old_logp: torch.Tensor | None = None  # [B, R] log π_old, the policy that sampled the batch
    ref_logp: torch.Tensor | None = None  # [B, R] log π_ref
    adv: torch.Tensor | None = None  # [B] or [B, R] advantage
    extra: dict[str, torch.Tensor] = field(default_factory=dict)  # [B, ...] per-sample tensors a plugin adds

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def response_ids(self) -> torch.Tensor:
        return self.input_ids[:, self.prompt_len :]  # [B, R]

    def _map(self, fn) -> Batch:
        """A new batch with `fn` applied to every per-sample tensor."""
        changes = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                changes[f.name] = fn(value)
        changes["extra"] = {k: fn(v) for k, v in self.extra.items()}
        return dataclasses.replace(self, **changes)

    def select(self, index: torch.Tensor | slice) -> Batch:
        """The rows at `index`."""
        return self._map(lambda t: t[index])

    def to(self, device: torch.device | str) -> Batch:
        return self._map(lambda t: t.to(device))

    def split(self, size: int) -> list[Batch]:
        """Consecutive chunks of at most `size` rows (micro-batches)."""
        return [self.select(slice(i, i + size)) for i in range(0, len(self), size)]
