"""PPO: GAE by hand and against loops, the KL-shaped reward, whitening, and both gradients (policy surrogate, critic)
against autograd on the objectives written out."""

import pytest
import torch
from helpers import objective_grad, surrogate_grad, written_out_mean

from posttrain.algorithms import common, ppo
from posttrain.algorithms.common import gae, kl_reward, whiten
from posttrain.algorithms.ppo import PPO, PPOConfig
from posttrain.core.aggregation import MODES, aggregate, masked_mean
from posttrain.core.batch import Batch
from posttrain.core.errors import ConfigError

LENGTHS = [3, 5, 1, 4, 0, 2]  # response lengths per row, one of them empty (a filtered sample)


def make_mask(lengths=LENGTHS, R=5):
    return (torch.arange(R)[None, :] < torch.tensor(lengths)[:, None]).float()  # [B, R], contiguous from column 0


def gae_loop(token_reward, values, mask, gamma, lam):
    """GAE (Schulman et al. 2016, Eq. 16) as plain loops over rows and tokens; V after the last token is 0."""
    adv, ret = torch.zeros_like(values), torch.zeros_like(values)
    for i in range(values.shape[0]):
        n, running = int(mask[i].sum()), 0.0
        for t in reversed(range(n)):
            next_value = float(values[i, t + 1]) if t + 1 < n else 0.0
            delta = float(token_reward[i, t]) + gamma * next_value - float(values[i, t])
            running = delta + gamma * lam * running
            adv[i, t], ret[i, t] = running, running + float(values[i, t])
    return adv, ret


def test_gae_hand_worked():
    """r = [0, 0, 1], V = [0.5, 0.6, 0.8], V after the last token 0 (a 4th padded column holds junk that must not count).

    δ_2 = 1 + 0 − 0.8 = 0.2,  δ_1 = 0 + 0.8 − 0.6 = 0.2,  δ_0 = 0 + 0.6 − 0.5 = 0.1.
    γ = λ = 1:   A = [0.1 + 0.4, 0.2 + 0.2, 0.2] = [0.5, 0.4, 0.2] = Σ_{k≥t} r_k − V_t;  R = A + V = [1, 1, 1].
    γ = 1, λ = 0.5:  A_2 = 0.2, A_1 = 0.2 + 0.5·0.2 = 0.3, A_0 = 0.1 + 0.5·0.3 = 0.25;  R = [0.75, 0.9, 1.0].
    """
    r = torch.tensor([[0.0, 0.0, 1.0, 7.0]])
    v = torch.tensor([[0.5, 0.6, 0.8, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    adv, ret = gae(r, v, mask, gamma=1.0, lam=1.0)
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.4, 0.2, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0, 1.0, 0.0]]))
    adv, ret = gae(r, v, mask, gamma=1.0, lam=0.5)
    torch.testing.assert_close(adv, torch.tensor([[0.25, 0.3, 0.2, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[0.75, 0.9, 1.0, 0.0]]))


@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (1.0, 0.95), (0.9, 0.5), (0.99, 0.0), (0.0, 0.7)])
def test_gae_matches_loop(gamma, lam):
    g = torch.Generator().manual_seed(1)
    mask = make_mask()
    r, v = torch.randn(6, 5, generator=g), torch.randn(6, 5, generator=g)  # junk outside the mask must not count
    adv, ret = gae(r, v, mask, gamma, lam)
    want_adv, want_ret = gae_loop(r, v, mask, gamma, lam)
    torch.testing.assert_close(adv, want_adv)
    torch.testing.assert_close(ret, want_ret)


def test_kl_shaped_reward():
    """−β(old − ref) on every response token, the sequence reward added at the last one, zero outside the mask."""
    g = torch.Generator().manual_seed(2)
    mask = make_mask()
    old, ref = -torch.rand(6, 5, generator=g), -torch.rand(6, 5, generator=g)
    reward = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    got = kl_reward(reward, old, ref, mask, beta=0.1)
    want = torch.zeros(6, 5)
    for i, n in enumerate(LENGTHS):
        for t in range(n):
            want[i, t] = -0.1 * (old[i, t] - ref[i, t]) + (reward[i] if t == n - 1 else 0.0)
    torch.testing.assert_close(got, want)
    assert got[4].abs().sum() == 0  # the empty row gets nothing, not even its reward
    no_kl = kl_reward(reward, old, None, mask, beta=0.0)
    assert no_kl.nonzero().tolist() == [[0, 2], [1, 4], [2, 0], [3, 3], [5, 1]]


def test_whiten():
    g = torch.Generator().manual_seed(3)
    mask = make_mask()
    x = 3 + 2 * torch.randn(6, 5, generator=g)
    w = whiten(x, mask)
    n = mask.sum()
    mean = (w * mask).sum() / n
    std = (((w - mean) ** 2 * mask).sum() / n).sqrt()
    torch.testing.assert_close(mean, torch.tensor(0.0), atol=1e-6, rtol=0)
    torch.testing.assert_close(std, torch.tensor(1.0))
    assert (w[mask == 0] == 0).all()


def test_whiten_constant_is_zero():
    """All advantages equal (e.g. one response token in the batch): variance 0, so the eps keeps the result 0."""
    mask = make_mask()
    w = whiten(torch.full((6, 5), 3.0), mask)
    assert torch.isfinite(w).all() and (w == 0).all()


def test_clipped_coefficient_hand_worked():
    """ε = 0.2, ratios ρ = [0.7, 1.0, 1.3] in each row. GC = A·ρ where min(ρA, clip(ρ, 0.8, 1.2)A) keeps ρA:
    A = +2: ρ = 1.3 > 1.2 is clipped -> GC [1.4, 2, 0];  A = −1: ρ = 0.7 < 0.8 is clipped -> GC [0, −1, −1.3];
    A = 0: GC 0 and nothing counts as clipped, though ρ leaves the range. clip_frac = 2 clipped / 9 tokens.
    With ε_high = 0.4 the upper bound is 1.4, so ρ = 1.3 with A = +2 is kept (GC 2.6); the lower bound stays 0.8."""
    rho = torch.tensor([0.7, 1.0, 1.3]).expand(3, 3)
    old = -torch.ones(3, 3)
    logp = old + torch.log(rho)
    adv = torch.tensor([[2.0], [-1.0], [0.0]])
    mask = torch.ones(3, 3)
    gc, metrics = common.clipped_coefficient(adv, logp, old, mask, 0.2, None)
    torch.testing.assert_close(gc, torch.tensor([[1.4, 2.0, 0.0], [0.0, -1.0, -1.3], [0.0, 0.0, 0.0]]))
    torch.testing.assert_close(metrics["clip_frac"], torch.tensor(2 / 9))
    torch.testing.assert_close(metrics["ratio"], torch.tensor(1.0))
    gc, metrics = common.clipped_coefficient(adv, logp, old, mask, 0.2, 0.4)
    torch.testing.assert_close(gc, torch.tensor([[1.4, 2.0, 2.6], [0.0, -1.0, -1.3], [0.0, 0.0, 0.0]]))
    torch.testing.assert_close(metrics["clip_frac"], torch.tensor(1 / 9))


def random_batch(seed=0, spread=0.0):
    """Random log-probs and values; `spread` > 0 moves π_old away from πθ so ratios leave [1 − ε, 1 + ε]."""
    g = torch.Generator().manual_seed(seed)
    B, R = len(LENGTHS), 5
    logp = -torch.rand(B, R, generator=g) * 3
    old = logp + spread * torch.randn(B, R, generator=g) if spread else logp.clone()
    ref = old + 0.3 * torch.randn(B, R, generator=g)
    batch = Batch(input_ids=torch.zeros(B, R + 2, dtype=torch.long), attention_mask=torch.ones(B, R + 2),
                  mask=make_mask(), prompt_len=2, reward=torch.randint(0, 2, (B,), generator=g).float(),
                  old_logp=old, ref_logp=ref, extra={"values": 0.5 * torch.randn(B, R, generator=g)})
    return batch, logp


def test_prepare():
    """With γ = λ = 1, V = 0 and no whitening, A_t is the reward-to-go of the shaped reward, and R_t = A_t."""
    batch, _ = random_batch()
    batch.extra["values"] = torch.zeros(6, 5)
    cfg = PPOConfig(beta=0.1, gamma=1.0, lam=1.0, whiten_advantages=False)
    prepared, metrics = PPO.prepare(batch, cfg)
    shaped = kl_reward(batch.reward, batch.old_logp, batch.ref_logp, batch.mask, 0.1)
    to_go = shaped.flip(1).cumsum(1).flip(1) * batch.mask
    torch.testing.assert_close(prepared.adv, to_go)
    torch.testing.assert_close(prepared.extra["returns"], to_go)
    assert set(prepared.extra) == {"values", "returns"} and "returns" not in batch.extra
    torch.testing.assert_close(metrics["kl"], masked_mean(batch.old_logp - batch.ref_logp, batch.mask))
    torch.testing.assert_close(metrics["seq_reward"], batch.reward.mean())
    whitened, _ = PPO.prepare(batch, PPOConfig())
    assert (whitened.adv[batch.mask == 0] == 0).all() and abs(masked_mean(whitened.adv, batch.mask)) < 1e-6


def shaped_reward_loop(reward, old, ref, mask, beta):
    """Eq. 2 written out: −β(log π_old − log π_ref) on each response token, r_φ added at the last one."""
    out = torch.zeros_like(old)
    for i in range(old.shape[0]):
        n = int(mask[i].sum())
        for t in range(n):
            out[i, t] = (-beta * (old[i, t] - ref[i, t]) if ref is not None else 0.0) + (reward[i] if t == n - 1 else 0)
    return out


@pytest.mark.parametrize("whiten_advantages", [False, True], ids=["raw", "whitened"])
def test_prepare_gae_with_critic(whiten_advantages):
    """γ = 0.9, λ = 0.5 (different, so swapping them shows) and the critic's V_old: A and R are GAE of the shaped
    reward by the loop above; whitened A is (A − mean)/std over response tokens with the population std."""
    batch, _ = random_batch(seed=3)
    cfg = PPOConfig(beta=0.1, gamma=0.9, lam=0.5, whiten_advantages=whiten_advantages)
    prepared, metrics = PPO.prepare(batch, cfg)
    shaped = shaped_reward_loop(batch.reward, batch.old_logp, batch.ref_logp, batch.mask, 0.1)
    adv, ret = gae_loop(shaped, batch.extra["values"], batch.mask, 0.9, 0.5)
    torch.testing.assert_close(prepared.extra["returns"], ret)
    if whiten_advantages:
        tokens = adv[batch.mask == 1]
        mean = tokens.mean()
        std = ((tokens - mean) ** 2).mean().sqrt()
        adv = (adv - mean) / std * batch.mask
    torch.testing.assert_close(prepared.adv, adv)
    torch.testing.assert_close(metrics["value"], batch.extra["values"][batch.mask == 1].mean())
    torch.testing.assert_close(metrics["returns"], ret[batch.mask == 1].mean())


def test_prepare_beta0_needs_no_reference():
    """With β = 0 no reference is loaded (ref_logp None): the shaped reward is r_φ at the last token alone."""
    batch, _ = random_batch()
    batch.ref_logp = None
    cfg = PPOConfig(beta=0.0, gamma=1.0, lam=1.0, whiten_advantages=False)
    prepared, metrics = PPO.prepare(batch, cfg)
    shaped = shaped_reward_loop(batch.reward, batch.old_logp, None, batch.mask, 0.0)
    adv, _ = gae_loop(shaped, batch.extra["values"], batch.mask, 1.0, 1.0)
    torch.testing.assert_close(prepared.adv, adv)
    assert "kl" not in metrics


def clipped_objective(adv, batch, cfg, mode, norm):
    """J_PPO (Eq. 1): the token average of min(ρA, clip(ρ, 1 − ε, 1 + ε)A), with A the fixed advantages."""
    high = cfg.clip_eps_high if cfg.clip_eps_high is not None else cfg.clip_eps

    def J(logp):
        ratio = torch.exp(logp - batch.old_logp)
        surrogate = torch.min(ratio * adv, torch.clamp(ratio, 1 - cfg.clip_eps, 1 + high) * adv)
        return written_out_mean(surrogate, batch.mask, mode, norm)

    return J


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("spread", [0.0, 0.4], ids=["ratio1", "ratio-off-1"])
@pytest.mark.parametrize("cfg", [PPOConfig(), PPOConfig(beta=0.0, whiten_advantages=False, gamma=0.9, lam=0.5),
                                 PPOConfig(clip_eps=0.1, clip_eps_high=0.3)], ids=["default", "plain", "clip-higher"])
def test_gradient_matches_objective(mode, spread, cfg):
    batch, logp = random_batch(spread=spread)
    prepared, _ = PPO.prepare(batch, cfg)
    norm = 4.0
    got = surrogate_grad(PPO, prepared, logp, cfg, mode, norm)
    want = objective_grad(clipped_objective(prepared.adv, batch, cfg, mode, norm), logp)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    _, metrics = PPO.coefficient(prepared, logp, cfg)
    if spread:  # the test only proves the clip if some tokens were clipped
        assert 0 < metrics["clip_frac"] < 1
    else:
        assert metrics["clip_frac"] == 0 and torch.isclose(metrics["ratio"], torch.tensor(1.0))


@pytest.mark.parametrize("value_clip", [0.2, None, 0.0])
def test_critic_gradient_matches_loss(value_clip):
    batch, _ = random_batch()
    cfg = PPOConfig(value_clip=value_clip)
    prepared, _ = PPO.prepare(batch, cfg)
    old, returns, mask = batch.extra["values"], prepared.extra["returns"], batch.mask
    values0 = old + 0.4 * torch.randn(old.shape, generator=torch.Generator().manual_seed(5))

    values = values0.clone().requires_grad_(True)
    loss, metrics = PPO.critic_loss(prepared, values, cfg)
    (got,) = torch.autograd.grad(aggregate(loss, mask, "token_mean"), values)

    values = values0.clone().requires_grad_(True)
    plain = (values - returns) ** 2
    if value_clip:
        clipped = (torch.clamp(values, old - value_clip, old + value_clip) - returns) ** 2
        plain = torch.max(plain, clipped)
    (want,) = torch.autograd.grad(written_out_mean(0.5 * plain, mask, "token_mean"), values)
    torch.testing.assert_close(got, want)
    if value_clip:  # the test only proves the value clip if it removed some gradients
        assert 0 < metrics["value_clip_frac"] < 1
    else:
        assert metrics["value_clip_frac"] == 0
    torch.testing.assert_close(metrics["value_error"], masked_mean((values0 - returns).abs(), mask))


def test_critic_metrics_perfect_critic():
    batch, _ = random_batch()
    prepared, _ = PPO.prepare(batch, PPOConfig())
    _, metrics = PPO.critic_loss(prepared, prepared.extra["returns"].clone(), PPOConfig())
    assert metrics["value_error"] == 0 and metrics["explained_variance"] == 1


def critic_batch(old, returns):
    B, R = old.shape
    return Batch(input_ids=torch.zeros(B, R + 2, dtype=torch.long), attention_mask=torch.ones(B, R + 2),
                 mask=torch.ones(B, R), prompt_len=2, extra={"values": old, "returns": returns})


def test_critic_loss_hand_worked():
    """ε_v = 0.2, V_old = 0. Per token V, R -> 0.5·max((V − R)², (clip(V, −0.2, 0.2) − R)²):
    V = 0.1, R = 0: inside the clip range, both terms 0.01 (a tie: the clip removed nothing) -> 0.005;
    V = 0.5, R = 1: 0.25 vs (0.2 − 1)² = 0.64 -> 0.32, the clip removed the gradient;
    V = −0.5, R = 1: 2.25 vs 1.44 -> 1.125;   V = 0.3, R = 0: 0.09 vs 0.04 -> 0.045;
    V = −0.5, R = −1: 0.25 vs (−0.2 + 1)² = 0.64 -> 0.32, clipped from below.
    value_clip_frac = 2/5; value_error = mean |R − V| = (0.1 + 0.5 + 1.5 + 0.3 + 0.5)/5 = 0.58."""
    values = torch.tensor([[0.1, 0.5, -0.5, 0.3, -0.5]])
    returns = torch.tensor([[0.0, 1.0, 1.0, 0.0, -1.0]])
    loss, metrics = PPO.critic_loss(critic_batch(torch.zeros(1, 5), returns), values, PPOConfig(value_clip=0.2))
    torch.testing.assert_close(loss, torch.tensor([[0.005, 0.32, 1.125, 0.045, 0.32]]))
    torch.testing.assert_close(metrics["value_clip_frac"], torch.tensor(0.4))
    torch.testing.assert_close(metrics["value_error"], torch.tensor(0.58))


def test_explained_variance_hand_worked():
    """R = [0.5, 1, 1.5, 2] (variance 0.3125), V = [0.5, 1, 1.5, 1.5]: R − V = [0, 0, 0, 0.5] has variance
    0.046875, so explained_variance = 1 − 0.046875/0.3125 = 0.85."""
    returns = torch.tensor([[0.5, 1.0, 1.5, 2.0]])
    values = torch.tensor([[0.5, 1.0, 1.5, 1.5]])
    _, metrics = PPO.critic_loss(critic_batch(values.clone(), returns), values, PPOConfig())
    torch.testing.assert_close(metrics["explained_variance"], torch.tensor(0.85))
    torch.testing.assert_close(metrics["value_error"], torch.tensor(0.125))


def test_plugin_contract():
    assert ppo.PPO.name == "ppo" and PPO.source == "online"
    assert PPO.needs(PPOConfig(beta=0.0)) == {"reward", "old_logp", "values"}
    assert PPO.needs(PPOConfig()) == {"reward", "old_logp", "values", "ref_logp"}
    cfg = PPOConfig(samples_per_prompt=4, ppo_epochs=3, num_minibatches=5)
    assert (PPO.samples_per_prompt(cfg), PPO.epochs(cfg), PPO.minibatches(cfg)) == (4, 3, 5)


@pytest.mark.parametrize("kwargs, message", [
    ({"clip_eps": 0.0}, "clip_eps: must be > 0 (got 0.0)"), ({"clip_eps_high": -1.0}, "clip_eps_high: must be > 0"),
    ({"beta": -0.1}, "beta: must be ≥ 0"), ({"value_clip": -0.1}, "value_clip: must be ≥ 0"),
    ({"gamma": 1.5}, "gamma: must be in [0, 1]"), ({"lam": -0.1}, "lam: must be in [0, 1]"),
    ({"ppo_epochs": 0}, "ppo_epochs: must be ≥ 1"), ({"num_minibatches": 0}, "num_minibatches: must be ≥ 1"),
    ({"samples_per_prompt": 0}, "samples_per_prompt: must be ≥ 1"), ({"critic_lr": 0.0}, "critic_lr: must be > 0")])
def test_out_of_range(kwargs, message):
    with pytest.raises(ConfigError) as info:
        PPOConfig(**kwargs)
    assert str(info.value).startswith(message)
