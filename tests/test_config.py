"""Recipes, overrides and the one-line errors for bad input."""

import pytest

from posttrain import config
from posttrain.core.errors import ConfigError


def test_every_shipped_recipe_validates_and_opens_with_its_command():
    for name, path in config.known_recipes().items():
        cfg, resolved = config.load(name, ["model.path=m"])  # sft_gsm8k has no default model
        assert path.read_text().splitlines()[0] == f"# posttrain run recipe={name}"
        assert cfg.description and resolved["algorithm"]["name"]


def test_overrides_and_types():
    cfg, resolved = config.load("grpo_math", ["algorithm.beta=0.02", "train.steps=3", "train.lr=1e-3"])
    assert cfg.algorithm.beta == 0.02 and cfg.train.steps == 3 and cfg.train.lr == 0.001
    assert resolved["algorithm"]["beta"] == 0.02


def test_int_accepted_for_float():
    cfg, _ = config.load("grpo_math", ["algorithm.beta=0"])
    assert cfg.algorithm.beta == 0.0 and isinstance(cfg.algorithm.beta, float)


def test_recipe_by_path(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("algorithm:\n  name: sft\ntrain:\n  steps: 7\n")
    cfg, _ = config.load(str(path))
    assert cfg.train.steps == 7


@pytest.mark.parametrize("recipe, overrides, message", [
    ("grpo_mat", [], "unknown recipe 'grpo_mat'; did you mean 'grpo_math'? known: "),
    ("grpo_math", ["algorithm.bta=0.1"], "algorithm.bta: unknown key; did you mean algorithm.beta?"),
    ("grpo_math", ["trian.steps=3"], "trian: unknown key; did you mean train?"),
    ("grpo_math", ["train.steps=three"], "train.steps: expected int, got 'three'"),
    ("grpo_math", ["train.steps=1.5"], "train.steps: expected int, got 1.5"),
    ("grpo_math", ["algorithm.group_size=1"], "algorithm.group_size: GRPO needs at least 2"),
    ("grpo_math", ["algorithm.clip_eps=0"], "algorithm.clip_eps: must be > 0"),
    ("grpo_math", ["algorithm.beta=-0.1"], "algorithm.beta: must be ≥ 0"),
    ("grpo_math", ["algorithm.name=grop"], "algorithm.name: unknown algorithm 'grop'; did you mean 'grpo'?"),
    ("grpo_math", ["train.loss_agg=mean"], "train.loss_agg: unknown mode 'mean'"),
    ("grpo_math", ["rollout.temperature=0"], "rollout.temperature: must be > 0"),
    ("grpo_math", ["train.lr=.inf"], "train.lr: must be a finite number, got inf"),
    ("grpo_math", ["train.lr=.nan"], "train.lr: must be a finite number, got nan"),
    ("grpo_math", ["algorithm.beta=.nan"], "algorithm.beta: must be a finite number, got nan"),
    ("grpo_math", ["rollout.temperature=1e309"], "rollout.temperature: must be a finite number, got inf"),
    ("grpo_math", ["rewards={accuracy: .inf}"], "rewards.accuracy: must be a finite number, got inf"),
    ("grpo_math", [f"train.lr={10**400}"], "train.lr: must be a finite number, got inf"),
    ("grpo_math", [f"train.steps={10**23}"], f"train.steps: {10**23} is out of range"),
    ("grpo_math", ["train.steps"], "override 'train.steps': expected key=value"),
    ("grpo_math", ["rollout.proximal=old"], "rollout.proximal: unknown 'old'; known: trainer, sampler"),
    ("grpo_math", ["rollout.proximal=sampler", "rollout.tis_cap=2"],
     "rollout.tis_cap: with proximal=sampler the clipped ratio already weights each token by π_θ / π_rollout"),
    ("grpo_math", ["rollout.proximal=sampler", "rollout.elite_pool=4"], "rollout.proximal: sampler takes the ratio "),
    ("online_rft_math", ["rollout.proximal=sampler"], "rollout.proximal: sampler is the π_old of a clipped ratio, "
                                                      "which online_rft has not"),
    ("grpo_math", ["data.preset=reasoning_gym:"], "data.preset: 'reasoning_gym:' ends with a colon, which YAML reads "
                                                 "as a mapping, not a string; give what follows the colon"),
    ("grpo_math", ["data.template=nothing"], "data.template: must contain {prompt}"),
    ("grpo_math", ["rewards.foo=1"], "rewards.foo: unknown reward 'foo'"),
    ("grpo_math", ["rollout.engine=hff"], "rollout.engine: unknown rollout engine 'hff'; did you mean 'hf'?"),
    ("grpo_math", ["train.backend=zero9"], "train.backend: unknown backend 'zero9'"),
    ("grpo_math", ["train.offload=gpu"], "train.offload: unknown 'gpu'; known: none, optimizer, params"),
    ("grpo_math", ["train.offload=params"], "train.offload: ddp supports none, not 'params'"),
    ("grpo_math", ["train.backend=fsdp2", "train.offload=optimizer"],
     "train.offload: fsdp2 supports none or params, not 'optimizer'"),
])
def test_bad_input_names_the_culprit(recipe, overrides, message):
    with pytest.raises(ConfigError) as err:
        config.load(recipe, overrides)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_missing_recipe_file():
    with pytest.raises(ConfigError, match="no such file"):
        config.load("nowhere/recipe.yaml")


def test_precision_values():
    """train.precision takes auto (every recipe's default), fp32, bf16-mixed, fp16-mixed or bf16."""
    assert config.load("grpo_math")[0].train.precision == "auto"
    assert config.load("grpo_math", ["train.precision=bf16-mixed"])[0].train.precision == "bf16-mixed"
    with pytest.raises(ConfigError, match=r"^train.precision: must be one of auto, fp32, bf16-mixed, fp16-mixed, bf16"):
        config.load("grpo_math", ["train.precision=fp16"])


@pytest.mark.parametrize("override, message", [
    ("model.dtype=bfloat16", "model.dtype: removed; use train.precision=fp32, bf16-mixed or bf16"),
    ("algorithm.scale_std=false", "algorithm.scale_std: removed; use algorithm.adv_norm=none (for scale_std=false) or "
                                  "adv_norm=mean_std (for true, the default)"),
])
def test_a_removed_key_names_what_replaces_it(override, message):
    """A key gone before 1.0 is refused, in one line saying what to write instead; never an unknown key, and never
    read as its replacement."""
    with pytest.raises(ConfigError) as err:
        config.load("grpo_math", [override])
    assert str(err.value) == message


def test_a_deepspeed_backend_without_deepspeed_is_refused_when_the_config_loads(monkeypatch):
    import importlib.util

    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else find(name, *a))
    with pytest.raises(ConfigError, match=r"^train.backend: zero3 needs DeepSpeed: pip install 'posttrain\[deepspeed\]'"):
        config.load("grpo_math", ["train.backend=zero3"])
    with pytest.raises(ConfigError, match=r"^train.precision: zero2 keeps fp32 master weights"):
        monkeypatch.undo()
        config.load("grpo_math", ["train.backend=zero2", "train.precision=bf16"])


def test_the_validated_config_is_read_only():
    """What changes in a run lives in its controllers: a loaded config refuses writes, in every group and in the
    plugin's own; a changed copy is dataclasses.replace, which leaves the original as it was."""
    import dataclasses

    cfg, _ = config.load("grpo_math", [])
    with pytest.raises(dataclasses.FrozenInstanceError, match="GRPOConfig.beta: the validated config is read-only"):
        cfg.algorithm.beta = 0.1
    for group, key in ((cfg, "seed"), (cfg.train, "lr"), (cfg.rollout, "temperature"), (cfg.model.lora, "r"),
                       (cfg.rewards, "overlong_buffer")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(group, key, getattr(group, key))
    changed = dataclasses.replace(cfg.algorithm, beta=0.1)
    assert changed.beta == 0.1 and cfg.algorithm.beta == 0.04


@pytest.mark.parametrize("recipe, given, proximal, tis_cap", [
    ("grpo_math", [], "sampler", None),  # the clipped ratio against the sampler is the correction
    ("ppo_math", [], "sampler", None),
    ("grpo_math", ["rollout.tis_cap=3"], "trainer", 3.0),  # the truncated weight, as given
    ("grpo_math", ["rollout.tis_mode=sequence_truncate"], "trainer", 2.0),
    ("grpo_math", ["rollout.elite_pool=4"], "trainer", 2.0),
    ("grpo_math", ["rollout.proximal=trainer"], "trainer", 2.0),
    ("online_rft_math", [], "trainer", 2.0),  # no clipped ratio: the truncated weight
])
def test_stale_samples_are_corrected_one_way_by_default(recipe, given, proximal, tis_cap):
    """At max_staleness ≥ 1 stale samples are never trained on as if fresh: a method with a clipped ratio takes it
    against the sampler's log-probs unless the truncated weight is asked for (tis_cap, tis_mode) or an elite pool needs
    it; the others get the truncated weight, C = 2. Synchronous runs keep the trainer's π_old and no weight. The run's
    plan resolves it; the validated config keeps what was given."""
    from posttrain.train.plan import plan

    stale = ["rollout.placement=separate", "rollout.max_staleness=1"]
    cfg = config.load(recipe, [*stale, *given])[0]
    assert (plan(cfg).rollout.proximal, plan(cfg).rollout.tis_cap) == (proximal, tis_cap)
    assert cfg.rollout.tis_cap == (3.0 if "rollout.tis_cap=3" in given else None)  # as given: nothing written into it
    r = plan(config.load(recipe)[0]).rollout
    assert (r.proximal, r.tis_cap) == ("trainer", None)
