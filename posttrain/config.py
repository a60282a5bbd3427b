"""Recipes, overrides and validation.

A recipe is a YAML file of groups (`model`, `data`, `algorithm`, `rollout`, `train`, `eval`, `rewards`) over the
defaults below; `key=value` overrides are OmegaConf dotlists merged on top. The merged tree is checked against the
dataclasses here and the chosen algorithm's own `Config`: an unknown key (with the nearest known one), a wrong type
or an out-of-range value is a `ConfigError` naming the key.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from posttrain import algorithms, backends, rewards, rollout
from posttrain.core.aggregation import MODES
from posttrain.core.errors import ConfigError


@dataclass
class ModelConfig:
    path: str | None = None
    """Local Hugging Face model directory; null builds the embedded tiny model and warms it up with SFT (cached)."""
    dtype: str = "float32"
    """Dtype of the weights: float32, bfloat16 or float16."""
    ref_path: str | None = None
    """Reference model directory for methods with a KL or a reference (GRPO β > 0, DPO, PPO); null: the start."""

    def __post_init__(self):
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"dtype: must be float32, bfloat16 or float16 (got {self.dtype!r})")


@dataclass
class WarmupConfig:
    steps: int = 250
    """SFT steps on the embedded task that turn the random tiny model into a weak but non-zero policy."""
    batch_size: int = 64
    """Problems per warm-up step."""
    lr: float = 3e-3
    """Warm-up learning rate."""
    hidden: int = 128
    """Width of the embedded tiny model."""
    layers: int = 4
    """Transformer blocks of the embedded tiny model."""
    cache_dir: str | None = None
    """Where warmed-up models are kept and reused; null: $POSTTRAIN_CACHE or ~/.cache/posttrain."""


@dataclass
class DataConfig:
    path: str | None = None
    """Training rows: a .jsonl or .parquet file or a `datasets` directory (save_to_disk); null: the embedded task."""
    test_path: str | None = None
    """Held-out rows for evaluation, same format; null with `path` set: the last `eval.num_problems` rows of `path`."""
    prompt_field: str = "question"
    """Field holding the question."""
    response_field: str = "answer"
    """Field holding the target response (offline methods such as SFT)."""
    answer_field: str = "answer"
    """Field holding the reference answer the rule reward checks (a number, or text ending in `#### N`)."""
    template: str = "Q: {prompt}\nA: "
    """Prompt text around the question; `{prompt}` is replaced by it."""
    max_prompt_len: int = 512
    """Prompts longer than this many tokens keep their last tokens."""
    max_response_len: int = 512
    """Offline responses longer than this many tokens are cut."""
    difficulty: int = 2
    """Embedded task: operations per problem (1: a±b, 2: a±b±c, ...), one worked step each."""
    max_operand: int = 9
    """Embedded task: operands are drawn from 0..max_operand."""
    train_size: int = 3000
    """Embedded task: training problems."""
    test_size: int = 500
    """Embedded task: held-out problems, never in the training split."""
    seed: int = 1234
    """Embedded task: seed of the problem generator."""

    def __post_init__(self):
        if "{prompt}" not in self.template:
            raise ConfigError(f"template: must contain {{prompt}} (got {self.template!r})")
        for key in ("max_prompt_len", "max_response_len", "difficulty", "max_operand", "train_size", "test_size"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{key}: must be ≥ 1 (got {getattr(self, key)})")


@dataclass
class RolloutConfig:
    engine: str = "hf"
    """Sampling engine (`posttrain.rollout`): hf (transformers generate, colocated with the trainer)."""
    temperature: float = 1.0
    """Sampling temperature; log-probs are scored at the same temperature."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    max_new_tokens: int = 64
    """Token budget per completion; a completion without EOS by then is truncated."""

    def __post_init__(self):
        try:
            rollout.get(self.engine)
        except ConfigError as err:
            raise ConfigError(str(err).removeprefix("rollout.")) from None
        if self.temperature <= 0:
            raise ConfigError(f"temperature: must be > 0 (got {self.temperature})")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p: must be in (0, 1] (got {self.top_p})")
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens: must be ≥ 1 (got {self.max_new_tokens})")


@dataclass
class TrainConfig:
    steps: int = 100
    """Optimizer steps (× the algorithm's epochs per batch)."""
    batch_size: int = 16
    """Prompts (online methods) or rows (offline methods) per step, per process."""
    micro_batch_size: int = 64
    """Sequences per forward/backward; gradients are accumulated over the batch."""
    lr: float = 1e-5
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    warmup_steps: int = 0
    """Linear learning-rate warm-up steps, then constant."""
    max_grad_norm: float = 1.0
    """Gradient clipping by global norm; 0 disables it."""
    loss_agg: str = "seq_mean_token_mean"
    """How per-token terms become the loss: seq_mean_token_mean (paper), token_mean (DAPO), seq_mean_token_sum_norm."""
    loss_agg_norm: float | None = None
    """Constant L of seq_mean_token_sum_norm (Dr. GRPO); null: rollout.max_new_tokens."""
    save_every: int = 0
    """Write a checkpoint every N steps under output_dir/checkpoints; 0: only the final model."""
    backend: str = "ddp"
    """How training is distributed (`posttrain.backends`): ddp (one process, or data parallel under torchrun)."""

    def __post_init__(self):
        try:
            backends.get(self.backend)
        except ConfigError as err:
            raise ConfigError(str(err).removeprefix("train.")) from None
        if self.loss_agg not in MODES:
            raise ConfigError(f"loss_agg: unknown mode {self.loss_agg!r}; known: {', '.join(MODES)}")
        for key in ("steps", "batch_size", "micro_batch_size"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{key}: must be ≥ 1 (got {getattr(self, key)})")
        if self.lr <= 0:
            raise ConfigError(f"lr: must be > 0 (got {self.lr})")
        for key in ("weight_decay", "warmup_steps", "max_grad_norm", "save_every"):
            if getattr(self, key) < 0:
                raise ConfigError(f"{key}: must be ≥ 0 (got {getattr(self, key)})")
        if self.loss_agg_norm is not None and self.loss_agg_norm <= 0:
            raise ConfigError(f"loss_agg_norm: must be > 0 (got {self.loss_agg_norm})")


@dataclass
class EvalConfig:
    num_problems: int = 200
    """Held-out problems scored by greedy decoding before and after training; 0 skips evaluation."""
    every: int = 0
    """Also evaluate every N steps (logged as eval_accuracy in metrics.jsonl); 0: before and after only."""
    batch_size: int = 200
    """Problems decoded at once."""
    max_new_tokens: int | None = None
    """Token budget per answer; null: rollout.max_new_tokens."""

    def __post_init__(self):
        for key, low in (("num_problems", 0), ("every", 0), ("batch_size", 1)):
            if getattr(self, key) < low:
                raise ConfigError(f"{key}: must be ≥ {low} (got {getattr(self, key)})")


@dataclass
class RewardModelConfig:
    path: str | None = None
    """Local sequence-classification model directory whose score is added to the rule rewards; null: none."""
    weight: float = 1.0
    """Weight of the reward model's score."""


@dataclass
class RunConfig:
    description: str = ""
    """One line saying what the recipe does (shown by `posttrain recipes`)."""
    output_dir: str = "runs/run"
    """Where config.yaml, metrics.jsonl, summary.json and the final model go."""
    overwrite: bool = False
    """Replace a non-empty output_dir (only once the new run has finished)."""
    seed: int = 0
    """Seed of the model init, sampling and data order; runs with the same seed repeat exactly on CPU."""
    model: ModelConfig = field(default_factory=ModelConfig)
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    data: DataConfig = field(default_factory=DataConfig)
    algorithm: Any = None
    """The method's own hyperparameters, validated against its plugin's Config; `name` picks the plugin."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    rewards: dict[str, float] = field(default_factory=lambda: {"accuracy": 1.0})
    """Rule rewards and their weights, e.g. {accuracy: 1.0, format: 0.1}."""
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)


def cache_root(cfg: RunConfig) -> Path:
    """Where warm-ups and sample sets are cached: warmup.cache_dir, else $POSTTRAIN_CACHE, else ~/.cache/posttrain."""
    root = cfg.warmup.cache_dir or os.environ.get("POSTTRAIN_CACHE") or Path.home() / ".cache" / "posttrain"
    return Path(root)


def recipes_dir() -> Path:
    return Path(str(resources.files("posttrain.recipes")))


def known_recipes() -> dict[str, Path]:
    return {p.stem: p for p in sorted(recipes_dir().glob("*.yaml"))}


def recipe_path(name_or_path: str) -> Path:
    """A recipe shipped with posttrain by name, or a YAML file by path."""
    known = known_recipes()
    if name_or_path in known:
        return known[name_or_path]
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.is_file():
            raise ConfigError(f"recipe: no such file {name_or_path!r}")
        return path
    near = difflib.get_close_matches(name_or_path, known, n=1)
    hint = f"did you mean {near[0]!r}? " if near else ""
    raise ConfigError(f"recipe: unknown recipe {name_or_path!r}; {hint}known: {', '.join(known)}")


def recipe_description(path: Path) -> str:
    return str(OmegaConf.load(path).get("description", ""))


def _type_name(tp) -> str:
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Checks `value` against the annotation `tp` (int, float, bool, str, optional, dict[str, float])."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        (tp,) = [a for a in args if a is not type(None)]
        return _coerce(value, tp, key)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return {str(k): _coerce(v, typing.get_args(tp)[1], f"{key}.{k}") for k, v in value.items()}
    ok = {
        bool: lambda v: isinstance(v, bool),
        int: lambda v: isinstance(v, int) and not isinstance(v, bool),
        float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        str: lambda v: isinstance(v, str),
    }[tp](value)
    if not ok:
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")
    return float(value) if tp is float else value


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def build(cls: type, values: Any, prefix: str) -> Any:
    """An instance of dataclass `cls` from a mapping, with errors naming `prefix.key`."""
    if values is None:
        values = {}
    if not isinstance(values, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a group of keys, got {values!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in values.items():
        if key not in names:
            near = difflib.get_close_matches(str(key), names, n=1)
            hint = f"; did you mean {_join(prefix, near[0])}?" if near else f"; known: {', '.join(names) or 'none'}"
            raise ConfigError(f"{_join(prefix, key)}: unknown key{hint}")
        tp = hints[key]
        full = _join(prefix, key)
        kwargs[key] = build(tp, value, full) if dataclasses.is_dataclass(tp) else _coerce(value, tp, full)
    try:
        return cls(**kwargs)
    except ConfigError as err:
        raise ConfigError(_join(prefix, str(err))) from None


def load(recipe: str, overrides: list[str] = ()) -> tuple[RunConfig, dict]:
    """The validated config of `recipe` with `overrides`, and the resolved tree as plain data (for config.yaml)."""
    path = recipe_path(recipe)
    try:
        base = OmegaConf.load(path)
    except (OSError, OmegaConfBaseException, ValueError) as err:
        raise ConfigError(f"recipe {path}: cannot be read as YAML ({str(err).splitlines()[0]})") from None
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key=value")
    try:
        merged = OmegaConf.merge(base, OmegaConf.from_dotlist(list(overrides)))
        tree = OmegaConf.to_container(merged, resolve=True)
    except OmegaConfBaseException as err:
        raise ConfigError(f"config: {str(err).splitlines()[0]}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"recipe {path}: expected a mapping of groups")
    algo_tree = dict(tree.get("algorithm") or {})
    tree_wo_algo = {k: v for k, v in tree.items() if k != "algorithm"}
    cfg = build(RunConfig, tree_wo_algo, "")
    if "name" not in algo_tree:
        raise ConfigError("algorithm.name: missing; the recipe must name a method, e.g. algorithm.name=grpo")
    plugin = algorithms.get(algo_tree.pop("name"))
    cfg.algorithm = build(plugin.Config, algo_tree, "algorithm")
    rewards.combine(cfg.rewards)  # unknown reward names and bad weights fail here, with the rest of the config
    tree["algorithm"] = {"name": plugin.name, **dataclasses.asdict(cfg.algorithm)}
    resolved = {**dataclasses.asdict(cfg), "algorithm": tree["algorithm"]}
    return cfg, resolved


def algorithm_of(cfg: RunConfig) -> type[algorithms.Algorithm]:
    """The plugin whose Config `cfg.algorithm` is."""
    for plugin in algorithms.REGISTRY.values():
        if type(cfg.algorithm) is plugin.Config:
            return plugin
    raise ValueError(f"no plugin has config type {type(cfg.algorithm).__name__}")
