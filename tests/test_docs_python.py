"""docs/python.md's examples, run as printed: every ```python block of the page, in order, as one script (piped to
`python -`, as a notebook's cells run in one interpreter), in a fresh directory."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

PAGE = Path(__file__).resolve().parent.parent / "docs" / "python.md"


def blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.S)


def test_the_pages_examples_run_as_printed(tmp_path):
    code = blocks()
    assert len(code) >= 4
    script = "\n".join(code)
    proc = subprocess.run([sys.executable, "-"], input=script, capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = [line for line in proc.stdout.splitlines() if "[WARNING]" not in line]  # DeepSpeed's, on importing it
    assert re.fullmatch(r"0\.\d+ -> 0\.\d+", out[0]), proc.stdout  # the first example's before and after
    steps = [line for line in out if re.fullmatch(r"\d+ -?[\d.]+ -?[\d.e-]+", line)]
    assert [int(line.split()[0]) for line in steps] == list(range(1, 11))
    assert any(line.startswith("halfway: ") for line in out)
    loop = [line for line in out if re.fullmatch(r"\d+ -?[\d.]+ -?[\d.e-]+ [\d.]+", line)]
    assert [int(line.split()[0]) for line in loop] == [1, 2, 3, 4, 5]
    assert json.loads((tmp_path / "runs" / "python_loop" / "summary.json").read_text())["steps"] == 5
    assert (tmp_path / "runs" / "python_loop_state" / "manifest.json").is_file()
    assert json.loads((tmp_path / "runs" / "python_own_loss" / "summary.json").read_text())["steps"] == 3
    own = [line.split() for line in out if line.startswith("own loss ")]
    assert [int(words[2]) for words in own] == [0, 1, 2] and all(float(words[4]) > 0 for words in own)
    for run in ("python_grpo", "python_steps", "python_brevity", "python_rows"):
        summary = json.loads((tmp_path / "runs" / run / "summary.json").read_text())
        assert summary["steps"] == 10, run
    brevity = [json.loads(line) for line in (tmp_path / "runs" / "python_brevity" / "metrics.jsonl").open()]
    assert all("reward/brevity" in m for m in brevity)
    assert "name: python:Guess" in (tmp_path / "runs" / "python_env" / "config.yaml").read_text()
    episodes = [json.loads(line) for line in (tmp_path / "runs" / "python_env" / "metrics.jsonl").open()]
    assert len(episodes) == 3 and all(m["env/turns"] >= 1 and m["env/errors"] == 0 for m in episodes)
    config = (tmp_path / "runs" / "python_rows" / "config.yaml").read_text()
    assert "path: python:data" in config
    assert json.loads((tmp_path / "runs" / "python_rows" / "summary.json").read_text())["eval_after"]["num_problems"] == 40
