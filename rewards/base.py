"""The reward registry and the weighted combinator; `posttrain.rewards` re-exports them."""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Mapping, Sequence
from numbers import Real

from posttrain.core.errors import ConfigError

RewardFn = Callable[[Sequence[str], Sequence[str], Sequence[str]], list[float]]
REWARDS: dict[str, RewardFn] = {}


def register(name: str) -> Callable[[RewardFn], RewardFn]:
    """Function decorator adding a reward under `name`; a second reward with the same name is an error."""

    def add(fn: RewardFn) -> RewardFn:
        if name in REWARDS:
            raise ValueError(f"reward {name!r} is registered twice ({REWARDS[name].__module__}, {fn.__module__})")
        REWARDS[name] = fn
        return fn

    return add


def get(name: str) -> RewardFn:
    """The reward registered as `name`; an unknown name is a ConfigError suggesting the nearest known one."""
    if name not in REWARDS:
        near = difflib.get_close_matches(str(name), REWARDS, n=1)
        hint = f"did you mean {near[0]!r}? " if near else ""
        raise ConfigError(f"reward {name!r} is unknown; {hint}known: {', '.join(sorted(REWARDS))}")
    return REWARDS[name]


def combine(
    weights: Mapping[str, float],
) -> Callable[[Sequence[str], Sequence[str], Sequence[str]], tuple[list[float], dict[str, list[float]]]]:
    """A callable giving `(total, parts)`: total[i] = Σ_name weights[name] · parts[name][i].

    Args:
        weights: reward name -> weight. Negative weights are penalties; every weight must be a finite number.

    Raises:
        ConfigError: `weights` is empty, names an unknown reward, or holds a weight that is not a finite number.
    """
    if not weights:
        raise ConfigError("rewards: no reward named; give at least one, e.g. {accuracy: 1.0}")
    # Validate once, here, so a bad recipe fails before the first rollout rather than mid-training.
    fns = {}
    for name in weights:
        try:
            fns[name] = get(name)
        except ConfigError as err:
            raise ConfigError(f"rewards.{name}: {err}") from None
    for name, w in weights.items():
        # bool is a Real subclass, but `accuracy: true` is a typo for a weight, not a weight.
        if isinstance(w, bool) or not isinstance(w, Real) or not math.isfinite(w):
            raise ConfigError(f"rewards.{name}: weight must be a finite number, got {w!r}")
    scale = {name: float(w) for name, w in weights.items()}

    def score(completions: Sequence[str], answers: Sequence[str],
              prompts: Sequence[str]) -> tuple[list[float], dict[str, list[float]]]:
        parts = {name: [float(s) for s in fn(completions, answers, prompts)] for name, fn in fns.items()}
        for name, scores in parts.items():
            if len(scores) != len(completions):
                raise ValueError(f"reward {name!r} gave {len(scores)} scores for {len(completions)} completions")
        total = [sum(scale[name] * parts[name][i] for name in fns) for i in range(len(completions))]
        return total, parts

    return score
