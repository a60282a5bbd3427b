"""Token-budget micro-batches and packed sequences leave the gradient as it is: for every method on one process here,
on two processes under each backend in tests/test_distributed.py. And the packing itself: position ids restart,
attention stays inside each sequence, and a broken packing is caught."""

import pytest
import torch
from conftest import FIXTURES

from posttrain import config
from posttrain.backends.ddp import DDP
from posttrain.core.aggregation import Totals
from posttrain.core.batch import collate
from posttrain.core.errors import ConfigError
from posttrain.core.micro import token_budget
from posttrain.models import scoring
from posttrain.models.scoring import pack, packs, token_logprobs, token_values
from posttrain.sources import run_splits
from posttrain.train import build

# Each recipe at test size: few prompts, short completions, a nonzero KL weight where the method has one.
SMALL = ["train.batch_size=4", "rollout.max_new_tokens=12", "data.train_size=64", "data.test_size=4",
         "eval.num_problems=4", "train.precision=fp32", "data.difficulty=1", "rollout.temperature=1.5"]
GROUPS = {"grpo_math", "dapo_math", "drgrpo_math", "gspo_math", "grpo_ps_math", "rloo_math", "reinforce_pp_math"}


def test_token_budget_fills_micro_batches_in_order():
    """Real tokens when packed, rows × the longest when padded; a unit over the budget alone; units kept whole."""
    five = [[9], [7], [5], [3], [1]]
    assert token_budget(five, 12, packed=True) == [[0], [1, 2], [3, 4]]  # 9 | 7+5 | 3+1
    assert token_budget(five, 12, packed=False) == [[0], [1], [2, 3], [4]]  # 9 | 7 | 2 × 5 | 1 (3 × 5 > 12)
    assert token_budget([[20], [4]], 12, packed=True) == [[0], [1]]  # too long for any budget: alone
    pairs = [[6, 5], [4, 4], [3, 2]]
    assert token_budget(pairs, 14, packed=True) == [[0], [1, 2]]  # pairs stay whole: 11 | 8 + 5
    assert token_budget(pairs, 16, packed=False) == [[0], [1, 2]]  # 2 × 6 | 4 × 4
    with pytest.raises(ConfigError, match="micro_batch_tokens: must be ≥ 1"):
        config.load("grpo_math", ["train.micro_batch_tokens=0"])


def test_pack_restarts_positions_and_maps_every_response_token(tiny_model_dir, monkeypatch):
    """Three sequences in two rows of the longest's width; each sequence's positions from 0; `where` names every
    real response token once; the log-probs and values are the padded ones."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    b = collate([[1, 5, 6], [1, 8], [1, 9]], [[20, 2], [30, 31, 32, 33, 34, 35], [40]], 0)  # 5, 8 and 3 tokens
    p = pack(b.input_ids, b.attention_mask, b.prompt_len)
    assert p.input_ids.tolist() == [[1, 8, 30, 31, 32, 33, 34, 35], [1, 5, 6, 20, 2, 1, 9, 40]]
    assert p.position_ids.tolist() == [list(range(8)), [0, 1, 2, 3, 4, 0, 1, 2]]
    assert sorted(p.where.tolist()) == (b.mask.flatten() > 0).nonzero().flatten().tolist()
    tail = pack(b.input_ids[:2], b.attention_mask[:2], b.prompt_len)  # 8 | 5: a tail of 3 after the second
    assert tail.position_ids[1].tolist() == [0, 1, 2, 3, 4, 0, 1, 2] and tail.input_ids[1, 5:].tolist() == [0, 0, 0]
    assert not tail.keep[1, 5:].any()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    critic = AutoModelForTokenClassification.from_pretrained(tiny_model_dir, num_labels=1)
    assert packs(model) and packs(critic)
    args = b.input_ids, b.attention_mask, b.prompt_len
    padded, packed = token_logprobs(model, *args), token_logprobs(model, *args, packed=True)
    torch.testing.assert_close(packed * b.mask, padded * b.mask, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(token_values(critic, *args, packed=True) * b.mask, token_values(critic, *args) * b.mask,
                               atol=2e-6, rtol=1e-5)
    one_row = pack(*args, width=16)  # as flash attention's varlen kernel takes them: every sequence in one row
    assert one_row.input_ids.shape == (1, 16) and one_row.position_ids[0].tolist() == [*range(8), *range(5), *range(3)]
    monkeypatch.setattr(scoring, "row_width", lambda model, mask: int(mask.sum()))
    torch.testing.assert_close(token_logprobs(model, *args, packed=True) * b.mask, padded * b.mask, atol=2e-6, rtol=1e-5)


def test_a_broken_packing_is_caught(tiny_model_dir):
    """What the equality checks guard against: positions that run on across a row, or attention that spans it, give
    other log-probs for the sequences that share a row."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    b = collate([[1, 5, 6], [1, 8], [1, 9]], [[20, 2], [30, 31, 32, 33, 34, 35], [40]], 0)  # rows 0 and 2 share
    padded = token_logprobs(model, b.input_ids, b.attention_mask, b.prompt_len)
    p = pack(b.input_ids, b.attention_mask, b.prompt_len)
    targets = b.input_ids[:, b.prompt_len :].flatten()[p.where]

    def scored(position_ids, attention_mask):
        logits = model(input_ids=p.input_ids, position_ids=position_ids, attention_mask=attention_mask,
                       use_cache=False).logits
        logp = torch.log_softmax(logits.float(), -1)[p.keep].gather(-1, targets[:, None]).squeeze(-1)
        return scoring.unpack(logp, p, padded.shape)

    torch.testing.assert_close(scored(p.position_ids, None) * b.mask, padded * b.mask, atol=2e-6, rtol=1e-5)
    run_on = torch.arange(p.input_ids.shape[1]).expand_as(p.input_ids)  # one sequence per row: attention leaks
    leaking = torch.ones_like(p.input_ids)  # restarting positions, but a mask that lets every token see the row
    second = torch.zeros_like(b.mask)
    second[2] = b.mask[2]  # the sequence placed after another in its row
    for wrong in (scored(run_on, None), scored(p.position_ids, leaking)):
        assert ((wrong - padded) * second).abs().max() > 1e-3


def prepared(recipe, model_dir, tmp_path):
    """The engine of `recipe` at test size and one of its batches as the update sees it: sampled (or read), scored
    (reference, old log-probs, values), prepared by the plugin."""
    extra = ["algorithm.group_size=4"] if recipe in GROUPS else []
    if recipe == "ppo_math":
        extra.append("algorithm.beta=0.05")
    if recipe == "sft_gsm8k":  # real GSM8K answers: 50 to 400 tokens, the lengths packing is for
        extra += [f"data.path={FIXTURES / 'gsm8k' / 'train_head.jsonl'}",
                  f"data.test_path={FIXTURES / 'gsm8k' / 'test_head.jsonl'}"]
    teacher = None
    if recipe == "distill_math":  # another tiny model with the same tokens: a teacher the student differs from
        from posttrain.models.embedded import build_model_dir

        teacher = build_model_dir(tmp_path / "teacher", hidden=32, layers=2, heads=2, seed=1)
        extra.append("algorithm.samples_per_prompt=4")
    cfg, _ = config.load(recipe, [f"model.path={model_dir}", f"output_dir={tmp_path / recipe}", *SMALL, *extra])
    engine = build(cfg, model_dir, DDP(), run_splits(cfg), teacher_path=teacher)
    torch.manual_seed(0)
    batch = ragged(engine.source.next()[0], engine.tokenizer.pad_token_id)
    if batch.reward is not None:  # rewards that differ within every group: advantages, and so a gradient
        batch.reward = torch.arange(len(batch)).remainder(2).float()  # 0, 1, 0, 1, …
    if "step_reward" in batch.extra:  # process supervision: one step, ending at each row's last token
        last = batch.mask.sum(-1).long() - 1  # [B]
        batch.extra["step_end"] = torch.nn.functional.one_hot(last, batch.mask.shape[1]).float()  # [B, R]
        batch.extra["step_reward"] = batch.extra["step_end"] * torch.rand(len(batch), 1)
    batch = engine.scored(batch)
    return engine, engine.plugin.prepare(batch, engine.algorithm)[0]


def ragged(batch, pad_id):
    """The batch with each response cut to a random length (at least one token), so that lengths differ enough for
    short sequences to share a row with a long one."""
    keep = torch.rand(len(batch)) * batch.mask.sum(-1)  # [B]
    cut = torch.arange(batch.mask.shape[1])[None] >= keep.ceil().clamp(min=1)[:, None]  # [B, R] dropped positions
    batch.mask = batch.mask.masked_fill(cut, 0)
    batch.attention_mask[:, batch.prompt_len :].masked_fill_(cut, 0)
    batch.input_ids[:, batch.prompt_len :].masked_fill_(cut, pad_id)
    return batch


def gradients(engine, batch) -> dict[str, torch.Tensor]:
    """The whole batch's gradient of every trained model, flattened; gradients cleared after."""
    engine.accumulate(batch, Totals.of(batch.mask))
    out = {}
    for name, trained in engine.trained().items():
        out[name] = torch.cat([p.grad.flatten() for p in trained.module.parameters() if p.grad is not None])
        trained.optimizer.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("recipe", sorted(config.known_recipes()))
def test_token_budgets_and_packing_keep_every_methods_gradient(recipe, tiny_model_dir, tmp_path, monkeypatch):
    """Padded rows in one micro-batch; token budgets, padded; token budgets, packed in rows of the longest's width
    (eager and SDPA attention) and in one row (flash attention's varlen): the same gradient, policy and critic, within
    fp32 rounding. The split and the packing really happen (several micro-batches; sequences sharing rows)."""
    engine, batch = prepared(recipe, tiny_model_dir, tmp_path)
    assert batch.mask.sum() > 0 and len(batch) >= 4
    shapes, real_pack = [], scoring.pack  # (sequences, packed rows) of each packing

    def spy(input_ids, *args):
        packed = real_pack(input_ids, *args)
        shapes.append((len(input_ids), len(packed.input_ids)))
        return packed

    monkeypatch.setattr(scoring, "pack", spy)
    budget = int(batch.lengths().float().mean() * 3)  # about three rows' tokens: several micro-batches
    runs, splits = {}, {}
    for name, tokens, packed in (("padded", None, False), ("budget", budget, False), ("packed", budget, True),
                                 ("one row", budget, True)):
        if name == "one row":
            shapes.clear()
            monkeypatch.setattr(scoring, "row_width", lambda model, mask: int(mask.sum()))
        engine.micro, engine.micro_tokens, engine.packed = len(batch), tokens, packed
        splits[name] = len(engine.micro_batches(batch))
        runs[name] = gradients(engine, batch)
    assert splits["padded"] == 1 and splits["budget"] > 1 and splits["packed"] > 1
    assert shapes and all(rows == 1 for _, rows in shapes) and any(seqs > 1 for seqs, _ in shapes)
    assert set(runs["padded"]) == ({"policy", "critic"} if recipe == "ppo_math" else {"policy"})
    for name in ("budget", "packed", "one row"):
        for role, grad in runs["padded"].items():
            assert grad.abs().sum() > 0, role
            torch.testing.assert_close(runs[name][role], grad, atol=1e-6, rtol=1e-4, msg=f"{name} {role}")


@pytest.mark.parametrize("confined", [True, False])
def test_a_run_packs_or_says_it_cannot(confined, tiny_model_dir, tmp_path, monkeypatch, capsys):
    """A packed run under a token budget trains and says it packed (summary.json); where the model's attention
    cannot be confined to each sequence it runs padded, after a one-line notice."""
    from posttrain.train import run

    if not confined:
        monkeypatch.setattr(scoring, "PACKED_TYPES", frozenset())
    cfg, resolved = config.load("grpo_math", [f"model.path={tiny_model_dir}", f"output_dir={tmp_path / 'run'}",
                                              *SMALL, "train.steps=2", "algorithm.group_size=4",
                                              "train.micro_batch_tokens=96", "train.packing=true"])
    summary = run(cfg, resolved)
    notice = [line for line in capsys.readouterr().err.splitlines() if "notice" in line]
    assert summary["packed"] is confined
    assert notice == ([] if confined else ["posttrain: notice: train.packing: llama (sdpa) attention cannot be kept "
                                           "inside each of several sequences in one row here; micro-batches run "
                                           "padded"])
    assert (tmp_path / "run" / "metrics.jsonl").read_text().count("\n") == 2
