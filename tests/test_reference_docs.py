"""The generated reference pages (posttrain/apps/reference.py): docs/config.md and docs/metrics.md equal what
`posttrain docs config|metrics` prints, every key of the schema is on the page with its help, every method's metric
has a unit, and every key that small real runs write to metrics.jsonl is declared."""

import dataclasses
import json
from pathlib import Path

import pytest
from cli_helpers import posttrain
from conftest import EASY

from posttrain import algorithms
from posttrain.apps import reference
from posttrain.schema import RunConfig
from posttrain.train.metrics import METHOD_UNITS, METRICS

DOCS = Path(__file__).resolve().parents[1] / "docs"


@pytest.mark.parametrize("page, command", [("config", reference.CONFIG_COMMAND),
                                           ("metrics", reference.METRICS_COMMAND)])
def test_the_committed_page_is_the_generated_one(page, command):
    """What the command prints (through the real command line, once) is the page as committed."""
    proc = posttrain("docs", page)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == reference.PAGES[page]()
    committed = (DOCS / f"{page}.md").read_text()
    assert committed == proc.stdout, f"docs/{page}.md is out of date; regenerate it: {command}"


def schema_keys(cls: type, prefix: str = "") -> list[str]:
    """Every plain key under `cls`, sub-groups walked: the schema as it is, whatever its groups."""
    keys = []
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            keys += schema_keys(type(default), f"{prefix}{f.name}.")
        elif f.name != "algorithm":
            keys.append(f"{prefix}{f.name}")
    return keys


def test_every_key_is_on_the_config_page_with_its_help():
    """Each key of every group, and each method's algorithm.* keys, has a row with a help text (a field without a
    docstring under it would leave the cell empty)."""
    page = reference.config_page()
    rows = {line.split("|")[1].strip(" `"): line.split("|")[-2].strip() for line in page.splitlines()
            if line.startswith("| `")}
    keys = schema_keys(RunConfig) + [f"algorithm.{f.name}" for p in algorithms.REGISTRY.values()
                                     for f in dataclasses.fields(p.Config)]
    assert keys and not [k for k in keys if k not in rows], "keys missing from docs/config.md"
    assert not [k for k in keys if not rows[k]], "keys without help: give the field a docstring in the schema"
    for name in algorithms.REGISTRY:
        assert f"### `algorithm.name={name}`" in page


def test_a_sub_group_is_followed_not_listed():
    """A group's dataclass field is a section of its own, found from the schema: the generator holds no list."""

    @dataclasses.dataclass
    class Inner:
        depth: int = 3
        """How deep."""

    @dataclasses.dataclass
    class Outer:
        width: float = 1.5
        """How wide."""
        inner: Inner = dataclasses.field(default_factory=Inner)
        """The inner part."""

    lines = reference.group_section("outer", Outer, "")
    assert "| `outer.width` | `float` | `1.5` | How wide. |" in lines
    assert "### `outer.inner`" in lines and "| `outer.inner.depth` | `int` | `3` | How deep. |" in lines


def test_the_docstring_parser_reads_every_shape_of_entry():
    """One name, several names sharing a meaning, a continuation line, and the heading's remark."""
    doc = ("Title.\n\nMetrics (means over the batch):\n    a: first.\n    b, c: shared\n        and continued.\n"
           "    d: last.\n\nAfter.\n    e: not a metric.\n")
    remark, entries = reference.docstring_metrics(doc)
    assert remark == "means over the batch"
    assert entries == {"a": "first.", "b": "shared and continued.", "c": "shared and continued.", "d": "last."}


def test_every_method_metric_has_a_unit():
    missing = {name for _, entries in reference.method_metrics().values() for name in entries} - set(METHOD_UNITS)
    assert not missing, f"add a unit for each to METHOD_UNITS in posttrain/train/metrics.py: {sorted(missing)}"


def test_a_pattern_matches_one_segment():
    names = {"reward/<name>", "reward/<name>/std", "env/turns"}
    assert reference.declared("reward/my_rewards.brevity", names)
    assert reference.declared("reward/accuracy/std", names)
    assert reference.declared("env/turns", names) and not reference.declared("env/calls", names)
    assert not reference.declared("reward/a/b/c", names)


TINY = ["train.threads=1", "train.steps=2", "train.batch_size=2", "rollout.max_new_tokens=8", "eval.num_problems=2",
        *EASY, "-q"]
# Runs that between them switch on every feature that logs metrics of its own, each a plain CLI run of two steps:
# name -> (method, arguments, a key that shows the feature ran rather than fell back).
RUNS = {
    "sft_packed": ("sft", ["recipe=sft_math", "train.packing=true", "train.micro_batch_tokens=64"], "trained_tokens"),
    "dpo": ("dpo", ["recipe=dpo_math"], "dpo_pairs"),
    "ppo_tis": ("ppo", ["recipe=ppo_math", "rollout.tis_cap=2"], "mismatch/tis_capped"),
    "grpo_stages": ("grpo", ["recipe=grpo_math", "algorithm.group_size=2", "rollout.dynamic_sampling=true",
                             "rollout.elite_pool=8", "rewards.overlong_buffer=4", "rollout.adaptive_temperature=true",
                             "eval.every=1"], "elite/pool_size"),
    "grpo_separate": ("grpo", ["recipe=grpo_math", "algorithm.group_size=2", "rollout.placement=separate",
                               "rollout.worker_threads=1", "rollout.max_staleness=1", "rewards.normalize=group"],
                      "time/wait_batch"),
    "grpo_calculator": ("grpo", ["recipe=grpo_tools", "algorithm.group_size=2", "rollout.adaptive_group_size=true",
                                 "rollout.min_group_size=2", "rollout.max_group_size=4"], "env/turns"),
}


@pytest.mark.parametrize("run", RUNS)
def test_every_logged_metric_is_declared(run, tiny_model_dir, tmp_path):
    """Every key of the run's metrics.jsonl is in posttrain/train/metrics.py or in its method's docstring."""
    method, args, shown = RUNS[run]
    out = tmp_path / run
    proc = posttrain("run", *args, *TINY, f"model.path={tiny_model_dir}", f"output_dir={out}")
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 2
    logged = set().union(*lines)
    assert shown in logged, f"{shown} not logged: the feature this run is for did not run"
    assert "notice: train.packing" not in proc.stderr  # packed, not run padded
    assert f"algorithm.name={method}" in reference.metrics_page()  # the run's method has a section
    names = {n for _, entries in METRICS.values() for n in entries} | set(reference.method_metrics()[method][1])
    missing = sorted(k for k in logged if not reference.declared(k, names))
    assert not missing, (f"metrics.jsonl keys with no declaration: {missing}; declare each in "
                         f"posttrain/train/metrics.py (or, for a method's own, in its module docstring's Metrics:), "
                         f"then run: {reference.METRICS_COMMAND}")


def test_rollout_keys_are_read_part_by_part():
    """`rollout` is made of parts (sampling, placement, off-policy correction, one per online stage): every key is
    in exactly one, the page lists each part under its own heading, and each stage switched on by a rollout key
    finds its keys in a part that names the stage's file."""
    import sys

    from posttrain.schema import RolloutConfig
    from posttrain.stages import STAGES

    owned = [f.name for part in RolloutConfig.PARTS for f in dataclasses.fields(part)]
    assert sorted(owned) == sorted(f.name for f in dataclasses.fields(RolloutConfig))
    assert len(owned) == len(set(owned))
    page = reference.config_page()
    for part in RolloutConfig.PARTS:
        assert f"### `rollout`: {part.TITLE}\n" in page
    for stage in STAGES:
        key = stage.key.split(" | ")[0]
        if key.startswith("rollout."):
            part = next(p for p in RolloutConfig.PARTS if key[len("rollout."):] in {f.name for f in dataclasses.fields(p)})
            path = sys.modules[stage.__module__].__file__.split("posttrain/", 1)[1]
            assert f"posttrain/{path}" in part.__doc__, (stage.__name__, part.__name__)
