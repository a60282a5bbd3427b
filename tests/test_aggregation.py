"""Aggregation modes on hand-worked numbers, and invariance to micro-batch splits."""

import pytest
import torch

from posttrain.core.aggregation import MODES, Totals, aggregate


def test_hand_worked():
    """values [[1, 2, 3], [4, 0, 0]], mask [[1, 1, 1], [1, 0, 0]]:
    seq_mean_token_mean = ((1+2+3)/3 + 4/1) / 2 = 3; token_mean = (1+2+3+4) / 4 = 2.5;
    seq_mean_token_sum_norm with L = 5: (6 + 4) / (5 · 2) = 1.
    """
    v = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])
    m = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert aggregate(v, m, "seq_mean_token_mean").item() == pytest.approx(3.0)
    assert aggregate(v, m, "token_mean").item() == pytest.approx(2.5)
    assert aggregate(v, m, "seq_mean_token_sum_norm", norm=5.0).item() == pytest.approx(1.0)


def test_empty_sequences_do_not_count():
    v = torch.tensor([[2.0, 2.0], [5.0, 5.0]])
    m = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    assert aggregate(v, m, "seq_mean_token_mean").item() == pytest.approx(2.0)


@pytest.mark.parametrize("mode", MODES)
def test_split_invariance(mode):
    """Summing micro-batch losses with the whole batch's totals gives the whole-batch loss."""
    g = torch.Generator().manual_seed(0)
    v = torch.randn(7, 5, generator=g)
    m = (torch.rand(7, 5, generator=g) > 0.3).float()
    totals = Totals.of(m)
    whole = aggregate(v, m, mode, norm=4.0)
    parts = sum(aggregate(v[i : i + 3], m[i : i + 3], mode, totals, norm=4.0) for i in range(0, 7, 3))
    torch.testing.assert_close(parts, whole)


def test_unknown_mode():
    with pytest.raises(ValueError, match="known"):
        aggregate(torch.ones(1, 1), torch.ones(1, 1), "mean")
