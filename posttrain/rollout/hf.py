"""The Hugging Face engine, colocated: it samples from the trainer's own policy module.

Colocated means the engine's model is the policy the trainer updates (the same parameters, with a LoRA adapter in
place when there is one, not a copy), so an update needs no weight sync and the trainer skips it; `load_weights`,
given another module's weights (a copy, a gathered shard), copies them in. Each prompt is sampled `n` times (a
GRPO group); every sample records its group, whether it ended with a stop token, and a response mask that ends after
the first one.

Decoding is a plain loop over the model's forward with a KV cache, not `model.generate`: one prefill, then one token
per step with logits only for the last position, stopping as soon as every row has ended. Every
`rollout.compact_every` tokens the rows that have ended leave the batch (`keep_rows`), so a long tail of lengths is
not paid for by every row; the uniform numbers are still drawn for every row, so the tokens are the same. The cache is allocated
once at its full length (prompt + budget) and written in place: a cache grown by concatenation copies itself at
every token, and its ever larger freed copies left the C heap fragmented (1.3 GB more peak RSS in a ~100M model's
bf16 rollout). Tokens are drawn by
inverting the float64 CDF of softmax(logits / τ) with one uniform number per row. That is an exact sample from the
same distribution `generate` draws from, without the [B, V] exponential noise its `multinomial` draws on CPU, which
took over half of the rollout time. Greedy decoding returns the same tokens as `generate` (tests/test_rollout.py).
`bench/vs_trl.py` measures the rollout phase against `generate`.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterable

import torch
from transformers import DynamicCache, StaticCache

from posttrain.core.batch import Batch, left_pad
from posttrain.models.scoring import position_ids
from posttrain.rollout.base import RolloutEngine, Setup, counts, register


@register("hf")
class HFEngine(RolloutEngine):
    """Sampling from the trainer's own policy module, in a KV-cache decode loop.

    Args:
        model: an unwrapped Hugging Face causal LM.
        pad_id: the padding token id.
        stop_ids: every token id that ends a completion.
    """

    colocated = True
    stops = True

    def __init__(self, model, *, pad_id: int, stop_ids: list[int], agree=None, compact_every: int = 16):
        self.model, self.pad_id, self.stop_ids, self.agree = model, pad_id, list(stop_ids), agree
        self.compact_every = compact_every

    @property
    def collective(self) -> bool:
        """True when the model's weights are sharded, so every process must make the same calls."""
        return self.agree is not None

    @classmethod
    def start(cls, setup: Setup) -> HFEngine:
        return cls(setup.policy, pad_id=setup.pad_id, stop_ids=setup.stop_ids, agree=setup.agree,
                   compact_every=getattr(setup.sampling, "compact_every", 16))

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], n: int | list[int], *, max_new_tokens: int,
                 temperature: float = 1.0, top_p: float = 1.0, greedy: bool = False,
                 stop: list[list[int]] | None = None) -> Batch:
        model, pad = self.model, self.pad_id
        device = next(model.parameters()).device
        sizes = counts(n, len(prompts))
        input_ids, attention_mask = left_pad([p for p, k in zip(prompts, sizes) for _ in range(k)], pad)  # [B, P]
        input_ids, attention_mask, P = input_ids.to(device), attention_mask.to(device), input_ids.shape[1]
        was_training = model.training
        model.eval()
        try:
            response, logp = decode(model, input_ids, attention_mask, max_new_tokens, stop_ids=self.stop_ids,
                                    pad_id=pad, temperature=temperature, top_p=top_p, greedy=greedy,
                                    agree=self.agree, compact_every=self.compact_every, stop=stop)  # [B, R] x2
        finally:
            model.train(was_training)
        R = response.shape[1]
        ends = stopped(response, self.stop_ids, stop)  # [B, R]
        ended = ends.any(-1)  # [B]
        length = torch.where(ended, ends.float().argmax(-1) + 1, torch.full_like(ended, R, dtype=torch.long))  # [B]
        mask = (torch.arange(R, device=device)[None] < length[:, None]).float()  # [B, R]
        response = torch.where(mask.bool(), response, torch.full_like(response, pad))
        return Batch(
            input_ids=torch.cat([input_ids, response], 1), attention_mask=torch.cat([attention_mask, mask.long()], 1),
            mask=mask, prompt_len=P, group=torch.arange(len(prompts), device=device).repeat_interleave(torch.tensor(sizes, device=device)),
            truncated=~ended, rollout_logp=logp * mask,
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


@functools.cache
def _forward_keys(forward) -> frozenset[str]:
    return frozenset(inspect.signature(forward).parameters)


_STATIC = {"ok": True}  # False once this transformers' StaticCache has failed on mixed key/value dtypes


def _new_cache(config, length: int):
    if _STATIC["ok"]:
        try:
            return StaticCache(config=config, max_cache_len=length)
        except TypeError:  # transformers before 5: its StaticCache wants the batch size and dtype up front
            pass
    try:
        return DynamicCache(config=config)
    except TypeError:  # transformers before the config argument
        return DynamicCache()


def _prefill(model, cache_key: str, length: int, **inputs):
    """The prompt's forward, filling a new cache; returns (output, cache).

    Under bf16 autocast the rotary embedding leaves keys in float32 and values in bf16. transformers before 5.20
    allocates a static layer in the keys' dtype for both and then fails to copy the values in; there the decode loop
    falls back to a growing cache for the rest of the process.
    """
    cache = _new_cache(model.config, length)
    try:
        return model(**inputs, **{cache_key: cache}), cache
    except RuntimeError as err:
        if not isinstance(cache, StaticCache) or "same dtype" not in str(err):
            raise
        _STATIC["ok"] = False
        cache = _new_cache(model.config, length)
        return model(**inputs, **{cache_key: cache}), cache


def next_token(logits: torch.Tensor, *, temperature: float = 1.0, top_p: float = 1.0, greedy: bool = False,
               uniform: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row from softmax(logits / τ), restricted to the top-p nucleus: [B, V] -> [B], [B].

    The nucleus keeps, in order of probability, every token whose more likely tokens hold less than `top_p` of the
    mass (so at least the most likely one). Sampling inverts the float64 CDF at one uniform number per row
    (`uniform`, [B, 1] float64 in [0, 1), drawn here when not given).
    Also returns each token's log-probability under the distribution it was drawn from: the nucleus renormalised,
    or log softmax(logits) when greedy.
    """
    if greedy:
        token = logits.argmax(-1)  # [B]
        return token, logits.float().log_softmax(-1).gather(-1, token[:, None]).squeeze(-1)
    probs = torch.softmax(logits.float() / temperature, -1)  # [B, V]
    order = None
    if top_p < 1.0:
        probs, order = probs.sort(-1, descending=True)
        probs = probs * ((probs.cumsum(-1) - probs) < top_p)  # [B, V] sorted, tail zeroed
    cdf = probs.double().cumsum_(-1)  # [B, V]
    if uniform is None:
        uniform = torch.rand(len(cdf), 1, dtype=torch.float64, device=cdf.device)
    u = uniform * cdf[:, -1:]  # [B, 1] in [0, total)
    token = torch.searchsorted(cdf, u, right=True).clamp_(max=cdf.shape[-1] - 1)  # [B, 1]
    logp = (probs.gather(-1, token).double().log() - cdf[:, -1:].log()).float().squeeze(-1)  # [B]
    return (token if order is None else order.gather(-1, token)).squeeze(-1), logp


def keep_rows(cache, rows: torch.Tensor) -> bool:
    """Keeps only `rows` of every layer of a KV cache (new, smaller tensors: the others' memory is freed); False
    when this cache's layers are not the plain key/value tensors it knows (nothing is changed then)."""
    layers = getattr(cache, "layers", None)
    if not layers or not all(isinstance(getattr(layer, "keys", None), torch.Tensor) and
                             isinstance(getattr(layer, "values", None), torch.Tensor) for layer in layers):
        return False
    for layer in layers:
        layer.keys, layer.values = layer.keys.index_select(0, rows), layer.values.index_select(0, rows)
        if hasattr(layer, "batch_size"):
            layer.batch_size = len(rows)
    return True


def stopped(tokens: torch.Tensor, stop_ids: list[int], stop: list[list[int]] | None = None) -> torch.Tensor:
    """[B, R] bool: True where a row's tokens end a completion there: a stop token, or the last token of one of
    the `stop` sequences (a tool call's closing tag, as token ids)."""
    ends = torch.isin(tokens, torch.tensor(stop_ids, device=tokens.device))  # [B, R]
    for seq in stop or []:
        k = len(seq)
        if 0 < k <= tokens.shape[1]:
            windows = tokens.unfold(1, k, 1)  # [B, R - k + 1, k]
            hit = (windows == torch.tensor(seq, device=tokens.device)).all(-1)  # [B, R - k + 1]
            ends[:, k - 1 :] |= hit
    return ends


def decode(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int, *,
           stop_ids: list[int], pad_id: int, agree=None, compact_every: int = 0,
           stop: list[list[int]] | None = None, **sampling) -> tuple[torch.Tensor, torch.Tensor]:
    """Continues each left-padded prompt by up to `max_new_tokens` tokens: [B, P] -> [B, R], R ≤ max_new_tokens,
    with the tokens' log-probabilities as `next_token` gives them ([B, R] float32).

    After a row emits a stop token (or ends one of the `stop` sequences) it is fed `pad_id`; decoding ends when
    every row has stopped, or with sharded weights (`agree` given) when every row of every process has: each
    forward gathers weights from all of them.
    With `compact_every` = c > 0, every c tokens the rows that have stopped leave the batch: their cache rows are
    freed and their logits no longer computed. The tokens drawn stay the same: each step still draws one uniform
    number for every row of the batch, in the same order, and a running row uses its own.
    """
    B, P = input_ids.shape
    keys = _forward_keys(model.forward)
    # transformers renamed `past_key_values` to `cache` in 5.x; a cache built from the config knows sliding windows.
    cache_key = "cache" if "cache" in keys else "past_key_values"
    last = {"logits_to_keep": 1} if "logits_to_keep" in keys else {}
    mask = torch.cat([attention_mask, attention_mask.new_ones(B, max_new_tokens)], 1)  # [B, P + R]
    position = position_ids(attention_mask)  # [B, P]: positions that skip the left padding, as scoring numbers them
    stops = torch.tensor(stop_ids, device=input_ids.device)
    sequences = [(torch.tensor(seq, device=input_ids.device), len(seq)) for seq in stop or [] if seq]
    out, cache = _prefill(model, cache_key, P + max_new_tokens, input_ids=input_ids, attention_mask=attention_mask,
                          position_ids=position, use_cache=True, **last)
    position = position[:, -1:]  # [b, 1], b the rows still in the batch
    rows = torch.arange(B, device=input_ids.device)  # [b]: which of the B rows they are
    tokens = torch.full((B, max_new_tokens), pad_id, dtype=torch.long, device=input_ids.device)  # [B, R]
    logps = torch.zeros(B, max_new_tokens, device=input_ids.device)  # [B, R]
    done = torch.zeros(B, dtype=torch.bool, device=input_ids.device)  # [b]
    R = max_new_tokens
    for t in range(max_new_tokens):
        # one uniform number for every row of the whole batch, each running row taking its own (none when greedy)
        uniform = None if sampling.get("greedy") else torch.rand(B, 1, dtype=torch.float64, device=input_ids.device)[rows]
        token, logp = next_token(out.logits[:, -1], uniform=uniform, **sampling)  # [b], [b]
        tokens[rows, t] = token.masked_fill_(done, pad_id)
        logps[rows, t] = logp.masked_fill_(done, 0.0)
        done |= torch.isin(token, stops)
        for seq, k in sequences:  # a stop sequence's last token, after the rest of it
            if t + 1 >= k:
                done |= (tokens[rows, t + 1 - k : t + 1] == seq).all(-1)
        if t == max_new_tokens - 1 or (agree(bool(done.all())) if agree else bool(done.all())):
            R = t + 1
            break
        if compact_every and (t + 1) % compact_every == 0 and done.any() and not done.all():
            running = (~done).nonzero().squeeze(-1)  # [b'] positions in the batch as it is
            if keep_rows(cache, running):
                rows, done, position, mask = rows[running], done[running], position[running], mask[running]
                token = token[running]
        position = position + 1
        out = model(input_ids=token[:, None], attention_mask=mask[:, : P + t + 1], position_ids=position,
                    use_cache=True, **{cache_key: cache}, **last)
    return tokens[:, :R], logps[:, :R]  # [B, R], [B, R]
