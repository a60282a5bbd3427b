"""Tests of the reward registry, the accuracy and format rewards, and `combine`, with hand-worked cases.

The GSM8K fixture (tests/fixtures/gsm8k, first 40 test rows) checks extraction against real worked answers.
"""

import json
from pathlib import Path

import pytest

from posttrain import rewards
from posttrain.core.errors import ConfigError, DataError
from posttrain.rewards.accuracy import accuracy, extract_answer, is_correct
from posttrain.rewards.format import format_reward
from posttrain.schema import RewardsConfig

FIXTURE = Path(__file__).parent / "fixtures" / "gsm8k" / "test_head.jsonl"
ROWS = [json.loads(line) for line in FIXTURE.read_text(encoding="utf-8").splitlines()]


@pytest.mark.parametrize(
    "text, expected",
    [
        ("#### 1,234", "1234"),
        ("#### $18.00", "18"),
        ("####-5", "-5"),
        ("#### -$5", "-5"),
        ("#### 0.50", "0.5"),
        ("#### -0", "0"),
        ("#### 1200", "1200"),
        ("#### 18.", "18"),
        ("The answer is 42.", "42"),
        ("no number here", None),
        ("So 10-3 = 7 and 7-3", "3"),
        ("first #### 3\nthen #### 4", "4"),
        ("#### seven", None),
        ("2 + 2 = 4 #### ", None),
    ],
    ids=[
        "commas->1234",
        "dollar-decimals->18",
        "no-space-sign->-5",
        "sign-dollar->-5",
        "0.50->0.5",
        "-0->0",
        "1200-kept",
        "trailing-dot->18",
        "fallback->42",
        "none",
        "binary-minus-not-sign->3",
        "last-marker->4",
        "marker-word->None",
        "empty-marker-no-fallback->None",
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    "completion, reference, expected",
    [
        ("#### 18", "18", True),
        ("#### 18.00", "$18", True),
        ("so she makes $18 a day.", "18", True),
        ("#### 1000", "1,000", True),
        ("#### 0.5", ".50", True),
        ("#### 17", "18", False),
        ("#### -18", "18", False),
        ("18 eggs\n#### 2", "18", False),
        ("no answer", "18", False),
        ("9 * 2 = 18\n#### 18", "She makes 9 * 2 = $<<9*2=18>>18 every day.\n#### 18", True),
        ("#### 16", "She has 16 - 3 = <<16-3=13>>13 left.\n#### 13", False),
    ],
    ids=[
        "18=18",
        "18.00=$18",
        "fallback-18",
        "1000=1,000",
        "0.5=.50",
        "17!=18",
        "-18!=18",
        "marker-beats-earlier",
        "no-number",
        "worked-reference-18",
        "worked-reference-13-not-16",
    ],
)
def test_is_correct(completion, reference, expected):
    assert is_correct(completion, reference) is expected


def test_reference_without_number_is_a_data_error():
    with pytest.raises(DataError, match="no number"):
        is_correct("#### 3", "unknown")


def test_accuracy_scores_each_completion():
    """References 3 and 5: "#### 3" is right (1.0), "#### 4" wrong (0.0), "it is 5" right by fallback (1.0)."""
    assert accuracy(["#### 3", "#### 4", "it is 5"], ["3", "3", "5"]) == [1.0, 0.0, 1.0]


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("#### 7", 1.0),
        ("Work.\n#### 7\n", 1.0),
        ("#### -$1,234.5  ", 1.0),
        ("#### seven", 0.0),
        ("#### 7 apples", 0.0),
        ("#### 7.", 0.0),
        ("#### 7\nand more text", 0.0),
        ("the answer is 7", 0.0),
    ],
    ids=["plain", "trailing-newline", "sign-dollar-commas", "word", "units", "trailing-dot", "text-after", "no-marker"],
)
def test_format_reward(completion, expected):
    assert format_reward([completion], ["7"]) == [expected]


def test_combine_weighted_sum():
    """Weights accuracy 1.0, format 0.5, reference 7 for each completion.

    "#### 7": acc 1, fmt 1 -> 1.0 + 0.5 = 1.5. "#### 7 apples": acc 1, fmt 0 -> 1.0.
    "#### 8": acc 0, fmt 1 -> 0.5. "seven": acc 0, fmt 0 -> 0.0.
    """
    score = rewards.combine(RewardsConfig({"accuracy": 1.0, "format": 0.5}))
    total, parts, counts = score(["#### 7", "#### 7 apples", "#### 8", "seven"], ["7"] * 4, ["Q: 3+4"] * 4)
    assert total == [1.5, 1.0, 0.5, 0.0]
    assert parts == {"accuracy": [1.0, 1.0, 0.0, 0.0], "format": [1.0, 0.0, 1.0, 0.0]}
    assert counts == {"verify_errors": 0, "errors": 0, "timeouts": 0, "nonfinite": 0}


def test_combine_negative_weight_is_a_penalty():
    """Format weight -0.25 on "#### 8" (acc 0, fmt 1) with reference 7: 0 - 0.25 = -0.25."""
    total, _, _ = rewards.combine(RewardsConfig({"accuracy": 1.0, "format": -0.25}))(["#### 8"], ["7"], ["Q: 3+4"])
    assert total == [-0.25]


@pytest.mark.parametrize(
    "weights, message",
    [
        ({}, "no reward"),
        ({"acuracy": 1.0}, "did you mean 'accuracy'"),
        ({"accuracy": float("nan")}, "rewards.accuracy: weight must be a finite number"),
        ({"format": float("inf")}, "rewards.format: weight"),
        ({"format": "1"}, "rewards.format: weight"),
        ({"format": True}, "rewards.format: weight"),
    ],
    ids=["empty", "unknown", "nan", "inf", "string", "bool"],
)
def test_combine_rejects_bad_weights(weights, message):
    with pytest.raises(ConfigError, match=message):
        rewards.combine(RewardsConfig(weights))


def test_unknown_reward_suggests_nearest():
    with pytest.raises(ConfigError) as err:
        rewards.get("acuracy")
    assert str(err.value) == "rewards: unknown reward 'acuracy'; did you mean 'accuracy'? known: accuracy, format"


def test_registry_holds_builtins_and_rejects_duplicates():
    assert rewards.get("accuracy") is accuracy and rewards.get("format") is format_reward
    with pytest.raises(ValueError, match="registered twice"):
        rewards.register("accuracy")(lambda completions, answers, prompts: [0.0] * len(completions))
    try:
        rewards.register("length")(length)  # a module-level function: the reward workers import it by name
        assert rewards.get("length") is length
        assert rewards.combine(RewardsConfig({"length": 1.0}))(["abc"], ["3"], ["Q: 1+2"]).total == [3.0]
    finally:
        rewards.REWARDS.pop("length", None)  # keep the new name out of other tests


def length(completions, answers, prompts):
    return [float(len(c)) for c in completions]


def test_fixture_has_40_rows():
    assert len(ROWS) == 40


@pytest.mark.parametrize("row", ROWS, ids=[f"row{i}" for i in range(len(ROWS))])
def test_gsm8k_answers_extract_and_score(row):
    """The extracted answer is the text after `####` less commas, and every reference scores itself 1.0."""
    assert extract_answer(row["answer"]) == row["answer"].split("####")[-1].strip().replace(",", "")
    assert accuracy([row["answer"]], [row["answer"]]) == [1.0]


def test_a_reward_workers_cannot_import_is_refused_when_the_config_loads():
    """Rewards run in worker processes, which import each function by name: a lambda cannot get there, and is
    refused with the config's errors rather than at the first step."""
    rewards.register("anonymous")(lambda completions, answers, prompts: [0.0] * len(completions))
    try:
        with pytest.raises(ConfigError, match="rewards.anonymous: the function cannot be sent to a reward worker"):
            rewards.combine(RewardsConfig({"anonymous": 1.0}))
    finally:
        rewards.REWARDS.pop("anonymous", None)
