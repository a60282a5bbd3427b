"""Aggregation modes on hand-worked numbers, and invariance to micro-batch splits."""

import pytest
import torch

from posttrain.core.aggregation import MODES, Totals, aggregate, masked_mean


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
def test_nothing_left_is_zero(mode):
    """A step whose sequences were all filtered out (e.g. every completion truncated under `mask_truncated`) has a
    zero loss with a zero gradient, not NaN; metrics over an empty mask are 0 too."""
    v = torch.ones(2, 3, requires_grad=True)
    m = torch.zeros(2, 3)
    loss = aggregate(v, m, mode, Totals.of(m), norm=4.0)
    (grad,) = torch.autograd.grad(loss, v)
    assert loss.item() == 0 and (grad == 0).all()
    assert masked_mean(torch.ones(2, 3), m).item() == 0


def test_masked_mean_hand_worked():
    """(1 + 2 + 4)/3 over the mask; the 9 is outside it. Over a single token, that token."""
    x = torch.tensor([[1.0, 2.0], [4.0, 9.0]])
    assert masked_mean(x, torch.tensor([[1.0, 1.0], [1.0, 0.0]])).item() == pytest.approx(7 / 3)
    assert masked_mean(x, torch.tensor([[0.0, 0.0], [1.0, 0.0]])).item() == 4.0


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
