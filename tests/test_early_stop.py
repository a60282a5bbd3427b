"""Early stopping (eval.stop_on): when a run stops, which evaluation is the best, and that the final model is the
best evaluation's, byte for byte, with its checkpoint kept whatever train.keep_checkpoints says."""

import json

import pytest
from conftest import EASY

from posttrain.core.errors import ConfigError
from posttrain.schema import EvalConfig
from posttrain.train.evaluation import EarlyStop


def judged(stop, values, metric="accuracy"):
    """Feeds `values` as evaluations at steps 1, 2, ...; returns (best flags, the step it stopped at or None)."""
    flags = []
    for step, v in enumerate(values, 1):
        if metric == "kl":
            stop.track({"kl": v})
        flags.append(stop.judge(step, {"accuracy": v}))
        if stop.stop:
            return flags, step
    return flags, None


def test_accuracy_stops_after_patience_worse_evaluations():
    """Best 0.70 at step 2; 0.68 is within 5% of it (0.665), so not worse and the count restarts; 0.60 and 0.50 are
    worse: with patience 2 the run stops at step 5."""
    stop = EarlyStop(EvalConfig(every=1, stop_on="accuracy", patience=2, min_delta=0.05))
    flags, at = judged(stop, [0.5, 0.7, 0.68, 0.6, 0.5, 0.9])
    assert flags == [True, True, False, False, False] and at == 5
    assert stop.summary(at) == {"metric": "accuracy", "best_step": 2, "best_value": 0.7, "stopped_at": 5}


def test_kl_growing_five_percent_over_three_evaluations():
    """The seed's rule. KL 1.0, 1.02 (grew 2%: not counted, step 2 is now where a rollback goes), then 1.10 (+7.8%),
    1.20 (+9.1%), 1.30 (+8.3%): three growths over 5% in a row stop the run at step 5, and the model to keep is step
    2's, the last before the growth began (the lowest KL, step 1's, would be the least trained). A growth under 5%
    restarts the count."""
    stop = EarlyStop(EvalConfig(every=1, stop_on="kl"))
    flags, at = judged(stop, [1.0, 1.02, 1.10, 1.20, 1.30], metric="kl")
    assert flags == [True, True, False, False, False] and at == 5 and stop.best_step == 2
    stop = EarlyStop(EvalConfig(every=1, stop_on="kl"))
    flags, at = judged(stop, [1.0, 1.10, 1.20, 1.22, 1.40, 1.60], metric="kl")
    assert at is None and stop.worse == 2 and stop.best_step == 4  # 1.22 grew 1.7%: counted from there again
    stop = EarlyStop(EvalConfig(every=2, stop_on="kl"))
    for v in (1.0, 3.0):
        stop.track({"kl": v})
    stop.judge(2, {"accuracy": 0.0})
    assert stop.best == 2.0  # the mean since the previous evaluation
    assert stop.judge(4, {"accuracy": 0.0}) is False and stop.worse == 0  # no KL logged since: not judged


def test_state_round_trip():
    stop = EarlyStop(EvalConfig(every=1, stop_on="accuracy", patience=3))
    judged(stop, [0.5, 0.7, 0.6])
    stop.best_evaluation = {"accuracy": 0.7}
    again = EarlyStop(EvalConfig(every=1, stop_on="accuracy", patience=3))
    stop.checkpoint = "step_2"
    again.load_state_dict(json.loads(json.dumps(stop.state_dict())))
    assert (again.best, again.best_step, again.worse, again.best_evaluation) == (0.7, 2, 1, {"accuracy": 0.7})
    assert again.checkpoint == "step_2"


def test_settings_are_checked():
    with pytest.raises(ConfigError, match="stop_on: accuracy is judged at the evaluations of eval.every"):
        EvalConfig(stop_on="accuracy")
    with pytest.raises(ConfigError, match="stop_on: unknown 'loss'"):
        EvalConfig(every=1, stop_on="loss")
    from posttrain import config

    with pytest.raises(ConfigError, match="eval.stop_on: kl needs a KL to the reference"):
        config.load("grpo_math", ["eval.every=1", "eval.stop_on=kl", "algorithm.beta=0"])


def test_a_run_stops_and_rolls_back_to_its_best_model(tiny_model_dir, tmp_path, monkeypatch):
    """Scripted held-out accuracies 0.5, 0.7, 0.6, 0.4 over 6 steps, patience 2: the run stops after step 4, and its
    model is step 2's checkpoint's, byte for byte, though train.keep_checkpoints=1 keeps only the newest otherwise."""
    from posttrain import config
    from posttrain.train import run as train
    from posttrain.train.engine import Engine

    scripted = iter([0.1, 0.5, 0.7, 0.6, 0.4])  # eval_before, then steps 1-4
    monkeypatch.setattr(Engine, "evaluate", lambda self: {"accuracy": next(scripted), "num_problems": 2})
    out = tmp_path / "es"
    # SFT: every step moves the weights (a random model's GRPO groups all earn 0, and in fp32 its reference equals the
    # policy: no gradient, and step 4's model would be step 2's)
    cfg, resolved = config.load("sft_math", [f"model.path={tiny_model_dir}", f"output_dir={out}", "train.steps=6",
                                             "train.batch_size=2", "eval.num_problems=2", "eval.every=1",
                                             "eval.stop_on=accuracy", "eval.patience=2", "eval.min_delta=0",
                                             "train.save_every=1", "train.keep_checkpoints=1", *EASY])
    summary = train(cfg, resolved, quiet=True)
    assert summary["early_stop"] == {"metric": "accuracy", "best_step": 2, "best_value": 0.7, "stopped_at": 4}
    assert summary["steps"] == 4 and summary["eval_after"]["accuracy"] == 0.7
    assert [p.name for p in sorted((out / "checkpoints").iterdir())] == ["step_2", "step_4"]
    assert (out / "model" / "model.safetensors").read_bytes() == \
        (out / "checkpoints" / "step_2" / "model.safetensors").read_bytes()
    assert (out / "model" / "model.safetensors").read_bytes() != \
        (out / "checkpoints" / "step_4" / "model.safetensors").read_bytes()
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]


def test_a_resumed_run_keeps_its_best_and_its_count(tiny_model_dir, tmp_path, monkeypatch):
    """Interrupted after step 3 was logged (step 2's checkpoint is the newest), then resumed: the best (step 2) and
    its checkpoint come back from step 2's checkpoint, so the run stops at step 4 and rolls back to step 2 as an
    uninterrupted one does."""
    from posttrain import config
    from posttrain.train import checkpoint
    from posttrain.train import run as train
    from posttrain.train.engine import Engine

    scripted = iter([0.1, 0.5, 0.7, 0.6, 0.6, 0.4])  # eval_before, steps 1-3, then step 3 again and step 4
    monkeypatch.setattr(Engine, "evaluate", lambda self: {"accuracy": next(scripted), "num_problems": 2})

    def interrupt(name, step):
        if (name, step) == ("step", 3):
            raise KeyboardInterrupt

    out = tmp_path / "es"
    args = [f"model.path={tiny_model_dir}", f"output_dir={out}", "train.steps=6", "train.batch_size=2",
            "algorithm.group_size=2", "rollout.max_new_tokens=4", "eval.num_problems=2", "eval.every=1",
            "eval.stop_on=accuracy", "eval.patience=2", "eval.min_delta=0", "train.save_every=1", *EASY]
    monkeypatch.setattr(checkpoint, "crash_point", interrupt)
    with pytest.raises(KeyboardInterrupt):
        train(*config.load("grpo_math", args), quiet=True)
    monkeypatch.setattr(checkpoint, "crash_point", lambda name, step: None)
    summary = train(*config.load("grpo_math", [*args, "resume=true"]), quiet=True)
    assert summary["resumed_from"]["step"] == 2
    assert summary["early_stop"] == {"metric": "accuracy", "best_step": 2, "best_value": 0.7, "stopped_at": 4}
    assert (out / "model" / "model.safetensors").read_bytes() == \
        (out / "checkpoints" / "step_2" / "model.safetensors").read_bytes()


def test_a_run_stops_when_its_kl_keeps_growing(tiny_model_dir, tmp_path, monkeypatch):
    """The loop feeds each step's logged kl to the judge: scripted KL 1.0, 1.02, 1.2, 1.4 with patience 2 stop the
    run after step 4 and keep step 2's model."""
    from posttrain import config
    from posttrain.train import run as train
    from posttrain.train.engine import Engine

    kls, step = iter([1.0, 1.02, 1.2, 1.4]), Engine.step
    monkeypatch.setattr(Engine, "step", lambda self: {**step(self), "kl": next(kls)})
    out = tmp_path / "kl"
    cfg, resolved = config.load("grpo_math", [f"model.path={tiny_model_dir}", f"output_dir={out}", "train.steps=6",
                                              "train.batch_size=2", "algorithm.group_size=2",
                                              "rollout.max_new_tokens=4", "eval.num_problems=2", "eval.every=1",
                                              "eval.stop_on=kl", "eval.patience=2", *EASY])
    summary = train(cfg, resolved, quiet=True)
    assert summary["early_stop"] == {"metric": "kl", "best_step": 2, "best_value": 1.02, "stopped_at": 4}
    assert (out / "model" / "model.safetensors").read_bytes() == \
        (out / "checkpoints" / "step_2" / "model.safetensors").read_bytes()
