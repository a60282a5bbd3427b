"""The plugin interface (`Algorithm`) and the registry of methods; `posttrain.algorithms` re-exports them."""

from __future__ import annotations

from typing import Any

import torch

from posttrain.core.registry import Registry

REGISTRY = Registry("algorithm", "algorithm.name")  # name -> plugin class


class Algorithm:
    """Defaults shared by every plugin. Subclasses set `Config` and override what differs.

    Attributes:
        name: the registry name, set by `register`.
        Config: dataclass of the method's own hyperparameters (the recipe's `algorithm` group, less `name`).
        source: where batches come from (`posttrain.sources`): "offline" (rows of prompt and response), "online"
            (samples of the current policy each step), "samples_once" (samples of the starting model, generated once
            and kept where correct), "pairs" (a correct and an incorrect response per prompt, from a file or samples).
        unit: rows that must stay together in one micro-batch (2 for a preference pair).
        learned_reward: the method is usually run with a learned reward model (PPO, as in InstructGPT); only
            `posttrain estimate` reads it, to count one by default.
        kl_penalty: the config's `beta` weighs a KL penalty to the reference, which `train.beta_schedule` may vary
            step by step (DPO's β is a temperature of its loss, not such a weight).
    """

    name: str = ""
    Config: type = object
    source: str = "offline"
    unit: int = 1
    learned_reward: bool = False
    kl_penalty: bool = False

    @staticmethod
    def needs(cfg: Any) -> frozenset[str]:
        """What the engine must provide: any of "reward", "old_logp", "ref_logp", "values" (loads a critic),
        "step_reward" (the judge's step rewards in `batch.extra`; needs `rewards.process`)."""
        return frozenset()

    @staticmethod
    def samples_per_prompt(cfg: Any) -> int:
        """Completions sampled per prompt by an online source."""
        return 1

    @staticmethod
    def epochs(cfg: Any) -> int:
        """Optimizer steps taken on each batch (μ in the paper)."""
        return 1

    @staticmethod
    def minibatches(cfg: Any) -> int:
        """Optimizer steps per epoch: the batch is split into this many minibatches."""
        return 1

    @staticmethod
    def aggregation(cfg: Any) -> tuple[str, float] | None:
        """(mode, norm) when the method fixes how tokens are aggregated; None uses `train.loss_agg`."""
        return None

    @staticmethod
    def prepare(batch: Any, cfg: Any) -> tuple[Any, dict[str, torch.Tensor]]:
        """Per-batch work before it is split into micro-batches (e.g. group advantages). Returns (batch, metrics)."""
        return batch, {}

    @staticmethod
    def coefficient(batch: Any, logp: torch.Tensor, cfg: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """GC for every response token of a micro-batch, from detached tensors. Returns (gc [B, R], metrics)."""
        raise NotImplementedError

    @staticmethod
    def critic_loss(batch: Any, values: torch.Tensor, cfg: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Per-token critic loss [B, R] from the critic's current values, for methods that need "values"."""
        raise NotImplementedError


register, get = REGISTRY.register, REGISTRY.find
