"""GRPO's family on one budget, 3 seeds each: held-out accuracy (mean ± spread), wall time and peak memory.

    python bench/variants.py                          # 7 recipes x 3 seeds; about 40 minutes on 2 CPU cores
    python bench/variants.py --recipes grpo_math,rloo_math --seeds 0,1 --steps 20

Each recipe runs as shipped (`posttrain run recipe=R seed=S`), one run at a time in its own process, on the embedded
default: the same cached SFT warm-up, task, token budget per completion, learning rate, batch, group size and step
count for all. What differs is each method's own definition, taken from its paper and tuned for none (so DAPO may
sample up to 4 rounds a step, and GSPO takes μ = 2 updates per batch): GRPO (`grpo_math`), Dr. GRPO
(`drgrpo_math`), DAPO (`dapo_math`), GSPO (`gspo_math`), RLOO (`rloo_math`), REINFORCE++ (`reinforce_pp_math`) and
GRPO with process supervision (`grpo_ps_math`). The seed changes the data order and the samples, not the warm-up.

Per recipe it prints the held-out greedy accuracy after training as mean ± sample standard deviation over the seeds
(and each seed's value), the median wall time of the run (warm-up excluded; one short unmeasured run goes first, so
that no measured run pays for reading files from a cold disk) and the largest peak RSS. Against GRPO it
prints the difference of means and whether it exceeds the seed-to-seed spread: |Δ| > s_GRPO + s_method, the sum of
the two standard deviations (a rough two-sigma-like bar for 3 seeds, stated rather than a significance test). It
writes everything to variants.json in --output.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

RECIPES = "grpo_math,drgrpo_math,dapo_math,gspo_math,rloo_math,reinforce_pp_math,grpo_ps_math"


def run(recipe: str, seed: int, out: Path, extra: list[str]) -> dict:
    proc = subprocess.run([sys.executable, "-m", "posttrain", "run", f"recipe={recipe}", f"seed={seed}",
                           f"output_dir={out}", "overwrite=true", *extra, "-q"], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{recipe} seed {seed} failed: {proc.stderr.strip()[-500:]}")
    s = json.loads((out / "summary.json").read_text())
    return {"before": s["eval_before"]["accuracy"], "after": s["eval_after"]["accuracy"],
            "wall_seconds": s["wall_seconds"], "peak_rss_mb": s.get("peak_rss_mb")}


def spread(values: list[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else 0.0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--recipes", default=RECIPES)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=None, help="train.steps for every run (default: the recipes' 140)")
    p.add_argument("--output", default="runs/variants")
    args = p.parse_args(argv)
    recipes, seeds = args.recipes.split(","), [int(s) for s in args.seeds.split(",")]
    extra = [f"train.steps={args.steps}"] if args.steps else []
    out, results, t0 = Path(args.output), {}, time.perf_counter()
    # not counted: the first run of a fresh process tree reads the model, tokenizer and libraries from disk
    run(recipes[0], seeds[0], out / "unmeasured", ["train.steps=1", "eval.num_problems=8"])
    for recipe in recipes:
        results[recipe] = [run(recipe, seed, out / f"{recipe}-seed{seed}", extra) for seed in seeds]
        accs = [r["after"] for r in results[recipe]]
        print(f"{recipe}: {statistics.mean(accs):.3f} ± {spread(accs):.3f} ({', '.join(f'{a:.3f}' for a in accs)})",
              file=sys.stderr, flush=True)
    base = [r["after"] for r in results.get("grpo_math", [])]
    print(f"\nheld-out accuracy after training, {len(seeds)} seeds ({', '.join(map(str, seeds))}); start "
          f"{results[recipes[0]][0]['before']:.3f}; {time.perf_counter() - t0:.0f} s in all\n")
    print("| recipe | accuracy, mean ± sd | per seed | Δ vs grpo_math | beyond the spread | wall s (median) | peak RSS MiB |")
    print("|---|---|---|---|---|---|---|")
    for recipe, rs in results.items():
        accs = [r["after"] for r in rs]
        mean, sd = statistics.mean(accs), spread(accs)
        if base and recipe != "grpo_math":
            delta = mean - statistics.mean(base)
            vs, beyond = f"{delta:+.3f}", "yes" if abs(delta) > spread(base) + sd else "no"
        else:
            vs, beyond = "", ""
        print(f"| {recipe} | {mean:.3f} ± {sd:.3f} | {' '.join(f'{a:.3f}' for a in accs)} | {vs} | {beyond} | "
              f"{statistics.median(r['wall_seconds'] for r in rs):.0f} | "
              f"{max(r['peak_rss_mb'] or 0 for r in rs):.0f} |")
    out.mkdir(parents=True, exist_ok=True)
    (out / "variants.json").write_text(json.dumps({"seeds": seeds, "extra": extra, "runs": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
