"""Environments that fail, through the real command line (docs/environments.md, "Rewards and failures").

An environment that cannot be created, or whose instances do not pickle, is refused in one line naming its file and
class, before training. Once a run trains, every call into an environment (its creation and `reset` at the start of
an episode, each `step`) is bounded by env.timeout_s, and its failure is an observation the model reads, counted in
metrics.jsonl's `env/errors`, never a crash, a hang or a NaN in the loss. The environments are tests/fake_envs.py's,
named by that file's path as a user names theirs; each run is one or two GRPO steps of four tiny episodes of the
untrained tiny model, whose every character ends a turn (fake_envs.EVERY_CHARACTER), so the environment reads each.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from cli_helpers import assert_one_line_error, posttrain, posttrain_here

from posttrain import environments
from posttrain.environments import Environment, Reply

FAKE = Path(__file__).with_name("fake_envs.py").resolve()


def tiny_run(model: Path, out: Path, env: str, *more: str) -> list[str]:
    """`posttrain run` of recipe=grpo_tools in `env`: two steps of 2 prompts x 2 episodes of two turns, with room
    for a reply between (the untrained model writes one character a turn)."""
    return ["run", "recipe=grpo_tools", f"model.path={model}", f"env.name={env}", "env.max_turns=2",
            "env.timeout_s=1", "train.steps=2", "train.batch_size=2", "algorithm.group_size=2",
            "rollout.max_new_tokens=100", "eval.num_problems=0", "data.train_size=8", "data.test_size=2",
            "train.threads=1", "train.log_samples=true", f"output_dir={out}", *more]


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_file_without_its_class_is_a_one_line_error(tiny_model_dir, tmp_path):
    """`env.name=path/to/file.py` (no `:Class`) is not an unknown registered name: it names a file, not its class."""
    proc = posttrain_here(*tiny_run(tiny_model_dir, tmp_path / "out", str(FAKE)))
    assert_one_line_error(proc, "env.name: expected a registered name or path/to/file.py:Class",
                          f"got the file alone, '{FAKE}': add a colon and the name")
    assert not (tmp_path / "out").exists()


def test_stop_strings_that_are_not_a_tuple_are_a_one_line_error(tiny_model_dir, tmp_path):
    """`stop = ("</guess>")` is a string, whose every character would end a turn: refused as the config loads."""
    proc = posttrain_here(*tiny_run(tiny_model_dir, tmp_path / "out", f"{FAKE}:StopIsAString"))
    assert_one_line_error(proc, "env.name: StopIsAString's stop must be a tuple of strings", "got str")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("cls, fragment", [
    ("FailsToStart", "failed (RuntimeError: no licence for this tool)"),
    ("SlowToStart", "failed (timed out after 1 s, env.timeout_s)"),
    ("Unpicklable", "does not pickle (TypeError: cannot pickle '_thread.lock' object)"),
])
def test_an_environment_that_cannot_be_created_or_pickled_is_a_one_line_error(tiny_model_dir, tmp_path, cls, fragment):
    """Checked once, before training: one instance created in a worker with the run's `env` settings, within
    env.timeout_s, that has to pickle both ways (an environment travels to a worker and back with each step)."""
    proc = posttrain(*tiny_run(tiny_model_dir, tmp_path / "out", f"{FAKE}:{cls}"))
    assert_one_line_error(proc, f"env.name: {cls} from '{FAKE}'", fragment)
    assert list(tmp_path.iterdir()) == []  # refused before the run's directory is made


def test_an_environments_own_refusal_is_its_line(tiny_model_dir, tmp_path):
    """A UserError from `__init__` (a tool this machine lacks, say) is the one line as the class wrote it, given as
    the run is built."""
    proc = posttrain(*tiny_run(tiny_model_dir, tmp_path / "out", f"{FAKE}:RefusesHere"))
    assert_one_line_error(proc, "env.name: this machine has no abacus (pip install abacus)")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("cls, says", [
    ("ResetRaises", "error: the environment failed (reset: ValueError: no board for this row)"),
    ("ResetHangs", "error: the environment failed (reset: timed out after 1 s)"),
])
def test_an_episode_whose_reset_fails_goes_on_with_the_error_as_every_reply(tiny_model_dir, tmp_path, cls, says):
    """Each episode's creation and `reset` run in a worker within env.timeout_s, like `step`; where they fail, the
    episode is still sampled, every turn's reply is the error, and `step` is never called on the environment that
    did not start. `env/errors` counts the failed start, once an episode (4 a step), and no step."""
    proc = posttrain(*tiny_run(tiny_model_dir, tmp_path / "out", f"{FAKE}:{cls}"))
    assert proc.returncode == 0, proc.stderr
    metrics = lines(tmp_path / "out" / "metrics.jsonl")
    assert [m["env/errors"] for m in metrics] == [4.0, 4.0]
    assert all(math.isfinite(m["loss"]) for m in metrics)
    samples = lines(tmp_path / "out" / "samples.jsonl")
    assert len(samples) == 8 and any(says in s["completion"] for s in samples)
    assert not any("ok" in s["completion"] for s in samples)  # fake_envs.Answers's reply: no step ran


@pytest.mark.parametrize("cls, says", [
    ("NotAReply", "error: the environment failed (step returned int, not Reply)"),
    ("NaNReward", "error: the environment failed (step returned a reward of nan)"),
    ("InfReward", "error: the environment failed (step returned a reward of -inf)"),
])
def test_a_step_that_breaks_the_contract_is_an_observation(tiny_model_dir, tmp_path, cls, says):
    """A `step` that returns something other than a Reply, or a Reply whose reward is not finite, fails as one that
    raises: the model reads why, `env/errors` counts it, and nothing of it (no NaN) reaches the reward or the loss."""
    proc = posttrain(*tiny_run(tiny_model_dir, tmp_path / "out", f"{FAKE}:{cls}"))
    assert proc.returncode == 0, proc.stderr
    metrics = lines(tmp_path / "out" / "metrics.jsonl")
    assert all(m["env/errors"] > 0 and m["env/reward"] == 0.0 for m in metrics)
    assert all(math.isfinite(m["loss"]) and math.isfinite(m["reward"]) for m in metrics)
    assert any(says in s["completion"] for s in lines(tmp_path / "out" / "samples.jsonl"))


@pytest.mark.parametrize("reply, fault", [
    (Reply(text="ok", info={"calls": float("nan")}), "step returned info['calls'] = nan"),
    (Reply(text="ok", reward="high"), "step returned a reward of 'high', not a number"),
    (Reply(text=None), "step returned a Reply whose text or role is not a string (None, 'user')"),
    (Reply(text="ok", info=[1.0]), "step returned a Reply whose info is list, not a dict"),
    (None, "step returned NoneType, not Reply"),
])
def test_each_way_a_reply_breaks_the_contract_is_named(reply, fault):
    """What `run_step` (in a pool worker, as the episodes call it) says of a reply the episode could not use; the
    model reads it as `error: the environment failed (...)`. A good reply comes back with its numbers as floats."""

    class Fixed(Environment):
        def step(self, text, ids, ended):
            return self.reply

    env = Fixed()
    env.reply = reply
    assert environments.run_step(Fixed, (env, "turn", [], False)) == (env, None, None, fault)
    env.reply = Reply(text="7", reward=1, info={"calls": True})
    _, good, rendered, why = environments.run_step(Fixed, (env, "turn", [], False), render=True)
    assert good == Reply(text="7", reward=1.0, info={"calls": 1.0}) and type(good.reward) is float
    assert rendered == "7" and why is None
