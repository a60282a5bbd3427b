"""Held-out evaluation: greedy answers to test problems from the rollout engine, judged correct or not."""

from __future__ import annotations

import torch

from posttrain.data import completion_texts, prompt_ids
from posttrain.schema import DataConfig, EvalConfig


@torch.no_grad()
def evaluate(rollout, judge, tokenizer, rows: list[dict], data_cfg: DataConfig, *, max_new_tokens: int,
             batch_size: int, backend=None) -> dict:
    """Greedy accuracy on `rows` (sharded across processes when `backend` runs several).

    Returns:
        {"accuracy", "num_problems", "mean_response_tokens", "examples": first three (prompt, completion, answer)}.
    """
    rank, world = (backend.rank, backend.world_size) if backend else (0, 1)
    shard = rows[rank::world]
    # Sharded weights: every process makes as many calls as the largest shard needs, an empty one on a dummy row.
    calls = -(-len(rows[::world]) // batch_size) if rollout.collective else -(-len(shard) // batch_size)
    correct = tokens = 0.0
    examples = []
    for start in range(0, calls * batch_size, batch_size):
        chunk = shard[start : start + batch_size]
        batch = rollout.generate(prompt_ids(tokenizer, chunk or rows[:1], data_cfg), 1,
                                 max_new_tokens=max_new_tokens, greedy=True)
        if not chunk:
            continue
        texts = completion_texts(tokenizer, batch)
        correct += sum(judge.correct(chunk, texts))
        tokens += float(batch.mask.sum())
        examples += [{"question": str(r[data_cfg.prompt_field]), "completion": t, "answer": a}
                     for r, t, a in zip(chunk, texts, judge.answers(chunk))][: 3 - len(examples)]
    totals = torch.tensor([correct, tokens, float(len(shard))])
    if backend is not None and world > 1:
        totals = backend.reduce(totals.to(backend.device), "sum").cpu()
    correct, tokens, n = totals.tolist()
    return {"accuracy": correct / max(n, 1), "num_problems": int(n), "mean_response_tokens": tokens / max(n, 1),
            "examples": examples}


class Schedule:
    """When a run evaluates: before training, every `eval.every` steps and at the last step, or after the loop."""

    def __init__(self, cfg: EvalConfig, steps: int):
        self.on, self.every, self.steps = cfg.num_problems > 0, cfg.every, steps

    def in_loop(self, step: int) -> bool:
        return self.on and bool(self.every) and (step % self.every == 0 or step == self.steps)

    @property
    def after_loop(self) -> bool:
        return self.on and not self.every
