"""Two processes for real (torchrun, DDP over gloo on CPU): each test first asserts that the world size is 2."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent


def torchrun(*args, timeout=300):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           *map(str, args)], capture_output=True, text=True, timeout=timeout, env=env)


def test_two_rank_update_equals_one_process_on_the_same_global_batch(tiny_model_dir, tmp_path):
    """Rows split over 2 ranks (2 micro-batches each, gradients synced once) give the gradient and the step of one
    process holding all 8 rows: the loss is normalised by the whole step's counts, and DDP's averaging undone."""
    single = subprocess.run([sys.executable, HERE / "ddp_update.py", tiny_model_dir, tmp_path / "one.pt"],
                            capture_output=True, text=True, timeout=300)
    assert single.returncode == 0, single.stderr[-3000:]
    two = torchrun(HERE / "ddp_update.py", tiny_model_dir, tmp_path / "two.pt")
    assert two.returncode == 0, two.stderr[-3000:]
    one, both = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    assert one["world_size"] == 1 and both["world_size"] == 2
    assert both["head"] == one["head"] == "ScoringHead"  # the chunked head ran inside DDP's forward
    assert one["max"] == 0 and both["max"] == 1  # reduce(..., "max") across ranks (the mismatch's largest gap)
    assert sum(g.abs().sum() for g in one["grads"].values()) > 0
    for name, grad in one["grads"].items():
        torch.testing.assert_close(both["grads"][name], grad, atol=1e-6, rtol=1e-5)
        # AdamW's first step is lr·g/(|g| + ε): where |g| is near fp32 noise, equal-within-tolerance gradients can
        # still step differently, so the weights are compared where the gradient is well above that noise.
        clear = grad.abs() > 1e-5
        torch.testing.assert_close(both["weights"][name][clear], one["weights"][name][clear], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("extra", [[], ["model.lora.r=4"]], ids=["full", "lora"])
def test_cli_run_on_two_ranks(tiny_model_dir, tmp_path, extra):
    """The README's multi-process command: `torchrun --nproc_per_node 2 -m posttrain run …` exits 0 on both ranks,
    training every weight or a LoRA adapter (whose reference is the base with the adapter off on each rank)."""
    out = tmp_path / "ddp"
    proc = torchrun("-m", "posttrain", "run", "recipe=grpo_math", f"model.path={tiny_model_dir}", f"output_dir={out}",
                    "train.steps=2", "train.batch_size=2", "algorithm.group_size=2", "train.micro_batch_size=3",
                    "rollout.max_new_tokens=6", "eval.num_problems=6", "data.train_size=100", "data.test_size=20",
                    *extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2
    if extra:
        assert (out / "model" / "adapter_config.json").is_file()
        assert summary["parameters"]["trained"] < summary["parameters"]["total"]
    assert summary["eval_before"]["num_problems"] == 6  # each rank scored 3; the counts were summed
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert proc.stdout.count("held-out accuracy") == 1  # printed by rank 0 only
