"""Resume: a run killed with SIGKILL (inside a checkpoint write, and between a step and its checkpoint) and resumed
ends with the same bytes as a run never interrupted; checkpoints are whole or absent; a resume that cannot be exact
is refused."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from cli_helpers import assert_one_line_error, posttrain, posttrain_here
from conftest import EASY

from posttrain.core.errors import ConfigError
from posttrain.core.threads import usable_cores
from posttrain.train import checkpoint

# The thread count pinned: fitted to the load, it could change the last bits of a reduction between the runs compared
PINNED = f"train.threads={usable_cores()}"
RUN = ["recipe=grpo_math", PINNED, "train.steps=4", "train.batch_size=2", "algorithm.group_size=2", "train.save_every=1",
       "rollout.max_new_tokens=6", "eval.num_problems=2", *EASY]


def run(model, out, *extra, crash=None):
    env = {"POSTTRAIN_CRASH_AT": crash} if crash else {}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return posttrain("run", *RUN, f"model.path={model}", f"output_dir={out}", *extra, "-q")
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def metrics(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_killed_twice_and_resumed_equals_uninterrupted(tiny_model_dir, tmp_path):
    whole = run(tiny_model_dir, tmp_path / "whole")
    assert whole.returncode == 0, whole.stderr[-2000:]
    out, staging = tmp_path / "killed", tmp_path / "killed.partial"

    killed = run(tiny_model_dir, out, crash="checkpoint:3")  # inside step 3's checkpoint write
    assert killed.returncode == -signal.SIGKILL
    assert [p.name for p in checkpoint.complete(staging / "checkpoints")] == ["step_1", "step_2"]
    assert (staging / "checkpoints" / ".step_3.tmp").is_dir()  # the torn write is there, and is not a checkpoint

    killed = run(tiny_model_dir, out, "resume=true", crash="step:4")  # step 4 logged, its checkpoint not written
    assert killed.returncode == -signal.SIGKILL
    assert [m["step"] for m in metrics(staging / "metrics.jsonl")] == [1, 2, 3, 4]

    resumed = run(tiny_model_dir, out)  # the first command again (resume=auto): from step 3, step 4's line dropped
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert (out / "model" / "model.safetensors").read_bytes() == \
        (tmp_path / "whole" / "model" / "model.safetensors").read_bytes()
    drop = ("wall_seconds", "tokens_per_s", "time/", "threads")  # what the machine gave, not what was computed
    same = [{k: v for k, v in m.items() if not k.startswith(drop)} for m in metrics(out / "metrics.jsonl")]
    assert same == [{k: v for k, v in m.items() if not k.startswith(drop)}
                    for m in metrics(tmp_path / "whole" / "metrics.jsonl")]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed_from"]["step"] == 3 and "eval_before" in summary


def test_auto_resume_starts_afresh_when_no_checkpoint_was_written(tiny_model_dir, tmp_path):
    """The default, resume=auto: a run killed before its first checkpoint (step 2 of save_every=3) is re-run by the
    same command, from the start, saying so, and ends as a run never interrupted; resume=true stays strict."""
    out, args = tmp_path / "killed", ["train.save_every=3"]
    assert run(tiny_model_dir, out, *args, crash="step:2").returncode == -signal.SIGKILL
    refused = posttrain_here("run", *RUN, f"model.path={tiny_model_dir}", f"output_dir={out}", *args, "resume=true")
    assert_one_line_error(refused, "resume: no complete checkpoint")
    again = posttrain("run", *RUN, f"model.path={tiny_model_dir}", f"output_dir={out}", *args, "resume=auto")  # not -q
    assert again.returncode == 0, again.stderr[-2000:]
    assert "grpo run from the start, writing to" in again.stderr
    assert run(tiny_model_dir, tmp_path / "whole", *args).returncode == 0
    assert (out / "model" / "model.safetensors").read_bytes() == \
        (tmp_path / "whole" / "model" / "model.safetensors").read_bytes()
    assert "resumed_from" not in json.loads((out / "summary.json").read_text())


def test_keep_checkpoints_and_refusals(tiny_model_dir, tmp_path):
    from posttrain import config
    from posttrain.train import run as train

    out = tmp_path / "kept"
    proc = run(tiny_model_dir, out, "train.keep_checkpoints=2")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [p.name for p in checkpoint.complete(out / "checkpoints")] == ["step_3", "step_4"]
    assert (out / "checkpoints" / "step_4" / "config.json").is_file()  # still a model directory
    refused = posttrain_here("run", *RUN, f"model.path={tiny_model_dir}", f"output_dir={out}", "resume=true")
    assert_one_line_error(refused, "resume:", "holds a finished run")
    step = out / "checkpoints" / "step_3"
    for extra, message in [
        (["resume=true", f"output_dir={tmp_path / 'none'}"], "resume: no complete checkpoint"),
        ([f"resume={step}", "train.lr=0.5", f"output_dir={tmp_path / 'a'}"],
         "resume: train.lr was 0.0002 in the run being resumed, now 0.5"),
        ([f"resume={tmp_path}", f"output_dir={tmp_path / 'b'}"], "is not a complete checkpoint"),
        ([f"resume={step}", f"output_dir={tmp_path / 'c'}", "train.backend=fsdp2"],
         "resume: train.backend was 'ddp' in the run being resumed, now 'fsdp2'"),
    ]:
        cfg, resolved = config.load("grpo_math", [*RUN[1:], f"model.path={tiny_model_dir}", *extra])
        with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
            train(cfg, resolved, quiet=True)


def test_what_may_differ_on_resume(tmp_path):
    old = {"train": {"steps": 4, "lr": 1.0, "save_every": 1}, "eval": {"num_problems": 2}, "resume": False}
    assert checkpoint.differences(old, {**old, "train": {"steps": 9, "lr": 1.0, "save_every": 5}, "resume": True}) == []
    assert checkpoint.differences(old, {**old, "train": {"steps": 4, "lr": 2.0, "save_every": 1}}) == \
        [("train.lr", 1.0, 2.0)]
    # eval.num_problems sets the held-out rows, and so the training rows, when there is no data.test_path
    assert checkpoint.differences(old, {**old, "eval": {"num_problems": 3}}) == [("eval.num_problems", 2, 3)]


def test_a_new_run_does_not_discard_an_interrupted_runs_checkpoints(tmp_path):
    from posttrain.train.rundir import RunDir, write_config

    (tmp_path / "out.partial" / "checkpoints" / "step_2").mkdir(parents=True)
    write_config(tmp_path / "out.partial", {})  # a run's directory, as posttrain marks one
    RunDir(tmp_path / "out", overwrite=False)  # a torn or model-only step_2 holds nothing to lose
    (tmp_path / "out.partial" / "checkpoints" / "step_2" / "trainer_state.json").write_text("{}")
    with pytest.raises(ConfigError, match="holds an interrupted run's checkpoints; resume=auto or true continues it"):
        RunDir(tmp_path / "out", overwrite=False)
    RunDir(tmp_path / "out", overwrite=False, resume=True)
    RunDir(tmp_path / "out", overwrite=False, resume="auto")
    RunDir(tmp_path / "out", overwrite=True)


def test_non_finite_steps_are_skipped_then_stop_the_run(tiny_model_dir, tmp_path, monkeypatch):
    """A NaN loss on one step leaves the weights and AdamW state as they were and is counted; a model that gives
    NaN every step stops the run after train.max_skipped_steps, with a checkpoint to look at."""
    import torch

    from posttrain import config
    from posttrain.core.errors import TrainingError
    from posttrain.train import run as train
    from posttrain.train.engine import Engine

    calls = {"n": 0}
    backward = Engine.accumulate

    def poisoned(self, batch, totals):  # update 2: finite loss, NaN gradients; update 3: NaN loss, finite gradients
        calls["n"] += 1
        metrics = backward(self, batch, totals)
        if calls["n"] == 2:
            for p in self.policy.module.parameters():
                if p.grad is not None:
                    p.grad.fill_(float("nan"))
        if calls["n"] == 3:
            metrics["loss"] = metrics["loss"] * float("nan")
        return metrics

    monkeypatch.setattr(Engine, "accumulate", poisoned)
    # SFT: its gradient is never zero, so the last step moves the weights whatever the samples (a random model's
    # GRPO groups all earn 0, and in fp32 its reference equals the policy: no gradient at all)
    cfg, resolved = config.load("sft_math", ["train.steps=4", "train.batch_size=2", "train.save_every=0",
                                             "eval.num_problems=2", *EASY, f"model.path={tiny_model_dir}",
                                             f"output_dir={tmp_path / 'one'}"])
    seen = []
    step = Engine.step

    def watched(self):  # the policy's weights and AdamW step count after each step
        out = step(self)
        opt = self.policy.optimizer.state
        seen.append(([p.detach().clone() for p in self.policy.module.parameters()],
                     max((float(s["step"]) for s in opt.values()), default=0.0)))
        return out

    monkeypatch.setattr(Engine, "step", watched)
    train(cfg, resolved, quiet=True)
    steps = metrics(tmp_path / "one" / "metrics.jsonl")
    assert [m["skipped_updates"] for m in steps] == [0.0, 1.0, 1.0, 0.0] and steps[-1]["skipped_steps"] == 2.0
    assert [adam for _, adam in seen] == [1.0, 1.0, 1.0, 2.0]  # AdamW stepped twice: steps 2 and 3 were skipped
    assert all(torch.equal(a, b) for a, b in zip(seen[0][0], seen[2][0]))  # and the weights did not move
    assert not all(torch.equal(a, b) for a, b in zip(seen[2][0], seen[3][0]))

    monkeypatch.setattr(Engine, "accumulate", backward)
    monkeypatch.setattr(Engine, "step", step)
    cfg, resolved = config.load("grpo_math", [*RUN[1:], "train.max_skipped_steps=2", "train.save_every=0",
                                              f"model.path={tiny_model_dir}", f"output_dir={tmp_path / 'nan'}"])
    start = {}
    init = Engine.__init__

    def poisoned_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        with torch.no_grad():
            next(p for p in self.policy.module.parameters() if p.requires_grad).view(-1)[0] = float("nan")
        start["weights"] = {n: p.detach().clone() for n, p in self.policy.module.named_parameters()}
        start["engine"] = self

    monkeypatch.setattr(Engine, "__init__", poisoned_init)
    with pytest.raises(TrainingError, match="2 steps in a row had a non-finite loss or gradient norm"):
        train(cfg, resolved, quiet=True)
    engine = start["engine"]
    after = dict(engine.policy.module.named_parameters())
    assert all(torch.equal(after[n].nan_to_num(), w.nan_to_num()) for n, w in start["weights"].items())
    assert not engine.policy.optimizer.state  # AdamW never stepped
    assert [p.name for p in checkpoint.complete(tmp_path / "nan.partial" / "checkpoints")] == ["step_2"]


def test_ctrl_c_of_a_separate_placement_run_is_one_line_and_keeps_its_checkpoints(tiny_model_dir, tmp_path):
    """Ctrl-C reaches every process of the terminal's process group: the training process and its rollout workers.
    The workers leave it to the training process, which stops them and says `posttrain: interrupted`; no worker
    prints a traceback. The interrupt lands inside a checkpoint write where the timing allows (a step's write lasts a
    fraction of a second), and the newest complete checkpoint verifies and resumes."""
    out = tmp_path / "run"
    args = [sys.executable, "-m", "posttrain", "run", *RUN, "train.steps=50", "eval.every=0",
            "rollout.placement=separate", "rollout.worker_threads=1", f"model.path={tiny_model_dir}",
            f"output_dir={out}", "-q"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "COLUMNS": "120"})
    found = tmp_path / "run.partial" / "checkpoints"
    deadline = time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline:
        if (found / "step_1").is_dir() and any(found.glob(".step_*.tmp")) or (found / "step_4").is_dir():
            break
        time.sleep(0.002)
    os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C does
    _, stderr = proc.communicate(timeout=120)
    # 130, or killed by SIGINT itself once it has said so: a shell reports both as 130
    assert proc.returncode in (130, -signal.SIGINT) and "Traceback" not in stderr, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == "posttrain: interrupted", stderr[-3000:]
    newest = checkpoint.complete(found)[-1]
    assert checkpoint.damage(newest) is None
    step = int(newest.name.removeprefix("step_"))
    resumed = posttrain("run", *RUN, f"train.steps={step + 1}", "eval.every=0", "rollout.placement=separate",
                        "rollout.worker_threads=1", f"model.path={tiny_model_dir}", f"output_dir={out}", "-q")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert json.loads((out / "summary.json").read_text())["resumed_from"]["step"] == step
