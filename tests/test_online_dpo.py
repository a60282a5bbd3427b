"""Online DPO: pairs formed from the judge's rewards (ties included) by hand, and the surrogate gradient against
autograd on the loss written out pair by pair, ties weighing nothing."""

import pytest
import torch
from helpers import micro_batched_grad, objective_grad, surrogate_grad

from posttrain import config
from posttrain.algorithms import get
from posttrain.algorithms.online_dpo import RANKED, OnlineDPOConfig, best_and_worst
from posttrain.core.batch import Batch
from posttrain.core.errors import ConfigError
from posttrain.train.plan import plan

ODPO = get("online_dpo")

# Three groups of 3, not contiguous (as the ids say): group 7 = rows 0, 3, 6; group 2 = rows 1, 4, 7; group 5 = 2, 5, 8.
GROUP = torch.tensor([7, 2, 5, 7, 2, 5, 7, 2, 5])
REWARD = torch.tensor([0.5, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0])


def test_pairs_hand_worked():
    """Group 7, rewards (0.5, 1, 1) on rows 0, 3, 6: chosen the first best, row 3; rejected the only worst, row 0.
    Group 2, rewards (1, 0, 0) on rows 1, 4, 7: chosen row 1, rejected the last worst, row 7.
    Group 5, rewards (0, 0, 0) on rows 2, 5, 8: a tie, its first and last rows, unranked."""
    rows, ranked = best_and_worst(REWARD, GROUP)
    assert rows.tolist() == [3, 0, 1, 7, 2, 8] and ranked.tolist() == [True, True, False]


def random_batch(seed=0):
    """The groups above with ragged responses (every one at least a token) and junk log-probs past each mask."""
    g = torch.Generator().manual_seed(seed)
    B, R = len(GROUP), 5
    lengths = torch.tensor([3, 5, 1, 4, 2, 2, 5, 3, 4])
    mask = (torch.arange(R)[None, :] < lengths[:, None]).float()
    logp = -torch.rand(B, R, generator=g) * 3
    batch = Batch(input_ids=torch.arange(B)[:, None].repeat(1, R + 2), attention_mask=torch.ones(B, R + 2),
                  mask=mask, prompt_len=2, group=GROUP, reward=REWARD, truncated=torch.zeros(B, dtype=torch.bool),
                  ref_logp=logp + 0.5 * torch.randn(B, R, generator=g))
    return batch, logp


def test_prepare_keeps_one_pair_per_group_chosen_first():
    """The prepared batch is rows [3, 0, 1, 7, 2, 8] of the samples (their ids say which), each pair's rows marked
    ranked or not; tie_frac 1/3; reward_gap the mean of 0.5, 1 and 0."""
    batch, _ = random_batch()
    pairs, metrics = ODPO.prepare(batch, OnlineDPOConfig(group_size=3))
    assert pairs.input_ids[:, 0].tolist() == [3, 0, 1, 7, 2, 8]
    assert pairs.extra[RANKED].tolist() == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0]
    torch.testing.assert_close(metrics["tie_frac"], torch.tensor(1 / 3))
    torch.testing.assert_close(metrics["reward_gap"], torch.tensor(0.5))
    assert torch.equal(pairs.ref_logp, batch.ref_logp[[3, 0, 1, 7, 2, 8]])


def written_out_loss(batch, rows, ranked, cfg):
    """The mean over the groups' pairs of d·L, L = −(1−ε) log σ(z) − ε log σ(−z), z = β(ℓ⁺ − ℓ⁻) on the rows of the
    unprepared batch: chosen rows[2p], rejected rows[2p + 1], d = ranked[p]."""

    def L(logp):
        total = 0.0
        for p in range(len(ranked)):
            ell = []
            for i in (int(rows[2 * p]), int(rows[2 * p + 1])):
                tokens = [t for t in range(logp.shape[1]) if batch.mask[i, t] == 1]
                s = sum(logp[i, t] - batch.ref_logp[i, t] for t in tokens)
                ell.append(s / len(tokens) if cfg.length_normalize else s)
            z = cfg.beta * (ell[0] - ell[1])
            eps = cfg.label_smoothing
            loss = -(1 - eps) * torch.log(torch.sigmoid(z)) - eps * torch.log(torch.sigmoid(-z))
            total = total + float(ranked[p]) * loss
        return total / len(ranked)

    return L


@pytest.mark.parametrize("length_normalize", [False, True], ids=["summed", "eq12"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("seed", [0, 1])
def test_gradient_matches_objective(length_normalize, label_smoothing, seed):
    """The surrogate's gradient on the prepared pairs, whole and one pair per micro-batch, against autograd on the
    loss written out over the unprepared samples: ties weigh 0, the G − 2 samples left out get no gradient."""
    cfg = OnlineDPOConfig(group_size=3, beta=0.5, length_normalize=length_normalize, label_smoothing=label_smoothing)
    batch, logp = random_batch(seed)
    rows, ranked = best_and_worst(batch.reward, batch.group)
    want = objective_grad(lambda lp: -written_out_loss(batch, rows, ranked, cfg)(lp), logp)  # [9, R] of the samples
    pairs, _ = ODPO.prepare(batch, cfg)
    mode, norm = ODPO.aggregation(cfg)
    for got in (surrogate_grad(ODPO, pairs, logp[rows], cfg, mode, norm),
                micro_batched_grad(ODPO, pairs, logp[rows], cfg, mode, norm, 2)):
        torch.testing.assert_close(got, want[rows], atol=1e-6, rtol=1e-5)
    assert want[[4, 5, 6]].abs().sum() == 0  # the samples left out of every pair
    assert want[[2, 8]].abs().sum() == 0 and want[[3, 0, 1, 7]].abs().sum() > 0  # the tie's rows; the ranked pairs'


def test_a_tie_changes_nothing_and_counts_in_the_mean():
    """Moving the tied pair's log-probs leaves every GC as it was (the tie's are 0), while the loss is the mean over
    all three pairs: the ranked pairs' GC is 2/3 of what it is when the tie is dropped from the batch."""
    cfg = OnlineDPOConfig(group_size=3)
    batch, logp = random_batch()
    pairs, _ = ODPO.prepare(batch, cfg)
    lp = logp[[3, 0, 1, 7, 2, 8]]
    gc, metrics = ODPO.coefficient(pairs, lp, cfg)
    moved = lp.clone()
    moved[4:] -= 1.0
    gc2, metrics2 = ODPO.coefficient(pairs, moved, cfg)
    assert torch.equal(gc, gc2) and gc[4:].abs().sum() == 0
    assert metrics["pair_accuracy"] == metrics2["pair_accuracy"]  # means over the ranked pairs only
    mode, norm = ODPO.aggregation(cfg)
    ranked_only = pairs.select(slice(0, 4))
    with_tie = surrogate_grad(ODPO, pairs, lp, cfg, mode, norm)[:4]
    without = surrogate_grad(ODPO, ranked_only, lp[:4], cfg, mode, norm)
    torch.testing.assert_close(with_tie, without * 2 / 3)


def test_every_pair_tied_gives_no_gradient():
    batch, logp = random_batch()
    batch.reward = torch.zeros(len(GROUP))
    pairs, metrics = ODPO.prepare(batch, OnlineDPOConfig(group_size=3))
    gc, _ = ODPO.coefficient(pairs, logp[:6], OnlineDPOConfig(group_size=3))
    assert metrics["tie_frac"] == 1 and gc.abs().sum() == 0


def test_plugin_contract_and_refusals():
    cfg = OnlineDPOConfig()
    assert ODPO.source == "online" and ODPO.unit == 2 and ODPO.needs(cfg) == {"reward", "ref_logp"}
    assert ODPO.samples_per_prompt(OnlineDPOConfig(group_size=8)) == 8 and ODPO.rows_per_item(cfg) == 2
    assert not ODPO.kl_penalty and ODPO.reward_threshold is None
    for kwargs, match in [({"group_size": 1}, "group_size: online DPO pairs"), ({"beta": 0.0}, "beta: must be > 0"),
                          ({"label_smoothing": 0.5}, "label_smoothing")]:
        with pytest.raises(ConfigError, match=match):
            OnlineDPOConfig(**kwargs)


def test_its_recipe_and_plan():
    """recipe=online_dpo_math: GRPO's 8 samples per prompt, of which the step trains on one pair: 32 prompts, 256
    samples, 64 rows. An odd number of samples in all, or per-difficulty group sizes, are refused by name."""
    cfg, resolved = config.load("online_dpo_math")
    assert type(cfg.algorithm) is OnlineDPOConfig and resolved["algorithm"]["name"] == "online_dpo"
    shape = plan(cfg).shape
    assert (shape.batch_unit, shape.samples_per_prompt, shape.rows, shape.sampled_rows) == ("prompts", 8, 64,
                                                                                              (256, 256))
    assert plan(cfg).role("reference") is not None
    with pytest.raises(ConfigError, match=r"train.batch_size: .* must be even \(got 3 × 3\)"):
        config.load("online_dpo_math", ["train.batch_size=3", "algorithm.group_size=3"])
    with pytest.raises(ConfigError, match="rollout.adaptive_group_size: online DPO keeps one pair"):
        config.load("online_dpo_math", ["rollout.adaptive_group_size=true"])
