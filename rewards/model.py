"""A learned reward: a local sequence-classification model directory whose single logit scores (prompt, response)."""

from __future__ import annotations

from pathlib import Path

import torch

from posttrain.models.loading import load


class RewardModel:
    """Scores texts with an `AutoModelForSequenceClassification` (one label) and its own tokenizer."""

    def __init__(self, path: str | Path, device: torch.device | str = "cpu", batch_size: int = 32,
                 dtype: str = "float32", place=None):
        self.model, self.tokenizer = load(path, "reward_model", dtype=dtype, key="reward_model.path")
        self.model.config.pad_token_id = self.tokenizer.pad_token_id  # it scores the last non-pad token
        self.model.eval().requires_grad_(False).to(device)
        if place is not None:  # a training backend's placement of frozen models (sharded under fsdp2 and zero3)
            self.model = place(self.model)
        self.device, self.batch_size = device, batch_size

    @torch.no_grad()
    def __call__(self, prompts: list[str], completions: list[str]) -> list[float]:
        scores = []
        self.tokenizer.padding_side = "right"
        for i in range(0, len(prompts), self.batch_size):
            texts = [p + c for p, c in zip(prompts[i : i + self.batch_size], completions[i : i + self.batch_size])]
            enc = self.tokenizer(texts, return_tensors="pt", padding=True).to(self.device)
            scores += self.model(**enc).logits[:, 0].float().tolist()
        return scores
