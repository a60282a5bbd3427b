"""Held-out evaluation: greedy answers to test problems, checked by the accuracy rule reward."""

from __future__ import annotations

import torch

from posttrain import rollout
from posttrain.config import DataConfig
from posttrain.data import prompt_ids
from posttrain.rewards import accuracy


@torch.no_grad()
def evaluate(model, tokenizer, rows: list[dict], data_cfg: DataConfig, *, max_new_tokens: int, batch_size: int,
             accelerator=None) -> dict:
    """Greedy accuracy on `rows` (sharded across processes when `accelerator` runs several).

    Returns:
        {"accuracy", "num_problems", "mean_response_tokens", "examples": first three (prompt, completion, answer)}.
    """
    rank, world = (accelerator.process_index, accelerator.num_processes) if accelerator else (0, 1)
    shard = rows[rank::world]
    correct = tokens = 0.0
    examples = []
    for start in range(0, len(shard), batch_size):
        chunk = shard[start : start + batch_size]
        batch = rollout.sample(model, tokenizer, prompt_ids(tokenizer, chunk, data_cfg), 1,
                               max_new_tokens=max_new_tokens, greedy=True)
        texts = rollout.completions(tokenizer, batch)
        answers = [str(r[data_cfg.answer_field]) for r in chunk]
        correct += sum(accuracy.accuracy(texts, answers))
        tokens += float(batch.mask.sum())
        examples += [{"question": str(r[data_cfg.prompt_field]), "completion": t, "answer": a}
                     for r, t, a in zip(chunk, texts, answers)][: 3 - len(examples)]
    totals = torch.tensor([correct, tokens, float(len(shard))])
    if accelerator is not None and world > 1:
        totals = accelerator.reduce(totals.to(accelerator.device), "sum").cpu()
    correct, tokens, n = totals.tolist()
    return {"accuracy": correct / max(n, 1), "num_problems": int(n), "mean_response_tokens": tokens / max(n, 1),
            "examples": examples}
