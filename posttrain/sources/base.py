"""The data source interface (`Source`), its dependencies (`Deps`) and the registry of sources (`SOURCES`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from posttrain.core.batch import Batch
from posttrain.core.registry import Registry
from posttrain.core.schedules import SamplingTemperature
from posttrain.data import RowSampler
from posttrain.data.difficulty import PassRates
from posttrain.judge import Judge
from posttrain.rollout import RolloutEngine
from posttrain.schema import DataConfig, RewardsConfig, RolloutConfig, RunConfig
from posttrain.stages import ElitePool


@dataclass(frozen=True)
class Deps:
    """Everything a data source may depend on. The engine fills it in; it holds no reference to the engine."""

    sampler: RowSampler  # seeded draws of this process's shard of the training rows (`sampler.rows`)
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
    agree: Callable[[bool], bool] | None = None  # True when a flag is true on every process (a collective call where
    # weights are sharded, so that every process samples as many rounds); None: this process's flag
    rewards: RewardsConfig | None = None  # the rewards.* keys the source applies itself (the overlong punishment)
    needs: frozenset[str] = frozenset()  # what the plugin asked the engine for (`Algorithm.needs`): a source reads
    # the ones it provides ("step_reward": the judge's step rewards in the batch), never which method runs
    # The run's controllers a source reads or updates (the run owns and checkpoints them):
    pass_rates: PassRates | None = None  # each prompt's running pass rate, kept up to date by the online source
    temperature: SamplingTemperature | None = None  # the sampling temperature, adapted by its stage if asked
    elite: ElitePool | None = None  # the elite replay pool (rollout.elite_pool)
    reduce: Callable[[torch.Tensor, str], torch.Tensor] | None = None  # a sum/mean/max over every process
    group_sizes: Callable[[list[dict]], tuple[int | list[int], dict]] | None = None  # rows -> (samples per prompt,
    # metrics): FixedGroups or AdaptiveGroups (posttrain.data.difficulty)
    episodes: Any = None  # with env.name, the Episodes (sources/episodes.py) that sample multi-turn episodes on
    # `rollout`; None: single completions
    stages: tuple[str, ...] = ()  # the online pipeline's stages the plan switches on, by key (posttrain.stages)


class Source:
    """Where each step's batch comes from. Subclasses implement `from_deps` and `next`.

    A source keeps no state of its own across steps: what changes as the run goes (the row draws, pass rates, the
    elite pool, the sampling temperature) lives in controllers the run owns and checkpoints, handed over in `Deps`.
    What a source builds at the start (RFT's samples, DPO's pairs and reference log-probs) is built again, the same,
    when a resumed run starts.

    Attributes:
        on_policy: the batch holds samples of the current policy (log-probs are scored at the sampling temperature).
        scores_reference: the source computes the reference log-probs itself (the engine then frees the reference).
    """

    name: str = ""
    on_policy: bool = False
    scores_reference: bool = False

    @staticmethod
    def row_fields(data: DataConfig) -> list[str]:
        """The fields of a data row the source reads, checked on every row before training starts."""
        return [data.prompt_field, data.answer_field]

    @staticmethod
    def judges_rows(cfg: RunConfig) -> bool:
        """Whether the judge's accuracy rule reads the reference answers of the training rows (as a reward or a
        verdict), so that every row's answer is checked before training starts to hold one it can compare with."""
        return False

    @classmethod
    def from_deps(cls, deps: Deps) -> Source:
        """The source, taking from `deps` only what it uses."""
        raise NotImplementedError

    def next(self) -> tuple[Batch, dict]:
        """The step's batch (on the CPU) and metrics of its data."""
        raise NotImplementedError


SOURCES = Registry("data source", "algorithm.source")  # name -> Source subclass; a plugin's `source` names one
register = SOURCES.register
