"""Rewards: a registry of scoring functions, your own functions by file path, and a weighted combinator.

A reward function takes `(completions, answers, prompts)`, one reference answer and one prompt text per completion,
and returns one float per completion (None: could not score). Recipes name rewards with weights, e.g.
`{"accuracy": 1.0, "format": 0.5}`, and add their own with `custom: {path/to/file.py:function: 0.5}`
(`posttrain.rewards.custom`). `combine` turns the `rewards` group into one callable that returns the weighted total,
each reward's raw scores (logged as metrics) and how many scores went missing. It runs every call in a worker process,
one completion at a time, within `rewards.timeout_s`: a reward that raises, hangs or gives nan costs that sample's
score (0, and counted), never the run. `posttrain.judge.Judge` is what the rest of posttrain calls: it adds a reward
model and the verdicts.
"""

from posttrain.rewards.base import REWARDS, RewardFn, Scores, combine, get, register

__all__ = ["REWARDS", "RewardFn", "Scores", "combine", "get", "register"]

# The built-in rewards register themselves on import.
from posttrain.rewards import accuracy, format  # noqa: E402,F401
