"""A method in a file of its own (`algorithm.name=path/to/file.py:Class`), and the README's "Add a method" as printed:
its file's gradient checked against autograd on the objective written out directly, and its command run."""

import re
from pathlib import Path

import pytest
import torch
from cli_helpers import assert_one_line_error, posttrain, posttrain_here

from posttrain import algorithms
from posttrain.core.aggregation import MODES, aggregate
from posttrain.core.batch import Batch

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_example() -> tuple[str, str, list[str]]:
    """The section's file name, the file as printed, and the arguments of the `posttrain run` it prints."""
    section = README.read_text().split("## Add a method", 1)[1].split("\n## ", 1)[0]
    name, code = re.search(r"```python\n# (\S+\.py)\n(.*?)```", section, re.S).groups()
    command = re.search(r"^ *posttrain run (.+)$", section, re.M).group(1)
    return name, f"# {name}\n{code}", command.split()


@pytest.fixture
def example(tmp_path):
    name, code, command = readme_example()
    (tmp_path / name).write_text(code)
    return tmp_path, name, command


def test_the_readme_s_method_is_its_objective_s_gradient(example):
    """GC against autograd on REINFORCE's objective written out: J = Σ_i (r_i − b)·(1/|o_i|)·Σ_t log π(o_it), under
    every aggregation the engine has (the method fixes none)."""
    where, name, _ = example
    plugin = algorithms.get(f"{where / name}:{readme_entry_class()}")
    cfg = plugin.Config()
    g = torch.Generator().manual_seed(0)
    B, R = 6, 5
    mask = (torch.arange(R) < torch.tensor([5, 3, 4, 1, 5, 2])[:, None]).float()  # [B, R]
    reward = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.2, 1.0])  # [B]
    batch = Batch(input_ids=torch.zeros(B, R + 2, dtype=torch.long), attention_mask=torch.ones(B, R + 2), mask=mask,
                  prompt_len=2, group=torch.arange(B), reward=reward, truncated=torch.zeros(B, dtype=torch.bool))
    logp0 = -torch.rand(B, R, generator=g)
    advantage = reward - cfg.baseline  # [B]
    for mode in MODES:
        logp = logp0.clone().requires_grad_(True)
        gc, _ = plugin.coefficient(batch, logp.detach(), cfg)
        (got,) = torch.autograd.grad(-aggregate(gc * logp, mask, mode, norm=4.0), logp)
        logp = logp0.clone().requires_grad_(True)
        per_seq = (logp * mask).sum(-1)  # [B]
        if mode == "seq_mean_token_mean":  # written out, not through aggregate
            j = (advantage * per_seq / mask.sum(-1)).mean()
        elif mode == "token_mean":
            j = (advantage * per_seq).sum() / mask.sum()
        else:  # seq_mean_token_sum_norm: each sequence's sum over a fixed norm
            j = (advantage * per_seq / 4.0).mean()
        (want,) = torch.autograd.grad(-j, logp)
        torch.testing.assert_close(got, want)
        assert want.abs().sum() > 0
    # and the objective it logs is the loss whose gradient that is
    logp = logp0.clone().requires_grad_(True)
    (logged,) = torch.autograd.grad(aggregate(plugin.objective(batch, logp, cfg), mask, MODES[0]), logp)
    torch.testing.assert_close(logged, -torch.autograd.grad((advantage * (logp * mask).sum(-1) / mask.sum(-1)).mean(),
                                                            logp)[0])


def readme_entry_class() -> str:
    _, _, command = readme_example()
    entry = next(a for a in command if a.startswith("algorithm.name="))
    return entry.rpartition(":")[2]


def test_the_readme_s_command_runs_the_method(example, tiny_model_dir):
    """The command as printed, in the file's directory, with a tiny model and two steps appended to keep it short."""
    where, _, command = example
    proc = posttrain("run", *command, f"model.path={tiny_model_dir}", "train.steps=2", "eval.num_problems=4",
                     "train.batch_size=2", "rollout.max_new_tokens=8", "output_dir=out", cwd=where)
    assert proc.returncode == 0, proc.stderr
    import json

    steps = [json.loads(line) for line in (where / "out" / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 2 and all("advantage" in s for s in steps)  # its own metric: the file's method ran
    assert json.loads((where / "out" / "summary.json").read_text())["algorithm"] == readme_entry_class()


BAD = {
    "missing.py:M": "algorithm.name: no such file",
    "{dir}/notes.txt:M": "not a Python source file",
    "{dir}/plain.py": "expected path/to/file.py:Class",
    "{dir}/plain.py:Nothing": "'Nothing' in '{dir}/plain.py' is nothing",
    "{dir}/plain.py:value": "'value' in '{dir}/plain.py' is a int",
    "{dir}/plain.py:NotAPlugin": "the class NotAPlugin, not an Algorithm subclass",
    "{dir}/plain.py:NoGC": "does not define coefficient and objective",
    "{dir}/broken.py:M": "importing '{dir}/broken.py' failed (ZeroDivisionError",
}


@pytest.mark.parametrize("entry", list(BAD))
def test_a_bad_method_file_is_one_line(tmp_path, entry):
    (tmp_path / "notes.txt").write_text("")
    (tmp_path / "broken.py").write_text("1 / 0\n")
    (tmp_path / "plain.py").write_text(
        "from dataclasses import dataclass\nfrom posttrain.algorithms import Algorithm\nvalue = 3\n"
        "class NotAPlugin:\n    pass\n@dataclass\nclass C:\n    x: int = 1\nclass NoGC(Algorithm):\n    Config = C\n")
    proc = posttrain_here("run", "recipe=grpo_math", f"algorithm.name={entry.format(dir=tmp_path)}", cwd=tmp_path)
    assert_one_line_error(proc, BAD[entry].format(dir=tmp_path))
