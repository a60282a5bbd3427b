"""The shared per-token scoring engine: log πθ(o_t | q, o_<t) for the response tokens of a padded batch, and the
critic's values V(q, o_<t) at the same positions.

One function serves the policy (with gradients), the old policy and the reference (without). No [B, R, V] logits
tensor is ever alive, in forward or in backward: the output head runs only on the hidden states of the positions
that predict real response tokens, a chunk of positions at a time, and each chunk is reduced to one float32
log-probability per position (its target logit minus the log-normaliser) before the next is computed. Backward
recomputes a chunk's logits from the saved hidden states and head weight (`_HeadLogProb`), so the peak is one chunk
of `chunk_rows` × V floats, whatever B and R are.

Where the head runs matters under sharding. FSDP and ZeRO-3 gather a module's weights only inside that module's own
forward, so a head applied to hidden states after the wrapped model returns would see a shard. Here the head module
itself does the chunked reduction: `token_logprobs` turns the model's plain `nn.Linear` head into a `ScoringHead`
(same parameters, same names, same state dict; an ordinary linear layer whenever no request is pending) and then
calls the wrapped model as usual. The model hands the head the hidden states of the kept positions, the head returns
log-probabilities where logits would be, and every wrapper sees one ordinary forward.

Models whose logits are more than `hidden @ W.T` (soft-capping, logit scales) or that have no `logits_to_keep`
are scored from their logits instead, still reduced in checkpointed chunks of sequences (`_from_logits`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect

import torch
from torch.utils.checkpoint import checkpoint

from posttrain.models.lora import hf_model

# Model types whose causal-LM forward computes logits as exactly `lm_head(hidden[:, -logits_to_keep:])`, nothing
# after it; `tests/test_scoring.py` checks each, in value and gradient, against the naive log_softmax.
HEAD_SCORED_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "gemma", "gpt2", "phi3", "olmo2"})


# Model types whose attention transformers keeps inside each sequence of a packed row, told only by position ids that
# restart at 0 and no attention mask (its packed-sequence masks for eager, SDPA and flex attention; the varlen kernels
# for flash attention). tests/test_model_families.py checks each family's packed forward against its padded one.
PACKED_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "gemma"})
CONFINED_ATTENTION = frozenset({"eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3"})


def packs(model: torch.nn.Module) -> bool:
    """Whether `model` (possibly wrapped) scores packed rows with attention confined to each sequence."""
    config = getattr(hf_model(model), "config", None)
    return (getattr(config, "model_type", None) in PACKED_TYPES
            and getattr(config, "_attn_implementation", None) in CONFINED_ATTENTION)


@dataclasses.dataclass
class Packed:
    """The sequences of a padded batch laid end to end in n rows of width W, no padding between them.

    Each sequence's position ids start again at 0, which is how the model finds where one ends (PACKED_TYPES).
    `keep` marks the positions that predict a response token, and `where` says which: the flat index into the padded
    batch's [B, R] response region of each kept position's target, in `keep`'s (row-major) order.
    """

    input_ids: torch.Tensor  # [n, W]
    position_ids: torch.Tensor  # [n, W]
    keep: torch.Tensor  # [n, W] bool
    where: torch.Tensor  # [N] long


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int, width: int | None = None) -> Packed:
    """The real tokens of each row of a padded batch ([B, T]: prompt left-padded to P, response right-padded), placed
    first-fit, longest first, into rows `width` wide (None: as wide as the longest sequence). A row's tail after its
    last sequence holds token 0 at positions 0, 1, …: a sequence of its own that nothing attends to and nothing
    reads."""
    B, T = input_ids.shape
    R = T - prompt_len
    lengths = attention_mask.sum(-1).tolist()  # [B] prompt + response tokens
    responses = attention_mask[:, prompt_len:].sum(-1).tolist()  # [B]
    width = max(width or 0, *lengths)
    free: list[int] = []  # room left in each packed row
    placed = []  # (row, offset) of each sequence
    for i in sorted(range(B), key=lambda i: -lengths[i]):
        row = next((r for r, room in enumerate(free) if room >= lengths[i]), len(free))
        if row == len(free):
            free.append(width)
        placed.append((i, row, width - free[row]))
        free[row] -= lengths[i]
    n = len(free)
    ids = torch.zeros(n, width, dtype=input_ids.dtype, device=input_ids.device)  # [n, W]
    pos = torch.zeros(n, width, dtype=torch.long, device=input_ids.device)  # [n, W] every column set below
    where = torch.full((n, width), -1, dtype=torch.long, device=input_ids.device)  # [n, W]
    for i, row, at in placed:
        L, r = lengths[i], responses[i]
        ids[row, at : at + L] = input_ids[i][attention_mask[i].bool()]
        pos[row, at : at + L] = torch.arange(L, device=input_ids.device)
        # the response starts at offset L - r; position L - r - 1 + t predicts its token t
        where[row, at + L - r - 1 : at + L - 1] = i * R + torch.arange(r, device=input_ids.device)
    for row, room in enumerate(free):
        pos[row, width - room :] = torch.arange(room, device=input_ids.device)
    keep = where >= 0  # [n, W]
    return Packed(ids, pos, keep, where[keep])


def row_width(model: torch.nn.Module, attention_mask: torch.Tensor) -> int | None:
    """How wide `pack` makes the rows for `model`: every token in one row under flash attention, whose varlen kernel
    computes only within each sequence; else (eager, SDPA, flex: a mask over the whole row, computed at W² per row)
    as wide as the longest sequence, which keeps W and so the masked-out work small."""
    attention = getattr(getattr(hf_model(model), "config", None), "_attn_implementation", None) or ""
    return int(attention_mask.sum()) if attention.startswith("flash") else None


def unpack(values: torch.Tensor, packed: Packed, shape: tuple[int, int]) -> torch.Tensor:
    """[N] values of the kept positions -> [B, R], zeros elsewhere (differentiable in `values`)."""
    return values.new_zeros(shape[0] * shape[1]).index_copy(0, packed.where, values).view(shape)


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding, as `generate` assigns them, so scoring sees what sampling saw."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # [B, T]


@functools.cache
def _accepts_logits_to_keep(forward) -> bool:
    return "logits_to_keep" in inspect.signature(forward).parameters


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype the head's matmul runs in: autocast's when it is on (mixed precision), else the inputs'."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return torch.promote_types(hidden.dtype, weight.dtype)


def _chunk_logits(hidden, weight, bias, temperature: float, dtype: torch.dtype) -> torch.Tensor:
    """Logits / τ of one chunk of positions, in float32 (float64 for float64 inputs): [c, H] -> [c, V]."""
    with torch.autocast(hidden.device.type, enabled=False):
        logits = torch.nn.functional.linear(hidden.to(dtype), weight.to(dtype), None if bias is None else
                                            bias.to(dtype)).to(torch.promote_types(dtype, torch.float32))
    return logits / temperature if temperature != 1.0 else logits


class _HeadLogProb(torch.autograd.Function):
    """log softmax(h Wᵀ + b) / τ)[target] for N positions, `chunk_rows` at a time: [N, H], [V, H], [N] -> [N].

    The gradient of log p_target with respect to the chunk's logits z is (onehot(target) − softmax(z)) / τ; backward
    recomputes z chunk by chunk and sends it through the head by hand, so only one [c, V] chunk is alive at a time.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk_rows, dtype):
        out = torch.empty(len(targets), dtype=torch.promote_types(dtype, torch.float32), device=hidden.device)  # [N]
        for s in range(0, len(targets), chunk_rows):
            logits = _chunk_logits(hidden[s : s + chunk_rows], weight, bias, temperature, dtype)  # [c, V]
            tgt = targets[s : s + chunk_rows, None]  # [c, 1]
            out[s : s + chunk_rows] = logits.gather(-1, tgt).squeeze(-1) - logits.logsumexp(-1)
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.temperature, ctx.chunk_rows, ctx.dtype = temperature, chunk_rows, dtype
        return out

    @staticmethod
    def backward(ctx, grad):  # grad: [N]
        hidden, weight, bias, targets = ctx.saved_tensors
        temperature, chunk_rows, dtype = ctx.temperature, ctx.chunk_rows, ctx.dtype
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden) if need_h else None  # [N, H]
        acc = torch.promote_types(dtype, torch.float32)  # gradients add up in at least float32
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None  # [V, H]
        grad_b = torch.zeros(weight.shape[0], dtype=acc, device=weight.device) if need_b else None  # [V]
        w = weight.to(dtype)
        with torch.autocast(hidden.device.type, enabled=False):
            for s in range(0, len(targets), chunk_rows):
                h = hidden[s : s + chunk_rows].to(dtype)  # [c, H]
                g = grad[s : s + chunk_rows, None].to(acc) / temperature  # [c, 1]
                dz = torch.softmax(_chunk_logits(h, w, bias, temperature, dtype), -1).mul_(-g)  # [c, V]
                dz.scatter_add_(-1, targets[s : s + chunk_rows, None], g)
                if need_b:
                    grad_b += dz.sum(0)
                dz = dz.to(dtype)
                if need_h:
                    grad_h[s : s + chunk_rows] = dz @ w
                if need_w:
                    grad_w += dz.T @ h
        return (grad_h, None if grad_w is None else grad_w.to(weight.dtype),
                None if grad_b is None else grad_b.to(bias.dtype), None, None, None, None)


class ScoringHead(torch.nn.Linear):
    """A causal LM's output head that, while a request is pending (`scoring`), returns the log-probabilities of
    given targets at the kept positions instead of their logits; otherwise an ordinary `nn.Linear`."""

    request: tuple | None = None

    @contextlib.contextmanager
    def scoring(self, keep: torch.Tensor, targets: torch.Tensor, temperature: float, chunk_rows: int):
        """keep: [B, K] bool over the K positions the model hands the head; targets: [N] for the N kept ones."""
        self.request = (keep, targets, temperature, chunk_rows)
        try:
            yield
        finally:
            self.request = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.request is None:
            return super().forward(hidden)
        keep, targets, temperature, chunk_rows = self.request
        h = hidden[keep]  # [B, K, H] -> [N, H]
        return _HeadLogProb.apply(h, self.weight, self.bias, targets, temperature, chunk_rows,
                                  _compute_dtype(h, self.weight))  # [N]


def scoring_head(model: torch.nn.Module) -> ScoringHead | None:
    """The model's output head, turned into a `ScoringHead` in place (parameters untouched); None when the model's
    logits are not simply that head applied to its last hidden states."""
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) not in HEAD_SCORED_TYPES or not _accepts_logits_to_keep(model.forward):
        return None
    head = model.get_output_embeddings()
    if type(head) is torch.nn.Linear:
        head.__class__ = ScoringHead
    return head if isinstance(head, ScoringHead) else None


def _token_logp(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(logits / temperature)[target] in float32: [b, R, V], [b, R] -> [b, R]."""
    logits = logits.float()  # a copy only when the model runs in lower precision
    if temperature != 1.0:
        logits = logits / temperature
    return logits.gather(-1, targets[..., None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)


CHUNK_LOGITS = 2**23  # at most this many logits alive at once when scoring: 32 MiB in float32
CHUNK_ROWS = 1024  # and at most this many positions: larger chunks gain nothing on a small vocabulary


def token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_len: int,
    *,
    temperature: float = 1.0,
    chunk_rows: int | None = None,
    packed: bool = False,
) -> torch.Tensor:
    """Log-probabilities of the response tokens `input_ids[:, prompt_len:]` under `model`.

    Args:
        model: a Hugging Face causal LM, possibly wrapped (DDP, a peft adapter).
        input_ids: [B, T] prompt left-padded to `prompt_len`, then the response.
        attention_mask: [B, T]; its response part marks the real response tokens (the rest is padding).
        prompt_len: P; the response region is columns P..T-1 (R = T - P columns).
        temperature: logits are divided by it, as when sampling.
        chunk_rows: about this many token positions (rows of V logits) are reduced at a time; None: as many as
            fit `CHUNK_LOGITS` logits, at most `CHUNK_ROWS` (256 positions at V = 32k, 55 at V = 152k, 1024 at
            V ≤ 8192).
        packed: run the model on the sequences packed end to end (`pack`; only for a model that `packs`), not on
            the padded rows; the log-probabilities are the same, without the padding's compute.

    Returns:
        [B, R] float32 log-probabilities; what padding positions hold depends on the path, so mask them.
    """
    B, T = input_ids.shape
    R = T - prompt_len
    inner = hf_model(model)  # the transformers model inside DDP's .module and peft's wrapper
    head = scoring_head(inner)
    vocab = head.out_features if head is not None else getattr(getattr(inner, "config", None), "vocab_size", 32_000)
    chunk_rows = chunk_rows or max(1, min(CHUNK_ROWS, CHUNK_LOGITS // vocab))
    if packed:
        return _packed_logprobs(model, head, input_ids, attention_mask, prompt_len, temperature, chunk_rows)
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids(attention_mask),
                  use_cache=False)
    if head is None:
        return _from_logits(model, inner, kwargs, prompt_len, temperature, chunk_rows)
    keep = attention_mask[:, prompt_len:].bool()  # [B, R]: position P - 1 + t predicts response token t
    targets = input_ids[:, prompt_len:][keep]  # [N]
    # The model hands the head positions P - 1 .. T - 1; the last predicts past the end and is never kept.
    with head.scoring(torch.nn.functional.pad(keep, (0, 1)), targets, temperature, chunk_rows):
        flat = model(**kwargs, logits_to_keep=R + 1).logits  # [N]
    return torch.zeros(B, R, dtype=flat.dtype, device=flat.device).masked_scatter(keep, flat)  # [B, R]


def _packed_logprobs(model, head, input_ids, attention_mask, prompt_len: int, temperature: float,
                     chunk_rows: int) -> torch.Tensor:
    """`token_logprobs` of the padded batch, computed on its sequences packed (`pack`): [B, T] -> [B, R]."""
    p = pack(input_ids, attention_mask, prompt_len, row_width(model, attention_mask))
    targets = input_ids[:, prompt_len:].flatten()[p.where]  # [N]
    kwargs = dict(input_ids=p.input_ids, position_ids=p.position_ids, attention_mask=None, use_cache=False)
    if head is not None:
        with head.scoring(p.keep, targets, temperature, chunk_rows):
            flat = model(**kwargs, logits_to_keep=0).logits  # [N] (0 keeps every position)
    else:  # from the logits, a chunk of kept positions at a time
        logits = model(**kwargs).logits[p.keep]  # [N, V]
        parts = [(logits[s : s + chunk_rows], targets[s : s + chunk_rows]) for s in range(0, len(targets), chunk_rows)]
        flat = torch.cat([checkpoint(_token_logp, c, t, temperature, use_reentrant=False)
                          if torch.is_grad_enabled() and c.requires_grad else _token_logp(c, t, temperature)
                          for c, t in parts])  # [N]
    return unpack(flat, p, (input_ids.shape[0], input_ids.shape[1] - prompt_len))  # [B, R]


def _from_logits(model, inner, kwargs: dict, prompt_len: int, temperature: float, chunk_rows: int) -> torch.Tensor:
    """The same from the model's [B, R, V] logits, reduced in checkpointed chunks of whole sequences."""
    B, T = kwargs["input_ids"].shape
    R = T - prompt_len
    if _accepts_logits_to_keep(inner.forward):
        # Positions P-1 .. T-1 are kept; the last one predicts past the end and is dropped.
        logits = model(**kwargs, logits_to_keep=R + 1).logits[:, :-1]  # [B, R, V] (a view)
    else:
        logits = model(**kwargs).logits[:, prompt_len - 1 : -1]  # [B, R, V] (a view)
    targets = kwargs["input_ids"][:, prompt_len:]  # [B, R]
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


def token_values(critic, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int, *,
                 packed: bool = False) -> torch.Tensor:
    """V of the state before each response token, at the positions whose log-probs are scored: [B, T] -> [B, R].

    The critic is a token-classification model with one output (`posttrain.models.loading`, kind "critic"); `packed`
    as in `token_logprobs`.
    """
    if packed:
        p = pack(input_ids, attention_mask, prompt_len, row_width(critic, attention_mask))
        # no cache: with one, transformers would not look for packed sequences (and attention would span the row)
        out = critic(input_ids=p.input_ids, position_ids=p.position_ids, attention_mask=None, use_cache=False)
        return unpack(out.logits[..., 0][p.keep].float(), p, (input_ids.shape[0], input_ids.shape[1] - prompt_len))
    out = critic(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids(attention_mask))
    return out.logits[:, prompt_len - 1 : -1, 0].float()  # [B, R]
