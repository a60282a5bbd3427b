"""The elite replay pool (stages/elite.py) on hand-built batches, its off-policy weight in Engine.coefficient
against autograd on the weighted objective written out, and its config checks."""

import io

import pytest
import torch
from helpers import objective_grad, weighted_grpo_objective

from posttrain import config
from posttrain.algorithms import get
from posttrain.algorithms.common import group_advantages
from posttrain.algorithms.grpo import GRPOConfig
from posttrain.core.aggregation import MODES, aggregate
from posttrain.core.batch import Batch, collate
from posttrain.core.errors import ConfigError
from posttrain.stages.elite import ElitePool, fresh_mask
from posttrain.train.engine import Engine

PAD = 0
A, B, C = [7, 8], [9], [3, 4, 5]  # three prompts, of different lengths (left padding differs)


def make(prompts, responses, rewards, groups, truncated=None, seed=0) -> Batch:
    """A source's batch: ids by `collate`, the rollout's log-probs (negative, 0 on padding), rewards on the CPU."""
    batch = collate(prompts, responses, PAD)
    g = torch.Generator().manual_seed(seed)
    batch.group, batch.reward = torch.tensor(groups), torch.tensor(rewards, dtype=torch.float)
    batch.truncated = torch.tensor(truncated or [False] * len(responses))
    batch.rollout_logp = -torch.rand(batch.mask.shape, generator=g) * batch.mask  # [B, R]
    return batch


def first_batch() -> Batch:
    """Group 0 (prompt A): rewards [0, 1, 0.5], best row 1; group 1 (prompt B): rewards [0.2, 0.2], best row 3."""
    return make([A, A, A, B, B], [[11, 12], [13, 14, 15], [16], [17], [18, 19]], [0, 1, 0.5, 0.2, 0.2],
                [0, 0, 0, 1, 1], truncated=[False, True, False, False, False])


def test_update_stores_each_prompts_best():
    pool, batch = ElitePool(8, PAD), first_batch()
    pool.update(batch)
    a, b = pool.elites[tuple(A)], pool.elites[tuple(B)]
    assert (a.response, a.reward, a.truncated) == ([13, 14, 15], 1.0, True)
    torch.testing.assert_close(a.logp, batch.rollout_logp[1, :3])
    torch.testing.assert_close(a.mask, torch.ones(3))
    assert b.response == [17] and b.reward == pytest.approx(0.2)  # equal rewards in one group: the first
    # a later tie replaces (the newer), a lower reward does not
    pool.update(make([A, A, B], [[21], [22], [23]], [1, 0, 0.1], [0, 0, 1]))
    assert pool.elites[tuple(A)].response == [21] and pool.elites[tuple(B)].response == [17]


def test_inject_replaces_the_lowest_sample_of_a_group_below_its_elite():
    """Pool: A → reward 1, B → 0.2. Group 0 (A) best 0.5 < 1: its lowest, 0 at rows 0 and 2, the last (row 2), is
    replaced. Group 1 (B) best 0.2 is not below 0.2: untouched. Group 2 (C) has no elite: untouched."""
    pool = ElitePool(8, PAD)
    pool.update(first_batch())
    batch = make([A, A, A, B, B, C, C], [[31], [32, 33], [34], [35], [36], [37], [38]], [0, 0.5, 0, 0.2, 0.0, 0, 1],
                 [0, 0, 0, 1, 1, 2, 2], seed=1)
    before = batch.input_ids.clone()
    out, n = pool.inject(batch)
    assert n == 1 and len(out) == len(batch) and out.group.tolist() == batch.group.tolist()
    assert out.extra["replayed"].tolist() == [0, 0, 1, 0, 0, 0, 0]
    elite, P = pool.elites[tuple(A)], out.prompt_len
    assert out.response_ids[2].tolist() == [13, 14, 15] and out.attention_mask[2, P:].tolist() == [1, 1, 1]
    assert out.input_ids[2, :P].tolist() == batch.input_ids[2, :P].tolist()  # the prompt stays
    torch.testing.assert_close(out.rollout_logp[2], elite.logp)  # μ, the log-probs of the policy that drew it
    assert out.mask[2].tolist() == [1, 1, 1] and out.reward[2] == 1.0 and bool(out.truncated[2])
    keep = torch.tensor([0, 1, 3, 4, 5, 6])
    assert torch.equal(out.response_ids[keep, :2], batch.response_ids[keep]) and out.response_ids[keep, 2].eq(PAD).all()
    torch.testing.assert_close(out.reward[keep], batch.reward[keep])
    assert torch.equal(batch.input_ids, before)  # the caller's batch is not changed
    # the pool's first pass over a prompt replays nothing, yet marks every row
    fresh, n = ElitePool(8, PAD).inject(batch)
    assert n == 0 and fresh.extra["replayed"].tolist() == [0] * 7


def test_a_longer_elite_widens_the_batch():
    """The elite has 3 tokens, the batch's R is 1: every per-token tensor, `extra`'s too, is padded to 3 columns."""
    pool = ElitePool(8, PAD)
    pool.update(first_batch())
    batch = make([A, A, B], [[41], [42], [43]], [0, 0, 0], [0, 0, 1], seed=2)
    batch.extra["step_end"] = torch.ones(3, 1)  # [B, R]
    batch.extra["score"] = torch.tensor([5.0, 6.0, 7.0])  # [B], not per token
    out, n = pool.inject(batch)
    assert n == 2 and out.input_ids.shape == (3, out.prompt_len + 3)  # both groups' lowest: rows 1 and 2
    for t in (out.mask, out.rollout_logp, out.extra["step_end"]):
        assert t.shape == (3, 3)
    assert out.response_ids[0].tolist() == [41, PAD, PAD] and out.attention_mask[0, -3:].tolist() == [1, 0, 0]
    assert out.mask[0].tolist() == [1, 0, 0] and out.rollout_logp[0, 1:].eq(0).all()
    assert out.extra["step_end"].tolist() == [[1, 0, 0], [0, 0, 0], [0, 0, 0]]  # the replaced rows' are cleared
    assert out.extra["score"].tolist() == [5.0, 6.0, 7.0] and out.response_ids[2].tolist() == [17, PAD, PAD]


def test_update_skips_replayed_rows():
    """A row marked replayed never becomes an elite, however high its reward: it is not a fresh sample."""
    pool = ElitePool(8, PAD)
    batch = make([A, A], [[51], [52]], [0, 9], [0, 0])
    batch.extra["replayed"] = torch.tensor([0.0, 1.0])
    pool.update(batch)
    assert pool.elites[tuple(A)].response == [51]


def test_least_recently_stored_or_used_prompt_is_evicted():
    pool = ElitePool(2, PAD)
    pool.update(make([A, B], [[1], [2]], [1, 1], [0, 1]))
    pool.inject(make([A, A], [[3], [4]], [0, 0], [0, 0]))  # A used: B is now the oldest
    pool.update(make([C, C], [[5], [6]], [1, 0], [0, 0]))
    assert list(pool.elites) == [tuple(A), tuple(C)] and len(pool) == 2
    assert pool.metrics(3) == {"elite/replayed": 3.0, "elite/pool_size": 2.0}


def test_state_round_trip():
    """A resumed pool (saved as a checkpoint is) replays the same rows and evicts in the same order."""
    pool = ElitePool(2, PAD)
    pool.update(first_batch())
    buffer = io.BytesIO()
    torch.save(pool.state_dict(), buffer)
    buffer.seek(0)
    resumed = ElitePool(2, PAD)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    batch = make([A, A, B, B], [[1], [2], [3], [4]], [0, 0, 0, 0], [0, 0, 1, 1])
    (want, n), (got, m) = pool.inject(batch), resumed.inject(batch)
    assert n == m == 2 and list(pool.elites) == list(resumed.elites)
    for a, b in zip((want.input_ids, want.mask, want.rollout_logp, want.reward), (got.input_ids, got.mask,
                                                                                  got.rollout_logp, got.reward)):
        assert torch.equal(a, b)


# -- the off-policy weight (Engine.coefficient) ------------------------------------------------------------------

GRPO = get("grpo")
REPLAYED = torch.tensor([0.0, 1.0, 0.0, 0.0, 0.0, 1.0])  # rows 1 and 5 replayed


def scored_batch(spread: float):
    """GRPO's batch after scoring: groups of 3, π_old (given if `spread` > 0), π_ref, and the rollout's log-probs:
    near π_old on fresh rows, an older policy's μ, far from it, on the replayed rows."""
    g = torch.Generator().manual_seed(0)
    Bn, R = 6, 5
    logp = -torch.rand(Bn, R, generator=g) * 3
    old = logp + spread * torch.randn(Bn, R, generator=g) if spread else None
    at_sampling = old if old is not None else logp
    mask = torch.ones(Bn, R)
    mask[0, 3:], mask[1, 2:] = 0, 0
    rollout = at_sampling + torch.where(REPLAYED[:, None] > 0, 0.8, 0.1) * torch.randn(Bn, R, generator=g)
    batch = Batch(input_ids=torch.zeros(Bn, R + 2, dtype=torch.long), attention_mask=torch.ones(Bn, R + 2), mask=mask,
                  prompt_len=2, group=torch.arange(2).repeat_interleave(3), reward=torch.tensor([0.0, 1, 0, 1, 1, 0]),
                  truncated=torch.zeros(Bn, dtype=torch.bool), old_logp=old,
                  ref_logp=logp + 0.3 * torch.randn(Bn, R, generator=g), rollout_logp=rollout * mask,
                  extra={"replayed": REPLAYED.clone()})
    return batch, logp, at_sampling


def engine(cfg, tis_cap, elite_cap) -> Engine:
    e = Engine.__new__(Engine)  # only what Engine.coefficient reads
    e.plugin, e.tis_cap, e.tis_mode, e.mismatch, e.elite_sums = GRPO, tis_cap, "token_truncate", torch.zeros(3), torch.zeros(2)
    e.algorithm, e.elite_is_cap, e.proximal = cfg, elite_cap, "trainer"
    return e


@pytest.mark.parametrize("tis_cap", [None, 1.5])
def test_replayed_rows_get_the_truncated_ratio_to_mu(tis_cap):
    """GC = plugin GC × min(π_old/μ, C) on replayed rows; fresh rows keep the plugin's GC (× the tis weight if set),
    and only fresh tokens enter the mismatch."""
    cfg, C = GRPOConfig(group_size=3, beta=0.04), 1.0
    batch, logp, at_sampling = scored_batch(spread=0.0)
    prepared, _ = GRPO.prepare(batch, cfg)
    e = engine(cfg, tis_cap, C)
    gc, metrics = e.coefficient(prepared, logp)
    plain, _ = GRPO.coefficient(prepared, logp, cfg)
    ratio = torch.exp(at_sampling - batch.rollout_logp)  # [B, R]
    fresh_w = torch.ones_like(ratio) if tis_cap is None else ratio.clamp(max=tis_cap)
    want = plain * torch.where(REPLAYED[:, None] > 0, ratio.clamp(max=C), fresh_w)
    torch.testing.assert_close(gc, want)
    on = batch.mask * REPLAYED[:, None]
    torch.testing.assert_close(e.elite_sums, torch.stack([(ratio.clamp(max=C) * on).sum(), on.sum()]))
    assert 0 < float(((ratio < C) * on).sum()) < float(on.sum())  # some replayed tokens down-weighted, some capped
    assert e.mismatch[1] == (batch.mask * (1 - REPLAYED[:, None])).sum()  # replayed tokens not measured
    torch.testing.assert_close(fresh_mask(batch), batch.mask * (1 - REPLAYED[:, None]))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("spread", [0.0, 0.4], ids=["mu1-weights-from-this-forward", "weights-from-old-logp"])
def test_gradient_with_a_replayed_row_matches_the_weighted_objective(mode, spread):
    """The engine's gradient equals autograd on Eq. 3 + 4 of GRPO with each replayed token's term weighted by the
    constant w_t = min(π_old/μ, C), fresh tokens by 1."""
    cfg, C, norm = GRPOConfig(group_size=3, beta=0.04), 1.0, 4.0
    batch, logp, at_sampling = scored_batch(spread)
    prepared, _ = GRPO.prepare(batch, cfg)
    x = logp.clone().requires_grad_(True)
    gc, _ = engine(cfg, None, C).coefficient(prepared, x.detach())
    (got,) = torch.autograd.grad(-aggregate(gc.detach() * x, prepared.mask, mode, norm=norm), x)

    w = torch.where(REPLAYED[:, None] > 0, torch.exp(at_sampling - batch.rollout_logp).clamp(max=C), 1.0)  # [B, R]
    adv = group_advantages(batch.reward, batch.group, cfg.adv_norm, cfg.eps)[:, None]  # [B, 1]

    weighted = weighted_grpo_objective(batch, cfg, adv, w, mode, norm)
    torch.testing.assert_close(got, objective_grad(weighted, logp), atol=1e-6, rtol=1e-5)
    unweighted = objective_grad(weighted_grpo_objective(batch, cfg, adv, torch.ones_like(w), mode, norm), logp)
    assert not torch.allclose(got, unweighted)  # the weights changed the gradient


# -- config -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("recipe, overrides, message", [
    ("sft_math", ["rollout.elite_pool=8"], "rollout.elite_pool: replays a prompt's best sample"),
    ("rft_math", ["rollout.elite_pool=8"], "rollout.elite_pool: replays a prompt's best sample"),
    ("ppo_math", ["rollout.elite_pool=8", "algorithm.samples_per_prompt=1"], "samples no groups"),
    ("grpo_math", ["rollout.elite_pool=-1"], "rollout.elite_pool: must be ≥ 0"),
    ("grpo_math", ["rollout.elite_is_cap=0"], "rollout.elite_is_cap: must be > 0"),
])
def test_config_refuses(recipe, overrides, message):
    with pytest.raises(ConfigError) as err:
        config.load(recipe, ["model.path=m", *overrides])
    assert message in str(err.value) and "\n" not in str(err.value)


def test_config_accepts_group_methods():
    for recipe in ("grpo_math", "ppo_math", "online_rft_math"):
        cfg, resolved = config.load(recipe, ["rollout.elite_pool=16", "rollout.elite_is_cap=2"])
        assert cfg.rollout.elite_pool == 16 and resolved["rollout"]["elite_is_cap"] == 2.0


# -- the stage (EliteReplay) in the online source ------------------------------------------------------------------
def test_the_stage_replays_on_a_second_pass_with_the_elite_version_and_text(monkeypatch):
    """A mixed prompt (rewards 1, 0) stored at version 0 comes back as failed at version 3: its worst sample becomes
    the stored best, with that row's version, reward, outcome and a new text for the stages after it."""
    from fake_online import Rollout, deps, fake_ids

    from posttrain.schema import RolloutConfig
    from posttrain.sources.online import Online

    fake_ids(monkeypatch)
    pool, rollout = ElitePool(4, PAD), Rollout()
    source = Online(deps(["mixed"], batch_size=1, sampling=RolloutConfig(elite_pool=4), elite=pool, rollout=rollout))
    first, stats = source.next()
    assert stats["elite/replayed"] == 0 and len(pool) == 1 and first.extra["replayed"].tolist() == [0, 0]
    source.sampler.rows = [{"id": 1, "kind": "failed", "question": "1"}]  # the same prompt, now never solved
    rollout.version = 3
    judged = source.pipeline.through(0)
    out = source.pipeline.stages[0](judged, None)
    assert out.metrics["elite/replayed"] == 1 and out.batch.extra["replayed"].tolist() == [0, 1]
    assert out.batch.version.tolist() == [3, 0] and out.batch.reward.tolist() == [0, 1]
    assert out.outcome.tolist() == [0, 1] and out.texts == ["replayed", "replayed"]
