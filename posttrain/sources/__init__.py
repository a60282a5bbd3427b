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
reference model once the source is built). `row_fields` names the fields of a data row the source reads, checked on
every row before training starts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from posttrain.config import algorithm_of
from posttrain.core.batch import Batch
from posttrain.data import RowSampler, load_splits
from posttrain.judge import Judge
from posttrain.rollout import RolloutEngine
from posttrain.schema import DataConfig, RolloutConfig, RunConfig


@dataclass(frozen=True)
class Deps:
    """Everything a data source may depend on. The engine fills it in; it holds no reference to the engine."""

    rows: list[dict]  # training rows (all of them; `sampler` draws this process's shard)
    sampler: RowSampler  # seeded draws of this process's shard of `rows`
    tokenizer: Any
    data: DataConfig
    batch_size: int  # prompts or rows per step, per process
    micro_batch_size: int  # sequences per forward
    seed: int
    algorithm: Any  # the plugin's config
    samples_per_prompt: int  # the plugin's n for online sampling
    rollout: RolloutEngine  # samples from the current policy
    sampling: RolloutConfig  # temperature, top_p, max_new_tokens
    judge: Judge
    score_reference: Callable[[Batch], torch.Tensor] | None  # [B, R] log π_ref of a batch (None: no reference)
    model_path: Path  # the starting model's directory (keys the cache of its samples)
    cache_dir: Path
    rank: int
    world: int


from posttrain.sources.offline import Offline  # noqa: E402
from posttrain.sources.online import Online  # noqa: E402
from posttrain.sources.pairs import Pairs  # noqa: E402
from posttrain.sources.samples import SamplesOnce  # noqa: E402

SOURCES = {"offline": Offline, "online": Online, "samples_once": SamplesOnce, "pairs": Pairs}


def run_splits(cfg: RunConfig) -> tuple[list[dict], list[dict]]:
    """A run's training and held-out rows, with the fields its method's source reads checked on every row."""
    fields = SOURCES[algorithm_of(cfg).source].row_fields(cfg.data)
    return load_splits(cfg.data, fields, cfg.eval.num_problems)
