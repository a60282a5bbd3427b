"""train.precision: bf16 compute really runs (autocast, or bf16 weights), log-probs stay float32, and the policy
gradient stays within a stated bound of the fp32 one. fp32 is checked exactly by every other gradient test."""

import pytest
import torch

from posttrain import config
from posttrain.backends.ddp import DDP
from posttrain.core.aggregation import Totals
from posttrain.sources import run_splits
from posttrain.train import Engine


def grpo_gradient(model_dir, tmp_path, precision):
    """One GRPO backward on a fixed batch (the fp32 engine samples it, with seed 0) under `precision`; returns the
    engine, the float32 gradient and the dtypes the first attention projection computed in."""
    cfg, _ = config.load("grpo_math", [f"model.path={model_dir}", f"output_dir={tmp_path / precision}",
                                       f"train.precision={precision}", "algorithm.beta=0.1", "train.batch_size=2",
                                       "algorithm.group_size=4", "data.train_size=50", "data.test_size=5"])
    engine = Engine(cfg, model_dir, DDP(precision=precision), run_splits(cfg))
    torch.manual_seed(0)
    sampler = Engine(config.load("grpo_math", [f"model.path={model_dir}", "data.train_size=50",
                                               "data.test_size=5"])[0], model_dir, DDP(), run_splits(cfg)).rollout
    batch = sampler.generate([[5, 6, 7], [8, 9]], 4, max_new_tokens=8)
    batch.reward = torch.tensor([1.0, 0, 0, 1, 0, 1, 1, 1])
    batch.ref_logp = engine.score(engine.ref, batch)
    batch, _ = engine.plugin.prepare(batch, cfg.algorithm)
    seen = []
    layer = engine.policy.module.model.layers[0].self_attn.q_proj
    hook = layer.register_forward_hook(lambda m, i, out: seen.append(out.dtype))
    engine.accumulate(batch, Totals.of(batch.mask))
    hook.remove()
    grad = torch.cat([p.grad.float().flatten() for p in engine.policy.module.parameters()])
    return engine, grad, set(seen), batch


@pytest.fixture(scope="module")
def fp32(tiny_model_dir, tmp_path_factory):
    return grpo_gradient(tiny_model_dir, tmp_path_factory.mktemp("fp32"), "fp32")


@pytest.mark.parametrize("precision, bound", [("bf16-mixed", 0.02), ("bf16", 0.02)])
def test_bf16_gradient_is_close_to_fp32(fp32, tiny_model_dir, tmp_path, precision, bound):
    """‖g − g_fp32‖ / ‖g_fp32‖ below the bound, and the bf16 path really ran: bf16 compute under autocast with
    fp32 weights, gradients and AdamW state (bf16-mixed), or everything in bf16 (bf16)."""
    _, want, seen_fp32, _ = fp32
    engine, got, seen, batch = grpo_gradient(tiny_model_dir, tmp_path, precision)
    assert seen_fp32 == {torch.float32} and seen == {torch.bfloat16}
    params = list(engine.policy.module.parameters())
    weights = torch.float32 if precision == "bf16-mixed" else torch.bfloat16
    assert {p.dtype for p in params} == {p.grad.dtype for p in params} == {weights}
    assert {p.dtype for p in engine.ref.parameters()} == {torch.bfloat16}
    assert engine.score(engine.ref, batch).dtype == torch.float32
    error = ((got - want).norm() / want.norm()).item()
    print(f"{precision}: relative gradient error {error:.4f}")
    assert 0 < error < bound
    engine.backend.step(engine.policy, 1.0)
    state = engine.policy.optimizer.state[params[0]]
    assert state["exp_avg"].dtype == weights
