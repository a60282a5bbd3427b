"""Rows: read from a file, a `datasets` object or the embedded task, checked, split, drawn, and tokenised.

Offline methods train on (prompt, response) rows; online methods take prompts from the same rows and sample the
responses (`posttrain.rollout`). A row is a dict; the config names the fields that hold the question, the target
response and the reference answer.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from posttrain.core.errors import ConfigError, DataError
from posttrain.data import embedded
from posttrain.schema import PRESETS, DataConfig


def read_rows(source: Any, key: str = "data.path") -> list[dict]:
    """Rows from a .jsonl / .parquet file, a `datasets` directory (save_to_disk) or an in-memory `datasets.Dataset`.

    Raises:
        DataError: naming `key` and the file, when it is missing, unreadable, malformed or empty.
    """
    if not isinstance(source, (str, Path)):
        rows = [dict(r) for r in source]  # a datasets.Dataset or any iterable of mappings
    else:
        path = Path(source)
        if not path.exists():
            raise DataError(f"{key}: no such file or directory '{path}'")
        try:
            if path.is_dir():
                import datasets

                rows = [dict(r) for r in datasets.load_from_disk(str(path))]
            elif path.suffix == ".parquet":
                import pyarrow.parquet as pq

                rows = pq.read_table(path).to_pylist()
            else:
                rows = _read_jsonl(path, key)
        except DataError:
            raise
        except Exception as err:  # each reader raises its own types; the user needs the file and the reason
            raise DataError(f"{key}: cannot read '{path}' ({type(err).__name__}: {str(err).splitlines()[0]})") from None
    if not rows:
        raise DataError(f"{key}: '{source}' holds no rows")
    return rows


def _read_jsonl(path: Path, key: str) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{key}: '{path}' line {n} is not valid JSON ({err.msg})") from None
            if not isinstance(row, dict):
                raise DataError(f"{key}: '{path}' line {n} is not a JSON object")
            rows.append(row)
    return rows


def check_fields(rows: list[dict], fields: list[str], key: str, source: Any) -> None:
    """Every row has every field as a non-empty string (or number); otherwise a DataError naming the config `key`,
    the file (`source`) and the row."""
    for n, row in enumerate(rows, 1):
        for name in fields:
            value = row.get(name)
            if value is None or (isinstance(value, str) and not value.strip()):
                raise DataError(f"{key}: '{source}' row {n} has no field '{name}' (fields: {', '.join(row) or 'none'})")


def load_splits(cfg: DataConfig, fields: list[str], num_test: int) -> tuple[list[dict], list[dict]]:
    """Training and held-out rows: the embedded task, or `path` (and `test_path`) with `fields` checked.

    With only `test_path` (enough for `posttrain eval`) there are no training rows."""
    if cfg.preset == "embedded":
        return embedded.task_splits(cfg.seed, cfg.train_size, cfg.test_size, cfg.difficulty, cfg.max_operand)
    train = []
    if cfg.path is not None:
        train = read_rows(cfg.path, "data.path")
        check_fields(train, fields, "data.path", cfg.path)
    if cfg.test_path is not None:
        test = read_rows(cfg.test_path, "data.test_path")
        check_fields(test, [cfg.prompt_field, cfg.answer_field], "data.test_path", cfg.test_path)
    else:  # hold out the tail, so evaluation never sees a training row
        if len(train) <= num_test:
            raise DataError(f"data.path: '{cfg.path}' has {len(train)} rows, too few to hold out {num_test} "
                            f"for eval; set data.test_path or a smaller eval.num_problems")
        train, test = train[: len(train) - num_test], train[len(train) - num_test :]
    return train, test


def uses_chat(tokenizer, cfg: DataConfig) -> bool:
    """Whether prompts go through the tokenizer's chat template (`data.chat_template`: auto, true or false).

    Raises:
        ConfigError: chat_template is true and the tokenizer has none.
    """
    has = bool(getattr(tokenizer, "chat_template", None)) if tokenizer is not None else False
    if cfg.chat_template is True and not has:
        raise ConfigError("data.chat_template: true, but the model's tokenizer has no chat template "
                          "(set it to auto or false, or add chat_template to tokenizer_config.json)")
    return has and cfg.chat_template is not False


def _messages(row: dict, cfg: DataConfig) -> list[dict]:
    template = cfg.template or PRESETS[cfg.preset]["chat"]
    system = [{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []
    return system + [{"role": "user", "content": template.replace("{prompt}", str(row[cfg.prompt_field]))}]


def prompt_texts(rows: list[dict], cfg: DataConfig, tokenizer=None) -> list[str]:
    """Each row's prompt as text: its question in the template, rendered by the chat template when one is used
    (which needs `tokenizer`), else after the system prompt's line."""
    if uses_chat(tokenizer, cfg):
        return [tokenizer.apply_chat_template(_messages(r, cfg), tokenize=False, add_generation_prompt=True)
                for r in rows]
    template = cfg.template or PRESETS[cfg.preset]["raw"]
    head = f"{cfg.system_prompt}\n" if cfg.system_prompt else ""
    return [head + template.replace("{prompt}", str(r[cfg.prompt_field])) for r in rows]


def prompt_ids(tokenizer, rows: list[dict], cfg: DataConfig) -> list[list[int]]:
    """Token ids of each row's prompt, cut from the left to `max_prompt_len`. A rendered chat template carries its
    own special tokens (BOS among them), so none are added to it."""
    texts = prompt_texts(rows, cfg, tokenizer)
    encoded = tokenizer(texts, add_special_tokens=not uses_chat(tokenizer, cfg))["input_ids"]
    return [ids[-cfg.max_prompt_len :] for ids in encoded]


def response_ids(tokenizer, rows: list[dict], cfg: DataConfig) -> list[list[int]]:
    """Token ids of each row's target response, ending in the token that ends a turn, cut to `max_response_len`.

    Without a chat template: the response's tokens and EOS. With one: what the template writes for the assistant's
    turn after the prompt (its end-of-turn token included, the whitespace after it left out), so SFT teaches the
    model to stop the way sampling stops; when the template's rendering does not extend the prompt's, the
    response's tokens and EOS.
    """
    texts = [str(r[cfg.response_field]) for r in rows]
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    plain = [ids + [tokenizer.eos_token_id] for ids in encoded]
    if uses_chat(tokenizer, cfg):
        specials = set(tokenizer.all_special_ids)
        prompts = tokenizer(prompt_texts(rows, cfg, tokenizer), add_special_tokens=False)["input_ids"]
        for i, (row, text) in enumerate(zip(rows, texts)):
            whole = tokenizer.apply_chat_template(_messages(row, cfg) + [{"role": "assistant", "content": text}],
                                                  tokenize=False)
            ids = tokenizer(whole, add_special_tokens=False)["input_ids"]
            turn = ids[len(prompts[i]) :] if ids[: len(prompts[i])] == prompts[i] else []
            ends = [t for t, tok in enumerate(turn) if tok in specials]
            if ends:
                plain[i] = turn[: ends[0] + 1]
    return [ids if len(ids) <= cfg.max_response_len else ids[: cfg.max_response_len - 1] + ids[-1:] for ids in plain]


def completion_texts(tokenizer, batch) -> list[str]:
    """The text of each sampled response of `batch`, without padding or stop tokens."""
    return tokenizer.batch_decode(batch.response_ids, skip_special_tokens=True)


class RowSampler:
    """Endless, seeded, reshuffled-each-epoch draws of rows; each data-parallel rank gets its own shard."""

    def __init__(self, rows: list[dict], seed: int, rank: int = 0, world: int = 1):
        if not rows:
            raise DataError("data.path: no training rows (data.test_path alone is enough only for posttrain eval)")
        self.rows = rows[rank::world] or rows
        self.rng = random.Random(seed * 1009 + rank)
        self.order: list[int] = []

    def at(self, step: int) -> None:
        """Called by the engine before each step's draws (`step`: steps done so far); uniform draws ignore it."""

    def state_dict(self) -> dict:
        """The generator's state and what is left of this epoch's order: enough to draw the same rows next."""
        return {"rng": self.rng.getstate(), "order": list(self.order)}

    def load_state_dict(self, state: dict) -> None:
        self.rng.setstate(state["rng"])
        self.order = list(state["order"])

    def next(self, n: int) -> list[dict]:
        out = []
        while len(out) < n:
            if not self.order:
                self.order = list(range(len(self.rows)))
                self.rng.shuffle(self.order)
            out.append(self.rows[self.order.pop()])
        return out
