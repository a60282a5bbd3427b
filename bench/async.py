"""Sampling apart from the trainer: throughput, idle time and accuracy of `rollout.placement=separate` at
max_staleness k = 0, 1, 2 (at k = 1 and 2 also with the reference log-probs scored by the worker,
`rollout.reference_on=workers`: k=1-ref, k=2-ref) against the colocated synchronous run.

    python bench/async.py                                   # both variants, 3 seeds of accuracy; ~55 min on 2 cores (AVX-512 with AMX)
    python bench/async.py --seeds 0                         # throughput alone; ~11 min (AVX-512, AVX512-BF16, no AMX)
    python bench/async.py --variants long-completions --seeds 0 --steps 12
    python bench/async.py --launcher local,ray --configs colocated,k=0,k=1 --seeds 0   # Ray actors beside processes

Variants:
- embedded: `recipe=grpo_math` as it ships (the warmed-up embedded model, 32 prompts × 8 samples a step,
  completions of ~20 tokens, which the update outweighs);
- long-completions: the embedded model's architecture untrained, on the same prompts, 8 prompts × 8 samples a step,
  `rollout.max_new_tokens=256`: its completions end at random (a mean near 90 tokens, a tail to the budget, GSM8K's
  worked solutions' range), so sampling is the larger part of a step. Accuracy means nothing there; throughput does.

Each configuration is one `posttrain run` in its own process, with the trainer and one worker on one core each under
`separate` (the worker's threads and the trainer's are the defaults: the usable cores shared between them). From
metrics.jsonl it reports, over the steps after the first (which pays one-time costs):
- steps/s, samples/s and tokens/s: steps, sequences sampled and completion tokens sampled per second of wall time
  between the end of step 1 and the end of the last step (vs colocated: the samples/s ratio);
- the idle share of each side: the trainer's, Σ time/wait_batch over that wall time (colocated: the share of the step
  spent sampling, when the trainer does nothing else); the worker's, Σ time/worker_idle over it;
- the mean staleness of the trained rows, and the mean completion length (response).
With `--seeds` of two or more, it also runs the embedded variant's whole recipe (all its steps) per seed and
`--accuracy` configuration, and reports the held-out accuracy after training (eval_after, greedy, 500 problems): mean,
and the spread (max − min) over the seeds. Three configurations are for accuracy only: `k=1-trainer` and `k=1-seq`,
k = 1 with the truncated importance weight per token or per sequence (`rollout.proximal=trainer`) in place of the
default correction, and `lagged-k=1`, the colocated run sampling each batch from the weights one update old
(bench/lagged.py, truncated weight), which has the staleness of k = 1 without the workers. k = 0 is left out by
default: it samples as the colocated run does.
`--launcher local,ray` runs each configuration with rollout workers both ways (its accuracy runs too): processes of the training process
(`rollout.launcher=local`) and Ray actors in a placement group on a local Ray instance (`rollout.launcher=ray`), and
adds what Ray costs: the workers' start-up (from asking for them to every worker ready, joining or starting the Ray
cluster included) and the weight push's milliseconds per MiB (the median `time/weight_sync` over the steps after the
first, over the MiB pushed to one worker).
`--timeline FILE.png` plots the busy and idle time of each side for the k = 1 run of the last variant, from the
clock stamps in its metrics.jsonl.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
VARIANTS = {
    "embedded": ["recipe=grpo_math"],
    "long-completions": ["recipe=grpo_math", "model.path={untrained}", "rollout.max_new_tokens=256",
                         "train.batch_size=8"],
}
CONFIGS = {"colocated": [], "k=0": ["rollout.placement=separate"],
           "k=1": ["rollout.placement=separate", "rollout.max_staleness=1"],
           "k=2": ["rollout.placement=separate", "rollout.max_staleness=2"],
           # the reference log-probs scored by the worker, off the trainer's side (rollout.reference_on=workers)
           "k=1-ref": ["rollout.placement=separate", "rollout.max_staleness=1", "rollout.reference_on=workers"],
           "k=2-ref": ["rollout.placement=separate", "rollout.max_staleness=2", "rollout.reference_on=workers"]}
# accuracy only: k = 1 with the truncated importance weight in place of the default correction (PPO's clip against
# the sampler), per token and per sequence, and the colocated run sampling from weights one update old with the
# truncated weight (bench/lagged.py: staleness without the workers)
ACCURACY = {"k=1-trainer": [*CONFIGS["k=1"], "rollout.proximal=trainer"],
            "k=1-seq": [*CONFIGS["k=1"], "rollout.tis_mode=sequence_truncate"],
            "lagged-k=1": ["rollout.tis_cap=2"]}
LAUNCH = {"lagged-k=1": [str(HERE / "lagged.py"), "1"]}  # what runs instead of `python -m posttrain`


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated: " + ", ".join(VARIANTS))
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated: " + ", ".join(CONFIGS))
    p.add_argument("--steps", type=int, default=16, help="steps of each throughput run")
    p.add_argument("--repeats", type=int, default=3,
                   help="rounds of the throughput runs, every configuration once a round; the table gives medians")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds of the accuracy runs (one: none)")
    p.add_argument("--accuracy", default="colocated,k=1,k=2,k=1-trainer,lagged-k=1",
                   help="comma-separated configurations of the accuracy runs: " + ", ".join([*CONFIGS, *ACCURACY]))
    p.add_argument("--launcher", default="local", help="comma-separated: local, ray (what starts the workers)")
    p.add_argument("--timeline", type=Path, help="a PNG of each side's busy and idle time (k=1, last variant)")
    args = p.parse_args(argv)
    unknown = [c for c in args.accuracy.split(",") if c not in {**CONFIGS, **ACCURACY}]
    if unknown:
        p.error(f"--accuracy: no configuration {unknown[0]!r}")
    return args


def run(args: list[str], out: Path, config: str = "") -> list[dict]:
    """One `posttrain run` (bench/lagged.py's for its configuration); its metrics.jsonl lines."""
    launch = LAUNCH.get(config, ["-m", "posttrain"])
    cmd = [sys.executable, *launch, "run", *args, f"output_dir={out}", "overwrite=true", "-q"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"bench/async.py: {' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def workers(out: Path, lines: list[dict]) -> dict:
    """The workers' start-up seconds and the weight push's milliseconds per MiB (nan for a colocated run)."""
    w = json.loads((out / "summary.json").read_text()).get("rollout_workers")
    if not w:
        return {"start s": float("nan"), "push ms/MiB": float("nan")}
    push = statistics.median(m["time/weight_sync"] for m in lines[1:])
    return {"start s": w["start_s"], "push ms/MiB": 1000 * push / w["push_mib"]}


def throughput(lines: list[dict]) -> dict:
    after = lines[1:]
    wall = lines[-1]["wall_seconds"] - lines[0]["wall_seconds"]
    samples = sum(m["generated_tokens"] / m["response_len"] for m in after)  # sequences sampled
    tokens = sum(m["generated_tokens"] for m in after)
    if "time/wait_batch" in after[0]:
        trainer_idle = sum(m["time/wait_batch"] for m in after) / wall
        worker_idle = sum(m["time/worker_idle"] for m in after) / wall
    else:  # colocated: one process, sampling while the update waits
        trainer_idle, worker_idle = sum(m["time/rollout"] for m in after) / wall, float("nan")
    return {"steps/s": len(after) / wall, "samples/s": samples / wall, "tokens/s": tokens / wall,
            "trainer idle": trainer_idle,
            "worker idle": worker_idle, "staleness": statistics.mean(m.get("staleness/mean", 0.0) for m in after),
            "response_len": statistics.mean(m["response_len"] for m in after)}


def row(variant: str, config: str, t: dict, note: str = "") -> str:
    ratio = f"{t['ratio']:.2f}x" if t["ratio"] == t["ratio"] else "-"
    return (f"{variant:<17} {config:<10} {t['steps/s']:>8.2f} {t['samples/s']:>10.1f} {ratio:>13} {t['tokens/s']:>9.0f} "
            f"{t['trainer idle']:>13.0%} {t['worker idle']:>12.0%} {t['staleness']:>10.2f} {t['response_len']:>9.1f}"
            f"{t['start s']:>8.1f} {t['push ms/MiB']:>12.2f}{note}")


def timeline(lines: list[dict], path: Path, title: str) -> None:
    """Each side's busy spans over time: the trainer's steps less its waits, the worker's sampling."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 2.6))
    for m in lines:
        wait_end = m["clock/step_start"] + m["time/wait_batch"]
        edge = {"edgecolor": "white", "linewidth": 1}  # a gap between one step's or batch's bar and the next
        ax.broken_barh([(m["clock/step_start"], m["time/wait_batch"])], (10, 8), color="#dddddd", **edge)
        ax.broken_barh([(wait_end, m["clock/step_end"] - wait_end)], (10, 8), color="#1f77b4", **edge)
        ax.broken_barh([(m["clock/batch_start"], m["clock/batch_end"] - m["clock/batch_start"])], (0, 8),
                       color="#ff7f0e", **edge)
    ax.set_yticks([4, 14], ["worker: sampling", "trainer: score + update"])
    ax.set_xlabel("seconds since the run's parts were built (grey: the trainer waits for its batch)")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    args = parse_args()
    variants, configs = args.variants.split(","), args.configs.split(",")
    seeds = [int(s) for s in args.seeds.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        from posttrain.models.embedded import build_model_dir

        untrained = build_model_dir(Path(tmp) / "untrained", max_len=512)  # the embedded architecture, fresh
        header = (f"{'variant':<17} {'config':<10} {'steps/s':>8} {'samples/s':>10} {'vs colocated':>13} "
                  f"{'tokens/s':>9} {'trainer idle':>13} {'worker idle':>12} {'staleness':>10} {'response':>9}"
                  f" {'start s':>7} {'push ms/MiB':>12}")
        print(header)
        table = {}  # (variant, config) -> each round's figures, its samples/s ratio to the round's colocated run among them
        for variant in variants:
            for r in range(args.repeats):  # rounds, so that a slow spell of the machine touches every configuration
                base = None
                for config, launcher in [(c, x) for c in configs for x in (["local"] if c == "colocated"
                                                                             else args.launcher.split(","))]:
                    given = [a.format(untrained=untrained) for a in VARIANTS[variant]]
                    ray = ["rollout.launcher=ray"] if launcher == "ray" else []
                    out = Path(tmp) / variant / f"{config}-{launcher}-{r}"
                    lines = run([*given, *CONFIGS[config], *ray, f"train.steps={args.steps}", "eval.num_problems=0"],
                                out)
                    t = {**throughput(lines), **workers(out, lines)}
                    base = t["samples/s"] if config == "colocated" else base
                    t["ratio"] = t["samples/s"] / base if base else float("nan")
                    config = f"{config} ray" if ray else config
                    table.setdefault((variant, config), []).append(t)
                    print(row(variant, f"{config}", t, f" (round {r + 1})"), flush=True)
                    if args.timeline and config == "k=1" and variant == variants[-1] and r == 0:
                        timeline(lines, args.timeline, f"{variant}, rollout.placement=separate, max_staleness=1")
        print(f"\nmedians over {args.repeats} rounds\n{header}")
        for (variant, config), rounds in table.items():
            print(row(variant, config, {k: statistics.median(t[k] for t in rounds) for k in rounds[0]}))
        if len(seeds) < 2:
            return
        print(f"\nheld-out accuracy after recipe=grpo_math's whole run (greedy, 500 problems), seeds {args.seeds}")
        print(f"{'config':<10} {'mean':>6} {'spread':>7}  per seed")
        for config in args.accuracy.split(","):
            given = {**CONFIGS, **ACCURACY}[config]
            separate = "rollout.placement=separate" in given
            for launcher in args.launcher.split(",") if separate else ["local"]:
                ray = ["rollout.launcher=ray"] if launcher == "ray" else []
                accuracy = []
                for seed in seeds:
                    out = Path(tmp) / "accuracy" / f"{config}-{launcher}-{seed}"
                    run([*VARIANTS["embedded"], *given, *ray, f"seed={seed}"], out, config)
                    accuracy.append(json.loads((out / "summary.json").read_text())["eval_after"]["accuracy"])
                name = f"{config} ray" if ray else config
                print(f"{name:<10} {statistics.mean(accuracy):>6.3f} {max(accuracy) - min(accuracy):>7.3f}  "
                      + " ".join(f"{a:.3f}" for a in accuracy), flush=True)


if __name__ == "__main__":
    main()
