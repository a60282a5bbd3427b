"""SAPO: the soft gate by hand, and the surrogate gradient against autograd on the objective (arXiv:2511.20347)
written out with plain torch ops."""

import math

import pytest
import torch
from helpers import micro_batched_grad, objective_grad, ragged_batch, surrogate_grad, written_out_mean

from posttrain import config
from posttrain.algorithms import get
from posttrain.algorithms.common import group_advantages
from posttrain.algorithms.grpo import GRPOConfig
from posttrain.algorithms.sapo import SAPOConfig
from posttrain.core.aggregation import MODES
from posttrain.core.batch import Batch
from posttrain.core.errors import ConfigError

SAPO, GRPO = get("sapo"), get("grpo")


def sapo_objective(batch, cfg, mode, norm):
    """J = aggregate of (4/τ)·σ(τ(ρ − 1))·Â with τ = τ_pos where Â > 0 else τ_neg, minus β·k3, token by token."""
    adv = group_advantages(batch.reward, batch.group, cfg.adv_norm, cfg.eps)
    B, R = batch.mask.shape

    def J(logp):
        old = batch.old_logp if batch.old_logp is not None else logp.detach()
        terms = torch.zeros(B, R)
        for i in range(B):
            tau = cfg.tau_pos if adv[i] > 0 else cfg.tau_neg
            for t in range(R):
                rho = torch.exp(logp[i, t] - old[i, t])
                gate = 4 / tau / (1 + torch.exp(-tau * (rho - 1)))
                kl = torch.exp(batch.ref_logp[i, t] - logp[i, t]) - (batch.ref_logp[i, t] - logp[i, t]) - 1
                terms[i, t] = gate * adv[i] - cfg.beta * kl
        return written_out_mean(terms, batch.mask, mode, norm)

    return J


def test_gate_hand_worked():
    """τ_pos = 1, τ_neg = 2 (a clear asymmetry); w = 4σ(1 − σ), σ = σ(τ(ρ − 1)); GC = w·ρ·Â.

    row 0, Â = +1, τ = 1: ρ = 1 -> σ = 1/2, w = 1, GC = 1; ρ = 2 -> σ(1) = 0.731059, w = 0.786448, GC = 1.572895;
    row 1, Â = −1, τ = 2: ρ = 2 -> σ(2) = 0.880797, w = 0.419974, GC = −0.839949; ρ = 1 -> GC = −1.
    gate = the mean of w over the four tokens; ratio = 1.5."""
    old = -torch.ones(2, 2)
    logp = old + torch.log(torch.tensor([[1.0, 2.0], [2.0, 1.0]]))
    batch = Batch(input_ids=torch.zeros(2, 4, dtype=torch.long), attention_mask=torch.ones(2, 4),
                  mask=torch.ones(2, 2), prompt_len=2, adv=torch.tensor([1.0, -1.0]), old_logp=old)
    gc, metrics = SAPO.coefficient(batch, logp, SAPOConfig(group_size=2, tau_pos=1.0, tau_neg=2.0))

    def w(x):
        s = 1 / (1 + math.exp(-x))
        return 4 * s * (1 - s)

    want = torch.tensor([[1.0, 2 * w(1.0)], [-2 * w(2.0), -1.0]])
    torch.testing.assert_close(gc, want)
    torch.testing.assert_close(want[0, 1], torch.tensor(1.572895), atol=1e-6, rtol=0)
    torch.testing.assert_close(metrics["gate"], torch.tensor((2 + w(1.0) + w(2.0)) / 4))
    torch.testing.assert_close(metrics["ratio"], torch.tensor(1.5))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("spread", [0.0, 0.5], ids=["mu1-ratio1", "ratio-off-1"])
@pytest.mark.parametrize("cfg", [SAPOConfig(group_size=3), SAPOConfig(group_size=3, beta=0.04),
                                 SAPOConfig(group_size=3, tau_pos=0.5, tau_neg=3.0),
                                 SAPOConfig(group_size=3, adv_norm="none")],
                         ids=["paper", "beta", "asymmetric", "unscaled"])
def test_gradient_matches_objective(mode, spread, cfg):
    """The surrogate's gradient, whole and in micro-batches of 2 rows, against autograd on J written out."""
    batch, logp = ragged_batch(spread=spread)
    if not spread:
        batch.old_logp = None
    prepared, _ = SAPO.prepare(batch, cfg)
    want = objective_grad(sapo_objective(batch, cfg, mode, 4.0), logp)
    torch.testing.assert_close(surrogate_grad(SAPO, prepared, logp, cfg, mode, 4.0), want, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(micro_batched_grad(SAPO, prepared, logp, cfg, mode, 4.0, 2), want, atol=1e-6,
                               rtol=1e-5)
    _, metrics = SAPO.coefficient(prepared, logp, cfg)
    assert (metrics["gate"] < 1) if spread else (metrics["gate"] == 1)


def test_on_policy_sapo_is_grpo_and_off_policy_it_is_not():
    """At ρ = 1 the gate's weight is 1: GC = Â, GRPO's. Off-policy, SAPO fades tokens smoothly where GRPO keeps or
    drops them whole."""
    for spread, same in [(0.0, True), (0.5, False)]:
        batch, logp = ragged_batch(spread=spread)
        if not spread:
            batch.old_logp = None
        s, g = SAPOConfig(group_size=3), GRPOConfig(group_size=3, beta=0.0)
        got = surrogate_grad(SAPO, SAPO.prepare(batch, s)[0], logp, s, "seq_mean_token_mean")
        grpo = surrogate_grad(GRPO, GRPO.prepare(batch, g)[0], logp, g, "seq_mean_token_mean")
        assert torch.allclose(got, grpo, atol=1e-7) == same


def test_negative_advantages_fade_faster():
    """τ_neg > τ_pos: at the same ρ away from 1, a token of negative advantage keeps less of its gradient."""
    old = torch.zeros(2, 1)
    batch = Batch(input_ids=torch.zeros(2, 3, dtype=torch.long), attention_mask=torch.ones(2, 3),
                  mask=torch.ones(2, 1), prompt_len=2, adv=torch.tensor([1.0, -1.0]), old_logp=old)
    gc, _ = SAPO.coefficient(batch, old + math.log(1.5), SAPOConfig(group_size=2))
    assert 0 < -gc[1, 0] < gc[0, 0] < 1.5  # both faded from ρ·|Â| = 1.5, the negative one more


def test_defaults_and_refusals():
    """The paper's temperatures, no KL, μ = 2; GRPO's clip keys are refused (they would do nothing)."""
    cfg = SAPOConfig()
    assert (cfg.tau_pos, cfg.tau_neg, cfg.beta, cfg.mu, cfg.clip_eps) == (1.0, 1.05, 0.0, 2, None)
    assert SAPO.needs(cfg) == {"reward", "old_logp"} and SAPO.clips_ratio and SAPO.aggregation(cfg) is None
    for kwargs, match in [({"clip_eps": 0.2}, "clip_eps: SAPO has no clip"),
                          ({"clip_eps_high": 0.28}, "clip_eps_high: SAPO has no clip"),
                          ({"tau_pos": 0.0}, "tau_pos: must be > 0"), ({"tau_neg": -1.0}, "tau_neg: must be > 0")]:
        with pytest.raises(ConfigError, match=match):
            SAPOConfig(**kwargs)


def test_its_recipe():
    """recipe=sapo_math has the paper's settings; on grpo_math, `algorithm.name=sapo` keeps GRPO's clip_eps, which
    SAPO refuses, naming the recipe."""
    cfg, resolved = config.load("sapo_math")
    assert type(cfg.algorithm) is SAPOConfig and config.algorithm_of(cfg) is SAPO
    assert (cfg.algorithm.tau_pos, cfg.algorithm.tau_neg, cfg.algorithm.beta, cfg.algorithm.mu) == (1.0, 1.05, 0.0, 2)
    assert cfg.train.loss_agg == "seq_mean_token_mean" and resolved["algorithm"]["name"] == "sapo"
    with pytest.raises(ConfigError, match="clip_eps: SAPO has no clip.*recipe=sapo_math"):
        config.load("grpo_math", ["algorithm.name=sapo"])
