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
import importlib.util
import json
import os
import re
import shutil
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
class Measured:
    rows: list[list[str]]
    precision: str  # what the stamp says of the runs' precision and threads
    threads: str
    note: str = ""  # a line between the table and its stamp: the command it ran and how long it took


@dataclass(frozen=True)
class Table:
    page: str  # relative to the repository root
    columns: tuple[str, ...]
    measure: Callable[[argparse.Namespace], Measured]
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


def first_command(args) -> Measured:
    rows, precisions = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (label, env) in enumerate(kernels_rows(args)):
            r = first_command_run(env, [], Path(tmp), f"run{i}")
            precisions.append(r["precision"])
            rows.append([label, r["precision"], f"{r['wall']:.0f} s", f"{r['warmup']:.0f} s", f"{r['done']:.1f} s",
                         f"`{r['printed']}`"])
    return Measured(rows, "auto (" + ", ".join(dict.fromkeys(precisions)) + ")", "fitted")


# what the same first command does when only the rounding differs: the threads, the precision
SPREAD_SETTINGS = [
    ("threads fitted (the default)", {}, []),
    ("`train.threads=1`", {}, ["train.threads=1"]),
    ("`train.threads=2`", {}, ["train.threads=2"]),
    ("`train.precision=fp32 warmup.precision=fp32`", {}, ["train.precision=fp32", "warmup.precision=fp32"]),
]


def first_command_spread(args) -> Measured:
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
    return Measured(rows, "as each row says", "as each row says")


# -- comparisons of methods: each seed its own warm-up --------------------------------------------------------------
def posttrain(args, argv: list[str], out: Path) -> tuple[float, str]:
    """`posttrain ARGV output_dir=OUT` as a user runs it, with the warm-ups cached in this invocation's own cache
    (empty at its start, shared by its tables so each seed's warm-up is built once): the seconds it took and the
    command as the page shows it (without the output directory)."""
    env = {**os.environ, "POSTTRAIN_CACHE": str(args.cache)}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "posttrain", *argv, f"output_dir={out}", "overwrite=true"],
                          cwd=args.work, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"docs_tables: `posttrain {' '.join(argv)}` failed:\n{proc.stderr[-3000:]}")
    return time.perf_counter() - t0, "posttrain " + " ".join(argv)


def warmups_built(runs: list[dict]) -> float:
    return sum(r.get("warmup_seconds") or 0.0 for r in runs)


def copy_figure(args, made: Path, page_figure: str) -> None:
    if not args.print:
        shutil.copyfile(made, ROOT / "docs" / page_figure)


VARIANTS = ["grpo_math", "drgrpo_math", "dapo_math", "gspo_math", "rloo_math", "reinforce_pp_math", "grpo_ps_math",
            "cispo_math", "sapo_math"]


def variants(args) -> Measured:
    """GRPO's family on grpo_math's budget, 3 seeds each: accuracy after, its spread, and each method against GRPO
    by the rough bar |Δ| > sd_a + sd_b and seed by seed (a seed's runs share its warm-up, so their difference leaves
    the warm-ups' part of the spread out)."""
    from posttrain.apps.spread import Spread, beyond

    out = args.work / "variants"
    secs, shown = posttrain(args, ["compare", *VARIANTS, "seeds=3", "eval_every=0"], out)
    runs = json.loads((out / "compare.json").read_text())["seed_runs"]
    def over(name, fn):
        return Spread(tuple(fn(r) for r in runs[name]))
    acc = {n: over(n, lambda r: r["accuracy_after"]) for n in VARIANTS}
    rows = []
    for n in VARIANTS:
        vs = n != "grpo_math"
        paired = acc[n] - acc["grpo_math"]  # seed by seed: both runs of a seed start from its warm-up
        rows.append([n, f"{acc[n]:.3f}", " ".join(f"{v:.3f}" for v in acc[n].values),
                     f"{over(n, lambda r: r['accuracy_after'] - r['accuracy_before']):+.3f}",
                     f"{paired.mean:+.3f}" if vs else "",
                     ("yes" if beyond(acc[n], acc["grpo_math"]) else "no") if vs else "",
                     f"{paired:+.3f}" if vs else "", f"{sum(d > 0 for d in paired.values)}/3" if vs else "",
                     f"{over(n, lambda r: r['wall_seconds']):.0f}",
                     f"{over(n, lambda r: r['memory']['peak_rss_mb']):.0f}"])
    start = " ".join(f"{r['accuracy_before']:.3f}" for r in runs["grpo_math"])
    built = warmups_built([r for n in VARIANTS for r in runs[n]])
    note = (f"`{shown}`: {3 * len(VARIANTS)} runs, one at a time, in {secs:.0f} s ({built:.0f} s of it building the "
            f"seeds' warm-ups). The warm-ups' held-out accuracy, seeds 0, 1, 2: {start}.")
    return Measured(rows, "auto (each recipe's `train.precision`)", "fitted", note)


def figure5(args) -> Measured:
    """`posttrain reproduce figure5`: each method's accuracy after 100 steps over 3 seeds, and each of the paper's
    orderings (every method against the one before it) with its verdict."""
    from posttrain.apps.reproduce import FIGURE5, LABELS, ORDERINGS, ordering_rows
    from posttrain.apps.spread import Spread

    out = args.work / "figure5"
    secs, shown = posttrain(args, ["reproduce", "figure5"], out)
    finals = json.loads((out / "figure5.json").read_text())["final_accuracy"]
    final = {n: Spread(tuple(v)) for n, v in finals.items()}
    against = {high: row for (high, _), row in zip(ORDERINGS, ordering_rows(final, finals))}
    rows = []
    for n in FIGURE5:
        o = against.get(n)
        rows.append([LABELS[n], f"{final[n]:.3f}", ", ".join(f"{v:.3f}" for v in final[n].values),
                     *([o["ordering"], f"{o['difference']:+.3f}", f"{o['spread']:.3f}",
                        "yes" if o["holds"] else "no", f"{o['seed_by_seed']:+.3f}",
                        f"{o['seeds_holding']}/{o['seeds']}"] if o else [""] * 6)])
    copy_figure(args, out / "figure5.png", "figure5.png")
    compare = json.loads((out / "compare.json").read_text())["seed_runs"]
    built = warmups_built([r for runs in compare.values() for r in runs])
    note = f"`{shown}`: 4 methods × 3 seeds of 100 steps in {secs:.0f} s ({built:.0f} s of it building warm-ups)."
    return Measured(rows, "auto (each recipe's `train.precision`)", "fitted", note)


def figure7(args) -> Measured:
    """`posttrain reproduce figure7`: Maj@K and Pass@K before and after GRPO, mean ± sd over 3 seeds, the lifts
    seed by seed, and in how many seeds Maj@K's lift is the larger."""
    from posttrain.apps.spread import Spread

    out = args.work / "figure7"
    secs, shown = posttrain(args, ["reproduce", "figure7"], out)
    data = json.loads((out / "figure7.json").read_text())
    seeds = data["seeds"]
    def at(what, when, i):
        return Spread(tuple(s[when][what][i] for s in seeds))
    rows = []
    for i, K in enumerate(data["K"]):
        lift = {w: at(w, "after", i) - at(w, "before", i) for w in ("maj", "pass")}
        gap = lift["maj"] - lift["pass"]
        rows.append([str(K), f"{at('maj', 'before', i):.3f}", f"{at('maj', 'after', i):.3f}", f"{lift['maj']:+.3f}",
                     f"{at('pass', 'before', i):.3f}", f"{at('pass', 'after', i):.3f}", f"{lift['pass']:+.3f}",
                     f"{gap:+.3f}", f"{sum(g > 0 for g in gap.values)}/{len(seeds)}"])
    copy_figure(args, out / "figure7.png", "figure7.png")
    note = (f"`{shown}`: 3 GRPO runs of 140 steps, 64 samples on each of 200 held-out problems before and after, in "
            f"{secs:.0f} s.")
    return Measured(rows, "auto (grpo_math's `train.precision`; sampling as the run)", "fitted", note)


def bench_module(name: str):
    """bench/NAME.py, imported under its own name (bench/ is a folder of scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


recipes = bench_module("recipes")


def recipes_table(args, overrides: list[str]) -> Measured:
    t0 = time.perf_counter()
    env = {**os.environ, "POSTTRAIN_CACHE": str(args.cache)}
    rows = recipes.measure(recipes.ORDER, args.work / ("recipes" + "".join(overrides)), overrides, env)
    shown = "python bench/recipes.py" + (" -- " + " ".join(overrides) if overrides else "")
    note = f"`{shown}`: {len(rows)} recipes, one after another, in {time.perf_counter() - t0:.0f} s, seed 0."
    return Measured(rows, "fp32" if overrides else "auto (each recipe's `train.precision`)", "fitted", note)


def compare_ppo_grpo(args) -> Measured:
    """`posttrain compare ppo_math grpo_math`: what each bought and what it held, role by role, phase by phase."""
    from posttrain.apps.compare.reporting import ROLES

    out = args.work / "ppo_grpo"
    secs, shown = posttrain(args, ["compare", "ppo_math", "grpo_math"], out)
    runs = json.loads((out / "compare.json").read_text())["runs"]
    names = ("ppo_math", "grpo_math")
    def mib(r, *keys):
        got = [r["memory"]["roles_bytes"].get(k) for k in keys]
        return " / ".join(f"{g / 2**20:.2f}" for g in got) if all(g is not None for g in got) else "–"
    def row(label, fn):
        return [label, *(fn(runs[n]) for n in names)]
    t, rss = "time_median_s", "cpu_peak_rss_mb"
    rows = [
        row("held-out accuracy before → after",
            lambda r: f"{r['accuracy_before']:.3f} → {r['accuracy_after']:.3f}"),
        row("steps", lambda r: str(r["steps"])),
        row("wall time of the run (s)", lambda r: f"{r['wall_seconds']:.1f}"),
        row("policy weights / gradients / AdamW state (MiB)",
            lambda r: mib(r, "policy_weights", "policy_gradients", "policy_optimizer_state")),
        row("reference weights (MiB)", lambda r: mib(r, "reference_weights")),
        row("critic weights / gradients / AdamW state (MiB)",
            lambda r: mib(r, "critic_weights", "critic_gradients", "critic_optimizer_state")),
        row("step batch (MiB)", lambda r: f"{r['memory']['roles_bytes'].get('rollout_batch', 0) / 2**20:.3f}"),
        row("all roles (MiB)", lambda r: f"{sum(r['memory']['roles_bytes'].values()) / 2**20:.2f}"),
        row("peak RSS: rollout / scoring / update phase (MiB)",
            lambda r: " / ".join(f"{r['memory'][rss].get(p, 0):,.0f}" for p in ("rollout", "scoring", "update"))),
        row("median time per step: rollout / scoring / update (s)",
            lambda r: " / ".join(f"{r[t][p] or 0:.3f}" for p in ("rollout", "scoring", "update"))),
        row("median step (s)", lambda r: f"{r[t]['step']:.3f}"),
        row("generated tokens/s (sampling) / trained tokens/s (update)",
            lambda r: " / ".join(f"{r['throughput'][k] or 0:,.0f}" for k in
                                 ("generated_tokens_per_s", "trained_tokens_per_s"))),
    ]
    assert set(ROLES) >= {k for n in names for k in runs[n]["memory"]["roles_bytes"]}, "a role the table leaves out"
    copy_figure(args, out / "compare.png", "compare_ppo_grpo.png")
    note = f"`{shown}` in {secs:.0f} s, seed 0 ({warmups_built(list(runs.values())):.0f} s of it building the warm-up)."
    return Measured(rows, "auto (each recipe's `train.precision`)", "fitted", note)


TABLES = {
    "first_command": Table("README.md", ("CPU class (`posttrain env`)", "precision `auto` ran", "whole command",
                                         "warm-up", "`done in` (the run)", "printed"), first_command,
                           "`posttrain run recipe=grpo_math` from an empty cache, timed, per CPU class reachable"),
    "first_command_spread": Table("docs/embedded.md", ("setting", "precision", "threads", "after the warm-up",
                                                       "after GRPO", "lift"), first_command_spread,
                                  "the first command under settings that differ only in rounding"),
    "variants": Table("docs/variants.md", ("recipe", "accuracy after, mean ± sd", "per seed (0, 1, 2)",
                                           "change from the warm-up", "Δ vs grpo_math", "beyond the spread",
                                           "Δ seed by seed", "seeds above grpo_math", "wall s", "peak RSS MiB"),
                      variants,
                      "GRPO's family on grpo_math's budget, 3 seeds each (about 40 min)"),
    "figure5": Table("docs/reproduction.md", ("method", "held-out accuracy after 100 steps", "seeds 0, 1, 2",
                                              "the paper's ordering", "mean difference", "sd sum",
                                              "holds beyond the spread", "difference seed by seed",
                                              "seeds in which it holds"), figure5,
                     "`posttrain reproduce figure5` (about 12 min, warm-ups included)"),
    "figure7": Table("docs/reproduction.md", ("K", "Maj@K before", "Maj@K after", "lift", "Pass@K before",
                                              "Pass@K after", "lift", "Maj@K lift − Pass@K lift",
                                              "seeds with the larger Maj@K lift"), figure7,
                     "`posttrain reproduce figure7` (about 5 min)"),
    "recipes": Table("docs/results.md", recipes.COLUMNS, lambda args: recipes_table(args, []),
                     "bench/recipes.py: the six recipes as shipped (about 5 min)"),
    "recipes_fp32": Table("docs/results.md", recipes.COLUMNS,
                          lambda args: recipes_table(args, ["train.precision=fp32"]),
                          "bench/recipes.py -- train.precision=fp32 (about 8 min)"),
    "compare_ppo_grpo": Table("docs/compare.md", ("", "ppo_math", "grpo_math"), compare_ppo_grpo,
                              "`posttrain compare ppo_math grpo_math` (about 3 min)"),
}


def block(name: str, table: Table, m: Measured) -> str:
    note = [m.note, ""] if m.note else []
    return "\n".join([f"<!-- table:{name} -->", *markdown(table.columns, m.rows), "", *note,
                      stamp(name, m.precision, m.threads), f"<!-- /table:{name} -->"])


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
    work = tempfile.TemporaryDirectory(prefix="docs_tables-")
    args.work = Path(work.name)
    args.cache = args.work / "cache"  # this invocation's warm-ups, built afresh
    for name in args.only or TABLES:
        table = TABLES[name]
        t0 = time.perf_counter()
        new = block(name, table, table.measure(args))
        if args.print:
            print(new)
        else:
            page = ROOT / table.page
            page.write_text(replace_block(page.read_text(), name, new))
            print(f"{name}: {table.page} rewritten ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
