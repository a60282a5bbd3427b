"""The shared scoring engine equals the naive log_softmax + gather, values and gradients."""

import pytest
import torch

from posttrain.core.batch import collate
from posttrain.models import scoring
from posttrain.models.loading import load
from posttrain.models.scoring import naive_token_logprobs, position_ids, token_logprobs, token_values


@pytest.fixture(scope="module")
def model_and_batch(tiny_model_dir):
    model, tok = load(tiny_model_dir)
    prompts = [tok(t)["input_ids"] for t in ["Q: 1+2\nA: ", "Q: 7\nA: ", "Q: 12-3+4\nA: "]]  # left padding varies
    responses = [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in ["3", "#### 7", "9+4"]]
    return model, collate(prompts, responses, tok.pad_token_id)


@pytest.fixture(params=["head", "logits"])
def path(request, monkeypatch):
    """Each test runs on both scoring paths: the chunked output head, and the logits of models it does not cover."""
    if request.param == "logits":
        monkeypatch.setattr(scoring, "HEAD_SCORED_TYPES", frozenset())
    return request.param


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_rows", [1, 5, 4096])
def test_matches_naive(model_and_batch, path, temperature, chunk_rows):
    model, b = model_and_batch
    assert (scoring.scoring_head(model) is None) == (path == "logits")  # the path under test is the one taken
    with torch.no_grad():
        ours = token_logprobs(model, b.input_ids, b.attention_mask, b.prompt_len, temperature=temperature,
                              chunk_rows=chunk_rows)
        naive = naive_token_logprobs(model, b.input_ids, b.attention_mask, b.prompt_len, temperature)
    assert ours.shape == b.mask.shape
    torch.testing.assert_close(ours * b.mask, naive * b.mask, atol=1e-5, rtol=1e-5)


def test_gradients_match_naive(model_and_batch, path):
    """Chunked scoring (the head's hand-written backward, or checkpointed chunks of logits) back-propagates the same
    gradient as the naive version."""
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


def rows_unpadded(b):
    """Each row of the batch as (prompt ids, response ids) without any padding."""
    for i in range(len(b)):
        prompt = b.input_ids[i, : b.prompt_len][b.attention_mask[i, : b.prompt_len] == 1]
        yield prompt, b.input_ids[i, b.prompt_len :][b.mask[i] == 1]


def test_position_ids_skip_left_padding():
    """Real tokens count from 0 after the left padding, as `generate` numbers them."""
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 1, 1, 1, 0]])
    got = position_ids(mask)
    assert got[mask == 1].tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 2]


@pytest.fixture(scope="module")
def models(tiny_model_dir, model_and_batch):
    """A policy and a critic of two kinds: Llama (rotary positions, where only position differences matter) and
    GPT-2 (learned absolute positions, where a shifted numbering changes every output)."""
    from transformers import GPT2Config, GPT2ForTokenClassification, GPT2LMHeadModel

    policy, _ = model_and_batch
    tok = load(tiny_model_dir)[1]
    torch.manual_seed(0)
    critic, _ = load(tiny_model_dir, "critic")
    cfg = GPT2Config(vocab_size=len(tok), n_positions=64, n_embd=32, n_layer=2, n_head=2, num_labels=1,
                     bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return {"llama": (policy, critic), "gpt2": (GPT2LMHeadModel(cfg).eval(), GPT2ForTokenClassification(cfg).eval())}


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_matches_each_sequence_alone(models, model_and_batch, path, arch, temperature):
    """Padding changes nothing: each row's log-probs are those of its unpadded sequence scored alone, where the model
    numbers positions from 0 by itself: log softmax(logits/τ) at position |q| − 1 + t, taken at response token t."""
    model, _ = models[arch]
    _, b = model_and_batch
    with torch.no_grad():
        ours = token_logprobs(model, b.input_ids, b.attention_mask, b.prompt_len, temperature=temperature)
        for i, (prompt, response) in enumerate(rows_unpadded(b)):
            seq = torch.cat([prompt, response])[None]
            logp = torch.log_softmax(model(input_ids=seq).logits[0].float() / temperature, dim=-1)  # [n, V]
            want = logp[len(prompt) - 1 : -1].gather(-1, response[:, None]).squeeze(-1)
            torch.testing.assert_close(ours[i, : len(response)], want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_values_are_the_state_before_each_token(models, model_and_batch, arch):
    """V_t is the critic's output at the position of the token before response token t (the state q, o_<t), the
    same for a padded row as for the row scored alone."""
    _, critic = models[arch]
    _, b = model_and_batch
    with torch.no_grad():
        values = token_values(critic, b.input_ids, b.attention_mask, b.prompt_len)
        assert values.shape == b.mask.shape and values.dtype == torch.float32
        for i, (prompt, response) in enumerate(rows_unpadded(b)):
            out = critic(input_ids=torch.cat([prompt, response])[None]).logits[0, :, 0]  # [n]
            torch.testing.assert_close(values[i, : len(response)], out[len(prompt) - 1 : -1], atol=1e-5, rtol=1e-5)


def test_bfloat16_model_scores_in_float32(tiny_model_dir, model_and_batch, path):
    """A bfloat16 model's logits are upcast before the log-normaliser: float32 log-probs equal to the float32
    log_softmax of the same logits."""
    _, b = model_and_batch
    model, _ = load(tiny_model_dir, dtype="bfloat16")
    with torch.no_grad():
        ours = token_logprobs(model, b.input_ids, b.attention_mask, b.prompt_len, chunk_rows=5)
        naive = naive_token_logprobs(model, b.input_ids, b.attention_mask, b.prompt_len)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours * b.mask, naive * b.mask, atol=1e-5, rtol=1e-5)


def test_head_backward_is_the_gradient_of_log_softmax():
    """The hand-written backward of the chunked head equals autograd's numerical gradient (float64, with a bias, a
    temperature and chunks that do not divide N)."""
    from posttrain.models.scoring import _HeadLogProb

    torch.manual_seed(0)
    N, H, V = 7, 5, 11
    hidden = torch.randn(N, H, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(V, H, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(V, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, V, (N,))
    assert torch.autograd.gradcheck(
        lambda h, w, b: _HeadLogProb.apply(h, w, b, targets, 0.7, 3, torch.float64), (hidden, weight, bias))
    want = torch.log_softmax((hidden @ weight.T + bias) / 0.7, -1).gather(-1, targets[:, None]).squeeze(-1)
    torch.testing.assert_close(_HeadLogProb.apply(hidden, weight, bias, targets, 0.7, 3, torch.float64), want)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_the_head_never_makes_response_logits(models, model_and_batch, arch):
    """With a request pending the output head returns one log-prob per real response token, never [B, R, V]
    logits; without one it is the same linear layer, and the state dict keeps its names."""
    from posttrain.models.scoring import ScoringHead

    model, _ = models[arch]
    _, b = model_and_batch
    keys = list(model.state_dict())
    shapes = []
    hook = model.get_output_embeddings().register_forward_hook(lambda m, i, out: shapes.append(tuple(out.shape)))
    try:
        with torch.no_grad():
            token_logprobs(model, b.input_ids, b.attention_mask, b.prompt_len)
            logits = model(input_ids=b.input_ids).logits
    finally:
        hook.remove()
    assert isinstance(model.get_output_embeddings(), ScoringHead)
    assert shapes == [(int(b.mask.sum()),), tuple(logits.shape)]
    assert logits.shape == (*b.input_ids.shape, model.config.vocab_size)
    assert list(model.state_dict()) == keys


@pytest.mark.parametrize("model_type", sorted(scoring.HEAD_SCORED_TYPES - {"gpt2"}))  # GPT-2: see `models`
def test_every_head_scored_type_matches_naive(model_and_batch, model_type):
    """Each model type the chunked head covers computes its logits as the head applied to the last hidden states and
    nothing more: values and gradients equal the naive log_softmax for a tiny random model of that type."""
    from transformers import AutoConfig, AutoModelForCausalLM

    _, b = model_and_batch
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(model_type, vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                               num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                               pad_token_id=0, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(cfg)
    assert scoring.scoring_head(model) is not None
    grads = []
    for fn in (lambda: token_logprobs(model, b.input_ids, b.attention_mask, b.prompt_len, temperature=0.7,
                                      chunk_rows=4),
               lambda: naive_token_logprobs(model, b.input_ids, b.attention_mask, b.prompt_len, 0.7)):
        model.zero_grad()
        logp = fn()
        (logp * b.mask).sum().backward()
        grads.append((logp.detach() * b.mask, [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    torch.testing.assert_close(grads[0][0], grads[1][0], atol=1e-5, rtol=1e-5)
    for ours, naive in zip(grads[0][1], grads[1][1]):
        torch.testing.assert_close(ours, naive, atol=1e-5, rtol=1e-4)
