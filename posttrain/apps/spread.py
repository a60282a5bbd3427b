"""Figures over seeds: the same run repeated with `seeds=N` in `posttrain compare`, and what its spread allows one
to say.

`Spread` holds one figure's value for each seed, in seed order, and reads as "mean ± sd" (sd the sample standard
deviation, n − 1 in the denominator). Arithmetic pairs seeds: (after − before) of two Spreads is the change of each
seed, then its mean and sd, not the difference of two means with their sds added. `over_seeds` turns the `numbers()`
of N runs into one such tree: a figure that is equal in every run (a step count, the bytes of a weight) stays a
plain number, one that varies becomes a Spread. Curves are matched by step.

A difference between two recipes *exceeds the spread* when |mean_a − mean_b| > sd_a + sd_b: the two ± bars do not
overlap. With 3 seeds that is a rough screen, not a significance test. It is the bar docs/variants.md and
docs/reproduction.md use.
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
import statistics
from dataclasses import dataclass


@functools.total_ordering
@dataclass(frozen=True, eq=False)
class Spread:
    values: tuple[float, ...]  # one per seed, in seed order

    @property
    def mean(self) -> float:
        return statistics.fmean(self.values)

    @property
    def sd(self) -> float:
        return statistics.stdev(self.values) if len(self.values) > 1 else 0.0

    def __format__(self, spec: str) -> str:
        if spec.endswith("d"):  # an integer figure (steps) that differs between seeds: its mean to one decimal
            spec = spec[:-1] + ".1f"
        mean = round(self.mean, 12) + 0.0  # no "-0.000" for a difference that is zero but for rounding
        return f"{format(mean, spec)} ± {format(self.sd, spec.replace('+', ''))}"

    def __float__(self) -> float:
        return self.mean

    def _op(self, other, fn) -> Spread:
        if isinstance(other, Spread):
            return Spread(tuple(fn(a, b) for a, b in zip(self.values, other.values, strict=True)))
        return Spread(tuple(fn(a, other) for a in self.values))

    def __add__(self, other):
        return self._op(other, operator.add)

    def __radd__(self, other):
        return self._op(other, lambda a, b: b + a)

    def __sub__(self, other):
        return self._op(other, operator.sub)

    def __rsub__(self, other):
        return self._op(other, lambda a, b: b - a)

    def __truediv__(self, other):
        return self._op(other, operator.truediv)

    def __mul__(self, other):
        return self._op(other, operator.mul)

    __rmul__ = __mul__

    def __neg__(self) -> Spread:
        return Spread(tuple(-v for v in self.values))

    def __eq__(self, other) -> bool:  # comparisons are of the means: a figure against a bound
        return self.mean == float(other) if isinstance(other, (Spread, int, float)) else NotImplemented

    def __lt__(self, other) -> bool:
        return self.mean < float(other)

    def __hash__(self) -> int:
        return hash(self.values)

    def as_json(self) -> dict:
        return {"mean": self.mean, "sd": self.sd, "values": list(self.values)}


def mean_of(x) -> float | None:
    """The plain number of a figure: a Spread's mean, a number as it is."""
    return None if x is None else float(x)


def sd_of(x) -> float:
    return x.sd if isinstance(x, Spread) else 0.0


def over_seeds(runs: list[dict]) -> dict:
    """One `numbers()` tree from several: equal numbers stay, differing ones become Spreads, a figure missing from
    some run becomes None; `curve` points are matched by step (a step not in every run is left out)."""
    if len(runs) == 1:
        return runs[0]
    return _merge(runs)


def _merge(values: list):
    first = values[0]
    if any(v is None for v in values):
        return None
    if isinstance(first, dict):
        keys = dict.fromkeys(k for v in values for k in v)
        return {k: (_curve if k == "curve" else _merge)([v.get(k) for v in values]) for k in keys}
    if isinstance(first, bool) or not isinstance(first, (int, float)):
        return first
    if all(v == first for v in values):
        return first
    return Spread(tuple(float(v) for v in values))


def _curve(curves: list) -> list | None:
    if any(c is None for c in curves):
        return None
    by_step = [{p["step"]: p for p in c} for c in curves]
    steps = [s for s in by_step[0] if all(s in c for c in by_step)]
    return [_merge([c[s] for c in by_step]) for s in steps]


def beyond(a, b) -> bool:
    """Whether two figures differ by more than their spread: |mean_a − mean_b| > sd_a + sd_b."""
    return abs(mean_of(a) - mean_of(b)) > sd_of(a) + sd_of(b)


def verdicts(figures: dict[str, object]) -> list[tuple[str, str, float, float, bool]]:
    """(a, b, mean_b − mean_a, sd_a + sd_b, beyond) for every pair of recipes, in the order given."""
    out = []
    for (a, x), (b, y) in itertools.combinations(figures.items(), 2):
        if x is None or y is None or math.isnan(mean_of(x)) or math.isnan(mean_of(y)):
            continue
        out.append((a, b, mean_of(y) - mean_of(x), sd_of(x) + sd_of(y), beyond(x, y)))
    return out
