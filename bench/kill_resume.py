"""Kill and resume: a short GRPO run killed with SIGKILL at random moments, resumed, and compared byte for byte with
the same run never interrupted.

    python bench/kill_resume.py                 # 20 kills; about 10 min on 2 CPU cores
    python bench/kill_resume.py --kills 5 --seed 1
    python bench/kill_resume.py --backend fsdp2 # the sharded training state (one process)
    python bench/kill_resume.py --set rollout.placement=separate   # sampling in a rollout worker (k = 0)

The run is `grpo_math` on a freshly initialised tiny model (no warm-up), 8 steps with a checkpoint after every step,
so a kill lands anywhere: while the model loads, during a step's sampling or update, inside a checkpoint write, or
while the final model is written. Kills are placed by progress, not by clock, since start-up time varies. For each kill the bench

1. starts the run, waits until it has logged a random number of steps (0 to 7), then a random part of one step's
   time more (measured on the uninterrupted run), and kills the process;
2. checks every complete checkpoint (`checkpoints/step_N` with its trainer_state.json) for the files a resume reads,
   each loadable (a corrupt one is counted);
3. runs it again with `resume=true` (or, when the kill came before the first checkpoint, from the start), then
   compares the final model.safetensors with the uninterrupted run's, and metrics.jsonl's steps with 1..8.

It prints one line per kill and `N/N identical, 0 corrupt` at the end; the exit status is 1 when any differ.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

STEPS = 8
RUN = ["recipe=grpo_math", f"train.steps={STEPS}", "train.threads=2", "train.batch_size=4", "algorithm.group_size=4",
       "train.save_every=1", "rollout.max_new_tokens=12", "eval.num_problems=8", "data.difficulty=1",
       "data.train_size=150", "data.test_size=20"]


def posttrain(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "posttrain", "run", *RUN, *args, "-q"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def corrupt_checkpoints(staging: Path) -> list[str]:
    """Complete checkpoints missing a file a resume reads, or holding one that does not load."""
    from posttrain.train.checkpoint import RUN_STATE, TRAINING_STATE, complete

    bad = []
    for ckpt in complete(staging / "checkpoints"):
        try:
            json.loads((ckpt / RUN_STATE).read_text())
            state = ckpt / TRAINING_STATE / "policy"
            for file in state.rglob("*.pt"):  # ddp's state.pt; DeepSpeed's partitions; the schedule's
                torch.load(file, weights_only=False)
            if any(state.glob("*.distcp")):  # torch.distributed.checkpoint's shards, through their index
                from torch.distributed.checkpoint import FileSystemReader

                FileSystemReader(state).read_metadata()
            if not any(state.iterdir()):
                raise FileNotFoundError(state)
            torch.load(ckpt / "process_0.pt", weights_only=False)
            from safetensors.torch import load_file

            load_file(ckpt / "model.safetensors")
        except Exception as err:  # any failure to read back is what this bench counts
            bad.append(f"{ckpt.name}: {type(err).__name__}")
    return bad


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kills", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", default="ddp", help="train.backend (one process): ddp, fsdp2, zero2 or zero3")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for every run, e.g. rollout.placement=separate (repeatable)")
    args = p.parse_args(argv)
    RUN.extend([f"train.backend={args.backend}", *args.set])
    rng = random.Random(args.seed)
    from posttrain.models.embedded import build_model_dir

    root = Path(tempfile.mkdtemp(prefix="kill_resume_"))
    os.environ.setdefault("POSTTRAIN_CACHE", str(root / "cache"))
    model = build_model_dir(root / "init", hidden=32, layers=2, heads=2)
    start, first = time.perf_counter(), None
    ref = posttrain(f"model.path={model}", f"output_dir={root / 'whole'}")
    while ref.poll() is None:  # when the first checkpoint appears: training has begun
        if first is None and (root / "whole.partial" / "checkpoints" / "step_1").is_dir():
            first = time.perf_counter() - start
        time.sleep(0.02)
    if ref.returncode != 0:
        print(ref.stderr.read(), file=sys.stderr)
        return 1
    duration = time.perf_counter() - start
    expected = (root / "whole" / "model" / "model.safetensors").read_bytes()
    walls = [json.loads(line)["wall_seconds"] for line in (root / "whole" / "metrics.jsonl").read_text().splitlines()]
    step_time = sorted(b - a for a, b in zip(walls, walls[1:]))[(STEPS - 1) // 2]  # median, checkpoint write included
    print(f"train.backend={args.backend}{''.join(' ' + o for o in args.set)}; uninterrupted run: {duration:.1f} s, its first checkpoint at "
          f"{first or 0:.1f} s, {step_time:.2f} s a step; "
          f"killing {args.kills} runs, each after a random number of logged steps and a random part of a step more")
    identical = corrupt = 0
    for i in range(args.kills):
        out, logged, delay = root / f"run{i}", rng.randrange(STEPS), rng.uniform(0.0, step_time)
        proc = posttrain(f"model.path={model}", f"output_dir={out}")
        metrics = out.with_name(out.name + ".partial") / "metrics.jsonl"
        while proc.poll() is None and (not metrics.is_file() or len(metrics.read_text().splitlines()) < logged):
            time.sleep(0.005)
        try:
            proc.wait(timeout=delay)
            where = "after it finished"
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            where = f"step {logged} + {delay:.2f} s"
        staging = out.with_name(out.name + ".partial")
        bad = corrupt_checkpoints(staging) if staging.is_dir() else []
        corrupt += bool(bad)
        done = (out / "summary.json").is_file() or (staging / "summary.json").is_file()  # killed while it closed
        if not (out / "summary.json").is_file():
            from posttrain.train.checkpoint import complete

            resume = ["resume=true"] if staging.is_dir() and complete(staging / "checkpoints") else []
            again = posttrain(f"model.path={model}", f"output_dir={out}", *resume)
            if again.wait() != 0:
                print(f"kill {i + 1} {where}: the resumed run failed: {again.stderr.read().strip()[-300:]}")
                continue
        steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
        same = (out / "model" / "model.safetensors").read_bytes() == expected and steps == list(range(1, STEPS + 1))
        identical += same
        resumed = json.loads((out / "summary.json").read_text()).get("resumed_from", {}).get("step")
        how = (f"resumed from step {resumed}" if resumed is not None else "its work was done" if done
               else "no checkpoint yet: started again")
        print(f"kill {i + 1:2d} {where:>18}: {how}; "
              f"{'identical' if same else 'DIFFERENT'}{'; corrupt: ' + ', '.join(bad) if bad else ''}")
    print(f"{identical}/{args.kills} identical, {corrupt} corrupt")
    return 0 if identical == args.kills and corrupt == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
