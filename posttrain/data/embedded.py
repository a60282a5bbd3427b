"""The embedded tasks: seeded synthetic arithmetic problems with held-out test problems; nothing is downloaded.

`data.task` picks one: `arithmetic` (sums of one-digit numbers, worked one step per line, which the tiny model
learns to do in its head) or `calc` (a product of two-digit numbers and more terms, which it cannot do reliably in its
head, worked with one call to the calculator tool of `environments/calculator.py`). Answers end in ``#### N`` like
GSM8K, so the same reward code checks both. The tiny model that goes with them is `posttrain.models.embedded`.
"""

from __future__ import annotations

import random
import re

from posttrain.core.errors import ConfigError

TEST_SEED_OFFSET = 1_000_003  # held-out problems come from a seed of their own


def make_problem(rng: random.Random, difficulty: int, max_operand: int = 9) -> dict[str, str]:
    """One problem: `difficulty` + 1 operands in [0, max_operand] joined by + or −, solved one step per line.

    >>> make_problem(random.Random(1), 2)
    {'question': '2-9+1', 'answer': '2-9=-7\\n-7+1=-6\\n#### -6'}
    """
    terms = [rng.randint(0, max_operand) for _ in range(difficulty + 1)]
    ops = [rng.choice("+-") for _ in range(difficulty)]
    question = str(terms[0]) + "".join(f"{op}{term}" for op, term in zip(ops, terms[1:]))
    return {"question": question, "answer": worked(question)}


def worked(question: str, slips=None) -> str:
    """The worked solution of an arithmetic `question`, one step per line, then `#### total`. `slips(right)` says, for a
    step whose right result is not one digit (a carry past 9, or below 0), whether the step slips: it then drops the
    carry (12 is written 2) or the minus sign (−3 is written 3), and the work goes on from what was written.

    >>> worked("7+5-3", slips=lambda right: True)
    '7+5=2\\n2-3=1\\n#### 1'
    """
    numbers = re.findall(r"\d+", question)
    total, steps = int(numbers[0]), []
    for op, term in zip(re.findall(r"(?<=\d)[+-]", question), map(int, numbers[1:])):
        new = total + term if op == "+" else total - term
        if slips is not None and not 0 <= new <= 9 and slips(new):
            new = new - 10 if new > 9 else -new
        steps.append(f"{total}{op}{term}={new}")
        total = new
    return "\n".join(steps) + f"\n#### {total}"


def taught(rows: list[dict], accuracy: float, demonstrations: int, seed: int) -> list[dict]:
    """The warm-up's training rows: `demonstrations` worked solutions of each arithmetic question in `rows`, written by
    a teacher who gets a step whose result is not one digit right with probability `accuracy` and otherwise slips
    (`worked`). A model trained on them to convergence imitates the teacher: greedy, it slips on every such step;
    sampled, it is right there about `accuracy` of the time, which is what RL on the answer's correctness can build
    on. The rows' answers are the teacher's; the held-out rows a run is evaluated on keep the right ones."""
    rng = random.Random(seed)
    return [{"question": row["question"], "answer": worked(row["question"], lambda right: rng.random() >= accuracy)}
            for _ in range(demonstrations) for row in rows]


def make_calc_problem(rng: random.Random, difficulty: int, max_operand: int = 99) -> dict[str, str]:
    """One calculator problem: a product of two operands in [10, max_operand], then `difficulty` − 1 more operands
    added or subtracted; worked with one call to the calculator, whose reply (`=1776`) follows the call.

    >>> make_calc_problem(random.Random(1), 2)
    {'question': '27*82+42', 'answer': '<calc>27*82+42</calc>=2256\\n#### 2256'}
    """
    low = min(10, max_operand)
    a, b = rng.randint(low, max_operand), rng.randint(low, max_operand)
    rest = [(rng.choice("+-"), rng.randint(low, max_operand)) for _ in range(difficulty - 1)]
    question = f"{a}*{b}" + "".join(f"{sign}{term}" for sign, term in rest)
    value = a * b + sum(term if sign == "+" else -term for sign, term in rest)
    return {"question": question, "answer": f"<calc>{question}</calc>={value}\n#### {value}"}


def make_split(seed: int, size: int, difficulty: int, max_operand: int, exclude: set[str] = frozenset(),
               task: str = "arithmetic") -> list[dict]:
    """`size` distinct problems from `seed`, none of whose questions is in `exclude` (held-out stays held out)."""
    rng, rows, seen = random.Random(seed), [], set(exclude)
    make = make_calc_problem if task == "calc" else make_problem
    for _ in range(size * 50):
        row = make(rng, difficulty, max_operand)
        if row["question"] not in seen:
            seen.add(row["question"])
            rows.append(row)
            if len(rows) == size:
                return rows
    raise ConfigError(f"data.train_size: difficulty={difficulty}, max_operand={max_operand} has too few distinct "
                      "problems for the train and test sizes; lower data.train_size or raise data.difficulty")


def task_splits(seed: int, train_size: int, test_size: int, difficulty: int, max_operand: int = 9,
                task: str = "arithmetic"):
    """(train, test) problems of `task`; test questions never appear in train."""
    test = make_split(seed + TEST_SEED_OFFSET, test_size, difficulty, max_operand, task=task)
    return make_split(seed, train_size, difficulty, max_operand, {r["question"] for r in test}, task), test
