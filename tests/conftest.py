"""Shared fixtures: a tiny model directory built once, and a private warm-up cache for every test session."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from posttrain.apps.cli import prepare_process

FIXTURES = Path(__file__).parent / "fixtures"

# Ray, the `ray` extra (rollout.launcher=ray): its tests skip without it, and POSTTRAIN_REQUIRE_RAY=1 (.ci/run, both
# lanes) turns the skip into a failure
HAVE_RAY = importlib.util.find_spec("ray") is not None
if not HAVE_RAY and os.environ.get("POSTTRAIN_REQUIRE_RAY") == "1":
    raise RuntimeError("POSTTRAIN_REQUIRE_RAY=1 but ray is not importable in this environment")
needs_ray = pytest.mark.skipif(not HAVE_RAY, reason="ray is not installed (pip install 'posttrain[ray]')")

# What every command sets in its own process, set here once, before any test: a test that runs the CLI in this
# process (`posttrain_here`) would otherwise set it midway, and `posttrain()` could no longer fork its commands
# (tests/cli_helpers.py forks only under the environment its zygote started with).
prepare_process()


@pytest.fixture(autouse=True)
def _environment_restored():
    """A test's changes to os.environ (its own, or those of code it runs in this process) end with it."""
    before = dict(os.environ)
    yield
    if os.environ != before:
        os.environ.clear()
        os.environ.update(before)


def pytest_terminal_summary(terminalreporter):
    """How the session's `posttrain()` commands ran: forked, or in new interpreters and why."""
    from cli_helpers import Zygote

    if Zygote.served or Zygote.fresh:
        why = f" (the environment differed in {', '.join(sorted(Zygote.differed))})" if Zygote.differed else ""
        terminalreporter.write_line(f"posttrain(): {Zygote.served} commands forked, {Zygote.fresh} in a new "
                                    f"interpreter{why}")


@pytest.fixture(scope="session", autouse=True)
def _private_cache(tmp_path_factory):
    """Warm-ups made by tests go to a temporary cache, never the user's."""
    os.environ["POSTTRAIN_CACHE"] = str(tmp_path_factory.mktemp("cache"))
    os.environ["HF_HUB_OFFLINE"] = "1"
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A randomly initialised two-layer Llama with the character tokenizer, saved as a HF directory."""
    from posttrain.models.embedded import build_model_dir

    return build_model_dir(tmp_path_factory.mktemp("tiny") / "model", hidden=32, layers=2, heads=2)


@pytest.fixture(scope="session")
def gsm8k_rows():
    from posttrain.data import read_rows

    return read_rows(FIXTURES / "gsm8k" / "test_head.jsonl")


@pytest.fixture(scope="session")
def warm_model_dir(tmp_path_factory) -> Path:
    """A tiny model given a short SFT on easy problems (a±b), so that its samples are sometimes right and sometimes
    wrong: what RFT and DPO need to build their data."""
    from posttrain import config
    from posttrain.models.embedded import build_model_dir
    from posttrain.train import run

    root = tmp_path_factory.mktemp("warm")
    init = build_model_dir(root / "init", hidden=64, layers=2, heads=2)
    cfg, resolved = config.load("sft_math", [f"model.path={init}", f"output_dir={root / 'run'}", "data.difficulty=1",
                                             "data.train_size=150", "data.test_size=20", "train.steps=120",
                                             "train.lr=3e-3", "eval.num_problems=0"])
    run(cfg, resolved, quiet=True)
    return root / "run" / "model"


EASY = ["data.difficulty=1", "data.train_size=150", "data.test_size=20"]


@pytest.fixture(scope="session")
def colocated(warm_model_dir, tmp_path_factory):
    """tests/test_async.py's short GRPO run as it has always run, sampling in the training process: the bytes that
    the runs through rollout workers (local processes, Ray actors) must match at max_staleness 0."""
    from test_async import run, summary, weights

    out = tmp_path_factory.mktemp("colocated") / "out"
    proc = run(warm_model_dir, out)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert summary(out)["placement"] == "colocated"
    return weights(out)
