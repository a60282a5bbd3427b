"""A GRPO step of the embedded default alone and with one core kept busy by another process, with the compute
threads pinned at every core (what torch does by itself: `train.threads=<cores>`) and fitted to the free cores
(`train.threads=0`, the default; posttrain/core/threads.py).

    python bench/busy_core.py [--steps 12] [--busy 1] [-- key=value ...]

Each run is `posttrain run recipe=grpo_math` in its own process, from the cached warm-up (the first run builds it),
with evaluation off. The busy process is a Python loop started before the run and stopped after it, not pinned to a
core: the kernel places it, as it would a second job or a data loader. The table gives the median `time/step` over
the steps after the first two, the median of the thread counts the steps ran with, and the ratio to the same
setting alone. Takes about 3 minutes on 2 cores (more on a slower CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

SPIN = "while True: pass"


def run(overrides: list[str], busy: int, steps: int) -> dict:
    """One run's median step time and thread count, with `busy` spinning processes beside it."""
    spinners = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(busy)]
    try:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "run"
            env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
            proc = subprocess.run([sys.executable, "-m", "posttrain", "run", "-q", "recipe=grpo_math",
                                   f"output_dir={out}", f"train.steps={steps}", "eval.num_problems=0", *overrides],
                                  capture_output=True, text=True, env=env)
            if proc.returncode:
                raise SystemExit(f"run failed: {proc.stderr.strip().splitlines()[-1]}")
            rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][2:]
            summary = json.loads((out / "summary.json").read_text())
    finally:
        for s in spinners:
            s.kill()
            s.wait()
    return {"step_s": statistics.median(r["time/step"] for r in rows),
            "threads": statistics.median(r["threads"] for r in rows), "precision": summary["precision"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--busy", type=int, default=1, help="busy processes beside the run (default 1)")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args, overrides = p.parse_args(argv[:cut]), argv[cut + 1 :]
    from posttrain.core import precision, threads

    cores = threads.usable_cores()
    subprocess.run([sys.executable, "-m", "posttrain", "run", "-q", "recipe=grpo_math", "train.steps=1",
                    "eval.num_problems=0", "overwrite=true", f"output_dir={tempfile.mkdtemp()}/warm", *overrides],
                   capture_output=True, check=True)  # builds the cached warm-up, outside the measurements
    print(f"{precision.cpu_class()} CPU (torch kernels {precision.cpu_flags()['kernels']}), {cores} usable cores; "
          f"grpo_math, medians of steps 3-{args.steps}", flush=True)
    print("| threads | load | precision | step s | threads used | × alone |")
    print("|---|---|---|---|---|---|")
    for label, setting in ((f"pinned at {cores} (before)", f"train.threads={cores}"), ("fitted (after)", "train.threads=0")):
        alone = run([setting, *overrides], 0, args.steps)
        busy = run([setting, *overrides], args.busy, args.steps)
        for load, r in (("alone", alone), (f"{args.busy} busy process", busy)):
            print(f"| {label} | {load} | {r['precision']} | {r['step_s']:.3f} | {r['threads']:g} | "
                  f"{r['step_s'] / alone['step_s']:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
