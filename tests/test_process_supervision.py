"""GRPO with process supervision (algorithms/grpo_ps.py): the step advantage by hand, the surrogate gradient against
autograd on Eq. 3 with the PS advantage written out as loops, the embedded task's rule process reward by hand, step
ends on the sampled tokens (character and byte-level BPE tokenizers), the process reward model's scoring positions,
the config errors, and end-to-end runs on step rewards."""

import json
import math
from types import SimpleNamespace

import pytest
import torch
from cli_helpers import posttrain
from conftest import EASY
from helpers import objective_grad, surrogate_grad, written_out_mean

from posttrain import config
from posttrain.algorithms import get
from posttrain.algorithms.grpo_ps import GRPOPSConfig, step_advantages
from posttrain.core.aggregation import MODES
from posttrain.core.batch import Batch, collate, concat
from posttrain.core.errors import ConfigError, DataError
from posttrain.data.steps import step_tensors, token_ends
from posttrain.judge import Judge
from posttrain.models.embedded import build_tokenizer
from posttrain.rewards import process_model
from posttrain.rewards.steps import line_ends, step_scores, worked_steps
from posttrain.schema import DataConfig, RewardsConfig

GRPOPS = get("grpo_ps")


def steps_batch(step_reward, step_end, mask, group, **fields):
    B, R = mask.shape
    return Batch(input_ids=torch.zeros(B, R + 2, dtype=torch.long), attention_mask=torch.ones(B, R + 2), mask=mask,
                 prompt_len=2, group=group, truncated=torch.zeros(B, dtype=torch.bool),
                 extra={"step_reward": step_reward, "step_end": step_end}, **fields)


def test_step_advantages_hand_worked():
    """Groups interleaved, rows 0, 2 in group 0 and rows 1, 3 in group 1; R = 5 tokens.

    Group 0: row 0 has steps ending at tokens 1 and 3 with rewards 1 and 0 (its 5th token is padding), row 2 one step
    ending at token 2 with reward 1. R = {1, 0, 1}: mean 2/3, unbiased std √((1/9 + 4/9 + 1/9)/2) = √(1/3) = 0.57735,
    r̃ = (1/3)/0.57735 = 0.57735 and (−2/3)/0.57735 = −1.15470. Â sums the r̃ of the steps ending at or after t:
        row 0: t ≤ 1: 0.57735 − 1.15470 = −0.57735; t = 2, 3: −1.15470; t = 4: 0 (masked);
        row 2: t ≤ 2: 0.57735; t = 3, 4: 0 (after its last step).
    Group 1: every step reward is 1, std 0: Â = 0 everywhere (not NaN).
    """
    end = torch.tensor([[0, 1, 0, 1, 0], [1, 0, 1, 0, 0], [0, 0, 1, 0, 0], [0, 1, 0, 0, 0]]).float()
    reward = torch.tensor([[0, 1, 0, 0, 0], [1, 0, 1, 0, 0], [0, 0, 1, 0, 0], [0, 1, 0, 0, 0]]).float()
    group = torch.tensor([0, 1, 0, 1])
    adv = step_advantages(reward, end, group, "mean_std", eps=1e-12)
    a, b = 0.57735, 1.15470
    want = torch.tensor([[a - b, a - b, -b, -b, 0], [0] * 5, [a, a, a, 0, 0], [0] * 5])
    mask = torch.ones(4, 5)
    mask[0, 4] = 0
    torch.testing.assert_close(adv * mask, want, atol=1e-5, rtol=0)
    prepared, metrics = GRPOPS.prepare(steps_batch(reward, end, mask, group), GRPOPSConfig(group_size=2, eps=1e-12))
    torch.testing.assert_close(prepared.adv, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(metrics["step_reward"], torch.tensor(5 / 6))  # 6 steps, 5 of them reward 1
    torch.testing.assert_close(metrics["steps_per_sample"], torch.tensor(6 / 4))
    torch.testing.assert_close(metrics["zero_std_frac"], torch.tensor(0.5))  # group 1's two samples


def random_steps_batch(B=6, R=6, G=3, seed=0, spread=0.0):
    """Random log-probs, steps and step rewards; rows of varied length, each ending with a step; `spread` > 0 moves
    π_old away from πθ so that ratios leave [1 − ε, 1 + ε]."""
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, R, generator=g) * 3
    old = logp + spread * torch.randn(B, R, generator=g) if spread else None
    ref = logp + 0.3 * torch.randn(B, R, generator=g)
    lengths = [3, 6, 1, 6, 4, 5]
    mask = torch.tensor([[float(t < n) for t in range(R)] for n in lengths])
    end = (torch.rand(B, R, generator=g) < 0.4).float() * mask
    end[torch.arange(B), torch.tensor(lengths) - 1] = 1.0
    reward = torch.rand(B, R, generator=g).round(decimals=1) * end
    group = torch.arange(B // G).repeat_interleave(G)
    truncated = torch.tensor([False, True, False, False, False, False])
    batch = steps_batch(reward, end, mask, group, old_logp=old, ref_logp=ref)
    batch.truncated = truncated
    return batch, logp


def ps_advantages_by_loops(batch, cfg):
    """§4.1.3 as plain loops: each group's step rewards normalised by their mean and (unbiased) std, then each token's
    advantage the sum of its row's normalised rewards at step ends at or after it."""
    reward, end = batch.extra["step_reward"].tolist(), batch.extra["step_end"].tolist()
    B, R = len(reward), len(reward[0])
    groups = batch.group.tolist()
    adv = [[0.0] * R for _ in range(B)]
    for g in set(groups):
        rows = [i for i in range(B) if groups[i] == g]
        rs = [reward[i][t] for i in rows for t in range(R) if end[i][t]]
        mean = sum(rs) / len(rs)
        std = math.sqrt(sum((r - mean) ** 2 for r in rs) / (len(rs) - 1)) if len(rs) > 1 else 0.0
        for i in rows:
            for t in range(R):
                adv[i][t] = sum((reward[i][s] - mean) / (std + cfg.eps if cfg.adv_norm == "mean_std" else 1.0)
                                for s in range(t, R) if end[i][s])
    return torch.tensor(adv)


def paper_objective(batch, cfg, mode, norm):
    """J (Eq. 3 with the process-supervision Â_{i,t}), the clipped ratio and the k3 KL of Eq. 4, written out."""
    adv = ps_advantages_by_loops(batch, cfg)
    high = cfg.clip_eps_high if cfg.clip_eps_high is not None else cfg.clip_eps
    mask = batch.mask * (~batch.truncated)[:, None] if cfg.mask_truncated else batch.mask

    def J(logp):
        old = batch.old_logp if batch.old_logp is not None else logp.detach()
        ratio = torch.exp(logp - old)
        surrogate = torch.min(ratio * adv, torch.clamp(ratio, 1 - cfg.clip_eps, 1 + high) * adv)
        log_ref_ratio = batch.ref_logp - logp
        kl = torch.exp(log_ref_ratio) - log_ref_ratio - 1
        return written_out_mean(surrogate - cfg.beta * kl, mask, mode, norm)

    return J


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("spread", [0.0, 0.4], ids=["mu1-ratio1", "ratio-off-1"])
@pytest.mark.parametrize("cfg", [GRPOPSConfig(group_size=3, beta=0.04), GRPOPSConfig(group_size=3, beta=0.0),
                                 GRPOPSConfig(group_size=3, beta=0.1, clip_eps=0.1, clip_eps_high=0.3),
                                 GRPOPSConfig(group_size=3, beta=0.02, adv_norm="none"),
                                 GRPOPSConfig(group_size=3, beta=0.02, mask_truncated=True)],
                         ids=["default", "beta0", "clip-higher", "dr-grpo", "mask-truncated"])
def test_gradient_matches_objective(mode, spread, cfg):
    batch, logp = random_steps_batch(spread=spread)
    prepared, _ = GRPOPS.prepare(batch, cfg)
    norm = 4.0
    got = surrogate_grad(GRPOPS, prepared, logp, cfg, mode, norm)
    want = objective_grad(paper_objective(batch, cfg, mode, norm), logp)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    if spread:  # the test only proves the clip if some tokens were clipped
        _, metrics = GRPOPS.coefficient(prepared, logp, cfg)
        assert 0 < metrics["clip_frac"] < 1


def test_needs_step_rewards_not_the_outcome_reward():
    assert GRPOPS.needs(GRPOPSConfig(beta=0.0)) == {"step_reward"}
    assert GRPOPS.needs(GRPOPSConfig(beta=0.1, mu=2)) == {"step_reward", "ref_logp", "old_logp"}


def test_rule_process_reward_hand_worked():
    """Question 2-9+1: the worked steps are 2-9=-7 and -7+1=-6, the answer −6. Lines end past their newline:
    "2-9=-7\\n" is 7 characters, "-7+1=-6\\n" 8 more (15), "#### -6" 7 more (22)."""
    assert worked_steps("2-9+1") == (["2-9=-7", "-7+1=-6"], -6)
    assert worked_steps(" 7 + 0 ") == (["7+0=7"], 7)
    right = "2-9=-7\n-7+1=-6\n#### -6"
    assert step_scores("2-9+1", right) == [(7, 1.0), (15, 1.0), (22, 1.0)]
    # a wrong first step, then the right second step (each is checked on its own) and the right answer
    assert step_scores("2-9+1", "2-9=-6\n-7+1=-6\n#### -6") == [(7, 0.0), (15, 1.0), (22, 1.0)]
    # spaces, tabs and carriage returns are ignored; trailing text is not
    assert [s for _, s in step_scores("2-9+1", "2 - 9 = -7\r\n-7+1=-6 so\n####\t-6")] == [1.0, 0.0, 1.0]
    # a wrong answer; a step past the question's two; a line after the answer line; a blank line
    assert [s for _, s in step_scores("2-9+1", "2-9=-7\n-7+1=-6\n#### -5")] == [1.0, 1.0, 0.0]
    assert [s for _, s in step_scores("2-9+1", "2-9=-7\n-7+1=-6\n-6+0=-6\n#### -6")] == [1.0, 1.0, 0.0, 1.0]
    assert [s for _, s in step_scores("2-9+1", "#### -6\n2-9=-7\n#### -6")] == [1.0, 0.0, 0.0]
    assert [s for _, s in step_scores("2-9+1", "\n2-9=-7")] == [0.0, 0.0]
    # another spelling of the number is wrong; a text with no line is one step, ending at 0
    assert step_scores("5+2", "5+2=07\n#### +7") == [(7, 0.0), (14, 0.0)]
    assert step_scores("5+2", "") == [(0, 0.0)]
    assert step_scores("5+2", "5+2=7\n") == [(6, 1.0)]  # a final newline adds no empty step
    assert line_ends("a\nb") == [2, 3] and line_ends("\n") == [1]
    with pytest.raises(DataError, match="rewards.process=steps: the question 'Natalia sold' is not a sum"):
        step_scores("Natalia sold", "1")


def test_judge_scores_steps_by_the_configured_source():
    rows = [{"question": "2-9+1", "answer": "#### -6"}] * 2
    completions = ["2-9=-7\n#### -6", "oops"]
    judge = Judge(DataConfig(), RewardsConfig(process="steps"))
    assert judge.score_steps(rows, completions) == [[(7, 1.0), (14, 1.0)], [(4, 0.0)]]
    seen = []
    prm = lambda prompts, texts: seen.append((prompts, texts)) or [[(len(t), 0.5)] for t in texts]  # noqa: E731
    judge = Judge(DataConfig(), RewardsConfig(process="model"), process_model=prm)
    assert judge.score_steps(rows, completions) == [[(14, 0.5)], [(4, 0.5)]]
    assert seen == [(["Q: 2-9+1\nA: "] * 2, completions)]  # the prompt as the policy saw it, then the completion
    with pytest.raises(ValueError, match="no process reward"):
        Judge(DataConfig(), RewardsConfig()).score_steps(rows, completions)


@pytest.fixture(scope="module")
def chars():
    return build_tokenizer()


@pytest.fixture(scope="module")
def bpe():
    from families import bpe_tokenizer

    return bpe_tokenizer()


def test_step_ends_on_character_tokens(chars):
    """One token per character: a line's step ends at its newline's token; the last step at the last response
    token, the EOS after the text, which the text does not show."""
    text = "2-9=-7\n#### -6"
    ids = chars(text, add_special_tokens=False)["input_ids"] + [chars.eos_token_id]
    assert chars.decode(ids, skip_special_tokens=True) == text
    assert token_ends(chars, ids, text, [7, 14]) == [6, 14]  # 14: the EOS


def test_step_ends_on_byte_level_bpe_tokens(bpe):
    """Multi-character tokens: each step ends at the first token whose decoded prefix holds the step's text. "é" is
    two byte tokens: the first decodes to "caf\\ufffd", four characters, so counting decoded characters would end the
    step "café" a token early; the prefix test ends it at the token that completes "é"."""
    text = "Natalia sold 48/2 = 24 clips\n#### 72"
    ids = bpe(text)["input_ids"]
    ends = token_ends(bpe, ids, text, [29, len(text)])
    assert bpe.decode(ids[: ends[0] + 1]) == text[:29] and ends[1] == len(ids) - 1
    assert len(ids[: ends[0] + 1]) < 29  # the tokens are not characters

    text = "café!!"
    ids = bpe(text)["input_ids"]
    (end, _) = token_ends(bpe, ids, text, [4, 6])
    assert bpe.decode(ids[:end]) == "caf\ufffd" and bpe.decode(ids[: end + 1]) == "café"  # split é, completed at end


def test_step_tensors_of_a_sampled_batch(chars):
    """Two samples, right-padded: each step's reward at its end token, 1.0 in step_end there. Row 1 has two steps
    ending on one token (both at character 2): one step there, with the lower reward."""
    texts = ["2-9=-7\n#### -6", "ab\ncd"]
    responses = [chars(t, add_special_tokens=False)["input_ids"] + [chars.eos_token_id] for t in texts]
    batch = collate([[5], [6, 7]], responses, chars.pad_token_id)
    steps = [[(7, 1.0), (14, 0.0)], [(2, 1.0), (2, 0.0), (5, 1.0)]]
    reward, end = step_tensors(chars, batch, texts, steps)
    assert end.shape == (2, 15) and end[0].nonzero().flatten().tolist() == [6, 14]
    assert reward[0, 6] == 1.0 and reward[0, 14] == 0.0 and end[1].nonzero().flatten().tolist() == [1, 5]
    assert reward[1, 1] == 0.0 and reward[1, 5] == 1.0 and reward.sum() == 2.0


def test_step_tensors_ride_through_select_concat_and_trim(chars):
    """The [B, R] extras keep their rows through select, are right-padded by concat like the mask, and lose the
    columns trimmed() cuts."""
    a = collate([[5]], [[1, 2, 3, 4]], 0)
    b = collate([[6, 7]], [[1, 2]], 0)
    a.extra = {"step_end": torch.tensor([[0.0, 1.0, 0.0, 1.0]])}
    b.extra = {"step_end": torch.tensor([[0.0, 1.0]])}
    c = concat([a, b], 0)
    assert c.extra["step_end"].tolist() == [[0, 1, 0, 1], [0, 1, 0, 0]]
    short = c.select(torch.tensor([1])).trimmed()
    assert short.extra["step_end"].tolist() == [[0, 1]] and short.mask.shape == (1, 2)


def test_online_source_puts_step_rewards_on_the_sampled_tokens(chars):
    """The online source with step rewards asked for: the judge's rule scores each line, and the [B, R] tensors
    mark the sampled tokens that end them (character tokens here: the newlines and the EOS)."""
    from pathlib import Path

    from posttrain.core.schedules import SamplingTemperature
    from posttrain.schema import RolloutConfig
    from posttrain.sources import Deps
    from posttrain.sources.online import Online

    class Rollout:
        version = 0

        def generate(self, prompts, n, **_):
            responses = [chars(t, add_special_tokens=False)["input_ids"] + [chars.eos_token_id]
                         for t in ("2-9=-7\n-7+1=-6\n#### -6", "2-9=-7\n#### 1")]
            batch = collate(prompts * n, responses, chars.pad_token_id)
            batch.group, batch.truncated = torch.zeros(n, dtype=torch.long), torch.zeros(n, dtype=torch.bool)
            return batch

    rows = SimpleNamespace(next=lambda k: [{"question": "2-9+1", "answer": "2-9=-7\n-7+1=-6\n#### -6"}] * k)
    judge = Judge(DataConfig(), RewardsConfig(process="steps"))

    def source(needs):
        return Online(Deps(sampler=rows, tokenizer=chars, data=DataConfig(), batch_size=1, micro_batch_size=2, seed=0,
                           algorithm=None, samples_per_prompt=2, rollout=Rollout(), sampling=RolloutConfig(),
                           judge=judge, score_reference=None, model_path=Path("."), cache_dir=Path("."), needs=needs,
                           temperature=SamplingTemperature(1.0),
                           stages=("rewards.process",) if "step_reward" in needs else ()))

    batch, _ = source(frozenset({"step_reward"})).next()
    assert batch.reward.tolist() == [1.0, 0.0]
    assert batch.extra["step_end"][0].nonzero().flatten().tolist() == [6, 14, 22]  # 22: the EOS
    assert batch.extra["step_reward"][0].tolist()[:23] == [0] * 6 + [1] + [0] * 7 + [1] + [0] * 7 + [1]
    assert batch.extra["step_end"][1].nonzero().flatten().tolist() == [6, 13]
    assert batch.extra["step_reward"][1, 6] == 1.0 and batch.extra["step_reward"][1, 13] == 0.0
    assert source(frozenset()).next()[0].extra == {}  # not asked for: not scored


def save_prm(path, tokenizer, labels, seed=0):
    """A tiny random LlamaForTokenClassification with `labels` outputs per token and `tokenizer`, saved to `path`."""
    from transformers import LlamaConfig, LlamaForTokenClassification

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, num_labels=labels,
                      pad_token_id=tokenizer.pad_token_id)
    model = LlamaForTokenClassification(cfg)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model.eval()


@pytest.mark.parametrize("labels", [1, 2])
def test_process_model_scores_each_line_at_its_end_token(tmp_path, chars, bpe, labels):
    """The PRM's score of a step is its head read at the token holding the step's last character of prompt +
    completion: sigmoid(logit) with one label, softmax's label 1 with two, equal to the model's own logits there.
    Character tokenizer (one label): token index = character index. Byte-level BPE (two labels): the offset mapping
    finds the token, checked here by decoding it."""
    tokenizer = chars if labels == 1 else bpe
    model = save_prm(tmp_path / "prm", tokenizer, labels)
    prm = process_model.ProcessRewardModel(tmp_path / "prm")
    prompts, completions = ["Q: 2-9+1\nA: ", "Q: 1+1\nA: "], ["2-9=-7\n-7+1=-6\n#### -6", "1+1=2\n"]
    got = prm(prompts, completions)
    assert [[e for e, _ in steps] for steps in got] == [[7, 15, 22], [6]]
    for p, c, steps in zip(prompts, completions, got):
        enc = tokenizer(p + c, return_tensors="pt", return_offsets_mapping=True)
        offsets = enc.pop("offset_mapping")[0]
        with torch.no_grad():
            logits = model(**enc).logits[0]  # [T, labels]
        probs = torch.sigmoid(logits[:, 0]) if labels == 1 else torch.softmax(logits, -1)[:, 1]  # [T]
        assert probs.std() > 1e-4  # the position matters: the scores differ from token to token
        for e, score in steps:
            char = len(p) + e - 1  # the step's last character: its newline, or the text's last
            t = int(((offsets[:, 0] <= char) & (offsets[:, 1] > char)).nonzero()[0])
            assert (p + c)[char] in tokenizer.decode(enc["input_ids"][0, t])
            assert score == pytest.approx(float(probs[t]), abs=1e-6)
            if labels == 1:
                assert t == char  # a character tokenizer with no BOS


def test_process_model_refuses_other_heads_and_slow_tokenizers(tmp_path, chars, monkeypatch):
    save_prm(tmp_path / "three", chars, 3)
    with pytest.raises(ConfigError, match="reward_model.process_path: .* has 3 labels"):
        process_model.ProcessRewardModel(tmp_path / "three")
    model = save_prm(tmp_path / "one", chars, 1)
    monkeypatch.setattr(process_model, "load", lambda *a, **k: (model, SimpleNamespace(is_fast=False)))
    with pytest.raises(ConfigError, match="reward_model.process_path: .* slow .* needs a fast one"):
        process_model.ProcessRewardModel(tmp_path / "one")


@pytest.mark.parametrize("overrides, message", [
    (["rewards.process=none"], "rewards.process: grpo_ps trains on step rewards; set rewards.process=steps"),
    (["rewards.process=model"], "reward_model.process_path: rewards.process=model needs a process reward model"),
    (["rewards.process=prm"], "rewards.process: unknown 'prm'; known: none, steps, model"),
])
def test_config_errors(overrides, message):
    with pytest.raises(ConfigError) as err:
        config.load("grpo_ps_math", overrides)
    assert message in str(err.value)


def test_config_resolves_the_process_keys():
    cfg, resolved = config.load("grpo_ps_math", ["rewards.process=model", "reward_model.process_path=/prm"])
    assert resolved["rewards"]["process"] == "model" and resolved["reward_model"]["process_path"] == "/prm"
    assert resolved["algorithm"]["name"] == "grpo_ps"
    with pytest.raises(ConfigError, match="rewards.process: step rewards are trained on by grpo_ps, and grpo trains "
                       "on none"):  # a key GRPO would ignore is refused (tests/test_bad_input_config.py)
        config.load("grpo_math", ["rewards.process=steps"])


def run_metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_grpo_ps_run_trains_on_rule_step_rewards(warm_model_dir, tmp_path):
    """`posttrain run recipe=grpo_ps_math` on a warmed-up tiny model: every step logs its step rewards; some are
    right (step_reward > 0) and some groups' steps differ (zero_std_frac < 1), so Â is not 0: the update trained on
    them."""
    out = tmp_path / "ps"
    proc = posttrain("run", "recipe=grpo_ps_math", f"model.path={warm_model_dir}", f"output_dir={out}",
                     "train.steps=2", "train.batch_size=4", "algorithm.group_size=4", "rollout.max_new_tokens=16",
                     "eval.num_problems=4", *EASY, "-q")
    assert proc.returncode == 0, proc.stderr[-2000:]
    metrics = run_metrics(out)
    assert len(metrics) == 2 and all(m["steps_per_sample"] >= 1 for m in metrics)
    assert any(m["step_reward"] > 0 for m in metrics) and any(m["zero_std_frac"] < 1 for m in metrics)
    assert all(m["loss"] == m["loss"] for m in metrics) and any(m["grad_norm"] > 0 for m in metrics)


def test_grpo_ps_run_with_a_process_reward_model(tiny_model_dir, tmp_path, chars):
    """rewards.process=model: the engine loads the PRM (it is asked for step rewards) and trains on its scores, each
    a sigmoid in (0, 1)."""
    save_prm(tmp_path / "prm", chars, 1)
    out = tmp_path / "ps"
    proc = posttrain("run", "recipe=grpo_ps_math", f"model.path={tiny_model_dir}", f"output_dir={out}",
                     "rewards.process=model", f"reward_model.process_path={tmp_path / 'prm'}", "train.steps=1",
                     "train.batch_size=2", "algorithm.group_size=2", "rollout.max_new_tokens=8",
                     "eval.num_problems=0", *EASY, "-q")
    assert proc.returncode == 0, proc.stderr[-2000:]
    (m,) = run_metrics(out)
    assert 0 < m["step_reward"] < 1 and m["zero_std_frac"] < 1 and m["grad_norm"] > 0
