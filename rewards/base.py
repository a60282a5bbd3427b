"""The reward registry and the weighted combinator, which runs every reward call in a worker pool.

Isolation. `combine`'s callable scores each (reward, completion) pair as one item of `POOL`, a
`posttrain.core.bounded.BoundedPool`: in parallel across its worker processes, each call within `rewards.timeout_s`
seconds, so a reward that crashes or hangs costs that one sample's score, never the batch or the run. A call
that raises, runs out of time or gives a non-finite score scores 0 there and is counted. Built-in and custom rewards
are treated alike, one completion per item: on the embedded GRPO recipe (256 completions a step, the accuracy rule)
that costs about 20 ms a step, under 1% of it, so batching the cheap built-ins was not worth a second rule.
Model output is only ever data to a reward; nothing here evaluates it.

What is counted, per call of the callable (the judge logs each as `reward/<kind>`):

- `verify_errors`: the reward returned None, "could not score" (the accuracy rule's math check raised);
- `errors`: the call raised, returned something other than one number or None, or its worker died;
- `timeouts`: the call outlasted `rewards.timeout_s` (its worker is killed and replaced);
- `nonfinite`: the call returned nan or ±inf.

A reward that raises posttrain's own `UserError` (the accuracy rule on a reference holding no number) stops the run
with that one-line error instead: bad data is not a sample's failure.
"""

from __future__ import annotations

import inspect
import math
import pickle
import warnings
from collections.abc import Callable, Mapping, Sequence
from numbers import Real
from typing import TYPE_CHECKING, NamedTuple

from posttrain.core.bounded import BoundedPool, Outcome
from posttrain.core.errors import ConfigError, UserError
from posttrain.core.registry import Registry
from posttrain.rewards import custom

if TYPE_CHECKING:
    from posttrain.schema import RewardsConfig

RewardFn = Callable[[Sequence[str], Sequence[str], Sequence[str]], list[float | None]]
Scorer = Callable[[Sequence[str], Sequence[str], Sequence[str]], "Scores"]  # what `combine` returns
REWARDS = Registry("reward", "rewards")  # name -> reward function
POOL = BoundedPool()  # every reward call runs here; its workers start on the first call and persist
COUNTS = ("verify_errors", "errors", "timeouts", "nonfinite")  # how a score can be missing, as the module lists


register, get = REWARDS.register, REWARDS.find


class Scores(NamedTuple):
    """What `combine`'s callable returns for n completions."""

    total: list[float]  # [n] Σ weight · score, a missing score counting 0
    parts: dict[str, list[float | None]]  # reward name -> [n] its scores, None where missing
    counts: dict[str, int]  # each of COUNTS -> how many scores went missing that way


class _Calls:
    """What `POOL` runs: one reward, by name, on one completion `(name, completion, answer, prompt)`.

    A worker unpickles it once, as it starts, outside every call's bound (`posttrain.core.bounded`, rule 3); that is
    when each reward's optional `warm(**context)` runs, importing what the reward needs (a custom file, math-verify),
    so that no call pays an import against its bound.
    """

    def __init__(self, fns: dict[str, RewardFn], context: dict[str, dict]) -> None:
        self.fns, self.context = fns, context

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        for name, fn in self.fns.items():
            try:
                getattr(fn, "warm", lambda **_: None)(**self.context[name])
            except Exception:  # the reward's own calls will fail the same way, and be counted
                pass

    def __call__(self, item: tuple[str, str, str, str]) -> float | None | UserError:
        """The reward's score as a float, None (could not score), or a UserError to stop the run."""
        name, completion, answer, prompt = item
        try:
            scores = list(self.fns[name]([completion], [answer], [prompt], **self.context[name]))
        except UserError as err:  # handed back to stop the run (module docstring)
            return err
        if len(scores) != 1:
            raise ValueError(f"gave {len(scores)} scores for 1 completion")
        return None if scores[0] is None else float(scores[0])


def _missing(outcome: Outcome) -> str | None:
    """Which of COUNTS an outcome is, or None when it is a score."""
    if outcome.timed_out:
        return "timeouts"
    if not outcome.ok:
        return "errors"
    if outcome.value is None:
        return "verify_errors"
    return None if math.isfinite(outcome.value) else "nonfinite"


def _weight(w, key: str) -> float:
    # bool is a Real subclass, but `accuracy: true` is a typo for a weight, not a weight.
    if isinstance(w, bool) or not isinstance(w, Real) or not math.isfinite(w):
        raise ConfigError(f"{key}: weight must be a finite number, got {w!r}")
    return float(w)


def combine(cfg: RewardsConfig, answer_format: str = "number") -> Scorer:
    """A callable giving `Scores` for lists (completions, answers, prompts): total[i] = Σ_name w[name] · parts[name][i].

    Every reward call runs in `POOL`, one completion per item (module docstring); a missing score counts 0 in the
    total, stays None in `parts` and is counted in `counts`.

    Args:
        cfg: the `rewards` group: registered rewards by name -> weight, custom functions by `path.py:function` ->
            weight (named `<file stem>.<function>` in `parts`), and the bound on each call.
        answer_format: `data.answer_format`, passed to the rewards that take it as a keyword (accuracy does).

    Raises:
        ConfigError: naming the key, when no reward is named, a name is unknown, a weight is not a finite number, or a
            custom entry's file or function cannot be loaded.
    """
    if not cfg.weights and not cfg.custom:
        raise ConfigError("rewards: no reward named; give at least one, e.g. {accuracy: 1.0}")
    # Validate once, here, so a bad recipe fails before the first rollout rather than mid-training.
    fns = {name: REWARDS.find(name, key=f"rewards.{name}") for name in cfg.weights}
    scale = {name: _weight(w, f"rewards.{name}") for name, w in cfg.weights.items()}
    for entry, w in cfg.custom.items():
        key = f"rewards.custom.{entry}"
        weight, fn = _weight(w, key), custom.load(entry)
        if fn.label in fns:
            raise ConfigError(f"{key}: another reward is already named {fn.label!r}; rename the file or the function")
        fns[fn.label], scale[fn.label] = fn, weight
    for name, fn in fns.items():  # each is sent to the workers by reference: a lambda or closure cannot be
        try:
            pickle.dumps(fn)
        except Exception:  # pickle raises several types for the same reason
            raise ConfigError(f"rewards.{name}: the function cannot be sent to a reward worker; define it at the top "
                              "level of an importable module (not a lambda, a closure or __main__)") from None
    calls = _Calls(fns, {name: {"answer_format": answer_format} if "answer_format" in _parameters(fn) else {}
                         for name, fn in fns.items()})  # one object, so each worker loads it once (bounded.py, 4)
    warned: set[tuple[str, str]] = set()

    def score(completions: Sequence[str], answers: Sequence[str], prompts: Sequence[str]) -> Scores:
        n = len(completions)
        if len(answers) != n or len(prompts) != n:
            raise ValueError(f"{n} completions for {len(answers)} answers and {len(prompts)} prompts")
        jobs = [(name, i) for name in fns for i in range(n)]
        outcomes = POOL.map(calls, [(name, completions[i], answers[i], prompts[i]) for name, i in jobs], cfg.timeout_s)
        parts: dict[str, list[float | None]] = {name: [None] * n for name in fns}
        counts = dict.fromkeys(COUNTS, 0)
        for (name, i), outcome in zip(jobs, outcomes, strict=True):
            if isinstance(outcome.value, UserError):
                raise outcome.value
            kind = _missing(outcome)
            if kind is None:
                parts[name][i] = outcome.value
                continue
            counts[kind] += 1
            if kind != "verify_errors" and (name, kind) not in warned:  # once per reward and kind: what went wrong
                warned.add((name, kind))
                warnings.warn(f"reward {name!r}: {outcome.error or f'gave {outcome.value}'}; that sample scores 0 "
                              f"(counted in reward/{kind}, reported once)", RuntimeWarning, stacklevel=2)
        total = [sum(scale[name] * (parts[name][i] or 0.0) for name in fns) for i in range(n)]
        return Scores(total, parts, counts)

    return score


def _parameters(fn) -> Mapping[str, inspect.Parameter]:
    """The parameters of a reward function (of the function in the file, for a custom one)."""
    return inspect.signature(fn.function() if isinstance(fn, custom.FileFunction) else fn).parameters
