"""The embedded default: seeded task with held-out problems, char tokenizer and tiny model via the HF Auto classes."""

import random
import re

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from posttrain.core.errors import ConfigError
from posttrain.data.embedded import make_calc_problem, make_problem, task_splits
from posttrain.environments.calculator import evaluate
from posttrain.rewards.accuracy import extract_answer
from posttrain.schema import DataConfig


def test_problem_is_worked_and_correct():
    """Seed 1 gives '2-9+1', solved as 2-9=-7, -7+1=-6, #### -6."""
    row = make_problem(random.Random(1), 2)
    assert row == {"question": "2-9+1", "answer": "2-9=-7\n-7+1=-6\n#### -6"}
    for seed in range(50):
        row = make_problem(random.Random(seed), 3, max_operand=20)
        terms = re.findall(r"[+-]?\d+", row["question"])
        assert int(extract_answer(row["answer"])) == sum(map(int, terms))


def test_splits_seeded_and_held_out():
    train, test = task_splits(7, 500, 100, 2)
    assert (train, test) == task_splits(7, 500, 100, 2)
    assert not {r["question"] for r in train} & {r["question"] for r in test}
    assert task_splits(8, 500, 100, 2)[1] != test


def test_calc_problems_are_worked_with_one_call_whose_reply_is_the_answer():
    assert make_calc_problem(random.Random(1), 1) == {"question": "27*82", "answer": "<calc>27*82</calc>=2214\n#### 2214"}
    for seed in range(100):
        difficulty = 1 + seed % 3
        row = make_calc_problem(random.Random(seed), difficulty, max_operand=50)
        operands = [int(t) for t in re.findall(r"\d+", row["question"])]
        assert len(operands) == difficulty + 1 and all(10 <= t <= 50 for t in operands)
        assert re.fullmatch(r"\d+\*\d+([+-]\d+)*", row["question"])
        value = evaluate(row["question"])  # the calculator's reply is the reference answer
        assert row["answer"] == f"<calc>{row['question']}</calc>={value}\n#### {value}"
        assert int(extract_answer(row["answer"])) == value


def test_the_task_picks_the_problems_and_their_operand_range():
    assert (DataConfig().task, DataConfig().max_operand) == ("arithmetic", 9)
    assert DataConfig(task="calc").max_operand == 99 and DataConfig(task="calc", max_operand=30).max_operand == 30
    train, test = task_splits(7, 300, 50, 1, 99, "calc")
    assert all(r["answer"].startswith("<calc>") for r in train + test)
    assert not {r["question"] for r in train} & {r["question"] for r in test}
    assert task_splits(7, 300, 50, 1, 99) != (train, test)
    with pytest.raises(ConfigError, match="task: unknown 'calculus'; known: arithmetic, calc"):
        DataConfig(task="calculus")


def test_model_dir_loads_with_auto_classes(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    text = "Q: 12+3\nA: 12+3=15\n#### 15"
    ids = tok(text)["input_ids"]
    assert len(ids) == len(text) and tok.decode(ids) == text
    assert model.config.vocab_size == len(tok) and tok.eos_token_id != tok.pad_token_id
    assert (tiny_model_dir / "model.safetensors").exists()
