"""How hard each prompt is for the current policy: its running pass rate, and group sizes set from it.

`PassRates` keeps, for every prompt the run has sampled, an exponential moving average of the share of its samples
the judge found correct: s ← s + α(p − s) with p the pass rate of its newest group and α = 1/2 (the first group sets
s = p). The policy changes as it trains, so older groups count less: a group k draws back weighs 2^−k. The curriculum
(`data.curriculum=pass_rate`) and per-difficulty group sizes read it; checkpoints save it.

`group_sizes` gives each prompt of a step its own G (`rollout.adaptive_group_size`), within the step's budget of
samples. A group teaches only if its rewards differ; with right-or-wrong rewards a group with no correct sample has
zero group-relative advantage everywhere. A prompt of pass rate s gets the smallest G in [G_min, G_max] whose group
holds a correct sample with probability at least q (`rollout.group_size_target`):

    G(s) = min { g ∈ [G_min, G_max] : 1 − (1 − s)^g ≥ q },  G_max when none is.

With q = 0.9 and [4, 8]: s ≥ 0.44 gets 4, s = 0.3 gets 7, s ≤ 0.25 gets 8: the seed's "4 for easy, 6–8 for hard".
A prompt never sampled gets the configured `group_size`. The sizes are then scaled in proportion to sum to the step's
budget, batch_size × group_size: exactly as many samples as with a fixed G, so every process samples and trains as
many rows. A size the scaling takes past G_min or G_max is held there and the others are scaled again; the results
are rounded by largest remainder (ties: the harder prompt), which keeps a harder prompt's G at least an easier one's.
The easy side is not symmetric on purpose: a group of a prompt the policy nearly always solves also tends to have
equal rewards, but there is little left to learn from it, so its samples go to the hard prompts instead.
"""

from __future__ import annotations

import math

from posttrain.core.errors import ConfigError

ALPHA = 0.5  # weight of the newest group in the moving average


def tracks_pass_rates(cfg) -> bool:
    """Whether a run keeps each prompt's running pass rate: for per-difficulty group sizes or the pass-rate
    curriculum (the judge's verdicts on the training rows update it)."""
    return cfg.rollout.adaptive_group_size or cfg.data.curriculum == "pass_rate"


class PassRates:
    """Running pass rate per prompt, keyed by the prompt's text (`data.prompt_field`)."""

    def __init__(self, field: str):
        self.field = field
        self.rates: dict[str, float] = {}

    def key(self, row: dict) -> str:
        return str(row[self.field])

    def get(self, row: dict) -> float | None:
        """The row's running pass rate, or None for a prompt not sampled yet."""
        return self.rates.get(self.key(row))

    def observe(self, rows: list[dict], correct: list[bool]) -> None:
        """Adds one sample set: `rows[i]` is the prompt of sample i, `correct[i]` the judge's verdict on it."""
        passed: dict[str, list[int]] = {}
        for row, ok in zip(rows, correct, strict=True):
            passed.setdefault(self.key(row), []).append(int(ok))
        for key, hits in passed.items():
            p = sum(hits) / len(hits)
            old = self.rates.get(key)
            self.rates[key] = p if old is None else old + ALPHA * (p - old)

    def state_dict(self) -> dict:
        return {"rates": dict(self.rates)}

    def load_state_dict(self, state: dict) -> None:
        self.rates = dict(state["rates"])


def wanted_size(rate: float, low: int, high: int, target: float) -> int:
    """G(s): the smallest group size in [low, high] that holds a correct sample with probability ≥ target."""
    if rate >= 1.0:
        return low
    if rate <= 0.0:
        return high
    g = math.ceil(math.log(1.0 - target) / math.log(1.0 - rate) - 1e-9)  # (1 − s)^g ≤ 1 − q
    return min(max(g, low), high)


def group_sizes(rates: list[float | None], *, size: int, low: int, high: int, target: float) -> list[int]:
    """Each prompt's G from its pass rate (None: not seen, `size`), scaled to sum to len(rates) × size within
    [low, high] (`size` must lie in that range)."""
    want = [float(size if s is None else wanted_size(s, low, high, target)) for s in rates]
    n, budget = len(rates), len(rates) * size
    held: dict[int, float] = {}  # sizes the scaling took past a bound, held at it
    while True:
        free = [i for i in range(n) if i not in held]
        scale = (budget - sum(held.values())) / sum(want[i] for i in free) if free else 1.0
        exact = {**held, **{i: want[i] * scale for i in free}}
        past = {i: min(max(exact[i], low), high) for i in free if not low <= exact[i] <= high}
        if not past:
            break
        held.update(past)
    sizes = [math.floor(exact[i] + 1e-9) for i in range(n)]
    by_remainder = sorted(range(n), key=lambda i: (-(exact[i] - sizes[i]), -want[i], i))  # ties: the harder
    for i in by_remainder[: budget - sum(sizes)]:
        sizes[i] += 1
    return sizes


class FixedGroups:
    """Every prompt gets the plugin's n samples."""

    def __init__(self, n: int):
        self.n = n

    def __call__(self, rows: list[dict]) -> tuple[int, dict[str, float]]:
        """(n for every prompt, no metrics)."""
        return self.n, {}


class AdaptiveGroups:
    """Per-difficulty group sizes (`rollout.adaptive_group_size`): each prompt's G from its running pass rate, the
    step's budget kept at len(rows) × n (`group_sizes`)."""

    def __init__(self, pass_rates: PassRates, n: int, low: int, high: int, target: float):
        self.pass_rates, self.n, self.low, self.high, self.target = pass_rates, n, low, high, target

    def __call__(self, rows: list[dict]) -> tuple[list[int], dict[str, float]]:
        """(each prompt's G, their least and greatest as metrics)."""
        sizes = group_sizes([self.pass_rates.get(r) for r in rows], size=self.n, low=self.low, high=self.high,
                            target=self.target)
        return sizes, {"group_size/min": float(min(sizes)), "group_size/max": float(max(sizes))}


def check(cfg, plugin) -> None:
    """Per-difficulty group sizes need groups of an online method, with algorithm.group_size (the budget's mean)
    within their bounds."""
    r = cfg.rollout
    if not r.adaptive_group_size:
        return
    n = plugin.samples_per_prompt(cfg.algorithm) if plugin.source == "online" else 0
    if n < 2:
        raise ConfigError(f"rollout.adaptive_group_size: sets each prompt's group size; {plugin.name} with these "
                          "settings samples no groups")
    if not r.min_group_size <= n <= r.max_group_size:
        raise ConfigError(f"rollout.adaptive_group_size: algorithm.group_size={n} is the mean group size and must lie "
                          f"in [rollout.min_group_size, rollout.max_group_size] = [{r.min_group_size}, "
                          f"{r.max_group_size}]")
