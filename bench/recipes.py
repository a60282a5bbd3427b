"""Runs every shipped recipe on the embedded default and prints a markdown table of what each bought and cost.

    python bench/recipes.py [--out runs/recipes] [recipe ...] [-- key=value ...]

Each recipe runs in its own process, one after another, so wall times and peak memory do not mix. All start from the
same cached SFT warm-up (the first run builds it; its time is reported separately). `bench/docs_tables.py --only
recipes` writes the same table into docs/results.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from posttrain.config import known_recipes

ORDER = ["sft_math", "rft_math", "online_rft_math", "dpo_math", "ppo_math", "grpo_math"]
COLUMNS = ("recipe", "accuracy before", "after", "change", "steps", "wall s (run)", "warm-up s (before the run)",
           "peak RSS MiB", "model state + batch MiB")


class RecipeFailed(RuntimeError):
    pass


def measure(recipes: list[str], out: Path, overrides: list[str], env: dict | None = None) -> list[list[str]]:
    """Each recipe in its own `posttrain run`, one after another: the table's rows, read from each summary.json."""
    rows = []
    for recipe in recipes:
        run_dir = out / recipe
        proc = subprocess.run([sys.executable, "-m", "posttrain", "run", "-q", f"recipe={recipe}",
                               f"output_dir={run_dir}", "overwrite=true", *overrides],
                              capture_output=True, text=True, env=env)
        if proc.returncode:
            raise RecipeFailed(f"{recipe} failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
        s = json.loads((run_dir / "summary.json").read_text())
        warm = s.get("warmup") or {}
        built = warm.get("seconds", 0.0) if not warm.get("cached", True) else 0.0  # 0: the warm-up was cached
        before, after = s["eval_before"]["accuracy"], s["eval_after"]["accuracy"]
        rows.append([recipe, f"{before:.3f}", f"{after:.3f}", f"{after - before:+.3f}", str(s["steps"]),
                     f"{s['wall_seconds']:.0f}", f"{built:.0f}",
                     f"{s['peak_rss_mb']:.0f}", f"{sum(s['memory']['roles_bytes'].values()) / 2**20:.1f}"])
        print(f"{recipe}: {before:.3f} -> {after:.3f}", file=sys.stderr)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/recipes")
    p.add_argument("recipes", nargs="*", default=[r for r in ORDER if r in known_recipes()])
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)  # argparse would take the overrides for recipe names
    args, overrides = p.parse_args(argv[:cut]), argv[cut + 1 :]
    try:
        rows = measure(args.recipes, Path(args.out), overrides)
    except RecipeFailed as err:
        print(err, file=sys.stderr)
        return 1
    print("| " + " | ".join(COLUMNS) + " |")
    print("|" + "---|" * len(COLUMNS))
    for row in rows:
        print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
