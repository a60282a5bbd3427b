"""Data sources: where each step's batch comes from. A plugin names one (`Algorithm.source`); the engine builds it.

- ``offline``: rows of (prompt, response) from a file, a `datasets` object or the embedded task (SFT).
- ``online``: G samples of the current policy per prompt, judged, every step (GRPO, PPO, Online RFT).
- ``samples_once``: k samples of the starting model per prompt, generated once (and cached), kept where the judge
  says correct (RFT).
- ``pairs``: a correct and an incorrect response to one prompt, from a preference file or judged from the starting
  model's samples; reference log-probs are computed once per pair here and reused every step (DPO).

A source is built from `Deps`, the explicit list of what sources may use, by its `from_deps`; each takes only what it
reads. `next()` returns (batch on the CPU, metrics of the step's data). Two class attributes tell the engine what it
needs to know: `on_policy` (the batch holds samples of the current policy, so log-probs are scored at the sampling
temperature) and `scores_reference` (the source computed the reference log-probs itself, so the engine frees the
reference model once the source is built). `row_fields` names the fields of a data row the source reads, and
`judges_rows` whether the judge checks the training rows' reference answers; `run_splits` checks both on every row
before training starts.
"""

from __future__ import annotations

import functools

from posttrain.config import algorithm_of
from posttrain.data import load_splits
from posttrain.rewards.accuracy import reference_problem
from posttrain.schema import RunConfig
from posttrain.sources import offline, online, pairs, samples  # noqa: F401  (the built-in sources register)
from posttrain.sources.base import SOURCES, Deps, Source

__all__ = ["SOURCES", "Deps", "Source", "run_splits"]


def run_splits(cfg: RunConfig, given: dict | None = None) -> tuple[list[dict], list[dict]]:
    """A run's training and held-out rows, every row checked before any work: the fields its method's source reads,
    and each reference answer the judge will check (every held-out row's; the training rows' when the source judges
    them) against the accuracy rule's own reading of it (`reference_problem`), so the run never meets one it cannot
    score. `given`: rows given from Python for data.path and data.test_path (`load_splits`)."""
    source = SOURCES.find(algorithm_of(cfg).source)
    reference = functools.partial(reference_problem, answer_format=cfg.data.answer_format)
    fields = source.row_fields(cfg.data)
    if cfg.model.path is None and cfg.data.gym_task is not None:  # the embedded model warms up on these rows' answers
        fields = [*fields, cfg.data.response_field]
    return load_splits(cfg.data, fields, cfg.eval.num_problems, reference, judged=source.judges_rows(cfg), given=given)
