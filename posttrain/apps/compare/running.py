"""Running a plan: each run is `python -m posttrain run` in its own process, one after another, so that wall times and
peak memory do not mix; its output reaches our stderr line by line, tagged with the run's name (and seed)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from posttrain.apps.compare.planning import Plan
from posttrain.core.errors import UserError


class RunFailed(Exception):
    """A run that exited with a non-zero status; `last_line` is the last thing it printed (its error, as a rule)."""

    def __init__(self, name: str, code: int, last_line: str):
        super().__init__(f"{name}: the run failed (exit status {code}): {last_line}")
        self.name, self.code, self.last_line = name, code, last_line


def run_one(name: str, recipe: str, plan: Plan, tag: str, out: Path | None = None, extra: tuple = ()) -> None:
    """One `posttrain run` in its own process, into `out` (default output_dir/name), with the plan's overrides and
    `extra`; its output goes to our stderr, one line at a time, tagged."""
    cmd = [sys.executable, "-m", "posttrain", "run", f"recipe={recipe}", *plan.overrides, *extra,
           f"output_dir={out or plan.out / name}", "overwrite=true"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    last = ""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        for line in proc.stdout:
            line = line.split("\r")[-1].strip()  # a progress bar redraws with \r: keep what it shows last
            if line:
                last = line.removeprefix("posttrain: error: ")
                print(f"{tag} {line}", file=sys.stderr, flush=True)
        proc.wait()
    finally:
        if proc.poll() is None:  # interrupted: do not leave the run behind
            proc.terminate()
            proc.wait()
        proc.stdout.close()
    if proc.returncode:
        raise RunFailed(name, proc.returncode, last or "(no output)")


def run_all(plan: Plan) -> None:
    """Every run of `plan`, recipe by recipe and seed by seed, each announced on stderr with its place in the queue.

    Raises:
        UserError: a run refused its input (exit status 2), named by its recipe.
        RunFailed: a run failed otherwise, named by its recipe and seed; the runs after it are not started.
    """
    todo = [(name, recipe, out, extra) for name, recipe in plan.recipes.items() for out, extra in plan.runs(name)]
    for i, (name, recipe, out, extra) in enumerate(todo, 1):
        what = f"{name}, {extra[0]}" if extra else name
        print(f"posttrain compare: running {what} ({i}/{len(todo)}) into {out}", file=sys.stderr)
        try:
            run_one(name, recipe, plan, f"[{what}]", out, tuple(extra))
        except RunFailed as err:
            if err.code == 2:
                raise UserError(f"{name}: the run refused its input: {err.last_line}") from None
            raise RunFailed(what, err.code, err.last_line) from None
