r"""MATH-style answer checking (Hendrycks et al. 2021, arXiv:2103.03874) with math-verify, each check bounded in time.

What is checked. math-verify reads the final answer of a completion: what is in `\boxed{...}` first, then LaTeX
after an anchor ("the final answer is $\frac12$") or alone, then a plain number or arithmetic expression (digits
and operators only, so no names reach sympy's parser). It turns both answers into sympy objects and compares them:
a decimal and a fraction after rounding both to 6 places, expressions symbolically, and sets, intervals, tuples,
matrices and equations by structure. So `\frac{1}{2}`, `0.5`, `1/2` and `50\%` agree, as do `x=3` and `3`, or
`30^\circ` and `30`, while `0.33` is not `\frac13`. A reference is either a full MATH solution, whose `\boxed{...}`
holds the answer, or a bare answer (`\frac{1}{2}`, `(1,2]`, `\text{(C)}`), read as if it were boxed.

One choice of math-verify's to know: a completion with several boxes is read as the set of their contents, so one
that boxes a guess and then its answer (`\boxed{4}` ... `\boxed{5}`) is wrong against 5.

The bound. Every check (one completion against its reference) runs in `POOL`, a
`posttrain.core.bounded.BoundedPool` of worker processes, within `timeout_s` seconds of wall-clock time; past that
its worker is killed and replaced. math-verify's own timeouts are turned off: they use SIGALRM, which works only in
a main thread, counts whole seconds and waits for a long C call to return. Each worker parses a distinct reference
once and keeps it (`_reference`). The accuracy reward in training already runs in a worker (the judge runs every
reward call in its own pool, `posttrain.rewards.base`); there the checks run in that worker, as a pool does not nest
(`posttrain.core.bounded`, rule 7), and the reward call's bound, `rewards.timeout_s`, is theirs: a check that runs
out of it scores 0 and counts as `reward/timeouts`.

What counts as an error. A check that raises or runs out of time scores False and is counted: math-verify's
parser failing on the text (a number of 5,000 digits exceeds Python's limit on reading digits as an int), sympy
failing to compare (a reference of `\frac{1}{0}`), or a reference with no answer math-verify can read. A
completion with no answer at all is wrong, not an error.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence

import sympy
from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse
from math_verify import verify as equivalent

from posttrain.core.bounded import BoundedPool

# The same targets for completions and references: math-verify caches the regexes of a single configuration.
TARGETS = (LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig())
POOL = BoundedPool()  # shared by `verify` and `final_answers`; its workers start on the first call

# With its timeouts off, math-verify warns once per process that it will not stop a runaway check; the pool does.
logging.getLogger("math_verify").setLevel(logging.ERROR)


def _read(text: str) -> list:
    """math-verify's parse of `text`: sympy objects first, then the matched text as a fallback string; [] if none."""
    return parse(text, extraction_config=TARGETS, parsing_timeout=None, raise_on_error=True)


@functools.lru_cache(maxsize=4096)
def _reference(reference: str) -> tuple:
    """The parsed answer of a reference (a solution with `\\boxed{}`, or a bare answer), cached in each worker."""
    parsed = _read(reference if "\\boxed" in reference else f"\\boxed{{{reference}}}")
    if not parsed:
        raise ValueError(f"math-verify reads no answer in the reference {reference[-80:]!r}")
    return tuple(parsed)


def _check(pair: tuple[str, str]) -> bool:
    """Whether the completion's final answer is equivalent to the reference's (run in a worker)."""
    completion, reference = pair
    gold = list(_reference(reference))  # verify takes lists; a tuple would be read as one sympy Tuple
    return equivalent(gold, _read(completion), timeout_seconds=None, raise_on_error=True)


def _final_answer(completion: str) -> str | None:
    """The canonical string of the completion's final answer, or None when it has none (run in a worker)."""
    parsed = _read(completion)
    if not parsed:
        return None
    answer = parsed[0]
    if isinstance(answer, str):  # math-verify matched an answer but could not parse it: vote on its text
        return answer.strip() or None
    # Floats as the exact rationals they print as (0.5 -> 1/2), then evaluated (math-verify builds 50\% as 50*(1/100)).
    answer = answer.xreplace({f: sympy.Rational(str(f)) for f in answer.atoms(sympy.Float)})
    return str(answer.doit())


def verdicts(completions: Sequence[str], references: Sequence[str], timeout_s: float = 5.0) -> list[bool | None]:
    """Whether each completion's final answer is equivalent to its reference's; None where the check raised or
    timed out (the accuracy reward scores it 0 and the judge counts it as `reward/verify_errors`, or a timeout in a
    reward worker as `reward/timeouts`)."""
    if len(completions) != len(references):
        raise ValueError(f"{len(completions)} completions for {len(references)} references")
    return [bool(o.value) if o.ok else None for o in POOL.map(_check, zip(completions, references), timeout_s)]


def scores(completions: Sequence[str], references: Sequence[str], timeout_s: float = 5.0) -> list[float | None]:
    """The accuracy reward: 1.0 or 0.0 per verdict, None where the check failed."""
    return [None if v is None else float(v) for v in verdicts(completions, references, timeout_s)]


def verify(completions: Sequence[str], references: Sequence[str], timeout_s: float = 5.0) -> tuple[list[bool], int]:
    """Whether each completion's final answer is equivalent to its reference's, and how many checks failed.

    Args:
        completions: model outputs, one per reference.
        references: MATH solutions with a `\\boxed{}` answer, or bare answers.
        timeout_s: wall-clock bound on each check, in seconds.

    Returns:
        One verdict per completion, and the number of checks that raised or timed out (each a False verdict).
    """
    checked = verdicts(completions, references, timeout_s)
    return [v is True for v in checked], sum(v is None for v in checked)


def final_answers(completions: Sequence[str], timeout_s: float = 5.0) -> list[str | None]:
    """The final answer of each completion as a canonical string, for majority voting (maj@k); None when none.

    The string is sympy's print of math-verify's first parse, with floats made exact and the expression evaluated,
    so `\\frac{1}{2}`, `0.5`, `1/2` and `50\\%` all give "1/2" and `\\{2,1\\}` gives "{1, 2}". It is no full
    equivalence test: `x=3` gives "Eq(x, 3)", not "3", and `(x+1)^2` stays apart from `x^2+2x+1`. A parse that
    raises or outlasts `timeout_s` gives None.
    """
    return [o.value if o.ok else None for o in POOL.map(_final_answer, completions, timeout_s)]
