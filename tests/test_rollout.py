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


def test_sharded_decoding_runs_until_every_process_has_stopped(tiny_model_dir):
    """With sharded weights each forward is collective, so the loop stops only when `agree` says every process's
    rows have stopped: here every token stops a row, yet another process (agree -> False) keeps it going to the
    budget, feeding padding; the tokens already sampled are unchanged."""
    model, tok = load(tiny_model_dir)
    every = list(range(model.config.vocab_size))
    prompts = [tok("Q: 3+4\nA: ")["input_ids"]]
    alone = HFEngine(model, pad_id=tok.pad_token_id, stop_ids=every).generate(prompts, 2, max_new_tokens=5,
                                                                               greedy=True)
    votes = []
    waiting = HFEngine(model, pad_id=tok.pad_token_id, stop_ids=every, agree=lambda f: votes.append(f) or False)
    assert waiting.collective and not HFEngine(model, pad_id=0, stop_ids=every).collective
    held = waiting.generate(prompts, 2, max_new_tokens=5, greedy=True)
    assert alone.mask.shape[1] == 1 and held.mask.shape[1] == 5
    assert votes == [True] * 4  # asked after each token but the last; this process was done from the first
    assert held.mask[:, 1:].sum() == 0 and (held.response_ids[:, 1:] == tok.pad_token_id).all()
    assert torch.equal(held.response_ids[:, :1], alone.response_ids)


def test_registry():
    assert get("hf") is HFEngine and ENGINES["hf"].name == "hf"


def test_greedy_decoding_equals_generate(tiny_model_dir):
    """The decode loop (KV cache, last-position logits, left-padded prompts of different lengths, rows that stop
    early) picks the tokens `model.generate` picks, up to each row's first stop token."""
    engine, tok = hf_engine(tiny_model_dir)
    torch.manual_seed(3)
    with torch.no_grad():  # larger random weights: the random model's greedy output depends on its input
        for p in engine.model.parameters():
            p.add_(torch.randn_like(p))
    prompts = [tok(t)["input_ids"] for t in ["Q: 3+4\nA: ", "Q: 12-7+1\nA: ", "Q: 5\nA: ", "Q: 9-9\nA: "]]
    free = engine.generate(prompts, 1, max_new_tokens=12, greedy=True)
    # A token the first row emits at its 4th step, made the stop token: rows stop at different steps, or never.
    engine.stop_ids = [int(free.response_ids[0, 3])]
    ours = engine.generate(prompts, 1, max_new_tokens=12, greedy=True)
    ids, mask = ours.input_ids[:, : ours.prompt_len], ours.attention_mask[:, : ours.prompt_len]
    want = engine.model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=12,
                                 pad_token_id=tok.pad_token_id, eos_token_id=engine.stop_ids)[:, ours.prompt_len :]
    assert len(set(ours.mask.sum(-1).tolist())) > 1  # rows of different lengths
    for i in range(len(ours)):
        n = int(ours.mask[i].sum())
        assert ours.response_ids[i, :n].tolist() == want[i, :n].tolist()


def test_next_token_samples_the_tempered_nucleus():
    """Frequencies over 40,000 draws match softmax(logits / τ) within 4 standard errors; with top-p the tokens
    outside the nucleus never come, and the nucleus is renormalised. Each token's reported log-probability is its
    log-probability under that distribution."""
    from posttrain.rollout.hf import next_token

    torch.manual_seed(0)
    logits = torch.tensor([0.5, -1.0, 2.0, -3.0, 1.0, 0.0])  # not in order of probability
    draws = 40_000
    for temperature, top_p in ((1.0, 1.0), (0.7, 1.0), (1.0, 0.8)):
        p = torch.softmax(logits / temperature, -1)
        if top_p < 1:  # the nucleus: tokens whose more likely ones hold less than top_p
            more_likely = torch.stack([p[p > q].sum() for q in p])  # [V]
            p = p * (more_likely < top_p)
            p = p / p.sum()
        tokens, logp = next_token(logits.expand(draws, -1), temperature=temperature, top_p=top_p)
        torch.testing.assert_close(logp, p.log()[tokens].float())
        freq = torch.bincount(tokens, minlength=len(logits)).double() / draws
        se = (p * (1 - p) / draws).sqrt()
        assert ((freq - p).abs() <= 4 * se + 1e-12).all(), (temperature, top_p, freq, p)
        if top_p < 1:
            assert freq[p == 0].sum() == 0 and (p == 0).any()
    token, logp = next_token(logits[None], greedy=True)
    assert token.item() == 2
    torch.testing.assert_close(logp, logits.log_softmax(-1)[2:3])


def test_reported_logprobs_are_the_trainers_in_fp32(tiny_model_dir):
    """The sampled tokens' log-probs that the decode loop reports equal what scoring computes for the same tokens
    at the same temperature (KV-cache decoding against one full forward), and are 0 on padding."""
    from posttrain.models.scoring import token_logprobs

    engine, tok = hf_engine(tiny_model_dir)
    torch.manual_seed(0)
    batch = engine.generate([tok("Q: 1\nA: ")["input_ids"], tok("Q: 22+3\nA: ")["input_ids"]], 8, max_new_tokens=12,
                            temperature=0.7)
    with torch.no_grad():
        trainer = token_logprobs(engine.model, batch.input_ids, batch.attention_mask, batch.prompt_len,
                                 temperature=0.7)  # [B, R]
    assert batch.rollout_logp.shape == batch.mask.shape and (batch.rollout_logp[batch.mask == 0] == 0).all()
    torch.testing.assert_close(batch.rollout_logp * batch.mask, trainer * batch.mask, atol=1e-4, rtol=0)


def test_rows_that_ended_leave_the_batch_and_the_samples_stay_the_same(tiny_model_dir):
    """rollout.compact_every: every c tokens the rows that have stopped leave the decode loop's batch. Under the same
    seed the tokens are those of the loop that keeps every row (each step still draws a uniform number for every
    row), the generator ends in the same state, and the log-probs agree to float rounding (a matrix product's
    summation order may depend on its row count). The forwards really shrank: the path ran."""
    model, tok = load(tiny_model_dir)
    prompts = [tok(f"Q: {i}+{i}\nA: ")["input_ids"] for i in range(6)]
    sizes = []
    model.register_forward_pre_hook(lambda m, args, kwargs: sizes.append(kwargs["input_ids"].shape[0]),
                                    with_kwargs=True)
    stops = [i for i in range(1, model.config.vocab_size, 6) if i != tok.pad_token_id]  # 1 in 6 ends a row
    runs = {}
    for c in (0, 1, 3):
        engine = HFEngine(model, pad_id=tok.pad_token_id, stop_ids=stops, compact_every=c)
        for greedy in (False, True):
            torch.manual_seed(0)
            sizes.clear()
            # lengths from 1 to the 40-token budget
            batch = engine.generate(prompts, 8, max_new_tokens=40, greedy=greedy)
            runs[c, greedy] = batch, torch.rand(1), list(sizes)
    for greedy in (False, True):
        want, after, forwards = runs[0, greedy]
        assert set(forwards) == {48}  # every row to the end
        for c in (1, 3):
            got, got_after, got_forwards = runs[c, greedy]
            assert torch.equal(got.input_ids, want.input_ids) and torch.equal(got.mask, want.mask)
            assert torch.equal(got.truncated, want.truncated) and torch.equal(got_after, after)
            torch.testing.assert_close(got.rollout_logp, want.rollout_logp, rtol=0, atol=1e-5)
            assert len(got_forwards) == len(forwards) and got_forwards == sorted(got_forwards, reverse=True)
            if not greedy:  # sampled lengths run from 1 to the budget: fewer rows, as many tokens
                assert want.mask.sum(1).min() < 5 and want.mask.sum(1).max() > 20 and min(got_forwards) < 10
