"""The reward registry and the weighted combinator; `posttrain.rewards` re-exports them."""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from numbers import Real

from posttrain.core.errors import ConfigError
from posttrain.core.registry import Registry

RewardFn = Callable[[Sequence[str], Sequence[str], Sequence[str]], list[float]]
REWARDS = Registry("reward", "rewards")  # name -> reward function


register, get = REWARDS.register, REWARDS.find


def combine(
    weights: Mapping[str, float], answer_format: str = "number",
) -> Callable[[Sequence[str], Sequence[str], Sequence[str]], tuple[list[float], dict[str, list[float | None]]]]:
    """A callable giving `(total, parts)`: total[i] = Σ_name weights[name] · parts[name][i].

    A reward that could not score a completion (its check raised or ran out of time) gives None there: it counts as
    0 in the total and stays None in `parts`, so the caller can count it.

    Args:
        weights: reward name -> weight. Negative weights are penalties; every weight must be a finite number.
        answer_format: `data.answer_format`, passed to the rewards that take it as a keyword (accuracy does).

    Raises:
        ConfigError: `weights` is empty, names an unknown reward, or holds a weight that is not a finite number.
    """
    if not weights:
        raise ConfigError("rewards: no reward named; give at least one, e.g. {accuracy: 1.0}")
    # Validate once, here, so a bad recipe fails before the first rollout rather than mid-training.
    fns = {name: REWARDS.find(name, key=f"rewards.{name}") for name in weights}
    for name, w in weights.items():
        # bool is a Real subclass, but `accuracy: true` is a typo for a weight, not a weight.
        if isinstance(w, bool) or not isinstance(w, Real) or not math.isfinite(w):
            raise ConfigError(f"rewards.{name}: weight must be a finite number, got {w!r}")
    scale = {name: float(w) for name, w in weights.items()}
    context = {name: {"answer_format": answer_format} if "answer_format" in inspect.signature(fn).parameters else {}
               for name, fn in fns.items()}

    def score(completions: Sequence[str], answers: Sequence[str],
              prompts: Sequence[str]) -> tuple[list[float], dict[str, list[float | None]]]:
        parts = {name: [None if s is None else float(s) for s in fn(completions, answers, prompts, **context[name])]
                 for name, fn in fns.items()}
        for name, scores in parts.items():
            if len(scores) != len(completions):
                raise ValueError(f"reward {name!r} gave {len(scores)} scores for {len(completions)} completions")
        total = [sum(scale[name] * (parts[name][i] or 0.0) for name in fns) for i in range(len(completions))]
        return total, parts

    return score
