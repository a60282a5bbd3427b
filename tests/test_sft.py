"""SFT: GC = 1, so the surrogate gradient is the gradient of the mean log-likelihood (Appendix A.1.1)."""

import pytest
import torch
from helpers import objective_grad, surrogate_grad, written_out_mean

from posttrain.algorithms import get
from posttrain.algorithms.sft import SFTConfig
from posttrain.core.aggregation import MODES
from posttrain.core.batch import Batch

SFT = get("sft")


@pytest.mark.parametrize("mode", MODES)
def test_gradient_matches_log_likelihood(mode):
    """J_SFT = (1/B) Σ_i (1/|o_i|) Σ_t log πθ(o_t) in the paper's mode; hand check for one token of a 2-token
    sequence in a batch of 3 under seq_mean_token_mean: ∂(−J)/∂logp = −(1/3)(1/2) = −1/6."""
    g = torch.Generator().manual_seed(1)
    logp = -torch.rand(3, 4, generator=g)
    mask = torch.tensor([[1.0, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    batch = Batch(input_ids=torch.zeros(3, 6, dtype=torch.long), attention_mask=torch.ones(3, 6), mask=mask,
                  prompt_len=2)
    got = surrogate_grad(SFT, batch, logp, SFTConfig(), mode, norm=3.0)
    want = objective_grad(lambda lp: written_out_mean(lp, mask, mode, norm=3.0), logp)
    torch.testing.assert_close(got, want)
    if mode == "seq_mean_token_mean":
        assert got[0, 0].item() == pytest.approx(-1 / 3 / 2)


def test_offline_needs_nothing():
    assert SFT.source == "offline" and SFT.needs(SFTConfig()) == frozenset()
