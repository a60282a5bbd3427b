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


def posttrain_here(*args, cwd=None) -> subprocess.CompletedProcess:
    """`posttrain *args` run in this process (no interpreter or torch start-up: milliseconds, not seconds), with the
    same exit status and captured output as `posttrain()`. An exception the CLI does not turn into a one-line error
    propagates: that is the traceback a user would see. For bad input refused before any work; a run that trains or
    spawns processes belongs in `posttrain()`."""
    import contextlib
    import io

    from posttrain.apps.cli import main
    from posttrain.backends import ddp

    out, err = io.StringIO(), io.StringIO()
    before, exit_process = os.getcwd(), ddp.exit_process
    ddp.exit_process = lambda code: None  # after an in-process run made a process group, `main` would end pytest
    try:
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main([str(a) for a in args])
            except SystemExit as exit_:  # argparse's own errors
                code = exit_.code if isinstance(exit_.code, int) else 1
    finally:
        os.chdir(before)
        ddp.exit_process = exit_process
    return subprocess.CompletedProcess(["posttrain", *map(str, args)], code, out.getvalue(), err.getvalue())
