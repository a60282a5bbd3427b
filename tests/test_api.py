"""posttrain from Python (posttrain/apps/api.py): `posttrain.Run` and `posttrain.run` are the CLI's run, byte for
byte; a run steps one step at a time; reward functions are called as TRL calls them; rows come as a list of dicts or a
`datasets.Dataset` with nothing written to disk."""

from __future__ import annotations

import json

import pytest
from cli_helpers import posttrain
from conftest import EASY, FIXTURES

import posttrain as pt
from posttrain.core.errors import ConfigError, UserError

# one thread: the runs compared must round alike (fitted threads could differ between them under load)
SMALL = {"train.threads": 1, "train.steps": 3, "train.batch_size": 2, "algorithm.group_size": 4,
         "rollout.max_new_tokens": 6, "eval.num_problems": 4, "eval.every": 2,
         **{k: int(v) for k, v in (item.split("=") for item in EASY)}}
DROP = ("wall_seconds", "tokens_per_s", "time/", "threads")  # what the machine gave, not what was computed


def as_args(overrides: dict) -> list[str]:
    return [f"{k}={v}" for k, v in overrides.items()]


def lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def computed(metrics: list[dict]) -> list[dict]:
    return [{k: v for k, v in m.items() if not k.startswith(DROP)} for m in metrics]


def test_the_cli_and_a_stepped_python_run_write_the_same_bytes(tiny_model_dir, tmp_path):
    """`posttrain run` and `posttrain.Run` stepped by hand (model, tokenizer and an evaluation looked at midway) end
    with the same model, config.yaml, metrics and summary; each step's metrics are the line metrics.jsonl holds."""
    overrides = {**SMALL, "model.path": str(tiny_model_dir)}
    cli = posttrain("run", "recipe=grpo_math", *as_args(overrides), f"output_dir={tmp_path / 'cli'}", "-q")
    assert cli.returncode == 0, cli.stderr[-2000:]
    with pt.Run("grpo_math", {**overrides, "output_dir": str(tmp_path / "api")}, quiet=True) as run:
        assert repr(run).endswith("not started, 0 steps here)")
        first = run.step()
        assert first["step"] == 1 and run.output_dir == tmp_path / "api.partial"
        assert type(run.model).__name__ == "LlamaForCausalLM" and run.tokenizer.pad_token_id is not None
        assert set(run.evaluate()) >= {"accuracy", "num_problems"}  # looks only: no step, no line in metrics.jsonl
        rest = list(run.steps())
        assert run.done and [m["step"] for m in rest] == [2, 3]
        summary = run.finish()
    assert run.training is None  # closed: the with block's end found nothing left to release
    cli_dir, api_dir = tmp_path / "cli", tmp_path / "api"
    assert summary["output_dir"] == str(api_dir) and not (tmp_path / "api.partial").exists()
    for name in ("model/model.safetensors", "model/config.json", "model/tokenizer.json"):
        assert (api_dir / name).read_bytes() == (cli_dir / name).read_bytes(), name
    config = (api_dir / "config.yaml").read_text()
    assert f"output_dir: {api_dir}\n" in config  # the one key the two runs were given differently
    assert config.replace(str(api_dir), str(cli_dir)) == (cli_dir / "config.yaml").read_text()
    assert computed(lines(api_dir / "metrics.jsonl")) == computed(lines(cli_dir / "metrics.jsonl"))
    assert [first, *rest] == lines(api_dir / "metrics.jsonl")
    table = run.metrics_table()
    assert list(table["step"]) == [1, 2, 3] and list(table["reward"]) == [m["reward"] for m in [first, *rest]]
    cli_summary = json.loads((cli_dir / "summary.json").read_text())
    untimed = ("wall_seconds", "output_dir", "memory", "peak_rss_mb")  # measured, or where it was written
    assert {k: v for k, v in summary.items() if k not in untimed} == \
        {k: v for k, v in cli_summary.items() if k not in untimed}
    assert summary["eval_after"] == cli_summary["eval_after"] and "eval_before" in summary


def test_run_warms_the_embedded_model_up_and_prints_what_the_cli_prints(tmp_path, capsys):
    from posttrain.apps import api

    overrides = {**SMALL, "warmup.steps": 60, "eval.every": 0, "output_dir": str(tmp_path / "run")}
    summary = pt.run("grpo_math", overrides, quiet=True)
    assert summary["steps"] == 3 and "warmup" in summary and (tmp_path / "run" / "model").is_dir()
    api.print_report(summary)
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("held-out accuracy: ") and out[-1].startswith("done in ")


def test_reward_functions_are_called_as_trl_calls_them(tiny_model_dir, tmp_path):
    """A reward function gets the completions and, as keywords, the prompts and every field of the rows (lists of
    equal length); its mean is logged as reward/<name>, weighted into the reward the run trains on."""
    calls = []

    def short(completions, prompts, answer, question, **kwargs):
        calls.append((list(completions), list(prompts), list(answer), list(question), kwargs))
        return [1.0 / (1 + len(c)) for c in completions]

    def nothing(completions, **kwargs):
        return [None] * len(completions)  # could not score: 0, counted

    overrides = {**SMALL, "model.path": str(tiny_model_dir), "eval.every": 0, "rewards.accuracy": 0,
                 "output_dir": str(tmp_path / "run")}
    with pt.Run("grpo_math", overrides, rewards={"short": (short, 2.0), "nothing": nothing}, quiet=True) as run:
        metrics = list(run.steps())
    assert len(calls) == 3
    completions, prompts, answers, questions, extra = calls[0]
    assert len(completions) == len(prompts) == len(answers) == len(questions) == 2 * 4 and not extra
    assert all(isinstance(c, str) for c in completions) and all(q in p for q, p in zip(questions, prompts))
    assert answers[0] == answers[3] and answers[0].split("####")[-1].strip().lstrip("-").isdigit()
    for m, (completions, *_) in zip(metrics, calls):
        share = sum(1.0 / (1 + len(c)) for c in completions) / len(completions)
        assert share > 0 and m["reward/short"] == pytest.approx(share) and m["reward/nothing"] == 0.0
        assert m["reward"] == pytest.approx(2.0 * share) and m["reward/verify_errors"] == len(completions)


def test_rows_from_python_train_as_the_same_rows_in_a_file(tiny_model_dir, tmp_path):
    """data= as a list of dicts and as a datasets.Dataset give the bytes a JSONL file of the same rows gives;
    config.yaml says where the rows came from."""
    import datasets

    from posttrain.data import read_rows

    train = read_rows(FIXTURES / "gsm8k" / "train_head.jsonl")[:40]
    test = read_rows(FIXTURES / "gsm8k" / "test_head.jsonl")[:4]
    file = tmp_path / "train.jsonl"
    file.write_text("".join(json.dumps(r) + "\n" for r in train))
    base = {**SMALL, "model.path": str(tiny_model_dir), "eval.every": 0, "rollout.max_new_tokens": 4,
            "data.max_prompt_len": 64}
    base = {k: v for k, v in base.items() if not k.startswith("data.") or k == "data.max_prompt_len"}
    pt.run("grpo_math", {**base, "data.path": str(file), "data.test_path": str(FIXTURES / "gsm8k" / "test_head.jsonl"),
                         "eval.num_problems": 4, "output_dir": str(tmp_path / "file")}, quiet=True)
    pt.run("grpo_math", {**base, "output_dir": str(tmp_path / "list")}, data=train, test_data=test, quiet=True)
    pt.run("grpo_math", {**base, "output_dir": str(tmp_path / "dataset")}, data=datasets.Dataset.from_list(train),
           test_data=datasets.Dataset.from_list(test), quiet=True)
    weights = [(tmp_path / d / "model" / "model.safetensors").read_bytes() for d in ("file", "list", "dataset")]
    assert weights[0] == weights[1] == weights[2]
    config = (tmp_path / "list" / "config.yaml").read_text()
    assert "  path: python:data\n  test_path: python:test_data\n" in config and "preset: gsm8k" in config


def test_bad_input_from_python_is_one_error_naming_it(tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError, match=r"^train.steps: "):
        pt.Run("grpo_math", {"train.steps": "many"})
    with pytest.raises(ConfigError, match=r"^rewards: sft does not sample"):
        pt.Run("sft_math", rewards=len)
    with pytest.raises(ConfigError, match=r"^rewards: a lambda has no name"):
        pt.Run("grpo_math", rewards=[lambda completions, **kw: [0.0] * len(completions)])
    with pytest.raises(ConfigError, match=r"^overrides: give a dict"):
        pt.Run("grpo_math", "train.steps=5")
    with pytest.raises(ConfigError, match=r"^data.path: given twice"):
        pt.Run("grpo_math", {"data.path": "rows.jsonl"}, data=[{"question": "1 + 1", "answer": "2"}])
    with pytest.raises(ConfigError, match=r"^env: give a subclass of posttrain.environments.Environment"):
        pt.Run("grpo_math", env=object())

    def two_few(completions, **kwargs):
        return [1.0]

    overrides = {**SMALL, "model.path": str(tiny_model_dir), "output_dir": str(tmp_path / "run"), "eval.every": 0}
    with pt.Run("grpo_math", overrides, rewards=two_few, quiet=True) as run:
        with pytest.raises(UserError, match=r"^rewards: the function 'two_few' returned 1 scores for 8 completions$"):
            run.step()
    assert (tmp_path / "run.partial").is_dir() and not (tmp_path / "run").exists()  # unfinished: left to resume


def test_a_script_without_a_main_guard_runs_and_leaving_the_run_stops_its_workers(tiny_model_dir, tmp_path):
    """A script read from stdin, with no `if __name__ == "__main__":` guard, starts rollout workers and reward workers
    (the accuracy rule's), which must not import it; leaving the `with` block stops the rollout workers."""
    import subprocess
    import sys

    overrides = {**SMALL, "model.path": str(tiny_model_dir), "eval.every": 0, "output_dir": str(tmp_path / "run"),
                 "rollout.placement": "separate", "rollout.workers": 1, "rollout.worker_threads": 1}
    script = f"""
import json, posttrain
with posttrain.Run("grpo_math", {overrides!r}, quiet=True) as run:
    step = run.step()
    workers = run.training.engine.rollout.workers
    assert type(run.training.engine.rollout).__name__ == "WorkerPool" and len(workers) == 1
    alive = [w.process.is_alive() for w in workers]
print(json.dumps({{"reward/accuracy": step["reward/accuracy"], "alive": alive,
                   "after": [w.process.is_alive() for w in workers]}}))
"""
    proc = subprocess.run([sys.executable, "-"], input=script, capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["alive"] == [True] and out["after"] == [False] and out["reward/accuracy"] >= 0


def test_an_environment_class_defined_in_the_script_runs_its_episodes(tiny_model_dir, tmp_path):
    """env= with a class defined in the script itself (__main__, as in a notebook), which no worker process could
    import: its instances run in the calling process, and what one keeps carries from reset to its steps."""
    import subprocess
    import sys

    overrides = {**SMALL, "model.path": str(tiny_model_dir), "eval.every": 0, "output_dir": str(tmp_path / "run"),
                 "env.max_turns": 3, "rollout.max_new_tokens": 8}
    script = f"""
import json, posttrain
from posttrain.environments import Environment, Reply

STEPPED = []  # filled only where the steps run: here, if they run in the script's own process


class Count(Environment):
    stop = tuple("0123456789+-=")  # the tiny model's random text meets one of these now and then: a turn ends there

    def reset(self, row):
        self.answer, self.turns = row["answer"], 0

    def step(self, text, ids, ended):
        self.turns += 1
        STEPPED.append(self.answer)
        return Reply(text="=", reward=0.25, done=ended or self.turns >= 2)

run = posttrain.Run("grpo_math", {overrides!r}, env=Count, quiet=True)
steps = list(run.steps())
run.finish()
print(json.dumps({{"steps": steps, "stepped": len(STEPPED)}}))
"""
    proc = subprocess.run([sys.executable, "-"], input=script, capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    assert len(out["steps"]) == 3 and all(m["env/errors"] == 0 for m in out["steps"])
    assert out["stepped"] > 0  # the turns read, here, in the script's own process
    assert "  name: python:Count\n" in (tmp_path / "run" / "config.yaml").read_text()
