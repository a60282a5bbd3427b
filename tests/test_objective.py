"""The logged `objective` (algorithms/base.py): for every registered method its gradient in log πθ is the surrogate
loss's, so that the value logged is that of the function the update descends; its value by hand where it has a
closed form; and the engine's `objective` is the plugin's, aggregated over the whole step like the loss.

(tests/test_reward_normalize.py is another matter: rewards made of several objectives.)"""

import math

import pytest
import torch
from helpers import micro_batched_grad, surrogate_grad

from posttrain.algorithms import REGISTRY, get
from posttrain.algorithms.common import clipped_objective
from posttrain.core.aggregation import MODES, Totals, aggregate
from posttrain.core.batch import Batch

LENGTHS = [3, 6, 1, 5, 4, 2, 6, 3]  # every row has a token (DPO's pairs need one); rows (2p, 2p + 1) are DPO's pairs


def batch_for(plugin, cfg, spread: float, seed: int = 0) -> tuple[Batch, torch.Tensor]:
    """A batch of 2 groups of 4 with what the engine would give `plugin` (what it `needs`, as the engine scores only
    that), and log πθ. `spread` = 0: π_old is πθ (ρ = 1), given only where needed; `spread` > 0: π_old is always given
    and off πθ, so that ratios leave the clip range."""
    g = torch.Generator().manual_seed(seed)
    B, R = len(LENGTHS), max(LENGTHS)
    logp = -torch.rand(B, R, generator=g) * 3
    mask = (torch.arange(R)[None, :] < torch.tensor(LENGTHS)[:, None]).float()  # [B, R]
    needs = plugin.needs(cfg)
    old = logp + spread * torch.randn(B, R, generator=g)
    end = (torch.rand(B, R, generator=g) < 0.4).float() * mask  # [B, R] step ends, and every row's last token
    end[torch.arange(B), torch.tensor(LENGTHS) - 1] = 1.0
    extra = {"values": 0.5 * torch.randn(B, R, generator=g)} if "values" in needs else {}
    if "step_reward" in needs:
        extra.update(step_reward=torch.rand(B, R, generator=g).round(decimals=1) * end, step_end=end)
    ids = torch.arange(B)[:, None].repeat(1, R + 2)  # each row's ids say which row it was (`prepared`)
    batch = Batch(input_ids=ids, attention_mask=torch.ones(B, R + 2), mask=mask,
                  prompt_len=2, group=torch.arange(2).repeat_interleave(4),
                  reward=torch.tensor([1.0, 0, 0, 1, 1, 1, 0, 1]), truncated=torch.zeros(B, dtype=torch.bool),
                  old_logp=old if spread or "old_logp" in needs else None,
                  ref_logp=logp + 0.3 * torch.randn(B, R, generator=g) if "ref_logp" in needs else None, extra=extra,
                  teacher_logp=logp + 0.5 * torch.randn(B, R, generator=g) if "teacher_logp" in needs else None)
    return batch, logp


def prepared(plugin, batch, logp, cfg) -> tuple[Batch, torch.Tensor]:
    """`plugin.prepare(batch)`, and the log-probs of the rows it kept, in its order (online DPO keeps one pair of each
    group): each row's ids say which row of `batch` it was."""
    out, _ = plugin.prepare(batch, cfg)
    return out, logp[out.input_ids[:, 0]]


def objective_grad(plugin, batch, logp0, cfg, mode, norm) -> torch.Tensor:
    """∂/∂logp of aggregate(objective(logp)), by autograd: what the engine logs, differentiated."""
    logp = logp0.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(aggregate(plugin.objective(batch, logp, cfg), batch.mask, mode, norm=norm), logp)
    return grad


def configs(plugin) -> list:
    """The defaults, and a KL weight and groups of 4 where the method has them (`sized_config`)."""
    return [plugin.Config(), plugin.sized_config(kl_weight=0.1, group=4)]


CASES = [(name, i) for name in REGISTRY for i in range(2)]  # every method registered, built in or added later


@pytest.mark.parametrize("spread", [0.0, 0.3], ids=["ratio1", "ratio-off-1"])
@pytest.mark.parametrize("name, which", CASES, ids=[f"{name}-{'sized' if i else 'default'}" for name, i in CASES])
def test_gradient_of_the_objective_is_the_surrogates(name, which, spread):
    """∇ aggregate(objective) = ∇ −aggregate(stopgrad(GC)·log πθ) under each aggregation the method allows: at ρ = 1,
    where the unified view's GC is the gradient of the method's objective, and off it, where the clip acts (every
    method here has GC the exact derivative of its objective at any ρ)."""
    plugin = get(name)
    cfg = configs(plugin)[which]
    batch, logp = batch_for(plugin, cfg, spread)
    ready, logp = prepared(plugin, batch, logp, cfg)
    fixed = plugin.aggregation(cfg)
    for mode, norm in [fixed] if fixed else [(m, 4.0) for m in MODES]:
        want = surrogate_grad(plugin, ready, logp, cfg, mode, norm)
        got = objective_grad(plugin, ready, logp, cfg, mode, norm)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5, msg=lambda m, mode=mode: f"{mode}: {m}")
        assert want.abs().sum() > 0 and (got[ready.mask == 0] == 0).all()


@pytest.mark.parametrize("name, which", CASES, ids=[f"{name}-{'sized' if i else 'default'}" for name, i in CASES])
def test_micro_batches_give_the_gradient_of_the_whole_batch(name, which):
    """The engine computes GC one micro-batch at a time, each from its own rows, and divides by the whole step's
    counts: for every method, under each aggregation it allows, micro-batches of one unit (a row, or a pair) give
    autograd's gradient of the objective of the whole batch, off ρ = 1. Per-batch work (group advantages) is
    `prepare`'s, on the whole batch, before the split."""
    plugin = get(name)
    cfg = configs(plugin)[which]
    batch, logp = batch_for(plugin, cfg, 0.3)
    ready, logp = prepared(plugin, batch, logp, cfg)
    fixed = plugin.aggregation(cfg)
    for mode, norm in [fixed] if fixed else [(m, 4.0) for m in MODES]:
        want = objective_grad(plugin, ready, logp, cfg, mode, norm)
        got = micro_batched_grad(plugin, ready, logp, cfg, mode, norm, plugin.unit)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5, msg=lambda m, mode=mode: f"{mode}: {m}")


def test_objective_runs_without_grad_and_leaves_the_batch_alone():
    """The engine passes detached log-probs under no_grad: every objective must be computable there (no backward,
    no in-place write on the batch)."""
    for name in REGISTRY:
        plugin = get(name)
        cfg = configs(plugin)[1]
        batch, logp = batch_for(plugin, cfg, 0.3)
        ready, logp = prepared(plugin, batch, logp, cfg)
        before = {k: v.clone() for k, v in vars(ready).items() if isinstance(v, torch.Tensor)}
        with torch.no_grad():
            value = plugin.objective(ready, logp, cfg)  # [B, R]
        assert value.shape == logp.shape and torch.isfinite(value).all(), name
        assert all(torch.equal(getattr(ready, k), v) for k, v in before.items()), name


def test_clipped_objective_hand_worked():
    """ε = 0.2. A = 1, ρ = 1.5: min(1.5, 1.2) = 1.2. A = −1, ρ = 0.5: min(−0.5, −0.8) = −0.8. A = 2, ρ = 0.9 (inside):
    1.8. With ε_high = 0.6, A = 1, ρ = 1.5: 1.5 (inside the wider range)."""
    adv = torch.tensor([[1.0, -1.0, 2.0]])
    logp = torch.log(torch.tensor([[1.5, 0.5, 0.9]]))
    got = clipped_objective(adv, logp, torch.zeros_like(logp), 0.2, None)
    torch.testing.assert_close(got, torch.tensor([[1.2, -0.8, 1.8]]))
    torch.testing.assert_close(clipped_objective(adv, logp, torch.zeros_like(logp), 0.2, 0.6)[0, 0], torch.tensor(1.5))


def test_sft_objective_is_the_negative_log_likelihood():
    """SFT's GC is 1, so its objective and the surrogate loss have the same value: the mean NLL."""
    plugin = get("sft")
    batch, logp = batch_for(plugin, plugin.Config(), 0.0)
    for mode in MODES:
        nll = aggregate(plugin.objective(batch, logp, plugin.Config()), batch.mask, mode)
        torch.testing.assert_close(nll, -aggregate(logp, batch.mask, mode))


@pytest.mark.parametrize("length_normalize", [False, True], ids=["summed", "eq12"])
def test_dpo_objective_is_its_loss(length_normalize):
    """Under DPO's own aggregation the objective is the mean over pairs of −log σ(z), the `dpo_loss` metric; by hand
    for one pair with z = 1: log(1 + e⁻¹) = 0.31326169 (tests/test_dpo.py's hand-worked pair)."""
    plugin = get("dpo")
    cfg = plugin.Config(beta=0.3, length_normalize=length_normalize)
    batch, logp = batch_for(plugin, cfg, 0.0)
    mode, norm = plugin.aggregation(cfg)
    value = aggregate(plugin.objective(batch, logp, cfg), batch.mask, mode, norm=norm)
    torch.testing.assert_close(value, plugin.coefficient(batch, logp, cfg)[1]["dpo_loss"])
    logp = torch.tensor([[-1.0, -2.0, -9.0], [-1.0, -1.0, -1.0]])
    pair = Batch(input_ids=torch.zeros(2, 5, dtype=torch.long), attention_mask=torch.ones(2, 5), prompt_len=2,
                 mask=torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]),
                 ref_logp=torch.tensor([[-1.2, -2.3, -5.0], [-0.8, -0.9, -0.8]]))
    cfg = plugin.Config(beta=1.0)
    mode, norm = plugin.aggregation(cfg)
    value = aggregate(plugin.objective(pair, logp, cfg), pair.mask, mode, norm=norm)
    torch.testing.assert_close(value, torch.tensor(math.log(1 + math.exp(-1))))


def test_engine_logs_the_objective_of_the_whole_step(tiny_model_dir, tmp_path):
    """GRPO with β = 0.1 on micro-batches of 3 rows: `objective` is the plugin's objective of the whole batch under
    the run's aggregation, as if it were one micro-batch, while `loss` stays the surrogate's."""
    from test_engine import grouped_batch, make_cfg, make_engine

    cfg, _ = make_cfg(tiny_model_dir, tmp_path, "train.loss_agg=token_mean", "algorithm.beta=0.1")
    engine = make_engine(cfg, tiny_model_dir)
    batch = grouped_batch(engine, cfg)
    engine.micro = 3
    metrics = engine.accumulate(batch, Totals.of(batch.mask))
    logp = engine.score(engine.policy.module, batch)  # [B, R] the same weights: accumulate does not step
    objective = engine.plugin.objective(batch, logp, cfg.algorithm)
    want = aggregate(objective, batch.mask, "token_mean")
    torch.testing.assert_close(metrics["objective"], want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(metrics["objective"], metrics["loss"])  # the surrogate's value is another number
