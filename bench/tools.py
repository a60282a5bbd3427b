"""GRPO with the calculator tool against the same run without it: held-out accuracy against step, and a plot.

    python bench/tools.py [--out runs/tools] [--every 5] [--plot docs/environments_calc.png] [-- key=value ...]

Runs `recipe=grpo_tools` twice, each in its own process, from the same cached SFT warm-up: with the calculator
(`env.name=calculator`, the recipe's) and with no tool (`env.name=null`: the model's call gets no reply, so it must
write the product itself). Both evaluate the same held-out problems greedily every `--every` steps, each in its own
setting. Prints a markdown table (the warm-up, then each run's accuracy by step, wall seconds) and plots both curves.
The first run builds the warm-up; its seconds are reported apart.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from posttrain.apps.reproduce import plot_curves

RUNS = {"with the calculator": [], "without a tool": ["env.name=null"]}


def curve(out: Path) -> tuple[list[tuple[int, float]], dict]:
    """(step, held-out accuracy) from a run directory: before training as step 0, each `eval.every`, the last."""
    summary = json.loads((out / "summary.json").read_text())
    points = {0: summary["eval_before"]["accuracy"], summary["steps"]: summary["eval_after"]["accuracy"]}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        m = json.loads(line)
        if "eval_accuracy" in m:
            points.setdefault(m["step"], m["eval_accuracy"])
    return sorted(points.items()), summary


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/tools")
    p.add_argument("--every", type=int, default=5, help="evaluate every N steps (eval.every)")
    p.add_argument("--plot", default="docs/environments_calc.png")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args, overrides = p.parse_args(argv[:cut]), argv[cut + 1 :]
    curves, rows = {}, []
    for name, extra in RUNS.items():
        out = Path(args.out) / ("tool" if not extra else "no_tool")
        proc = subprocess.run([sys.executable, "-m", "posttrain", "run", "-q", "recipe=grpo_tools", f"output_dir={out}",
                               "overwrite=true", f"eval.every={args.every}", *overrides, *extra],
                              capture_output=True, text=True)
        if proc.returncode:
            print(f"{name}: failed: {proc.stderr.strip().splitlines()[-1]}", file=sys.stderr)
            return 1
        points, summary = curve(out)
        curves[name] = [points]
        warm = summary.get("warmup", {})
        rows.append((name, points, summary["wall_seconds"], 0.0 if warm.get("cached", True) else warm["seconds"]))
        print(f"{name}: {points[0][1]:.3f} -> {points[-1][1]:.3f}", file=sys.stderr)
    steps = [s for s, _ in rows[0][1]]
    print("| run | " + " | ".join(f"step {s}" for s in steps) + " | wall s (run) | warm-up s (before it) |")
    print("|---|" + "---:|" * (len(steps) + 2))
    for name, points, wall, warm in rows:
        values = dict(points)
        print(f"| {name} | " + " | ".join(f"{values[s]:.3f}" if s in values else "" for s in steps)
              + f" | {wall:.0f} | {warm:.0f} |")
    plot_curves(curves, Path(args.plot), title="recipe=grpo_tools: two-digit products, with and without the tool")
    print(f"plot: {args.plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
