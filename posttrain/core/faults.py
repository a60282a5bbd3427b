"""Fault injection for the kill tests and bench/kill_resume.py: a SIGKILL at an exact point of a run."""

from __future__ import annotations

import os
import signal


def crash_point(name: str, step: int) -> None:
    """Kills this process with SIGKILL when $POSTTRAIN_CRASH_AT is `name:step`, so that a kill lands at an exact
    point: `checkpoint` (inside a checkpoint write), `step` (a step logged, its checkpoint not written), `request`
    (the N-th sampling request sent to rollout workers, prompts in flight), `push` (weight version N half pushed)."""
    if os.environ.get("POSTTRAIN_CRASH_AT") == f"{name}:{step}":
        os.kill(os.getpid(), signal.SIGKILL)
