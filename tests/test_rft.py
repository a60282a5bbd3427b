"""RFT and Online RFT: GC = I(o); the surrogate gradient is that of the filtered log-likelihood written out."""

import pytest
import torch
from helpers import objective_grad, surrogate_grad, written_out_mean

from posttrain.algorithms import get
from posttrain.algorithms.online_rft import OnlineRFTConfig
from posttrain.algorithms.rft import RFTConfig
from posttrain.core.aggregation import MODES
from posttrain.core.batch import Batch
from posttrain.core.errors import ConfigError


def batch_with(reward, mask):
    B, R = mask.shape
    return Batch(input_ids=torch.zeros(B, R + 2, dtype=torch.long), attention_mask=torch.ones(B, R + 2), mask=mask,
                 prompt_len=2, reward=torch.tensor(reward))


MASK = torch.tensor([[1.0, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name, cfg", [("rft", RFTConfig()), ("online_rft", OnlineRFTConfig())])
def test_gradient_matches_objective(name, cfg, mode):
    """J = (1/B) Σ_i (1/|o_i|) Σ_t I(o_i) log πθ(o_i,t). Hand check under seq_mean_token_mean: sample 1 (correct,
    2 tokens) gets ∂(−J)/∂logp = −(1/4)(1/2) = −0.125 per token; sample 2 (wrong) gets 0."""
    plugin = get(name)
    reward = [1.0, 1.0, 0.0, 1.0]
    batch = batch_with(reward, MASK)
    logp = -torch.rand(4, 4, generator=torch.Generator().manual_seed(0))
    indicator = torch.tensor(reward)[:, None]
    got = surrogate_grad(plugin, batch, logp, cfg, mode, norm=3.0)
    want = objective_grad(lambda lp: written_out_mean(indicator * lp, MASK, mode, norm=3.0), logp)
    torch.testing.assert_close(got, want)
    if mode == "seq_mean_token_mean":
        assert got[1, 0].item() == pytest.approx(-0.125) and got[2].abs().sum() == 0


def test_online_threshold():
    plugin = get("online_rft")
    batch = batch_with([0.4, 0.6, 1.0, 0.0], MASK)
    gc, metrics = plugin.coefficient(batch, torch.zeros(4, 4), OnlineRFTConfig(threshold=0.5))
    assert gc[:, 0].tolist() == [0.0, 1.0, 1.0, 0.0] and metrics["correct_frac"].item() == 0.5
    # One-token responses (R = 1): I(o) is the same, one column wide.
    gc, metrics = plugin.coefficient(batch_with([0.4, 0.6, 1.0, 0.0], MASK[:, :1]), torch.zeros(4, 1),
                                     OnlineRFTConfig(threshold=0.5))
    assert gc.tolist() == [[0.0], [1.0], [1.0], [0.0]] and metrics["correct_frac"].item() == 0.5


def test_sources_and_needs():
    assert get("rft").source == "samples_once" and get("online_rft").source == "online"
    assert get("online_rft").needs(OnlineRFTConfig()) == {"reward"}


def test_out_of_range():
    with pytest.raises(ConfigError, match="samples_per_prompt"):
        RFTConfig(samples_per_prompt=0)
    with pytest.raises(ConfigError, match="samples_per_prompt"):
        OnlineRFTConfig(samples_per_prompt=0)
