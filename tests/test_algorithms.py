"""The plugin base and the registry: the defaults a method inherits, and how names resolve."""

import pytest

from posttrain.algorithms import REGISTRY, Algorithm, get, plugin_of, register
from posttrain.core.errors import ConfigError


def test_defaults_are_one_update_per_batch():
    """A method that overrides nothing samples one completion per prompt, takes one optimizer step per batch (μ = 1,
    one minibatch), asks the engine for nothing, and leaves the token aggregation to `train.loss_agg`."""
    assert Algorithm.needs(None) == frozenset()
    assert Algorithm.samples_per_prompt(None) == 1
    assert Algorithm.epochs(None) == 1
    assert Algorithm.minibatches(None) == 1
    assert Algorithm.aggregation(None) is None
    batch = object()
    assert Algorithm.prepare(batch, None) == (batch, {})
    with pytest.raises(NotImplementedError):
        Algorithm.coefficient(batch, None, None)
    with pytest.raises(NotImplementedError):
        Algorithm.objective(batch, None, None)
    assert Algorithm.reward_threshold is None


def test_a_config_names_its_method():
    """`plugin_of` is one look-up from a config's class to its plugin, so no Config class may serve two methods."""
    for name in REGISTRY:
        assert plugin_of(get(name).Config()) is get(name)
    with pytest.raises(ValueError, match="its Config GRPOConfig is 'grpo'"):
        register("grpo_again")(type("GRPOAgain", (Algorithm,), {"Config": get("grpo").Config}))
    assert "grpo_again" not in REGISTRY


def test_builtins_registered_in_table_order():
    """Table 10's methods in its order (online DPO beside DPO), then GRPO's family in order of publication (GRPO+PS,
    from GRPO's paper, first), then on-policy distillation."""
    assert list(REGISTRY)[:14] == ["sft", "rft", "online_rft", "dpo", "online_dpo", "ppo", "grpo", "grpo_ps", "rloo",
                                   "reinforce_pp", "cispo", "gspo", "sapo", "distill"]
    assert all(get(name).name == name for name in REGISTRY)


def test_a_name_registers_once():
    with pytest.raises(ValueError, match="registered twice"):
        register("sft")(type("OtherSFT", (Algorithm,), {}))
    assert get("sft").__name__ == "SFT"


def test_unknown_name_lists_the_known_ones():
    # 'grop', not 'gpro': 'gpro' is as close to 'gspo' as to 'grpo', and difflib breaks the tie alphabetically
    known = ("known: cispo, distill, dpo, grpo, grpo_ps, gspo, online_dpo, online_rft, ppo, reinforce_pp, rft, rloo, "
             "sapo, sft")
    with pytest.raises(ConfigError, match=f"did you mean 'grpo'.*{known}"):
        get("grop")
