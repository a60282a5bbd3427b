"""The engine: micro-batch invariance of the gradient, exact repeats with a seed, models loaded only when asked."""

import json

import pytest
import torch
from accelerate import Accelerator

from posttrain import config, rollout
from posttrain.aggregation import MODES, Totals
from posttrain.trainer import Engine, run


def make_cfg(model_dir, tmp_path, *overrides):
    cfg, resolved = config.load("grpo_math", [f"model.path={model_dir}", f"output_dir={tmp_path / 'run'}",
                                              "eval.num_problems=4", "eval.batch_size=4", "train.batch_size=2",
                                              "algorithm.group_size=4", "rollout.max_new_tokens=6",
                                              "data.train_size=200", "data.test_size=20", *overrides])
    return cfg, resolved


@pytest.mark.parametrize("mode", MODES)
def test_gradient_invariant_to_micro_batches(tiny_model_dir, tmp_path, mode):
    """Groups of 4 split across micro-batches of 3 give the gradient of the whole batch at once."""
    cfg, _ = make_cfg(tiny_model_dir, tmp_path, f"train.loss_agg={mode}", "algorithm.beta=0.1")
    engine = Engine(cfg, tiny_model_dir, Accelerator(cpu=True))
    torch.manual_seed(0)
    batch = rollout.sample(engine.model, engine.tokenizer, [[5, 6, 7], [8, 9]], 4, max_new_tokens=6)
    batch.reward = torch.tensor([1.0, 0, 0, 1, 0, 1, 1, 1])
    batch.ref_logp = engine.score(engine.ref, batch) + 0.1 * torch.randn(batch.mask.shape)
    batch, _ = engine.plugin.prepare(batch, cfg.algorithm)
    grads = []
    for micro in (8, 3):
        engine.cfg.train.micro_batch_size = micro
        engine.optimizer.zero_grad()
        engine.accumulate(batch, Totals.of(batch.mask))
        grads.append(torch.cat([p.grad.flatten() for p in engine.model.parameters()]))
    assert grads[0].abs().sum() > 0
    torch.testing.assert_close(grads[0], grads[1], atol=1e-6, rtol=1e-4)


def test_reference_loaded_only_when_asked(tiny_model_dir, tmp_path):
    assert Engine(make_cfg(tiny_model_dir, tmp_path, "algorithm.beta=0")[0], tiny_model_dir,
                  Accelerator(cpu=True)).ref is None
    assert Engine(make_cfg(tiny_model_dir, tmp_path, "algorithm.beta=0.1")[0], tiny_model_dir,
                  Accelerator(cpu=True)).ref is not None


def test_seeded_runs_repeat_exactly(tiny_model_dir, tmp_path):
    outs = []
    for name in ("a", "b"):
        cfg, resolved = make_cfg(tiny_model_dir, tmp_path, f"output_dir={tmp_path / name}", "train.steps=2",
                                 "algorithm.mu=2", "train.micro_batch_size=3")
        run(cfg, resolved, quiet=True)
        lines = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        timing = ("time/", "tokens_per_s", "wall_seconds")
        outs.append(([{k: v for k, v in m.items() if not k.startswith(timing)} for m in lines],
                     (tmp_path / name / "model" / "model.safetensors").read_bytes()))
    assert outs[0] == outs[1]
