"""The accuracy reward: 1.0 when a completion's final answer equals the reference's, checked the data's way.

`data.answer_format` picks the check. `math` hands it to `posttrain.rewards.math_answer` (math-verify on `\\boxed{}`,
LaTeX or plain answers, each check bounded in time; one that fails or runs out scores None: 0, and counted).
`reasoning_gym` hands it to `posttrain.rewards.gym_answer`, the task's own scorer, whose partial credit the reward
keeps (a verdict is a score of 1). `number`, for maths word problems (GSM8K, Cobbe et al. 2021, arXiv:2110.14168), is
the rule below.

Number rule: 1.0 if the completion's final numeric answer equals the reference's, else 0.0. The final answer is the number
right after the last `####` marker (GSM8K's own format); a completion without a marker falls back to its last number.
Numbers may carry a sign, a `$`, thousands commas and decimals, and are compared exactly (`fractions.Fraction`), so
"18", "18.00" and "$18" all equal 18. Model output is only matched with a regex, never evaluated.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Sequence
from decimal import Decimal
from fractions import Fraction

from posttrain.core.errors import ConfigError, DataError
from posttrain.rewards.base import register

# A sign (not when it is a minus between two operands, as in "10-3"), an optional `$`, then digits with either
# well-formed thousands commas ("1,234") or none, then optional decimals. A trailing "." is never taken.
NUMBER = r"(?:(?<![\w.])(?P<sign>[-+]))?\$?(?P<digits>(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|(?<!\d)\.\d+)"
# Spaces but not newlines between marker and number: "####\n18" is not GSM8K's answer line.
FINAL = re.compile(r"####[ \t]*" + NUMBER)
ANY_NUMBER = re.compile(NUMBER)


def normalise(match: re.Match) -> str:
    """The canonical string of a NUMBER match: no `$` or commas, no trailing zeros, no "-0"."""
    value = Decimal(match["digits"].replace(",", ""))
    if match["sign"] == "-":
        value = -value
    if value == 0:
        return "0"
    # normalize() drops trailing zeros ("18.00" -> "18") but may write 1200 as 1.2E+3; "f" writes it out again.
    return format(value.normalize(), "f")


def final_match(text: str) -> re.Match | None:
    """The NUMBER right after the last `####` in `text` (spaces between allowed), or None; also used by `format`."""
    marker = text.rfind("####")
    return FINAL.match(text, marker) if marker >= 0 else None


def extract_answer(text: str) -> str | None:
    """The final numeric answer of `text` as a normalised string, or None if it has none.

    The number right after the last `####` marker; with no marker, the last number anywhere. A marker not followed
    by a number gives None: the text announced its answer and it is not a number, so no earlier number stands in.
    """
    if "####" in text:
        match = final_match(text)
        return normalise(match) if match else None
    matches = list(ANY_NUMBER.finditer(text))
    return normalise(matches[-1]) if matches else None


def reference_problem(reference: str, answer_format: str = "number") -> str | None:
    """What keeps `reference` from being compared with, as the rule of `answer_format` reads it, or None.

    The number rule needs a number in it: `is_correct` stops the run on a reference without one, so every row the run
    will judge is asked this first, before training (`posttrain.sources.run_splits`). math-verify reads an answer from
    any non-empty text, and a reference it still cannot read scores 0 and is counted (`reward/verify_errors`): nothing
    is refused for it here.
    """
    if answer_format == "number" and extract_answer(reference) is None:
        return "holds no number to compare answers with"
    if answer_format == "reasoning_gym":  # the task, options and entry the scorer needs
        return checker(answer_format).reference_problem(reference)
    return None


def is_correct(completion: str, reference: str) -> bool:
    """Whether the final answer of `completion` equals `reference` (a bare number or a worked answer ending `#### N`).

    Raises:
        DataError: the reference holds no number, so no completion could ever be scored correct.
    """
    expected = extract_answer(reference)
    if expected is None:
        raise DataError(f"reference answer {reference[-80:]!r} holds no number to compare with")
    got = extract_answer(completion)
    return got is not None and Fraction(got) == Fraction(expected)


# The formats checked by a module of their own, imported when first used (sympy, reasoning-gym): each has `verdicts`,
# `scores` and `final_answers` over lists. `number` is this module's rule.
CHECKERS = {"math": "posttrain.rewards.math_answer", "reasoning_gym": "posttrain.rewards.gym_answer"}


def checker(answer_format: str):
    """The module that checks answers of `answer_format`, or None for `number`.

    Raises:
        ConfigError: the checker's package is not installed (reasoning-gym is an extra).
    """
    if answer_format not in CHECKERS:
        return None
    try:
        return importlib.import_module(CHECKERS[answer_format])
    except ImportError as err:
        raise ConfigError(f"data.answer_format: {answer_format} needs the {err.name} package "
                          "(pip install 'posttrain[reasoning-gym]' for reasoning_gym)") from None


def verdicts(completions: Sequence[str], answers: Sequence[str], answer_format: str = "number") -> list[bool | None]:
    """Whether each completion's final answer equals its reference; None where a math check failed or timed out."""
    if (module := checker(answer_format)) is not None:
        return module.verdicts(completions, answers)
    return [is_correct(c, a) for c, a in zip(completions, answers, strict=True)]


def final_answers(completions: Sequence[str], answer_format: str = "number") -> list[str | None]:
    """The final answer each completion gives, as a string equal for equal answers (what maj@k votes on), or None."""
    if (module := checker(answer_format)) is not None:
        return module.final_answers(completions)
    return [extract_answer(c) for c in completions]


@register("accuracy")
def accuracy(completions: Sequence[str], answers: Sequence[str], prompts: Sequence[str] = (), *,
             answer_format: str = "number") -> list[float | None]:
    """1.0 per completion whose final answer equals its reference, else 0.0 (None: the check failed); a reasoning-gym
    task's own score in [0, 1]. The prompts are not needed."""
    if (module := checker(answer_format)) is not None:
        return module.scores(completions, answers)
    return [None if v is None else float(v) for v in verdicts(completions, answers, answer_format)]


def _warm(answer_format: str = "number") -> None:
    """Imports the format's checker (math-verify and sympy, reasoning-gym): a reward worker calls this as it starts, so
    that the import (a second or two) counts against no check's bound (`posttrain.rewards.base`)."""
    checker(answer_format)


accuracy.warm = _warm
