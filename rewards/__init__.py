"""Rewards: a registry of scoring functions and a weighted combinator.

A reward function takes `(completions, answers, prompts)`, one reference answer and one prompt text per completion,
and returns one float per completion. Recipes name rewards with weights, e.g. `{"accuracy": 1.0, "format": 0.5}`;
`combine` turns that mapping into one callable that returns the weighted total and each reward's raw scores (logged as
metrics). `posttrain.judge.Judge` is what the rest of posttrain calls: it adds a reward model and the verdicts.
"""

from posttrain.rewards.base import REWARDS, RewardFn, combine, get, register

__all__ = ["REWARDS", "RewardFn", "combine", "get", "register"]

# The built-in rewards register themselves on import.
from posttrain.rewards import accuracy, format  # noqa: E402,F401
