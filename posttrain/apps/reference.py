"""Reference pages generated from the code that defines them: docs/config.md from the config schema, docs/metrics.md
from the metric declarations. A table of keys or metrics written by hand drifts from the code; these are printed by

    posttrain docs config > docs/config.md     # every key: type, default, help, by group; each method's algorithm.*
    posttrain docs metrics > docs/metrics.md   # every metrics.jsonl key: unit and meaning, by where it is logged

and tests/test_reference_docs.py checks that the committed pages equal what these print.

Sources, read as they are, never listed here again:

- keys: the dataclasses of `posttrain.schema` reached from `RunConfig` (a field whose default is a dataclass is a
  group, or a sub-group such as `model.lora`), each field's docstring (the string literal under it, read from the
  source with `ast`, as Python keeps no such attribute docstring), and each registered method's `Config`;
- metrics: `posttrain.train.metrics.METRICS` (the engine's, the sources', the stages', the judge's and the workers'),
  and the "Metrics:" section of each method's module docstring (algorithms/*.py), with units from
  `posttrain.train.metrics.METHOD_UNITS`.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import sys
import textwrap
from functools import cache
from typing import Any

from posttrain.core.errors import UserError

CONFIG_COMMAND = "posttrain docs config > docs/config.md"
METRICS_COMMAND = "posttrain docs metrics > docs/metrics.md"


# -- keys ------------------------------------------------------------------------------------------------------
@cache
def field_docs(cls: type) -> dict[str, str]:
    """Field name -> the docstring under it, for `cls` and the dataclasses it inherits from (the nearest wins)."""
    docs: dict[str, str] = {}
    for klass in reversed([k for k in cls.__mro__ if dataclasses.is_dataclass(k)]):
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):  # a class built at run time has no source: its fields go undocumented
            continue
        body = ast.parse(source).body[0].body
        for node, after in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                    and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
                docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _value(value: Any) -> str:
    """A default as a recipe writes it (YAML's null, true and false)."""
    if value is dataclasses.MISSING:
        return "required"
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if value == "":
        return '`""`'
    if isinstance(value, (dict, list)):  # as a recipe writes it: {accuracy: 1.0}
        import yaml

        return f"`{yaml.safe_dump(value, default_flow_style=True, width=10**6).strip()}`"
    return f"`{value}`"


def _cell(text: str) -> str:
    """Text as one markdown table cell: one line, pipes escaped."""
    return " ".join(text.split()).replace("|", "\\|")


def _type(f: dataclasses.Field) -> str:
    tp = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    return f"`{tp}`".replace("|", "\\|")


def key_rows(cls: type, prefix: str) -> tuple[list[str], list[tuple[str, type, str]]]:
    """The table rows of `cls`'s plain keys under `prefix`, and its sub-groups (prefix, class, their docstring)."""
    rows, groups, docs = [], [], field_docs(cls)
    for f in dataclasses.fields(cls):
        default = _default(f)
        if dataclasses.is_dataclass(default):
            groups.append((f"{prefix}{f.name}", type(default), docs.get(f.name, "")))
            continue
        rows.append(f"| `{prefix}{f.name}` | {_type(f)} | {_value(default)} | {_cell(docs.get(f.name, ''))} |")
    return rows, groups


TABLE = ["| key | type | default | meaning |", "|---|---|---|---|"]


def group_section(name: str, cls: type, doc: str, level: int = 2) -> list[str]:
    """A group's heading, what it is for, its keys, then each sub-group's section."""
    rows, groups = key_rows(cls, f"{name}.")
    intro = [_cell(text) for text in (doc, inspect.cleandoc(cls.__doc__ or "")) if text and not
             text.startswith(f"{cls.__name__}(")]  # a dataclass without a docstring gets its signature as one
    out = [f"{'#' * level} `{name}`", "", *(line for text in intro for line in (text, ""))]
    parts = getattr(cls, "PARTS", ())  # a group made of parts (rollout): a table each, in their order
    for part in parts:
        part_rows, _ = key_rows(part, f"{name}.")
        out += [f"{'#' * (level + 1)} `{name}`: {part.TITLE}", "", _cell(inspect.cleandoc(part.__doc__ or "")), "",
                *TABLE, *part_rows, ""]
    if not parts:
        out += [*TABLE, *rows, ""]
    for sub, sub_cls, sub_doc in groups:
        out += group_section(sub, sub_cls, sub_doc, level + 1)
    return out


def config_page() -> str:
    """docs/config.md: the top-level keys, every group of the schema in its order, then each method's keys."""
    from posttrain import algorithms
    from posttrain.schema import RunConfig

    rows, groups = key_rows(RunConfig, "")
    docs = field_docs(RunConfig)
    out = ["# Config keys", "",
           f"Generated by `{CONFIG_COMMAND}` from the config schema (`posttrain/schema.py`, each field's docstring)",
           "and each method's `Config` (`algorithms/*.py`); do not edit it by hand: tests/test_reference_docs.py",
           "checks that it equals the command's output. A recipe sets these keys, and `key=value` overrides them on the",
           "command line (`posttrain run recipe=grpo_math train.lr=1e-6`); `posttrain config recipe=NAME` prints a",
           "recipe's resolved values. The defaults here are the schema's: a recipe usually sets its own.", "",
           "## Top-level keys", "", *TABLE]
    algorithm_doc = ""
    for row in rows:
        if row.startswith("| `algorithm` |"):  # the method's keys, validated against its plugin: below
            algorithm_doc = docs.get("algorithm", "")
            continue
        out.append(row)
    out.append("")
    for name, cls, doc in groups:
        out += group_section(name, cls, doc)
    out += ["## `algorithm`", "", _cell(algorithm_doc), "",
            "`algorithm.name` picks the method (a registered name below, or `path/to/file.py:Class`); the other "
            "`algorithm.*` keys are that method's `Config` fields:", ""]
    for name, plugin in algorithms.REGISTRY.items():
        rows, groups = key_rows(plugin.Config, "algorithm.")
        summary = (inspect.getdoc(sys.modules[plugin.__module__]) or "").split("\n", 1)[0]
        keys = [*TABLE, *rows] if rows else ["No keys of its own."]
        out += [f"### `algorithm.name={name}`", "", _cell(summary), "", *keys, ""]
        for sub, sub_cls, sub_doc in groups:
            out += group_section(sub, sub_cls, sub_doc, 4)
    return "\n".join(out).rstrip("\n") + "\n"


# -- metrics ---------------------------------------------------------------------------------------------------
ENTRY = re.compile(r"^ {4}(\S[^:]*?): (.*)$")  # `    name[, name...]: meaning` under a "Metrics...:" line


def docstring_metrics(doc: str) -> tuple[str, dict[str, str]]:
    """The "Metrics:" section of a method's module docstring: its heading's remark (the text in parentheses, if any)
    and name -> meaning, an entry naming several metrics (`clip_frac, ratio: ...`) giving the meaning to each."""
    lines = doc.splitlines()
    start = next((i for i, line in enumerate(lines) if re.match(r"^Metrics\b.*:\s*$", line)), None)
    if start is None:
        return "", {}
    remark = re.search(r"\((.*)\)", lines[start])
    entries: dict[str, str] = {}
    last: list[str] = []
    for line in lines[start + 1:]:
        if line.strip() and not line.startswith("    "):
            break
        if (match := ENTRY.match(line)) and not line.startswith("     "):
            last = [name.strip() for name in match.group(1).split(",")]
            for name in last:
                entries[name] = match.group(2).strip()
        elif line.strip() and last:  # a continuation of the entry above
            for name in last:
                entries[name] += " " + line.strip()
    return (remark.group(1) if remark else ""), entries


def method_metrics() -> dict[str, tuple[str, dict[str, str]]]:
    """Registered method -> its docstring's metrics (remark, name -> meaning)."""
    from posttrain import algorithms

    return {name: docstring_metrics(inspect.getdoc(sys.modules[plugin.__module__]) or "")
            for name, plugin in algorithms.REGISTRY.items()}


def declared(key: str, names) -> bool:
    """Whether metrics.jsonl's `key` is one of `names`, or matches a pattern among them (`reward/<name>`: any one
    path segment in place of `<name>`)."""
    if key in names:
        return True
    return any(re.fullmatch("[^/]+".join(map(re.escape, re.split(r"<[^>]+>", n))), key) for n in names if "<" in n)


def metrics_page() -> str:
    """docs/metrics.md: the shared metrics by where they are logged, then each method's own."""
    from posttrain.train.metrics import METHOD_UNITS, METRICS

    out = ["# Metrics", "",
           f"Generated by `{METRICS_COMMAND}` from where each metric is declared: `posttrain/train/metrics.py` for "
           "those every method shares, and each method's module docstring (its \"Metrics:\" section, "
           "`algorithms/*.py`) for its own; do not edit it by hand: tests/test_reference_docs.py checks that it "
           "equals the command's output, and that every key a run writes is declared.", "",
           "Each line of `metrics.jsonl` is one step: these keys, those that apply to the run (a key appears only "
           "where its feature is on). A name with `<...>` stands for a family (`reward/<name>`: one per reward). "
           "`report_to` sends the same numbers to trackers (docs/outputs.md).", ""]
    for section, (where, entries) in METRICS.items():
        out += [f"## {section}", "", _cell(where), "", "| metric | unit | meaning |", "|---|---|---|"]
        out += [f"| `{name}` | {_cell(unit)} | {_cell(meaning)} |" for name, (unit, meaning) in entries.items()]
        out.append("")
    out += ["## Each method's own", "",
            "Logged by the method's plugin (`coefficient` and `prepare`), as means over the step's micro-batches; "
            "every method also logs `objective` (what it minimises) beside the engine's `loss`.", ""]
    for method, (remark, entries) in method_metrics().items():
        out += [f"### `algorithm.name={method}`", ""]
        if remark:
            out += [_cell(remark[0].upper() + remark[1:]) + ".", ""]
        out += ["| metric | unit | meaning |", "|---|---|---|"]
        out += [f"| `{name}` | {_cell(METHOD_UNITS.get(name, ''))} | {_cell(meaning)} |"
                for name, meaning in entries.items()]
        out.append("")
    return "\n".join(out).rstrip("\n") + "\n"


PAGES = {"config": config_page, "metrics": metrics_page}


def main(page: str) -> int:
    if page not in PAGES:
        raise UserError(f"docs: unknown page {page!r}; known: {', '.join(PAGES)}")
    print(PAGES[page](), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:2]))
