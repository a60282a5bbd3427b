"""REINFORCE++: the KL-shaped token rewards, returns and batch normalisation by hand, and the surrogate gradient
against autograd on the objective written out, with the advantages computed by loops."""

import math

import pytest
import torch
from helpers import clipped_objective, objective_grad, ragged_batch, surrogate_grad

from posttrain import config
from posttrain.algorithms import get
from posttrain.algorithms.common import whiten
from posttrain.algorithms.reinforce_pp import ReinforcePPConfig
from posttrain.core.aggregation import MODES
from posttrain.core.batch import Batch
from posttrain.core.errors import ConfigError

RPP = get("reinforce_pp")


def advantages_by_loops(batch, cfg):
    """r_t = −β(log π_old − log π_ref) + (r − group mean if baseline)·1[t last], G_t = r_t + γ G_{t+1}, then
    (G − mean)/√(var + 1e-8) over every response token of the batch (population variance)."""
    B, R = batch.mask.shape
    baseline = cfg.baseline if cfg.baseline is not None else cfg.group_size > 1
    outcome = []
    for i in range(B):
        members = [float(batch.reward[j]) for j in range(B) if batch.group[j] == batch.group[i]]
        outcome.append(float(batch.reward[i]) - (sum(members) / len(members) if baseline else 0.0))
    returns, tokens = torch.zeros(B, R), []
    for i in range(B):
        n, running = int(batch.mask[i].sum()), 0.0
        for t in reversed(range(n)):
            kl = float(batch.old_logp[i, t] - batch.ref_logp[i, t]) if cfg.kl_in_reward else 0.0
            running = -cfg.beta * kl + (outcome[i] if t == n - 1 else 0.0) + cfg.gamma * running
            returns[i, t] = running
            tokens.append(running)
    mean = sum(tokens) / len(tokens)
    var = sum((x - mean) ** 2 for x in tokens) / len(tokens)
    return (returns - mean) / math.sqrt(var + 1e-8) * batch.mask


def rpp_objective(batch, cfg, mode, norm):
    """min(ρ_t Â_t, clip(ρ_t) Â_t) per token (− β·k3 when the KL is in the loss), under `mode`."""
    return clipped_objective(batch, cfg, advantages_by_loops(batch, cfg), mode, norm)


def hand_batch():
    """One group of three, rewards [1, 0, 0], lengths 1, 2, 3; log π_old − log π_ref = [0.5], [0, 1], [0.2, 0.2, −0.4]
    (padding holds 9)."""
    ref = torch.zeros(3, 3)
    kl = torch.tensor([[0.5, 9, 9], [0.0, 1.0, 9], [0.2, 0.2, -0.4]])
    return Batch(input_ids=torch.zeros(3, 5, dtype=torch.long), attention_mask=torch.ones(3, 5),
                 mask=torch.tensor([[1.0, 0, 0], [1, 1, 0], [1, 1, 1]]), prompt_len=2, group=torch.zeros(3).long(),
                 reward=torch.tensor([1.0, 0.0, 0.0]), truncated=torch.zeros(3, dtype=torch.bool), old_logp=ref + kl,
                 ref_logp=ref)


def test_returns_hand_worked_with_baseline():
    """β = 0.1, γ = 1, baseline (G = 3): outcomes r − 1/3 = [2/3, −1/3, −1/3];
    token rewards [−0.05 + 2/3], [0, −0.1 − 1/3], [−0.02, −0.02, 0.04 − 1/3];
    returns G_t = Σ_{s≥t} r_s: [0.61667], [−0.43333, −0.43333], [−0.33333, −0.31333, −0.29333];
    Â = those returns whitened over the 6 tokens; kl = (0.5 + 0 + 1 + 0.2 + 0.2 − 0.4)/6 = 0.25."""
    batch = hand_batch()
    prepared, metrics = RPP.prepare(batch, ReinforcePPConfig(group_size=3, beta=0.1))
    returns = torch.tensor([[0.61667, 0, 0], [-0.43333, -0.43333, 0], [-0.33333, -0.31333, -0.29333]])
    torch.testing.assert_close(prepared.adv, whiten(returns, batch.mask), atol=2e-5, rtol=0)
    torch.testing.assert_close(metrics["kl"], torch.tensor(0.25))


def test_returns_hand_worked_discounted_without_baseline():
    """β = 0.1, γ = 0.5, no baseline: token rewards [0.95], [0, −0.1], [−0.02, −0.02, 0.04];
    G = [0.95], [0 + 0.5·(−0.1), −0.1] = [−0.05, −0.1], [−0.02 + 0.5·0, −0.02 + 0.5·0.04, 0.04] = [−0.02, 0, 0.04]."""
    batch = hand_batch()
    prepared, _ = RPP.prepare(batch, ReinforcePPConfig(group_size=3, beta=0.1, gamma=0.5, baseline=False))
    returns = torch.tensor([[0.95, 0, 0], [-0.05, -0.1, 0], [-0.02, 0.0, 0.04]])
    torch.testing.assert_close(prepared.adv, whiten(returns, batch.mask))


def test_batch_normalisation_hand_worked():
    """Groups of one, β = 0: returns [1, 1] and [0, 0] (the outcome at the last token, γ = 1), token mean 0.5,
    population std 0.5 -> Â = ±1 on every token, whichever sequence and group it is in."""
    batch = Batch(input_ids=torch.zeros(2, 4, dtype=torch.long), attention_mask=torch.ones(2, 4),
                  mask=torch.ones(2, 2), prompt_len=2, group=torch.tensor([0, 1]), reward=torch.tensor([1.0, 0.0]),
                  truncated=torch.zeros(2, dtype=torch.bool))
    prepared, _ = RPP.prepare(batch, ReinforcePPConfig(group_size=1, beta=0.0))
    torch.testing.assert_close(prepared.adv, torch.tensor([[1.0, 1.0], [-1.0, -1.0]]))


def test_truncated_completions_leave_the_loss_and_the_normalisation():
    """mask_truncated: a truncated row gets no token reward and Â = 0, and the mean and std are those of the others
    (here rows 0 and 1 of the hand-worked batch, their returns [0.61667] and [−0.43333, −0.43333] whitened)."""
    batch = hand_batch()
    batch.truncated = torch.tensor([False, False, True])
    prepared, _ = RPP.prepare(batch, ReinforcePPConfig(group_size=3, beta=0.1, mask_truncated=True))
    assert prepared.mask[2].sum() == 0 and (prepared.adv[2] == 0).all()
    returns = torch.tensor([[0.61667, 0, 0], [-0.43333, -0.43333, 0], [0, 0, 0]])
    torch.testing.assert_close(prepared.adv, whiten(returns, prepared.mask), atol=2e-5, rtol=0)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("spread", [0.0, 0.4], ids=["mu1-ratio1", "ratio-off-1"])
@pytest.mark.parametrize("G, cfg", [(3, ReinforcePPConfig(group_size=3)), (1, ReinforcePPConfig(group_size=1, beta=0.1)),
                                    (3, ReinforcePPConfig(group_size=3, beta=0.1, kl_in_reward=False)),
                                    (3, ReinforcePPConfig(group_size=3, gamma=0.9, baseline=False)),
                                    (3, ReinforcePPConfig(group_size=3, clip_eps=0.1, clip_eps_high=0.3))],
                         ids=["baseline", "groups-of-one", "kl-in-loss", "discounted", "clip-higher"])
def test_gradient_matches_objective(mode, spread, G, cfg):
    batch, logp = ragged_batch(G=G, spread=spread)
    prepared, _ = RPP.prepare(batch, cfg)
    norm = 4.0
    got = surrogate_grad(RPP, prepared, logp, cfg, mode, norm)
    want = objective_grad(rpp_objective(batch, cfg, mode, norm), logp)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    _, metrics = RPP.coefficient(prepared, logp, cfg)
    if spread:  # the test only proves the clip if some tokens were clipped
        assert 0 < metrics["clip_frac"] < 1
    else:
        assert metrics["clip_frac"] == 0 and metrics["ratio"] == 1


def test_needs_and_groups_of_one():
    assert RPP.needs(ReinforcePPConfig(group_size=1)) == {"reward", "ref_logp", "old_logp"}
    assert RPP.needs(ReinforcePPConfig(beta=0.0)) == {"reward"}
    assert RPP.needs(ReinforcePPConfig(kl_in_reward=False)) == {"reward", "ref_logp"}
    assert RPP.samples_per_prompt(ReinforcePPConfig(group_size=1)) == 1


@pytest.mark.parametrize("kwargs, key", [({"group_size": 1, "baseline": True}, "baseline"),
                                         ({"group_size": 0}, "group_size: ReinforcePP needs at least 1"),
                                         ({"adv_norm": "mean_std"}, "adv_norm"), ({"gamma": 1.5}, "gamma")])
def test_out_of_range(kwargs, key):
    with pytest.raises(ConfigError, match=key):
        ReinforcePPConfig(**kwargs)


def test_runs_from_the_grpo_recipe():
    cfg, _ = config.load("grpo_math", ["algorithm.name=reinforce_pp", "algorithm.group_size=1"])
    assert type(cfg.algorithm) is ReinforcePPConfig and config.algorithm_of(cfg) is RPP
