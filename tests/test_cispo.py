"""CISPO: the clipped, detached importance weight by hand, and the surrogate gradient against autograd on the
objective (MiniMax-M1, arXiv:2506.13585, Eq. 4–5) written out with plain torch ops."""

import math

import pytest
import torch
from helpers import micro_batched_grad, objective_grad, ragged_batch, surrogate_grad, written_out_mean

from posttrain import config
from posttrain.algorithms import get
from posttrain.algorithms.cispo import CISPOConfig
from posttrain.algorithms.common import group_advantages
from posttrain.algorithms.grpo import GRPOConfig
from posttrain.core.aggregation import MODES
from posttrain.core.batch import Batch
from posttrain.core.errors import ConfigError

CISPO, GRPO = get("cispo"), get("grpo")


def cispo_objective(batch, cfg, mode, norm):
    """J = aggregate of sg(clip(ρ, 1 − ε_low, 1 + ε_high))·Â·log πθ, minus β·k3 per token, as loops over the tokens
    (`written_out_mean`); ρ is computed apart from the graph, as the paper's sg says."""
    adv = group_advantages(batch.reward, batch.group, cfg.adv_norm, cfg.eps)
    high = cfg.clip_eps if cfg.clip_eps_high is None else cfg.clip_eps_high
    B, R = batch.mask.shape

    def J(logp):
        old = batch.old_logp if batch.old_logp is not None else logp.detach()
        terms = torch.zeros(B, R)
        for i in range(B):
            for t in range(R):
                rho = math.exp(float(logp[i, t].detach()) - float(old[i, t]))  # a number: no gradient flows through it
                weight = min(max(rho, 1 - cfg.clip_eps), 1 + high)
                kl = torch.exp(batch.ref_logp[i, t] - logp[i, t]) - (batch.ref_logp[i, t] - logp[i, t]) - 1
                terms[i, t] = weight * adv[i] * logp[i, t] - cfg.beta * kl
        return written_out_mean(terms, batch.mask, mode, norm)

    return J


def test_weight_hand_worked():
    """ε_low = 1 (no lower bound), ε_high = 0.28; Â per row, log πθ − log π_old per token:

    row 0, Â = +1: ρ = e^0.5 = 1.6487 -> weight 1.28: GC 1.28 (GRPO's clip would give 0); ρ = e^−1 = 0.3679 -> kept,
      GC 0.3679 (no lower bound);
    row 1, Â = −2: ρ = e^0.1 = 1.1052 -> kept, GC −2.2103; ρ = e^0.3 = 1.3499 -> 1.28, GC −2.56 (GRPO keeps it:
      ρÂ = −2.6997 is the min);
    row 2, Â = 0: ρ = e^0.5, bounded but not counted in clip_frac (its GC is 0 anyway).
    clip_frac = 2 bounded / 6 tokens; ratio = the mean of the six ρ."""
    diff = torch.tensor([[0.5, -1.0], [0.1, 0.3], [0.5, 0.0]])
    old = -torch.ones(3, 2)
    batch = Batch(input_ids=torch.zeros(3, 4, dtype=torch.long), attention_mask=torch.ones(3, 4),
                  mask=torch.ones(3, 2), prompt_len=2, adv=torch.tensor([1.0, -2.0, 0.0]), old_logp=old)
    gc, metrics = CISPO.coefficient(batch, old + diff, CISPOConfig(group_size=2))
    want = torch.tensor([[1.28, math.exp(-1)], [-2 * math.exp(0.1), -2.56], [0.0, 0.0]])
    torch.testing.assert_close(gc, want)
    torch.testing.assert_close(metrics["clip_frac"], torch.tensor(2 / 6))
    torch.testing.assert_close(metrics["ratio"], diff.exp().mean())
    grpo, _ = GRPO.coefficient(batch, old + diff, GRPOConfig(group_size=2, beta=0.0, clip_eps=0.28))
    assert grpo[0, 0] == 0 and torch.isclose(grpo[1, 1], torch.tensor(-2 * math.exp(0.3)))  # where the two differ


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("spread", [0.0, 0.5], ids=["mu1-ratio1", "ratio-off-1"])
@pytest.mark.parametrize("cfg", [CISPOConfig(group_size=3), CISPOConfig(group_size=3, beta=0.04),
                                 CISPOConfig(group_size=3, clip_eps=0.2, clip_eps_high=0.2),
                                 CISPOConfig(group_size=3, adv_norm="none", clip_eps_high=None)],
                         ids=["paper", "beta", "both-bounds", "unscaled"])
def test_gradient_matches_objective(mode, spread, cfg):
    """The surrogate's gradient, whole and in micro-batches of 2 rows, against autograd on J written out; off ρ = 1
    some weights are bounded and some are not, so the clip is really exercised."""
    batch, logp = ragged_batch(spread=spread)
    if not spread:
        batch.old_logp = None  # μ = 1: π_old is πθ
    prepared, _ = CISPO.prepare(batch, cfg)
    want = objective_grad(cispo_objective(batch, cfg, mode, 4.0), logp)
    torch.testing.assert_close(surrogate_grad(CISPO, prepared, logp, cfg, mode, 4.0), want, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(micro_batched_grad(CISPO, prepared, logp, cfg, mode, 4.0, 2), want, atol=1e-6,
                               rtol=1e-5)
    _, metrics = CISPO.coefficient(prepared, logp, cfg)
    if spread:
        assert 0 < metrics["clip_frac"] < 1
    else:
        assert metrics["clip_frac"] == 0 and metrics["ratio"] == 1


def test_on_policy_cispo_is_grpo_and_off_policy_it_is_not():
    """μ = 1 (ρ = 1): GC = Â, GRPO's. Off-policy, tokens outside GRPO's trust region keep a bounded gradient in CISPO,
    so the two differ."""
    for spread, same in [(0.0, True), (0.5, False)]:
        batch, logp = ragged_batch(spread=spread)
        if not spread:
            batch.old_logp = None
        c, g = CISPOConfig(group_size=3, clip_eps=0.2, clip_eps_high=0.2), GRPOConfig(group_size=3, beta=0.0)
        got = surrogate_grad(CISPO, CISPO.prepare(batch, c)[0], logp, c, "token_mean")
        grpo = surrogate_grad(GRPO, GRPO.prepare(batch, g)[0], logp, g, "token_mean")
        assert torch.allclose(got, grpo, atol=1e-7) == same


def test_defaults_and_needs():
    """No lower bound, ε_high 0.28, no KL, μ = 2 so that the weight acts; old log-probs scored, no reference."""
    cfg = CISPOConfig()
    assert (cfg.clip_eps, cfg.clip_eps_high, cfg.beta, cfg.mu) == (1.0, 0.28, 0.0, 2)
    assert CISPO.needs(cfg) == {"reward", "old_logp"} and CISPO.needs(CISPOConfig(beta=0.1, mu=1)) == {"reward",
                                                                                                     "ref_logp"}
    assert CISPO.aggregation(cfg) is None and CISPO.clips_ratio and CISPO.source == "online"


@pytest.mark.parametrize("kwargs, key", [({"clip_eps": 1.5}, "clip_eps: CISPO clips its weight below"),
                                         ({"clip_eps": 0.0}, "clip_eps: must be > 0"),
                                         ({"clip_eps_high": -0.1}, "clip_eps_high: must be > 0"),
                                         ({"mu": 0}, "mu: must be ≥ 1"), ({"group_size": 1}, "group_size")])
def test_out_of_range(kwargs, key):
    with pytest.raises(ConfigError, match=key):
        CISPOConfig(**kwargs)


def test_its_recipe():
    """recipe=cispo_math: the paper's token-level aggregation, no lower bound, ε_high 0.28, β 0, μ 2; an ε_high below
    ε_low is CISPO's to allow (the two bound a weight, not the two sides of a min)."""
    cfg, resolved = config.load("cispo_math")
    assert type(cfg.algorithm) is CISPOConfig and config.algorithm_of(cfg) is CISPO
    assert (cfg.algorithm.clip_eps, cfg.algorithm.clip_eps_high, cfg.algorithm.beta, cfg.algorithm.mu) == \
        (1.0, 0.28, 0.0, 2) and cfg.train.loss_agg == "token_mean" and resolved["algorithm"]["name"] == "cispo"
    cfg, _ = config.load("grpo_math", ["algorithm.name=cispo"])  # GRPO's ε 0.2 both sides: a valid CISPO range
    assert type(cfg.algorithm) is CISPOConfig and cfg.algorithm.clip_eps == 0.2 and cfg.algorithm.mu == 1
