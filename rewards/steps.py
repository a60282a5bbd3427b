"""The embedded task's process reward: each worked step of a completion checked by rule.

Process supervision (DeepSeekMath, arXiv:2402.03300, §4.1.3) scores a completion step by step, not once at the end.
A process reward returns, for each step, `(char_end, score)`: the offset in the completion's text just past the step's
last character, and the step's reward. `rewards.process` picks the source: `steps`, this rule, or `model`, a process
reward model (`posttrain.rewards.process_model`). Neither is in the `REWARDS` registry: a registered reward gives one
number per completion, which `combine` weighs and sums; a process reward gives a list per completion, and only the
methods that train on step rewards (`grpo_ps`) read it.

Steps are lines (`line_ends`): a step ends just past its newline, the last step at the end of the text; a newline at
the very end adds no empty step, and a completion with no text is one step ending at 0. The embedded task writes its
solution one step per line, "a-b=c\\n...\\n#### N" (`posttrain.data.embedded`), so each line can be checked:

- line k before the first `####` line (k = 0, 1, ...) scores 1.0 if it is exactly the k-th worked step of the question,
  "total op term=new" with the running total from the question's first number (so a step is right or wrong on its
  own, whatever the lines before it say), else 0.0; a line past the question's number of steps scores 0.0;
- the first line that starts with `####` scores 1.0 if the number after it is the question's answer, wherever it
  comes, else 0.0;
- every line after it scores 0.0.

What is forgiven: spaces, tabs and carriage returns anywhere in a line ("2 - 9 = -7" is the step 2-9=-7). Nothing
else: trailing text ("2-9=-7 so"), another spelling of a number ("+7", "07", "7.0") or a blank line make the line
wrong. The rule reads only the question (the row's `data.prompt_field`, e.g. "2-9+1"); one that is not such a sum is a
DataError. It is a few regular expressions on short strings, so it runs in the judge's process, not the reward pool.
"""

from __future__ import annotations

import re

from posttrain.core.errors import DataError

QUESTION = re.compile(r"\d+(?:[+-]\d+)*")  # the embedded task's question, spaces removed: "2-9+1"
TERM = re.compile(r"[+-]?\d+")
IGNORED = re.compile(r"[ \t\r\n]")  # what a line may hold besides its step without being wrong


def line_ends(text: str) -> list[int]:
    """The end offset of each line of `text` (past its newline; the last at len(text)); [0] for an empty text.

    >>> line_ends("1+2=3\\n#### 3"), line_ends("1+2=3\\n"), line_ends("")
    ([6, 11], [6], [0])
    """
    ends = [m.end() for m in re.finditer("\n", text)]
    return ends if ends and ends[-1] == len(text) else [*ends, len(text)]


def worked_steps(question: str) -> tuple[list[str], int]:
    """The lines that solve `question` ("2-9+1" -> ["2-9=-7", "-7+1=-6"]) and its answer (-6).

    Raises:
        DataError: `question` is not a sum of whole numbers such as "2-9+1".
    """
    compact = IGNORED.sub("", question)
    if not QUESTION.fullmatch(compact):
        raise DataError(f"rewards.process=steps: the question {question[:80]!r} is not a sum like 2-9+1; the rule "
                        "checks the embedded task's steps (rewards.process=model scores other tasks)")
    first, *terms = TERM.findall(compact)
    total, lines = int(first), []
    for term in terms:
        new = total + int(term)
        lines.append(f"{total}{term[0]}{term[1:]}={new}")
        total = new
    return lines, total


def step_scores(question: str, completion: str) -> list[tuple[int, float]]:
    """(char_end, score) for each line of `completion`, by the rule of the module docstring."""
    lines, answer = worked_steps(question)
    scores, answered, start = [], False, 0
    for k, end in enumerate(line_ends(completion)):
        line = IGNORED.sub("", completion[start:end])
        if answered:  # past the answer line
            score = 0.0
        elif line.startswith("####"):
            answered, score = True, float(line == f"####{answer}")
        else:
            score = float(k < len(lines) and line == lines[k])
        scores.append((end, score))
        start = end
    return scores
