"""The online source (sources/online.py): a round is a rollout record, and the pipeline of stages (posttrain.stages)
runs the stages the config switches on, in order, each round through the stages before the one that asks for it."""

import pytest
import torch
from fake_online import Rollout, deps, fake_ids

from posttrain.core.schedules import SamplingTemperature
from posttrain.data.difficulty import AdaptiveGroups, PassRates
from posttrain.schema import RewardsConfig, RolloutConfig
from posttrain.sources.online import Online
from posttrain.stages import STAGES, Judged, Pipeline, Stage
from posttrain.stages.elite import ElitePool


@pytest.fixture(autouse=True)
def no_tokenizer(monkeypatch):
    fake_ids(monkeypatch)


def test_off_takes_one_round_as_it_comes():
    source = Online(deps(["solved", "failed", "mixed"]))
    batch, stats = source.next()
    assert source.pipeline.stages == []  # no key on, no stage
    assert len(batch) == 6 and batch.group.tolist() == [0, 0, 1, 1, 2, 2] and "sampling_rounds" not in stats
    assert batch.reward.tolist() == [1, 1, 0, 0, 1, 0] and stats["response_len"] == 1.5


def test_a_round_is_a_rollout_record():
    """The ids as sampled, the sampler's log-probs, the policy version of the weights that sampled each row, and the
    temperature the controller gave, at which the rollout engine was called."""
    rollout = Rollout()
    rollout.version = 7
    source = Online(deps(["mixed", "solved"], batch_size=2, rollout=rollout,
                         temperature=SamplingTemperature(0.8)))
    batch, _ = source.next()
    assert batch.version.tolist() == [7] * 4 and batch.temperature == 0.8 and rollout.temperatures == [0.8]
    assert batch.rollout_logp.sum() == -0.5 * batch.mask.sum() and batch.model_tokens is None


class Tag(Stage):
    """A toy stage: appends its name to every round it sees; `rounds` > 1 asks for that many rounds in all."""

    def __init__(self, name, seen, rounds=1):
        self.name, self.seen, self.rounds = name, seen, rounds

    def __call__(self, judged, more):
        self.seen.append(self.name)
        for _ in range(self.rounds - 1):
            more()
        return judged.replace(metrics={**judged.metrics, self.name: 1.0})


def test_more_passes_a_round_through_the_stages_before_the_asking_one():
    """Stage b asks for two more rounds: each goes through a only; c sees the one batch b returns."""
    seen, draws = [], []

    def draw():
        draws.append(1)
        return Judged(batch=None, rows=[], texts=[], outcome=torch.zeros(0))

    out = Pipeline(draw, [Tag("a", seen), Tag("b", seen, rounds=3), Tag("c", seen)])()
    assert seen == ["a", "b", "a", "a", "c"] and len(draws) == 3 and set(out.metrics) == {"a", "b", "c"}


def test_every_stage_on_takes_effect(monkeypatch):
    """All six stages switched on through Deps, over two passes of the same prompts: each leaves its mark, so leaving
    one out of `STAGES` fails here."""
    from posttrain.stages import step_rewards

    monkeypatch.setattr(step_rewards, "step_tensors", lambda tok, batch, texts, steps: (
        torch.ones(batch.mask.shape), batch.mask.clone()))
    sampling = RolloutConfig(max_new_tokens=2, dynamic_sampling=True, max_sampling_rounds=2,
                             adaptive_temperature=True, elite_pool=4)
    rates, pool = PassRates("question"), ElitePool(4, 0)
    temperature = SamplingTemperature(1.0, target=1.0, low=0.5, high=2.0)  # samples of entropy 0.5: τ rises
    kinds = ["mixed", "solved", "failed", "mixed"] * 4
    source = Online(deps(kinds, batch_size=2, sampling=sampling, rewards=RewardsConfig(overlong_buffer=2),
                         needs=frozenset({"step_reward"}), pass_rates=rates, temperature=temperature, elite=pool))
    assert [type(s) for s in source.pipeline.stages] == STAGES
    batch, stats = source.next()
    assert stats["sampling_rounds"] == 2  # dynamic sampling: the first round held one group that differs
    assert rates.rates and "pass_rate" in stats  # pass rates: every round's verdicts
    assert stats["reward/overlong"] < 0 and batch.reward.min() < 0  # the penalty is in the rewards trained on
    assert len(pool) == 2 and "elite/replayed" in stats  # the pool took each kept group's best
    assert batch.extra["step_end"].sum() == batch.mask.sum()  # step rewards on the kept samples
    assert stats["temperature"] == 1.0 and stats["entropy"] == 0.5 and temperature.value > 1.0


def test_group_sizes_come_from_the_controller():
    """Per-difficulty group sizes: the sizer's per-prompt n reaches the rollout engine, and its metrics the step.
    Prompt 1 is solved (G 2), prompt 2 unseen (G 4): scaled to the budget of 8, 2.67 and 5.33, rounded to 3 and 5."""
    rates = PassRates("question")
    rates.observe([{"question": "1"}], [True])  # prompt 1 solved: the smallest group
    source = Online(deps(["mixed", "mixed"], batch_size=2, n=4, group_sizes=AdaptiveGroups(rates, 4, 2, 6, 0.9)))
    batch, stats = source.next()
    assert batch.group.tolist() == [0, 0, 0, 1, 1, 1, 1, 1] and stats["group_size/min"] == 3.0
