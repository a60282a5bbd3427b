r"""Tests of the MATH answer checker (rewards/math_answer.py) and the pool that bounds it (posttrain/core/bounded.py).

The table holds MATH-style cases whose verdict is both what math-verify returns and what a MATH grader wants.
Cases where the two differ are left out, e.g. `\boxed{(1,2)}` against `\{1,2\}` (math-verify: equal) and a
completion that boxes a guess, then its answer (math-verify reads both boxes as the set {4, 5}).

The pathological answer `\boxed{9^{9^{9^{9}}}}` runs sympy for minutes (over 60 s by hand, with math-verify's own
timeouts off), so finishing within its one-second bound shows the pool killed it.
"""

import multiprocessing
import os
import time

import pytest

from posttrain.core.bounded import BoundedPool
from posttrain.rewards.math_answer import final_answers, verify

SOLUTION = r"The two numbers sum to $5+5=10$, so the answer is $\boxed{10}$."

CASES = [
    # Equivalent forms.
    (r"\boxed{0.5}", r"\frac{1}{2}", True),
    (r"The answer is $\boxed{1/2}$.", r"\frac12", True),
    (r"\boxed{\dfrac{1}{2}}", r"\frac{1}{2}", True),
    (r"\boxed{\frac{\sqrt2}{2}}", r"\sqrt{2}/2", True),
    (r"\boxed{\sqrt{8}}", r"2\sqrt{2}", True),
    (r"\boxed{(1,2]}", r"(1, 2]", True),
    (r"\boxed{(-\infty, 3)}", r"(-\infty,3)", True),
    (r"\boxed{\{2,1\}}", r"\{1,2\}", True),
    (r"\boxed{(3,-4)}", r"(3,-4)", True),
    (r"\boxed{x=3}", "3", True),
    (r"\boxed{30^\circ}", "30", True),
    (r"\boxed{5\text{ cm}}", "5", True),
    (r"\boxed{50\%}", "50", True),
    (r"\boxed{\pi \cdot 2}", r"2\pi", True),
    (r"\boxed{\frac{\pi}{4}}", r"\frac14\pi", True),
    (r"\boxed{-7}", "-7", True),
    (r"\boxed{1,000,000}", "1000000", True),
    (r"\boxed{1000000}", r"1,\!000,\!000", True),
    (r"So the answer is $\boxed{10}$.", SOLUTION, True),
    (r"\boxed{x^2+2x+1}", "(x+1)^2", True),
    (r"\boxed{\text{(C)}}", r"\text{(C)}", True),
    (r"\boxed{\$18.90}", "18.9", True),
    (r"\boxed{\begin{pmatrix} 1 \\ 2 \end{pmatrix}}", r"\begin{pmatrix}1\\2\end{pmatrix}", True),
    (r"Final Answer: The final answer is $\frac{3}{4}$. I hope it is correct.", r"\frac34", True),
    (r"\boxed{1+i}", "i+1", True),
    (r"\boxed{(-\infty,0)\cup(0,\infty)}", r"(-\infty,0) \cup (0,\infty)", True),
    # Wrong, if close.
    (r"\boxed{0.33}", r"\frac{1}{3}", False),
    (r"\boxed{2\sqrt{3}}", r"3\sqrt{2}", False),
    (r"\boxed{7}", "-7", False),
    (r"\boxed{[1,2]}", "(1,2]", False),
    (r"\boxed{(-\infty, 3]}", r"(-\infty,3)", False),
    (r"\boxed{\{1,2,3\}}", r"\{1,2\}", False),
    (r"\boxed{(-4,3)}", "(3,-4)", False),
    (r"\boxed{11}", SOLUTION, False),
    (r"\boxed{\text{(B)}}", r"\text{(C)}", False),
    ("I could not solve it.", "3", False),
    (r"\boxed{\frac{\pi}{3}}", r"\frac{\pi}{6}", False),
    (r"\boxed{x^2-2x+1}", "(x+1)^2", False),
    (r"\boxed{1000}", "10,000", False),
    (r"\boxed{12345678901234567890}", "12345678901234567891", False),
]


@pytest.fixture(scope="module")
def verdicts():
    """The table checked in one call (its first also starts the workers), and that call's error count."""
    return verify([c for c, _, _ in CASES], [r for _, r, _ in CASES])


@pytest.mark.parametrize("index", range(len(CASES)), ids=[f"{c[:24]}|{r[:16]}" for c, r, _ in CASES])
def test_table(verdicts, index):
    got, errors = verdicts
    assert errors == 0
    assert got[index] is CASES[index][2]


def test_pathological_answer_is_bounded_and_the_pool_recovers():
    start = time.monotonic()
    got, errors = verify([r"\boxed{9^{9^{9^{9}}}}", r"\boxed{2}"], ["1", "2"], timeout_s=1.0)
    took = time.monotonic() - start
    assert got == [False, True] and errors == 1
    assert 1.0 <= took < 4.0  # it ran until the bound, and no longer
    assert verify([r"\boxed{3}"], ["3"]) == ([True], 0)  # the killed worker's replacement works


def test_parse_that_raises_is_counted():
    """math-verify's parser raises on a number of over 4,300 digits (Python's limit on reading digits as an int)."""
    got, errors = verify(["The answer is " + "1" * 5000, r"\boxed{1}"], ["1", "1"])
    assert got == [False, True] and errors == 1


def test_unusable_reference_is_counted():
    """An empty box holds no answer; sympy cannot compare anything with 1/0 (math-verify's comparison raises)."""
    got = verify([r"\boxed{1}"] * 3, [r"\boxed{}", r"\frac{1}{0}", "1"])
    assert got == ([False, False, True], 2)


def test_final_answers():
    halves = [r"\boxed{\frac{1}{2}}", r"\boxed{0.5}", "The answer is 1/2", r"\boxed{50\%}"]
    got = final_answers([*halves, r"\boxed{\{2,1\}}", r"\boxed{\{1,2\}}", r"\boxed{0.33}", "no answer here"])
    assert got[:4] == ["1/2"] * 4
    assert got[4] == got[5] == "{1, 2}"
    assert got[6] == "33/100"
    assert got[7] is None


@pytest.fixture(scope="module")
def pool():
    with BoundedPool(workers=2) as pool:
        yield pool


def test_pool_keeps_input_order(pool):
    items = list(range(-40, 40))
    assert [o.value for o in pool.map(abs, items, timeout_s=5.0)] == [abs(i) for i in items]


def test_pool_reports_what_fn_raised(pool):
    good, bad = pool.map(int, ["7", "seven"], timeout_s=5.0)
    assert good.ok and good.value == 7
    assert not bad.ok and not bad.timed_out and bad.error.startswith("ValueError: invalid literal")


def test_pool_reports_a_worker_that_died(pool):
    (died,) = pool.map(os._exit, [3], timeout_s=5.0)
    assert died.error == "worker exited with code 3" and not died.timed_out
    assert pool.map(abs, [-1], timeout_s=5.0)[0].value == 1


@pytest.mark.parametrize("fn, hung, quick", [(time.sleep, 60, 0), (sum, range(10**12), range(3))],
                         ids=["sleep", "stuck-in-C"])
def test_pool_kills_an_item_past_its_bound(pool, fn, hung, quick):
    """`sum` over a range loops in C, where SIGALRM's handler would wait for the loop to end (minutes)."""
    pool.map(abs, [1, 2], timeout_s=5.0)  # both workers up
    processes = len(multiprocessing.active_children())
    start = time.monotonic()
    slow, done = pool.map(fn, [hung, quick], timeout_s=0.3)
    assert time.monotonic() - start < 3.0
    assert slow.timed_out and slow.error == "timed out after 0.3 s"
    assert done.ok and done.value == fn(quick)
    assert [o.value for o in pool.map(abs, [-1, -2, -3], timeout_s=5.0)] == [1, 2, 3]
    assert len(multiprocessing.active_children()) == processes  # the hung worker is gone, and one replaced it


def test_pool_refuses_a_function_it_cannot_pickle(pool):
    with pytest.raises((AttributeError, TypeError)):
        pool.map(lambda x: x, [1], timeout_s=1.0)


def test_judge_scores_and_counts_with_the_math_preset():
    """`data.preset=math` routes the accuracy reward, the verdict and the vote through math-verify; a check that
    raises scores 0 and is counted as reward/verify_errors."""
    from posttrain.judge import Judge
    from posttrain.schema import DataConfig, RewardsConfig

    judge = Judge(DataConfig(preset="math", path="math.jsonl"), RewardsConfig({"accuracy": 1.0}))
    rows = [{"problem": "Half of one?", "solution": r"It is $\boxed{\frac{1}{2}}$."}] * 3
    completions = [r"So $\boxed{0.5}$.", r"\boxed{\frac{1}{3}}", "The answer is " + "1" * 5000]
    total, stats = judge.score(rows, completions)
    assert total.tolist() == [1.0, 0.0, 0.0]
    assert stats["reward/verify_errors"] == 1.0 and stats["reward/accuracy"] == pytest.approx(1 / 3)
    assert judge.correct(rows, completions) == [True, False, False]
    assert judge.final_answers(completions[:2]) == ["1/2", "1/3"]
    number = Judge(DataConfig(preset="gsm8k", path="g.jsonl"), RewardsConfig())  # the #### rule: no LaTeX
    assert number.correct([{"question": "q", "answer": "#### 0.5"}], [r"\boxed{\frac{1}{2}}"]) == [False]


def test_grpo_run_on_math_rows(warm_model_dir, tmp_path):
    """The real CLI runs with `data.preset=math` on MATH-layout rows (the reward workers and math-verify start
    under it) and records the math format; which checker scores is tested at the judge, just above."""
    import json

    from cli_helpers import posttrain

    rows = [{"problem": f"What is {a} plus {b}?", "solution": f"We add: ${a}+{b}={a + b}$, so $\\boxed{{{a + b}}}$."}
            for a in range(6) for b in range(4)]
    path = tmp_path / "math.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    proc = posttrain("run", "recipe=grpo_math", f"model.path={warm_model_dir}", "data.preset=math",
                     f"data.path={path}", f"output_dir={out}", "train.steps=2", "train.batch_size=2",
                     "algorithm.group_size=2", "rollout.max_new_tokens=8", "eval.num_problems=4")
    assert proc.returncode == 0, proc.stderr[-2000:]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2 and all("reward/verify_errors" in m for m in metrics)
    assert "answer_format: math" in (out / "config.yaml").read_text()
