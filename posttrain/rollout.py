"""The online data source: completions of the current policy, sampled with Hugging Face `generate`.

Each prompt is sampled `n` times (a GRPO group); every sample records its group, whether it ended with EOS, and a
response mask that stops after the first EOS.
"""

from __future__ import annotations

import torch

from posttrain.batch import Batch
from posttrain.data import left_pad


def eos_ids(model, tokenizer) -> list[int]:
    """Every token id that ends a completion (generation configs may list several)."""
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None) or tokenizer.eos_token_id
    ids = ids if isinstance(ids, (list, tuple)) else [ids]
    return sorted({int(i) for i in ids} | {int(tokenizer.eos_token_id)})


@torch.no_grad()
def sample(
    model,
    tokenizer,
    prompts: list[list[int]],
    n: int,
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    greedy: bool = False,
) -> Batch:
    """`n` completions of each prompt as a Batch with `group` and `truncated` filled in.

    Args:
        model: an unwrapped Hugging Face causal LM.
        prompts: token ids of each prompt.
        n: samples per prompt; rows i·n … i·n + n − 1 answer prompt i.
    """
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id
    input_ids, attention_mask = left_pad([p for p in prompts for _ in range(n)], pad)  # [B, P]
    input_ids, attention_mask, P = input_ids.to(device), attention_mask.to(device), input_ids.shape[1]
    stop = eos_ids(model, tokenizer)
    was_training = model.training
    model.eval()
    sampling = {} if greedy else dict(temperature=temperature, top_p=top_p, top_k=0)
    out = model.generate(
        input_ids=input_ids, attention_mask=attention_mask, do_sample=not greedy, max_new_tokens=max_new_tokens,
        pad_token_id=pad, eos_token_id=stop, **sampling,
    )  # [B, P + R]
    model.train(was_training)
    response = out[:, P:]  # [B, R]
    R = response.shape[1]
    is_eos = torch.isin(response, torch.tensor(stop, device=device))  # [B, R]
    ended = is_eos.any(-1)  # [B]
    length = torch.where(ended, is_eos.float().argmax(-1) + 1, torch.full_like(ended, R, dtype=torch.long))  # [B]
    mask = (torch.arange(R, device=device)[None] < length[:, None]).float()  # [B, R]
    response = torch.where(mask.bool(), response, torch.full_like(response, pad))
    return Batch(
        input_ids=torch.cat([input_ids, response], 1), attention_mask=torch.cat([attention_mask, mask.long()], 1),
        mask=mask, prompt_len=P, group=torch.arange(len(prompts), device=device).repeat_interleave(n),
        truncated=~ended,
    )


def completions(tokenizer, batch: Batch) -> list[str]:
    """The text of each sampled response, without padding or EOS."""
    return tokenizer.batch_decode(batch.response_ids, skip_special_tokens=True)
