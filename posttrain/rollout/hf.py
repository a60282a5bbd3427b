"""The Hugging Face `generate` engine, colocated: it samples from the trainer's own policy module.

Colocated means the engine's model is the policy the trainer updates (the same parameters, not a copy), so
`load_weights` finds every tensor already in place and copies nothing; given another module's weights (a copy, a
gathered shard) it copies them in. Each prompt is sampled `n` times (a GRPO group); every sample records its group,
whether it ended with a stop token, and a response mask that ends after the first one.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from posttrain.core.batch import Batch, left_pad
from posttrain.rollout.base import RolloutEngine, register


@register("hf")
class HFEngine(RolloutEngine):
    """Sampling with `model.generate`.

    Args:
        model: an unwrapped Hugging Face causal LM.
        pad_id: the padding token id.
        stop_ids: every token id that ends a completion.
    """

    def __init__(self, model, *, pad_id: int, stop_ids: list[int]):
        self.model, self.pad_id, self.stop_ids = model, pad_id, list(stop_ids)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], n: int, *, max_new_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0, greedy: bool = False) -> Batch:
        model, pad = self.model, self.pad_id
        device = next(model.parameters()).device
        input_ids, attention_mask = left_pad([p for p in prompts for _ in range(n)], pad)  # [B, P]
        input_ids, attention_mask, P = input_ids.to(device), attention_mask.to(device), input_ids.shape[1]
        was_training = model.training
        model.eval()
        sampling = {} if greedy else dict(temperature=temperature, top_p=top_p, top_k=0)
        out = model.generate(
            input_ids=input_ids, attention_mask=attention_mask, do_sample=not greedy, max_new_tokens=max_new_tokens,
            pad_token_id=pad, eos_token_id=self.stop_ids, **sampling,
        )  # [B, P + R]
        model.train(was_training)
        response = out[:, P:]  # [B, R]
        R = response.shape[1]
        is_eos = torch.isin(response, torch.tensor(self.stop_ids, device=device))  # [B, R]
        ended = is_eos.any(-1)  # [B]
        length = torch.where(ended, is_eos.float().argmax(-1) + 1, torch.full_like(ended, R, dtype=torch.long))  # [B]
        mask = (torch.arange(R, device=device)[None] < length[:, None]).float()  # [B, R]
        response = torch.where(mask.bool(), response, torch.full_like(response, pad))
        return Batch(
            input_ids=torch.cat([input_ids, response], 1), attention_mask=torch.cat([attention_mask, mask.long()], 1),
            mask=mask, prompt_len=P, group=torch.arange(len(prompts), device=device).repeat_interleave(n),
            truncated=~ended,
        )

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        params = dict(self.model.named_parameters())
        copied = 0
        for name, tensor in weights:
            target = params[name]
            if target.data_ptr() != tensor.data_ptr():  # colocated: the same storage, nothing to copy
                target.copy_(tensor)
                copied += tensor.numel() * tensor.element_size()
        return copied

    def release(self) -> None:
        # generate keeps no KV cache between calls; what it cached on a GPU goes back to the device.
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def restore(self) -> None:
        pass  # nothing was taken away: the weights are the policy's own
