"""Runs every shipped recipe on the embedded default and prints a markdown table of what each bought and cost.

    python bench/recipes.py [--out runs/recipes] [recipe ...] [-- key=value ...]

Each recipe runs in its own process, one after another, so wall times and peak memory do not mix. All start from the
same cached SFT warm-up (the first run builds it; its time is reported separately).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from posttrain.config import known_recipes

ORDER = ["sft_math", "rft_math", "online_rft_math", "dpo_math", "ppo_math", "grpo_math"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/recipes")
    p.add_argument("recipes", nargs="*", default=[r for r in ORDER if r in known_recipes()])
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)  # argparse would take the overrides for recipe names
    args, overrides = p.parse_args(argv[:cut]), argv[cut + 1 :]
    rows = []
    for recipe in args.recipes:
        out = Path(args.out) / recipe
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "posttrain", "run", "-q", f"recipe={recipe}", f"output_dir={out}",
                               "overwrite=true", *overrides], capture_output=True, text=True)
        if proc.returncode:
            print(f"{recipe} failed: {proc.stderr.strip().splitlines()[-1]}", file=sys.stderr)
            return 1
        s = json.loads((out / "summary.json").read_text())
        warm = s.get("warmup", {})
        rows.append((recipe, s["eval_before"]["accuracy"], s["eval_after"]["accuracy"], s["steps"], s["wall_seconds"],
                     warm.get("seconds", 0.0) if not warm.get("cached", True) else 0.0, s["peak_rss_mb"],
                     sum(s["memory"]["roles_bytes"].values()) / 2**20, time.perf_counter() - t0))
        print(f"{recipe}: {rows[-1][1]:.3f} -> {rows[-1][2]:.3f}", file=sys.stderr)
    print("| recipe | accuracy before | after | change | steps | wall s (run) | warm-up s (before the run) | peak RSS MiB | "
          "model state + batch MiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r, before, after, steps, wall, warm, rss, roles, _ in rows:
        print(f"| {r} | {before:.3f} | {after:.3f} | {after - before:+.3f} | {steps} | {wall:.0f} | {warm:.0f} | "
              f"{rss:.0f} | {roles:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
