"""`posttrain reproduce figure5|figure7`: DeepSeekMath's two central comparisons (arXiv:2402.03300, §5.2) at toy
scale, on the embedded default, with seeds.

    posttrain reproduce figure5 [seeds=3] [steps=100] [output_dir=runs/figure5] [overwrite=true] [key=value ...]
    posttrain reproduce figure7 [seeds=3] [steps=140] [k=64] [problems=200] [output_dir=runs/figure7] [...]

figure5: RFT, Online RFT, GRPO with outcome supervision and GRPO with process supervision, each from the same cached
SFT warm-up, on one budget: `steps` steps each drawing 256 samples (Online RFT and both GRPOs: 32 prompts × 8
samples; RFT: 256 rows a step of its set of the warm-up's correct samples, drawn once from 1024 prompts × 4). Every
other setting is the method's own recipe, none tuned for this comparison. It runs `posttrain compare` with `seeds=N`
on those four recipes (written to output_dir/recipes), and adds figure5.png, held-out greedy accuracy against step
(mean ± sd over seeds), and figure5.md, whether each of the paper's orderings held: Online RFT > RFT, GRPO > Online
RFT, GRPO+PS > GRPO.

figure7: for each seed, a GRPO run (`grpo_math`, `steps` steps), then Pass@K and Maj@K for K = 1, 2, 4, … (the
powers of two up to k) on `problems` held-out problems, from k samples per problem at temperature 0.7, of the start
(the SFT warm-up) and of the trained policy (`posttrain.train.evaluation`). figure7.png draws both curves before and
after, as the paper's figure does; figure7.md says at each K how much RL lifted each, and whether Maj@K rose more
than Pass@K.

An ordering of figure5 *holds* when the means are in the paper's order and the difference exceeds the seed-to-seed
spread (Δ > sd_a + sd_b, `posttrain.apps.spread`); the report also counts the seeds in which it holds pairwise (seed s
of one method against seed s of the other: the same warm-up, data and sampling seed). figure7's "Maj@K rose more"
is paired too: the lift gap (Maj@K lift − Pass@K lift) of each seed, whose mean must be positive and above its sd.
With one seed there is no spread, and the reports say n/a.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from posttrain.apps.spread import Spread, beyond, mean_of, sd_of
from posttrain.core.errors import UserError
from posttrain.core.outputs import check_output_dir

FIGURE5 = {"rft": "rft_math", "online_rft": "online_rft_math", "grpo": "grpo_math", "grpo_ps": "grpo_ps_math"}
LABELS = {"rft": "RFT", "online_rft": "Online RFT", "grpo": "GRPO", "grpo_ps": "GRPO+PS"}
ORDERINGS = [("online_rft", "rft"), ("grpo", "online_rft"), ("grpo_ps", "grpo")]  # (should be higher, lower)
SAMPLES_PER_STEP = 256  # 32 prompts × 8 samples; RFT: 256 rows
OWN = {"figure5": ("seeds", "steps", "output_dir", "overwrite"),
       "figure7": ("seeds", "steps", "k", "problems", "output_dir", "overwrite")}


def settings_of(figure: str, items: list[str]) -> tuple[dict, list[str]]:
    """(reproduce's own keys with defaults, the overrides passed on to every run)."""
    if figure not in OWN:
        raise UserError(f"reproduce: unknown figure {figure!r}; known: figure5, figure7")
    defaults = {"figure5": dict(seeds=3, steps=100, output_dir="runs/figure5", overwrite="false"),
                "figure7": dict(seeds=3, steps=140, k=64, problems=200, output_dir="runs/figure7",
                                overwrite="false")}[figure]
    own, passed = dict(defaults), []
    for item in items:
        key, eq, value = item.partition("=")
        if not eq:
            raise UserError(f"{item}: expected key=value (reproduce {figure} takes {', '.join(OWN[figure])} and run "
                            "overrides)")
        if key in OWN[figure]:
            own[key] = value
        else:
            passed.append(item)
    for key in ("seeds", "steps", "k", "problems"):
        if key in own:
            try:
                own[key] = int(own[key])
            except ValueError:
                raise UserError(f"{key}={own[key]}: expected an integer") from None
            if own[key] < 1:
                raise UserError(f"{key}={own[key]}: must be ≥ 1")
    if own["overwrite"] not in ("true", "false"):
        raise UserError(f"overwrite={own['overwrite']}: expected true or false")
    out = check_output_dir(own["output_dir"], example=f"runs/{figure}")
    if out.exists() and not out.is_dir():
        raise UserError(f"output_dir: '{out}' is a file, not a directory")
    if out.is_dir() and any(out.iterdir()) and own["overwrite"] != "true":
        raise UserError(f"output_dir: '{out}' is not empty; pass overwrite=true or another output_dir=…")
    own["output_dir"] = out
    return own, passed


# -- Figure 5 -------------------------------------------------------------------------------------------------------
def figure5_recipes(out: Path) -> list[str]:
    """The four recipes with the shared samples-per-step, written under out/recipes; their paths."""
    import yaml

    from posttrain import config

    paths = []
    (out / "recipes").mkdir(parents=True, exist_ok=True)
    for name, recipe in FIGURE5.items():
        tree = yaml.safe_load(config.recipe_path(recipe).read_text())
        tree["output_dir"] = f"runs/{name}"
        tree["description"] = f"{tree.get('description', recipe)} (figure5: {SAMPLES_PER_STEP} samples a step)"
        if name == "rft":
            tree["train"]["batch_size"] = SAMPLES_PER_STEP
        else:
            tree["train"]["batch_size"] = SAMPLES_PER_STEP // 8
            tree["algorithm"]["samples_per_prompt" if name == "online_rft" else "group_size"] = 8
        path = out / "recipes" / f"{name}.yaml"
        path.write_text(yaml.safe_dump(tree, sort_keys=False))
        paths.append(str(path))
    return paths


def ordering_rows(final: dict[str, Spread | float], seeds: dict[str, list[float]]) -> list[dict]:
    """For each of ORDERINGS: the two means ± sd, their difference, the difference seed by seed (mean ± sd: the runs
    of a seed share its warm-up), in how many seeds it holds, and the verdict (on the means and their spread)."""
    rows = []
    for high, low in ORDERINGS:
        a, b = final[high], final[low]
        wins = sum(x > y for x, y in zip(seeds[high], seeds[low]))
        held = mean_of(a) > mean_of(b) and beyond(a, b) if len(seeds[high]) > 1 else None  # None: no spread
        paired = Spread(tuple(x - y for x, y in zip(seeds[high], seeds[low])))  # each seed's: one warm-up for both
        rows.append({"ordering": f"{LABELS[high]} > {LABELS[low]}", "higher": a, "lower": b,
                     "difference": mean_of(a) - mean_of(b), "spread": sd_of(a) + sd_of(b), "seed_by_seed": paired,
                     "seeds_holding": wins, "seeds": len(seeds[high]), "holds": held})
    return rows


def figure5(own: dict, passed: list[str]) -> int:
    from posttrain.apps import compare

    out = own["output_dir"]
    argv = [*figure5_recipes(out), f"steps={own['steps']}", f"seeds={own['seeds']}", f"output_dir={out}",
            "overwrite=true", *passed]
    try:
        results = compare.run_comparison(argv)  # writes compare's own report too; the figures use its data
    except compare.RunFailed as err:
        print(f"posttrain: error: {err}", file=sys.stderr)
        return 1
    curves = {name: [[(p["step"], p["eval_accuracy"]) for p in run["curve"] if p.get("eval_accuracy") is not None]
                     for run in runs] for name, runs in results.seed_runs.items()}
    finals = {name: [run["accuracy_after"] for run in runs] for name, runs in results.seed_runs.items()}
    final = {name: Spread(tuple(v)) if len(v) > 1 else v[0] for name, v in finals.items()}
    rows = ordering_rows(final, finals)
    plot_curves(curves, out / "figure5.png")
    (out / "figure5.md").write_text(figure5_markdown(final, rows, own, passed))
    (out / "figure5.json").write_text(json.dumps({"final_accuracy": finals, "orderings": rows}, indent=2,
                                                 default=lambda x: x.as_json()) + "\n")
    verdict = {True: "holds beyond the spread", False: "not beyond the spread", None: "one seed: no spread"}
    for row in rows:
        print(f"{row['ordering']}: {row['higher']:.3f} vs {row['lower']:.3f} "
              f"({row['seeds_holding']}/{row['seeds']} seeds; {verdict[row['holds']]})")
    print(f"report: {out / 'figure5.md'}, figure5.png, compare.md")
    return 0


def plot_curves(curves: dict[str, list[list[tuple[int, float]]]], path: Path,
                title: str = "Figure 5 at toy scale: the embedded task") -> None:
    """Held-out accuracy against step, one line per method (or setting) at the mean over seeds, a band of ± sd."""
    import statistics

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.8), constrained_layout=True)
    for name, runs in curves.items():
        steps = sorted(set.intersection(*(set(s for s, _ in run) for run in runs)))
        values = [[dict(run)[s] for run in runs] for s in steps]
        mean = [statistics.fmean(v) for v in values]
        sd = [statistics.stdev(v) if len(v) > 1 else 0.0 for v in values]
        line, = ax.plot(steps, mean, marker="o", label=LABELS.get(name, name))
        ax.fill_between(steps, [m - d for m, d in zip(mean, sd)], [m + d for m, d in zip(mean, sd)],
                        color=line.get_color(), alpha=0.18, linewidth=0)
    seeds = len(next(iter(curves.values())))
    ax.set_xlabel("step")
    ax.set_ylabel("held-out accuracy (greedy)" + (f", mean ± sd over {seeds} seeds" if seeds > 1 else ""))
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def figure5_markdown(final: dict, rows: list[dict], own: dict, passed: list[str]) -> str:
    lines = ["# Figure 5 at toy scale", "",
             f"Command: `posttrain reproduce figure5 seeds={own['seeds']} steps={own['steps']}"
             + "".join(f" {p}" for p in passed) + "`", "",
             f"Each method: {own['steps']} steps of {SAMPLES_PER_STEP} samples from the same SFT warm-up; the rest is "
             "its own recipe (recipes/). compare.md has every figure.", "",
             "| method | held-out accuracy after |", "|---|---:|"]
    lines += [f"| {LABELS[n]} | {final[n]:.3f} |" for n in FIGURE5]
    lines += ["", "| the paper's ordering | mean difference | sd sum | seed by seed | seeds in which it holds | "
              "holds beyond the spread |", "|---|---:|---:|---:|---:|---|"]
    yes = {True: "yes", False: "no", None: "n/a (one seed)"}
    lines += [f"| {r['ordering']} | {r['difference']:+.3f} | {r['spread']:.3f} | {r['seed_by_seed']:+.3f} | "
              f"{r['seeds_holding']}/{r['seeds']} | {yes[r['holds']]} |" for r in rows]
    return "\n".join(lines + ["", "![held-out accuracy against step](figure5.png)", ""])


# -- Figure 7 -------------------------------------------------------------------------------------------------------
def figure7(own: dict, passed: list[str]) -> int:
    from posttrain.apps import compare, evaluate

    out, k = own["output_dir"], own["k"]
    # the run's held-out rows are those evaluated here (from data.path without a test_path they are its last rows)
    plan = compare.plan(["grpo_math", f"steps={own['steps']}", "eval_every=0", f"seeds={own['seeds']}",
                         f"output_dir={out}", "overwrite=true", *passed, f"eval.num_problems={own['problems']}"])
    evals = ["eval.num_problems=" + str(own["problems"]), f"eval.k={k}", f"eval.n={k}", "rollout.temperature=0.7",
             *[p for p in passed if p.startswith(("data.", "eval.batch_size", "rollout.max_new_tokens"))]]
    results = []
    for i, (run_dir, extra) in enumerate(plan.runs("grpo_math"), 1):
        seed = (extra or [o for o in plan.overrides if o.startswith("seed=")])[0]  # the run's, for its sampling too
        print(f"posttrain reproduce: GRPO run {i}/{own['seeds']} ({seed}) into {run_dir}", file=sys.stderr)
        try:
            compare.run_one("grpo_math", "grpo_math", plan, f"[grpo_math, {seed}]", run_dir, tuple(extra))
        except compare.RunFailed as err:
            if err.code == 2:
                raise UserError(f"grpo_math ({seed}): the run refused its input: {err.last_line}") from None
            print(f"posttrain: error: grpo_math ({seed}): the run failed (exit status {err.code}): {err.last_line}",
                  file=sys.stderr)
            return 1
        summary = json.loads((run_dir / "summary.json").read_text())
        start = (summary.get("warmup") or {}).get("path") or _model_path(run_dir)  # the SFT warm-up, or model.path
        curves = {}
        for when, model in (("before", start), ("after", run_dir / "model")):
            print(f"posttrain reproduce: Pass@K and Maj@K {when} GRPO ({seed}), K ≤ {k}", file=sys.stderr)
            report = evaluate.main(str(model), [*evals, seed], output=str(run_dir / f"eval_{when}.json"), quiet=True)
            curves[when] = report["curve"]
        results.append(curves)
    Ks = results[0]["before"]["K"]
    table = {f"{what}_{when}": [Spread(v) if len(v) > 1 else v[0] for v in
                                zip(*(r[when][what] for r in results))]
             for what in ("pass", "maj") for when in ("before", "after")}
    (out / "figure7.json").write_text(json.dumps({"K": Ks, "seeds": results, "table": table}, indent=2,
                                                 default=lambda x: x.as_json()) + "\n")
    plot_figure7(Ks, table, out / "figure7.png")
    (out / "figure7.md").write_text(figure7_markdown(Ks, table, own, passed))
    last = len(Ks) - 1
    lift_maj, lift_pass = table["maj_after"][last] - table["maj_before"][last], \
        table["pass_after"][last] - table["pass_before"][last]
    print(f"K={Ks[last]}: Maj@K {table['maj_before'][last]:.3f} -> {table['maj_after'][last]:.3f}, Pass@K "
          f"{table['pass_before'][last]:.3f} -> {table['pass_after'][last]:.3f} (lift {lift_maj:+.3f} against "
          f"{lift_pass:+.3f})")
    print(f"report: {out / 'figure7.md'}, figure7.png")
    return 0


def _model_path(run_dir: Path) -> str:
    import yaml

    return yaml.safe_load((run_dir / "config.yaml").read_text())["model"]["path"]


def plot_figure7(Ks: list[int], table: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.6), constrained_layout=True, sharey=True)
    for ax, what, title in zip(axes, ("maj", "pass"), ("Maj@K", "Pass@K")):
        for when, label, style in (("before", "SFT warm-up", "--"), ("after", "after GRPO", "-")):
            values = table[f"{what}_{when}"]
            mean, sd = [mean_of(v) for v in values], [sd_of(v) for v in values]
            line, = ax.plot(Ks, mean, style, marker="o", label=label)
            ax.fill_between(Ks, [m - d for m, d in zip(mean, sd)], [m + d for m, d in zip(mean, sd)],
                            color=line.get_color(), alpha=0.18, linewidth=0)
        ax.set_xscale("log", base=2)
        ax.set_xticks(Ks, [str(K) for K in Ks])
        ax.set_xlabel("K")
        ax.set_title(f"{title}, held-out, temperature 0.7")
        ax.grid(alpha=0.3)
        ax.legend()
    axes[0].set_ylabel("accuracy (mean ± sd over seeds)")
    fig.savefig(path, dpi=110)
    plt.close(fig)


def figure7_markdown(Ks: list[int], table: dict, own: dict, passed: list[str]) -> str:
    lines = ["# Figure 7 at toy scale", "",
             f"Command: `posttrain reproduce figure7 seeds={own['seeds']} steps={own['steps']} k={own['k']} "
             f"problems={own['problems']}" + "".join(f" {p}" for p in passed) + "`", "",
             f"{own['problems']} held-out problems, {own['k']} samples each at temperature 0.7, before (the SFT "
             f"warm-up) and after {own['steps']} GRPO steps; mean ± sd over {own['seeds']} seeds. The lift is after "
             "− before, seed by seed, and so is the gap between the two lifts; the gap is beyond the spread when its "
             "mean is positive (Maj@K rose more) and above its sd.", "",
             "| K | Maj@K before | Maj@K after | lift | Pass@K before | Pass@K after | lift | Maj@K lift − Pass@K "
             "lift | beyond the spread |", "|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for i, K in enumerate(Ks):
        lift_maj = table["maj_after"][i] - table["maj_before"][i]
        lift_pass = table["pass_after"][i] - table["pass_before"][i]
        gap = lift_maj - lift_pass
        exceeds = ("yes" if mean_of(gap) > sd_of(gap) else "no") if own["seeds"] > 1 else "n/a (one seed)"
        lines.append(f"| {K} | {table['maj_before'][i]:.3f} | {table['maj_after'][i]:.3f} | {lift_maj:+.3f} | "
                     f"{table['pass_before'][i]:.3f} | {table['pass_after'][i]:.3f} | {lift_pass:+.3f} | {gap:+.3f} |"
                     f" {exceeds} |")
    return "\n".join(lines + ["", "![Maj@K and Pass@K before and after GRPO](figure7.png)", ""])


def main(figure: str, items: list[str]) -> int:
    own, passed = settings_of(figure, items)
    own["output_dir"].mkdir(parents=True, exist_ok=True)
    return figure5(own, passed) if figure == "figure5" else figure7(own, passed)
