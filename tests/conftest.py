"""Shared fixtures: a tiny model directory built once, and a private warm-up cache for every test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"


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
