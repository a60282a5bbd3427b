"""Evaluation: pass@k's unbiased estimator, maj@k's vote, and `posttrain eval` end to end."""

import json
import math

import pytest
from cli_helpers import assert_one_line_error, posttrain, posttrain_here

from posttrain.rewards.accuracy import extract_answer
from posttrain.train.evaluation import majority, majority_right, pass_at_k


@pytest.mark.parametrize("n", [1, 2, 5, 8, 16])
def test_pass_at_k_is_the_chance_that_k_of_the_n_samples_hold_a_correct_one(n):
    """1 − C(n − c, k) / C(n, k): drawing k of the n samples without replacement, at least one is correct."""
    for k in range(1, n + 1):
        for c in range(n + 1):
            exact = 1 - math.comb(n - c, k) / math.comb(n, k)
            assert pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12), (n, c, k)
    assert pass_at_k(8, 2, 1) == pytest.approx(2 / 8)  # pass@1: the fraction correct
    assert pass_at_k(8, 0, 8) == 0 and pass_at_k(8, 1, 8) == 1


def test_majority_votes_over_answers_and_breaks_ties_by_first_seen():
    assert majority(["3", "4", "4", None, "3", "4"]) == "4"
    assert majority(["5", "3", "3", "5"]) == "5"  # tied: the earliest of them
    assert majority([None, "7", None]) == "7"  # completions without an answer do not vote
    assert majority([None, None]) is None and majority([]) is None


def test_maj_at_k_over_disjoint_runs_of_k_samples():
    finals, right = ["1", "2", "1", "3", "3", "3", None], [True, False, True, False, False, False, False]
    assert majority_right(finals, right, 1) == pytest.approx(2 / 7)  # each sample alone
    assert majority_right(finals, right, 2) == pytest.approx(2 / 3)  # [1, 2] -> 1, [1, 3] -> 1, [3, 3] -> 3
    assert majority_right(finals, right, 3) == pytest.approx(1 / 2)  # [1, 2, 1] -> 1, [3, 3, 3] -> 3
    assert majority_right(finals, right, 4) == 1.0  # [1, 2, 1, 3] -> 1; the last three are left over
    assert majority_right([None, None], [False, False], 2) == 0.0  # no answer, no vote


def test_posttrain_eval_reports_greedy_pass_and_maj_with_records(tiny_model_dir, tmp_path):
    out = tmp_path / "eval.json"
    proc = posttrain("eval", tiny_model_dir, "eval.k=2", "eval.n=3", "eval.num_problems=5", "eval.batch_size=2",
                     "rollout.max_new_tokens=8", "data.train_size=20", "data.test_size=5", "-o", out, "-q")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert proc.stdout.splitlines()[0].startswith(f"greedy {report['greedy']:.3f}  pass@2 {report['pass@2']:.3f}  "
                                                  f"maj@2 {report['maj@2']:.3f}  (5 problems; 3 samples each")
    assert report["num_problems"] == len(report["records"]) == 5 and (report["k"], report["n"]) == (2, 3)
    records = report["records"]
    assert report["greedy"] == pytest.approx(sum(r["greedy"]["correct"] for r in records) / 5)
    for r in records:  # each problem's figures follow from its own samples; the vote is over the first k
        assert len(r["samples"]) == 3 and r["correct_samples"] == sum(s["correct"] for s in r["samples"])
        assert r["majority_answer"] == majority([extract_answer(s["completion"]) for s in r["samples"][:2]])
    assert report["pass@2"] == pytest.approx(sum(pass_at_k(3, r["correct_samples"], 2) for r in records) / 5)
    assert report["maj@2"] == pytest.approx(sum(r["majority_correct"] for r in records) / 5)
    curve = report["curve"]  # K = 1, 2 ≤ n = 3, from the same samples
    assert curve["K"] == [1, 2]
    assert curve["pass"] == pytest.approx([sum(pass_at_k(3, r["correct_samples"], K) for r in records) / 5
                                           for K in (1, 2)])
    finals = [[extract_answer(s["completion"]) for s in r["samples"]] for r in records]
    rights = [[s["correct"] for s in r["samples"]] for r in records]
    assert curve["maj"] == pytest.approx([sum(majority_right(f, c, K) for f, c in zip(finals, rights)) / 5
                                          for K in (1, 2)])
    written = out.read_text()
    assert_one_line_error(posttrain_here("eval", tiny_model_dir, "-o", out), f"{out}: already exists")
    assert out.read_text() == written  # nothing on disk replaced
    assert_one_line_error(posttrain_here("eval", tmp_path / "nothing", "-o", tmp_path / "x.json"), "model.path")
    assert_one_line_error(posttrain_here("eval", tiny_model_dir, "eval.n=1", "eval.k=2", "-o", tmp_path / "y.json"),
                          "eval.n: must be ≥ k = 2")


def test_a_run_with_eval_k_reports_pass_and_maj(tiny_model_dir, tmp_path):
    """The same evaluation inside `posttrain run`: eval.k adds pass@k and maj@k to the before and after figures."""
    out = tmp_path / "run"
    proc = posttrain("run", "recipe=sft_math", f"model.path={tiny_model_dir}", f"output_dir={out}", "train.steps=1",
                     "eval.num_problems=4", "eval.k=2", "rollout.max_new_tokens=6", "data.train_size=20",
                     "data.test_size=4")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    for key in ("eval_before", "eval_after"):
        assert {"pass@2", "maj@2"} <= summary[key].keys() and summary[key]["n"] == 2
