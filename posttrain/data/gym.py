"""Procedurally generated tasks from reasoning-gym as rows: `data.preset=reasoning_gym:TASK`.

reasoning-gym (Stojanovski et al. 2025, arXiv:2505.24760; the `reasoning-gym` extra) generates problems of about a
hundred tasks (chain_sum, basic_arithmetic, countdown, word_sorting, sudoku, ...), each entry a question, an answer and
the metadata its task's scorer reads. Nothing is downloaded: entry i of a task under seed s is a function of (s, i)
and the task's config, `data.task_options`.

Each row holds:
- `question`: the entry's question, the prompt;
- `response`: `#### ANSWER`, the target of SFT and of the embedded model's warm-up;
- `reference`: JSON {"task", "options", "entry"}, what `posttrain.rewards.gym_answer` scores a completion against
  (`reference` writes it, `read_reference` reads it back: tuples are kept as tuples, since some scorers compare the
  answer they parse with a tuple in the entry's metadata, arc_agi's board among them).

The held-out split comes from a seed of its own (the embedded task's offset), and no training row repeats one of its
questions, as with the embedded task.
"""

from __future__ import annotations

import difflib
import json
from typing import Any

from posttrain.core.errors import ConfigError
from posttrain.data.embedded import TEST_SEED_OFFSET

TRIES = 50  # entries drawn per row wanted, at most, before a task is found to have too few distinct questions


def dataset(task: str, options: dict[str, Any], seed: int = 0, size: int = 1):
    """reasoning-gym's dataset of `task` under `options`, its first entry drawn (a value of a wrong type may only
    fail there), or a ConfigError naming the key that is wrong."""
    try:
        import reasoning_gym
        from reasoning_gym.factory import DATASETS
    except ImportError:
        raise ConfigError(f"data.preset: reasoning_gym:{task} needs the reasoning-gym package "
                          "(pip install 'posttrain[reasoning-gym]')") from None
    if task not in DATASETS:
        near = difflib.get_close_matches(task, DATASETS, n=3)
        hint = f"; did you mean {', '.join(near)}?" if near else f" ({len(DATASETS)} tasks: reasoning_gym.factory)"
        raise ConfigError(f"data.preset: reasoning-gym has no task {task!r}{hint}")
    known = [k for k in getattr(DATASETS[task][1], "__dataclass_fields__", {}) if k not in ("seed", "size")]
    for key in options:
        if key not in known:
            raise ConfigError(f"data.task_options.{key}: {task} has no such option (its options: {', '.join(known)})")
    try:
        entries = reasoning_gym.create_dataset(task, **options, seed=seed, size=size)
        entries[0]
        return entries
    except (AssertionError, TypeError, ValueError) as err:  # the config's own validate(), or a value of a wrong type
        raise ConfigError(f"data.task_options: {task} refuses {options}: {err}") from None


TUPLE = "__tuple__"  # how `reference` writes a tuple, which JSON would read back as a list


def _tagged(value: Any) -> Any:
    if isinstance(value, tuple):
        return {TUPLE: [_tagged(v) for v in value]}
    if isinstance(value, list):
        return [_tagged(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _tagged(v) for k, v in value.items()}
    return value


def _untagged(obj: dict) -> Any:
    return tuple(obj[TUPLE]) if obj.keys() == {TUPLE} else obj


def reference(task: str, options: dict[str, Any], entry: dict[str, Any]) -> str:
    """A row's `reference`: the task, its options and the entry, as JSON (anything JSON has no type for as its str)."""
    return json.dumps(_tagged({"task": task, "options": options, "entry": entry}), sort_keys=True, default=str)


def read_reference(text: str) -> dict[str, Any]:
    """`reference`'s dict again, tuples as tuples. Raises ValueError for text that is not JSON."""
    return json.loads(text, object_hook=_untagged)


def row(task: str, options: dict[str, Any], entry: dict[str, Any]) -> dict[str, str | None]:
    """One posttrain row of a reasoning-gym entry (module docstring). A task whose entries hold no answer (its scorer
    checks a plan or an assignment: boxnet, graph_color, ...) gives no response (None), which a method that trains on
    responses, or the embedded model's warm-up, refuses in one line."""
    response = None if entry["answer"] is None else f"#### {entry['answer']}"
    return {"question": entry["question"], "response": response, "reference": reference(task, options, entry)}


def split(task: str, options: dict[str, Any], seed: int, size: int, exclude: set[str] = frozenset(),
          key: str = "data.train_size") -> list[dict]:
    """`size` rows with distinct questions from `task` under `seed`, none of them in `exclude` (`key`: the size's
    config key, for the error when the task has too few)."""
    entries = dataset(task, options, seed, size * TRIES)
    rows, seen = [], set(exclude)
    for i in range(len(entries)):
        entry = entries[i]
        if entry["question"] not in seen:
            seen.add(entry["question"])
            rows.append(row(task, options, entry))
            if len(rows) == size:
                return rows
    raise ConfigError(f"{key}: reasoning_gym:{task} gave too few distinct questions for {size} rows "
                      f"(after {len(entries)} draws); lower data.train_size or data.test_size, or widen "
                      "data.task_options")


def task_splits(task: str, options: dict[str, Any], seed: int, train_size: int,
                test_size: int) -> tuple[list[dict], list[dict]]:
    """(train, test) rows of a reasoning-gym task; test questions never appear in train."""
    test = split(task, options, seed + TEST_SEED_OFFSET, test_size, key="data.test_size")
    return split(task, options, seed, train_size, {r["question"] for r in test}), test
