"""The HF rollout engine: groups, EOS masking, truncation flags, greedy decoding and weight loading."""

import torch

from posttrain.data import completion_texts
from posttrain.models.loading import load, stop_token_ids
from posttrain.rollout import ENGINES, get
from posttrain.rollout.hf import HFEngine


def hf_engine(model_dir):
    model, tok = load(model_dir)
    return HFEngine(model, pad_id=tok.pad_token_id, stop_ids=stop_token_ids(model, tok)), tok


def test_sample_masks_after_eos_and_flags_truncation(tiny_model_dir):
    engine, tok = hf_engine(tiny_model_dir)
    torch.manual_seed(0)
    # The random model is close to uniform over 100 tokens: about 1 sample in 12 stops within 8 tokens.
    batch = engine.generate([tok("Q: 1\nA: ")["input_ids"], tok("Q: 22\nA: ")["input_ids"]], 60, max_new_tokens=8)
    assert batch.group.tolist() == [0] * 60 + [1] * 60
    assert 0 < batch.truncated.sum() < len(batch)
    R = batch.mask.shape[1]
    for i in range(len(batch)):
        response = batch.response_ids[i].tolist()
        n = int(batch.mask[i].sum())
        assert batch.mask[i, :n].all() and not batch.mask[i, n:].any()  # one contiguous block from the start
        if batch.truncated[i]:
            assert n == R == 8 and tok.eos_token_id not in response
        else:
            assert response[n - 1] == tok.eos_token_id and tok.eos_token_id not in response[: n - 1]
    assert batch.attention_mask[:, batch.prompt_len :].float().equal(batch.mask)
    assert len(completion_texts(tok, batch)) == 120


def test_greedy_is_deterministic(tiny_model_dir):
    engine, tok = hf_engine(tiny_model_dir)
    prompts = [tok("Q: 3+4\nA: ")["input_ids"]]
    a = engine.generate(prompts, 2, max_new_tokens=5, greedy=True)
    b = engine.generate(prompts, 2, max_new_tokens=5, greedy=True)
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.input_ids[0], a.input_ids[1])


def test_load_weights_samples_from_the_new_weights(tiny_model_dir, tmp_path):
    """Weights of another model copied in: greedy output follows them. The policy's own weights copy nothing."""
    engine, tok = hf_engine(tiny_model_dir)
    other, _ = load(tiny_model_dir)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn_like(p))
    prompts = [tok("Q: 3+4\nA: ")["input_ids"]]
    before = engine.generate(prompts, 1, max_new_tokens=8, greedy=True)
    want = HFEngine(other, pad_id=tok.pad_token_id, stop_ids=engine.stop_ids).generate(prompts, 1, max_new_tokens=8,
                                                                                       greedy=True)
    assert not torch.equal(before.input_ids, want.input_ids)
    copied = engine.load_weights(other.named_parameters())
    assert copied == sum(p.numel() * p.element_size() for p in other.parameters())
    assert torch.equal(engine.generate(prompts, 1, max_new_tokens=8, greedy=True).input_ids, want.input_ids)
    assert engine.load_weights(engine.model.named_parameters()) == 0  # colocated: already in place


def test_registry():
    assert get("hf") is HFEngine and ENGINES["hf"].name == "hf"
