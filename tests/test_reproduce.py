"""`posttrain reproduce figure5|figure7`: the settings it takes, the budget it gives each method, the verdict on each of
the paper's orderings; and (slow) both commands end to end at a tiny size."""

import json

import pytest
import yaml
from cli_helpers import assert_one_line_error, posttrain, posttrain_here

from posttrain.apps import reproduce
from posttrain.apps.spread import Spread
from posttrain.core.errors import UserError


def test_settings_and_refusals(tmp_path):
    own, passed = reproduce.settings_of("figure7", ["seeds=2", "k=8", f"output_dir={tmp_path / 'o'}", "seed=3"])
    assert (own["seeds"], own["steps"], own["k"], own["problems"]) == (2, 140, 8, 200) and passed == ["seed=3"]
    assert reproduce.settings_of("figure5", [])[0]["steps"] == 100
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    for figure, items, message in [("figure6", [], "unknown figure 'figure6'"), ("figure5", ["seeds=0"], "seeds=0"),
                                   ("figure5", ["k=4"], None), ("figure7", ["steps=x"], "steps=x: expected an integer"),
                                   ("figure5", [f"output_dir={tmp_path / 'full'}"], "is not empty"),
                                   ("figure5", ["grpo"], "grpo: expected key=value")]:
        if message is None:  # k is figure7's; for figure5 it is a run override, checked by the runs
            assert reproduce.settings_of(figure, items)[1] == items
            continue
        with pytest.raises(UserError, match=message):
            reproduce.settings_of(figure, items)
    assert_one_line_error(posttrain_here("reproduce", "figure9"), "reproduce: unknown figure 'figure9'")


def test_figure5_gives_every_method_the_same_samples_per_step(tmp_path):
    paths = reproduce.figure5_recipes(tmp_path)
    trees = {p.rsplit("/", 1)[1].removesuffix(".yaml"): yaml.safe_load(open(p)) for p in paths}
    assert list(trees) == ["rft", "online_rft", "grpo", "grpo_ps"]
    assert trees["rft"]["train"]["batch_size"] == 256  # rows of its fixed set of correct samples
    assert trees["online_rft"]["train"]["batch_size"] * trees["online_rft"]["algorithm"]["samples_per_prompt"] == 256
    for name in ("grpo", "grpo_ps"):
        assert trees[name]["train"]["batch_size"] * trees[name]["algorithm"]["group_size"] == 256
    assert trees["grpo_ps"]["rewards"]["process"] == "steps" and trees["grpo"]["algorithm"]["beta"] == 0.04
    from posttrain import config

    for p in paths:  # every written recipe loads as it stands
        config.load(p, [])


def test_an_ordering_holds_only_beyond_the_spread():
    seeds = {"rft": [0.40, 0.42, 0.44], "online_rft": [0.50, 0.52, 0.54], "grpo": [0.51, 0.60, 0.49],
             "grpo_ps": [0.45, 0.47, 0.46]}
    final = {n: Spread(tuple(v)) for n, v in seeds.items()}
    rows = {r["ordering"]: r for r in reproduce.ordering_rows(final, seeds)}
    assert rows["Online RFT > RFT"]["holds"] and rows["Online RFT > RFT"]["seeds_holding"] == 3
    assert rows["Online RFT > RFT"]["difference"] == pytest.approx(0.10)
    grpo = rows["GRPO > Online RFT"]  # means 0.533 vs 0.52: right order, but within sd 0.059 + 0.02
    assert grpo["difference"] > 0 and not grpo["holds"] and grpo["seeds_holding"] == 2
    ps = rows["GRPO+PS > GRPO"]
    assert ps["difference"] < 0 and not ps["holds"] and ps["seeds_holding"] == 0
    paired = rows["Online RFT > RFT"]["seed_by_seed"]  # 0.1 in every seed
    assert paired.values == pytest.approx((0.1, 0.1, 0.1)) and format(paired, "+.3f") == "+0.100 ± 0.000"
    assert grpo["seed_by_seed"].values == pytest.approx((0.01, 0.08, -0.05))


def test_figure5_takes_the_comparison_as_data(tmp_path, monkeypatch):
    """figure5 builds on what `compare.run_comparison` returns, not on compare.json: here the comparison is replaced
    by one that runs nothing and writes no file. Two seeds; GRPO+PS ends at 0.5 and 0.7, so its final accuracy is
    0.6 ± 0.141 and GRPO+PS > GRPO (0.3 in both seeds) holds in 2 of 2 seeds and beyond the spread."""
    from posttrain.apps import compare

    def run(after: float) -> dict:
        return {"accuracy_after": after, "curve": [{"step": 0, "wall_seconds": 0.0, "eval_accuracy": 0.1},
                                                   {"step": 2, "wall_seconds": 1.0, "eval_accuracy": after}]}

    finals = {"rft": (0.1, 0.1), "online_rft": (0.2, 0.2), "grpo": (0.3, 0.3), "grpo_ps": (0.5, 0.7)}
    seed_runs = {name: [run(a) for a in after] for name, after in finals.items()}
    given = []

    def comparison(argv):
        given.append(argv)
        return compare.Results(compare.Plan({n: n for n in finals}, argv, tmp_path, [], 2, 1), seed_runs)

    monkeypatch.setattr(compare, "run_comparison", comparison)
    own, passed = reproduce.settings_of("figure5", ["seeds=2", "steps=2", f"output_dir={tmp_path}"])
    assert reproduce.figure5(own, passed) == 0
    assert "seeds=2" in given[0] and not (tmp_path / "compare.json").exists()
    report = json.loads((tmp_path / "figure5.json").read_text())
    assert report["final_accuracy"] == {name: list(after) for name, after in finals.items()}
    ps = report["orderings"][-1]
    assert ps["ordering"] == "GRPO+PS > GRPO" and ps["seeds_holding"] == 2 and ps["holds"]
    assert ps["higher"]["mean"] == pytest.approx(0.6) and ps["higher"]["sd"] == pytest.approx(0.1414, abs=1e-4)
    assert ps["seed_by_seed"]["values"] == pytest.approx([0.2, 0.4])
    assert "| GRPO+PS > GRPO | +0.300 | 0.141 | +0.300 ± 0.141 | 2/2 | yes |" in (tmp_path / "figure5.md").read_text()
    assert (tmp_path / "figure5.png").stat().st_size > 10_000


@pytest.mark.slow
def test_both_figures_end_to_end_at_a_tiny_size(tiny_model_dir, tmp_path):
    small = [f"model.path={tiny_model_dir}", "eval.num_problems=4", "data.train_size=60", "data.test_size=8",
             "rollout.max_new_tokens=6"]
    proc = posttrain("reproduce", "figure5", "seeds=2", "steps=2", f"output_dir={tmp_path / 'f5'}", *small)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "f5" / "figure5.json").read_text())
    assert set(report["final_accuracy"]) == {"rft", "online_rft", "grpo", "grpo_ps"}
    assert all(len(v) == 2 for v in report["final_accuracy"].values())
    assert (tmp_path / "f5" / "figure5.png").stat().st_size > 10_000 and "GRPO+PS > GRPO" in proc.stdout
    proc = posttrain("reproduce", "figure7", "seeds=2", "steps=1", "k=4", "problems=4",
                     f"output_dir={tmp_path / 'f7'}", *small)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "f7" / "figure7.json").read_text())
    assert report["K"] == [1, 2, 4] and len(report["seeds"]) == 2
    assert report["seeds"][0]["before"]["pass"][0] == pytest.approx(report["seeds"][0]["before"]["maj"][0])
    assert "| 4 |" in (tmp_path / "f7" / "figure7.md").read_text()


def test_one_seed_has_no_spread_to_judge_by():
    seeds = {"rft": [0.4], "online_rft": [0.5], "grpo": [0.6], "grpo_ps": [0.7]}
    rows = reproduce.ordering_rows({n: v[0] for n, v in seeds.items()}, seeds)
    assert [r["holds"] for r in rows] == [None, None, None] and [r["seeds_holding"] for r in rows] == [1, 1, 1]
