"""The pass-rate stage (stages/pass_rates.py): every round's verdicts, the filtered-out ones too, update the pass rates
that per-difficulty group sizes and the pass-rate curriculum read; on only when one of them is."""

import pytest
from fake_online import deps, fake_ids

from posttrain import config
from posttrain.data.difficulty import PassRates
from posttrain.schema import RolloutConfig
from posttrain.sources.online import Online
from posttrain.stages.pass_rates import PassRateUpdates
from posttrain.train.controllers import build_controllers


@pytest.fixture(autouse=True)
def no_tokenizer(monkeypatch):
    fake_ids(monkeypatch)


def test_every_round_updates_the_pass_rates():
    """Dynamic sampling draws two rounds (solved, failed, then mixed): the equal groups it drops were judged too, and
    the step's pass_rate is the mean of the rounds' shares (1/2 and 1/2)."""
    rates = PassRates("question")
    sampling = RolloutConfig(dynamic_sampling=True, max_sampling_rounds=2)
    source = Online(deps(["solved", "failed", "mixed", "mixed"], batch_size=2, sampling=sampling, pass_rates=rates))
    _, stats = source.next()
    assert rates.rates == {"1": 1.0, "2": 0.0, "3": 0.5, "4": 0.5}
    assert stats["pass_rate"] == 0.5 and stats["sampling_rounds"] == 2


def test_on_with_a_consumer_of_pass_rates_only():
    """The run makes the pass rates (the controller) only for adaptive group sizes or the pass-rate curriculum; the
    stage follows the controller."""
    assert isinstance(PassRateUpdates.build(deps(["mixed"], pass_rates=PassRates("question"))), PassRateUpdates)
    for overrides, on in ((["rollout.adaptive_group_size=true", "algorithm.group_size=6"], True),
                          (["data.curriculum=pass_rate"], True), ([], False)):
        cfg, _ = config.load("grpo_math", overrides)
        rows = [{"question": "1+1", "answer": "2"}]
        assert (build_controllers(cfg, rows, 0, 1, 0).pass_rates is not None) is on
        assert PassRateUpdates.on(cfg, frozenset()) is on
