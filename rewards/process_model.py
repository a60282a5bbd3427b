"""A process reward model (PRM): a local token-classification model directory that scores each step of a completion.

DeepSeekMath's GRPO with process supervision (arXiv:2402.03300, §4.1.3) takes a reward at the end token of every step
from a PRM. Here that is an `AutoModelForTokenClassification` read at the token that holds each step's last character
in prompt + completion, re-tokenised with the PRM's own tokenizer (its vocabulary need not be the policy's). Steps are
the lines of the completion (`posttrain.rewards.steps.line_ends`); the token of a character comes from the tokenizer's
offset mapping, which only fast (Rust) tokenizers give.

Score of a step: with `num_labels` 1, the sigmoid of the logit (a probability that the step is right); with 2, the
softmax probability of label 1 (labels 0 = wrong step, 1 = right step, as a two-way classifier is trained); other
label counts are refused. A completion with no text is one step, scored at the prompt's last token. PRMs that mark
steps with a tag token of their own (Math-Shepherd's "ки") are scored at the line ends all the same: give the
completions the layout the PRM was trained on.

Loaded as every model is (`posttrain.models.loading.load`): safetensors only, `trust_remote_code=False`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from posttrain.core.errors import ConfigError
from posttrain.models.loading import load
from posttrain.rewards.steps import line_ends

KEY = "reward_model.process_path"


class ProcessRewardModel:
    """Scores each line of each completion with a token-classification model and its own (fast) tokenizer."""

    def __init__(self, path: str | Path, device: torch.device | str = "cpu", batch_size: int = 32,
                 dtype: str = "float32", place=None):
        self.model, self.tokenizer = load(path, "process_reward_model", dtype=dtype, key=KEY)
        if not self.tokenizer.is_fast:
            raise ConfigError(f"{KEY}: the tokenizer of '{path}' is a slow (Python) tokenizer; a process reward model "
                              "needs a fast one (tokenizer.json), whose offset mapping finds each step's end token")
        self.labels = self.model.config.num_labels
        if self.labels not in (1, 2):
            raise ConfigError(f"{KEY}: '{path}' has {self.labels} labels; a process reward model has 1 (a logit, "
                              "scored by its sigmoid) or 2 (scored by the probability of label 1)")
        self.model.eval().requires_grad_(False).to(device)
        if place is not None:  # a training backend's placement of frozen models (sharded under fsdp2 and zero3)
            self.model = place(self.model)
        self.device, self.batch_size = device, batch_size

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        """[b, T, labels] logits -> [b, T] scores: sigmoid of the one logit, or the probability of label 1 of two."""
        return torch.sigmoid(logits[..., 0]) if self.labels == 1 else torch.softmax(logits, -1)[..., 1]

    @torch.no_grad()
    def __call__(self, prompts: list[str], completions: list[str]) -> list[list[tuple[int, float]]]:
        """(char_end in the completion, score) for each line of each completion."""
        out = []
        self.tokenizer.padding_side = "right"
        for i in range(0, len(prompts), self.batch_size):
            prompt, completion = prompts[i : i + self.batch_size], completions[i : i + self.batch_size]
            enc = self.tokenizer([p + c for p, c in zip(prompt, completion)], return_tensors="pt", padding=True,
                                 return_offsets_mapping=True, return_special_tokens_mask=True)
            offsets, special = enc.pop("offset_mapping"), enc.pop("special_tokens_mask")  # [b, T, 2], [b, T]
            scores = self.probabilities(self.model(**enc.to(self.device)).logits.float()).cpu()  # [b, T]
            text_tokens = enc["attention_mask"].cpu().bool() & ~special.bool()  # [b, T]
            for j, (p, c) in enumerate(zip(prompt, completion)):
                ends = line_ends(c)
                at = [end_token(offsets[j], text_tokens[j], len(p) + e - 1) for e in ends]
                out.append([(e, float(scores[j, t])) for e, t in zip(ends, at)])
        return out


def end_token(offsets: torch.Tensor, text_tokens: torch.Tensor, char: int) -> int:
    """The first text token of a row whose span ends past character `char` (the token holding it, or the next one if
    the tokenizer dropped it); the row's last text token when none does. `offsets` [T, 2], `text_tokens` [T] bool."""
    hit = (text_tokens & (offsets[:, 1] > char)).nonzero()
    return int(hit[0]) if len(hit) else int(text_tokens.nonzero()[-1])
