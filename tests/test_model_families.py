"""Five transformers architectures (Llama, Qwen2, Qwen3, Mistral, Gemma) with a byte-level BPE tokenizer and two stop
tokens, each through posttrain's loader, scoring, HF rollout engine, one GRPO step and save: what a user pointing
`model.path` at a small instruct checkpoint runs. Each family's tiny model is built once (tests/families.py) and keeps
its own code path in transformers: grouped-query attention, q/k/v biases, q/k norms, a sliding window shorter than
the prompts, tied and scaled embeddings.
"""

import json
import math

import pytest
import torch
from conftest import FIXTURES
from families import (
    CHAT_TEMPLATE,
    ENDOFTEXT,
    FAMILIES,
    IM_END,
    IM_START,
    WINDOW,
    bpe_tokenizer,
    build_family,
    gsm8k_texts,
    has_family_feature,
    stop_ids,
)

from posttrain.core.batch import collate
from posttrain.models import scoring
from posttrain.models.loading import load, stop_token_ids
from posttrain.models.scoring import token_logprobs
from posttrain.rollout.hf import HFEngine

CLASSES = {name: config.replace("Config", "ForCausalLM") for name, (config, _) in FAMILIES.items()}
TEXT = "Weng earns $12.50/hour × 3 = <<12.5*3=37.5>>37.5\n\n  #### 1,234 — café, 日本, 🙂\t"


@pytest.fixture(scope="session")
def bpe():
    return bpe_tokenizer()


@pytest.fixture(scope="session", params=list(FAMILIES))
def family(request, bpe, tmp_path_factory):
    """(name, model directory) of each family, built once per session."""
    name = request.param
    return name, build_family(name, tmp_path_factory.mktemp(name) / "model", bpe)


@pytest.fixture(scope="session")
def questions():
    """The GSM8K slice's questions."""
    return gsm8k_texts()[0::2]


def test_tokenizer_round_trips_text_and_carries_chatml(bpe):
    """Byte-level BPE decodes any text back unchanged; the specials are single tokens; the template is ChatML."""
    ids = bpe(TEXT)["input_ids"]
    assert bpe.decode(ids) == TEXT and len(ids) < len(TEXT.encode())  # merges were learnt from GSM8K
    assert len(bpe) == 512 and bpe.eos_token == IM_END and bpe.pad_token == ENDOFTEXT
    specials = [IM_START, IM_END, ENDOFTEXT]
    assert bpe("".join(specials))["input_ids"] == bpe.convert_tokens_to_ids(specials)  # one token each
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"}]
    assert bpe.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n1+1?<|im_end|>\n<|im_start|>assistant\n")
    assert bpe.apply_chat_template(chat[1:], tokenize=False).startswith("<|im_start|>user\n")  # no default system


def test_loads_as_its_family_with_both_stop_ids(family, bpe, questions):
    """`load` gives the family's own class with its distinctive feature, and `stop_token_ids` both stop ids: the
    second only from generation_config.json, as the tokenizer's EOS is `<|im_end|>`."""
    name, path = family
    model, tok = load(path)
    assert type(model).__name__ == CLASSES[name] and has_family_feature(name, model)
    assert stop_token_ids(model, tok) == sorted(stop_ids(bpe)) and tok.eos_token_id == stop_ids(bpe)[0]
    assert tok.pad_token_id == bpe.convert_tokens_to_ids(ENDOFTEXT) and len(tok) == model.config.vocab_size
    # the tokenizer as transformers loads it for this model type (for qwen2, a Qwen2Tokenizer rebuilt from the
    # vocabulary and merges with Qwen's own pre-tokenizer): still byte-level, with the specials and template
    assert tok.decode(tok(TEXT)["input_ids"]) == TEXT and tok.get_vocab() == bpe.get_vocab()
    assert tok.chat_template == CHAT_TEMPLATE
    if name == "mistral":  # the window is applied, not only configured: positions past it see less context
        from transformers import AutoModelForCausalLM

        full = AutoModelForCausalLM.from_pretrained(path, sliding_window=None)
        ids = torch.tensor([tok(questions[0])["input_ids"]])
        assert ids.shape[1] > 2 * WINDOW
        with torch.no_grad():
            gap = (model(input_ids=ids).logits - full(input_ids=ids).logits).abs().amax(-1)[0]  # [T]
        assert gap[:WINDOW].max() < 1e-5 and (gap[WINDOW:] > 1e-4).all()


def scored_batch(tok, questions, answers):
    """Three GSM8K rows, prompts of different lengths (left-padded), responses ending in either stop id."""
    ends = stop_ids(tok)
    prompts = [tok(f"Q: {q}\nA: ")["input_ids"] for q in questions[:3]]
    responses = [tok(a, add_special_tokens=False)["input_ids"][: 6 + 3 * i] + [ends[i % 2]]
                 for i, a in enumerate(answers[:3])]
    assert len({len(p) for p in prompts}) == 3
    return prompts, responses, collate(prompts, responses, tok.pad_token_id)


def test_scoring_equals_log_softmax_of_each_unpadded_row(family, monkeypatch):
    """posttrain's per-token log-probs of a left- and right-padded batch equal, in fp32, log_softmax of the model's
    logits gathered at the response tokens of each row run alone without padding; on the chunked-head path (for
    the families posttrain sends there) and on the logits path."""
    _, path = family
    model, tok = load(path)
    texts = gsm8k_texts()
    prompts, responses, b = scored_batch(tok, texts[0::2], texts[1::2])
    want = torch.zeros(b.mask.shape)  # [B, R]
    with torch.no_grad():
        for i, (p, r) in enumerate(zip(prompts, responses)):
            logits = model(input_ids=torch.tensor([p + r])).logits[0].float()  # [T_i, V]
            logp = torch.log_softmax(logits, -1)[len(p) - 1 : -1]  # [R_i, V], position t predicts token t + 1
            want[i, : len(r)] = logp.gather(-1, torch.tensor(r)[:, None]).squeeze(-1)
        # the chunked head takes over every family posttrain lists for it: none falls back silently
        head = scoring.scoring_head(model) is not None
        assert head == (model.config.model_type in scoring.HEAD_SCORED_TYPES)
        paths = {"head" if head else "logits": token_logprobs(model, b.input_ids, b.attention_mask, b.prompt_len)}
        monkeypatch.setattr(scoring, "HEAD_SCORED_TYPES", frozenset())
        assert scoring.scoring_head(model) is None
        paths["logits"] = token_logprobs(model, b.input_ids, b.attention_mask, b.prompt_len)
    assert b.mask.sum(-1).tolist() == [len(r) for r in responses]
    for got in paths.values():
        torch.testing.assert_close(got * b.mask, want, atol=1e-5, rtol=1e-5)


def test_packed_sequences_score_as_each_row_alone(family, monkeypatch):
    """Every family posttrain packs (scoring.PACKED_TYPES) gives the unpadded rows' log-probs from packed rows, in
    rows of the longest's width and with every sequence in one row (Mistral's sliding window shorter than a prompt
    included), on the chunked-head path and on the logits path; a family posttrain does not pack is refused."""
    _, path = family
    model, tok = load(path)
    texts = gsm8k_texts()
    _, _, b = scored_batch(tok, texts[0::2], texts[1::2])
    assert scoring.packs(model) == (model.config.model_type in scoring.PACKED_TYPES)
    assert scoring.packs(model), "each family here is one posttrain packs"
    args = b.input_ids, b.attention_mask, b.prompt_len
    with torch.no_grad():
        want = token_logprobs(model, *args)  # equal to each row alone: the test above
        got = {"rows of the longest": token_logprobs(model, *args, packed=True)}
        monkeypatch.setattr(scoring, "row_width", lambda model, mask: int(mask.sum()))
        got["one row"] = token_logprobs(model, *args, packed=True)
        monkeypatch.setattr(scoring, "HEAD_SCORED_TYPES", frozenset())
        got["one row, from logits"] = token_logprobs(model, *args, packed=True)
    for name, logp in got.items():
        torch.testing.assert_close(logp * b.mask, want * b.mask, atol=1e-5, rtol=1e-5, msg=name)
    model.config.model_type = "gpt2"  # an architecture whose attention posttrain does not confine
    assert not scoring.packs(model)


@pytest.fixture
def stopping_often():
    """Makes a model stop often: a hook pins feature 0 of the final hidden state to k, and the output head reads
    feature 0 into the two stop tokens' logits alone (weight 1; 0 for every other token). Each stop token then has
    probability about `p` at every step, in sampling and in scoring alike, as both see the same forward."""
    hooks = []

    def apply(model, stops, p=0.1):
        k = math.log(p * (model.config.vocab_size - 2) / (1 - 2 * p))  # e^k / (V − 2 + 2e^k) = p
        with torch.no_grad():
            head = model.get_output_embeddings().weight  # [V, H] (Gemma's is its input embedding, too)
            head[:, 0] = 0.0
            head[stops, 0] = 1.0

        def pin(module, args, out):
            return torch.cat([torch.full_like(out[..., :1], k), out[..., 1:]], -1)

        hooks.append(model.model.norm.register_forward_hook(pin))

    yield apply
    for hook in hooks:
        hook.remove()


def test_samples_end_at_the_first_of_either_stop_id_and_are_scored_as_sampled(family, questions, stopping_often):
    """The HF engine's masks end at the first stop token, whichever of the two it is, and rows with none are flagged
    truncated; the ids in the batch are the ids sampled: the trainer's scoring of them gives the log-probs the
    engine reported while drawing them (the KV-cache decode agrees with the full forward)."""
    name, path = family
    model, tok = load(path)
    stops = stop_token_ids(model, tok)
    stopping_often(model, stops)
    engine = HFEngine(model, pad_id=tok.pad_token_id, stop_ids=stops)
    torch.manual_seed(0)
    batch = engine.generate([tok(f"Q: {q}\nA: ")["input_ids"] for q in questions[:3]], 16, max_new_tokens=8)
    R = batch.mask.shape[1]
    assert len(batch) == 48 and R == 8
    endings = set()
    for i in range(len(batch)):
        response, n = batch.response_ids[i].tolist(), int(batch.mask[i].sum())
        assert batch.mask[i, :n].all() and not batch.mask[i, n:].any()  # one block from the start
        first = next((t for t, token in enumerate(response) if token in stops), None)
        if batch.truncated[i]:
            assert first is None and n == R
            endings.add("truncated")
        else:
            assert first == n - 1  # the mask ends at the first stop token, and keeps it
            assert response[n:] == [tok.pad_token_id] * (R - n)
            endings.add(response[first])
    assert endings == {*stops, "truncated"}  # each way of ending happened
    assert batch.attention_mask[:, batch.prompt_len :].float().equal(batch.mask)
    with torch.no_grad():
        scored = token_logprobs(model, batch.input_ids, batch.attention_mask, batch.prompt_len)  # [B, R]
    torch.testing.assert_close(scored * batch.mask, batch.rollout_logp, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="session")
def grpo_run(family, tmp_path_factory):
    """One GRPO step on GSM8K rows through the Engine, as `posttrain run recipe=grpo_math` takes it (bf16-mixed),
    the reward model being the family's own checkpoint with a new score head, so that the rewards of a group
    differ and the advantages are not zero. Returns what the tests look at; the model is saved as a run saves it."""
    from posttrain import backends, config
    from posttrain.sources import run_splits
    from posttrain.train import build
    from posttrain.train.checkpoint import save_model

    name, path = family
    out = tmp_path_factory.mktemp(f"{name}_grpo")
    gsm8k = FIXTURES / "gsm8k"
    cfg, _ = config.load("grpo_math", [
        f"model.path={path}", f"output_dir={out / 'run'}", f"data.path={gsm8k / 'train_head.jsonl'}",
        f"data.test_path={gsm8k / 'test_head.jsonl'}", "train.steps=1", "train.batch_size=2", "algorithm.group_size=2",
        "rollout.max_new_tokens=8", "eval.num_problems=2", "eval.batch_size=2", f"reward_model.path={path}"])
    backend = backends.get(cfg.train.backend)(precision=cfg.train.precision, offload=cfg.train.offload)
    torch.manual_seed(0)
    engine = build(cfg, path, backend, run_splits(cfg))
    policy = backend.generation_model(engine.policy)
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    metrics = engine.step()
    evaluation = engine.evaluate()
    save_model(engine, out / "model")
    return {"name": name, "path": path, "policy": policy, "before": before, "metrics": metrics, "eval": evaluation,
            "saved": out / "model", "rollout": engine.rollout.name,
            "reward_model": type(engine.judge.reward_model.model).__name__}


def test_one_grpo_step_trains_every_weight(grpo_run):
    """The step ran this family (policy and reward model), had something to learn (rewards differ within groups),
    and its finite loss and gradient moved every weight; evaluation decodes and checks two held-out problems."""
    run, m = grpo_run, grpo_run["metrics"]
    assert type(run["policy"]).__name__ == CLASSES[run["name"]] and run["rollout"] == "hf"
    assert run["reward_model"] == CLASSES[run["name"]].replace("CausalLM", "SequenceClassification")
    assert m["reward_std"] > 0 and m["zero_std_frac"] == 0
    assert math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"]) and m["grad_norm"] > 0
    assert math.isfinite(m["kl"]) and m["generated_tokens"] > 0
    unchanged = [n for n, p in run["policy"].named_parameters() if torch.equal(p, run["before"][n])]
    assert unchanged == []
    assert run["eval"]["num_problems"] == 2 and 0 <= run["eval"]["accuracy"] <= 1


def test_saved_model_reloads_with_the_same_logits_tokenizer_and_stop_ids(grpo_run, bpe, questions):
    """The run's saved model directory loads with plain transformers as the same family (tied weights still tied),
    gives the trained in-memory model's logits, and keeps the tokenizer, its chat template and both stop ids."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run, saved, policy = grpo_run, grpo_run["saved"], grpo_run["policy"]
    # the attention the run chose (eager under bf16 on CPU, posttrain.backends.base), for bit-equal logits
    reloaded = AutoModelForCausalLM.from_pretrained(saved, attn_implementation=policy.config._attn_implementation)
    assert type(reloaded).__name__ == CLASSES[run["name"]] and has_family_feature(run["name"], reloaded)
    weights = reloaded.state_dict()
    assert weights.keys() == policy.state_dict().keys()
    assert all(torch.equal(weights[n], p) for n, p in policy.state_dict().items())
    ids = torch.tensor([bpe(questions[1])["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, policy(input_ids=ids).logits, atol=0, rtol=0)
    assert json.loads((saved / "generation_config.json").read_text())["eos_token_id"] == stop_ids(bpe)
    assert stop_token_ids(*load(saved)) == sorted(stop_ids(bpe))
    tok, started = AutoTokenizer.from_pretrained(saved), AutoTokenizer.from_pretrained(run["path"])
    assert type(tok) is type(started) and tok.get_vocab() == started.get_vocab()
    assert (tok.eos_token, tok.pad_token, tok.chat_template) == (IM_END, ENDOFTEXT, CHAT_TEMPLATE)
    chat = [{"role": "system", "content": TEXT}, {"role": "user", "content": questions[2]}]
    text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert text == started.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert tok(text)["input_ids"] == started(text)["input_ids"]
