"""The same loop under `accelerate launch` with two CPU processes (DDP over gloo)."""

import json
import subprocess
import sys


def test_two_processes(tiny_model_dir, tmp_path):
    out = tmp_path / "ddp"
    proc = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2", "--cpu",
         "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "posttrain", "run",
         "recipe=grpo_math", f"model.path={tiny_model_dir}", f"output_dir={out}", "train.steps=2",
         "train.batch_size=2", "algorithm.group_size=2", "train.micro_batch_size=3", "rollout.max_new_tokens=6",
         "eval.num_problems=6", "data.train_size=100", "data.test_size=20"],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval_before"]["num_problems"] == 6  # each process scored its shard; counts were summed
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]
