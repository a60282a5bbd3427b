"""The plan of a run (posttrain/train/plan.py), decided once: `posttrain explain` prints the plan the run records in
summary.json, for every recipe and the combinations that move its decisions; the step does what the plan says; and
nothing outside the engine sets an attribute of it once built."""

import dataclasses
import inspect
import json
import os
import signal
import sys
from pathlib import Path

import pytest
from cli_helpers import posttrain, posttrain_here
from conftest import EASY

from posttrain import config
from posttrain.train import run
from posttrain.train.engine import Engine
from posttrain.train.plan import Machine, plan

TINY = ["train.steps=1", "train.batch_size=4", "train.micro_batch_size=3", "rollout.max_new_tokens=8",
        "eval.num_problems=0", "train.precision=fp32", "train.threads=1", *EASY]
GROUP = ["algorithm.group_size=2"]
SEPARATE = ["rollout.placement=separate", "rollout.workers=1"]
ONCE = ["algorithm.num_prompts=4", "algorithm.samples_per_prompt=2"]  # RFT's and DPO's samples drawn at the start
GROUPED = ("grpo_math", "grpo_ps_math", "gspo_math", "drgrpo_math", "dapo_math", "rloo_math", "reinforce_pp_math",
           "cispo_math", "sapo_math", "online_dpo_math")
TEACHER = "model.teacher_path={model}"  # the run's own starting model as the distillation teacher (its tokens)
GSM8K = Path(__file__).parent / "fixtures" / "gsm8k"
RECIPE_OVERRIDES = {**{r: GROUP for r in GROUPED}, "rft_math": ONCE, "dpo_math": ONCE,
                    "ppo_math": ["algorithm.samples_per_prompt=2"], "online_rft_math": ["algorithm.samples_per_prompt=2"],
                    "grpo_tools": [*GROUP, "env.max_turns=2"],
                    "distill_math": ["algorithm.samples_per_prompt=2", TEACHER],
                    "sft_gsm8k": [f"data.path={GSM8K / 'train_head.jsonl'}", f"data.test_path={GSM8K / 'test_head.jsonl'}",
                                  "data.max_prompt_len=128", "data.max_response_len=64"]}
COMBINATIONS = {
    "ppo_minibatches": ("ppo_math", ["algorithm.samples_per_prompt=2", "algorithm.ppo_epochs=2",
                                     "algorithm.num_minibatches=2"]),
    "grpo_separate_k1": ("grpo_math", [*GROUP, *SEPARATE, "rollout.max_staleness=1"]),
    "grpo_separate_k1_trainer": ("grpo_math", [*GROUP, *SEPARATE, "rollout.max_staleness=1",
                                               "rollout.proximal=trainer"]),
    "grpo_reference_on_workers": ("grpo_math", [*GROUP, *SEPARATE, "rollout.reference_on=workers"]),
    "grpo_packed_budget": ("grpo_math", [*GROUP, "train.packing=true", "train.micro_batch_tokens=96"]),
    "grpo_stages": ("grpo_math", [*GROUP, "rollout.dynamic_sampling=true", "rollout.elite_pool=4",
                                  "rewards.overlong_buffer=4", "rollout.adaptive_temperature=true"]),
    "grpo_lora": ("grpo_math", [*GROUP, "model.lora.r=4"]),
    "grpo_calculator": ("grpo_math", [*GROUP, "env.name=calculator", "env.max_turns=2"]),
}


CASES = {**{r: (r, RECIPE_OVERRIDES.get(r, [])) for r in config.known_recipes()}, **COMBINATIONS}


@pytest.mark.parametrize("case", sorted(CASES))
def test_explain_prints_the_plan_the_run_records(case, tiny_model_dir, tmp_path):
    recipe, overrides = CASES[case]
    overrides = [f"model.path={tiny_model_dir}", f"output_dir={tmp_path / 'run'}", *TINY,
                 *(o.format(model=tiny_model_dir) for o in overrides)]
    explained = posttrain_here("explain", f"recipe={recipe}", *overrides, "--json")
    assert explained.returncode == 0, explained.stderr
    printed = json.loads(explained.stdout)["plan"]
    cfg, resolved = config.load(recipe, overrides)
    summary = run(cfg, resolved, quiet=True)
    assert summary["plan"] == printed
    # and the step did what the plan says
    (metrics,) = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    shape = printed["shape"]
    assert metrics["updates"] == shape["updates_per_step"]
    if printed["passes"]["update"]["tokens"] is None:  # by rows: the plan's micro-batches exactly
        assert metrics["micro_batches"] == shape["epochs"] * sum(map(len, shape["micro_batches"]))
    else:  # under a token budget the plan counts every row at its bounds: the most a step can take
        assert metrics["micro_batches"] <= shape["epochs"] * sum(map(len, shape["micro_batches"]))
    assert metrics.get("generated_tokens", 0) <= shape["sampled_tokens"][1]
    # the models the run really held are the plan's roles, where the plan put them
    roles, held = {r["role"]: r for r in printed["roles"]}, summary["memory"]["roles_bytes"]
    ref = roles.get("reference")
    assert ("reference_weights" in held) == (ref is not None and ref["where"] == "trainer")
    assert ("critic_weights" in held) == ("critic" in roles)
    assert ("teacher_weights" in held) == ("teacher" in roles)
    if ref is not None and ref["where"] == "workers":
        assert summary["rollout_workers"]["workers"] == printed["rollout"]["workers"] == 1


def test_the_plan_is_pure_and_frozen():
    """Made from the config and the machine's figures alone: the same inputs, the same plan; and read-only."""
    cfg, _ = config.load("ppo_math", ["rollout.placement=separate", "rollout.max_staleness=1"])
    machine = Machine(world_size=2, precision="bf16-mixed", cores=8, cpus=tuple(range(8)))
    first = plan(cfg, machine)
    assert plan(cfg, machine) == first and first.world_size == 2 and first.precision == "bf16-mixed"
    assert first.rollout.worker_cpus == ((4, 5, 6, 7),) and first.threads == 4  # the workers' cores, the trainer's
    assert (first.rollout.proximal, first.rollout.tis_cap) == ("sampler", None)  # resolved here, not in the config
    assert cfg.rollout.proximal is None and cfg.rollout.tis_cap is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.steps = 3


def test_the_engine_is_finished_when_built(tiny_model_dir, tmp_path, monkeypatch):
    """Every attribute of the engine is set by its own methods (its construction, its step, its resume), never by
    the builder or the loop: through runs resumed from a killed run's checkpoint, one with rollout workers ahead and
    the reference on them, one whose source scores the reference once (DPO)."""
    own = {f.__code__ for f in vars(Engine).values() if inspect.isfunction(f)}
    outsiders = []
    original = object.__setattr__

    def watched(engine, name, value):
        caller = sys._getframe(1).f_code
        if caller not in own:
            outsiders.append(f"{name} set in {caller.co_name} ({caller.co_filename}:{caller.co_firstlineno})")
        original(engine, name, value)

    out = tmp_path / "run"
    runs = {"grpo_math": [*GROUP, *SEPARATE, "rollout.max_staleness=1", "rollout.reference_on=workers"],
            "dpo_math": ONCE}
    for recipe, overrides in runs.items():  # first killed after step 3 is logged, its checkpoint (step 2) kept
        args = [f"model.path={tiny_model_dir}", f"output_dir={out / recipe}", *TINY, *overrides, "train.steps=4",
                "train.save_every=2"]
        os.environ["POSTTRAIN_CRASH_AT"] = "step:3"  # (each test's changes to the environment end with it)
        assert posttrain("run", f"recipe={recipe}", *args).returncode == -signal.SIGKILL
        del os.environ["POSTTRAIN_CRASH_AT"]
        runs[recipe] = args
    monkeypatch.setattr(Engine, "__setattr__", watched, raising=False)
    for recipe, args in runs.items():  # built, resumed from step 2, stepped, evaluated, saved
        cfg, resolved = config.load(recipe, args)
        summary = run(cfg, resolved, quiet=True)
        assert summary["resumed_from"]["step"] == 2 and summary["steps"] == 4
    assert outsiders == []
