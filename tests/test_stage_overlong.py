"""The overlong penalty stage (stages/overlong.py, rewards.overlong_buffer): DAPO's Eq. 13 by hand, on the rewards a
step trains on, and its settings."""

import pytest
import torch
from fake_online import deps, fake_ids

from posttrain.rewards.overlong import overlong_penalty
from posttrain.schema import RewardsConfig, RolloutConfig
from posttrain.sources.online import Online


def test_overlong_penalty_hand_worked():
    """Budget 10, buffer 4: the punishment starts after 6 tokens; 7 tokens lose 1/4, 9 lose 3/4, 10 (ended on its
    last token) lose all; a truncated completion loses all whatever its length."""
    lengths = torch.tensor([3, 6, 7, 9, 10, 10])
    truncated = torch.tensor([False, False, False, False, False, True])
    got = overlong_penalty(lengths, truncated, budget=10, buffer=4)
    assert got.tolist() == [0.0, 0.0, -0.25, -0.75, -1.0, -1.0]


def test_overlong_penalty_is_added_to_the_rewards(monkeypatch):
    """Responses of 1 and 2 tokens (the fake rollout's) in a budget of 2 with a buffer of 2: the punishment starts
    at 0 tokens, so 1 token loses half the weight 0.4 and 2 tokens all of it: rewards 1 − 0.2 and 0 − 0.4."""
    fake_ids(monkeypatch)
    source = Online(deps(["mixed"], batch_size=1, sampling=RolloutConfig(max_new_tokens=2),
                         rewards=RewardsConfig(overlong_buffer=2, overlong_penalty=0.4)))
    batch, stats = source.next()
    assert batch.reward.tolist() == pytest.approx([0.8, -0.4])
    assert stats["reward/overlong"] == pytest.approx(-0.3) and stats["reward"] == pytest.approx(0.2)


def test_overlong_settings_are_checked():
    from posttrain import config
    from posttrain.core.errors import ConfigError

    cfg, resolved = config.load("grpo_math", ["rewards.overlong_buffer=8"])
    assert cfg.rewards.overlong_buffer == 8 and resolved["rewards"]["overlong_buffer"] == 8
    with pytest.raises(ConfigError, match=r"rewards.overlong_buffer: 99 is more than the budget it is the end of "
                                          r"\(rollout.max_new_tokens=24\)"):
        config.load("grpo_math", ["rewards.overlong_buffer=99"])
    with pytest.raises(ConfigError, match="rewards.overlong_penalty: must be ≥ 0"):
        config.load("grpo_math", ["rewards.overlong_penalty=-1"])


def test_overlong_punishment_needs_online_samples():
    from posttrain import config
    from posttrain.core.errors import ConfigError

    with pytest.raises(ConfigError, match="rewards.overlong_buffer: the overlong punishment shapes the rewards"):
        config.load("sft_math", ["rewards.overlong_buffer=2"])
