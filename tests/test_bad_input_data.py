"""Bad model directories and data files, refused before any work as one line naming the file (and the row and field),
exit status 2, with nothing left on disk: corrupt weights and JSON files of a model directory, rows whose answer the
run could not score or whose target is no text, `datasets` directories of several splits, held-out questions that are
training questions, and token budgets no sequence fits."""

from __future__ import annotations

import json
import re
import shutil

import datasets
import pytest
from cli_helpers import assert_one_line_error, posttrain, posttrain_here

from posttrain import config
from posttrain.core.errors import DataError
from posttrain.models.loading import load_tokenizer
from posttrain.sources import run_splits
from posttrain.sources.pairs import pairs_from_file

ROWS = [{"question": f"{i} + 1", "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}"} for i in range(8)]
OTHERS = [{"question": f"{i} * 2", "answer": f"#### {2 * i}"} for i in range(4)]  # questions ROWS has not


def write_rows(path, rows, at: int | None = None, row: dict | None = None):
    """`rows` as JSONL at `path`, the one at index `at` replaced by `row`."""
    rows = [row if i == at else r for i, r in enumerate(rows)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def good(tmp_path):
    return write_rows(tmp_path / "good.jsonl", ROWS)


@pytest.fixture
def other(tmp_path):
    """Held-out rows whose questions are not ROWS's."""
    return write_rows(tmp_path / "other.jsonl", OTHERS)


# --- A. model directories ---------------------------------------------------------------------------------------

def truncate(file):
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])


MODEL_FILES = [  # (file, how it is spoiled, fragment after the file's path)
    ("model.safetensors", truncate, "cannot be read as safetensors (truncated or corrupt)"),
    ("model.safetensors", lambda f: f.write_bytes(b"not a safetensors file " * 4), "cannot be read as safetensors"),
    ("model.safetensors", lambda f: f.write_bytes(b""), "cannot be read as safetensors"),
    ("config.json", lambda f: f.write_text("[1, 2]"), "holds a JSON list, not an object"),
    ("tokenizer.json", truncate, "cannot be read as JSON (truncated or corrupt)"),
    ("generation_config.json", lambda f: f.write_text('{"eos_token_id": '), "cannot be read as JSON"),
]


@pytest.mark.parametrize("name, spoil, fragment", MODEL_FILES,
                         ids=["truncated", "garbage", "empty", "config-list", "tokenizer-truncated", "generation"])
def test_eval_names_the_unreadable_file_of_a_model(tmp_path, tiny_model_dir, good, name, spoil, fragment):
    """Before: a SafetensorError or TypeError traceback, a message naming no file, or (generation_config.json) the
    file silently ignored, and the stop tokens with it."""
    model = shutil.copytree(tiny_model_dir, tmp_path / "model")
    spoil(model / name)
    out = tmp_path / "eval.json"
    proc = posttrain_here("eval", model, f"data.test_path={good}", "eval.num_problems=2", "-o", out)
    assert_one_line_error(proc, f"model.path: '{model / name}' {fragment}")
    assert not out.exists()


def test_run_refuses_truncated_weights_before_the_run_directory(tmp_path, tiny_model_dir, good, other):
    model = shutil.copytree(tiny_model_dir, tmp_path / "model")
    truncate(model / "model.safetensors")
    proc = posttrain("run", "recipe=sft_math", f"model.path={model}", f"data.path={good}", f"data.test_path={other}",
                     f"output_dir={tmp_path / 'o'}")
    assert_one_line_error(proc, f"model.path: '{model / 'model.safetensors'}' cannot be read as safetensors "
                                "(truncated or corrupt): ")
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.partial").exists()


# --- B. rows ------------------------------------------------------------------------------------------------------

ROW_CASES = [  # (recipe, row 3 of data.path, fragment after "row 3: ")
    ("grpo_math", {"question": "x", "answer": "seven"}, "'answer' holds no number to compare answers with ('seven')"),
    ("grpo_math", {"question": "x", "answer": [1, 2]}, "'answer' is a list, expected a string or number"),
    ("grpo_math", {"question": "x", "answer": None}, "'answer' is null"),
    ("grpo_math", {"question": "x", "answer": True}, "'answer' is a boolean, expected a string or number"),
    ("grpo_math", {"question": {"text": "x"}, "answer": "3"}, "'question' is an object, expected a string or number"),
    ("rft_math", {"question": "x", "answer": "seven"}, "'answer' holds no number"),
    ("sft_math", {"question": "x", "answer": ["#### 3"]}, "'answer' is a list, expected a string or number"),
    ("sft_math", {"question": "x", "answer": " "}, "'answer' is empty"),
]


@pytest.mark.parametrize("recipe, row, fragment", ROW_CASES,
                         ids=["no-number", "list", "null", "bool", "question-object", "rft", "sft-list", "sft-empty"])
def test_run_names_file_row_and_field_before_training(tmp_path, tiny_model_dir, good, recipe, row, fragment):
    """Before: a no-number answer stopped the run at its first step (leaving `<output_dir>.partial`, the message
    naming no file or row), a list was trained on as its text, and null was "no field 'answer'"."""
    bad = write_rows(tmp_path / "bad.jsonl", ROWS, 2, row)
    proc = posttrain_here("run", f"recipe={recipe}", f"model.path={tiny_model_dir}", f"data.path={bad}",
                          f"data.test_path={good}", f"output_dir={tmp_path / 'o'}", "train.steps=1",
                          "eval.num_problems=2")
    assert_one_line_error(proc, f"data.path: '{bad}' row 3: {fragment}")
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.partial").exists()


def test_held_out_answers_are_checked_before_eval_loads_the_model(tmp_path, tiny_model_dir):
    """Before: the model was loaded and sampled, then the judge stopped on the answer without naming the file."""
    bad = write_rows(tmp_path / "test.jsonl", ROWS, 2, {"question": "x", "answer": "seven"})
    out = tmp_path / "eval.json"
    proc = posttrain_here("eval", tiny_model_dir, f"data.test_path={bad}", "-o", out)
    assert_one_line_error(proc, f"data.test_path: '{bad}' row 3: 'answer' holds no number")
    assert not out.exists()


def test_held_out_tail_rows_keep_their_row_numbers(tmp_path, tiny_model_dir):
    """SFT trains on rows 1-5 and holds out rows 6-8 (eval.num_problems=3); row 7's answer is the judge's."""
    bad = write_rows(tmp_path / "rows.jsonl", ROWS, 6, {"question": "x", "answer": "seven"})
    proc = posttrain_here("run", "recipe=sft_math", f"model.path={tiny_model_dir}", f"data.path={bad}",
                          "eval.num_problems=3", "train.steps=1", f"output_dir={tmp_path / 'o'}")
    assert_one_line_error(proc, f"data.path: '{bad}' row 7: 'answer' holds no number")
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.partial").exists()


def splits(tiny_model_dir, recipe, *overrides):
    cfg, _ = config.load(recipe, [f"model.path={tiny_model_dir}", *overrides])
    return run_splits(cfg)


def test_an_answer_is_checked_the_way_the_run_reads_it(tmp_path, tiny_model_dir, good, other):
    """Text with no number is a fine SFT target (never judged) and a fine math-verify reference, but no reference for
    GRPO's number rule. Before: GRPO took it too, and stopped at its first step."""
    text = write_rows(tmp_path / "text.jsonl", ROWS, 2, {"question": "x", "answer": "seven apples"})
    train, _ = splits(tiny_model_dir, "sft_math", f"data.path={text}", f"data.test_path={other}")
    assert train[2]["answer"] == "seven apples"
    assert len(splits(tiny_model_dir, "grpo_math", f"data.path={text}", f"data.test_path={other}",
                      "data.answer_format=math")[0]) == 8
    with pytest.raises(DataError, match="row 3: 'answer' holds no number"):
        splits(tiny_model_dir, "grpo_math", f"data.path={text}", f"data.test_path={good}")


def test_a_pairs_file_row_that_is_not_text(tmp_path, tiny_model_dir):
    """DPO's pair file has its own fields; a rejected response that is a list was trained on as its text."""
    row = {"prompt": "1 + 1", "chosen": "#### 2", "rejected": ["#### 3"]}
    path = write_rows(tmp_path / "pairs.jsonl", [row])
    cfg, _ = config.load("dpo_math", [f"model.path={tiny_model_dir}", f"algorithm.pairs_path={path}"])
    with pytest.raises(DataError, match=f"algorithm.pairs_path: '{path}' row 1: 'rejected' is a list"):
        pairs_from_file(str(path), cfg.algorithm, load_tokenizer(tiny_model_dir, "model.path"), cfg.data)


# --- C. `datasets` directories of several splits -----------------------------------------------------------------

def save_splits(path, **splits):
    datasets.DatasetDict({name: datasets.Dataset.from_list(rows) for name, rows in splits.items()}).save_to_disk(path)
    return path


def test_a_dataset_dict_directory_gives_train_and_test(tmp_path, tiny_model_dir):
    """`load_dataset(...).save_to_disk(DIR)`: data.path reads its train split, data.test_path its test split, and a
    split's own directory names any split. Before: "dictionary update sequence element #0 has length 1"."""
    both = save_splits(tmp_path / "gsm8k", train=ROWS[:6], test=ROWS[6:])
    train, test = splits(tiny_model_dir, "sft_math", f"data.path={both}", f"data.test_path={both}")
    assert (train, test) == (ROWS[:6], ROWS[6:])
    other = save_splits(tmp_path / "other", train=ROWS[:5], validation=ROWS[5:])
    train, test = splits(tiny_model_dir, "sft_math", f"data.path={other}", f"data.test_path={other / 'validation'}")
    assert (train, test) == (ROWS[:5], ROWS[5:])


@pytest.mark.parametrize("key, wanted", [("data.path", "train"), ("data.test_path", "test")])
def test_a_missing_split_lists_those_there_and_how_to_pick_one(tmp_path, tiny_model_dir, good, key, wanted):
    saved = save_splits(tmp_path / "ds", validation=ROWS[:4], extra=ROWS[4:])
    paths = {"data.path": good, "data.test_path": good, key: saved}
    proc = posttrain_here("run", "recipe=sft_math", f"model.path={tiny_model_dir}", *(f"{k}={v}" for k, v in
                          paths.items()), f"output_dir={tmp_path / 'o'}")
    assert_one_line_error(proc, f"{key}: '{saved}' holds the splits validation, extra and no '{wanted}'",
                          f"give a split's own directory, e.g. {key}={saved / 'validation'}")
    assert not (tmp_path / "o").exists()


def test_a_dataset_dict_given_as_data_path_alone_is_held_out_on_its_test_split(tmp_path, tiny_model_dir):
    """Before: the held-out rows were the last eval.num_problems rows of its train split, and its test split was
    never read."""
    both = save_splits(tmp_path / "gsm8k", train=ROWS[:6], test=ROWS[6:])
    train, test = splits(tiny_model_dir, "sft_math", f"data.path={both}", "eval.num_problems=2")
    assert (train, test) == (ROWS[:6], ROWS[6:])


def test_a_dataset_dict_without_a_test_split_holds_out_its_tail(tmp_path, tiny_model_dir):
    only = save_splits(tmp_path / "only", train=ROWS)
    assert splits(tiny_model_dir, "sft_math", f"data.path={only}", "eval.num_problems=2") == (ROWS[:6], ROWS[6:])


# --- D. held-out questions that are training questions --------------------------------------------------------------


def test_the_training_file_as_the_held_out_file_is_refused(tmp_path, tiny_model_dir, good):
    """Before: accepted, and the held-out accuracy was measured on the training rows."""
    proc = posttrain_here("run", "recipe=sft_math", f"model.path={tiny_model_dir}", f"data.path={good}",
                          f"data.test_path={good}", "train.steps=1", "eval.num_problems=3",
                          f"output_dir={tmp_path / 'o'}")
    assert_one_line_error(proc, f"data.test_path: 3 of the 3 held-out questions evaluated ('{good}') are in "
                                f"data.path ('{good}') too")
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.partial").exists()


def test_a_question_in_both_files_is_counted(tmp_path, tiny_model_dir, good):
    test = write_rows(tmp_path / "test.jsonl", [*OTHERS, {**ROWS[5], "answer": "#### 6.0"}])  # one training question
    with pytest.raises(DataError, match=re.escape(f"data.test_path: 1 of the 5 held-out questions evaluated "
                                                  f"('{test}') is in data.path ('{good}') too")):
        splits(tiny_model_dir, "grpo_math", f"data.path={good}", f"data.test_path={test}", "eval.num_problems=5")
    # held-out rows past eval.num_problems are never evaluated, and an evaluation of none compares nothing
    assert splits(tiny_model_dir, "grpo_math", f"data.path={good}", f"data.test_path={test}", "eval.num_problems=4")
    assert splits(tiny_model_dir, "grpo_math", f"data.path={good}", f"data.test_path={good}", "eval.num_problems=0")


def test_a_held_out_tail_holds_out_whole_questions(tmp_path, tiny_model_dir):
    """A file with several rows per question (several responses each, in order or shuffled): the tail posttrain
    holds out keeps its questions whole, training leaves them out, rather than refusing a file the user cannot split
    otherwise, or evaluating on questions it trained on."""
    again = [{"question": " 0 +  1 ", "answer": "0 + 1 = 1, again\n#### 1"}, {**ROWS[3], "answer": "#### 4"}]
    rows = write_rows(tmp_path / "rows.jsonl", [*ROWS, *again])  # the tail repeats rows 1 and 4 (spacing apart)
    train, test = splits(tiny_model_dir, "sft_math", f"data.path={rows}", "eval.num_problems=2")
    assert test == again and len(train) == 6
    assert {r["question"] for r in train}.isdisjoint({" ".join(r["question"].split()) for r in test})


def test_a_dataset_dict_whose_test_split_repeats_its_train_split(tmp_path, tiny_model_dir):
    both = save_splits(tmp_path / "ds", train=ROWS, test=ROWS[6:] + OTHERS)
    with pytest.raises(DataError, match=re.escape(f"data.path: 2 of the 6 held-out questions evaluated "
                                                  f"('{both / 'test'}') are in its train split ('{both / 'train'}')")):
        splits(tiny_model_dir, "sft_math", f"data.path={both}", "eval.num_problems=6")


# --- E. token budgets ---------------------------------------------------------------------------------------------

SHORT_RUN = ["train.steps=1", "train.batch_size=2", "eval.num_problems=0", "data.train_size=20", "data.test_size=4"]


def test_a_token_budget_below_the_longest_sampled_sequence(tmp_path, tiny_model_dir):
    """Before: accepted; each sequence then ran as a micro-batch of its own (a 2-step run took over 5 minutes)."""
    proc = posttrain_here("run", "recipe=grpo_math", f"model.path={tiny_model_dir}", "train.micro_batch_tokens=4",
                          "algorithm.group_size=2", "rollout.max_new_tokens=6", *SHORT_RUN,
                          f"output_dir={tmp_path / 'o'}")
    assert_one_line_error(proc, "train.micro_batch_tokens: 4 tokens are fewer than the longest sequence takes",
                          "'s prompt,", "+ one sampled token)")
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.partial").exists()


def test_a_token_budget_below_the_longest_possible_completion_is_a_setting(tmp_path, tiny_model_dir):
    """Long generations that are mostly short: a budget that holds every prompt but not prompt + max_new_tokens is
    accepted (a long completion runs alone), as a user of long reasoning traces would set it."""
    from posttrain.data.lengths import check_token_budget

    easy = ["data.difficulty=1", "data.train_size=150", "data.test_size=20"]
    cfg, _ = config.load("grpo_math", [f"model.path={tiny_model_dir}", "train.micro_batch_tokens=40",
                                       "rollout.max_new_tokens=64", *easy])
    train = splits(tiny_model_dir, "grpo_math", *easy)[0]
    check_token_budget(load_tokenizer(tiny_model_dir, "model.path"), train, cfg, given=False)  # no error

def test_a_token_budget_below_the_longest_training_row(tmp_path, tiny_model_dir):
    """SFT's sequences are its rows: the longest (prompt + response tokens) is named."""
    rows = [*ROWS, {"question": "1 + 1 + 1 + 1", "answer": "1 + 1 + 1 + 1 = 4, counted one by one\n#### 4"}]
    path = write_rows(tmp_path / "rows.jsonl", rows)
    proc = posttrain_here("run", "recipe=sft_math", f"model.path={tiny_model_dir}", f"data.path={path}",
                          "train.micro_batch_tokens=40", *SHORT_RUN, f"output_dir={tmp_path / 'o'}")
    assert_one_line_error(proc, "train.micro_batch_tokens: 40 tokens are fewer than the longest sequence takes",
                          "(data.path row 9 is", "tokens, prompt and response)")
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.partial").exists()
