"""Tests of several objectives normalised apart (`rewards.normalize`, posttrain/judge.py), against the z-scores
written out as loops, and of the key in the config.

The objectives: accuracy (0/1, weight 1), `scales.length` = 100 · characters (weight 0.5), `scales.vague` = 1, or
None ("could not score", counted as 0) on the completion "no" (weight 0.25); and, where given, a reward model scoring
the count of 7s in a completion (weight 3).
"""

import statistics

import pytest
import torch
import yaml

from posttrain import config, rewards
from posttrain.core.errors import ConfigError
from posttrain.judge import Judge
from posttrain.schema import DataConfig, RewardsConfig

SCALES = '''
def length(completions, answers, prompts):
    return [100.0 * len(c) for c in completions]


def vague(completions, answers, prompts):
    return [None if c == "no" else 1.0 for c in completions]
'''

# Ragged groups, shuffled and numbered out of order: 5 (3 samples), 2 (2), 9 (2, accuracy constant), 4 (1).
RAGGED = ["#### 7", "#### 8", "#### 77", "#### 7", "so #### 7", "no", "so #### 7", "#### 8"]
GROUP = [5, 2, 5, 9, 2, 5, 9, 4]
ACCURACY = [1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0]  # reference 7


def sevens(prompts, completions):
    return [float(c.count("7")) for c in completions]


@pytest.fixture
def scales(tmp_path):
    (tmp_path / "scales.py").write_text(SCALES)
    return tmp_path / "scales.py"


def judge(scales, normalize, accuracy=1.0, model=False):
    rules = RewardsConfig({"accuracy": accuracy}, {f"{scales}:length": 0.5, f"{scales}:vague": 0.25},
                          normalize=normalize)
    return Judge(DataConfig(preset="gsm8k", path="g.jsonl"), rules, sevens if model else None, 3.0)


def rows(n):
    return [{"question": "What is 3 + 4?", "answer": "#### 7"}] * n


def raw_parts(model=False):
    """Each objective's weight and scores on RAGGED, by hand (a missing score as 0)."""
    parts = {"accuracy": (1.0, ACCURACY), "scales.length": (0.5, [100.0 * len(c) for c in RAGGED]),
             "scales.vague": (0.25, [0.0 if c == "no" else 1.0 for c in RAGGED])}
    return {**parts, "model": (3.0, sevens(None, RAGGED))} if model else parts


def written_out(parts, group):
    """Σ_k w_k (r_k − mean) / (stdev + 1e-4), each group in a loop; a group of one has stdev 0."""
    total = [0.0] * len(group)
    for weight, r in parts.values():
        for g in set(group):
            members = [i for i, h in enumerate(group) if h == g]
            values = [r[i] for i in members]
            mean, std = statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0
            for i in members:
                total[i] += weight * (r[i] - mean) / (std + 1e-4)
    return total


def within_group_std(r, group):
    """The mean over samples of the stdev of each sample's group."""
    std = {g: statistics.stdev([r[i] for i, h in enumerate(group) if h == g]) if group.count(g) > 1 else 0.0
           for g in set(group)}
    return sum(std[g] for g in group) / len(group)


def test_none_is_the_plain_weighted_sum(scales):
    """normalize=none returns what `rewards.combine` sums, bit for bit, with or without group ids; the ids add only
    the spread of each objective."""
    cfg = RewardsConfig({"accuracy": 1.0}, {f"{scales}:length": 0.5, f"{scales}:vague": 0.25})
    expected = torch.tensor(rewards.combine(cfg)(RAGGED, ["#### 7"] * 8, ["Q"] * 8).total)
    plain, stats = judge(scales, "none").score(rows(8), RAGGED)
    grouped, grouped_stats = judge(scales, "none").score(rows(8), RAGGED, group=torch.tensor(GROUP))
    assert torch.equal(plain, expected) and torch.equal(grouped, expected)
    assert not any(k.endswith("/std") for k in stats) and "reward/normalized" not in grouped_stats
    assert grouped_stats["reward/scales.length/std"] > 0


def test_group_hand_worked(scales):
    """Group 0: "#### 7", "#### 77": accuracy [1, 0], length [600, 700], vague [1, 1]; the raw sums
    1 + 300 + 0.25 = 301.25 and 350.25 put the wrong, longer answer first. z-scored (stdev 0.70711 and 70.711, plus eps 1e-4): accuracy ±0.5 / 0.70721 =
    ±0.70701, length ∓50 / 70.711 = ∓0.70711, so the total is 0.70701 − 0.5·0.70711 = ±0.35345: the right answer
    first, as the weights say.
    Group 1: "#### 7", "so #### 7": accuracy [1, 1] is constant and adds 0; length [600, 900] -> ∓0.70711, total
    ∓0.35355 (raw 301.25, 451.25). `vague` is 1 everywhere and adds 0. `reward` is the raw mean, 1404 / 4 = 351."""
    completions = ["#### 7", "#### 77", "#### 7", "so #### 7"]
    total, stats = judge(scales, "group").score(rows(4), completions, group=torch.tensor([0, 0, 1, 1]))
    assert total.tolist() == pytest.approx([0.35345, -0.35345, -0.35355, 0.35355], abs=1e-5)
    assert stats["reward"] == 351.0
    assert stats["reward/normalized"] == pytest.approx(0.0, abs=1e-6)


def test_group_matches_the_written_out_loop_for_ragged_shuffled_groups(scales):
    """Every objective, the reward model included, z-scored within its group then weighted; a missing score ("no":
    vague None) counts 0 before normalising; the group of one sample gets 0."""
    total, _ = judge(scales, "group", model=True).score(rows(8), RAGGED, group=torch.tensor(GROUP))
    expected = written_out(raw_parts(model=True), GROUP)
    assert total.tolist() == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert total[7] == 0.0
    assert torch.tensor(expected).abs().max() < 5  # a z-score, not the 100× scale of `length`


def test_constant_objective_adds_nothing_and_weights_scale_contributions(scales):
    """Group 9 ("#### 7", "so #### 7") has accuracy constant: doubling accuracy's weight moves no sample of it,
    and moves every other sample by exactly its accuracy z-score."""
    group = torch.tensor(GROUP)
    once, _ = judge(scales, "group").score(rows(8), RAGGED, group=group)
    twice, _ = judge(scales, "group", accuracy=2.0).score(rows(8), RAGGED, group=group)
    z_accuracy = written_out({"accuracy": (1.0, ACCURACY)}, GROUP)
    assert (twice - once).tolist() == pytest.approx(z_accuracy, abs=1e-5)
    assert (twice - once)[[3, 6]].tolist() == [0.0, 0.0]
    assert z_accuracy[0] > 0.5  # the check above is not vacuous


def test_batch_normalises_over_the_whole_batch(scales):
    """normalize=batch is the loop over one group of all samples, whatever the group ids; normalize=group without
    ids is the same."""
    expected = written_out(raw_parts(), [0] * 8)
    by_batch, stats = judge(scales, "batch").score(rows(8), RAGGED, group=torch.tensor(GROUP))
    no_ids, _ = judge(scales, "group").score(rows(8), RAGGED)
    assert by_batch.tolist() == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert no_ids.tolist() == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert by_batch.tolist() != pytest.approx(written_out(raw_parts(), GROUP), abs=1e-3)
    assert stats["reward/normalized"] == pytest.approx(0.0, abs=1e-6)


def test_stats_report_each_objective_raw_and_its_spread_within_groups(scales):
    """`reward` stays the raw weighted mean, `reward/<name>` each raw mean, `reward/<name>/std` the mean over
    samples of the stdev within their group (the group of one: 0), and `reward/normalized` the mean returned."""
    total, stats = judge(scales, "group", model=True).score(rows(8), RAGGED, group=torch.tensor(GROUP))
    parts = raw_parts(model=True)
    raw = [sum(w * r[i] for w, r in parts.values()) for i in range(8)]
    assert stats["reward"] == pytest.approx(sum(raw) / 8)
    assert stats["reward/normalized"] == pytest.approx(float(total.mean()))
    assert stats["reward/scales.vague"] == pytest.approx(7 / 8) and stats["reward/verify_errors"] == 1.0
    for name, (_, r) in parts.items():
        assert stats[f"reward/{name}"] == pytest.approx(sum(r) / 8)
        assert stats[f"reward/{name}/std"] == pytest.approx(within_group_std(r, GROUP)), name
    assert stats["reward/scales.length/std"] > 100 * stats["reward/accuracy/std"] > 0


def test_group_ids_of_the_wrong_shape_are_refused(scales):
    with pytest.raises(ValueError, match=r"\(3,\) group ids for 8 completions"):
        judge(scales, "group").score(rows(8), RAGGED, group=torch.tensor([0, 0, 1]))


def test_unknown_value_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"^rewards.normalize: unknown 'bogus'; known: none, group, batch$"):
        config.load("grpo_math", ["rewards.normalize=bogus"])


@pytest.mark.parametrize("recipe", ["sft_math", "rft_math", "dpo_math"])
def test_offline_methods_refuse_it(recipe):
    with pytest.raises(ConfigError, match=r"^rewards.normalize: .* trains on no such samples$"):
        config.load(recipe, ["rewards.normalize=group"])
    assert config.load(recipe, ["rewards.normalize=none"])[0].rewards.normalize == "none"


@pytest.mark.parametrize("recipe, extra, message", [
    ("online_rft_math", [], "keeps the samples whose reward reaches algorithm.threshold"),
    ("grpo_ps_math", [], "trains on step rewards"),
    ("ppo_math", ["algorithm.samples_per_prompt=1"], "draws one per prompt (every reward would be 0); use rewards.normalize=batch"),
])
def test_methods_it_would_mislead_refuse_it(recipe, extra, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        config.load(recipe, ["rewards.normalize=group", *extra])
    assert config.load("ppo_math", ["rewards.normalize=batch"])[0].rewards.normalize == "batch"


def test_recipe_round_trip_keeps_the_key(tmp_path):
    """In a recipe, on the command line, and back through the resolved config.yaml: `normalize` is a reserved key,
    not a reward."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("algorithm: {name: grpo}\nrewards: {accuracy: 1.0, format: 0.1, normalize: group}\n")
    cfg, resolved = config.load(str(recipe))
    assert cfg.rewards.normalize == "group" and cfg.rewards.weights == {"accuracy": 1.0, "format": 0.1}
    assert resolved["rewards"]["normalize"] == "group"
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(resolved))
    again, _ = config.load(str(tmp_path / "config.yaml"))
    assert again.rewards == cfg.rewards
    cli, _ = config.load("grpo_math", ["rewards={accuracy: 1.0, format: 0.5, normalize: group}"])
    assert cli.rewards.normalize == "group" and cli.rewards.weights == {"accuracy": 1.0, "format": 0.5}
    assert config.load("grpo_math")[1]["rewards"]["normalize"] == "none"
