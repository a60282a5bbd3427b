"""The headline end to end: `posttrain run recipe=grpo_math` from an empty cache lifts held-out accuracy.

Marked slow (2 to 5 minutes on 2 CPU cores, by CPU class: README's table): `python -m pytest -m slow`.
"""

import json

import pytest
from cli_helpers import posttrain


@pytest.mark.slow
def test_grpo_math_lifts_accuracy_by_20_points(tmp_path):
    out = tmp_path / "grpo"
    proc = posttrain("run", "recipe=grpo_math", f"output_dir={out}", f"warmup.cache_dir={tmp_path / 'cache'}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["warmup"]["cached"] is False
    assert summary["eval_after"]["accuracy"] - summary["eval_before"]["accuracy"] >= 0.20
