"""Recipes, overrides and validation.

A recipe is a YAML file of groups (`model`, `data`, `algorithm`, `rollout`, `train`, `eval`, `rewards`) over the
defaults of `posttrain.schema`; `key=value` overrides are OmegaConf dotlists merged on top. The merged tree is checked
against the schema's dataclasses, the chosen algorithm's own `Config` and the registries (reward names, rollout
engine, backend): an unknown key or name (with the nearest known one), a wrong type or an out-of-range value is a
`ConfigError` naming the key.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import math
import types
import typing
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from posttrain.core import launch, threads
from posttrain.core.errors import ConfigError
from posttrain.core.frozen import freeze
from posttrain.schema import (  # noqa: F401  (re-exported: the schema is part of what `posttrain.config` offers)
    TRACKERS,
    DataConfig,
    EvalConfig,
    ModelConfig,
    RewardModelConfig,
    RewardsConfig,
    RolloutConfig,
    RunConfig,
    TrainConfig,
    WarmupConfig,
    cache_root,
)

if TYPE_CHECKING:
    from posttrain import algorithms
    from posttrain.core.precision import Choice


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
    """Checks `value` against the annotation `tp` (int, float, bool, str, optional, list, dict[str, float], Any: a
    value a plugin of its own checks, such as a reasoning-gym task's options)."""
    if tp is Any:
        return value
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        for tp in options[:-1]:  # `bool | str`: the first type that takes the value
            try:
                return _coerce(value, tp, key)
            except ConfigError:
                pass
        return _coerce(value, options[-1], key)
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, e.g. [0.05, 0.02], got {value!r}")
        return [_coerce(v, typing.get_args(tp)[0], f"{key}[{i}]") for i, v in enumerate(value)]
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
    if value is None:  # `key=` on the command line, or `key:` in a recipe
        raise ConfigError(f"{key}: empty; give a value ({_type_name(tp)}), e.g. {key}=...")
    if not ok and tp is str and isinstance(value, dict) and len(value) == 1 and None in value.values():
        raise ConfigError(f"{key}: '{next(iter(value))}:' ends with a colon, which YAML reads as a mapping, not a "
                          "string; give what follows the colon")
    if not ok:
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")
    if tp is int and not -INT_LIMIT < value < INT_LIMIT:
        raise ConfigError(f"{key}: {value} is out of range (a 64-bit integer: magnitude below 2^63)")
    if tp is float:  # YAML writes inf and nan as .inf and .nan, and 1e309 overflows to inf
        try:
            value = float(value)
        except OverflowError:
            value = math.inf
        if not math.isfinite(value):
            raise ConfigError(f"{key}: must be a finite number, got {value!r}")
    return value


INT_LIMIT = 2**63  # what torch and numpy can hold as an integer


# Keys that are gone, each with what replaces it: a config that still gives one is told what to write instead.
REMOVED = {
    "model.dtype": "train.precision=fp32, bf16-mixed or bf16",
    "algorithm.scale_std": "algorithm.adv_norm=none (for scale_std=false) or adv_norm=mean_std (for true, the default)",
}


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
        if _join(prefix, key) in REMOVED:
            raise ConfigError(f"{_join(prefix, key)}: removed; use {REMOVED[_join(prefix, key)]}")
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
    """The validated config of `recipe` with `overrides`, read-only (`posttrain.core.frozen`), and the resolved tree
    as plain data (for config.yaml)."""
    path = recipe_path(recipe)
    try:
        base = OmegaConf.load(path)
    except (OSError, OmegaConfBaseException, ValueError, yaml.YAMLError) as err:  # a scanner error is none of the first
        where = getattr(err, "problem_mark", None)
        at = f", line {where.line + 1}" if where is not None else ""
        raise ConfigError(f"recipe {path}: cannot be read as YAML{at} ({str(err).splitlines()[0]})") from None
    if not isinstance(base, DictConfig):  # a list, or a scalar, at the top level
        raise ConfigError(f"recipe {path}: expected a mapping of groups (model:, data:, algorithm:, ...) at the top "
                          f"level, got a {type(base).__name__.removesuffix('Config').lower()}")
    for item in overrides:
        key, eq, _ = item.partition("=")
        if not (eq and key.strip()):  # no `=`, or nothing before it
            raise ConfigError(f"override {item!r}: expected key=value")
        try:
            OmegaConf.from_dotlist([item])
        except (yaml.YAMLError, OmegaConfBaseException, ValueError) as err:  # e.g. an unterminated quote
            problem = getattr(err, "problem", None) or str(err).splitlines()[0]
            raise ConfigError(f"{item.split('=', 1)[0]}: the value {item.split('=', 1)[1]!r} cannot be read as YAML "
                              f"({problem}); check its quotes and brackets") from None
    try:
        merged = OmegaConf.merge(base, OmegaConf.from_dotlist(list(overrides)))
        tree = OmegaConf.to_container(merged, resolve=True, throw_on_missing=True)
    except MissingMandatoryValue as err:  # `???` in a recipe: a value it cannot guess, e.g. model.path
        raise ConfigError(f"{err.full_key}: required by recipe {path.stem}; give {err.full_key}=...") from None
    except OmegaConfBaseException as err:
        raise ConfigError(f"config: {str(err).splitlines()[0]}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"recipe {path}: expected a mapping of groups")
    algo_tree = dict(tree.get("algorithm") or {})
    tree_wo_algo = {k: v for k, v in tree.items() if k not in ("algorithm", "rewards")}
    cfg = build(RunConfig, tree_wo_algo, "")
    # Counts the cores of this machine cannot serve, before torch loads libgomp, which reads OMP_NUM_THREADS
    # (Ray places its workers on any node of its cluster, and says itself what does not fit: docs/distributed.md)
    here = cfg.rollout.placement == "separate" and cfg.rollout.launcher == "local"
    threads.check_counts(cfg.train.threads, cfg.rollout.workers if here else 0,
                         cfg.rollout.worker_threads if here else 0)
    cfg.rewards = rewards_config(tree.get("rewards"))
    check_trackers(cfg)
    if "name" not in algo_tree:
        raise ConfigError("algorithm.name: missing; the recipe must name a method, e.g. algorithm.name=grpo")
    from posttrain import algorithms, stages  # the plugins, and torch: once the other groups are valid, a bad key
    from posttrain.data import curriculum, difficulty  # answers fast

    r = cfg.rollout
    if r.placement == "separate" and r.launcher == "local" and r.gpus:  # before a warm-up: the machine cannot serve it
        launch.worker_gpus(r.workers, r.gpus, launch.cuda_devices(), launch.local_world())
    plugin = algorithms.get(algo_tree.pop("name"))
    cfg.algorithm = build(plugin.Config, algo_tree, "algorithm")
    plugin.check(cfg)  # what the method itself cannot serve
    check_normalize(cfg, plugin)
    check_rewards_apply(cfg, plugin)
    curriculum.check(cfg, plugin)
    difficulty.check(cfg, plugin)  # per-difficulty group sizes
    stages.check(cfg, plugin)  # each stage of the online source refuses what it cannot serve
    if cfg.rollout.max_staleness and plugin.source != "online":
        raise ConfigError(f"rollout.max_staleness: workers run ahead for the online methods, which sample as they "
                          f"train; {plugin.name} does not (its samples, if any, are drawn once)")
    if cfg.rollout.reference_on == "workers" and plugin.source != "online":
        raise ConfigError(f"rollout.reference_on: workers score the batches they sample for the online methods; "
                          f"{plugin.name} scores its reference where it trains")
    if cfg.rollout.reference_on == "workers" and not {"ref_logp", "teacher_logp"} & plugin.needs(cfg.algorithm):
        beta = f" with algorithm.beta={cfg.algorithm.beta:g}" if hasattr(cfg.algorithm, "beta") else ""
        raise ConfigError(f"rollout.reference_on: workers hold the frozen models that score a batch (the reference of "
                          f"a KL term, a distillation teacher), and {plugin.name}{beta} has none (none is loaded); "
                          "drop rollout.reference_on")
    if cfg.rollout.tis_cap is not None and plugin.source != "online":
        raise ConfigError(f"rollout.tis_cap: weighs each token of the samples an online method draws as it trains by "
                          f"π_trainer / π_rollout, and {plugin.name} trains on none (its rows are given, or sampled "
                          "once and kept without the rollout engine's log-probs); drop rollout.tis_cap")
    if cfg.rollout.proximal == "sampler" and not plugin.clips_ratio:
        raise ConfigError(f"rollout.proximal: sampler is the π_old of a clipped ratio, which {plugin.name} has not "
                          "(PPO, GRPO's family and GSPO have one)")
    if cfg.env.name is not None:
        check_env(cfg, plugin)
    if cfg.eval.stop_on == "kl" and not (plugin.kl_penalty and cfg.algorithm.beta > 0):
        raise ConfigError(f"eval.stop_on: kl needs a KL to the reference, which {plugin.name} with "
                          f"algorithm.beta={getattr(cfg.algorithm, 'beta', None)} does not measure")
    if cfg.train.beta_schedule != "constant" and not (plugin.kl_penalty and cfg.algorithm.beta > 0):
        why = "its β weighs no KL penalty" if not plugin.kl_penalty else "algorithm.beta is 0, so no reference is loaded"
        raise ConfigError(f"train.beta_schedule: {plugin.name} has nothing to schedule ({why})")
    from posttrain import backends, rewards, rollout  # transformers, torch.distributed

    rewards.combine(cfg.rewards)  # unknown names, bad weights, custom files that do not load: all fail here
    rollout.get(cfg.rollout.engine).check()  # an engine whose library is missing fails here, before any work
    backends.get(cfg.train.backend).check(cfg.train)  # unknown backend, unsupported offload, missing library
    tree["algorithm"] = {"name": plugin.name, **dataclasses.asdict(cfg.algorithm)}
    resolved = {**dataclasses.asdict(cfg), "algorithm": tree["algorithm"], "rewards": rewards_tree(cfg.rewards)}
    return freeze(cfg), resolved  # read-only from here: what changes in a run lives in its controllers


def check_env(cfg: RunConfig, plugin) -> None:
    """env.name: a registered environment, for the online methods; per-turn rewards come from its turns, not from a
    completion's lines."""
    from posttrain import environments

    environments.get(cfg.env.name)  # an unknown name fails here, naming the known ones
    if plugin.source != "online":
        raise ConfigError(f"env.name: episodes are sampled by the online methods as they train; {plugin.name} "
                          "samples none, or once")
    if cfg.rewards.process in ("steps", "model"):
        raise ConfigError(f"rewards.process: {cfg.rewards.process} reads the steps of one completion's text; an "
                          "episode's steps are its turns (rewards.process=turns)")


def check_normalize(cfg: RunConfig, plugin) -> None:
    """rewards.normalize makes each reward a weighted sum of z-scores: for online methods that train on the reward's
    spread, not those that compare it with a threshold (`Algorithm.reward_threshold`, Online RFT) or train on step
    rewards (GRPO+PS), and with `group` only where there are groups."""
    norm = cfg.rewards.normalize
    if norm == "none":
        return
    if plugin.source != "online":
        raise ConfigError(f"rewards.normalize: normalises the rewards of samples drawn as the run trains; "
                          f"{plugin.name} trains on no such samples")
    if plugin.reward_threshold is not None:
        raise ConfigError(f"rewards.normalize: {plugin.name} keeps the samples whose reward reaches "
                          f"algorithm.{plugin.reward_threshold}, and a z-score has no such scale; use "
                          "rewards.normalize=none")
    if "step_reward" in plugin.needs(cfg.algorithm):
        raise ConfigError(f"rewards.normalize: {plugin.name} trains on step rewards (rewards.process), which it "
                          "normalises itself; the outcome reward it would change is only logged")
    if norm == "group" and plugin.samples_per_prompt(cfg.algorithm) < 2:
        raise ConfigError(f"rewards.normalize: group z-scores over a prompt's samples, and {plugin.name} with these "
                          "settings draws one per prompt (every reward would be 0); use rewards.normalize=batch")


def users_of(need: str) -> str:
    """The registered methods that train on `need` ("reward", "step_reward"), as a list for a message."""
    from posttrain import algorithms

    return ", ".join(sorted(name for name, p in algorithms.REGISTRY.items() if need in p.needs(p.Config())))


def check_rewards_apply(cfg: RunConfig, plugin) -> None:
    """A reward key the method in use never reads is refused, naming the methods that would use it: the `rewards`
    weights, custom functions and time-out, and the reward model, weigh the samples an online method draws (SFT,
    RFT and DPO keep or compare samples by the answer check alone); rewards.process feeds methods that train on step
    rewards; a reward model's weight needs a reward model."""
    needs, default = plugin.needs(cfg.algorithm), RewardsConfig()
    if cfg.rewards.process != "none" and "step_reward" not in needs:
        raise ConfigError(f"rewards.process: step rewards are trained on by {users_of('step_reward')}, and "
                          f"{plugin.name} trains on none; use rewards.process=none")
    if plugin.source != "online":
        weights = [f"rewards.{name}" for name, w in cfg.rewards.weights.items() if default.weights.get(name) != w]
        given = [*weights, *(["rewards.custom"] if cfg.rewards.custom else []),
                 *(["rewards.timeout_s"] if cfg.rewards.timeout_s != default.timeout_s else []),
                 *(["reward_model.path"] if cfg.reward_model.path is not None else []),
                 *(["rewards"] if set(default.weights) - set(cfg.rewards.weights) else [])]
        if given:
            raise ConfigError(f"{given[0]}: read by the methods that score rewards ({users_of('reward')}); "
                              f"{plugin.name} scores none (it trains on given responses or on the answer check)")
    elif cfg.reward_model.path is not None and "reward" not in needs:
        raise ConfigError(f"reward_model.path: {plugin.name} trains on step rewards, not on the outcome reward a reward "
                          f"model scores; for a process reward model give reward_model.process_path")
    if cfg.reward_model.weight != RewardModelConfig().weight and cfg.reward_model.path is None:
        raise ConfigError("reward_model.weight: weighs the reward model's score, and no reward model is given "
                          "(reward_model.path)")
    if cfg.reward_model.process_path is not None and cfg.rewards.process != "model":
        raise ConfigError("reward_model.process_path: read with rewards.process=model only (got "
                          f"rewards.process={cfg.rewards.process})")


def check_trackers(cfg: RunConfig) -> None:
    """A tracker whose library is missing fails here, before any work (found, not imported: wandb takes seconds)."""
    for name in cfg.trackers:
        if not any(importlib.util.find_spec(package) for package in TRACKERS[name]):
            raise ConfigError(f"report_to: {name} needs {' or '.join(TRACKERS[name])}: "
                              "pip install 'posttrain[tracking]'")


def flatten(tree: dict, prefix: str = "") -> dict:
    """A resolved tree as one level of dotted keys, {"train": {"lr": 1e-5}} -> {"train.lr": 1e-5}."""
    out = {}
    for k, v in tree.items():
        out.update(flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def rewards_config(values: Any) -> RewardsConfig:
    """The `rewards` group from its flat form: reward names with weights beside the reserved keys (`custom`,
    `timeout_s`, ...: RewardsConfig.RESERVED). Like `algorithm`, it is built apart from the rest, as its reward names
    are not fields."""
    if values is None:
        values = {}
    if not isinstance(values, dict):
        raise ConfigError(f"rewards: expected a mapping of reward names to weights, got {values!r}")
    group = {k: v for k, v in values.items() if k in RewardsConfig.RESERVED}
    weights = {str(k): _coerce(v, float, f"rewards.{k}") for k, v in values.items() if k not in group}
    custom = group.get("custom")
    for entry, weight in custom.items() if isinstance(custom, dict) else ():
        if isinstance(weight, dict):  # `rewards.custom.f.py:fn=1` splits at the dots into {f: {py:fn: 1}}
            raise ConfigError(f"rewards.custom.{entry}: expected a weight, got {weight!r}; on the command line give "
                              "the entry inside braces: 'rewards.custom={path/to/file.py:function: 1.0}'")
    if weights or custom:  # a group naming no reward keeps the default, {accuracy: 1.0}
        group["weights"] = weights
    return build(RewardsConfig, group, "rewards")


def rewards_tree(cfg: RewardsConfig) -> dict:
    """The `rewards` group in its flat form, as a recipe writes it (config.yaml, `posttrain config`)."""
    return {**cfg.weights, "custom": dict(cfg.custom), "timeout_s": cfg.timeout_s,
            "overlong_buffer": cfg.overlong_buffer, "overlong_penalty": cfg.overlong_penalty, "process": cfg.process,
            "normalize": cfg.normalize}


def run_device():
    """The device a run trains on: the GPU when there is one (each process's own), else the CPU."""
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def settle_precision(cfg: RunConfig) -> tuple[RunConfig, Choice]:
    """`cfg` with `train.precision` as it runs on this device (`auto` resolved, posttrain.core.precision), and the
    choice with its reason. The validated config itself is left as it is: config.yaml keeps what was asked for."""
    from posttrain import backends
    from posttrain.core import precision

    choice = precision.resolve(cfg.train.precision, run_device(), backends.get(cfg.train.backend).precisions)
    return freeze(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, precision=choice.precision))), choice


def algorithm_of(cfg: RunConfig) -> type[algorithms.Algorithm]:
    """The plugin whose Config `cfg.algorithm` is: one dictionary look-up (`posttrain.algorithms.plugin_of`)."""
    from posttrain import algorithms

    return algorithms.plugin_of(cfg.algorithm)
