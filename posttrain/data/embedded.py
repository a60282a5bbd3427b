"""The embedded task: seeded synthetic arithmetic problems with held-out test problems; nothing is downloaded.

Problems end in ``#### N`` like GSM8K, so the same reward code checks both. The tiny model that goes with it is
`posttrain.models.embedded`.
"""

from __future__ import annotations

import random

from posttrain.core.errors import ConfigError


def make_problem(rng: random.Random, difficulty: int, max_operand: int = 9) -> dict[str, str]:
    """One problem: `difficulty` + 1 operands in [0, max_operand] joined by + or −, solved one step per line.

    >>> make_problem(random.Random(1), 2)
    {'question': '2-9+1', 'answer': '2-9=-7\\n-7+1=-6\\n#### -6'}
    """
    terms = [rng.randint(0, max_operand) for _ in range(difficulty + 1)]
    ops = [rng.choice("+-") for _ in range(difficulty)]
    total, steps = terms[0], []
    for op, term in zip(ops, terms[1:]):
        new = total + term if op == "+" else total - term
        steps.append(f"{total}{op}{term}={new}")
        total = new
    question = str(terms[0]) + "".join(f"{op}{term}" for op, term in zip(ops, terms[1:]))
    return {"question": question, "answer": "\n".join(steps) + f"\n#### {total}"}


def make_split(seed: int, size: int, difficulty: int, max_operand: int, exclude: set[str] = frozenset()) -> list[dict]:
    """`size` distinct problems from `seed`, none of whose questions is in `exclude` (held-out stays held out)."""
    rng, rows, seen = random.Random(seed), [], set(exclude)
    for _ in range(size * 50):
        row = make_problem(rng, difficulty, max_operand)
        if row["question"] not in seen:
            seen.add(row["question"])
            rows.append(row)
            if len(rows) == size:
                return rows
    raise ConfigError(f"data.train_size: difficulty={difficulty}, max_operand={max_operand} has too few distinct "
                      "problems for the train and test sizes; lower data.train_size or raise data.difficulty")


def task_splits(seed: int, train_size: int, test_size: int, difficulty: int, max_operand: int = 9):
    """(train, test) problems; test questions never appear in train."""
    test = make_split(seed + 1_000_003, test_size, difficulty, max_operand)
    return make_split(seed, train_size, difficulty, max_operand, {r["question"] for r in test}), test
