"""Test helpers for the real command line: `posttrain ...` in a fresh process, and the one-line error it must give
for bad input."""

from __future__ import annotations

import os
import subprocess
import sys


def posttrain(*args, cwd=None) -> subprocess.CompletedProcess:
    """`python -m posttrain *args`, output captured, at 120 columns so progress lines are not cut differently per
    terminal."""
    return subprocess.run([sys.executable, "-m", "posttrain", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env={**os.environ, "COLUMNS": "120"})


def assert_one_line_error(proc: subprocess.CompletedProcess, *fragments: str) -> None:
    """Bad input: exit status 2 and a single `posttrain: error: ...` line on stderr holding every fragment."""
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("posttrain: error: "), proc.stderr
    for fragment in fragments:
        assert fragment in lines[0]
