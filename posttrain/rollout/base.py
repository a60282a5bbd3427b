"""The rollout engine interface and the registry of engines; `posttrain.rollout` re-exports them."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from posttrain.core.batch import Batch
from posttrain.core.registry import Registry
from posttrain.schema import RolloutConfig


@dataclass(frozen=True)
class Setup:
    """What a run hands its rollout engine to start from; each engine takes what it needs."""

    policy: torch.nn.Module  # the trainer's policy, unwrapped: a colocated engine samples from it directly
    model_path: Path  # the starting policy's directory: an engine with its own copy of the weights loads it
    pad_id: int
    stop_ids: list[int]  # every token id that ends a completion
    sampling: RolloutConfig  # the rollout.* keys
    precision: str  # train.precision
    seed: int
    max_seqs: int  # the most sequences one call samples (a step's prompts × samples per prompt)
    agree: Callable[[bool], bool] | None = None  # sharded weights: True when a flag is true on every process


class RolloutEngine:
    """The interface. Subclasses implement `start` and the four methods after it.

    `generate` also reports, in `Batch.rollout_logp`, each sampled token's log-probability under the distribution it
    was drawn from (softmax(logits / τ), renormalised to the top-p nucleus); greedy batches report log softmax(logits).
    The engine compares them with the trainer's to measure the train-inference mismatch.
    """

    name: str = ""
    colocated: bool = False
    """True when the engine samples from the trainer's own module, so an update needs no weight sync."""
    takes_adapter: bool = False
    """True when, under LoRA, the engine holds the adapted model and takes the trained adapter alone."""
    collective: bool = False
    """True when sampling runs sharded weights, so every process must make the same `generate` calls."""
    stops: bool = False
    """True when `generate` takes `stop` sequences, which multi-turn environments need (posttrain.environments)."""
    version: int = 0
    """The policy version it samples with: the training steps done when its weights were last synced."""

    @classmethod
    def check(cls) -> None:
        """Raises ConfigError when this engine cannot run here (its library is missing); cheap, imports nothing."""

    @classmethod
    def start(cls, setup: Setup) -> RolloutEngine:
        """The engine for a run."""
        raise NotImplementedError

    def generate(self, prompts: list[list[int]], n: int | list[int], *, max_new_tokens: int,
                 temperature: float = 1.0, top_p: float = 1.0, greedy: bool = False,
                 stop: list[list[int]] | None = None) -> Batch:
        """`n` completions of each prompt (or n[i] of prompt i), prompt by prompt: with n an int, rows i·n … i·n + n − 1
        answer prompt i; `Batch.group` says which prompt each row answers. `greedy` ignores the sampling settings and
        decodes the most likely token each step. `stop`: token-id sequences that also end a completion, kept in it
        (an environment's end of a tool call); only engines with `stops` set take them."""
        raise NotImplementedError

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Takes the policy's (name, tensor) pairs after an update, in order; returns the bytes copied."""
        raise NotImplementedError

    def release(self) -> None:
        """Frees what the engine holds on the device between rollouts, before the update runs."""
        raise NotImplementedError

    def restore(self) -> None:
        """Takes back what `release` freed, before the next rollout."""
        raise NotImplementedError


class Workers(RolloutEngine):
    """What rollout workers apart from the trainer (`rollout.placement=separate`) add to the interface, and all that
    callers may use of them beyond it: the pool on one process (posttrain.rollout.workers) and the pool several
    training processes share (posttrain.rollout.shared) both implement it. Restarts, placement and weight staging
    stay inside."""

    def score_frozen(self, batch: Batch) -> dict[str, torch.Tensor]:
        """The log-probs of `batch`'s response tokens under the frozen models the workers hold
        (rollout.reference_on=workers), by the batch field each fills: "ref_logp" (the reference), "teacher_logp"
        (the distillation teacher); [B, R] each."""
        raise NotImplementedError

    def take_idle(self) -> float:
        """Seconds the workers waited for work since the last call (a step's `time/worker_idle`)."""
        raise NotImplementedError

    restarts: int = 0
    """Workers restarted so far after dying."""

    def report(self) -> dict:
        """What the run records of the workers that really ran (summary.json's `rollout_workers`): their count,
        process ids and attention, the sampling requests made, the restarts."""
        raise NotImplementedError

    def state_dict(self) -> dict:
        """What a checkpoint keeps of them (their generators' streams), so that a resumed run samples the same."""
        raise NotImplementedError

    def load_state_dict(self, state: dict) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Stops the worker processes."""
        raise NotImplementedError


def counts(n: int | list[int], prompts: int) -> list[int]:
    """Completions per prompt: `n` for each of `prompts`, or the list n itself."""
    if isinstance(n, int):
        return [n] * prompts
    if len(n) != prompts:
        raise ValueError(f"generate: {len(n)} group sizes for {prompts} prompts")
    return list(n)


ENGINES = Registry("rollout engine", "rollout.engine")  # name -> RolloutEngine subclass


register, get = ENGINES.register, ENGINES.find
