"""The plugin interface (`Algorithm`) and the registry of methods; `posttrain.algorithms` re-exports them."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from posttrain.core.errors import ConfigError
from posttrain.core.registry import Registry

REGISTRY = Registry("algorithm", "algorithm.name")  # name -> plugin class
BY_CONFIG: dict[type, type[Algorithm]] = {}  # Config class -> plugin: a validated config names its method


class Algorithm:
    """Defaults shared by every plugin. Subclasses set `Config` and override what differs.

    What is logged: the engine's `loss` is the surrogate −aggregate(stopgrad(GC) · log πθ), whose gradient is the
    method's but whose value means nothing. Beside it the engine logs `objective`, the value of what the method
    minimises: the plugin's `objective` per token, aggregated exactly as the loss (same mode, same whole-step
    denominators). Its sign is the loss's: a method the paper writes as maximising J logs −J (the clipped surrogate
    with its KL term, negated), DPO its loss, SFT and RFT their negative log-likelihood. Where the surrogate's
    gradient is the method's, ∇ objective = ∇ loss; `tests/test_objective.py` checks it for every registered method,
    at ρ = 1 and off it. The engine's importance weights (`rollout.tis_cap`, the elite pool's) multiply GC but are
    not part of `objective`.

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
        clips_ratio: the method's GC clips a ratio π_θ / π_old (PPO's, GRPO's, GSPO's), so that π_old may be the
            sampler's own log-probs (`rollout.proximal=sampler`).
        reward_threshold: the config key of a fixed threshold the method compares each reward with (Online RFT's
            `threshold`), or None where only the rewards' differences matter. A z-scored reward
            (`rewards.normalize`) has no fixed scale, so such a method refuses it.
    """

    name: str = ""
    Config: type = object
    source: str = "offline"
    unit: int = 1
    learned_reward: bool = False
    kl_penalty: bool = False
    clips_ratio: bool = False
    reward_threshold: str | None = None

    @staticmethod
    def needs(cfg: Any) -> frozenset[str]:
        """What the engine must provide: any of "reward", "old_logp", "ref_logp", "values" (loads a critic),
        "step_reward" (the judge's step rewards in `batch.extra`; needs `rewards.process`)."""
        return frozenset()

    @staticmethod
    def samples_per_prompt(cfg: Any) -> int:
        """Completions sampled per prompt by an online source."""
        return 1

    @classmethod
    def rows_per_item(cls, cfg: Any) -> int:
        """Sequences trained per item of `train.batch_size` (a prompt, row or pair): the samples of a prompt times
        the unit, unless `prepare` keeps fewer of them (online DPO keeps one pair of each group)."""
        return cls.samples_per_prompt(cfg) * cls.unit

    @staticmethod
    def check(cfg: Any) -> None:
        """Refuses, with a ConfigError naming the key, run settings (`cfg` is the whole RunConfig, its `algorithm`
        validated) that the method cannot serve. The base accepts all."""

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
    def objective(batch: Any, logp: torch.Tensor, cfg: Any) -> torch.Tensor:
        """The method's objective per response token of a micro-batch [B, R], signed as a loss (see the class
        docstring), differentiable in `logp`. The engine calls it on detached log-probs, under no_grad, only to log
        its aggregate; the tests differentiate it."""
        raise NotImplementedError

    @staticmethod
    def critic_loss(batch: Any, values: torch.Tensor, cfg: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Per-token critic loss [B, R] from the critic's current values, for methods that need "values"."""
        raise NotImplementedError

    @staticmethod
    def critic_aggregation(cfg: Any) -> tuple[str, float]:
        """(mode, norm) under which the engine aggregates `critic_loss`, for methods that need "values"."""
        raise NotImplementedError

    @classmethod
    def sized_config(cls, kl_weight: float, group: int) -> Any:
        """The default config with a KL weight and a number of samples per prompt, where the method has such settings
        (this base ignores both): what `posttrain estimate` sizes. A value the config rejects raises its
        ConfigError."""
        return cls.Config()


def register(name: str):
    """Decorator adding a plugin to the registry under `name`; its `Config` must be its own, so that a config names
    its method (`plugin_of`)."""

    def add(plugin: type[Algorithm]) -> type[Algorithm]:
        owner = BY_CONFIG.get(plugin.Config)
        if owner is not None:
            raise ValueError(f"algorithm {name!r}: its Config {plugin.Config.__name__} is {owner.name!r}'s; a method "
                             "needs a Config class of its own (a subclass will do)")
        REGISTRY.register(name)(plugin)
        BY_CONFIG[plugin.Config] = plugin
        return plugin

    return add


def plugin_of(config: Any) -> type[Algorithm]:
    """The registered plugin whose `Config` `config` is an instance of (exactly: a subclass names its own method)."""
    try:
        return BY_CONFIG[type(config)]
    except KeyError:
        raise ValueError(f"no plugin has config type {type(config).__name__}") from None


PREFIX = "posttrain_custom_method"  # the module name of a method's file: PREFIX_<hash of its path>
FILE_ENTRY = "path/to/file.py:Class, an Algorithm subclass in a local file"


def get(name: str) -> type[Algorithm]:
    """The plugin `algorithm.name` names: a registered method, or `path/to/file.py:Class` (a plugin in a local file,
    imported now, named by its class and known to `plugin_of`, but not listed with the built-in methods). ConfigError
    naming algorithm.name for an unknown name, a file that is missing or fails to import, or a class that is no
    plugin."""
    from posttrain.core.files import load_entry, names_a_file

    name = str(name)
    if not names_a_file(name):
        return REGISTRY.find(name)

    path, attr, plugin = load_entry(name, REGISTRY.key, PREFIX, FILE_ENTRY)
    if not (isinstance(plugin, type) and issubclass(plugin, Algorithm)):
        what = "nothing" if plugin is None else f"a {type(plugin).__name__}" if not isinstance(plugin, type) \
            else f"the class {plugin.__name__}, not an Algorithm subclass"
        raise ConfigError(f"{REGISTRY.key}: {attr!r} in '{path}' is {what}; expected {FILE_ENTRY}")
    if not dataclasses.is_dataclass(plugin.Config):
        raise ConfigError(f"{REGISTRY.key}: {attr}.Config in '{path}' is not a dataclass; a method's settings are a "
                          "dataclass of its own (its fields are the algorithm.* keys)")
    if plugin.coefficient is Algorithm.coefficient or plugin.objective is Algorithm.objective:
        raise ConfigError(f"{REGISTRY.key}: {attr} in '{path}' does not define coefficient and objective; a method "
                          "gives its GC per token and the objective whose gradient it is")
    owner = BY_CONFIG.get(plugin.Config)
    if owner is not None and owner is not plugin:
        raise ConfigError(f"{REGISTRY.key}: {attr}.Config in '{path}' is {owner.name!r}'s; a method needs a Config "
                          "class of its own (a subclass will do)")
    if "name" not in vars(plugin):  # named by its class, unless it names itself; listed nowhere but in this run
        plugin.name = attr
    BY_CONFIG[plugin.Config] = plugin  # a validated config names its method (plugin_of)
    return plugin
