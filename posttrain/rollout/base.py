"""The rollout engine interface and the registry of engines; `posttrain.rollout` re-exports them."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from posttrain.core.batch import Batch
from posttrain.core.registry import Registry


class RolloutEngine:
    """The interface. Subclasses implement all four methods."""

    name: str = ""

    def generate(self, prompts: list[list[int]], n: int, *, max_new_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0, greedy: bool = False) -> Batch:
        """`n` completions of each prompt; rows i·n … i·n + n − 1 answer prompt i. `greedy` ignores the sampling
        settings and decodes the most likely token each step."""
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


ENGINES = Registry("rollout engine", "rollout.engine")  # name -> RolloutEngine subclass


register, get = ENGINES.register, ENGINES.find
