"""The embedded default: seeded task with held-out problems, char tokenizer and tiny model via the HF Auto classes."""

import random
import re

from transformers import AutoModelForCausalLM, AutoTokenizer

from posttrain.data.embedded import make_problem, task_splits
from posttrain.rewards.accuracy import extract_answer


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


def test_model_dir_loads_with_auto_classes(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    text = "Q: 12+3\nA: 12+3=15\n#### 15"
    ids = tok(text)["input_ids"]
    assert len(ids) == len(text) and tok.decode(ids) == text
    assert model.config.vocab_size == len(tok) and tok.eos_token_id != tok.pad_token_id
    assert (tiny_model_dir / "model.safetensors").exists()
