"""DPO: a hand-worked pair, and the surrogate gradient against autograd on the DPO loss written out pair by pair."""

import math

import pytest
import torch
from helpers import objective_grad, surrogate_grad

from posttrain.algorithms import get
from posttrain.algorithms.dpo import DPO, DPOConfig  # importing the module registers "dpo"
from posttrain.core.batch import Batch
from posttrain.core.errors import ConfigError


def make_batch(mask, ref_logp):
    B, R = mask.shape
    return Batch(input_ids=torch.zeros(B, R + 2, dtype=torch.long), attention_mask=torch.ones(B, R + 2), mask=mask,
                 prompt_len=2, ref_logp=ref_logp)


def random_batch(pairs=4, R=6, seed=0):
    """Rows [chosen_0, rejected_0, ...] with responses of 1 to R tokens, right-padded; padding holds junk values."""
    g = torch.Generator().manual_seed(seed)
    B = 2 * pairs
    logp = -torch.rand(B, R, generator=g) * 3
    ref = logp + 0.5 * torch.randn(B, R, generator=g)
    lengths = torch.tensor([6, 2, 1, 6, 4, 5, 3, 3])[:B]
    mask = (torch.arange(R)[None, :] < lengths[:, None]).float()
    return make_batch(mask, ref), logp


def written_out_loss(batch, cfg):
    """Mean over pairs of −(1−ε) log σ(z) − ε log σ(−z), z = β(ℓ⁺ − ℓ⁻), ℓ a (length-averaged) sum of token log-ratios."""

    def L(logp):
        losses = []
        for p in range(logp.shape[0] // 2):
            ell = []
            for i in (2 * p, 2 * p + 1):
                tokens = [t for t in range(logp.shape[1]) if batch.mask[i, t] == 1]
                s = sum(logp[i, t] - batch.ref_logp[i, t] for t in tokens)
                ell.append(s / len(tokens) if cfg.length_normalize else s)
            z = cfg.beta * (ell[0] - ell[1])
            eps = cfg.label_smoothing
            losses.append(-(1 - eps) * torch.log(torch.sigmoid(z)) - eps * torch.log(torch.sigmoid(-z)))
        return sum(losses) / len(losses)

    return L


@pytest.mark.parametrize("length_normalize", [False, True], ids=["summed", "eq12"])
@pytest.mark.parametrize("beta", [0.05, 0.5, 2.0])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("seed", [0, 1])
def test_gradient_matches_objective(length_normalize, beta, label_smoothing, seed):
    cfg = DPOConfig(beta=beta, length_normalize=length_normalize, label_smoothing=label_smoothing)
    batch, logp = random_batch(seed=seed)
    mode, norm = DPO.aggregation(cfg)
    got = surrogate_grad(DPO, batch, logp, cfg, mode, norm)
    # objective_grad differentiates −objective; the loss is minimised, so pass −loss.
    want = objective_grad(lambda lp: -written_out_loss(batch, cfg)(lp), logp)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    assert got.abs().sum() > 0 and (got[batch.mask == 0] == 0).all()


def test_hand_worked_pair():
    """One pair, β = 1. Chosen: 2 tokens, logp [−1.0, −2.0], ref [−1.2, −2.3], log-ratio 0.2 + 0.3 = 0.5 (one pad).
    Rejected: 3 tokens, logp [−1, −1, −1], ref [−0.8, −0.9, −0.8], log-ratio −0.2 − 0.1 − 0.2 = −0.5.
    z = 1·(0.5 − (−0.5)) = 1; σ(−1) = 1/(1 + e) = 0.26894142; loss = log(1 + e⁻¹) = 0.31326169.
    GC = ±2·β·σ(−1) = ±0.53788284 (the 2: the engine averages over 2 sequences, DPO over 1 pair), so the surrogate
    gradient −GC/2 is −0.26894142 on chosen tokens and +0.26894142 on rejected ones, 0 on the pad.
    With ε = 0.1: w = 0.9·0.26894142 − 0.1·0.73105858 = 0.16894142, GC = ±0.33788284,
    loss = 0.9·0.31326169 + 0.1·1.31326169 = 0.41326169."""
    logp = torch.tensor([[-1.0, -2.0, -9.0], [-1.0, -1.0, -1.0]])
    ref = torch.tensor([[-1.2, -2.3, -5.0], [-0.8, -0.9, -0.8]])
    batch = make_batch(torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]), ref)

    cfg = DPOConfig(beta=1.0)
    gc, metrics = DPO.coefficient(batch, logp, cfg)
    torch.testing.assert_close(gc, torch.tensor([[0.53788284, 0.53788284, 0.0], [-0.53788284] * 3]))
    torch.testing.assert_close(metrics["reward_margin"], torch.tensor(1.0))
    torch.testing.assert_close(metrics["chosen_logratio"], torch.tensor(0.5))
    torch.testing.assert_close(metrics["rejected_logratio"], torch.tensor(-0.5))
    torch.testing.assert_close(metrics["pair_accuracy"], torch.tensor(1.0))
    torch.testing.assert_close(metrics["dpo_loss"], torch.tensor(0.31326169))
    grad = surrogate_grad(DPO, batch, logp, cfg, *DPO.aggregation(cfg))
    torch.testing.assert_close(grad, torch.tensor([[-0.26894142, -0.26894142, 0.0], [0.26894142] * 3]))

    gc, metrics = DPO.coefficient(batch, logp, DPOConfig(beta=1.0, label_smoothing=0.1))
    torch.testing.assert_close(gc, torch.tensor([[0.33788284, 0.33788284, 0.0], [-0.33788284] * 3]))
    torch.testing.assert_close(metrics["dpo_loss"], torch.tensor(0.41326169))
    assert math.isclose(1 / (1 + math.e), 0.26894142, abs_tol=1e-8)


def test_policy_equal_to_reference():
    """At the start of training πθ = π_ref, so ℓ± = 0 and z = 0: no pair is preferred yet (pair_accuracy counts
    z > 0 only), the loss is log 2 = 0.69314718, w = σ(0) = 0.5 and GC = ±2·β·0.5 = ±β."""
    batch, _ = random_batch()
    cfg = DPOConfig(beta=0.3)
    gc, metrics = DPO.coefficient(batch, batch.ref_logp.clone(), cfg)
    torch.testing.assert_close(metrics["pair_accuracy"], torch.tensor(0.0))
    torch.testing.assert_close(metrics["reward_margin"], torch.tensor(0.0))
    torch.testing.assert_close(metrics["dpo_loss"], torch.tensor(0.69314718))
    sign = torch.tensor([1.0, -1.0] * 4)[:, None]
    torch.testing.assert_close(gc, 0.3 * sign * batch.mask)


def test_pairs_are_independent():
    """GC of a pair does not depend on the other pairs, so any split into whole pairs gives the same coefficients."""
    cfg = DPOConfig(beta=0.3, length_normalize=True)
    batch, logp = random_batch()
    whole, _ = DPO.coefficient(batch, logp, cfg)
    parts = [DPO.coefficient(batch.select(slice(i, i + 2)), logp[i : i + 2], cfg)[0] for i in range(0, len(batch), 2)]
    torch.testing.assert_close(whole, torch.cat(parts))


def test_shape_checks():
    batch, logp = random_batch()
    with pytest.raises(AssertionError, match="odd"):
        DPO.coefficient(batch.select(slice(0, 3)), logp[:3], DPOConfig())
    with pytest.raises(AssertionError, match="ref_logp"):
        DPO.coefficient(make_batch(batch.mask, batch.ref_logp[:, :-1]), logp, DPOConfig())
    with pytest.raises(AssertionError, match="ref_logp"):
        DPO.coefficient(make_batch(batch.mask, None), logp, DPOConfig())
    with pytest.raises(AssertionError, match="mask"):
        DPO.coefficient(make_batch(batch.mask[:, :-1], batch.ref_logp), logp, DPOConfig())


def test_plugin_contract():
    assert get("dpo") is DPO and DPO.name == "dpo"
    assert DPO.source == "pairs" and DPO.unit == 2 and DPO.Config is DPOConfig
    assert DPO.needs(DPOConfig()) == {"ref_logp"}
    assert DPO.aggregation(DPOConfig()) == ("seq_mean_token_sum_norm", 1.0)
    assert DPO.aggregation(DPOConfig(length_normalize=True)) == ("seq_mean_token_mean", 1.0)


@pytest.mark.parametrize("kwargs, key", [({"beta": 0.0}, "beta"), ({"beta": -1.0}, "beta"),
                                         ({"label_smoothing": 0.5}, "label_smoothing"),
                                         ({"label_smoothing": -0.1}, "label_smoothing"),
                                         ({"samples_per_prompt": 1}, "samples_per_prompt"),
                                         ({"num_prompts": 0}, "num_prompts")])
def test_out_of_range(kwargs, key):
    with pytest.raises(ConfigError, match=f"^{key}: "):
        DPOConfig(**kwargs)
