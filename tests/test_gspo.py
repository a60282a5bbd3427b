"""GSPO: the sequence ratio and its clip by hand, and the surrogate gradient against autograd on the objective
(arXiv:2507.18071, Eq. 5) written out with plain torch ops."""

import math

import pytest
import torch
from helpers import objective_grad, surrogate_grad, written_out_mean

from posttrain import config
from posttrain.algorithms import get
from posttrain.algorithms.common import group_advantages
from posttrain.algorithms.grpo import GRPOConfig
from posttrain.algorithms.gspo import GSPOConfig
from posttrain.core.batch import Batch
from posttrain.core.errors import ConfigError

GSPO, GRPO = get("gspo"), get("grpo")
LENGTHS = [3, 5, 1, 4, 0, 2, 5, 3, 4]  # response lengths, one row empty (a filtered sample)


def random_batch(seed=0, spread=0.0, G=3):
    """Groups of G with continuous rewards (so Â ≠ 0), ragged masks and junk log-probs past each mask; `spread` > 0
    moves π_old away from πθ so that sequence ratios leave the clip range; 0 leaves old_logp None (μ = 1)."""
    g = torch.Generator().manual_seed(seed)
    B, R = len(LENGTHS), 5
    logp = -torch.rand(B, R, generator=g) * 3
    old = logp + spread * torch.randn(B, R, generator=g) if spread else None
    mask = (torch.arange(R)[None, :] < torch.tensor(LENGTHS)[:, None]).float()  # [B, R]
    batch = Batch(input_ids=torch.zeros(B, R + 2, dtype=torch.long), attention_mask=torch.ones(B, R + 2), mask=mask,
                  prompt_len=2, group=torch.arange(B // G).repeat_interleave(G), reward=torch.rand(B, generator=g),
                  truncated=torch.zeros(B, dtype=torch.bool), old_logp=old,
                  ref_logp=logp + 0.3 * torch.randn(B, R, generator=g))
    return batch, logp


def gspo_objective(batch, cfg):
    """J_GSPO = (1/G) Σ_i min(s_i Â_i, clip(s_i, 1 − ε_low, 1 + ε_high) Â_i), s_i = exp((1/|o_i|) Σ_t log-ratio),
    as loops over the sequences in the loss, minus β·k3 averaged as (1/G) Σ_i (1/|o_i|) Σ_t."""
    adv = group_advantages(batch.reward, batch.group, cfg.adv_norm, cfg.eps)
    high = cfg.clip_eps_high if cfg.clip_eps_high is not None else cfg.clip_eps
    B, R = batch.mask.shape

    def J(logp):
        old = batch.old_logp if batch.old_logp is not None else logp.detach()
        seqs = [i for i in range(B) if batch.mask[i].sum() > 0]
        total = 0.0
        for i in seqs:
            tokens = [t for t in range(R) if batch.mask[i, t]]
            s = torch.exp(sum(logp[i, t] - old[i, t] for t in tokens) / len(tokens))
            total = total + torch.min(s * adv[i], torch.clamp(s, 1 - cfg.clip_eps, 1 + high) * adv[i])
        log_ref_ratio = batch.ref_logp - logp
        kl = torch.exp(log_ref_ratio) - log_ref_ratio - 1
        return total / len(seqs) - cfg.beta * written_out_mean(kl, batch.mask, "seq_mean_token_mean")

    return J


def test_sequence_ratio_and_clip_hand_worked():
    """Six sequences, ε_low = 3e-4, ε_high = 4e-4 (the defaults); log πθ − log π_old per token, padding holds junk:

    rows 0, 1: [0.3, −0.1, 0.4] -> log s = 0.6/3 = 0.2, s = e^0.2 = 1.22140;
      Â = +1: s > 1 + ε_high, clipped -> GC 0;  Â = −1: s ≥ 1 − ε_low, kept -> GC −1.22140 on each of its tokens;
    row 2: [−0.3, 0.1] (and 5 in padding) -> log s = −0.1, s = 0.90484; Â = +2 kept -> GC 1.80967;
    row 3: [0, 0, 0], s = 1, Â = 0 -> GC 0, and it does not count for clip_frac;
    row 4: s = 1.00035 between 1 + ε_low and 1 + ε_high, Â = +1: kept (the upper bound is ε_high) -> GC 1.00035;
    row 5: s = 0.99965 between 1 − ε_high and 1 − ε_low, Â = −1: clipped (the lower bound is ε_low) -> GC 0.
    clip_frac = 2 clipped / 5 sequences with Â ≠ 0; ratio = (2·1.22140 + 0.90484 + 1 + 1.00035 + 0.99965)/6."""
    up, down = math.log(1.00035), math.log(0.99965)
    diff = torch.tensor([[0.3, -0.1, 0.4, 9.0], [0.3, -0.1, 0.4, -9.0], [-0.3, 0.1, 5.0, 5.0], [0.0, 0.0, 0.0, 3.0],
                         [up, up, up, 3.0], [down, down, down, 3.0]])
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 0], [1, 1, 1, 0]])
    old = -torch.ones(6, 4)
    batch = Batch(input_ids=torch.zeros(6, 6, dtype=torch.long), attention_mask=torch.ones(6, 6), mask=mask,
                  prompt_len=2, adv=torch.tensor([1.0, -1.0, 2.0, 0.0, 1.0, -1.0]), old_logp=old)
    gc, metrics = GSPO.coefficient(batch, old + diff, GSPOConfig())
    s0, s2 = math.exp(0.2), math.exp(-0.1)
    want = torch.tensor([[0.0, 0, 0, 0], [-s0, -s0, -s0, 0], [2 * s2, 2 * s2, 0, 0], [0, 0, 0, 0],
                         [1.00035, 1.00035, 1.00035, 0], [0, 0, 0, 0]])
    torch.testing.assert_close(gc * mask, want)
    torch.testing.assert_close(metrics["clip_frac"], torch.tensor(2 / 5))
    torch.testing.assert_close(metrics["ratio"], torch.tensor((2 * s0 + s2 + 1 + 1.00035 + 0.99965) / 6))


@pytest.mark.parametrize("scale", [0.0, 5.0], ids=["mu1-ratio1", "ratio-off-1"])
@pytest.mark.parametrize("cfg", [GSPOConfig(group_size=3), GSPOConfig(group_size=3, beta=0.04),
                                 GSPOConfig(group_size=3, clip_eps=0.2, clip_eps_high=0.28),
                                 GSPOConfig(group_size=3, beta=0.02, adv_norm="none")],
                         ids=["paper", "beta", "wide-clip", "unscaled"])
def test_gradient_matches_objective(scale, cfg):
    """The plugin's surrogate under its own aggregation against autograd on J_GSPO written out; π_old is moved by a
    few ε_high per token, so that sequence ratios fall on both sides of the clip."""
    spread = scale * cfg.clip_eps_high
    batch, logp = random_batch(spread=spread)
    prepared, _ = GSPO.prepare(batch, cfg)
    mode, norm = GSPO.aggregation(cfg)
    got = surrogate_grad(GSPO, prepared, logp, cfg, mode, norm)
    want = objective_grad(gspo_objective(batch, cfg), logp)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    _, metrics = GSPO.coefficient(prepared, logp, cfg)
    if spread:  # the test only proves the clip if some sequences were clipped and some were not
        assert 0 < metrics["clip_frac"] < 1
    else:
        assert metrics["clip_frac"] == 0 and metrics["ratio"] == 1


@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_on_policy_gspo_is_grpo_with_sequence_mean(beta):
    """μ = 1 (no old log-probs): s_i = 1 = ρ_{i,t}, so GSPO's gradient is GRPO's under seq_mean_token_mean; once
    π_old differs (μ > 1) the per-sequence and per-token ratios give different gradients."""
    gspo_cfg, grpo_cfg = GSPOConfig(group_size=3, beta=beta), GRPOConfig(group_size=3, beta=beta)
    for spread, same in [(0.0, True), (0.4, False)]:
        batch, logp = random_batch(spread=spread)
        got = surrogate_grad(GSPO, GSPO.prepare(batch, gspo_cfg)[0], logp, gspo_cfg, "seq_mean_token_mean")
        grpo = surrogate_grad(GRPO, GRPO.prepare(batch, grpo_cfg)[0], logp, grpo_cfg, "seq_mean_token_mean")
        assert torch.allclose(got, grpo, atol=1e-7) == same


def test_ratio_reads_only_the_sequence_own_tokens():
    """Junk in the padding of logp or old_logp changes neither s_i nor any GC."""
    cfg = GSPOConfig(group_size=3, clip_eps=0.2, clip_eps_high=0.2)
    batch, logp = random_batch(spread=0.1)
    prepared, _ = GSPO.prepare(batch, cfg)
    gc, metrics = GSPO.coefficient(prepared, logp, cfg)
    pad = prepared.mask == 0
    prepared.old_logp = prepared.old_logp.masked_fill(pad, 50.0)
    gc2, metrics2 = GSPO.coefficient(prepared, logp.masked_fill(pad, -50.0), cfg)
    torch.testing.assert_close(gc2 * prepared.mask, gc * prepared.mask)
    torch.testing.assert_close(metrics2["ratio"], metrics["ratio"])


def test_defaults_aggregation_and_needs():
    """The paper's ε (3e-4, 4e-4) and no KL; μ = 2 so the sequence ratio acts; the aggregation is fixed."""
    cfg = GSPOConfig()
    assert (cfg.clip_eps, cfg.clip_eps_high, cfg.beta, cfg.mu) == (3e-4, 4e-4, 0.0, 2)
    assert GSPO.aggregation(cfg) == ("seq_mean_token_mean", 1.0) and GSPO.epochs(cfg) == 2
    assert GSPO.needs(cfg) == {"reward", "old_logp"}
    assert GSPO.needs(GSPOConfig(beta=0.1, mu=1)) == {"reward", "ref_logp"}
    assert GSPO.source == "online" and GSPO.samples_per_prompt(GSPOConfig(group_size=4)) == 4


def test_its_recipe_and_the_grpo_recipe():
    """recipe=gspo_math has the paper's settings. On grpo_math, `algorithm.name=gspo` alone would clip a sequence
    ratio with GRPO's token ε below (0.2) and GSPO's ε_high above (4e-4): refused, naming the fix; with both ε given
    it runs from GRPO's recipe."""
    cfg, resolved = config.load("gspo_math")
    assert type(cfg.algorithm) is GSPOConfig and config.algorithm_of(cfg) is GSPO
    assert (cfg.algorithm.clip_eps, cfg.algorithm.clip_eps_high, cfg.algorithm.beta, cfg.algorithm.mu) == \
        (3e-4, 4e-4, 0.0, 2) and resolved["algorithm"]["name"] == "gspo"
    with pytest.raises(ConfigError, match="clip_eps_high: 0.0004 is below clip_eps=0.2; .* use recipe=gspo_math"):
        config.load("grpo_math", ["algorithm.name=gspo"])
    cfg, _ = config.load("grpo_math", ["algorithm.name=gspo", "algorithm.clip_eps=3e-4"])
    assert type(cfg.algorithm) is GSPOConfig and cfg.algorithm.group_size == 8 and cfg.algorithm.mu == 1
