"""`posttrain explain`: the plan of a recipe's step prints without running anything, in words; that it is the plan
the run records, and what the step does, is tests/test_plan.py's, for every recipe."""

import json
import os

import pytest
from cli_helpers import assert_one_line_error, posttrain_here
from conftest import EASY

from posttrain import config
from posttrain.apps import cli, explain
from posttrain.apps.estimate import model_spec
from posttrain.train import run


def plan_of(recipe: str, *overrides: str, world: int = 1) -> explain.Plan:
    cfg, _ = config.load(recipe, list(overrides))
    return explain.explain(cfg, recipe, world)


@pytest.mark.parametrize(("recipe", "lines"), [
    ("recipe=grpo_math", ["sequences sampled (8 per prompt)", "256", "1 optimizer step per batch",
                   "reference        frozen", "on-policy"]),
    ("recipe=ppo_math", ["2 epochs (μ) × 2 minibatches of 64 rows each = 4 optimizer steps per batch",
                  "240 optimizer steps in the run", "critic           trained", "3 optimizer steps behind",
                  "old log-probs"]),
    ("recipe=dpo_math", ["pairs (train.batch_size)", "sequences trained on", "64", "then freed", "fixed data"]),
    ("recipe=sft_math", ["rows (train.batch_size)", "data.max_response_len", "fixed data"]),
    ("recipe=ppo_math rollout.placement=separate rollout.max_staleness=2",  # 2 steps of 4 optimizer steps ahead
     ["rollout workers  frozen", "up to 8 optimizer steps behind", "the last is 11 optimizer steps behind",
      "the clipped ratio is taken against the log-probs the sampler reported",
      "the clipped ratio's π_old is the sampler's log-probs"]),
    ("recipe=ppo_math rollout.placement=separate rollout.max_staleness=1 rollout.proximal=trainer",
     ["up to 4 optimizer steps behind", "rollout.tis_cap=2, token_truncate", "old_logp) are scored before the first"]),
    ("recipe=grpo_math rollout.placement=separate rollout.max_staleness=1 rollout.reference_on=workers",
     ["a copy of the starting policy, held by each rollout worker (rollout.reference_on=workers), not by the trainer",
      "the workers score each batch they sample"]),
])
def test_explain_prints_the_plan(recipe, lines, capsys):
    os.environ.pop("WORLD_SIZE", None)  # (each test's changes to the environment end with it: conftest)
    assert cli.main(["explain", *recipe.split()]) == 0
    out = capsys.readouterr().out
    text = " ".join(out.split())  # the prose is wrapped
    for line in lines + ["Nothing was run", "Models:", "How far off-policy:", "Memory per GPU", "total"]:
        assert " ".join(line.split()) in text, (line, out)
    assert max(map(len, out.splitlines())) <= explain.WIDTH


def test_json_counts_every_process(capsys):
    os.environ["WORLD_SIZE"] = "4"
    assert cli.main(["explain", "recipe=grpo_math", "--json", "train.batch_size=3"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["world_size"] == 4 and plan["rows"] == 3 * 8 and plan["all_processes"]["rows"] == 4 * 3 * 8
    assert plan["all_processes"]["batch_size"] == 12 and plan["memory"]["gpu_bytes"] > 0
    assert [m["role"] for m in plan["models"]] == ["policy", "reference"]


def test_bad_input_is_one_line():
    assert_one_line_error(posttrain_here("explain", "recipe=grpo_math", "train.batch_sise=3"), "train.batch_sise")


def test_bad_world_size(capsys):
    os.environ["WORLD_SIZE"] = "two"
    assert cli.main(["explain", "recipe=sft_math"]) == 2
    assert "WORLD_SIZE=two" in capsys.readouterr().err


def test_models_follow_what_the_plugin_needs():
    """LoRA without model.ref_path: the reference is the policy with its adapter off; β = 0: no reference; a reward
    model for a method that trains on rewards (the config refuses one for the others)."""
    def roles(plan):
        return {m.role: m.origin for m in plan.models}

    assert "adapter off" in roles(plan_of("grpo_math", "model.lora.r=8"))["reference"]
    assert "reference" not in roles(plan_of("grpo_math", "algorithm.beta=0"))
    assert roles(plan_of("ppo_math", "reward_model.path=/rm"))["reward model"] == "/rm"


def test_minibatches_that_do_not_divide():
    """6 rows in 4 minibatches: the engine cuts chunks of ⌈6 / 4⌉ = 2 rows, so 3 optimizer steps per epoch, not 4;
    the learning-rate schedule still counts 4, and the plan says so."""
    plan = plan_of("ppo_math", "train.batch_size=3", "algorithm.samples_per_prompt=2", "algorithm.num_minibatches=4",
                   "train.steps=10")
    assert plan.minibatch_rows == [2, 2, 2] and plan.updates_per_step == 2 * 3 and plan.updates == 60
    assert plan.scheduled_updates == 80 and any("80" in n and "60" in n for n in plan.notes)


def test_dynamic_sampling_bounds_what_is_sampled():
    plan = plan_of("dapo_math", "train.batch_size=4", "algorithm.group_size=2", "rollout.max_sampling_rounds=3",
                   "rollout.max_new_tokens=10")
    assert plan.rows == 8 and plan.sampled_rows == (8, 24) and plan.sampled_tokens == (80, 240)
    assert [s.key for s in plan.stages][-2:] == ["rewards.overlong_buffer", "rollout.dynamic_sampling"]


def test_embedded_spec_is_the_model_the_warm_up_builds(tmp_path):
    from posttrain.models.embedded import build_model_dir

    cfg, _ = config.load("grpo_math", ["warmup.hidden=32", "warmup.layers=2"])
    built = model_spec(str(build_model_dir(tmp_path / "m", hidden=32, layers=2)))
    assert explain.embedded_spec(cfg) == built.__class__(**{**vars(built), "name": "embedded tiny model"})


# -- against a real step --------------------------------------------------------------------------------------------

TINY = ["train.steps=1", "train.batch_size=4", "train.micro_batch_size=3", "rollout.max_new_tokens=8",
        "eval.num_problems=0", "train.precision=fp32", *EASY]


def test_dpo_pairs_from_a_file_are_whole_units(tiny_model_dir, tmp_path):
    """A pair is two rows and stays in one micro-batch: train.micro_batch_size=3 runs as micro-batches of 2. The
    reference scores every pair once, before step 1, so a step scores nothing before its update. (Every recipe's
    plan against its run: tests/test_plan.py.)"""
    pairs = tmp_path / "prefs.jsonl"
    pairs.write_text("\n".join(json.dumps({"prompt": f"{i}+1", "chosen": f"{i}+1={i + 1}\n#### {i + 1}",
                                           "rejected": f"{i}+1={i}\n#### {i}"}) for i in range(8)))
    out = tmp_path / "run"
    cfg, resolved = config.load("dpo_math", [f"model.path={tiny_model_dir}", f"output_dir={out}", *TINY,
                                             f"algorithm.pairs_path={pairs}"])
    plan = explain.explain(cfg, "dpo_math", 1)
    assert plan.rows == 8 and plan.micro_batch_size == 2 and plan.micro_batch_rows == [[2, 2, 2, 2]]
    assert plan.scored == [] and "reference" in {m.role for m in plan.models}
    assert plan.run.role("reference").scored_once
    summary = run(cfg, resolved, quiet=True)
    (metrics,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert summary["plan"] == plan.run.to_dict() and metrics["micro_batches"] == 4 and metrics["updates"] == 1
    assert "generated_tokens" not in metrics  # nothing sampled


@pytest.mark.parametrize("args, where", [
    ([], {"trainer": "1 training process", "sampler": "in the training process, between updates"}),
    (["rollout.placement=separate", "rollout.worker_threads=1", "rollout.reference_on=workers"],
     {"rollout worker 0": "a process the first training process starts on its machine (rollout.launcher=local)",
      "reference": "on each rollout worker"}),
    (["rollout.placement=separate", "rollout.launcher=ray", "rollout.workers=2", "rollout.worker_threads=1",
      "ray.strategy=STRICT_SPREAD"],
     {"rollout worker 1": "a Ray actor in bundle 1 of a placement group of 2 bundles of {CPU: 1} "
                          "(ray.strategy=STRICT_SPREAD)", "reference": "in the training processes"}),
])
def test_explain_says_where_each_role_runs(args, where):
    """`posttrain explain` names where the trainer, the sampler or each rollout worker, and the reference run: a
    worker process on this machine, or a Ray actor in its placement group bundle."""
    cfg, _ = config.load("grpo_math", args)
    placement = dict(explain.explain(cfg, "grpo_math").placement)
    for role, words in where.items():
        assert words in placement[role], (role, placement[role])
    assert ("sampler" in placement) == (not args)  # colocated: no worker; separate: no sampler in the trainer
    section = explain.render(explain.explain(cfg, "grpo_math")).split("Where each role runs:")[1]
    assert all(f"\n  {role} " in section for role in where)
