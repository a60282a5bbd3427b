"""Regenerates the tables the README and the docs report, in place, each stamped with what measured it.

    python bench/docs_tables.py                       # every table
    python bench/docs_tables.py --only first_command  # one (or several: --only a b)
    python bench/docs_tables.py --list                # the tables and the page each lives in
    python bench/docs_tables.py --only first_command --print   # print the block instead of writing the page

A table lives in its page between `<!-- table:NAME -->` and `<!-- /table:NAME -->`. The command reruns what the table
reports, writes it as Markdown under a stamp line (the command, the date, the machine's cores, CPU model and class, the
precision and threads the runs used, and the torch and transformers versions) and replaces the block, so a figure in
the docs is what this command printed on the machine the stamp names, never a transcription.
tests/test_docs_tables.py checks that every block has the stamp and the columns the command writes (not the numbers,
which belong to the machine).

Measure alone: another busy process on the second core slows a two-thread run, and the fitted thread count follows it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from statistics import median

ROOT = Path(__file__).resolve().parents[1]
AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}  # torch computes as on an AVX2-only CPU
STAMP = re.compile(r"^Measured by `python bench/docs_tables\.py --only (\w+)` on (\d{4}-\d{2}-\d{2}): (\d+) CPU cores "
                   r"\((.*)\), precision (.+), threads (.+), torch (\S+), transformers (\S+)\.$")


@dataclass(frozen=True)
class Table:
    page: str  # relative to the repository root
    columns: tuple[str, ...]
    measure: Callable[[argparse.Namespace], tuple[list[list[str]], str, str]]  # -> rows, precision, threads
    about: str


def versions() -> tuple[str, str]:
    import torch
    import transformers

    return torch.__version__.split("+")[0], transformers.__version__


def machine() -> tuple[int, str]:
    from posttrain.apps.env import report

    cpu = report()["cpu"]
    return len(os.sched_getaffinity(0)), f"{cpu['model']}, {cpu['class']}"


def stamp(name: str, precision: str, threads: str) -> str:
    cores, cpu = machine()
    torch_v, tf_v = versions()
    return (f"Measured by `python bench/docs_tables.py --only {name}` on {datetime.date.today().isoformat()}: {cores} "
            f"CPU cores ({cpu}), precision {precision}, threads {threads}, torch {torch_v}, transformers {tf_v}.")


def markdown(columns: tuple[str, ...], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns), *("| " + " | ".join(r) + " |" for r in rows)]


# -- the first command ----------------------------------------------------------------------------------------------
def first_command_run(env_extra: dict[str, str], overrides: list[str], tmp: Path, name: str) -> dict:
    """`posttrain run recipe=grpo_math` from an empty warm-up cache, in a fresh directory, as a new user runs it:
    the whole command's wall time, the warm-up's and the run's (`done in`), and the line it printed."""
    out, cache = tmp / name, tmp / f"cache-{name}"
    env = {**os.environ, **env_extra, "POSTTRAIN_CACHE": str(cache)}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "posttrain", "run", "recipe=grpo_math", f"output_dir={out}",
                           *overrides], cwd=tmp, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"docs_tables: the first command failed ({name}):\n{proc.stderr[-3000:]}")
    text = proc.stdout + proc.stderr
    printed = re.search(r"^held-out accuracy: .*$", text, re.M).group(0)
    done = float(re.search(r"^done in ([\d.]+)s", text, re.M).group(1))
    summary = json.loads((out / "summary.json").read_text())
    return {"wall": wall, "done": done, "warmup": summary["warmup"]["seconds"], "printed": printed,
            "precision": summary["precision"], "threads": summary["threads"],
            "before": summary["eval_before"]["accuracy"], "after": summary["eval_after"]["accuracy"]}


def kernels_rows(args) -> list[tuple[str, dict[str, str]]]:
    """The CPU classes this machine reaches: its own, and AVX2 kernels where it has more."""
    from posttrain.core.precision import cpu_class, cpu_flags

    native = cpu_class(cpu_flags())
    rows = [(native, {})]
    if native.startswith("AVX-512") and not args.native_only:
        rows.append(("AVX2 kernels (the same CPU, `ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2`)", AVX2))
    return rows


def first_command(args) -> tuple[list[list[str]], str, str]:
    rows, precisions = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (label, env) in enumerate(kernels_rows(args)):
            r = first_command_run(env, [], Path(tmp), f"run{i}")
            precisions.append(r["precision"])
            rows.append([label, r["precision"], f"{r['wall']:.0f} s", f"{r['warmup']:.0f} s", f"{r['done']:.1f} s",
                         f"`{r['printed']}`"])
    return rows, "auto (" + ", ".join(dict.fromkeys(precisions)) + ")", "fitted"


# what the same first command does when only the rounding differs: the threads, the precision
SPREAD_SETTINGS = [
    ("threads fitted (the default)", {}, []),
    ("`train.threads=1`", {}, ["train.threads=1"]),
    ("`train.threads=2`", {}, ["train.threads=2"]),
    ("`train.precision=fp32 warmup.precision=fp32`", {}, ["train.precision=fp32", "warmup.precision=fp32"]),
]


def first_command_spread(args) -> tuple[list[list[str]], str, str]:
    """The first command under settings that differ only in rounding, each from its own empty cache: the warm-up's
    held-out accuracy (the run's `before`) and the run's (`after`), and their spread."""
    settings = list(SPREAD_SETTINGS)
    for label, env in kernels_rows(args)[1:]:
        settings.append((label.split(" (")[0] + " (fp32)", env, []))
    rows, before, after = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (label, env, overrides) in enumerate(settings):
            r = first_command_run(env, overrides, Path(tmp), f"spread{i}")
            before.append(r["before"])
            after.append(r["after"])
            rows.append([label, r["precision"], str(r["threads"]), f"{r['before']:.3f}", f"{r['after']:.3f}",
                         f"{r['after'] - r['before']:+.3f}"])
    rows.append(["**largest distance from the median**", "", "",
                 f"{max(abs(x - median(before)) for x in before):.3f}",
                 f"{max(abs(x - median(after)) for x in after):.3f}",
                 f"{min(a - b for a, b in zip(after, before)):+.3f} (least)"])
    return rows, "as each row says", "as each row says"


TABLES = {
    "first_command": Table("README.md", ("CPU class (`posttrain env`)", "precision `auto` ran", "whole command",
                                         "warm-up", "`done in` (the run)", "printed"), first_command,
                           "`posttrain run recipe=grpo_math` from an empty cache, timed, per CPU class reachable"),
    "first_command_spread": Table("docs/embedded.md", ("setting", "precision", "threads", "after the warm-up",
                                                       "after GRPO", "lift"), first_command_spread,
                                  "the first command under settings that differ only in rounding"),
}


def block(name: str, table: Table, rows: list[list[str]], precision: str, threads: str) -> str:
    return "\n".join([f"<!-- table:{name} -->", *markdown(table.columns, rows), "", stamp(name, precision, threads),
                      f"<!-- /table:{name} -->"])


def replace_block(text: str, name: str, new: str) -> str:
    pattern = re.compile(rf"<!-- table:{name} -->\n.*?<!-- /table:{name} -->", re.S)
    if not pattern.search(text):
        raise SystemExit(f"docs_tables: no <!-- table:{name} --> block to replace")
    return pattern.sub(lambda _: new, text, count=1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", nargs="+", choices=sorted(TABLES), help="only these tables")
    p.add_argument("--list", action="store_true", help="list the tables and their pages")
    p.add_argument("--print", action="store_true", help="print the blocks instead of writing the pages")
    p.add_argument("--native-only", action="store_true", help="only this CPU's own class (no AVX2-kernel rows)")
    args = p.parse_args(argv)
    if args.list:
        for name, table in TABLES.items():
            print(f"{name:24s} {table.page:20s} {table.about}")
        return 0
    for name in args.only or TABLES:
        table = TABLES[name]
        t0 = time.perf_counter()
        rows, precision, threads = table.measure(args)
        new = block(name, table, rows, precision, threads)
        if args.print:
            print(new)
        else:
            page = ROOT / table.page
            page.write_text(replace_block(page.read_text(), name, new))
            print(f"{name}: {table.page} rewritten ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
