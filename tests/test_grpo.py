"""GRPO: group advantages by hand, and the surrogate gradient against autograd on Eq. 3 + Eq. 4 written out."""

import dataclasses
import math

import pytest
import torch
from helpers import objective_grad, surrogate_grad, weighted_grpo_objective, written_out_mean

from posttrain.algorithms import get
from posttrain.algorithms.common import group_advantages, group_median, group_stats
from posttrain.algorithms.grpo import GRPOConfig
from posttrain.core.aggregation import MODES, aggregate
from posttrain.core.batch import Batch
from posttrain.core.errors import ConfigError
from posttrain.schema import TIS_MODES

GRPO = get("grpo")


def test_group_advantages_hand_worked():
    """Group 0 rewards [1, 0, 0, 1]: mean 0.5, unbiased std √(4·0.25/3) = 0.57735, Â = ±0.5/0.57735 = ±0.86603.
    Group 1 rewards [1, 1] (std 0) gives Â = 0. The groups are interleaved to show order does not matter."""
    reward = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 1.0])
    group = torch.tensor([0, 1, 0, 0, 1, 0])
    adv = group_advantages(reward, group, "mean_std", eps=0.0 + 1e-12)
    torch.testing.assert_close(adv, torch.tensor([0.86603, 0.0, -0.86603, -0.86603, 0.0, 0.86603]), atol=1e-4, rtol=0)
    unscaled = group_advantages(reward, group, "none", eps=1e-4)
    torch.testing.assert_close(unscaled, torch.tensor([0.5, 0.0, -0.5, -0.5, 0.0, 0.5]))


def test_group_of_one_has_zero_advantage():
    """A group with one sample has nothing to compare with: its std is taken as 0 and its Â is 0 (not NaN).
    Group 0 rewards [1, 0]: mean 0.5, unbiased std √(2·0.25/1) = 0.70711, Â = ±0.70711."""
    reward = torch.tensor([1.0, 0.0, 1.0])
    group = torch.tensor([0, 0, 7])
    _, std = group_stats(reward, group)
    torch.testing.assert_close(std, torch.tensor([0.70711, 0.70711, 0.0]), atol=1e-5, rtol=0)
    adv = group_advantages(reward, group, "mean_std", eps=1e-4)
    torch.testing.assert_close(adv, torch.tensor([0.70701, -0.70701, 0.0]), atol=1e-5, rtol=0)


def test_group_median_hand_worked():
    """Groups interleaved: group 0 holds [3, 1, 2] (odd: the middle value 2), group 1 [4, 0, 10, 1] (even: the mean
    of the two middle values 1 and 4, 2.5), group 2 the single value 7."""
    x = torch.tensor([3.0, 4.0, 1.0, 0.0, 7.0, 10.0, 2.0, 1.0])
    group = torch.tensor([0, 1, 0, 1, 2, 1, 0, 1])
    torch.testing.assert_close(group_median(x, group), torch.tensor([2.0, 2.5, 2.0, 2.5, 7.0, 2.5, 2.0, 2.5]))


def test_median_mad_advantages_hand_worked():
    """adv_norm=median_mad, (r − median) / (1.4826·MAD + eps), eps = 1e-4, groups interleaved:

    group 0 [0, 1, 5]: median 1, |r − 1| = [1, 0, 4], MAD 1, scale 1.4826 -> Â = [−1, 0, 4] / 1.4827
        = [−0.67445, 0, 2.69778];
    group 1 [0, 1, 2, 10]: median (1 + 2)/2 = 1.5, |r − 1.5| = [1.5, 0.5, 0.5, 8.5], MAD (0.5 + 1.5)/2 = 1 ->
        Â = [−1.5, −0.5, 0.5, 8.5] / 1.4827 = [−1.01167, −0.33722, 0.33722, 5.73278];
    group 2 [1, 0, 0, 0] (0/1 rewards, 3 of 4 agree): median 0, |r| = [1, 0, 0, 0], MAD 0, so the scale is
        √(π/2)·mean |r − median| = 1.25331·0.25 = 0.31333 -> Â = [1/0.31343, 0, 0, 0] = [3.19052, 0, 0, 0];
    group 3 [1, 1] (constant): MAD 0 and mean |r − median| 0, Â = 0/eps = 0.
    """
    reward = torch.tensor([0.0, 0.0, 1.0, 1.0, 1.0, 2.0, 0.0, 5.0, 10.0, 0.0, 1.0, 0.0, 1.0])
    group = torch.tensor([0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 1, 2, 3])
    adv = group_advantages(reward, group, "median_mad", eps=1e-4)
    want = torch.tensor([-0.67445, -1.01167, 3.19052, 0.0, 0.0, 0.33722, 0.0, 2.69778, 5.73278, 0.0, -0.33722, 0.0,
                         0.0])
    torch.testing.assert_close(adv, want, atol=1e-5, rtol=0)


def test_prepare_metrics_hand_worked():
    """The rewards of the hand-worked case: group 0 has std 0.57735 (4 samples), group 1 std 0 (2 samples).
    reward_std is the mean over samples, (4·0.57735 + 2·0)/6 = 0.38490; zero_std_frac = 2/6."""
    reward = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 1.0])
    group = torch.tensor([0, 1, 0, 0, 1, 0])
    batch = Batch(input_ids=torch.zeros(6, 4, dtype=torch.long), attention_mask=torch.ones(6, 4), mask=torch.ones(6, 2),
                  prompt_len=2, group=group, reward=reward, truncated=torch.zeros(6, dtype=torch.bool))
    _, metrics = GRPO.prepare(batch, GRPOConfig(group_size=2))
    torch.testing.assert_close(metrics["reward_std"], torch.tensor(0.38490), atol=1e-5, rtol=0)
    torch.testing.assert_close(metrics["zero_std_frac"], torch.tensor(1 / 3))


def random_batch(B=6, R=5, G=3, seed=0, spread=0.0):
    """Random log-probs; `spread` > 0 moves π_old away from πθ so ratios leave [1 − ε, 1 + ε]."""
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, R, generator=g) * 3
    old = logp + spread * torch.randn(B, R, generator=g) if spread else None
    ref = logp + 0.3 * torch.randn(B, R, generator=g)
    mask = torch.ones(B, R)
    mask[0, 3:] = 0
    mask[4, 1:] = 0
    reward = torch.randint(0, 2, (B,), generator=g).float()
    group = torch.arange(B // G).repeat_interleave(G)
    batch = Batch(input_ids=torch.zeros(B, R + 2, dtype=torch.long), attention_mask=torch.ones(B, R + 2), mask=mask,
                  prompt_len=2, group=group, reward=reward, truncated=torch.zeros(B, dtype=torch.bool), old_logp=old,
                  ref_logp=ref)
    return batch, logp


def paper_objective(batch, cfg, mode, norm):
    """J_GRPO (Eq. 3) with the clipped ratio and the k3 KL of Eq. 4, written out."""
    adv = group_advantages(batch.reward, batch.group, cfg.adv_norm, cfg.eps)[:, None]
    high = cfg.clip_eps_high if cfg.clip_eps_high is not None else cfg.clip_eps

    def J(logp):
        old = batch.old_logp if batch.old_logp is not None else logp.detach()
        ratio = torch.exp(logp - old)
        surrogate = torch.min(ratio * adv, torch.clamp(ratio, 1 - cfg.clip_eps, 1 + high) * adv)
        log_ref_ratio = batch.ref_logp - logp
        kl = torch.exp(log_ref_ratio) - log_ref_ratio - 1
        return written_out_mean(surrogate - cfg.beta * kl, batch.mask, mode, norm)

    return J


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("spread", [0.0, 0.4], ids=["mu1-ratio1", "ratio-off-1"])
@pytest.mark.parametrize("cfg", [GRPOConfig(group_size=3, beta=0.04), GRPOConfig(group_size=3, beta=0.0),
                                 GRPOConfig(group_size=3, beta=0.1, clip_eps=0.1, clip_eps_high=0.3),
                                 GRPOConfig(group_size=3, beta=0.02, adv_norm="none"),
                                 GRPOConfig(group_size=3, beta=0.02, adv_norm="median_mad")],
                         ids=["default", "beta0", "clip-higher", "dr-grpo", "median-mad"])
def test_gradient_matches_objective(mode, spread, cfg):
    batch, logp = random_batch(spread=spread)
    prepared, _ = GRPO.prepare(batch, cfg)
    norm = 4.0
    got = surrogate_grad(GRPO, prepared, logp, cfg, mode, norm)
    want = objective_grad(paper_objective(batch, cfg, mode, norm), logp)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    if spread:  # the test only proves the clip if some tokens were clipped
        _, metrics = GRPO.coefficient(prepared, logp, cfg)
        assert 0 < metrics["clip_frac"] < 1


def test_mu1_coefficient_is_paper_form():
    """With ρ = 1, GC = Â + β(π_ref/πθ − 1) (DeepSeekMath Eq. 21)."""
    cfg = GRPOConfig(group_size=3, beta=0.05)
    batch, logp = random_batch()
    prepared, _ = GRPO.prepare(batch, cfg)
    gc, _ = GRPO.coefficient(prepared, logp, cfg)
    torch.testing.assert_close(gc, prepared.adv[:, None] + 0.05 * (torch.exp(batch.ref_logp - logp) - 1))


def test_beta0_needs_no_reference():
    """With β = 0 the engine loads no reference, so ref_logp is None: GC is Â·ρ alone and no kl is reported."""
    cfg = GRPOConfig(group_size=3, beta=0.0)
    batch, logp = random_batch()
    prepared, _ = GRPO.prepare(dataclasses.replace(batch, ref_logp=None), cfg)
    gc, metrics = GRPO.coefficient(prepared, logp, cfg)
    torch.testing.assert_close(gc, prepared.adv[:, None].expand_as(logp))
    assert "kl" not in metrics


def test_kl_metric_hand_worked():
    """k3 per token, π_ref/πθ − log(π_ref/πθ) − 1: for π_ref/πθ = 2 it is 2 − ln 2 − 1 = 0.30685, for π_ref/πθ = 4
    it is 4 − ln 4 − 1 = 1.61371, and 0 where the two agree. Masked mean over the 3 response tokens (the 4th column is
    padding holding a large log-ratio): (0.30685 + 1.61371 + 0)/3 = 0.64019. GC with Â = 0 is β(π_ref/πθ − 1)."""
    logp = torch.tensor([[-1.0, -2.0, -1.0, -1.0]])
    ref = logp + torch.tensor([[math.log(2), math.log(4), 0.0, 5.0]])
    batch = Batch(input_ids=torch.zeros(1, 6, dtype=torch.long), attention_mask=torch.ones(1, 6),
                  mask=torch.tensor([[1.0, 1.0, 1.0, 0.0]]), prompt_len=2, adv=torch.zeros(1), ref_logp=ref)
    gc, metrics = GRPO.coefficient(batch, logp, GRPOConfig(group_size=2, beta=0.1))
    torch.testing.assert_close(metrics["kl"], torch.tensor(0.64019), atol=1e-5, rtol=0)
    torch.testing.assert_close(gc[0, :3], torch.tensor([0.1, 0.3, 0.0]))


def test_mask_truncated():
    batch, _ = random_batch()
    batch = dataclasses.replace(batch, truncated=torch.tensor([False, True, False, False, False, True]))
    prepared, _ = GRPO.prepare(batch, GRPOConfig(group_size=3, mask_truncated=True))
    assert prepared.mask[1].sum() == 0 and prepared.mask[5].sum() == 0 and prepared.mask[2].sum() == 5


def test_needs():
    assert GRPO.needs(GRPOConfig(beta=0.0)) == {"reward"}
    assert GRPO.needs(GRPOConfig(beta=0.1, mu=2)) == {"reward", "ref_logp", "old_logp"}


@pytest.mark.parametrize("kwargs, key", [({"group_size": 1}, "group_size"), ({"clip_eps": 0.0}, "clip_eps"),
                                         ({"beta": -0.1}, "beta"), ({"mu": 0}, "mu"), ({"clip_eps_high": -1.0},
                                                                                       "clip_eps_high"),
                                         ({"adv_norm": "mad"}, "adv_norm")])
def test_out_of_range(kwargs, key):
    with pytest.raises(ConfigError, match=key):
        GRPOConfig(**kwargs)


def expected_is_weight(trainer, sampled, mask, cap, tis_mode):
    """The importance weight each rollout.tis_mode defines (docs/unified_view.md), written out token by token."""
    B, R = trainer.shape
    weight = torch.zeros(B, R, dtype=torch.float64)
    for i in range(B):
        seq = math.prod(math.exp(trainer[i, t] - sampled[i, t]) for t in range(R) if mask[i, t])  # Π_t ρ_t
        for t in range(R):
            rho = seq if tis_mode.startswith("sequence") else math.exp(trainer[i, t] - sampled[i, t])
            weight[i, t] = min(rho, cap) if tis_mode.endswith("truncate") else (rho if rho <= cap else 0.0)
    return weight.float()


@pytest.mark.parametrize("tis_mode", TIS_MODES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("spread", [0.0, 0.4], ids=["mu1-weights-from-this-forward", "weights-from-old-logp"])
def test_importance_weighted_gradient_matches_the_weighted_objective(mode, spread, tis_mode):
    """rollout.tis_cap and tis_mode: the engine's GC (Engine.coefficient) against autograd on Eq. 3 + Eq. 4 with
    each token's term weighted by the constant the mode defines from ρ = π_trainer / π_rollout (truncated or masked,
    per token or per sequence), π_trainer taken under the sampling weights."""
    from posttrain.train.engine import Engine

    cfg, cap, norm = GRPOConfig(group_size=3, beta=0.04), 1.5, 4.0
    batch, logp = random_batch(spread=spread)
    at_sampling = batch.old_logp if batch.old_logp is not None else logp
    g = torch.Generator().manual_seed(1)
    batch.rollout_logp = (at_sampling + 0.5 * torch.randn(logp.shape, generator=g)) * batch.mask  # another engine
    prepared, _ = GRPO.prepare(batch, cfg)
    engine = Engine.__new__(Engine)  # only what Engine.coefficient reads
    engine.plugin, engine.algorithm, engine.mismatch = GRPO, cfg, torch.zeros(3)
    engine.tis_cap, engine.tis_mode, engine.proximal = cap, tis_mode, "trainer"

    x = logp.clone().requires_grad_(True)
    gc, metrics = engine.coefficient(prepared, x.detach())
    (got,) = torch.autograd.grad(-aggregate(gc.detach() * x, prepared.mask, mode, norm=norm), x)

    weight = expected_is_weight(at_sampling.double(), batch.rollout_logp.double(), batch.mask, cap, tis_mode)  # [B, R]
    objective = paper_objective(batch, cfg, mode, norm)
    adv = group_advantages(batch.reward, batch.group, cfg.adv_norm, cfg.eps)[:, None]

    weighted = weighted_grpo_objective(batch, cfg, adv, weight, mode, norm)  # Eq. 3 + 4, each token's term weighted
    torch.testing.assert_close(got, objective_grad(weighted, logp), atol=1e-6, rtol=1e-5)
    assert not torch.allclose(got, objective_grad(objective, logp))  # the weights changed the gradient
    assert 0 < metrics["mismatch/tis_capped"] < 1  # some tokens capped, some not: the cap is exercised
    if batch.old_logp is None:  # the step's only update: this forward is where the mismatch is measured
        assert engine.mismatch[1] == batch.mask.sum() and engine.mismatch[0] > 0


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("spread", [0.0, 0.4], ids=["mu1", "old-logp-from-the-trainer"])
def test_ratio_against_the_sampler_matches_the_clipped_objective_on_its_logprobs(mode, spread):
    """rollout.proximal=sampler: the engine's GC is autograd's on Eq. 3 + Eq. 4 with π_old the log-probs the rollout
    engine reported (PPO's own objective on the sampler's samples), whatever the trainer scored as π_old; the clip
    acts on the tokens the sampler is far from, and the mismatch is still measured against the trainer."""
    from posttrain.train.engine import Engine

    cfg, norm = GRPOConfig(group_size=3, beta=0.04), 4.0
    batch, logp = random_batch(spread=spread)
    g = torch.Generator().manual_seed(2)
    batch.rollout_logp = (logp + 0.5 * torch.randn(logp.shape, generator=g)) * batch.mask  # an older policy
    prepared, _ = GRPO.prepare(batch, cfg)
    engine = Engine.__new__(Engine)  # only what Engine.coefficient reads
    engine.plugin, engine.algorithm, engine.mismatch = GRPO, cfg, torch.zeros(3)
    engine.tis_cap, engine.tis_mode, engine.proximal = None, "token_truncate", "sampler"

    x = logp.clone().requires_grad_(True)
    gc, metrics = engine.coefficient(prepared, x.detach())
    (got,) = torch.autograd.grad(-aggregate(gc.detach() * x, prepared.mask, mode, norm=norm), x)

    on_sampler = dataclasses.replace(batch, old_logp=batch.rollout_logp)
    torch.testing.assert_close(got, objective_grad(paper_objective(on_sampler, cfg, mode, norm), logp),
                               atol=1e-6, rtol=1e-5)
    assert not torch.allclose(got, objective_grad(paper_objective(batch, cfg, mode, norm), logp))  # π_old changed
    assert 0 < metrics["clip_frac"] < 1  # the clip acts on some tokens, not all
    if batch.old_logp is None:
        assert engine.mismatch[1] == batch.mask.sum() and engine.mismatch[0] > 0


def test_mismatch_sums_hand_worked():
    """Δ = log π_trainer − log π_rollout = (0.5, −1) on two tokens, a third masked out: Σ k3 = (e^0.5 − 1.5) +
    (e^−1 − 1 + 1) = 0.148721 + 0.367879, 2 tokens, max |Δ| = 1."""
    from posttrain.train.engine import mismatch_sums

    trainer, sampled = torch.tensor([[-1.0, -2.0, -0.1]]), torch.tensor([[-1.5, -1.0, -3.0]])
    got = mismatch_sums(trainer, sampled, torch.tensor([[1.0, 1.0, 0.0]]))
    torch.testing.assert_close(got, torch.tensor([0.516600, 2.0, 1.0]), atol=1e-6, rtol=0)
