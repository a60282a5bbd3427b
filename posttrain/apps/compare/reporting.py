"""The report's tables, recipes as columns, for the terminal (rich) and for compare.md: outcome, memory by role and
phase, the estimator's model-state bytes next to the measured ones, time per phase and throughput, and held-out
accuracy against step and wall time; with seeds, which differences between recipes exceed the seed-to-seed spread.
A figure over seeds is a `Spread` and prints as mean ± sd."""

from __future__ import annotations

from posttrain.apps.compare.planning import Plan
from posttrain.apps.spread import Spread, verdicts

ROLES = {  # role in summary.json -> label, in report order; a role not listed is shown too (`roles_of`)
    "policy_weights": "policy weights", "policy_gradients": "policy gradients",
    "policy_optimizer_state": "policy AdamW state", "reference_weights": "reference weights",
    "critic_weights": "critic weights", "critic_gradients": "critic gradients",
    "critic_optimizer_state": "critic AdamW state", "reward_model_weights": "reward model weights",
    "rollout_batch": "step batch (ids, masks, log-probs, ...)",
}
PHASE_LABELS = {"rollout": "rollout (sampling)", "reward": "reward", "scoring": "scoring (ref, old, values)",
                "update": "update (forward, backward, step)", "other": "other (collation, advantages, ...)"}
MEM_PHASES = ("rollout", "scoring", "update")
MIB = 2**20


def roles_of(runs: list[dict]) -> list[str]:
    """The roles any run measured: those of ROLES in its order, then any other (a new model a method holds)."""
    seen = {k for r in runs for k in r["memory"]["roles_bytes"]}
    return [k for k in ROLES if k in seen] + sorted(seen - ROLES.keys())


def role_label(role: str) -> str:
    return ROLES.get(role, role.replace("_", " "))


def _f(x, fmt: str) -> str:
    return "–" if x is None else format(x, fmt)


def fmt_mib(v: float | None) -> str:
    """MiB with about three significant figures."""
    if v is None:
        return "–"
    return f"{v:,.0f}" if v >= 100 else f"{v:.2f}" if v >= 1 else f"{v:.3g}"


def fmt_bytes(nbytes: int | None) -> str:
    """Bytes, as MiB (`fmt_mib`)."""
    return fmt_mib(None if nbytes is None else nbytes / MIB)


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
    memory = [row(role_label(k), lambda r, k=k: fmt_bytes(r["memory"]["roles_bytes"].get(k))) for k in roles]
    memory.append(row("all roles", lambda r: fmt_bytes(sum(r["memory"]["roles_bytes"].values()))))
    for key, what in (("cpu_peak_rss_mb", "peak RSS"), ("cuda_peak_allocated_mb", "CUDA max allocated")):
        for phase in MEM_PHASES:
            if any(phase in r["memory"][key] for r in rs):
                memory.append(row(f"{what}, {phase} phase", lambda r, k=key, p=phase: fmt_mib(r["memory"][k].get(p))))
    memory.append(row("peak RSS, whole run", lambda r: fmt_mib(r["memory"]["peak_rss_mb"])))

    def versus(r, k):
        est, got = (r["estimated_roles_bytes"] or {}).get(k), r["memory"]["roles_bytes"].get(k)
        if est is None or got is None:
            return "–"
        return f"{fmt_bytes(got)} / {fmt_bytes(est)} ({(got - est) / est:+.1%})"

    est_roles = [k for k in roles if any(k in (r["estimated_roles_bytes"] or {}) for r in rs)]
    estimate = [row(role_label(k), lambda r, k=k: versus(r, k)) for k in est_roles]
    timing = [row(label, lambda r, p=p: _f(r["time_median_s"][p], ".3f")) for p, label in PHASE_LABELS.items()]
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
    """compare.md: the command, the overrides and notes, every table, and with seeds the spread section."""
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
    `posttrain.apps.spread`), and their difference seed by seed: seed s of a against seed s of b, which share the
    seed's warm-up, data order and sampling seed, so that the part of the spread they share drops out."""
    lines = ["## Differences beyond the seed-to-seed spread", "",
             "A difference counts when |mean_b − mean_a| > sd_a + sd_b (the ± bars do not overlap): a rough screen "
             "with few seeds, not a significance test. Seed by seed: b − a within each seed (both runs from the same "
             "warm-up), as mean ± sd, and in how many seeds b was above a.", "",
             "| figure | a | b | mean b − mean a | sd a + sd b | beyond the spread | seed by seed | b above a |",
             "|---|---|---|---:|---:|---|---:|---:|"]
    change = {n: r["accuracy_after"] - r["accuracy_before"] if r["accuracy_before"] is not None else None
              for n, r in runs.items()}
    compared = [("held-out accuracy after", {n: r["accuracy_after"] for n, r in runs.items()})]
    if len({repr(r["accuracy_before"]) for r in runs.values()}) > 1:  # else the changes differ as the afters do
        compared.append(("change in held-out accuracy", change))
    for label, figures in compared:
        for a, b, diff, bar, yes in verdicts(figures):
            paired = figures[b] - figures[a]  # a Spread of each seed's difference where either varies over seeds
            values = paired.values if isinstance(paired, Spread) else (paired,)
            lines.append(f"| {label} | {a} | {b} | {diff:+.3f} | {bar:.3f} | {'yes' if yes else 'no'} | "
                         f"{paired:+.3f} | {sum(v > 0 for v in values)}/{len(values)} |")
    return lines + [""]


def show(runs: dict[str, dict]) -> None:
    """The tables, printed to the terminal."""
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
