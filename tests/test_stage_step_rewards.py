"""The step-reward stage (stages/step_rewards.py): on for a plugin that trains on step rewards, it scores the kept
samples' steps once and puts them on their tokens; its refusals. The token positions themselves are tested in
test_process_supervision.py."""

import pytest
import torch
from fake_online import deps, fake_ids

from posttrain import config
from posttrain.core.errors import ConfigError
from posttrain.schema import RolloutConfig
from posttrain.sources.online import Online
from posttrain.stages import step_rewards
from posttrain.stages.step_rewards import StepRewards


def test_scores_the_kept_samples_only(monkeypatch):
    """Under dynamic sampling two rounds are drawn, but only the kept batch's samples are scored by step."""
    fake_ids(monkeypatch)
    scored = []
    monkeypatch.setattr(step_rewards, "step_tensors", lambda tok, batch, texts, steps: (
        scored.append(len(steps)) or torch.full(batch.mask.shape, 0.5), batch.mask.clone()))
    sampling = RolloutConfig(dynamic_sampling=True, max_sampling_rounds=2)
    source = Online(deps(["solved", "mixed"], batch_size=1, sampling=sampling, needs=frozenset({"step_reward"})))
    batch, stats = source.next()
    assert scored == [2] and stats["sampling_rounds"] == 2
    assert batch.extra["step_reward"].eq(0.5).all() and torch.equal(batch.extra["step_end"], batch.mask)


def test_off_unless_the_plugin_asks():
    assert not StepRewards.on(None, frozenset()) and StepRewards.on(None, frozenset({"step_reward"}))
    assert StepRewards.key not in deps(["mixed"]).stages
    assert isinstance(StepRewards.build(deps(["mixed"], needs=frozenset({"step_reward"}))), StepRewards)


@pytest.mark.parametrize("overrides, message", [
    (["algorithm.name=grpo_ps"], "rewards.process: grpo_ps trains on step rewards"),
    (["algorithm.name=grpo_ps", "rewards={accuracy: 1.0, process: model}"],
     "reward_model.process_path: rewards.process=model needs"),
])
def test_refusals(overrides, message):
    with pytest.raises(ConfigError, match=message):
        config.load("grpo_math", overrides)
