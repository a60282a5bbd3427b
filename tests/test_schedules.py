"""Learning-rate schedules (train.lr_schedule): the factor by hand at chosen steps, and the rate a run logs."""

import json
import math

import pytest
from cli_helpers import assert_one_line_error, posttrain, posttrain_here
from conftest import EASY

from posttrain.core.schedules import lr_factor


def test_constant_after_a_linear_warm_up():
    """Warm-up of 3: (s + 1)/4 at steps 0-2, then 1 whatever the total."""
    got = [lr_factor(s, schedule="constant", warmup=3, total=10) for s in range(6)]
    assert got == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_cosine_to_a_floor():
    """No warm-up, 4 steps, floor 0.1: p = 0, 1/4, 1/2, 3/4, and 0.1 + 0.9·½(1 + cos πp) = 1, 0.86820, 0.55,
    0.23180."""
    got = [lr_factor(s, schedule="cosine", warmup=0, total=4, floor=0.1) for s in range(4)]
    assert got == pytest.approx([1.0, 0.1 + 0.45 * (1 + math.cos(math.pi / 4)), 0.55,
                                 0.1 + 0.45 * (1 + math.cos(3 * math.pi / 4))])
    assert got[1] == pytest.approx(0.86820, abs=1e-5) and got[3] == pytest.approx(0.23180, abs=1e-5)


def test_cosine_restarts_go_back_to_the_peak():
    """Warm-up 2, then 8 steps in 4 cycles of 2 (three warm restarts): each cycle is 1 then ½(1 + cos π/2) = 0.5
    (floor 0); the warm-up steps are 1/3 and 2/3."""
    got = [lr_factor(s, schedule="cosine_restarts", warmup=2, total=10, cycles=4) for s in range(10)]
    assert got == pytest.approx([1 / 3, 2 / 3, 1.0, 0.5, 1.0, 0.5, 1.0, 0.5, 1.0, 0.5])
    one = [lr_factor(s, schedule="cosine_restarts", warmup=0, total=6, cycles=1, floor=0.2) for s in range(6)]
    assert one == [lr_factor(s, schedule="cosine", warmup=0, total=6, floor=0.2) for s in range(6)]


def test_the_run_logs_the_rate_each_step_used(tiny_model_dir, tmp_path):
    """metrics.jsonl's lr at step n is the rate of step n's update: lr · factor(n − 1), here with one warm-up step
    then a cosine from 1e-3 to 1e-4 over the 4 remaining steps."""
    out = tmp_path / "cos"
    proc = posttrain("run", "recipe=grpo_math", f"model.path={tiny_model_dir}", f"output_dir={out}", "train.steps=5",
                     "train.batch_size=2", "algorithm.group_size=2", "rollout.max_new_tokens=4", "eval.num_problems=0",
                     "train.lr=1e-3", "train.warmup_steps=1", "train.lr_schedule=cosine", "train.min_lr=1e-4", *EASY,
                     "-q")
    assert proc.returncode == 0, proc.stderr[-2000:]
    logged = [json.loads(line)["lr"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    want = [1e-3 * lr_factor(s, schedule="cosine", warmup=1, total=5, floor=0.1) for s in range(5)]
    assert logged == pytest.approx(want, rel=1e-6)
    assert logged[0] == pytest.approx(5e-4) and logged[1] == pytest.approx(1e-3)  # warm-up, then the peak


@pytest.mark.parametrize("args, fragment", [(["train.lr_schedule=linear"], "train.lr_schedule: unknown 'linear'"),
                                            (["train.min_lr=1"], "train.min_lr: must be between 0 and lr"),
                                            (["train.lr_cycles=0"], "train.lr_cycles: must be ≥ 1")])
def test_bad_schedule_settings(tmp_path, args, fragment):
    assert_one_line_error(posttrain_here("run", "recipe=grpo_math", *args, f"output_dir={tmp_path / 'x'}"), fragment)


def test_beta_schedules_by_hand():
    """piecewise [0.05, 0.02, 0.01] over 6 steps: two steps each; cosine 0.04 -> 0.01 over 5 steps: 0.04, then
    0.01 + 0.03·½(1 + cos(πk/4)) = 0.035607, 0.025, 0.014393, 0.01."""
    from posttrain.core.schedules import beta_at

    piece = [beta_at(s, schedule="piecewise", values=[0.05, 0.02, 0.01], total=6, beta=0.9) for s in range(1, 7)]
    assert piece == [0.05, 0.05, 0.02, 0.02, 0.01, 0.01]
    cosine = [beta_at(s, schedule="cosine", values=[0.04, 0.01], total=5, beta=0.9) for s in range(1, 6)]
    assert cosine == pytest.approx([0.04, 0.035607, 0.025, 0.014393, 0.01], abs=1e-6)
    assert beta_at(3, schedule="constant", values=[], total=6, beta=0.9) == 0.9


def test_the_run_uses_and_logs_each_steps_beta(tiny_model_dir, tmp_path, monkeypatch):
    """A GRPO run with β piecewise over 4 steps: metrics.jsonl logs β = 0.2, 0.2, 0.05, 0.05, and the plugin's GC
    was computed with that β at each step (its kl term is β(π_ref/πθ − 1), so the β seen by coefficient is checked
    directly)."""
    from posttrain import config
    from posttrain.algorithms.grpo import GRPO
    from posttrain.train import run as train

    seen = []
    coefficient = GRPO.coefficient

    def spy(batch, logp, cfg):
        seen.append(cfg.beta)
        return coefficient(batch, logp, cfg)

    monkeypatch.setattr(GRPO, "coefficient", staticmethod(spy))
    cfg, resolved = config.load("grpo_math", [f"model.path={tiny_model_dir}", f"output_dir={tmp_path / 'b'}",
                                              "train.steps=4", "train.batch_size=2", "algorithm.group_size=2",
                                              "rollout.max_new_tokens=4", "eval.num_problems=0", *EASY,
                                              "train.beta_schedule=piecewise", "train.beta_values=[0.2,0.05]"])
    train(cfg, resolved, quiet=True)
    logged = [json.loads(line)["beta"] for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert logged == [0.2, 0.2, 0.05, 0.05]
    assert sorted(set(seen)) == [0.05, 0.2] and seen[0] == 0.2 and seen[-1] == 0.05
    assert cfg.algorithm.beta == 0.04  # the caller's config is left as it was


@pytest.mark.parametrize("args, fragment", [
    (["train.beta_schedule=cosine", "train.beta_values=[0.1]"], "train.beta_values: cosine takes two"),
    (["train.beta_schedule=piecewise"], "train.beta_values: piecewise takes at least one"),
    (["train.beta_schedule=step"], "train.beta_schedule: unknown 'step'"),
    (["train.beta_schedule=piecewise", "train.beta_values=[0.1]", "algorithm.beta=0"],
     "train.beta_schedule: grpo has nothing to schedule (algorithm.beta is 0"),
    (["train.beta_values=0.1"], "train.beta_values: expected a list")])
def test_bad_beta_schedules(tmp_path, args, fragment):
    assert_one_line_error(posttrain_here("run", "recipe=grpo_math", *args, f"output_dir={tmp_path / 'x'}"), fragment)


def test_dpo_has_no_kl_weight_to_schedule(tmp_path):
    assert_one_line_error(posttrain_here("run", "recipe=dpo_math", "train.beta_schedule=piecewise", "train.beta_values=[1]",
                                    f"output_dir={tmp_path / 'x'}"), "train.beta_schedule: dpo has nothing to schedule")


def test_a_resumed_run_takes_up_the_beta_schedule_where_it_stopped(tiny_model_dir, tmp_path, monkeypatch):
    """Interrupted after step 3 was logged (step 2 saved), then resumed: steps 3 and 4 run with the third and fourth
    step's β, not the first's, as in an uninterrupted run."""
    from posttrain import config
    from posttrain.train import checkpoint
    from posttrain.train import run as train

    def interrupt(name, step):
        if (name, step) == ("step", 3):
            raise KeyboardInterrupt

    out = tmp_path / "b"
    args = [f"model.path={tiny_model_dir}", f"output_dir={out}", "train.steps=4", "train.batch_size=2",
            "algorithm.group_size=2", "rollout.max_new_tokens=4", "eval.num_problems=0", "train.save_every=1", *EASY,
            "train.beta_schedule=piecewise", "train.beta_values=[0.2,0.1,0.05,0.01]"]
    monkeypatch.setattr(checkpoint, "crash_point", interrupt)
    with pytest.raises(KeyboardInterrupt):
        train(*config.load("grpo_math", args), quiet=True)
    monkeypatch.setattr(checkpoint, "crash_point", lambda name, step: None)
    train(*config.load("grpo_math", [*args, "resume=true"]), quiet=True)
    logged = [json.loads(line)["beta"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert logged == [0.2, 0.1, 0.05, 0.01]
