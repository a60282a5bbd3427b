"""Outputs that cannot be written are refused before any work, as one line; a final move that fails keeps the finished
run; an interrupted warm-up's leftovers are cleaned without touching a live one; and a prompt that slows every batch
drawing it is named once, before training."""

import errno
import fcntl
import json
import os
import re
from pathlib import Path

import pytest
from cli_helpers import assert_one_line_error, posttrain, posttrain_here

import posttrain as package
from posttrain import config
from posttrain.core.errors import ConfigError, TrainingError, UserError

CODE = Path(package.__file__).parent


@pytest.fixture
def here(tmp_path):
    """A working directory holding a file, `afile`."""
    (tmp_path / "cwd").mkdir()
    (tmp_path / "cwd" / "afile").write_text("keep me\n")
    return tmp_path / "cwd"


# model.path names no model, so that a check that is missing fails fast on it, before any training.
@pytest.mark.parametrize("output_dir, overwrite, fragments", [
    (".", False, ["output_dir: '.' is the current directory", "name a subdirectory"]),
    ("''", False, ["output_dir: empty", "name a directory"]),
    ("/", True, ["output_dir: '/' is the root directory"]),
    ("..", True, ["output_dir: '..' is a directory above the current one"]),
    (str(CODE), True, ["is posttrain's own code"]),
    (str(CODE.parent), True, ["holds posttrain's own code"]),
    ("afile/run", False, ["output_dir: cannot create 'afile/run': 'afile' is a file, not a directory"]),
])
def test_run_refuses_an_output_dir_it_cannot_move_a_run_onto(here, output_dir, overwrite, fragments):
    proc = posttrain_here("run", "recipe=grpo_math", f"model.path={here / 'no_model'}", f"output_dir={output_dir}",
                          f"overwrite={str(overwrite).lower()}", cwd=here)
    assert_one_line_error(proc, *fragments)
    assert (here / "afile").read_text() == "keep me\n" and sorted(p.name for p in here.iterdir()) == ["afile"]


def test_a_parent_that_cannot_be_written_is_refused_before_any_work(here, monkeypatch):
    """Tests run as root, whom chmod does not stop: the probe's first write fails instead, as it would for a user."""
    import tempfile

    def denied(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(tempfile, "mkdtemp", denied)
    proc = posttrain_here("run", "recipe=grpo_math", f"model.path={here / 'no_model'}", "output_dir=runs/x", cwd=here)
    assert_one_line_error(proc, "output_dir: cannot create 'runs/x' in '.' (Permission denied)", "writable")
    proc = posttrain_here("eval", here / "no_model", "-o", "out/eval.json", cwd=here)
    assert_one_line_error(proc, "-o: cannot create 'out/eval.json' in '.' (Permission denied)")


def test_eval_checks_its_output_before_evaluating(here):
    for output, fragment in [("afile/eval.json", "-o: cannot create 'afile/eval.json': 'afile' is a file"),
                             (".", "-o: '.' is a directory; give the report's file name, e.g. -o eval.json"),
                             ("afile", "afile: already exists")]:
        assert_one_line_error(posttrain_here("eval", here / "no_model", "-o", output, cwd=here), fragment)
    assert (here / "afile").read_text() == "keep me\n"


def test_eval_makes_the_missing_directories_of_its_output(tiny_model_dir, tmp_path):
    from posttrain.apps import evaluate

    out = tmp_path / "reports" / "tiny" / "eval.json"
    evaluate.main(str(tiny_model_dir), ["eval.num_problems=2", "rollout.max_new_tokens=2"], output=str(out),
                  quiet=True)
    assert json.loads(out.read_text())["num_problems"] == 2


def test_compare_and_reproduce_refuse_the_same_output_dirs(here, monkeypatch):
    from posttrain.apps import compare, reproduce

    monkeypatch.chdir(here)
    for value, fragment in [(".", "is the current directory"), ("..", "a directory above the current one"),
                            ("''", "empty"), ("afile", "'afile' is a file, not a directory"),
                            ("afile/x", "'afile' is a file, not a directory")]:
        value = "" if value == "''" else value
        with pytest.raises(UserError, match=fragment):
            compare.plan(["grpo_math", f"output_dir={value}", "overwrite=true"])
        for figure in ("figure5", "figure7"):
            with pytest.raises(UserError, match=fragment):
                reproduce.settings_of(figure, [f"output_dir={value}", "overwrite=true"])
    assert_one_line_error(posttrain_here("reproduce", "figure5", "output_dir=.", "overwrite=true", cwd=here),
                          "output_dir: '.' is the current directory", "e.g. output_dir=runs/figure5")
    assert sorted(p.name for p in here.iterdir()) == ["afile"]


def test_a_mount_point_is_refused_as_output_dir(tmp_path, monkeypatch):
    from posttrain.train.rundir import RunDir

    (tmp_path / "volume").mkdir()
    real = os.path.ismount
    monkeypatch.setattr(os.path, "ismount", lambda p: Path(p) == tmp_path / "volume" or real(p))
    with pytest.raises(ConfigError, match="is a mount point: the finished run, written beside it"):
        RunDir(tmp_path / "volume", overwrite=True)


def test_a_final_move_that_fails_keeps_the_finished_run_and_the_previous_one(tmp_path, monkeypatch):
    from posttrain.train.rundir import RunDir, write_config

    out = tmp_path / "run"
    out.mkdir()
    write_config(out, {"previous": True})  # a run's directory, as posttrain marks one
    (out / "summary.json").write_text('{"previous": true}')
    run_dir = RunDir(out, overwrite=True)
    (run_dir.create({"finished": True}) / "summary.json").write_text('{"finished": true}')
    rename = Path.rename

    def fails_across_devices(self, target):
        if Path(self) == run_dir.path:
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        return rename(self, target)

    monkeypatch.setattr(Path, "rename", fails_across_devices)
    with pytest.raises(TrainingError, match=re.escape(f"the finished run is whole in '{run_dir.path}'")):
        run_dir.commit()
    assert json.loads((out / "summary.json").read_text()) == {"previous": True}  # put back where it was
    assert json.loads((run_dir.path / "summary.json").read_text()) == {"finished": True}
    monkeypatch.undo()
    for f in out.iterdir():  # the previous run gone: out is empty
        f.unlink()
    with pytest.raises(ConfigError, match="holds a finished run that was not moved into place"):
        RunDir(out, overwrite=False)  # not wiped by the next run


def _locked(path: Path):
    f = open(path, "a")
    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return f


def test_stale_warmups_are_cleaned_but_not_one_being_written(tmp_path):
    """Nor a directory of the user's that has a warm-up's name: posttrain removes only run directories it wrote."""
    from posttrain.apps import warmup
    from posttrain.train.rundir import write_config

    stale, live = tmp_path / f"warmup-{'a' * 12}.partial", tmp_path / f"warmup-{'b' * 12}.partial"
    finished, unknown = tmp_path / f"warmup-{'c' * 12}", tmp_path / "warmup-notakey.partial"
    users = tmp_path / f"warmup-{'d' * 12}.partial"
    for d in (stale, live, finished, unknown, users):
        (d / "model").mkdir(parents=True)
    for d in (stale, live, finished, unknown):
        write_config(d, {"warmup": {}})
    (users / "notes.txt").write_text("precious\n")
    with _locked(tmp_path / f"warmup-{'b' * 12}.lock"):  # another process writing it now
        assert warmup.clean_stale(tmp_path) == [stale]
        assert live.is_dir() and finished.is_dir() and unknown.is_dir()
    assert warmup.clean_stale(tmp_path) == [live]  # its writer is gone
    assert finished.is_dir() and unknown.is_dir() and (users / "notes.txt").read_text() == "precious\n"
    # a warm-up's from before run directories were marked: its config.yaml, without the first line, is a warm-up's
    older = tmp_path / f"warmup-{'e' * 12}.partial"
    (older / "checkpoints").mkdir(parents=True)
    (older / "config.yaml").write_text(f"description: {warmup.DESCRIPTION}\noutput_dir: x\n")
    assert warmup.clean_stale(tmp_path) == [older] and (users / "notes.txt").read_text() == "precious\n"


def test_a_warmup_holds_its_lock_while_it_writes(tmp_path, monkeypatch):
    from posttrain.apps import warmup

    cfg, _ = config.load("grpo_math", [f"warmup.cache_dir={tmp_path}"])
    (tmp_path / f"warmup-{'a' * 12}.partial").mkdir()  # left by an interrupted warm-up of another key
    seen = {}

    def fake_run(run_cfg, resolved, quiet, splits=None):
        out = Path(run_cfg.output_dir)
        with pytest.raises(BlockingIOError):
            _locked(out.with_name(out.name + ".lock"))
        seen["stale_gone"] = not (tmp_path / f"warmup-{'a' * 12}.partial").exists()
        (out / "model").mkdir(parents=True)
        (out / "model" / "config.json").write_text("{}")

    monkeypatch.setattr(warmup, "run", fake_run)
    monkeypatch.setattr(warmup, "build_model_dir", lambda path, **kw: path)
    path, info = warmup.ensure(cfg, quiet=True)
    assert seen == {"stale_gone": True} and info["cached"] is False and (path / "config.json").is_file()
    _locked(path.parent.with_name(path.parent.name + ".lock")).close()  # released once done


def test_each_task_warms_up_a_model_of_its_own(tmp_path, monkeypatch):
    from posttrain.apps import warmup

    trained = {}

    def fake_run(run_cfg, resolved, quiet, splits=None):
        # the arithmetic task's rows are the slipping teacher's, `demonstrations` per question; calc's its own
        trained[run_cfg.data.task] = (run_cfg.data.max_operand, len(splits[0]) // run_cfg.data.train_size)
        (Path(run_cfg.output_dir) / "model").mkdir(parents=True)
        (Path(run_cfg.output_dir) / "model" / "config.json").write_text("{}")

    monkeypatch.setattr(warmup, "run", fake_run)
    monkeypatch.setattr(warmup, "build_model_dir", lambda path, **kw: path)
    paths = [warmup.ensure(config.load(recipe, [f"warmup.cache_dir={tmp_path}"])[0], quiet=True)[0]
             for recipe in ("grpo_math", "grpo_tools")]
    assert paths[0] != paths[1] and trained == {"arithmetic": (9, 16), "calc": (99, 1)}


def _rows(path: Path, long_row: int, chars: int, n: int = 40) -> Path:
    rows = [{"question": f"{i} + 1", "answer": str(i + 1)} for i in range(n)]
    rows[long_row]["question"] = "7 " * (chars // 2)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("chars, extra, fragments", [
    (20_000, [], ["data.path row 4's prompt is 20,0", "cut to its last 512 by data.max_prompt_len",
                  "x the median prompt", "padded to 512 tokens"]),
    (2_000, ["data.max_prompt_len=4096"], ["data.path row 4's prompt is 2,0", "x the median prompt",
                                          "data.max_prompt_len=4096 bounds prompts"]),
    (600, ["data.max_prompt_len=200"], ["1 of 40 prompts is longer than data.max_prompt_len=200 tokens",
                                        "the longest: data.path row 4"]),
    (200, [], None),  # long, but not past the floor: padding to it costs little
])
def test_a_long_prompt_is_named_once_before_training(tiny_model_dir, tmp_path, chars, extra, fragments):
    """The tiny model's tokenizer has a token per character, so a question of N characters is a prompt of about N."""
    from transformers import AutoTokenizer

    from posttrain.data.lengths import long_prompts
    from posttrain.sources import run_splits

    data = _rows(tmp_path / "rows.jsonl", 3, chars)
    cfg, _ = config.load("grpo_math", [f"model.path={tiny_model_dir}", f"data.path={data}", "eval.num_problems=5",
                                       *extra])
    warning = long_prompts(AutoTokenizer.from_pretrained(tiny_model_dir), *run_splits(cfg), cfg)
    if fragments is None:
        assert warning is None
        return
    assert warning is not None and "\n" not in warning
    for fragment in fragments:
        assert fragment in warning, warning


def test_a_run_warns_of_a_long_prompt_once(tiny_model_dir, tmp_path):
    data = _rows(tmp_path / "rows.jsonl", 3, 1_000)
    proc = posttrain("run", "recipe=grpo_math", f"model.path={tiny_model_dir}", f"data.path={data}", "-q",
                     f"output_dir={tmp_path / 'run'}", "train.steps=2", "train.batch_size=2", "algorithm.group_size=2",
                     "rollout.max_new_tokens=2", "eval.num_problems=2", "eval.every=0", "data.max_prompt_len=300")
    assert proc.returncode == 0, proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("posttrain: warning:")]
    assert len(warnings) == 1 and "data.path row 4's prompt is 1,0" in warnings[0], proc.stderr


# A tiny run that finishes in seconds, for the refusals that must come before one would destroy a user's files.
TINY = ["recipe=grpo_math", "train.steps=1", "train.batch_size=2", "algorithm.group_size=2",
        "rollout.max_new_tokens=2", "eval.num_problems=2", "eval.every=0", "-q"]


@pytest.mark.parametrize("side, overwrite, fragments", [
    (".partial", "false", ["output_dir: '{out}.partial', where the run is written on its way to '{out}'",
                           "posttrain did not write"]),
    (".partial", "true", ["output_dir: '{out}.partial', where the run is written on its way to '{out}'"]),
    (".old", "true", ["output_dir: '{out}.old', where the previous '{out}' is set aside", "posttrain did not write"]),
    ("", "true", ["output_dir: '{out}' is not a posttrain run's directory", "overwrite=true replaces only a run's"]),
])
def test_a_directory_posttrain_did_not_write_is_never_removed(tiny_model_dir, tmp_path, side, overwrite, fragments):
    """A directory of the user's own where a run would write (`OUT.partial`), set the previous run aside (`OUT.old`)
    or replace it (`OUT` under overwrite=true) is refused before any work, and keeps its files."""
    out = tmp_path / "out"
    mine = out.with_name(out.name + side)
    mine.mkdir()
    (mine / "notes.txt").write_text("precious\n")
    proc = posttrain("run", *TINY, f"model.path={tiny_model_dir}", f"output_dir={out}", f"overwrite={overwrite}")
    assert_one_line_error(proc, *(f.format(out=out) for f in fragments))
    assert (mine / "notes.txt").read_text() == "precious\n" and [p.name for p in mine.iterdir()] == ["notes.txt"]


def test_a_runs_own_directories_are_still_replaced(tiny_model_dir, tmp_path):
    """What posttrain wrote it may remove: a failed run's `.partial`, and under overwrite=true a finished run, whose
    config.yaml opens with posttrain's line. An empty directory holds nothing to lose."""
    out = tmp_path / "out"
    out.mkdir()  # empty: taken as it is
    first = posttrain("run", *TINY, f"model.path={tiny_model_dir}", f"output_dir={out}")
    assert first.returncode == 0, first.stderr[-2000:]
    assert (out / "config.yaml").read_text().startswith("# posttrain run directory")
    (out.with_name("out.partial")).mkdir()
    (out.with_name("out.partial") / "config.yaml").write_text((out / "config.yaml").read_text())  # a failed run's
    again = posttrain("run", *TINY, f"model.path={tiny_model_dir}", f"output_dir={out}", "overwrite=true", "seed=3")
    assert again.returncode == 0, again.stderr[-2000:]
    assert "seed: 3" in (out / "config.yaml").read_text()
    assert not out.with_name("out.partial").exists() and not out.with_name("out.old").exists()
