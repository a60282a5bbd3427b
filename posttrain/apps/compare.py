"""`posttrain compare`: several recipes on one budget, side by side.

    posttrain compare ppo_math grpo_math [steps=N] [eval_every=N] [seeds=N] [output_dir=runs/compare]
                      [overwrite=true] [key=value ...]

Each recipe runs in its own process (`python -m posttrain run`), one after another, so wall times and peak memory do
not mix. Every run gets the same overrides, and compare adds what a fair comparison needs: the same `seed`, the same
step budget (`steps`, default the smallest `train.steps` among the recipes), the same held-out problems (the smallest
`eval.num_problems`) and an evaluation every `eval_every` steps (default steps // 5), so that accuracy is recorded
against step and wall time. Other differences between the recipes' model, data, rollout or reward settings are
reported as notes, not changed. With `seeds=N` each recipe runs N times, with seeds seed, seed + 1, …, into
output_dir/<recipe>/seed_<s>; every figure is then reported as mean ± sd over the seeds (`posttrain.apps.spread`),
the plots draw bands and error bars, and the report lists which differences between recipes exceed the spread.

The report reads what each run recorded (summary.json and metrics.jsonl) and puts the recipes side by side, as many
as were given:

1. outcome: held-out accuracy before and after, wall time (a one-off SFT warm-up of the embedded model excluded);
2. memory: bytes held by each role (weights, gradients and AdamW state of the policy and critic, reference and reward
   model weights, the step's batch), counted from the tensors; peak RSS per phase on CPU and
   `torch.cuda.max_memory_allocated` per phase on a GPU;
3. the estimator's model-state bytes (`posttrain.apps.estimate.state_bytes`, fp32 runs only) next to the measured ones;
4. time: the median over steps of each phase, and throughput (generated tokens / sampling time, trained tokens /
   update time);
5. held-out accuracy and reward against step and wall time.

It prints the tables (rich) and writes compare.md, compare.json (every number) and compare.png (memory by role, time
by phase, accuracy against wall time) to output_dir. docs/compare.md says how to read them.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from posttrain import config
from posttrain.apps.spread import Spread, mean_of, over_seeds, sd_of, verdicts
from posttrain.core.errors import ConfigError, UserError

OWN_KEYS = ("output_dir", "overwrite", "steps", "eval_every", "seeds")
ROLES = {  # role in summary.json -> label, in report order; a role not listed is shown too (`roles_of`)
    "policy_weights": "policy weights", "policy_gradients": "policy gradients",
    "policy_optimizer_state": "policy AdamW state", "reference_weights": "reference weights",
    "critic_weights": "critic weights", "critic_gradients": "critic gradients",
    "critic_optimizer_state": "critic AdamW state", "reward_model_weights": "reward model weights",
    "rollout_batch": "step batch (ids, masks, log-probs, ...)",
}
COLORS = {"policy_weights": "#1f77b4", "policy_gradients": "#6baed6", "policy_optimizer_state": "#c6dbef",
          "reference_weights": "#2ca02c", "critic_weights": "#d62728", "critic_gradients": "#fc8d59",
          "critic_optimizer_state": "#fdd0a2", "reward_model_weights": "#9467bd", "rollout_batch": "#7f7f7f"}
OTHER_COLORS = ("#bcbd22", "#17becf", "#8c564b", "#e377c2")


def roles_of(runs: list[dict]) -> list[str]:
    """The roles any run measured: those of ROLES in its order, then any other (a new model a method holds)."""
    seen = {k for r in runs for k in r["memory"]["roles_bytes"]}
    return [k for k in ROLES if k in seen] + sorted(seen - ROLES.keys())


def role_label(role: str) -> str:
    return ROLES.get(role, role.replace("_", " "))


PHASES = {"rollout": "time/rollout", "reward": "time/reward", "scoring": "time/score", "update": "time/update"}
PHASE_LABELS = {"rollout": "rollout (sampling)", "reward": "reward", "scoring": "scoring (ref, old, values)",
                "update": "update (forward, backward, step)", "other": "other (collation, advantages, ...)"}
MEM_PHASES = ("rollout", "scoring", "update")
ALIGNED = ("model.", "warmup.", "data.", "rollout.", "rewards.", "reward_model.", "eval.max_new_tokens")
MIB = 2**20


@dataclass
class Plan:
    """What compare will run: one run directory per recipe under `out`, each with the same `overrides`."""

    recipes: dict[str, str]  # run name -> recipe name or path
    argv: list[str]  # as given, for the report
    out: Path
    overrides: list[str]  # with `seed=` when one seed; without it when several (`seed_list`)
    steps: int
    eval_every: int
    notes: list[str] = field(default_factory=list)
    seed_list: list[int] = field(default_factory=list)  # seeds=N: the seeds each recipe runs with; [] for one run

    def runs(self, name: str) -> list[tuple[Path, list[str]]]:
        """(run directory, extra overrides) of each run of recipe `name`."""
        if not self.seed_list:
            return [(self.out / name, [])]
        return [(self.out / name / f"seed_{s}", [f"seed={s}"]) for s in self.seed_list]


def _int(settings: dict, key: str, low: int) -> int | None:
    if key not in settings:
        return None
    try:
        value = int(settings[key])
    except ValueError:
        raise UserError(f"{key}={settings[key]}: expected an integer") from None
    if value < low:
        raise UserError(f"{key}={value}: must be ≥ {low}")
    return value


def _load_all(recipes: dict[str, str], overrides: list[str]) -> dict[str, dict]:
    resolved = {}
    for name, recipe in recipes.items():
        try:
            resolved[name] = config.load(recipe, overrides)[1]
        except ConfigError as err:  # a key valid for one recipe may not be for another (algorithm.*)
            raise ConfigError(f"{name}: {err}") from None
    return resolved


def plan(argv: list[str]) -> Plan:
    """Parses `RECIPE ... key=value ...`, validates every recipe with the overrides, and settles the shared budget."""
    names, settings, passed = [], {}, []
    for item in argv:
        key, eq, value = item.partition("=")
        if not eq:
            names.append(item)
        elif key == "recipe":
            raise UserError(f"{item}: give recipes as plain names, e.g. posttrain compare ppo_math grpo_math")
        elif key in OWN_KEYS:
            settings[key] = value
        else:
            passed.append(item)
    if not names:
        raise UserError(f"compare: give one or more recipes, e.g. posttrain compare ppo_math grpo_math (known: "
                        f"{', '.join(config.known_recipes())})")
    recipes = {}
    for recipe in names:
        name = config.recipe_path(recipe).stem  # an unknown recipe is a ConfigError listing the known ones
        if name in recipes:
            raise UserError(f"{recipe}: given twice (each recipe runs once, into output_dir/{name})")
        recipes[name] = recipe
    overwrite = settings.get("overwrite", "false").lower()
    if overwrite not in ("true", "false"):
        raise UserError(f"overwrite={settings['overwrite']}: expected true or false")
    out = Path(settings.get("output_dir", "runs/compare"))
    if out.exists() and not out.is_dir():
        raise UserError(f"output_dir: '{out}' is a file, not a directory")
    if out.is_dir() and any(out.iterdir()) and overwrite != "true":
        raise UserError(f"output_dir: '{out}' is not empty; pass overwrite=true or another output_dir=…")

    resolved, notes = _load_all(recipes, passed), []
    own = {"train.steps": _int(settings, "steps", 1), "eval.every": _int(settings, "eval_every", 0)}
    seeds = _int(settings, "seeds", 1) or 1
    user_keys = {item.partition("=")[0] for item in passed}
    per = {name: config.flatten(tree) for name, tree in resolved.items()}

    def values(key: str) -> str:
        return ", ".join(f"{name}={flat.get(key)}" for name, flat in per.items())

    if own["train.steps"] is None:
        own["train.steps"] = min(flat["train.steps"] for flat in per.values())
        notes.append(f"steps: {own['train.steps']} for every recipe, the smallest train.steps among them "
                     f"({values('train.steps')}); steps=N sets another budget")
    if own["eval.every"] is None and "eval.every" not in user_keys:
        own["eval.every"] = max(1, own["train.steps"] // 5)
    if "seed" not in user_keys:
        own["seed"] = next(iter(per.values()))["seed"]
        if len({flat["seed"] for flat in per.values()}) > 1:
            notes.append(f"seed: {own['seed']} for every recipe (they set {values('seed')})")
    problems = {flat["eval.num_problems"] for flat in per.values()}
    if len(problems) > 1 and "eval.num_problems" not in user_keys:
        own["eval.num_problems"] = min(problems)
        notes.append(f"eval.num_problems: {min(problems)} for every recipe, the smallest among them "
                     f"({values('eval.num_problems')}), so all are scored on the same held-out problems")
    overrides = passed + [f"{k}={v}" for k, v in own.items() if v is not None]
    per = {name: config.flatten(tree) for name, tree in _load_all(recipes, overrides).items()}
    for key in sorted({k for flat in per.values() for k in flat}):
        if key.startswith(ALIGNED) and len({json.dumps(flat.get(key)) for flat in per.values()}) > 1:
            notes.append(f"the recipes differ in {key} ({values(key)}); pass {key}=… to align them")
    every = next(iter(per.values()))["eval.every"]
    if seeds == 1:
        return Plan(recipes, argv, out, overrides, own["train.steps"], every, notes)
    base = next(iter(per.values()))["seed"]
    overrides = [o for o in overrides if o.partition("=")[0] != "seed"]
    return Plan(recipes, argv, out, overrides, own["train.steps"], every, notes, list(range(base, base + seeds)))


class RunFailed(Exception):
    def __init__(self, name: str, code: int, last_line: str):
        super().__init__(f"{name}: exit status {code}: {last_line}")
        self.name, self.code, self.last_line = name, code, last_line


def run_one(name: str, recipe: str, plan: Plan, tag: str, out: Path | None = None, extra: tuple = ()) -> None:
    """One `posttrain run` in its own process, into `out` (default output_dir/name), with the plan's overrides and
    `extra`; its output goes to our stderr, one line at a time, tagged."""
    cmd = [sys.executable, "-m", "posttrain", "run", f"recipe={recipe}", *plan.overrides, *extra,
           f"output_dir={out or plan.out / name}", "overwrite=true"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    last = ""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        for line in proc.stdout:
            line = line.split("\r")[-1].strip()  # a progress bar redraws with \r: keep what it shows last
            if line:
                last = line.removeprefix("posttrain: error: ")
                print(f"{tag} {line}", file=sys.stderr, flush=True)
        proc.wait()
    finally:
        if proc.poll() is None:  # interrupted: do not leave the run behind
            proc.terminate()
            proc.wait()
        proc.stdout.close()
    if proc.returncode:
        raise RunFailed(name, proc.returncode, last or "(no output)")


# -- the numbers of one run --------------------------------------------------------------------------------------
def _median(metrics: list[dict], key: str) -> float | None:
    xs = [m[key] for m in metrics if key in m]
    return statistics.median(xs) if xs else None


def _rate(metrics: list[dict], tokens: str, seconds: str) -> float | None:
    t = sum(m.get(seconds, 0.0) for m in metrics)
    return sum(m.get(tokens, 0.0) for m in metrics) / t if t > 0 and any(seconds in m for m in metrics) else None


def estimated_roles(resolved: dict, summary: dict) -> dict[str, int] | None:
    """What `posttrain.apps.estimate.state_bytes` predicts for each model-state role the run measured; None when it
    cannot say like for like: trained weights not fp32 (`train.precision=bf16`: torch's AdamW keeps moments in the
    weights' dtype, the estimator in fp32) or a model directory that is gone."""
    from posttrain.apps.estimate import model_spec, state_bytes

    model = resolved["model"]["path"] or (summary.get("warmup") or {}).get("path")
    precision = summary.get("precision") or resolved["train"].get("precision", "fp32")  # what ran: auto resolved
    if precision == "bf16" or not model:
        return None
    # bf16-mixed holds the models it only scores in bf16, fp16-mixed in fp16: two bytes a weight either way
    frozen = "fp32" if precision == "fp32" else "bf16"
    try:
        policy = state_bytes(model_spec(str(model)), dtype="fp32", master_weights=False)
        critic = state_bytes(model_spec(str(resolved["algorithm"].get("critic_path") or model)), dtype="fp32",
                             master_weights=False)
        ref = state_bytes(model_spec(str(resolved["model"]["ref_path"] or model)), dtype=frozen, trained=False)
        rm_path = resolved["reward_model"]["path"]
        rm = state_bytes(model_spec(str(rm_path)), dtype=frozen, trained=False) if rm_path else None
    except UserError:
        return None
    est = {"policy_weights": policy.params, "policy_gradients": policy.grads, "policy_optimizer_state": policy.moments,
           "reference_weights": ref.params, "critic_weights": critic.params, "critic_gradients": critic.grads,
           "critic_optimizer_state": critic.moments, "reward_model_weights": rm.params if rm else None}
    measured = summary.get("memory", {}).get("roles_bytes", {})
    return {role: est[role] for role in measured if est.get(role) is not None}


def numbers(summary: dict, metrics: list[dict], resolved: dict) -> dict:
    """Everything the report shows for one run, from its summary.json, metrics.jsonl and config.yaml."""
    warm = (summary.get("warmup") or {}).get("seconds", 0.0)  # a warm-up built before the run: not in its wall time
    medians = {phase: _median(metrics, key) for phase, key in PHASES.items()}
    medians["other"] = statistics.median([m["time/step"] - sum(m.get(k, 0.0) for k in PHASES.values())
                                          for m in metrics]) if metrics else None
    medians["step"] = _median(metrics, "time/step")
    before, after = (summary.get(k, {}).get("accuracy") for k in ("eval_before", "eval_after"))
    curve = [{"step": 0, "wall_seconds": 0.0, "eval_accuracy": before}] if before is not None else []
    for m in metrics:
        point = {"step": m["step"], "wall_seconds": m["wall_seconds"], "reward": m.get("reward")}
        if "eval_accuracy" in m:
            point["eval_accuracy"] = m["eval_accuracy"]
        curve.append(point)
    if after is not None and curve and "eval_accuracy" not in curve[-1]:
        curve[-1]["eval_accuracy"] = after  # evaluated after the last step only (eval.every=0)
    mem = summary.get("memory", {})
    return {
        "algorithm": summary.get("algorithm"), "steps": summary.get("steps"),
        "wall_seconds": summary["wall_seconds"], "warmup_seconds": warm,
        "accuracy_before": before, "accuracy_after": after,
        "eval_problems": summary.get("eval_before", {}).get("num_problems"),
        "memory": {"roles_bytes": mem.get("roles_bytes", {}), "cpu_peak_rss_mb": mem.get("cpu_peak_rss_mb", {}),
                   "cuda_peak_allocated_mb": mem.get("cuda_peak_allocated_mb", {}),
                   "peak_rss_mb": summary.get("peak_rss_mb")},
        "estimated_roles_bytes": estimated_roles(resolved, summary),
        "time_median_s": medians,
        "throughput": {"generated_tokens_per_s": _rate(metrics, "generated_tokens", "time/rollout"),
                       "trained_tokens_per_s": _rate(metrics, "trained_tokens", "time/update")},
        "curve": curve,
    }


def load_run(run_dir: str | Path) -> dict:
    """`numbers()` of a finished run directory."""
    import yaml

    run_dir = Path(run_dir)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return numbers(json.loads((run_dir / "summary.json").read_text()), metrics,
                   yaml.safe_load((run_dir / "config.yaml").read_text()))


# -- the report ----------------------------------------------------------------------------------------------------
def _f(x, fmt: str) -> str:
    return "–" if x is None else format(x, fmt)


def _mb(v: float | None) -> str:
    """MiB with about three significant figures."""
    if v is None:
        return "–"
    return f"{v:,.0f}" if v >= 100 else f"{v:.2f}" if v >= 1 else f"{v:.3g}"


def _mib(nbytes: int | None) -> str:
    return _mb(None if nbytes is None else nbytes / MIB)


def _curve_cells(run: dict) -> dict[int, str]:
    """Per evaluated step: accuracy, wall time, and the mean reward of the steps since the previous evaluation."""
    cells, rewards = {}, []
    for p in run["curve"]:
        if p.get("reward") is not None:
            rewards.append(p["reward"])
        if p.get("eval_accuracy") is not None:
            r = f", reward {sum(rewards) / len(rewards):.3f}" if rewards else ""
            wall = p["wall_seconds"]
            cells[p["step"]] = f"{p['eval_accuracy']:.3f} at {wall:.0f} s{r}" if wall >= 100 else \
                f"{p['eval_accuracy']:.3f} at {wall:.1f} s{r}"
            rewards = []
    return cells


def tables(runs: dict[str, dict]) -> list[tuple[str, list[str], list[list[str]]]]:
    """The report as (title, header, rows), recipes as columns: the same content for the terminal and markdown."""
    rs = list(runs.values())

    def row(label, cell):
        return [label, *(cell(r) for r in rs)]

    change = [r["accuracy_after"] - r["accuracy_before"] if r["accuracy_before"] is not None else None for r in rs]
    outcome = [row("held-out accuracy before", lambda r: _f(r["accuracy_before"], ".3f")),
               row("held-out accuracy after", lambda r: _f(r["accuracy_after"], ".3f")),
               ["change", *(_f(c, "+.3f") for c in change)],
               row("held-out problems", lambda r: _f(r["eval_problems"], "d")),
               row("steps", lambda r: _f(r["steps"], "d")),
               row("wall time (s)", lambda r: _f(r["wall_seconds"], ".1f"))]
    roles = roles_of(rs)
    memory = [row(role_label(k), lambda r, k=k: _mib(r["memory"]["roles_bytes"].get(k))) for k in roles]
    memory.append(row("all roles", lambda r: _mib(sum(r["memory"]["roles_bytes"].values()))))
    for key, what in (("cpu_peak_rss_mb", "peak RSS"), ("cuda_peak_allocated_mb", "CUDA max allocated")):
        for phase in MEM_PHASES:
            if any(phase in r["memory"][key] for r in rs):
                memory.append(row(f"{what}, {phase} phase", lambda r, k=key, p=phase: _mb(r["memory"][k].get(p))))
    memory.append(row("peak RSS, whole run", lambda r: _mb(r["memory"]["peak_rss_mb"])))

    def versus(r, k):
        est, got = (r["estimated_roles_bytes"] or {}).get(k), r["memory"]["roles_bytes"].get(k)
        return "–" if est is None or got is None else f"{_mib(got)} / {_mib(est)} ({(got - est) / est:+.1%})"

    est_roles = [k for k in roles if any(k in (r["estimated_roles_bytes"] or {}) for r in rs)]
    estimate = [row(role_label(k), lambda r, k=k: versus(r, k)) for k in est_roles]
    phases = ("rollout", "reward", "scoring", "update", "other")
    timing = [row(PHASE_LABELS[p], lambda r, p=p: _f(r["time_median_s"][p], ".3f")) for p in phases]
    timing += [row("step", lambda r: _f(r["time_median_s"]["step"], ".3f")),
               row("generated tokens/s (sampling)", lambda r: _f(r["throughput"]["generated_tokens_per_s"], ",.0f")),
               row("trained tokens/s (update)", lambda r: _f(r["throughput"]["trained_tokens_per_s"], ",.0f"))]
    cells = [_curve_cells(r) for r in rs]
    curve = [[str(s), *(c.get(s, "–") for c in cells)] for s in sorted({s for c in cells for s in c})]
    header = ["", *runs]
    out = [("Outcome", header, outcome), ("Memory (MiB)", header, memory)]
    if estimate:
        out.append(("Model-state bytes, measured / posttrain.apps.estimate (MiB)", header, estimate))
    out += [("Time per step (median over steps, s)", header, timing),
            ("Held-out accuracy against step and wall time (reward: mean since the previous point)",
             ["step", *runs], curve)]
    return out


def markdown(runs: dict[str, dict], plan: Plan) -> str:
    lines = [f"# posttrain compare: {', '.join(runs)}", "",
             f"Command: `posttrain compare {' '.join(plan.argv)}`", "",
             f"Overrides given to every run: `{' '.join(plan.overrides)}`", "",
             f"Every recipe ran {plan.steps} steps with the same overrides; held-out accuracy "
             + (f"every {plan.eval_every} step(s) and " if plan.eval_every else "")
             + "before and after. Wall time excludes a one-off SFT warm-up of the embedded model. docs/compare.md "
             "explains each row.",
             ""]
    lines += [f"- note: {n}" for n in plan.notes] + ([""] if plan.notes else [])
    if plan.seed_list:
        lines += [f"Each recipe ran with seeds {', '.join(map(str, plan.seed_list))}; every figure that differs "
                  "between them is their mean ± sample sd.", ""]
    for title, header, rows in tables(runs):
        lines += [f"## {title}", "", "| " + " | ".join(header) + " |",
                  "|---|" + "---:|" * (len(header) - 1)]
        lines += ["| " + " | ".join(r) + " |" for r in rows] + [""]
    if plan.seed_list and len(runs) > 1:
        lines += spread_section(runs)
    lines += ["![memory by role, time by phase, accuracy against wall time](compare.png)", ""]
    return "\n".join(lines)


def spread_section(runs: dict[str, dict]) -> list[str]:
    """Markdown: for every pair of recipes, whether their held-out accuracy after (and its change, when the recipes
    start from different accuracies) differ by more than the seed-to-seed spread (sd_a + sd_b;
    `posttrain.apps.spread`)."""
    lines = ["## Differences beyond the seed-to-seed spread", "",
             "A difference counts when |mean_b − mean_a| > sd_a + sd_b (the ± bars do not overlap): a rough screen "
             "with few seeds, not a significance test.", "",
             "| figure | a | b | mean b − mean a | sd a + sd b | beyond the spread |", "|---|---|---|---:|---:|---|"]
    change = {n: r["accuracy_after"] - r["accuracy_before"] if r["accuracy_before"] is not None else None
              for n, r in runs.items()}
    compared = [("held-out accuracy after", {n: r["accuracy_after"] for n, r in runs.items()})]
    if len({repr(r["accuracy_before"]) for r in runs.values()}) > 1:  # else the changes differ as the afters do
        compared.append(("change in held-out accuracy", change))
    for label, figures in compared:
        for a, b, diff, bar, yes in verdicts(figures):
            lines.append(f"| {label} | {a} | {b} | {diff:+.3f} | {bar:.3f} | {'yes' if yes else 'no'} |")
    return lines + [""]


def show(runs: dict[str, dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    for title, header, rows in tables(runs):
        table = Table(title=title, title_justify="left")
        for i, h in enumerate(header):
            table.add_column(h, justify="left" if i == 0 else "right")
        for r in rows:
            table.add_row(*r)
        console.print(table)


def plot(runs: dict[str, dict], path: Path) -> None:
    """Four panels: memory by role (stacked, MiB), time by phase (stacked medians, s), held-out accuracy against
    step and against wall time. Figures over seeds are drawn at their mean, with ± sd as error bars and bands."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names, rs = list(runs), list(runs.values())
    x = list(range(len(names)))
    fig, (mem, tim, by_step, by_wall) = plt.subplots(1, 4, figsize=(21, 5.6), constrained_layout=True)

    def stack(ax, series, colors, unit, fmt=_mb, totals=None):
        bottom = [0.0] * len(rs)
        for label, values, color in zip(series, series.values(), colors):
            ax.bar(x, values, 0.6, bottom=bottom, label=label, color=color, edgecolor="white", linewidth=0.5)
            bottom = [b + v for b, v in zip(bottom, values)]
        errors = [sd_of(t) for t in totals] if totals else [0.0] * len(rs)
        if any(errors):
            ax.errorbar(x, bottom, yerr=errors, fmt="none", ecolor="black", capsize=4, linewidth=1)
        for i, total in enumerate(bottom):
            ax.annotate(fmt(total), (i, total + errors[i]), ha="center", va="bottom", fontsize=9)
        ax.set_xticks(x, names, rotation=20 if len(names) > 3 else 0)
        ax.set_ylabel(unit)
        ax.set_ylim(0, max((b + e for b, e in zip(bottom, errors)), default=0) * 1.12 or 1)
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2, fontsize=8, frameon=False)

    roles = roles_of(rs)
    others = iter(OTHER_COLORS * len(roles))
    stack(mem, {role_label(k): [mean_of(r["memory"]["roles_bytes"].get(k, 0)) / MIB for r in rs] for k in roles},
          [COLORS.get(k) or next(others) for k in roles], "MiB")
    mem.set_title("memory held by each role")
    phases = ("rollout", "reward", "scoring", "update", "other")
    stack(tim, {PHASE_LABELS[p]: [max(0.0, mean_of(r["time_median_s"][p]) or 0.0) for r in rs] for p in phases},
          ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#b0b0b0"], "seconds per step (median)", lambda t: f"{t:.3g} s",
          totals=[r["time_median_s"]["step"] for r in rs])
    tim.set_title("time per step by phase")
    for name, r in runs.items():
        pts = [p for p in r["curve"] if p.get("eval_accuracy") is not None]
        if not pts:
            continue
        acc = [mean_of(p["eval_accuracy"]) for p in pts]
        sd = [sd_of(p["eval_accuracy"]) for p in pts]
        steps, walls = [p["step"] for p in pts], [mean_of(p["wall_seconds"]) for p in pts]
        line, = by_step.plot(steps, acc, marker="o", label=name)
        by_wall.plot(walls, acc, marker="o", label=name, color=line.get_color())
        if any(sd):
            low, high = [a - d for a, d in zip(acc, sd)], [a + d for a, d in zip(acc, sd)]
            by_step.fill_between(steps, low, high, color=line.get_color(), alpha=0.18, linewidth=0)
            by_wall.errorbar(walls, acc, yerr=sd, fmt="none", ecolor=line.get_color(), alpha=0.5, capsize=3)
    seeds = " (mean ± sd over seeds)" if any(isinstance(p.get("eval_accuracy"), Spread)
                                            for r in rs for p in r["curve"]) else ""
    for ax, label, title in ((by_step, "step", "held-out accuracy against step"),
                             (by_wall, "wall time (s)", "held-out accuracy against wall time")):
        ax.set_xlabel(label)
        ax.set_ylabel("held-out accuracy (greedy)" + seeds)
        top = max((y for line in ax.lines for y in line.get_ydata()), default=0.0)
        ax.set_ylim(0, min(1.0, max(0.05, top * 1.15)))
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2, fontsize=8, frameon=False)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(runs: dict[str, dict], plan: Plan, seeds: dict[str, list[dict]] | None = None) -> None:
    """Writes compare.json (with each seed's numbers, when several), compare.md and compare.png to plan.out and
    prints the tables."""
    settings = {"recipes": plan.recipes, "steps": plan.steps, "eval_every": plan.eval_every,
                "overrides": plan.overrides, "notes": plan.notes, "seeds": plan.seed_list or None}
    tree = {"settings": settings, "runs": runs, **({"seed_runs": seeds} if seeds else {})}
    as_json = lambda x: x.as_json() if isinstance(x, Spread) else str(x)  # noqa: E731
    (plan.out / "compare.json").write_text(json.dumps(tree, indent=2, default=as_json) + "\n")
    (plan.out / "compare.md").write_text(markdown(runs, plan))
    plot(runs, plan.out / "compare.png")
    show(runs)


def main(argv: list[str]) -> int:
    """`posttrain compare RECIPE ... [key=value ...]`: 0 done, UserError on bad input (also when a run says so), 1
    when a run fails otherwise."""
    p = plan(argv)
    for note in p.notes:
        print(f"posttrain compare: {note}", file=sys.stderr)
    todo = [(name, recipe, out, extra) for name, recipe in p.recipes.items() for out, extra in p.runs(name)]
    for i, (name, recipe, out, extra) in enumerate(todo, 1):
        what = f"{name}, {extra[0]}" if extra else name
        print(f"posttrain compare: running {what} ({i}/{len(todo)}) into {out}", file=sys.stderr)
        try:
            run_one(name, recipe, p, f"[{what}]", out, tuple(extra))
        except RunFailed as err:
            if err.code == 2:
                raise UserError(f"{name}: the run refused its input: {err.last_line}") from None
            print(f"posttrain: error: {what}: the run failed (exit status {err.code}): {err.last_line}",
                  file=sys.stderr)
            return 1
    seeds = {name: [load_run(out) for out, _ in p.runs(name)] for name in p.recipes}
    runs = {name: over_seeds(each) for name, each in seeds.items()}
    report(runs, p, seeds if p.seed_list else None)
    print(f"report: {p.out / 'compare.md'}, compare.json, compare.png")
    return 0
