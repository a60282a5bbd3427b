"""The rollout engine interface and the registry of engines; `posttrain.rollout` re-exports them."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

import torch

from posttrain.core.batch import Batch
from posttrain.core.errors import ConfigError


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


ENGINES: dict[str, type[RolloutEngine]] = {}


def register(name: str):
    """Class decorator adding a rollout engine under `name`; a second engine with the same name is an error."""

    def add(cls: type[RolloutEngine]) -> type[RolloutEngine]:
        if name in ENGINES:
            raise ValueError(f"rollout engine {name!r} is registered twice")
        cls.name = name
        ENGINES[name] = cls
        return cls

    return add


def get(name: str) -> type[RolloutEngine]:
    """The engine registered as `name`; an unknown name is a ConfigError listing the known ones."""
    if name not in ENGINES:
        near = difflib.get_close_matches(str(name), ENGINES, n=1)
        hint = f"did you mean {near[0]!r}? " if near else ""
        raise ConfigError(f"rollout.engine: unknown rollout engine {name!r}; {hint}known: {', '.join(ENGINES)}")
    return ENGINES[name]
