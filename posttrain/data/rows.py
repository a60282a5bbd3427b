"""Rows: read from a file, a `datasets` object or the embedded task, checked, split, drawn, and tokenised.

Offline methods train on (prompt, response) rows; online methods take prompts from the same rows and sample the
responses (`posttrain.rollout`). A row is a dict; the config names the fields that hold the question, the target
response and the reference answer.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Mapping
from numbers import Number
from pathlib import Path
from typing import Any

from posttrain.core.errors import ConfigError, DataError
from posttrain.data import embedded, gym
from posttrain.schema import PRESETS, PYTHON_ROWS, DataConfig


def read_rows(source: Any, key: str = "data.path", split: str = "train") -> list[dict]:
    """Rows from a .jsonl / .parquet file, a `datasets` directory (save_to_disk) or an in-memory `datasets.Dataset`.

    A `datasets` directory of several splits (a `DatasetDict`'s, as `load_dataset(...).save_to_disk` writes) gives its
    `split`; another split is read by naming its own directory (`DIR/validation`).

    Raises:
        DataError: naming `key` and the file, when it is missing, unreadable, malformed or empty, or lacks `split`.
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

                rows = [dict(r) for r in _split_of(datasets.load_from_disk(str(path)), path, key, split)]
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


def _split_of(saved: Any, path: Path, key: str, split: str):
    """What `datasets.load_from_disk(path)` gave (`saved`) if it is a `Dataset`, its `split` if it is a `DatasetDict`
    (a mapping of splits)."""
    if not isinstance(saved, Mapping):
        return saved
    if split not in saved:
        splits = list(saved)
        if not splits:
            raise DataError(f"{key}: '{path}' is a `datasets` directory of splits, and holds none")
        example = next((s for s in splits if s != "train"), splits[0])
        raise DataError(f"{key}: '{path}' holds the splits {', '.join(splits)} and no '{split}', the one {key} "
                        f"reads; give a split's own directory, e.g. {key}={path / example}")
    return saved[split]


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


def check_fields(rows: list[dict], fields: list[str], key: str, source: Any,
                 checks: dict[str, Callable[[str], str | None]] | None = None, first: int = 1) -> None:
    """Every row has every field as a non-empty string or number that passes its check in `checks`, if any (field ->
    a function of the field's text saying what is wrong with it, or None); otherwise a DataError naming the config
    `key`, the file (`source`), the row (numbered from `first`) and the field."""
    checks = checks or {}
    for n, row in enumerate(rows, first):
        for name in fields:
            if name not in row:
                raise DataError(f"{key}: '{source}' row {n} has no field '{name}' (fields: {', '.join(row) or 'none'})")
            problem = _problem(row[name], checks.get(name))
            if problem is not None:
                raise DataError(f"{key}: '{source}' row {n}: '{name}' {problem}")


def _problem(value: Any, check: Callable[[str], str | None] | None) -> str | None:
    """What is wrong with a field's value (null, not a string or number, empty, or what `check` says), or None."""
    if value is None:
        return "is null"
    if isinstance(value, bool) or not isinstance(value, (str, Number)):  # Number: also Parquet's decimals
        return f"is {_kind(value)}, expected a string or number"
    text = str(value)
    if not text.strip():
        return "is empty"
    wrong = check(text) if check is not None else None
    return f"{wrong} ({text[-80:]!r})" if wrong else None


def _kind(value: Any) -> str:
    """A JSON reader's name for the type of `value`: a list, an object, a boolean."""
    if isinstance(value, (list, tuple)):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return "a boolean" if isinstance(value, bool) else f"a {type(value).__name__}"


def load_splits(cfg: DataConfig, fields: list[str], num_test: int,
                reference: Callable[[str], str | None] | None = None,
                judged: bool = False, given: Mapping[str, Any] | None = None) -> tuple[list[dict], list[dict]]:
    """Training and held-out rows: the embedded task, or `path` (and `test_path`) with every row checked.

    Training rows need `fields`; held-out rows the question and the reference answer. `reference` says what keeps an
    answer's text from being checked by the judge (None: nothing does): it is asked of every held-out row's answer, and
    of every training row's when `judged` (the method judges its training rows' answers too), so a row the run could
    not score is refused before training, naming its file, row and field. With only `test_path` (enough for
    `posttrain eval`) there are no training rows. Without `test_path`, the held-out rows are `path`'s own test split
    when it is a `datasets` directory of splits that has one, else its last `num_test` rows. `given` holds rows
    given from Python (a list of dicts or a `datasets.Dataset`) for `data.path` and `data.test_path`, which then
    name them as `schema.PYTHON_ROWS` does; they are checked as a file's rows are.

    Raises:
        DataError: a row lacks a field or an answer the judge can read, or a held-out question to be evaluated (of
            the first `num_test`) is a training question too.
    """
    if cfg.preset == "embedded":
        return embedded.task_splits(cfg.seed, cfg.train_size, cfg.test_size, cfg.difficulty, cfg.max_operand,
                                     cfg.task)
    if cfg.gym_task is not None:
        train, test = gym.task_splits(cfg.gym_task, cfg.task_options, cfg.seed, cfg.train_size, cfg.test_size)
        if cfg.response_field in fields and any(r[cfg.response_field] is None for r in train):
            raise DataError(f"data.preset: {cfg.preset}'s entries hold no answer to train on (its scorer checks the "
                            "model's own); SFT and the embedded model's warm-up need one: give model.path and an "
                            "online method")
        return train, test
    answer = {cfg.answer_field: reference} if reference is not None else {}
    given = given or {}
    for key, value in (("data.path", cfg.path), ("data.test_path", cfg.test_path)):
        if value == PYTHON_ROWS[key] and key not in given:
            raise DataError(f"{key}: {value} names rows given from Python (posttrain.Run's data=/test_data=), and "
                            "none were given")
    train = read_rows(given.get("data.path", cfg.path), "data.path") if cfg.path is not None else []
    held_out = held_out_split(cfg.path) if cfg.test_path is None and cfg.path is not None else None
    if cfg.test_path is None and held_out is None:  # hold out the tail, so evaluation never sees a training row
        if len(train) <= num_test:
            raise DataError(f"data.path: '{cfg.path}' has {len(train)} rows, too few to hold out {num_test} "
                            f"for eval; set data.test_path or a smaller eval.num_problems")
        train, test = train[: len(train) - num_test], train[len(train) - num_test :]
        # a file with several rows per question (several responses each, as augmented or rejection-sampled sets
        # have) holds out whole questions: training keeps none of the held-out ones, so none is evaluated on a row it
        # was trained on
        held = {_question(row, cfg.prompt_field) for row in test[:num_test] if cfg.prompt_field in row}
        train = [row for row in train if cfg.prompt_field not in row or _question(row, cfg.prompt_field) not in held]
    if cfg.path is not None:
        check_fields(train, fields, "data.path", cfg.path, answer if judged else None)
    if cfg.test_path is not None:
        test = read_rows(given.get("data.test_path", cfg.test_path), "data.test_path", split="test")
        check_fields(test, [cfg.prompt_field, cfg.answer_field], "data.test_path", cfg.test_path, answer)
        where = ("data.test_path", f"'{cfg.test_path}'", f"data.path ('{cfg.path}')")
    elif held_out is not None:  # a DatasetDict's own test split, as data.test_path=DIR would read it
        test = read_rows(held_out, "data.path")
        check_fields(test, [cfg.prompt_field, cfg.answer_field], "data.path", held_out, answer)
        where = ("data.path", f"'{held_out}'", f"its train split ('{held_out.with_name('train')}')")
    else:
        check_fields(test, [cfg.prompt_field, cfg.answer_field], "data.path", cfg.path, answer, first=len(train) + 1)
        where = ("data.path", f"'{cfg.path}' rows {len(train) + 1}-{len(train) + len(test)}",
                 f"its training rows (rows 1-{len(train)})")
    _check_apart(train, test[:num_test], cfg.prompt_field, *where)
    return train, test


def held_out_split(path: str | Path) -> Path | None:
    """The directory of the `test` split of a `datasets` directory of splits (`DatasetDict.save_to_disk`, which lists
    them in dataset_dict.json), where `data.path` alone names one: its held-out rows. None for anything else."""
    listing = Path(path) / "dataset_dict.json"
    try:
        splits = json.loads(listing.read_text()).get("splits", [])
    except (OSError, ValueError, AttributeError):  # not a directory of splits, or not the listing datasets writes
        return None
    return Path(path) / "test" if "test" in splits else None


def _question(row: dict, field: str) -> str:
    return " ".join(str(row[field]).split())  # spacing apart, the same question


def _check_apart(train: list[dict], evaluated: list[dict], field: str, key: str, held_out: str, trained: str) -> None:
    """Refuses held-out rows to be evaluated whose question a training row asks too: their accuracy would be measured
    on training data. Real splits share none (GSM8K's train and test, for one), so even a few mean the files were
    mixed up (data.test_path naming the training file) or built with a leak; it is the files that must change.

    Args:
        train: the training rows.
        evaluated: the held-out rows evaluated (the first eval.num_problems).
        field: the question's field.
        key, held_out, trained: the config key to name, where the held-out rows are, and where the training rows are.
    """
    if not train or not evaluated:
        return
    asked = {_question(row, field) for row in train}
    shared = sum(_question(row, field) in asked for row in evaluated)
    if shared:
        raise DataError(f"{key}: {shared} of the {len(evaluated)} held-out questions evaluated ({held_out}) "
                        f"{'is' if shared == 1 else 'are'} in {trained} too, so held-out accuracy would be measured "
                        "on training data; remove them from one of the two")


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


def prompt_messages(row: dict, cfg: DataConfig) -> list[dict]:
    template = cfg.template or PRESETS[cfg.layout_of(cfg.preset)]["chat"]
    system = [{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []
    return system + [{"role": "user", "content": template.replace("{prompt}", str(row[cfg.prompt_field]))}]


def prompt_texts(rows: list[dict], cfg: DataConfig, tokenizer=None) -> list[str]:
    """Each row's prompt as text: its question in the template, rendered by the chat template when one is used
    (which needs `tokenizer`), else after the system prompt's line."""
    if uses_chat(tokenizer, cfg):
        return [tokenizer.apply_chat_template(prompt_messages(r, cfg), tokenize=False, add_generation_prompt=True)
                for r in rows]
    template = cfg.template or PRESETS[cfg.layout_of(cfg.preset)]["raw"]
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
            whole = tokenizer.apply_chat_template(prompt_messages(row, cfg) + [{"role": "assistant", "content": text}],
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
