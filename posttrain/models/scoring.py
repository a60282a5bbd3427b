"""The shared per-token scoring engine: log πθ(o_t | q, o_<t) for the response tokens of a padded batch, and the
critic's values V(q, o_<t) at the same positions.

One function serves the policy (with gradients), the old policy and the reference (without). It avoids the naive
`log_softmax(logits.float())` over [B, T, V]: the model's head runs only at the R positions that predict response
tokens (`logits_to_keep`, which Hugging Face causal LMs accept), and the float32 log-normaliser is computed in
chunks of sequences. Under autograd each chunk is checkpointed, so backward recomputes its float32 logits instead of
keeping them all alive. The forward still goes through the model's own `__call__`, so wrappers such as DDP see it.
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch.utils.checkpoint import checkpoint


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding, as `generate` assigns them, so scoring sees what sampling saw."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # [B, T]


@functools.cache
def _accepts_logits_to_keep(forward) -> bool:
    return "logits_to_keep" in inspect.signature(forward).parameters


def _token_logp(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(logits / temperature)[target] in float32: [b, R, V], [b, R] -> [b, R]."""
    logits = logits.float()  # a copy only when the model runs in lower precision
    if temperature != 1.0:
        logits = logits / temperature
    return logits.gather(-1, targets[..., None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_len: int,
    *,
    temperature: float = 1.0,
    chunk_rows: int = 512,
) -> torch.Tensor:
    """Log-probabilities of the response tokens `input_ids[:, prompt_len:]` under `model`.

    Args:
        model: a Hugging Face causal LM, possibly wrapped (DDP).
        input_ids: [B, T] prompt left-padded to `prompt_len`, then the response.
        attention_mask: [B, T].
        prompt_len: P; the response region is columns P..T-1 (R = T - P columns).
        temperature: logits are divided by it, as when sampling.
        chunk_rows: about this many token positions (rows of V logits) are reduced at a time.

    Returns:
        [B, R] float32 log-probabilities (padding positions hold finite junk; mask them).
    """
    B, T = input_ids.shape
    R = T - prompt_len
    inner = getattr(model, "module", model)  # DDP keeps the model in .module
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids(attention_mask),
                  use_cache=False)
    if _accepts_logits_to_keep(inner.forward):
        # Positions P-1 .. T-1 are kept; the last one predicts past the end and is dropped.
        logits = model(**kwargs, logits_to_keep=R + 1).logits[:, :-1]  # [B, R, V] (a view)
    else:
        logits = model(**kwargs).logits[:, prompt_len - 1 : -1]  # [B, R, V] (a view)
    targets = input_ids[:, prompt_len:]  # [B, R]
    seqs = max(1, chunk_rows // max(R, 1))  # sequences per chunk; slicing the view copies nothing
    out = []
    for start in range(0, B, seqs):
        chunk, tgt = logits[start : start + seqs], targets[start : start + seqs]  # [b, R, V], [b, R]
        if torch.is_grad_enabled() and chunk.requires_grad:
            out.append(checkpoint(_token_logp, chunk, tgt, temperature, use_reentrant=False))
        else:
            out.append(_token_logp(chunk, tgt, temperature))
    return torch.cat(out)  # [B, R]


def naive_token_logprobs(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int,
    temperature: float = 1.0,
) -> torch.Tensor:
    """The textbook version: float32 log_softmax over all [B, T, V] logits, then gather. For tests and benchmarks."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids(attention_mask),
                   use_cache=False).logits  # [B, T, V]
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)[:, prompt_len - 1 : -1]  # [B, R, V]
    return logp.gather(-1, input_ids[:, prompt_len:, None]).squeeze(-1)  # [B, R]


def token_values(critic, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """V of the state before each response token, at the positions whose log-probs are scored: [B, T] -> [B, R].

    The critic is a token-classification model with one output (`posttrain.models.loading`, kind "critic").
    """
    out = critic(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids(attention_mask))
    return out.logits[:, prompt_len - 1 : -1, 0].float()  # [B, R]
