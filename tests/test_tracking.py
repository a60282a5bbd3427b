"""Trackers (`report_to`), end to end on the command line: TensorBoard, W&B (offline) and trackio each hold exactly
metrics.jsonl's numbers, read back from what they wrote (event files, the .wandb transaction log, trackio's SQLite
database); a resumed run's TensorBoard steps follow on without a repeat; report_to=none writes nothing outside
output_dir and imports no tracker; a bad name or a missing library is one line naming report_to."""

import importlib.util
import json
import math
import os
import re
import signal
import sqlite3
import struct
import subprocess
import sys

import pytest
import yaml
from cli_helpers import assert_one_line_error, posttrain_here
from conftest import EASY

from posttrain import config, schema
from posttrain.core.errors import ConfigError
from posttrain.train import tracking

RUN = ["recipe=grpo_math", "train.steps=3", "train.batch_size=2", "algorithm.group_size=2", "rollout.max_new_tokens=6",
       "eval.num_problems=2", *EASY]
# CI installs the tracking extra and sets POSTTRAIN_REQUIRE_TRACKERS=1, so that there a missing library fails these
# tests instead of skipping them.
MISSING = [name for name, packages in schema.TRACKERS.items() if not any(map(importlib.util.find_spec, packages))]
needs_trackers = pytest.mark.skipif(
    bool(MISSING) and not os.environ.get("POSTTRAIN_REQUIRE_TRACKERS"),
    reason=f"{', '.join(MISSING)} not installed (pip install 'posttrain[tracking]')")


def run(model, out, *extra, env=None, cwd=None):
    return subprocess.run([sys.executable, "-m", "posttrain", "run", *RUN, f"model.path={model}", f"output_dir={out}",
                           *map(str, extra), "-q"], capture_output=True, text=True, cwd=cwd, env={**os.environ, **env})


def private(root) -> dict:
    """The environment of a tracked run whose trackers write only under `root`: W&B offline and silent, its config,
    cache and data directories, trackio's database and HOME all there."""
    dirs = {key: root / key.lower() for key in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "TRACKIO_DIR",
                                                 "HOME")}
    for path in dirs.values():
        path.mkdir(parents=True)
    return {"WANDB_MODE": "offline", "WANDB_SILENT": "true", **{k: str(v) for k, v in dirs.items()}}


def metrics(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def per_tag(lines: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """metrics.jsonl as tag -> [(step, value), ...], as a tracker holds it."""
    out = {}
    for line in lines:
        for key, value in line.items():
            if key != "step":
                out.setdefault(key, []).append((line["step"], value))
    return out


def assert_same_scalars(scalars: dict[str, list[tuple[int, float]]], lines: list[dict]) -> None:
    """TensorBoard's scalars are metrics.jsonl's: the same tags, each at the same steps once, each value the line's
    rounded to float32 (a NaN equal to a NaN)."""
    expected = per_tag(lines)
    assert scalars.keys() == expected.keys()
    for tag, points in expected.items():
        assert [s for s, _ in scalars[tag]] == [s for s, _ in points], (tag, scalars[tag], points)
        f32 = [struct.unpack("f", struct.pack("f", v))[0] for _, v in points]
        assert all(a == b or math.isnan(a) and math.isnan(b) for (_, a), b in zip(scalars[tag], f32)), \
            (tag, scalars[tag], points)


def tfrecords(path):
    """The records of a TFRecord file: uint64 length, uint32 CRC of it, the data, uint32 CRC of the data."""
    data, pos = path.read_bytes(), 0
    while pos < len(data):
        (length,) = struct.unpack("<Q", data[pos:pos + 8])
        yield data[pos + 12:pos + 12 + length]
        pos += 12 + length + 4


def tensorboard_scalars(logdir):
    """Every scalar in the event files under `logdir`, as TensorBoard reads them: files in name order (they start with
    their time), and a SessionLog.START event at step s drops what was logged at steps ≥ s before it (TensorBoard's
    EventAccumulator, the purge a writer with purge_step=s asks for). Returns (tag -> [(step, value), ...], the raw
    (tag, step) pairs, the purge steps seen)."""
    if importlib.util.find_spec("tensorboardX"):
        from tensorboardX.proto.event_pb2 import Event, SessionLog
    else:
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog
    scalars, raw, purges = {}, [], []
    for path in sorted(logdir.rglob("events.out.tfevents.*"), key=lambda p: p.name):
        for record in tfrecords(path):
            event = Event.FromString(record)
            if event.HasField("session_log") and event.session_log.status == SessionLog.START:
                purges.append(event.step)
                scalars = {tag: [(s, v) for s, v in points if s < event.step] for tag, points in scalars.items()}
            for value in event.summary.value if event.HasField("summary") else ():
                if value.HasField("simple_value"):
                    scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
                    raw.append((value.tag, event.step))
    return scalars, raw, purges


def wandb_records(path):
    """The records of a .wandb transaction log: a 7-byte header (':W&B', 0xBEE1, version), then LevelDB's log format,
    32 KiB blocks of chunks (CRC, length, type: 1 full, 2 first, 3 middle, 4 last), each record a protobuf Record."""
    from wandb.proto.wandb_internal_pb2 import Record

    data, block = path.read_bytes(), 32768
    magic, ident, _ = struct.unpack("<4sHB", data[:7])
    assert (magic, ident) == (b":W&B", 0xBEE1), (magic, ident)
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            yield Record.FromString(pending)
            pending = b""


@pytest.fixture(scope="module")
def tracked(tiny_model_dir, tmp_path_factory):
    """One run that reports to all three trackers (eval.every=2: eval_accuracy on step 2 only)."""
    root = tmp_path_factory.mktemp("tracked")
    env, out = private(root / "private"), root / "grpo_tracked"
    proc = run(tiny_model_dir, out, "report_to=tensorboard,wandb,trackio", "eval.every=2", env=env, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Trackio" not in proc.stdout  # trackio prints to stdout; the run sends that to stderr (or, with -q, away)
    lines = metrics(out)
    assert [m["step"] for m in lines] == [1, 2, 3] and "eval_accuracy" in lines[1] and "eval_accuracy" not in lines[0]
    return out, env, lines


@needs_trackers
def test_tensorboard_holds_metrics_jsonl(tracked):
    out, _, lines = tracked
    scalars, raw, purges = tensorboard_scalars(out / "tensorboard")
    assert raw and purges == []  # a fresh run: nothing to purge
    assert_same_scalars(scalars, lines)
    [hparams] = (out / "tensorboard").rglob("hparams.yml")  # the config, flattened, beside the event files
    stored = yaml.safe_load(hparams.read_text())
    assert stored["report_to"] == "tensorboard,wandb,trackio" and stored["train.steps"] == 3
    assert stored["model.ref_path"] == "null" and stored["algorithm.name"] == "grpo"


@needs_trackers
def test_wandb_offline_run_holds_metrics_jsonl(tracked):
    out, env, lines = tracked
    [log] = (out / "wandb").glob("offline-run-*/run-*.wandb")  # inside the run directory, renamed with it
    history, stored, runs = {}, {}, []
    for record in wandb_records(log):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            history[record.history.step.num] = {k: v for k, v in items.items() if not k.startswith("_")}
        elif kind == "config":
            stored.update({item.key: json.loads(item.value_json) for item in record.config.update})
        elif kind == "run":
            runs.append(record.run)
    assert [(r.project, r.display_name) for r in runs][:1] == [("posttrain", "grpo_tracked")]
    assert history == {m["step"]: {k: v for k, v in m.items() if k != "step"} for m in lines}
    assert stored["train.lr"] == 2e-4 and stored["report_to"] == "tensorboard,wandb,trackio"
    assert not any(os.scandir(env["HOME"]))  # W&B wrote nothing into the (fake) home directory


@needs_trackers
def test_trackio_database_holds_metrics_jsonl(tracked):
    out, env, lines = tracked
    db = sqlite3.connect(os.path.join(env["TRACKIO_DIR"], "posttrain.db"))
    rows = db.execute("SELECT step, metrics FROM metrics WHERE run_name = ? ORDER BY step", (out.name,)).fetchall()
    assert {step: json.loads(values) for step, values in rows} == \
        {m["step"]: {k: v for k, v in m.items() if k != "step"} for m in lines}
    [(stored,)] = db.execute("SELECT config FROM configs WHERE run_name = ?", (out.name,)).fetchall()
    stored = json.loads(stored)
    assert stored["train.steps"] == 3 and "allow_val_change" not in stored  # accelerate's keyword is not a key


@needs_trackers
def test_resumed_run_continues_tensorboard_without_a_repeat(tiny_model_dir, tmp_path):
    """Killed after step 3 was logged (to TensorBoard too) but before it was saved, then resumed from step 2: the
    event files hold step 3 twice, and the resumed run's purge_step=3 makes TensorBoard show the second only."""
    env, out = private(tmp_path / "private"), tmp_path / "resumed"
    args = ["report_to=tensorboard", "train.save_every=1"]
    killed = run(tiny_model_dir, out, *args, env={**env, "POSTTRAIN_CRASH_AT": "step:3"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    resumed = run(tiny_model_dir, out, *args, "resume=true", env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    scalars, raw, purges = tensorboard_scalars(out / "tensorboard")
    assert purges == [3] and raw.count(("loss", 3)) == 2  # the repeat is there, and purged
    assert_same_scalars(scalars, metrics(out))
    assert all([s for s, _ in points] == [1, 2, 3] for points in scalars.values())


NONE = """
import sys
from posttrain.apps import cli
assert cli.main(sys.argv[1:]) == 0
print(sorted({m.split(".")[0] for m in sys.modules} & {"tensorboardX", "tensorboard", "wandb", "trackio"}))
"""


def test_report_to_none_writes_nothing_outside_output_dir(tiny_model_dir, tmp_path):
    """The default: a run leaves HOME, the working directory and TMPDIR (each empty, its own) as they were, writes
    only its own files, and imports no tracker library."""
    home, cwd, tmp, out = (tmp_path / name for name in ("home", "cwd", "tmp", "out"))
    for path in (home, cwd, tmp):
        path.mkdir()
    proc = subprocess.run([sys.executable, "-c", NONE, "run", *RUN, f"model.path={tiny_model_dir}", f"output_dir={out}",
                           "-q"], capture_output=True, text=True, cwd=cwd,
                          env={**os.environ, "HOME": str(home), "TMPDIR": str(tmp)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1] == "[]"
    assert {p.name for p in tmp_path.iterdir()} == {"home", "cwd", "tmp", "out"}
    assert [list(path.rglob("*")) for path in (home, cwd, tmp)] == [[], [], []]
    assert {p.name for p in out.iterdir()} == {"config.yaml", "metrics.jsonl", "summary.json", "model"}
    assert yaml.safe_load((out / "config.yaml").read_text())["report_to"] == "none"


@pytest.mark.parametrize("value, fragments", [
    ("tensorbord", ["report_to: unknown tracker 'tensorbord'; did you mean 'tensorboard'?",
                    "known: none, tensorboard, wandb, trackio"]),
    ("none,wandb", ["report_to: none names no tracker"]),
])
def test_bad_report_to_exits_2_with_one_line(tmp_path, value, fragments):
    assert_one_line_error(posttrain_here("run", "recipe=grpo_math", f"report_to={value}", f"output_dir={tmp_path / 'x'}"),
                          *fragments)


def test_a_missing_library_is_one_line_before_any_work(monkeypatch):
    found = importlib.util.find_spec

    def without(*absent):
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in absent else found(name, *a))

    without("wandb")
    with pytest.raises(ConfigError, match=re.escape("report_to: wandb needs wandb: pip install 'posttrain[tracking]'")):
        config.load("grpo_math", ["report_to=wandb"])
    without("tensorboardX", "tensorboard")
    with pytest.raises(ConfigError, match=re.escape("report_to: tensorboard needs tensorboardX or tensorboard: pip "
                                                    "install 'posttrain[tracking]'")):
        config.load("grpo_math", ["report_to=tensorboard"])
    without("tensorboard")  # either library will do
    if found("tensorboardX"):
        assert config.load("grpo_math", ["report_to=tensorboard"])[0].trackers == ("tensorboard",)


def test_names_and_hyperparameters():
    assert tracking.TRACKERS.keys() == schema.TRACKERS.keys()
    assert schema.RunConfig().trackers == ()
    assert schema.RunConfig(report_to="tensorboard, wandb,tensorboard").trackers == ("tensorboard", "wandb")
    assert tracking.hyperparameters({"a": {"b": None, "c": [1, "x"], "d": {"e": True}}, "f": 0.5, "g": "s"}) == \
        {"a.b": "null", "a.c": '[1, "x"]', "a.d.e": True, "f": 0.5, "g": "s"}


@pytest.mark.parametrize("jupyter, widgets, live", [(True, True, True), (True, False, False), (False, True, False)])
def test_the_bar_is_live_in_a_notebook_where_ipywidgets_is_there(monkeypatch, jupyter, widgets, live):
    """In a notebook (rich's Console says is_jupyter) the bar is rich's live one where ipywidgets can draw it, else
    the plain lines; stderr not a terminal and no notebook: plain lines (the CLI's output when piped, unchanged)."""
    from rich.console import Console

    monkeypatch.setattr(tracking, "Console", lambda stderr: Console(stderr=stderr, force_jupyter=jupyter,
                                                                    force_terminal=False))
    monkeypatch.setattr(tracking, "has_widgets", lambda: widgets)
    assert tracking.Progress(10).live is live
    assert tracking.Progress(10, enabled=False).live is False
