"""The batch every stage passes on: token ids, masks and per-sample tensors, all with B rows.

Layout: prompts are left-padded to P columns and responses right-padded to R columns, so every response starts at
column P of `input_ids` and the response region is `input_ids[:, P:]`. Per-token tensors (`mask`, `logp`, `old_logp`,
`ref_logp`, ...) cover that region only: [B, R], and so does any tensor in `extra` whose second dimension is R.
`left_pad` and `collate` build that layout from token ids.
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
    rollout_logp: torch.Tensor | None = None  # [B, R] log-probs the rollout engine reported for the tokens it drew
    ref_logp: torch.Tensor | None = None  # [B, R] log π_ref
    teacher_logp: torch.Tensor | None = None  # [B, R] log π_T, the distillation teacher's
    adv: torch.Tensor | None = None  # [B] or [B, R] advantage
    extra: dict[str, torch.Tensor] = field(default_factory=dict)  # [B, ...] per-sample tensors a plugin adds
    # What a rollout record carries beyond the tokens, for off-policy correction and multi-turn environments:
    version: torch.Tensor | None = None  # [B] long, the policy version that sampled each row (steps trained by then)
    model_tokens: torch.Tensor | None = None  # [B, R] 1.0 on tokens the model sampled, 0.0 on tokens an environment
    # wrote (multi-turn); None: every response token is the model's
    temperature: float = 1.0  # τ the responses were drawn at, and so the one their log-probs are scored at

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
        """The rows at `index` (a slice, or an index or mask tensor on any device: the rewards live on the CPU)."""
        if isinstance(index, torch.Tensor):
            return self._map(lambda t: t[index.to(t.device)])
        return self._map(lambda t: t[index])

    def to(self, device: torch.device | str) -> Batch:
        return self._map(lambda t: t.to(device))

    def split(self, size: int) -> list[Batch]:
        """Consecutive chunks of at most `size` rows (micro-batches)."""
        return [self.select(slice(i, i + size)) for i in range(0, len(self), size)]

    def lengths(self) -> torch.Tensor:
        """[B] real tokens per row, prompt and response."""
        return self.attention_mask.sum(-1)

    def widened(self, P: int, R: int, pad_id: int) -> Batch:
        """The same rows with prompts left-padded to P columns and responses right-padded to R (P, R ≥ the batch's):
        `pad_id` in the ids, zeros in the attention mask and in every per-token ([B, r, ...]) tensor."""
        p, r = self.prompt_len, self.input_ids.shape[1] - self.prompt_len
        if (P, R) == (p, r):
            return self

        def pad(t: torch.Tensor) -> torch.Tensor:
            if t is self.input_ids or t is self.attention_mask:
                return torch.nn.functional.pad(t, (P - p, R - r), value=pad_id if t is self.input_ids else 0)
            if t.dim() >= 2 and t.shape[1] == r:  # per token
                return torch.nn.functional.pad(t, (0, 0) * (t.dim() - 2) + (0, R - r), value=0)
            return t

        return dataclasses.replace(self._map(pad), prompt_len=P)

    def trimmed(self) -> Batch:
        """The same rows without the columns that are padding in every row: the left of the prompt region and the
        right of the response region. P and R shrink; per-token tensors keep their first R' columns."""
        P, R = self.prompt_len, self.input_ids.shape[1] - self.prompt_len
        real = self.attention_mask.bool().any(0)  # [T] columns with a real token in some row
        left = int(real[:P].float().argmax()) if real[:P].any() else P - 1
        keep_r = int(real[P:].nonzero().max()) + 1 if real[P:].any() else 1  # R' ≥ 1
        if left == 0 and keep_r == R:
            return self

        def cut(t: torch.Tensor) -> torch.Tensor:
            if t is self.input_ids or t is self.attention_mask:
                return t[:, left : P + keep_r]
            return t[:, :keep_r] if t.dim() >= 2 and t.shape[1] == R else t

        return dataclasses.replace(self._map(cut), prompt_len=P - left)


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts left-padded to the longest: ([B, P] ids, [B, P] attention mask)."""
    P = max(map(len, prompts))
    ids = torch.full((len(prompts), P), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), P), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, P - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[i, P - len(p) :] = 1
    return ids, mask


def concat(batches: list[Batch], pad_id: int) -> Batch:
    """The rows of `batches` in order, as one batch: prompts left-padded to the longest P, responses and per-token
    tensors ([b, R] ones: mask, log-probs) right-padded to the longest R, with `pad_id` and zeros."""
    P = max(b.prompt_len for b in batches)
    R = max(b.input_ids.shape[1] - b.prompt_len for b in batches)
    wide = [b.widened(P, R, pad_id) for b in batches]
    first = wide[0]
    changes = {}
    for f in dataclasses.fields(first):
        values = [getattr(b, f.name) for b in wide]
        if all(isinstance(v, torch.Tensor) for v in values):
            changes[f.name] = torch.cat(values)
        elif any(isinstance(v, torch.Tensor) for v in values):
            raise ValueError(f"concat: {f.name} is set in some batches only")
    changes["extra"] = {k: torch.cat([b.extra[k] for b in wide]) for k in first.extra}
    return dataclasses.replace(first, **changes)


def collate(prompts: list[list[int]], responses: list[list[int]], pad_id: int) -> Batch:
    """Left-pads prompts to P and right-pads responses to R; `mask` marks the response tokens."""
    prompt, prompt_mask = left_pad(prompts, pad_id)  # [B, P]
    R = max(map(len, responses))
    response = torch.full((len(responses), R), pad_id, dtype=torch.long)  # [B, R]
    mask = torch.zeros((len(responses), R))  # [B, R]
    for i, r in enumerate(responses):
        response[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, : len(r)] = 1
    return Batch(input_ids=torch.cat([prompt, response], 1), attention_mask=torch.cat([prompt_mask, mask.long()], 1),
                 mask=mask, prompt_len=prompt.shape[1])
