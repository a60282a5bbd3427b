"""The adaptive temperature stage (stages/temperature.py) and its controller (core/schedules.py,
SamplingTemperature): the entropy of the fresh samples over every process moves the next step's τ; replayed rows are
left out; the controller's state round-trips."""

import math

import torch
from fake_online import Rollout, deps, fake_ids

from posttrain.core.batch import collate
from posttrain.core.schedules import SamplingTemperature, adapted_temperature
from posttrain.schema import RolloutConfig
from posttrain.sources.online import Online
from posttrain.stages import Judged
from posttrain.stages.temperature import AdaptiveTemperature


def test_the_fresh_tokens_entropy_over_every_process_moves_tau():
    """Two rows of 2 tokens at log-prob −1 and −3; the second is an elite replay, left out: entropy 1 nat. With a
    `reduce` that adds another process's 2 tokens of 2 nats each: (2 + 4) / 4 = 1.5 nats."""
    batch = collate([[5], [5]], [[1, 2], [3, 4]], 0)
    batch.rollout_logp = torch.tensor([[-1.0, -1.0], [-3.0, -3.0]])
    batch.extra["replayed"] = torch.tensor([0.0, 1.0])
    judged = Judged(batch, [{}, {}], ["", ""], torch.zeros(2))
    alone = SamplingTemperature(1.0, target=2.0, low=0.5, high=2.0)
    out = AdaptiveTemperature(alone, lambda t, op: t)(judged, None)
    assert out.metrics == {"temperature": 1.0, "entropy": 1.0}
    assert alone.value == adapted_temperature(1.0, 1.0, 2.0, 0.5, 2.0) == math.exp(0.1 * 0.5)
    other = SamplingTemperature(1.0, target=2.0, low=0.5, high=2.0)
    out = AdaptiveTemperature(other, lambda t, op: t + torch.tensor([4.0, 2.0]))(judged, None)
    assert out.metrics["entropy"] == 1.5


def test_the_first_step_sets_a_missing_target_and_the_next_draw_uses_the_new_tau(monkeypatch):
    """No rollout.target_entropy: the first step's entropy (0.5, the fake's log-probs) is the target, so τ holds;
    with a target above it, τ rises, and the next round is drawn at it."""
    fake_ids(monkeypatch)
    sampling = RolloutConfig(adaptive_temperature=True)
    held = SamplingTemperature(1.0, low=0.5, high=2.0)
    Online(deps(["mixed"] * 2, batch_size=1, sampling=sampling, temperature=held)).next()
    assert held.target == 0.5 and held.value == 1.0
    rollout, rising = Rollout(), SamplingTemperature(1.0, target=1.0, low=0.5, high=2.0)
    source = Online(deps(["mixed"] * 2, batch_size=1, sampling=sampling, temperature=rising, rollout=rollout))
    source.next()
    after_one = rising.value
    source.next()
    assert rollout.temperatures == [1.0, after_one] and after_one == math.exp(0.1 * 0.5) and rising.value > after_one


def test_the_controller_round_trips():
    a = SamplingTemperature(1.0, low=0.5, high=2.0)
    a.observe(0.7)
    a.observe(0.4)
    b = SamplingTemperature(1.0, low=0.5, high=2.0)
    b.load_state_dict(a.state_dict())
    assert (b.value, b.target) == (a.value, a.target) == (a.value, 0.7) and a.value != 1.0
