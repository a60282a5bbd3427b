"""Bad input that the config refuses before any work, through the real CLI in this process (`posttrain_here`): recipes
and overrides that are not YAML mappings, and keys that cannot take effect for the method in use. Each case is one
line naming the culprit, exit status 2. Also what `posttrain config` and `--help` must show."""

from __future__ import annotations

import pytest
from cli_helpers import assert_one_line_error, posttrain_fresh, posttrain_here

from posttrain import algorithms
from posttrain.apps.cli import METHODS


def write(tmp_path, name: str, text: str) -> str:
    (tmp_path / name).write_text(text)
    return str(tmp_path / name)


RECIPES = [  # (file text, fragment): recipe files that are YAML but not a mapping of groups
    ("- a\n- b\n", "expected a mapping of groups (model:, data:, algorithm:, ...) at the top level, got a list"),
    ("3\n", "cannot be read as YAML"),
]


@pytest.mark.parametrize("text, fragment", RECIPES, ids=["list", "scalar"])
def test_a_recipe_that_is_not_a_mapping(tmp_path, text, fragment):
    path = write(tmp_path, "mine.yaml", text)
    assert_one_line_error(posttrain_here("run", f"recipe={path}", f"output_dir={tmp_path / 'o'}"), path, fragment)
    assert not (tmp_path / "o").exists()


OVERRIDES = [  # (override, fragment): values that are not YAML
    ('algorithm.beta="0.1', "algorithm.beta: the value '\"0.1' cannot be read as YAML (found unexpected end of stream)"),
    ("train.beta_values=[0.1,", "train.beta_values: the value '[0.1,' cannot be read as YAML"),
    ("rewards={accuracy: 1", "rewards: the value '{accuracy: 1' cannot be read as YAML"),
    ("=3", "override '=3': expected key=value"),
    ("rollout.engine=", "rollout.engine: empty; give a value (str), e.g. rollout.engine=..."),
    ("train.steps=", "train.steps: empty; give a value (int)"),
]


@pytest.mark.parametrize("override, fragment", OVERRIDES, ids=["quote", "bracket", "brace", "no-key", "empty-str", "empty-int"])
def test_an_override_that_is_not_yaml(tmp_path, override, fragment):
    assert_one_line_error(posttrain_here("run", "recipe=grpo_math", override, f"output_dir={tmp_path / 'o'}"),
                          fragment)


IGNORED = [  # (recipe, override, fragments): a key the method would never read
    ("grpo_math", "rewards.process=steps", ["rewards.process: step rewards are trained on by grpo_ps", "grpo trains"]),
    ("ppo_math", "rewards.process=model", ["rewards.process: step rewards are trained on by grpo_ps", "ppo trains"]),
    ("sft_math", "rewards.process=steps", ["rewards.process:", "sft trains on none"]),
    ("sft_math", "rewards.format=0.5", ["rewards.format: read by the methods that score rewards (cispo, grpo, gspo,",
                                        "sft scores none"]),
    ("rft_math", "rewards.format=0.5", ["rewards.format:", "rft scores none"]),
    ("dpo_math", "rewards={format: 1.0}", ["rewards.format:", "dpo scores none"]),
    ("sft_math", "rewards.timeout_s=3", ["rewards.timeout_s:", "sft scores none"]),
    ("sft_math", "rewards.custom={my.py:f: 1.0}", ["rewards.custom:", "sft scores none"]),
    ("sft_math", "reward_model.path=/nowhere", ["reward_model.path:", "sft scores none"]),
    ("grpo_ps_math", "reward_model.path=/nowhere", ["reward_model.path: grpo_ps trains on step rewards",
                                                    "reward_model.process_path"]),
    ("grpo_math", "reward_model.weight=3", ["reward_model.weight:", "no reward model is given"]),
    ("grpo_math", "reward_model.process_path=/nowhere", ["reward_model.process_path: read with rewards.process=model"]),
    ("grpo_math", "algorithm.clip_eps_high=0.1", ["algorithm.clip_eps_high: 0.1 is below clip_eps=0.2"]),
    ("ppo_math", "algorithm.clip_eps_high=0.1", ["algorithm.clip_eps_high: 0.1 is below clip_eps=0.2"]),
    ("dapo_math", "algorithm.clip_eps=0.3", ["algorithm.clip_eps_high: 0.28 is below clip_eps=0.3"]),
    ("gspo_math", "algorithm.clip_eps_high=1e-4", ["algorithm.clip_eps_high:", "GSPO clips a sequence ratio"]),
    ("grpo_math", "rollout.tis_mode=token_mask", ["rollout.tis_mode: token_mask bounds the ratio by tis_cap, which is "
                                                  "off (null); give rollout.tis_cap=C"]),
]


@pytest.mark.parametrize("recipe, override, fragments", IGNORED, ids=[f"{r}-{o}" for r, o, _ in IGNORED])
def test_a_key_the_method_would_ignore(tmp_path, recipe, override, fragments):
    assert_one_line_error(posttrain_here("run", f"recipe={recipe}", override, f"output_dir={tmp_path / 'o'}"),
                          *fragments)
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.partial").exists()


@pytest.mark.parametrize("recipe, override", [
    ("grpo_math", "rewards.format=0.5"), ("grpo_ps_math", "rewards.format=0.5"),  # logged beside the step rewards
    ("grpo_math", "algorithm.clip_eps_high=0.28"), ("ppo_math", "algorithm.clip_eps_high=0.2"),
    ("sft_math", "rewards.accuracy=1.0"), ("grpo_ps_math", "rewards.process=steps"),
])
def test_keys_the_method_reads_are_kept(recipe, override):
    proc = posttrain_here("config", f"recipe={recipe}", override)
    assert proc.returncode == 0, proc.stderr


def test_config_shows_the_rule_rewards_left_out():
    """`posttrain config` shows every key: a registered rule reward not weighed in is a comment, not absent."""
    shown = posttrain_here("config", "recipe=grpo_math").stdout
    group = shown[shown.index("\nrewards:\n"):].split("\n")[2:5]
    assert group == ["  accuracy: 1.0", "  # format: off (a registered rule reward; rewards.format=0.1 weighs it in)",
                     "  custom: {}"]
    assert "# format" not in posttrain_here("config", "recipe=grpo_math", "rewards.format=0.5").stdout
    assert "# format" not in posttrain_here("config", "recipe=sft_math").stdout  # SFT scores no reward


def test_help_names_every_registered_method():
    """`posttrain --help` lists the methods by their papers' names; one registered later must be added to it."""
    names = {"sft": "SFT", "rft": "RFT", "online_rft": "Online RFT", "dpo": "DPO", "online_dpo": "Online DPO",
             "ppo": "PPO", "grpo": "GRPO", "grpo_ps": "GRPO+PS", "gspo": "GSPO", "rloo": "RLOO",
             "reinforce_pp": "REINFORCE++", "cispo": "CISPO", "sapo": "SAPO", "distill": "on-policy distillation"}
    assert set(algorithms.REGISTRY) == set(names)
    listed = [m.split(" (")[0] for m in METHODS.split(";")[0].split(", ")]
    assert sorted(listed) == sorted(names.values())
    assert METHODS in " ".join(posttrain_here("--help").stdout.split())


# --- settings that cannot take effect, or would take the machine down ---------------------------------------------

CANNOT_TAKE_EFFECT = [  # (recipe, overrides, fragments): a key given that the run would never read
    ("grpo_math", ["rollout.placement=separate", "rollout.reference_on=workers", "algorithm.beta=0"],
     ["rollout.reference_on: workers hold the frozen models", "grpo with algorithm.beta=0 has none"]),
    ("gspo_math", ["rollout.placement=separate", "rollout.reference_on=workers"],  # the recipe's β is 0
     ["rollout.reference_on:", "gspo with algorithm.beta=0 has none"]),
    ("sft_math", ["rollout.tis_cap=2"], ["rollout.tis_cap: weighs each token of the samples an online method draws",
                                         "sft trains on none"]),
    ("rft_math", ["rollout.tis_cap=2"], ["rollout.tis_cap:", "rft trains on none"]),
    ("dpo_math", ["rollout.tis_cap=2"], ["rollout.tis_cap:", "dpo trains on none"]),
    ("grpo_math", ["rollout.weight_bucket_mb=16"], ["rollout.weight_bucket_mb: applies to rollout.placement=separate"]),
    ("grpo_math", ["rollout.worker_timeout_s=30"], ["rollout.worker_timeout_s: applies to rollout.placement=separate"]),
    ("grpo_math", ["rollout.max_worker_restarts=1"], ["rollout.max_worker_restarts: applies to"]),
]


@pytest.mark.parametrize("recipe, overrides, fragments", CANNOT_TAKE_EFFECT,
                         ids=["beta0", "gspo", "sft-tis", "rft-tis", "dpo-tis", "bucket", "timeout", "restarts"])
def test_a_setting_that_cannot_take_effect(recipe, overrides, fragments):
    """Before: each was accepted, and the run went on without it (a reference held by workers that nothing asked
    for, a cap on importance weights no sample carries, worker settings with no workers)."""
    assert_one_line_error(posttrain_here("config", f"recipe={recipe}", *overrides), *fragments)


@pytest.mark.parametrize("overrides", [
    ["rollout.placement=separate", "rollout.reference_on=workers"],  # β = 0.04: the workers score the reference
    ["rollout.tis_cap=2"],  # grpo's samples carry the rollout engine's log-probs
    ["rollout.placement=separate", "rollout.weight_bucket_mb=16", "rollout.worker_timeout_s=30",
     "rollout.max_worker_restarts=1"],
])
def test_the_same_settings_where_they_take_effect(overrides):
    proc = posttrain_here("config", "recipe=grpo_math", *overrides)
    assert proc.returncode == 0, proc.stderr


@pytest.fixture
def two_cores(monkeypatch):
    """This process may use 2 cores, whatever the machine: the affinity {0, 1}, no cgroup quota, one process."""
    from posttrain.core import threads

    monkeypatch.setattr(threads, "allowed_cpus", lambda: {0, 1})
    monkeypatch.setattr(threads, "cgroup_quota", lambda root=threads.CGROUP: None)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)


OVERSUBSCRIBED = [  # (overrides, fragments): more threads or processes than cores
    (["train.threads=1000"], ["train.threads: 1000 threads on the 2 cores this process may use",
                              "give at most 2, or 0 to fit them"]),
    (["train.threads=3"], ["train.threads: 3 threads on the 2 cores"]),
    (["rollout.placement=separate", "rollout.workers=6"], ["rollout.workers: 6 worker processes on the 2 cores",
                                                           "give at most 2"]),
    (["rollout.placement=separate", "rollout.worker_threads=1000"],
     ["rollout.worker_threads: 1000 threads in each worker on the 2 cores"]),
    (["rollout.placement=separate", "rollout.workers=2", "rollout.worker_threads=2"],
     ["rollout.worker_threads: 2 threads in each of 2 workers (4) on the 2 cores"]),
]


@pytest.mark.parametrize("overrides, fragments", OVERSUBSCRIBED,
                         ids=["threads", "threads-3", "workers", "worker-threads", "workers-x-threads"])
def test_more_threads_than_cores_is_refused(two_cores, overrides, fragments):
    """Before: accepted, and a 2-core run slowed from about 11,000 tokens/s to 180-230, saying nothing."""
    assert_one_line_error(posttrain_here("config", "recipe=grpo_math", *overrides), *fragments)


@pytest.mark.parametrize("overrides", [
    ["train.threads=2"], ["train.threads=1"],
    ["rollout.placement=separate", "rollout.workers=2", "rollout.worker_threads=1"],  # tests/test_async.py's
    ["rollout.placement=separate", "rollout.worker_threads=2"],
])
def test_as_many_threads_as_cores_are_kept(two_cores, overrides):
    proc = posttrain_here("config", "recipe=grpo_math", *overrides)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("value", ["abc", "0", "-1", "1.5"])
def test_omp_num_threads_that_is_no_thread_count(monkeypatch, value):
    """Before: ignored by posttrain (it fitted the threads as if unset) while libgomp printed its own complaint."""
    monkeypatch.setenv("OMP_NUM_THREADS", value)
    assert_one_line_error(posttrain_here("config", "recipe=grpo_math"),
                          f"OMP_NUM_THREADS: {value!r} in the environment is not a thread count")


def test_omp_num_threads_above_the_cores(two_cores, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1000")
    assert_one_line_error(posttrain_here("config", "recipe=grpo_math"),
                          "OMP_NUM_THREADS: 1000 threads on the 2 cores this process may use")
    proc = posttrain_here("config", "recipe=grpo_math", "train.threads=1")  # train.threads wins: 1 thread
    assert proc.returncode == 0, proc.stderr


def test_a_bad_omp_num_threads_is_one_line_from_a_new_interpreter(monkeypatch):
    """libgomp complains on stderr when torch loads it: the refusal comes first, so it is the only line."""
    monkeypatch.setenv("OMP_NUM_THREADS", "abc")
    assert_one_line_error(posttrain_fresh("config", "recipe=grpo_math"), "OMP_NUM_THREADS: 'abc'")
