"""Environments for multi-turn rollouts: a registry like algorithms/ and rewards/ (docs/environments.md).

An environment answers each model turn (a tool's result, a game's next move) until the episode is done; the
trajectory is one token sequence whose environment tokens get a gradient coefficient of exactly 0.
"""

from posttrain.environments.base import (
    ENVIRONMENTS,
    POOL,
    Environment,
    FileClass,
    Reply,
    check,
    describe,
    get,
    given,
    pool_for,
    register,
    run_start,
    run_step,
    start_function,
    step_function,
)

__all__ = ["ENVIRONMENTS", "POOL", "Environment", "FileClass", "Reply", "check", "describe", "get", "given", "pool_for",
           "register", "run_start", "run_step", "start_function", "step_function"]

# The built-in environments register themselves on import.
from posttrain.environments import calculator, python  # noqa: E402,F401
