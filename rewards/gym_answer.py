"""Answers to reasoning-gym's tasks (`data.preset=reasoning_gym:TASK`), scored by each task's own checker.

The final answer of a completion is the text after its last `####`, stripped; it may span lines (a grid, a list of
words). A completion without the marker, or with nothing after it, has no answer (None), which the scorer scores as
it scores any answer (most give 0, some a little for trying: countdown 0.01).

The reference is a row's `reference` field as `posttrain.data.gym` writes and reads it: JSON {"task", "options",
"entry"}, the entry being what the task generated (question, answer, metadata). The score is the task's
`score_answer(answer, entry)` in [0, 1]: 1 for a right answer, 0 for a wrong one, and for some tasks credit
between (reasoning-gym's default gives an answer that contains the reference len(reference) / len(answer)). The
accuracy reward is that score; a verdict (evaluation's accuracy, what RFT and DPO keep) is whether it is 1.

Scorers are reasoning-gym's code, some of them search or parse; each check runs in `POOL` within its bound, as
math-verify's do (`posttrain.rewards.math_answer`), and a worker builds each task's dataset object once.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence

import reasoning_gym

from posttrain.core.bounded import BoundedPool
from posttrain.data.gym import read_reference

MARKER = "####"
POOL = BoundedPool()  # its workers start on the first call


def final_answer(completion: str) -> str | None:
    """The text after the last `####` of `completion`, stripped; None without the marker or with nothing after it."""
    at = completion.rfind(MARKER)
    return (completion[at + len(MARKER):].strip() or None) if at >= 0 else None


def reference_problem(reference: str) -> str | None:
    """What keeps `reference` from being scored against (not this module's JSON), or None."""
    try:
        parsed = read_reference(reference)
    except ValueError:
        return "is not the JSON reference data.preset=reasoning_gym:TASK writes"
    if not isinstance(parsed, dict) or not {"task", "options", "entry"} <= parsed.keys():
        return "lacks the task, options or entry of a reasoning-gym reference"
    return None


@functools.lru_cache(maxsize=64)
def _scorer(task: str, options: str):
    return reasoning_gym.create_dataset(task, **json.loads(options), seed=0, size=1).score_answer


def score(completion: str, reference: str) -> float:
    """The task's score of the completion's final answer against the entry in `reference`, in [0, 1]."""
    ref = read_reference(reference)
    check = _scorer(ref["task"], json.dumps(ref["options"], sort_keys=True))
    return float(check(final_answer(completion), ref["entry"]))


def _score(pair: tuple[str, str]) -> float:
    return score(*pair)


def scores(completions: Sequence[str], references: Sequence[str], timeout_s: float = 5.0) -> list[float | None]:
    """Each completion's score against its reference; None where the scorer raised or outlasted `timeout_s` (the
    accuracy reward scores it 0 and counts it)."""
    if len(completions) != len(references):
        raise ValueError(f"{len(completions)} completions for {len(references)} references")
    return [o.value if o.ok else None for o in POOL.map(_score, zip(completions, references), timeout_s)]


def verdicts(completions: Sequence[str], references: Sequence[str]) -> list[bool | None]:
    """Whether each completion scores 1 (right); None where its check failed."""
    return [None if s is None else s == 1.0 for s in scores(completions, references)]


def final_answers(completions: Sequence[str]) -> list[str | None]:
    """The final answer of each completion as its text (what maj@k votes on), or None."""
    return [final_answer(c) for c in completions]
