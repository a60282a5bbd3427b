"""RLOO: the leave-one-out baseline and the KL-shaped sequence reward by hand, and the surrogate gradient against
autograd on the objective written out, including the paper's sequence-sum estimator."""

import pytest
import torch
from helpers import LENGTHS, clipped_objective, objective_grad, ragged_batch, surrogate_grad

from posttrain import config
from posttrain.algorithms import get
from posttrain.algorithms.rloo import RLOOConfig, leave_one_out
from posttrain.core.aggregation import MODES
from posttrain.core.batch import Batch
from posttrain.core.errors import ConfigError

RLOO = get("rloo")


def loo_by_loops(batch, cfg):
    """Â_i = R_i − (1/(n−1)) Σ_{j≠i} R_j, R_i = r_i − β Σ_t (log π_old − log π_ref) when the KL is in the reward."""
    B, R = batch.mask.shape
    shaped = [float(batch.reward[i]) for i in range(B)]
    if cfg.kl_in_reward:
        for i in range(B):
            shaped[i] -= cfg.beta * sum(float(batch.old_logp[i, t] - batch.ref_logp[i, t])
                                        for t in range(R) if batch.mask[i, t])
    adv = []
    for i in range(B):
        others = [shaped[j] for j in range(B) if batch.group[j] == batch.group[i] and j != i]
        adv.append(shaped[i] - sum(others) / len(others) if others else 0.0)
    return torch.tensor(adv)


def rloo_objective(batch, cfg, mode, norm):
    """Σ_t min(ρ Â_i, clip(ρ) Â_i) per sequence (− β·k3 per token when the KL is in the loss), under `mode`."""
    return clipped_objective(batch, cfg, loo_by_loops(batch, cfg)[:, None], mode, norm)


def test_leave_one_out_hand_worked():
    """Group 0 [1, 0, 0, 1]: 1 − (0 + 0 + 1)/3 = 0.66667 and 0 − 2/3 = −0.66667 (= 4/3 · (r − 0.5)).
    Group 1 [1, 0, 1]: 1 − (0 + 1)/2 = 0.5 and 0 − (1 + 1)/2 = −1. Group 2, one sample: nothing to compare, 0.
    The groups are interleaved to show order does not matter."""
    reward = torch.tensor([1.0, 1.0, 0.0, 0.0, 5.0, 0.0, 1.0, 1.0])
    group = torch.tensor([0, 1, 0, 1, 2, 0, 0, 1])
    torch.testing.assert_close(leave_one_out(reward, group),
                               torch.tensor([2 / 3, 0.5, -2 / 3, -1.0, 0.0, -2 / 3, 2 / 3, 0.5]))


def test_kl_in_the_sequence_reward_hand_worked():
    """β = 0.1, one group of two. log π_old − log π_ref: row 0 [0.5, 1.0] (a padded 3rd column holds 7), row 1
    [−0.2] -> sequence KLs 1.5 and −0.2. R = [1 − 0.15, 0 + 0.02] = [0.85, 0.02], Â = ±(0.85 − 0.02) = ±0.83;
    kl = (1.5 − 0.2)/2 = 0.65. With the KL in the loss instead, Â = ±1 and prepare logs no kl."""
    ref = torch.zeros(2, 3)
    batch = Batch(input_ids=torch.zeros(2, 5, dtype=torch.long), attention_mask=torch.ones(2, 5),
                  mask=torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]]), prompt_len=2, group=torch.tensor([0, 0]),
                  reward=torch.tensor([1.0, 0.0]), truncated=torch.zeros(2, dtype=torch.bool),
                  old_logp=ref + torch.tensor([[0.5, 1.0, 7.0], [-0.2, 7.0, 7.0]]), ref_logp=ref)
    prepared, metrics = RLOO.prepare(batch, RLOOConfig(group_size=2, beta=0.1))
    torch.testing.assert_close(prepared.adv, torch.tensor([0.83, -0.83]))
    torch.testing.assert_close(metrics["kl"], torch.tensor(0.65))
    prepared, metrics = RLOO.prepare(batch, RLOOConfig(group_size=2, beta=0.1, kl_in_reward=False))
    torch.testing.assert_close(prepared.adv, torch.tensor([1.0, -1.0]))
    assert "kl" not in metrics


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("spread", [0.0, 0.4], ids=["mu1-ratio1", "ratio-off-1"])
@pytest.mark.parametrize("cfg", [RLOOConfig(group_size=3), RLOOConfig(group_size=3, beta=0.0),
                                 RLOOConfig(group_size=3, beta=0.1, kl_in_reward=False),
                                 RLOOConfig(group_size=3, beta=0.1, clip_eps=0.1, clip_eps_high=0.3)],
                         ids=["kl-in-reward", "beta0", "kl-in-loss", "clip-higher"])
def test_gradient_matches_objective(mode, spread, cfg):
    batch, logp = ragged_batch(spread=spread)
    prepared, _ = RLOO.prepare(batch, cfg)
    norm = 4.0
    got = surrogate_grad(RLOO, prepared, logp, cfg, mode, norm)
    want = objective_grad(rloo_objective(batch, cfg, mode, norm), logp)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    _, metrics = RLOO.coefficient(prepared, logp, cfg)
    if spread:  # the test only proves the clip if some tokens were clipped
        assert 0 < metrics["clip_frac"] < 1
    else:
        assert metrics["clip_frac"] == 0 and metrics["ratio"] == 1


def test_sequence_sum_aggregation_is_the_papers_estimator():
    """At μ = 1 (ρ = 1) with seq_mean_token_sum_norm and L = 1, the gradient is RLOO_k's
    (1/B) Σ_i Â_i ∇ log πθ(o_i|q), log πθ(o_i|q) = Σ_t log πθ(o_{i,t}) (Ahmadian et al. 2024), Â by loops."""
    cfg = RLOOConfig(group_size=3, beta=0.05)
    batch, logp = ragged_batch()
    adv = loo_by_loops(batch, cfg)
    seqs = [i for i in range(len(LENGTHS)) if LENGTHS[i] > 0]

    def reinforce(lp):
        return sum(adv[i] * (lp[i] * batch.mask[i]).sum() for i in seqs) / len(seqs)

    got = surrogate_grad(RLOO, RLOO.prepare(batch, cfg)[0], logp, cfg, "seq_mean_token_sum_norm", 1.0)
    torch.testing.assert_close(got, objective_grad(reinforce, logp))


def test_needs():
    """The KL in the reward reads the sampling policy's log-probs, so old_logp is needed even at μ = 1."""
    assert RLOO.needs(RLOOConfig(beta=0.04)) == {"reward", "ref_logp", "old_logp"}
    assert RLOO.needs(RLOOConfig(beta=0.0)) == {"reward"}
    assert RLOO.needs(RLOOConfig(beta=0.04, kl_in_reward=False)) == {"reward", "ref_logp"}
    assert RLOO.needs(RLOOConfig(beta=0.0, mu=2)) == {"reward", "old_logp"}


@pytest.mark.parametrize("kwargs, key", [({"group_size": 1}, "group_size: RLOO needs at least 2"),
                                         ({"adv_norm": "mean_std"}, "adv_norm"),
                                         ({"beta": -1.0}, "beta")])
def test_out_of_range(kwargs, key):
    with pytest.raises(ConfigError, match=key):
        RLOOConfig(**kwargs)


def test_runs_from_the_grpo_recipe():
    cfg, _ = config.load("grpo_math", ["algorithm.name=rloo"])
    assert type(cfg.algorithm) is RLOOConfig and config.algorithm_of(cfg) is RLOO
    assert cfg.algorithm.kl_in_reward and cfg.algorithm.beta == 0.04
