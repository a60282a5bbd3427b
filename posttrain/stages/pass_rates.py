"""The pass-rate stage: each round's verdicts update every prompt's running pass rate (`posttrain.data.difficulty`),
which per-difficulty group sizes (`rollout.adaptive_group_size`) and the pass-rate curriculum
(`data.curriculum=pass_rate`) read. On whenever one of them is; the pass rates are a controller the run owns and
checkpoints.

Metrics: `pass_rate`, the share of the round's samples the judge found correct.
"""

from __future__ import annotations

from posttrain.data.difficulty import tracks_pass_rates
from posttrain.stages.base import Judged, Stage


class PassRateUpdates(Stage):
    key = "rollout.adaptive_group_size | data.curriculum=pass_rate"

    def __init__(self, pass_rates, correct):
        self.pass_rates, self.correct = pass_rates, correct  # PassRates; (rows, texts) -> list[bool], the judge's

    @staticmethod
    def on(cfg, needs) -> bool:
        return tracks_pass_rates(cfg)

    @classmethod
    def build(cls, deps) -> PassRateUpdates:
        return cls(deps.pass_rates, deps.judge.correct)

    def __call__(self, judged: Judged, more) -> Judged:
        correct = self.correct(judged.rows, judged.texts)
        self.pass_rates.observe(judged.rows, correct)
        return judged.replace(metrics={**judged.metrics, "pass_rate": sum(correct) / len(correct)})
