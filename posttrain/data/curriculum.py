"""Curriculum draws (`data.curriculum`): easy to hard by a difficulty field, or weighted by each prompt's pass rate.

field: Platanios et al. 2019, "Competence-based Curriculum Learning for Neural Machine Translation" (NAACL,
arXiv:1903.09848), with
its square-root competence, c0 = `data.curriculum_start`, T = `data.curriculum_steps`:

    c(t) = min(1, sqrt(t · (1 − c0²) / T + c0²))

At step t the draws come from the easiest ⌈c(t) · N⌉ of the shard's N rows (lower `data.difficulty_field` = easier:
a number, or a text holding one number such as MATH's "Level 3"; ties in a seeded fixed order), shuffled without
replacement: a pass draws each row of the pool once. Rows that join the pool join the current pass, so they are drawn
before any row repeats. Once c = 1: RowSampler's uniform epochs.

pass_rate: Kimi k1.5 (arXiv:2501.12599, §2.3.4, "prioritized sampling": problem i is drawn with probability
proportional to 1 − s_i, s_i its tracked success rate). Rows are drawn with replacement, by

    P(i) ∝ w_i = max(1 − s_i, floor),   s_i = the prompt's running pass rate (0 while it was never tried)

Deviation: the floor (`data.curriculum_floor`), so that no prompt is starved. Not easiest first: a prompt the policy
already solves gives a group of equal rewards, whose group-relative advantage is zero; easy-first on pass rates would
redraw exactly the prompts that teach nothing.

Resume: `state_dict` holds the generator's state, what is left of the pass and the pool's size; the pass rates are
the engine's to save.
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Callable

from posttrain.core.errors import ConfigError, DataError
from posttrain.data.rows import RowSampler


def competence(step: int, start: float, steps: int) -> float:
    """c(t) = min(1, sqrt(t · (1 − c0²) / T + c0²)): the share of the rows, easiest first, drawn from at step t."""
    return min(1.0, math.sqrt(step * (1 - start**2) / steps + start**2))


def difficulty(value) -> float | None:
    """A row's difficulty: a finite number, or the one number in a string such as MATH's "Level 3"; else None."""
    if isinstance(value, str):
        found = re.findall(r"-?\d+(?:\.\d+)?", value)
        return float(found[0]) if len(found) == 1 else None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        return None
    return float(value)


def check(cfg, plugin) -> None:
    """data.curriculum orders the rows drawn each step: of methods that draw rows each step, and by pass rate only
    for those whose samples the run judges as it trains."""
    if cfg.data.curriculum != "none" and plugin.source not in ("online", "offline"):
        raise ConfigError(f"data.curriculum: orders the rows drawn each step; {plugin.name} samples its training set "
                          "once, before the run")
    if cfg.data.curriculum == "pass_rate" and plugin.source != "online":
        raise ConfigError(f"data.curriculum: pass_rate weighs prompts by how often the policy solves them, judged on "
                          f"samples drawn as the run trains; {plugin.name} draws none (curriculum=field works)")


def check_difficulty(rows: list[dict], field: str) -> None:
    """Every row has a difficulty in `field`; otherwise a DataError naming data.difficulty_field and the row."""
    for n, row in enumerate(rows, 1):
        if field not in row:
            names = ", ".join(row) or "none"
            raise DataError(f"data.difficulty_field: row {n} has no field '{field}' (fields: {names})")
        value = row[field]
        if difficulty(value) is None:
            raise DataError(f"data.difficulty_field: row {n} field '{field}' is {value!r}, not a number (or a text "
                            "with one number, like 'Level 3')")


class Curriculum(RowSampler):
    """RowSampler whose draws follow `mode`: field (competence-based) or pass_rate (prioritised); see the module."""

    def __init__(self, rows: list[dict], seed: int, rank: int = 0, world: int = 1, *, mode: str,
                 field: str | None = None, start: float = 0.2, ramp_steps: int = 100,
                 pass_rate: Callable[[dict], float | None] | None = None, floor: float = 0.05):
        super().__init__(rows, seed, rank, world)
        if mode not in ("field", "pass_rate"):
            raise ConfigError(f"data.curriculum: a Curriculum draws by field or pass_rate, not {mode!r}")
        if ramp_steps < 1:
            raise ConfigError(f"data.curriculum_steps: must be ≥ 1 (got {ramp_steps})")
        self.mode, self.start, self.ramp_steps, self.pass_rate, self.floor = mode, start, ramp_steps, pass_rate, floor
        self.pool = len(self.rows)  # rows drawn from: the easiest `pool` of `ranked`
        if mode == "pass_rate":
            if pass_rate is None:
                raise ValueError("curriculum=pass_rate needs a pass_rate callable (row -> float | None)")
            return
        if not field:
            raise ConfigError("data.difficulty_field: required with data.curriculum=field")
        check_difficulty(rows, field)  # all rows, so that the row number is the file's
        self.ranked = list(range(len(self.rows)))
        self.rng.shuffle(self.ranked)  # the seeded order of ties; sort is stable
        self.ranked.sort(key=lambda i: difficulty(self.rows[i][field]))
        self.pool = self._size(0)

    def _size(self, step: int) -> int:
        n = len(self.rows)
        return min(n, max(1, math.ceil(competence(step, self.start, self.ramp_steps) * n - 1e-9)))

    def at(self, step: int) -> None:
        """field: grow (or shrink) the pool to ⌈c(step) · N⌉ rows; the rows that join it join the current pass."""
        if self.mode != "field":
            return
        size = self._size(step)
        if size > self.pool and self.order:  # mid-pass; with no pass under way, the next one holds the whole pool
            self.order += self.ranked[self.pool : size]
            self.rng.shuffle(self.order)
        elif size < self.pool:  # only when steps go back
            keep = set(self.ranked[:size])
            self.order = [i for i in self.order if i in keep]
        self.pool = size

    def next(self, n: int) -> list[dict]:
        if self.mode == "pass_rate":
            rates = [self.pass_rate(row) for row in self.rows]
            weights = [max(1.0 - (0.0 if s is None else s), self.floor) for s in rates]
            return [self.rows[i] for i in self.rng.choices(range(len(self.rows)), weights=weights, k=n)]
        out = []
        while len(out) < n:
            if not self.order:
                self.order = self.ranked[: self.pool]
                self.rng.shuffle(self.order)
            out.append(self.rows[self.order.pop()])
        return out

    def state_dict(self) -> dict:
        """RowSampler's state and the pool's size (what `at` grows from)."""
        return {**super().state_dict(), "pool": self.pool}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.pool = state["pool"]
