"""Tests of isolated rewards: custom reward files loaded by path, every reward call bounded in a worker, and models
loaded without running code (rewards/custom.py, rewards/base.py, posttrain/core/bounded.py rule 7,
posttrain/models/loading.py).

The faulty reward of the GRPO run counts its calls across worker processes in a locked file. Call k sleeps forever
when 5 | k, else raises when 3 | k, else gives nan when 7 | k, else scores 1. Three steps of 4 completions make
calls 1-4, 5-8 and 9-12, so the steps log, as (errors, timeouts, nonfinite):
step 1: (1, 0, 0) from call 3; step 2: (1, 1, 1) from calls 6, 5, 7; step 3: (2, 1, 0) from calls 9 and 12, and 10.
"""

import json
import shutil
import time

import pytest
import torch
from cli_helpers import assert_one_line_error, posttrain

from posttrain import config, rewards
from posttrain.core.errors import ConfigError, DataError, UserError
from posttrain.models import loading
from posttrain.schema import RewardsConfig

MY_REWARDS = '''
def brevity(completions, answers, prompts):
    return [-len(c) / 10 for c in completions]


def tagged(completions, answers, prompts, answer_format="none"):
    return [float(answer_format == "number") for _ in completions]
'''


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    """tmp_path as the current directory, holding my_rewards.py."""
    (tmp_path / "my_rewards.py").write_text(MY_REWARDS)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_custom_reward_loaded_by_path(in_tmp):
    """Reference 7. "#### 7" (6 characters): accuracy 1, brevity -0.6, tagged 1 -> 1 + 0.5·(-0.6) + 1 = 1.7.
    "seven" (5 characters): accuracy 0, brevity -0.5, tagged 1 -> 0.5·(-0.5) + 1 = 0.75. `tagged` declares
    answer_format, so it is passed ("number"); a relative path is read from the current directory."""
    cfg = RewardsConfig({"accuracy": 1.0}, {"my_rewards.py:brevity": 0.5, f"{in_tmp}/my_rewards.py:tagged": 1.0})
    total, parts, counts = rewards.combine(cfg)(["#### 7", "seven"], ["7", "7"], ["Q: 3+4"] * 2)
    assert total == pytest.approx([1.7, 0.75])
    assert parts == {"accuracy": [1.0, 0.0], "my_rewards.brevity": [-0.6, -0.5], "my_rewards.tagged": [1.0, 1.0]}
    assert sum(counts.values()) == 0


def test_bad_data_still_stops_the_run():
    """A reward raising posttrain's own UserError is no sample's failure: the accuracy rule on a reference with no
    number raises it in the worker, and it reaches the caller as the one-line error it is."""
    with pytest.raises(DataError, match="reference answer 'seven' holds no number"):
        rewards.combine(RewardsConfig())(["#### 7"], ["seven"], ["Q"])


def test_rewards_group_in_a_recipe_file(in_tmp):
    """The YAML form: reward names and the reserved keys side by side; a group naming rewards replaces the default."""
    recipe = in_tmp / "recipe.yaml"
    recipe.write_text("algorithm: {name: grpo}\nrewards:\n  format: 0.5\n  custom:\n    my_rewards.py:brevity: 0.25\n"
                      "  timeout_s: 2\n")
    cfg, resolved = config.load(str(recipe))
    assert (cfg.rewards.weights, cfg.rewards.custom, cfg.rewards.timeout_s) == (
        {"format": 0.5}, {"my_rewards.py:brevity": 0.25}, 2.0)
    assert resolved["rewards"] == {"format": 0.5, "custom": {"my_rewards.py:brevity": 0.25}, "timeout_s": 2.0,
                                   "overlong_buffer": 0, "overlong_penalty": 1.0, "process": "none", "normalize": "none"}
    recipe.write_text("algorithm: {name: grpo}\nrewards:\n  custom: {my_rewards.py:brevity: 1}\n")
    only_custom, _ = config.load(str(recipe))
    assert only_custom.rewards.weights == {} and only_custom.rewards.custom == {"my_rewards.py:brevity": 1.0}
    default, resolved = config.load("grpo_math", ["rewards.timeout_s=3"])
    assert resolved["rewards"] == {"accuracy": 1.0, "custom": {}, "timeout_s": 3.0, "overlong_buffer": 0,
                                   "overlong_penalty": 1.0, "process": "none", "normalize": "none"}


@pytest.mark.parametrize("override, message", [
    ("rewards.custom={nope.py:brevity: 1}", "rewards.custom.nope.py:brevity: no such file"),
    ("rewards.custom={my_rewards.py:nope: 1}", "rewards.custom.my_rewards.py:nope: '{tmp}/my_rewards.py' defines no "
                                                "function 'nope'"),
    ("rewards.custom={broken.py:f: 1}", "rewards.custom.broken.py:f: importing '{tmp}/broken.py' failed "
                                        "(ModuleNotFoundError: No module named 'not_a_module_anywhere')"),
    ("rewards.custom={my_rewards.py: 1}", "rewards.custom.my_rewards.py: expected path/to/file.py:function"),
    ("rewards.custom.my_rewards.py:brevity=1", "rewards.custom.my_rewards: expected a weight"),
    ("rewards.custom={my_rewards.py:brevity: .nan}", "rewards.custom.my_rewards.py:brevity: must be a finite number"),
    ("rewards.timeout_s=0", "rewards.timeout_s: must be > 0"),
], ids=["missing-file", "missing-function", "import-fails", "no-function", "dotted-key", "nan-weight", "timeout"])
def test_bad_custom_entries_name_the_key(in_tmp, override, message):
    (in_tmp / "broken.py").write_text("import not_a_module_anywhere\n\ndef f(c, a, p):\n    return [0.0]\n")
    with pytest.raises(ConfigError) as err:
        config.load("grpo_math", [override])
    assert str(err.value).startswith(message.format(tmp=in_tmp)) and "\n" not in str(err.value)


def test_bad_custom_entry_is_one_line_from_the_cli(in_tmp):
    proc = posttrain("config", "recipe=grpo_math", "rewards.custom={my_rewards.py:nope: 1}", cwd=in_tmp)
    assert_one_line_error(proc, "rewards.custom.my_rewards.py:nope", "defines no function 'nope'")


NESTED = '''
import multiprocessing

from posttrain.rewards import math_answer


def nested(completions, answers, prompts):
    """math-verify's verdict, plus one for each process a pool inside this worker would have started."""
    verdicts = math_answer.verdicts(completions, answers)
    return [float(v) + len(multiprocessing.active_children()) for v in verdicts]
'''


def test_math_checks_run_in_the_reward_worker_and_stay_bounded(tmp_path):
    """Under answer_format=math, the accuracy rule in a reward worker checks directly (no pool in the pool: the custom
    reward sees no child process), and a check sympy would run for minutes is stopped at rewards.timeout_s."""
    (tmp_path / "nest.py").write_text(NESTED)
    cfg = RewardsConfig({"accuracy": 1.0}, {f"{tmp_path}/nest.py:nested": 1.0}, timeout_s=1.0)
    score = rewards.combine(cfg, answer_format="math")
    start = time.monotonic()
    with pytest.warns(RuntimeWarning, match="timed out after 1 s") as caught:
        _, parts, counts = score([r"\boxed{0.5}", r"\boxed{3}", r"\boxed{9^{9^{9^{9}}}}"], [r"\frac12", "2", "2"],
                                 [""] * 3)
    assert time.monotonic() - start < 15
    assert sorted(str(w.message).split(":")[0] for w in caught) == ["reward 'accuracy'", "reward 'nest.nested'"]
    assert parts == {"accuracy": [1.0, 0.0, None], "nest.nested": [1.0, 0.0, None]}
    assert counts == {"verify_errors": 0, "errors": 0, "timeouts": 2, "nonfinite": 0}


FLAKY = '''
import fcntl
import time


def flaky(completions, answers, prompts):
    with open({counter!r}, "r+") as f:  # the call number, counted across worker processes
        fcntl.flock(f, fcntl.LOCK_EX)
        k = int(f.read()) + 1
        f.seek(0)
        f.write(str(k))
    if k % 5 == 0:
        time.sleep(3600)
    if k % 3 == 0:
        raise RuntimeError(f"call {{k}} fails")
    return [float("nan") if k % 7 == 0 else 1.0 for _ in completions]
'''


def test_a_faulty_reward_costs_samples_not_the_run(warm_model_dir, tmp_path):
    """Counts from the module docstring; the accuracy rule beside it keeps scoring, and every count is per step."""
    counter = tmp_path / "calls"
    counter.write_text("0")
    (tmp_path / "flaky_rewards.py").write_text(FLAKY.format(counter=str(counter)))
    out = tmp_path / "run"
    proc = posttrain("run", "recipe=grpo_math", f"model.path={warm_model_dir}", f"output_dir={out}", "train.steps=3",
                     "train.batch_size=2", "algorithm.group_size=2", "rollout.max_new_tokens=8", "eval.num_problems=0",
                     "rewards.timeout_s=2", f"rewards.custom={{{tmp_path / 'flaky_rewards.py'}:flaky: 1.0}}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    got = [(m["reward/errors"], m["reward/timeouts"], m["reward/nonfinite"], m["reward/flaky_rewards.flaky"])
           for m in metrics]
    assert got == [(1, 0, 0, 0.75), (1, 1, 1, 0.25), (2, 1, 0, 0.25)]
    assert all(m["reward/verify_errors"] == 0 and "reward/accuracy" in m for m in metrics)
    assert counter.read_text() == "12"
    assert "RuntimeError: call 3 fails" in proc.stderr and "counted in reward/timeouts" in proc.stderr


def test_a_pickle_only_checkpoint_is_refused(tiny_model_dir, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model, ignore=shutil.ignore_patterns("*.safetensors"))
    torch.save({"w": torch.zeros(1)}, model / "pytorch_model.bin")
    with pytest.raises(UserError) as err:
        loading.load(model, key="model.path")
    assert str(err.value).startswith(f"model.path: '{model}' holds its weights only as a pickle (pytorch_model.bin)")
    assert "\n" not in str(err.value)


def test_models_load_from_safetensors_without_remote_code(tiny_model_dir, monkeypatch):
    """The loader asks transformers for safetensors only, and never for a checkpoint's own code."""
    import transformers

    seen = []
    for auto in ("AutoTokenizer", "AutoModelForCausalLM"):
        real = getattr(transformers, auto).from_pretrained
        monkeypatch.setattr(getattr(transformers, auto), "from_pretrained",
                            lambda *a, _real=real, _auto=auto, **kw: seen.append((_auto, kw)) or _real(*a, **kw))
    loading.load(tiny_model_dir)
    assert [(auto, kw["trust_remote_code"], kw.get("use_safetensors")) for auto, kw in seen] == [
        ("AutoTokenizer", False, None), ("AutoModelForCausalLM", False, True)]
