"""Online rollouts: groups, EOS masking and truncation flags."""

import torch

from posttrain import rollout
from posttrain.trainer import load_model


def test_sample_masks_after_eos_and_flags_truncation(tiny_model_dir):
    model, tok = load_model(tiny_model_dir)
    torch.manual_seed(0)
    # The random model is close to uniform over 100 tokens: about 1 sample in 12 stops within 8 tokens.
    batch = rollout.sample(model, tok, [tok("Q: 1\nA: ")["input_ids"], tok("Q: 22\nA: ")["input_ids"]], 60,
                           max_new_tokens=8)
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
    assert len(rollout.completions(tok, batch)) == 120


def test_greedy_is_deterministic(tiny_model_dir):
    model, tok = load_model(tiny_model_dir)
    prompts = [tok("Q: 3+4\nA: ")["input_ids"]]
    a = rollout.sample(model, tok, prompts, 2, max_new_tokens=5, greedy=True)
    b = rollout.sample(model, tok, prompts, 2, max_new_tokens=5, greedy=True)
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.input_ids[0], a.input_ids[1])
