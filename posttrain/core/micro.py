"""How a batch is cut into micro-batches: one implementation for every scoring and update pass, on the trainer and on
the rollout workers (`train.micro_batch_size`, `train.micro_batch_tokens`, `train.packing`; the run's plan says which
applies to each pass)."""

from __future__ import annotations

import torch


def split(lengths: torch.Tensor, unit: int, rows: int, tokens: int | None, packed: bool) -> list[torch.Tensor]:
    """The rows of each micro-batch of a batch whose rows have `lengths` real tokens ([B] long): whole units of `unit`
    rows (DPO's pairs), longest unit first so that rows of similar length go together; `rows` rows each, or under a
    token budget of `tokens` (`token_budget`), where it wins."""
    lengths = lengths.view(-1, unit)  # [B / unit, unit]
    order = torch.argsort(lengths.max(-1).values, descending=True, stable=True)  # [B / unit]
    idx = (order[:, None] * unit + torch.arange(unit, device=order.device)).flatten()  # [B]
    if tokens is None:
        return list(idx.split(rows))
    groups = token_budget(lengths[order.to(lengths.device)].tolist(), tokens, packed)
    by_unit = idx.view(-1, unit)  # [B / unit, unit] the rows of each unit, longest unit first
    return [by_unit[g].flatten() for g in groups]


def token_budget(lengths: list[list[int]], budget: int, packed: bool) -> list[list[int]]:
    """Which units (DPO's pairs; single rows otherwise) go into each micro-batch under a token budget: their indices
    into `lengths`, which holds each unit's rows' real tokens, longest unit first.

    Units go in order, so that sequences of similar lengths share a micro-batch, while it computes at most `budget`
    tokens: its real tokens when packed, else rows × its longest row. A unit over the budget makes a micro-batch
    alone. (Packed rows are as wide as the micro-batch's longest sequence, and attention over a mask costs the
    square of a row's width whatever the mask keeps: mixing short sequences into long rows fills them but makes the
    short ones pay for the long one's width, slower on CPU; bench/README.md has the figures.)
    """
    groups: list[list[int]] = []
    tokens = rows = longest = 0
    for i, unit in enumerate(lengths):
        t, r, w = tokens + sum(unit), rows + len(unit), max(longest, *unit)
        if groups and (t if packed else r * w) <= budget:
            groups[-1].append(i)
        else:
            groups.append([i])
            t, r, w = sum(unit), len(unit), max(unit)
        tokens, rows, longest = t, r, w
    return groups
