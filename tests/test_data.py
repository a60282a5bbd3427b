"""Offline data sources: files, datasets, the GSM8K fixture, and their errors."""

import json
import re

import datasets
import pytest
import torch

from posttrain.core.batch import collate
from posttrain.core.errors import DataError
from posttrain.data import RowSampler, check_fields, load_splits, read_rows
from posttrain.schema import DataConfig


def test_jsonl_parquet_dataset_dir_and_in_memory(tmp_path, gsm8k_rows):
    rows = gsm8k_rows[:5]
    ds = datasets.Dataset.from_list(rows)
    ds.to_parquet(tmp_path / "rows.parquet")
    ds.save_to_disk(str(tmp_path / "dsdir"))
    assert read_rows(tmp_path / "rows.parquet") == rows
    assert read_rows(tmp_path / "dsdir") == rows
    assert read_rows(ds) == rows


def test_gsm8k_fixture(gsm8k_rows):
    assert len(gsm8k_rows) == 40
    check_fields(gsm8k_rows, ["question", "answer"], "data.path", "gsm8k")


@pytest.mark.parametrize("content, message", [
    ("", "holds no rows"),
    ('{"question": "a"}\nnot json\n', "line 2 is not valid JSON"),
    ("[1, 2]\n", "line 1 is not a JSON object"),
])
def test_bad_files(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(DataError, match=message):
        read_rows(path)


def test_missing_file():
    with pytest.raises(DataError, match="data.path: no such file or directory 'nope.jsonl'"):
        read_rows("nope.jsonl")


def test_row_missing_field_is_named(tmp_path):
    """Like every other data error, the message starts with the config key, then names the file and the row."""
    good, bad = tmp_path / "good.jsonl", tmp_path / "bad.jsonl"
    good.write_text(json.dumps({"question": "1+1", "answer": "2"}))
    bad.write_text("\n".join(json.dumps(r) for r in [{"question": "1+1", "answer": "2"}, {"question": "2+2"}]))
    message = f"data.path: '{bad}' row 2 has no field 'answer' (fields: question)"
    with pytest.raises(DataError, match=re.escape(message)):
        load_splits(DataConfig(path=str(bad), test_path=str(good)), ["question", "answer"], 1)
    with pytest.raises(DataError, match=re.escape(f"data.test_path: '{bad}' row 2 has no field 'answer'")):
        load_splits(DataConfig(path=str(good), test_path=str(bad)), ["question", "answer"], 1)


def test_held_out_tail(tmp_path, gsm8k_rows):
    path = tmp_path / "g.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in gsm8k_rows))
    train, test = load_splits(DataConfig(path=str(path)), ["question", "answer"], 10)
    assert len(train) == 30 and test == gsm8k_rows[30:]
    with pytest.raises(DataError, match="too few to hold out"):
        load_splits(DataConfig(path=str(path)), ["question", "answer"], 40)


def test_collate_layout():
    """Prompts [5, 6] and [7] with responses [1] and [2, 3]: P = 2, R = 2, prompts left-padded, responses right."""
    b = collate([[5, 6], [7]], [[1], [2, 3]], pad_id=0)
    assert b.prompt_len == 2
    assert b.input_ids.tolist() == [[5, 6, 1, 0], [0, 7, 2, 3]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 0], [0, 1, 1, 1]]
    assert b.mask.tolist() == [[1, 0], [1, 1]]
    assert [len(m) for m in b.split(1)] == [1, 1]
    assert torch.equal(b.select(torch.tensor([1])).input_ids, b.input_ids[1:])


def test_sampler_is_seeded_and_sharded():
    rows = [{"i": i} for i in range(10)]
    a, b = RowSampler(rows, 3).next(25), RowSampler(rows, 3).next(25)
    assert a == b and {r["i"] for r in a[:10]} == set(range(10))  # one full epoch before repeating
    shard0, shard1 = RowSampler(rows, 3, 0, 2).next(5), RowSampler(rows, 3, 1, 2).next(5)
    assert {r["i"] for r in shard0}.isdisjoint({r["i"] for r in shard1})


def test_trimmed_drops_columns_that_are_padding_in_every_row():
    """Prompts [5 6 | 7] and responses [8 | 9 10]: one prompt column and one response column are padding in every
    row of the pair taken alone; trimming cuts them and the per-token tensors, and keeps every real token."""
    b = collate([[5, 6], [7], [1, 2, 3]], [[8], [9, 10], [4, 4, 4]], pad_id=0)  # P = 3, R = 3
    b.old_logp = torch.arange(9.0).view(3, 3)
    b.extra["values"] = -b.old_logp
    b.extra["score"] = torch.tensor([1.0, 2.0, 3.0])
    pair = b.select(slice(0, 2)).trimmed()
    assert pair.prompt_len == 2 and pair.input_ids.tolist() == [[5, 6, 8, 0], [0, 7, 9, 10]]
    assert pair.mask.tolist() == [[1, 0], [1, 1]] and pair.old_logp.tolist() == [[0, 1], [3, 4]]
    assert pair.extra["values"].tolist() == [[0, -1], [-3, -4]] and pair.extra["score"].tolist() == [1, 2]
    assert pair.response_ids.tolist() == [[8, 0], [9, 10]]
    assert b.trimmed() is b  # nothing to cut
