"""Resuming from damaged or mismatched checkpoints: a checkpoint with a file cut short, emptied or missing is skipped
for the newest one that verifies, with a line saying so, or, when none does, refused in one line naming the file; a
resume that cannot continue the run (fewer steps than the checkpoint's, another method) is refused in one line."""

import json
import shutil
import signal

import pytest
from cli_helpers import assert_one_line_error, posttrain
from test_resume import RUN, run

from posttrain.train import checkpoint


@pytest.fixture(scope="module")
def killed(tiny_model_dir, tmp_path_factory):
    """A run of 4 steps killed after step 4 was logged: step_1 to step_3 are its checkpoints (copied by each test)."""
    out = tmp_path_factory.mktemp("killed") / "run"
    proc = run(tiny_model_dir, out, crash="step:4")
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    staging = out.with_name("run.partial")
    assert [p.name for p in checkpoint.complete(staging / "checkpoints")] == ["step_1", "step_2", "step_3"]
    return staging


@pytest.fixture
def copy(killed, tmp_path):
    """The killed run's directory, copied: (output_dir, its checkpoints)."""
    out = tmp_path / "run"
    shutil.copytree(killed, out.with_name("run.partial"))
    return out, out.with_name("run.partial") / "checkpoints"


def cut(path, keep=0.5):
    """`path` cut to the first `keep` of its bytes (a write a full disk or a copy interrupted)."""
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def training_state(step):
    """The first file of the checkpoint's training state (under ddp, the policy's state.pt)."""
    return next(f for f in sorted((step / checkpoint.TRAINING_STATE).rglob("*")) if f.is_file())


DAMAGE = {
    "training state cut short": (lambda step: cut(training_state(step)), "training_state/"),
    "model cut short": (lambda step: cut(step / "model.safetensors"), "model.safetensors"),
    "process state missing": (lambda step: (step / "process_0.pt").unlink(), "process_0.pt"),
    "process state empty": (lambda step: (step / "process_0.pt").write_bytes(b""), "process_0.pt"),
    "run state cut short": (lambda step: cut(step / "trainer_state.json"), "trainer_state.json"),
    "run state emptied": (lambda step: (step / "trainer_state.json").write_text("{}"), "trainer_state.json"),
    "manifest edited": (lambda step: (step / checkpoint.MANIFEST).write_text(
        '{"files": {"../../elsewhere": {"bytes": "many"}}}'), checkpoint.MANIFEST),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_newest_checkpoint_is_skipped_for_the_newest_whole_one(tiny_model_dir, copy, damage):
    out, checkpoints = copy
    harm, name = DAMAGE[damage]
    harm(checkpoints / "step_3")
    proc = run(tiny_model_dir, out)  # the same command again: resume=auto
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    notices = [line for line in proc.stderr.splitlines() if "step_3" in line]
    assert len(notices) == 1 and notices[0].startswith("posttrain: notice: "), proc.stderr
    assert name in notices[0] and "step_2" in notices[0], notices[0]
    assert json.loads((out / "summary.json").read_text())["resumed_from"]["step"] == 2


@pytest.mark.parametrize("damage", DAMAGE)
def test_no_whole_checkpoint_or_a_damaged_one_named_is_one_line(tiny_model_dir, copy, damage):
    out, checkpoints = copy
    harm, name = DAMAGE[damage]
    for step in ("step_1", "step_2", "step_3"):
        harm(checkpoints / step)
    proc = run(tiny_model_dir, out)
    assert_one_line_error(proc, "resume:", str(checkpoints / "step_3"), name)
    assert_one_line_error(run(tiny_model_dir, out, f"resume={checkpoints / 'step_2'}"), "resume:",
                          str(checkpoints / "step_2"), name)
    assert [p.name for p in sorted(checkpoints.iterdir())] == ["step_1", "step_2", "step_3"]  # nothing removed


@pytest.mark.parametrize("damage", ["training state cut short", "process state empty", "run state emptied"])
def test_a_damaged_checkpoint_of_an_older_posttrain_is_one_line(tiny_model_dir, copy, damage):
    """A checkpoint written before manifests (none to verify against): its load errors name the file."""
    out, checkpoints = copy
    harm, name = DAMAGE[damage]
    for step in checkpoints.iterdir():
        (step / "manifest.json").unlink(missing_ok=True)
    harm(checkpoints / "step_3")
    proc = run(tiny_model_dir, out, f"resume={checkpoints / 'step_3'}")
    assert_one_line_error(proc, "resume:", str(checkpoints / "step_3"), name)


def test_fewer_steps_than_the_checkpoints_is_refused(tiny_model_dir, copy):
    out, _ = copy
    assert_one_line_error(run(tiny_model_dir, out, "train.steps=2"), "train.steps: 2", "step 3")


def test_another_method_is_named_first(tiny_model_dir, copy):
    out, _ = copy
    ppo = [a for a in RUN[1:] if not a.startswith("algorithm.group_size")]  # PPO samples one completion a prompt
    proc = posttrain("run", "recipe=ppo_math", *ppo, f"model.path={tiny_model_dir}", f"output_dir={out}", "-q")
    assert_one_line_error(proc, "resume:", "algorithm.name was 'grpo'", "now 'ppo'")
