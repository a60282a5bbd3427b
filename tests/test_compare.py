"""`posttrain compare`: the plan (one budget for all), the numbers of a run, the report for any number of recipes, an
end-to-end comparison of GRPO and PPO, one-line errors, and the estimator against the bytes measured per role."""

import json

import pytest
from cli_helpers import assert_one_line_error, posttrain

from posttrain import config
from posttrain.apps import compare
from posttrain.apps.compare import reporting
from posttrain.apps.estimate import model_spec, state_bytes
from posttrain.core.errors import ConfigError, UserError

FAST = ["eval.num_problems=4", "train.batch_size=2", "rollout.max_new_tokens=6", "data.train_size=100",
        "data.test_size=20"]
CRITIC = {"critic_weights", "critic_gradients", "critic_optimizer_state"}


def test_plan_shares_one_budget(tmp_path):
    """Recipe a trains 30 steps and scores 50 problems with seed 0; b trains 20, scores 80, seed 3, on easier data.
    compare runs both for min(30, 20) = 20 steps, evaluates every 20 // 5 = 4 steps, on the same min(50, 80) = 50
    problems, with a's seed, and notes each choice and the data difference it leaves alone."""
    (tmp_path / "a.yaml").write_text("algorithm: {name: grpo}\ntrain: {steps: 30}\neval: {num_problems: 50}\n")
    (tmp_path / "b.yaml").write_text("seed: 3\nalgorithm: {name: ppo}\ndata: {difficulty: 1}\n"
                                     "train: {steps: 20}\neval: {num_problems: 80}\n")
    a, b, out = tmp_path / "a.yaml", tmp_path / "b.yaml", f"output_dir={tmp_path / 'c'}"
    p = compare.plan([str(a), str(b), out, "train.batch_size=4"])
    assert list(p.recipes) == ["a", "b"] and p.steps == 20 and p.eval_every == 4
    assert p.overrides == ["train.batch_size=4", "train.steps=20", "eval.every=4", "seed=0", "eval.num_problems=50"]
    assert [n.split(" ")[0] for n in p.notes] == ["steps:", "seed:", "eval.num_problems:", "the"]
    assert "data.difficulty (a=2, b=1)" in p.notes[-1]
    assert compare.plan([str(a), str(b), "steps=7", "eval.num_problems=9", out]).eval_every == 1
    with pytest.raises(ConfigError, match=r"^b: algorithm\.group_size: unknown key"):
        compare.plan([str(a), str(b), "algorithm.group_size=2", out])
    with pytest.raises(UserError, match="steps=0: must be ≥ 1"):
        compare.plan(["ppo_math", "steps=0", out])


def fake_run() -> dict:
    """Three steps, a warm-up of 10 s built before the run, evaluation at step 2 and after the last step.

    Medians: rollout median(1, 3, 2) = 2, reward 0.1, scoring 0.5, update 2, step 6; other = step − the four phases
    = (0.4, 0.4, 0.5), median 0.4. Throughput: generated 600 tokens / 6 s rollout = 100 tok/s; trained 500 tokens /
    8 s update = 62.5 tok/s. Wall times are the run's own (20 s in all, step 2 at 11 s); the warm-up is reported apart.
    """
    phases = [(1.0, 0.1, 0.5, 2.0, 4.0), (3.0, 0.1, 0.5, 2.0, 6.0), (2.0, 0.3, 0.7, 4.0, 7.5)]
    metrics = [{"step": i + 1, "time/rollout": r, "time/reward": w, "time/score": s, "time/update": u,
                "time/step": t, "generated_tokens": g, "trained_tokens": n, "reward": rew, "wall_seconds": wall}
               for i, ((r, w, s, u, t), g, n, rew, wall) in enumerate(zip(phases, (100, 200, 300), (100, 150, 250),
                                                                         (0.2, 0.4, 0.6), (5, 11, 18)))]
    metrics[1]["eval_accuracy"] = 0.5
    summary = {"algorithm": "grpo", "steps": 3, "wall_seconds": 20.0, "peak_rss_mb": 500.0,
               "warmup": {"cached": False, "seconds": 10.0, "path": "/nonexistent"},
               "eval_before": {"accuracy": 0.25, "num_problems": 4},
               "eval_after": {"accuracy": 0.75, "num_problems": 4},
               "memory": {"roles_bytes": {"policy_weights": 2**20, "policy_gradients": 2**20},
                          "cpu_peak_rss_mb": {"rollout": 400.0, "scoring": 420.0, "update": 500.0}}}
    resolved = {"model": {"path": None, "ref_path": None}, "train": {"precision": "fp32"}, "algorithm": {},
                "reward_model": {"path": None}}
    return compare.numbers(summary, metrics, resolved)


def test_numbers_of_a_run():
    run = fake_run()
    assert run["time_median_s"] == pytest.approx({"rollout": 2.0, "reward": 0.1, "scoring": 0.5, "update": 2.0,
                                                  "other": 0.4, "step": 6.0})
    assert run["throughput"] == pytest.approx({"generated_tokens_per_s": 100.0, "trained_tokens_per_s": 62.5})
    assert run["wall_seconds"] == 20.0 and run["warmup_seconds"] == 10.0
    assert run["estimated_roles_bytes"] is None  # the model directory is gone
    acc = [(p["step"], p["wall_seconds"], p["eval_accuracy"]) for p in run["curve"] if "eval_accuracy" in p]
    assert acc == [(0, 0.0, 0.25), (2, 11, 0.5), (3, 18, 0.75)]  # the final evaluation lands on the last step
    assert reporting._curve_cells(run) == {0: "0.250 at 0.0 s", 2: "0.500 at 11.0 s, reward 0.300",
                                           3: "0.750 at 18.0 s, reward 0.600"}


def test_report_for_any_number_of_recipes(tmp_path):
    runs = {name: fake_run() for name in ("a", "b", "c")}
    runs["c"]["memory"]["roles_bytes"]["critic_weights"] = 3 * 2**20
    runs["c"]["memory"]["cuda_peak_allocated_mb"] = {"update": 123.0}
    runs["b"]["memory"]["roles_bytes"]["process_reward_model_weights"] = 2**20  # a role compare has no label for
    titles = []
    for title, header, rows in compare.tables(runs):
        titles.append(title)
        assert len(header) == 4 and all(len(r) == 4 for r in rows), title
    assert titles[:2] == ["Outcome", "Memory (MiB)"]
    memory = {r[0]: r[1:] for r in compare.tables(runs)[1][2]}
    assert memory["critic weights"] == ["–", "–", "3.00"] and memory["CUDA max allocated, update phase"][2] == "123"
    assert memory["process reward model weights"] == ["–", "1.00", "–"]
    p = compare.Plan({n: n for n in runs}, list(runs), tmp_path, ["train.steps=3"], 3, 2)
    compare.report(compare.Results(p, {n: [r] for n, r in runs.items()}))
    written = json.loads((tmp_path / "compare.json").read_text())
    assert written["runs"]["c"]["throughput"]["trained_tokens_per_s"] == 62.5 and "seed_runs" not in written
    assert "| held-out accuracy after | 0.750 | 0.750 | 0.750 |" in (tmp_path / "compare.md").read_text()
    assert (tmp_path / "compare.png").stat().st_size > 10_000


def test_the_comparison_returns_the_results_it_writes(tmp_path, monkeypatch):
    """`run_comparison` hands back as data what compare.json holds (`posttrain reproduce` builds on it): here with
    the runs and their reading replaced, two seeds of two recipes."""
    per_seed = {"grpo_math": [fake_run(), fake_run()], "ppo_math": [fake_run(), fake_run()]}
    per_seed["ppo_math"][1]["accuracy_after"] = 0.5
    ran = []
    monkeypatch.setattr(compare, "run_all", ran.append)
    monkeypatch.setattr(compare, "read", lambda p: compare.Results(p, per_seed))
    results = compare.run_comparison(["grpo_math", "ppo_math", "seeds=2", "steps=3", f"output_dir={tmp_path}"])
    assert ran == [results.plan] and results.plan.seed_list == [0, 1] and results.seed_runs is per_seed
    assert results.runs["ppo_math"]["accuracy_after"].values == (0.75, 0.5)
    written = json.loads((tmp_path / "compare.json").read_text())
    assert written == json.loads(json.dumps(results.as_json(), default=lambda x: x.as_json()))
    assert written["seed_runs"]["ppo_math"][1]["accuracy_after"] == 0.5 and written["settings"]["steps"] == 3


def test_compare_grpo_and_ppo(tiny_model_dir, tmp_path):
    out = tmp_path / "cmp"
    proc = posttrain("compare", "grpo_math", "ppo_math", f"model.path={tiny_model_dir}", "steps=2",
                     f"output_dir={out}", *FAST)
    assert proc.returncode == 0, proc.stderr
    assert "[grpo_math] step 2/2" in proc.stderr and "[ppo_math] step 2/2" in proc.stderr  # progress, streamed
    assert "Memory (MiB)" in proc.stdout and "policy AdamW state" in proc.stdout
    for name in ("compare.md", "compare.json", "compare.png"):
        assert (out / name).stat().st_size > 0
    report = json.loads((out / "compare.json").read_text())
    assert list(report["runs"]) == ["grpo_math", "ppo_math"] and report["settings"]["steps"] == 2
    grpo, ppo = (report["runs"][k] for k in ("grpo_math", "ppo_math"))
    for run in (grpo, ppo):
        assert {"policy_weights", "policy_gradients", "policy_optimizer_state", "reference_weights"} <= set(
            run["memory"]["roles_bytes"])
        assert set(run["memory"]["cpu_peak_rss_mb"]) == {"rollout", "scoring", "update"}
        assert [p["step"] for p in run["curve"] if "eval_accuracy" in p] == [0, 1, 2]  # eval_every = max(1, 2 // 5)
    assert CRITIC <= set(ppo["memory"]["roles_bytes"]) and not CRITIC & set(grpo["memory"]["roles_bytes"])

    again = posttrain("compare", "grpo_math", "ppo_math", f"output_dir={out}")
    assert_one_line_error(again, "output_dir", "not empty", "overwrite=true")


def test_unknown_recipe_is_one_line(tmp_path):
    proc = posttrain("compare", "grpo_math", "no_such_recipe", f"output_dir={tmp_path / 'cmp'}")
    assert_one_line_error(proc, "no_such_recipe", "known:", "ppo_math")
    assert not (tmp_path / "cmp").exists()
    assert posttrain("compare", "--help").returncode == 0


def test_a_run_that_refuses_its_input_stops_the_comparison(tiny_model_dir, tmp_path):
    proc = posttrain("compare", "grpo_math", "ppo_math", f"model.path={tiny_model_dir}", "steps=1",
                     f"data.path={tmp_path / 'missing.jsonl'}", f"output_dir={tmp_path / 'cmp'}", *FAST)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("posttrain: error: grpo_math: the run refused its input: data"), last
    assert "[ppo_math]" not in proc.stderr  # stopped at the first failure


@pytest.mark.parametrize("size", [dict(), dict(hidden=512, layers=6, heads=8)], ids=["tiny", "20M"])
def test_estimator_agrees_with_measured_roles(tmp_path, size):
    """One PPO step in fp32 (policy, reference, critic): the estimator's weights, gradients and AdamW moments are
    within 10% of the bytes measured per role. torch's AdamW adds a 4-byte step per tensor, the critic has a 1-output
    head instead of the tied lm_head; both are far below 10%."""
    from posttrain.models.embedded import build_model_dir
    from posttrain.train import run

    model = build_model_dir(tmp_path / "model", **size)
    spec = model_spec(str(model))
    assert (15e6 < spec.n_params < 25e6) if size else spec.n_params < 1e6
    one_step = ["train.precision=fp32", "train.steps=1", "train.batch_size=1", "rollout.max_new_tokens=4",
                "eval.num_problems=0", "data.train_size=20", "data.test_size=5", "algorithm.samples_per_prompt=1",
                "algorithm.ppo_epochs=1", "algorithm.num_minibatches=1"]
    cfg, resolved = config.load("ppo_math", [f"model.path={model}", f"output_dir={tmp_path / 'run'}", *one_step])
    run(cfg, resolved, quiet=True)
    measured = compare.load_run(tmp_path / "run")
    trained, frozen = state_bytes(spec, dtype="fp32", master_weights=False), state_bytes(spec, dtype="fp32",
                                                                                         trained=False)
    expected = {"policy_weights": trained.params, "policy_gradients": trained.grads,
                "policy_optimizer_state": trained.moments, "reference_weights": frozen.params,
                "critic_weights": trained.params, "critic_gradients": trained.grads,
                "critic_optimizer_state": trained.moments}
    roles = measured["memory"]["roles_bytes"]
    for role, est in expected.items():
        assert abs(roles[role] - est) / est < 0.10, (role, roles[role], est)
    assert measured["estimated_roles_bytes"] == expected  # what the report shows next to the measured bytes


def test_spread_pairs_seeds_and_reads_mean_plus_minus_sd():
    from posttrain.apps.spread import Spread, beyond, over_seeds

    before, after = Spread((0.2, 0.4, 0.3)), Spread((0.5, 0.6, 0.7))
    change = after - before  # seed by seed: 0.3, 0.2, 0.4
    assert change.values == pytest.approx((0.3, 0.2, 0.4)) and change.mean == pytest.approx(0.3)
    assert change.sd == pytest.approx(0.1) and format(change, "+.3f") == "+0.300 ± 0.100"
    assert format(Spread((1.0, 1.0)) / 2, ".2f") == "0.50 ± 0.00" and sum([Spread((1.0, 2.0)), 1]).values == (2, 3)
    assert beyond(Spread((0.5, 0.6)), Spread((0.9, 1.0))) and not beyond(Spread((0.5, 0.7)), Spread((0.6, 0.8)))
    a, b = fake_run(), fake_run()
    b["accuracy_after"], b["curve"][-1]["eval_accuracy"], b["wall_seconds"] = 0.95, 0.95, 22.0
    merged = over_seeds([a, b])
    assert merged["steps"] == 3 and merged["memory"]["roles_bytes"]["policy_weights"] == 2**20  # equal: as it was
    assert merged["accuracy_after"].values == (0.75, 0.95) and merged["wall_seconds"].values == (20.0, 22.0)
    assert merged["curve"][-1]["eval_accuracy"].values == (0.75, 0.95) and merged["curve"][0]["eval_accuracy"] == 0.25
    assert over_seeds([a]) is a


def test_report_over_seeds_says_which_differences_exceed_the_spread(tmp_path):
    from posttrain.apps.spread import over_seeds

    def seeds(*accuracies):
        runs = []
        for acc in accuracies:
            run = fake_run()
            run["accuracy_after"] = run["curve"][-1]["eval_accuracy"] = acc
            runs.append(run)
        return runs

    per_seed = {"a": seeds(0.50, 0.52, 0.54), "b": seeds(0.70, 0.72, 0.74), "c": seeds(0.45, 0.55, 0.65),
                "d": seeds(0.47, 0.57, 0.67)}
    runs = {name: over_seeds(each) for name, each in per_seed.items()}
    p = compare.Plan({n: n for n in runs}, list(runs), tmp_path, ["train.steps=3"], 3, 2, seed_list=[0, 1, 2])
    compare.report(compare.Results(p, per_seed))
    md = (tmp_path / "compare.md").read_text()
    assert "| held-out accuracy after | 0.520 ± 0.020 | 0.720 ± 0.020 | 0.550 ± 0.100 | 0.570 ± 0.100 |" in md
    # bars 0.50–0.54 and 0.70–0.74; seed by seed b − a is 0.2 in every seed
    assert "| held-out accuracy after | a | b | +0.200 | 0.040 | yes | +0.200 ± 0.000 | 3/3 |" in md
    assert "| held-out accuracy after | a | c | +0.030 | 0.120 | no | +0.030 ± 0.080 | 2/3 |" in md  # −0.05, 0.03, 0.11
    assert "| held-out accuracy after | b | c | -0.170 | 0.120 | yes | -0.170 ± 0.080 | 0/3 |" in md
    # the bars overlap (0.2 of spread against 0.02), but d is above c by 0.02 in every seed: what pairing shows
    assert "| held-out accuracy after | c | d | +0.020 | 0.200 | no | +0.020 ± 0.000 | 3/3 |" in md
    assert "seeds 0, 1, 2" in md
    written = json.loads((tmp_path / "compare.json").read_text())
    assert written["runs"]["a"]["accuracy_after"]["mean"] == pytest.approx(0.52)
    assert written["runs"]["a"]["accuracy_after"]["values"] == [0.5, 0.52, 0.54]
    assert [r["accuracy_after"] for r in written["seed_runs"]["c"]] == [0.45, 0.55, 0.65]
    assert (tmp_path / "compare.png").stat().st_size > 10_000


def test_compare_over_seeds_plans_each_recipe_once_per_seed(tmp_path):
    out = tmp_path / "cmp"
    p = compare.plan(["grpo_math", "seeds=2", "seed=5", f"output_dir={out}"])
    assert p.seed_list == [5, 6] and not any(o.startswith("seed=") for o in p.overrides)
    assert p.runs("grpo_math") == [(out / "grpo_math" / "seed_5", ["seed=5"]),
                                   (out / "grpo_math" / "seed_6", ["seed=6"])]


@pytest.mark.slow  # four runs; compare's own path is test_compare_grpo_and_ppo's
def test_compare_over_seeds_runs_each_recipe_once_per_seed(tiny_model_dir, tmp_path):
    out = tmp_path / "cmp"
    proc = posttrain("compare", "grpo_math", "online_rft_math", f"model.path={tiny_model_dir}", "steps=1", "seeds=2",
                     f"output_dir={out}", *FAST)
    assert proc.returncode == 0, proc.stderr
    assert "[grpo_math, seed=1] step 1/1" in proc.stderr
    for name in ("grpo_math", "online_rft_math"):
        for seed in (0, 1):
            run = out / name / f"seed_{seed}"
            assert json.loads((run / "summary.json").read_text())["steps"] == 1
    report = json.loads((out / "compare.json").read_text())
    assert report["settings"]["seeds"] == [0, 1] and len(report["seed_runs"]["grpo_math"]) == 2
    configs = [(out / "grpo_math" / f"seed_{s}" / "config.yaml").read_text() for s in (0, 1)]
    assert "\nseed: 0\n" in configs[0] and "\nseed: 1\n" in configs[1]
    assert "Differences beyond the seed-to-seed spread" in (out / "compare.md").read_text()
