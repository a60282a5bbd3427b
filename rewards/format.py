"""The format reward: did the completion end with GSM8K's answer line?

Rule: 1.0 if the last `####` marker in the completion is followed by a number (the same NUMBER pattern as the
accuracy reward: sign, `$`, thousands commas, decimals) and then only whitespace to the end, else 0.0. So
"#### 7" scores 1.0 while "#### seven", "#### 7 apples", "#### 7." and a completion with no marker score 0.0.
It checks shape only; whether the number is right is the accuracy reward's job.
"""

from __future__ import annotations

from collections.abc import Sequence

from posttrain.rewards.accuracy import final_match
from posttrain.rewards.base import register


def is_well_formed(completion: str) -> bool:
    """Whether `completion` ends with `#### <number>` (trailing whitespace allowed) at its last marker."""
    match = final_match(completion)
    return match is not None and not completion[match.end() :].strip()


@register("format")
def format_reward(completions: Sequence[str], answers: Sequence[str], prompts: Sequence[str] = ()) -> list[float]:
    """1.0 per well-formed completion, else 0.0; `answers` only has its length checked, for the common signature."""
    return [float(is_well_formed(c)) for c, _ in zip(completions, answers, strict=True)]
