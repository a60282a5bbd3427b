"""Fakes for the online source and its stages: rows handed out in order, a rollout engine whose samples are known in
advance, and a judge whose rewards a prompt's kind decides. `deps` builds the source's real `Deps` from them."""

from __future__ import annotations

from pathlib import Path

import torch

from posttrain.core.batch import collate
from posttrain.core.schedules import SamplingTemperature
from posttrain.schema import RolloutConfig
from posttrain.sources import Deps

PAD = 0
# A prompt's kind decides its samples' rewards: "mixed" alternates 1, 0, ... (the group differs), "solved" all 1,
# "failed" all 0 (the group is equal). Its id is in its prompt tokens and its samples' responses, of varied length.
REWARDS = {"mixed": lambda j: float(j % 2 == 0), "solved": lambda j: 1.0, "failed": lambda j: 0.0}


class Queue:
    """A row sampler that hands out rows in a fixed order."""

    def __init__(self, rows):
        self.rows = list(rows)

    def next(self, k):
        out, self.rows = self.rows[:k], self.rows[k:]
        return out


class Rollout:
    """Prompt i (tokens [id] * (id % 3 + 1)) gets n samples [id, j + 1, ...] of length j + 1, log-prob −0.5 each."""

    version = 0

    def __init__(self):
        self.temperatures = []  # the τ of each call

    def generate(self, prompts, n, *, temperature=1.0, **_):
        self.temperatures.append(temperature)
        sizes = n if isinstance(n, list) else [n] * len(prompts)
        responses = [[p[0]] + [j + 1] * j for p, k in zip(prompts, sizes) for j in range(k)]
        batch = collate([p for p, k in zip(prompts, sizes) for _ in range(k)], responses, PAD)
        batch.group = torch.arange(len(prompts)).repeat_interleave(torch.tensor(sizes))
        batch.truncated = torch.zeros(len(batch), dtype=torch.bool)
        batch.rollout_logp = -batch.mask * 0.5
        return batch


class Judge:
    def score(self, rows, completions, group=None):
        n = len(rows) // len({r["id"] for r in rows})
        total = [REWARDS[r["kind"]](i % n) for i, r in enumerate(rows)]
        return torch.tensor(total), {"reward": sum(total) / len(total), "reward/errors": 1.0}

    def correct(self, rows, completions):
        n = len(rows) // len({r["id"] for r in rows})
        return [REWARDS[r["kind"]](i % n) == 1.0 for i, r in enumerate(rows)]

    def score_steps(self, rows, completions):
        return [[(0, 1.0)] for _ in rows]


class Tokenizer:
    pad_token_id = PAD


def fake_ids(monkeypatch):
    """Prompt ids and completion texts without a tokenizer (the fake rollout's prompts carry the row's id)."""
    from posttrain.sources import online
    from posttrain.stages import elite

    monkeypatch.setattr(online, "prompt_ids", lambda tok, rows, data: [[r["id"]] * (r["id"] % 3 + 1) for r in rows])
    monkeypatch.setattr(online, "completion_texts", lambda tok, batch: [""] * len(batch))
    monkeypatch.setattr(elite, "completion_texts", lambda tok, batch: ["replayed"] * len(batch))


def deps(kinds, *, batch_size=3, n=2, sampling=None, rollout=None, **more) -> Deps:
    """The source's dependencies over rows of `kinds` (ids 1, 2, ...), with the fakes above; `more` sets any other
    field of Deps (rewards, needs, pass_rates, elite, group_sizes, agree, reduce, temperature)."""
    sampling = sampling or RolloutConfig()
    rows = [{"id": i + 1, "kind": k, "question": str(i + 1)} for i, k in enumerate(kinds)]
    fields = {"temperature": SamplingTemperature(sampling.temperature), "reduce": lambda t, op: t, **more}
    fields.setdefault("stages", stages_on(sampling, **more))
    return Deps(sampler=Queue(rows), tokenizer=Tokenizer(), data=None, batch_size=batch_size, micro_batch_size=8,
                seed=0, algorithm=None, samples_per_prompt=n, rollout=rollout or Rollout(), sampling=sampling,
                judge=Judge(), score_reference=None, model_path=Path("."), cache_dir=Path("."), **fields)


def stages_on(sampling, *, rewards=None, needs=frozenset(), pass_rates=None, **_) -> tuple[str, ...]:
    """The stages a run's plan switches on for these dependencies, by each stage's own rule (`Stage.on`): pass rates
    given stand for a key that keeps them (the pass-rate curriculum)."""
    from types import SimpleNamespace

    from posttrain.schema import RewardsConfig
    from posttrain.stages import STAGES

    cfg = SimpleNamespace(rollout=sampling, rewards=rewards or RewardsConfig(),
                          data=SimpleNamespace(curriculum="pass_rate" if pass_rates is not None else "none"))
    return tuple(s.key for s in STAGES if s.on(cfg, needs))
