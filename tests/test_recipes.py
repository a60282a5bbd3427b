"""A short real CLI run of every shipped recipe, and the bad input specific to RFT, DPO and PPO."""

import json

import pytest
from cli_helpers import assert_one_line_error, posttrain, posttrain_here
from conftest import EASY, FIXTURES

from posttrain import config

TINY = ["train.steps=2", "train.batch_size=4", "train.micro_batch_size=5", "eval.num_problems=4",
        "rollout.max_new_tokens=8", *EASY]
PER_RECIPE = {"rft_math": ["algorithm.num_prompts=16"], "dpo_math": ["algorithm.num_prompts=16"],
              "grpo_math": ["algorithm.group_size=2"], "grpo_ps_math": ["algorithm.group_size=2"],
              "gspo_math": ["algorithm.group_size=2"], "drgrpo_math": ["algorithm.group_size=2"],
              "dapo_math": ["algorithm.group_size=2"], "rloo_math": ["algorithm.group_size=2"],
              "reinforce_pp_math": ["algorithm.group_size=2"], "grpo_tools": ["algorithm.group_size=2"],
              "ppo_math": ["algorithm.samples_per_prompt=2"], "cispo_math": ["algorithm.group_size=2"],
              "sapo_math": ["algorithm.group_size=2"], "online_dpo_math": ["algorithm.group_size=2"],
              "distill_math": ["algorithm.samples_per_prompt=2"],
              "sft_gsm8k": [f"data.path={FIXTURES / 'gsm8k' / 'train_head.jsonl'}", "eval.k=2",
                            f"data.test_path={FIXTURES / 'gsm8k' / 'test_head.jsonl'}", "train.precision=fp32"]}


@pytest.mark.parametrize("recipe", sorted(config.known_recipes()))
def test_recipe_runs(recipe, warm_model_dir, tmp_path):
    out = tmp_path / recipe
    teacher = [f"model.teacher_path={warm_model_dir}"] if recipe == "distill_math" else []  # the student's own tokens
    proc = posttrain("run", f"recipe={recipe}", f"model.path={warm_model_dir}", f"output_dir={out}", *TINY,
                     *PER_RECIPE.get(recipe, []), *teacher)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and "accuracy" in summary["eval_after"]
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2 and all(m["loss"] == m["loss"] for m in metrics)  # no NaN


def test_rft_samples_are_cached(warm_model_dir, tmp_path):
    args = ["recipe=rft_math", f"model.path={warm_model_dir}", *TINY, "algorithm.num_prompts=8",
            f"warmup.cache_dir={tmp_path / 'cache'}"]
    assert posttrain("run", *args, f"output_dir={tmp_path / 'a'}").returncode == 0
    cached = list((tmp_path / "cache").glob("samples-*.jsonl"))
    assert len(cached) == 1
    stamp = cached[0].stat().st_mtime_ns
    assert posttrain("run", *args, f"output_dir={tmp_path / 'b'}").returncode == 0
    assert cached[0].stat().st_mtime_ns == stamp  # reused, not drawn again


def test_dpo_from_preference_file(warm_model_dir, tmp_path):
    pairs = tmp_path / "prefs.jsonl"
    pairs.write_text("\n".join(json.dumps({"prompt": f"{i}+1", "chosen": f"{i}+1={i + 1}\n#### {i + 1}",
                                           "rejected": f"{i}+1={i}\n#### {i}"}) for i in range(8)))
    proc = posttrain("run", "recipe=dpo_math", f"model.path={warm_model_dir}", f"algorithm.pairs_path={pairs}",
                     f"output_dir={tmp_path / 'o'}", *TINY)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((tmp_path / "o" / "metrics.jsonl").read_text().splitlines()[0])["dpo_pairs"] == 8


def test_bad_preference_file(warm_model_dir, tmp_path):
    pairs = tmp_path / "prefs.jsonl"
    pairs.write_text(json.dumps({"prompt": "1+1", "chosen": "2"}) + "\n")
    assert_one_line_error(posttrain_here("run", "recipe=dpo_math", f"model.path={warm_model_dir}",
                                    f"algorithm.pairs_path={pairs}", f"output_dir={tmp_path / 'o'}", *TINY),
                          f"algorithm.pairs_path: '{pairs}' row 1 has no field 'rejected'")


def test_dpo_without_a_reference(warm_model_dir, tmp_path):
    assert_one_line_error(posttrain_here("run", "recipe=dpo_math", f"model.path={warm_model_dir}",
                                    f"model.ref_path={tmp_path / 'nowhere'}", f"output_dir={tmp_path / 'o'}", *TINY),
                          "model.ref_path", "not a Hugging Face model directory")


def test_ppo_critic_with_another_tokenizer(warm_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    other = tmp_path / "other"
    tok = AutoTokenizer.from_pretrained(warm_model_dir)
    tok.add_tokens(["<extra>"])
    model = AutoModelForCausalLM.from_pretrained(warm_model_dir)
    model.resize_token_embeddings(len(tok))
    model.save_pretrained(other)
    tok.save_pretrained(other)
    assert_one_line_error(posttrain_here("run", "recipe=ppo_math", f"model.path={warm_model_dir}",
                                    f"algorithm.critic_path={other}", f"output_dir={tmp_path / 'o'}", *TINY),
                          "algorithm.critic_path", "different tokenizer")


def test_ppo_with_a_reward_model(warm_model_dir, tmp_path):
    """A local sequence-classification directory scores completions beside the rule reward."""
    from transformers import AutoConfig, AutoTokenizer, LlamaForSequenceClassification

    rm_dir = tmp_path / "rm"
    cfg = AutoConfig.from_pretrained(warm_model_dir, num_labels=1)
    LlamaForSequenceClassification(cfg).save_pretrained(rm_dir)
    AutoTokenizer.from_pretrained(warm_model_dir).save_pretrained(rm_dir)
    out = tmp_path / "o"
    proc = posttrain("run", "recipe=ppo_math", f"model.path={warm_model_dir}", f"reward_model.path={rm_dir}",
                     "reward_model.weight=0.5", f"output_dir={out}", *TINY, *PER_RECIPE["ppo_math"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    metrics = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert "reward/model" in metrics and "reward/accuracy" in metrics
    summary = json.loads((out / "summary.json").read_text())
    assert summary["memory"]["roles_bytes"]["reward_model_weights"] > 0
    assert_one_line_error(posttrain_here("run", "recipe=ppo_math", f"model.path={warm_model_dir}",
                                    f"reward_model.path={tmp_path / 'none'}", f"output_dir={tmp_path / 'x'}", *TINY),
                          "reward_model.path")
