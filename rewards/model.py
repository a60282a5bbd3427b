"""A learned reward: a local sequence-classification model directory whose single logit scores (prompt, response)."""

from __future__ import annotations

from pathlib import Path

import torch

from posttrain.errors import UserError


class RewardModel:
    """Scores texts with a `AutoModelForSequenceClassification` (one label) and its own tokenizer."""

    def __init__(self, path: str | Path, device: torch.device | str = "cpu", batch_size: int = 32):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        path = Path(path)
        if not (path / "config.json").is_file():
            raise UserError(f"reward_model.path: '{path}' is not a Hugging Face model directory (no config.json)")
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(path)
            self.model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1)
        except (OSError, ValueError, KeyError) as err:
            raise UserError(f"reward_model.path: cannot load '{path}' ({str(err).splitlines()[0]})") from None
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model.config.pad_token_id = self.tokenizer.pad_token_id  # it scores the last non-pad token
        self.model.eval().requires_grad_(False).to(device)
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
