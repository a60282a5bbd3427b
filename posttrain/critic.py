"""The critic of actor-critic methods: a token-classification model with one output, V(q, o_<t) per position.

By default it starts from the policy's own weights with a new scalar head (the common choice in PPO for language
models), so its weights, gradients and AdamW state cost as much memory as the policy's: that is real, and measured.
"""

from __future__ import annotations

from pathlib import Path

import torch

from posttrain.errors import UserError
from posttrain.scoring import position_ids


def load_critic(path: str | Path, dtype: str, policy_tokenizer, key: str = "algorithm.critic_path"):
    """A critic from a local HF directory; its tokenizer must be the policy's, token for token."""
    from transformers import AutoModelForTokenClassification, AutoTokenizer

    path = Path(path)
    if not (path / "config.json").is_file():
        raise UserError(f"{key}: '{path}' is not a Hugging Face model directory (no config.json)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise UserError(f"{key}: cannot load the tokenizer of '{path}' ({str(err).splitlines()[0]})") from None
    if tokenizer.get_vocab() != policy_tokenizer.get_vocab():
        raise UserError(f"{key}: the critic at '{path}' has a different tokenizer from the policy "
                        f"({len(tokenizer)} vs {len(policy_tokenizer)} tokens); it cannot score the policy's tokens")
    try:
        critic = AutoModelForTokenClassification.from_pretrained(path, num_labels=1, dtype=getattr(torch, dtype))
    except (OSError, ValueError, KeyError) as err:
        raise UserError(f"{key}: cannot load '{path}' as a critic ({str(err).splitlines()[0]})") from None
    return critic


def token_values(critic, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """V of the state before each response token, at the positions whose log-probs are scored: [B, T] -> [B, R]."""
    out = critic(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids(attention_mask))
    return out.logits[:, prompt_len - 1 : -1, 0].float()  # [B, R]
