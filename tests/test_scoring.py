"""The shared scoring engine equals the naive log_softmax + gather, values and gradients."""

import pytest
import torch

from posttrain.core.batch import collate
from posttrain.models.loading import load
from posttrain.models.scoring import naive_token_logprobs, token_logprobs


@pytest.fixture(scope="module")
def model_and_batch(tiny_model_dir):
    model, tok = load(tiny_model_dir)
    prompts = [tok(t)["input_ids"] for t in ["Q: 1+2\nA: ", "Q: 7\nA: ", "Q: 12-3+4\nA: "]]  # left padding varies
    responses = [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in ["3", "#### 7", "9+4"]]
    return model, collate(prompts, responses, tok.pad_token_id)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_rows", [1, 5, 4096])
def test_matches_naive(model_and_batch, temperature, chunk_rows):
    model, b = model_and_batch
    with torch.no_grad():
        ours = token_logprobs(model, b.input_ids, b.attention_mask, b.prompt_len, temperature=temperature,
                              chunk_rows=chunk_rows)
        naive = naive_token_logprobs(model, b.input_ids, b.attention_mask, b.prompt_len, temperature)
    assert ours.shape == b.mask.shape
    torch.testing.assert_close(ours * b.mask, naive * b.mask, atol=1e-5, rtol=1e-5)


def test_gradients_match_naive(model_and_batch):
    """Chunked, checkpointed scoring back-propagates the same gradient as the naive version."""
    model, b = model_and_batch
    grads = []
    for fn in (lambda: token_logprobs(model, b.input_ids, b.attention_mask, b.prompt_len, chunk_rows=3),
               lambda: naive_token_logprobs(model, b.input_ids, b.attention_mask, b.prompt_len)):
        model.zero_grad()
        (fn() * b.mask).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    torch.testing.assert_close(grads[0], grads[1], atol=1e-5, rtol=1e-4)


def test_without_logits_to_keep(model_and_batch):
    """Models whose forward has no `logits_to_keep` take the full-logits path and agree."""
    model, b = model_and_batch

    class Plain(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask, position_ids, use_cache):
            return self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)

    with torch.no_grad():
        ours = token_logprobs(Plain(model), b.input_ids, b.attention_mask, b.prompt_len)
        naive = naive_token_logprobs(model, b.input_ids, b.attention_mask, b.prompt_len)
    torch.testing.assert_close(ours * b.mask, naive * b.mask, atol=1e-5, rtol=1e-5)
