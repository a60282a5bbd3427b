"""`posttrain compare`: several recipes on one budget, side by side.

    posttrain compare ppo_math grpo_math [steps=N] [eval_every=N] [seeds=N] [output_dir=runs/compare]
                      [overwrite=true] [key=value ...]

Each recipe runs in its own process (`python -m posttrain run`), one after another, so wall times and peak memory do
not mix. Every run gets the same overrides, and compare adds what a fair comparison needs: the same `seed`, the same
step budget (`steps`, default the smallest `train.steps` among the recipes), the same held-out problems (the smallest
`eval.num_problems`) and an evaluation every `eval_every` steps (default steps // 5), so that accuracy is recorded
against step and wall time. Other differences between the recipes' model, data, rollout or reward settings are
reported as notes, not changed. With `seeds=N` each recipe runs N times, with seeds seed, seed + 1, …, into
output_dir/<recipe>/seed_<s>; every figure is then reported as mean ± sd over the seeds (`posttrain.apps.spread`),
the plots draw bands and error bars, and the report lists which differences between recipes exceed the spread.

The report reads what each run recorded (summary.json and metrics.jsonl) and puts the recipes side by side, as many
as were given:

1. outcome: held-out accuracy before and after, wall time (a one-off SFT warm-up of the embedded model excluded);
2. memory: bytes held by each role (weights, gradients and AdamW state of the policy and critic, reference and reward
   model weights, the step's batch), counted from the tensors; peak RSS per phase on CPU and
   `torch.cuda.max_memory_allocated` per phase on a GPU;
3. the estimator's model-state bytes (`posttrain.apps.estimate.state_bytes`, fp32 runs only) next to the measured ones;
4. time: the median over steps of each phase, and throughput (generated tokens / sampling time, trained tokens /
   update time);
5. held-out accuracy and reward against step and wall time.

It prints the tables (rich) and writes compare.md, compare.json (every number) and compare.png (memory by role, time
by phase, accuracy against wall time) to output_dir. docs/compare.md says how to read them.

The steps, one module each, in the order they happen:

- `planning`: the recipes, the overrides and the shared budget (`plan`, `Plan`);
- `running`: each run in its own process (`run_all`, `run_one`, `RunFailed`);
- `reading`: what each run recorded, as numbers, with the estimator's figures beside them (`load_run`, `numbers`),
  and all of them as `Results`, the data of compare.json;
- `reporting` and `plotting`: the tables (terminal and compare.md) and compare.png.

`run_comparison` does them all and returns the `Results` (what `posttrain reproduce` builds its figures from);
`report` writes them.
"""

from __future__ import annotations

import json
import sys

from posttrain.apps.compare.planning import Plan, plan
from posttrain.apps.compare.plotting import plot
from posttrain.apps.compare.reading import Results, load_run, numbers, read
from posttrain.apps.compare.reporting import markdown, show, tables
from posttrain.apps.compare.running import RunFailed, run_all, run_one
from posttrain.apps.spread import Spread

__all__ = ["Plan", "Results", "RunFailed", "load_run", "main", "numbers", "plan", "report", "run_comparison",
           "run_one", "tables"]


def run_comparison(argv: list[str]) -> Results:
    """What `posttrain compare argv` does: plans, runs every recipe (once per seed), reads what each run recorded,
    writes the report; returns what it reported.

    Raises:
        UserError: bad input, or a run that refused its input (exit status 2).
        RunFailed: a run that failed otherwise; the runs after it are not started and nothing is reported.
    """
    p = plan(argv)
    for note in p.notes:
        print(f"posttrain compare: {note}", file=sys.stderr)
    run_all(p)
    results = read(p)
    report(results)
    print(f"report: {p.out / 'compare.md'}, compare.json, compare.png")
    return results


def report(results: Results) -> None:
    """Writes compare.json (`Results.as_json`), compare.md and compare.png to the plan's output_dir and prints the
    tables."""
    runs, out = results.runs, results.plan.out
    as_json = lambda x: x.as_json() if isinstance(x, Spread) else str(x)  # noqa: E731
    (out / "compare.json").write_text(json.dumps(results.as_json(), indent=2, default=as_json) + "\n")
    (out / "compare.md").write_text(markdown(runs, results.plan))
    plot(runs, out / "compare.png")
    show(runs)


def main(argv: list[str]) -> int:
    """`posttrain compare RECIPE ... [key=value ...]`: 0 done, UserError on bad input (also when a run says so), 1
    when a run fails otherwise."""
    try:
        run_comparison(argv)
    except RunFailed as err:
        print(f"posttrain: error: {err}", file=sys.stderr)
        return 1
    return 0
