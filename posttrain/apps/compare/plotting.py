"""compare.png: memory by role and time by phase as stacked bars, held-out accuracy against step and against wall
time as lines, one bar or line per recipe. Figures over seeds are drawn at their mean, with ± sd as error bars and
bands."""

from __future__ import annotations

from pathlib import Path

from posttrain.apps.compare.reporting import MIB, PHASE_LABELS, fmt_mib, role_label, roles_of
from posttrain.apps.spread import Spread, mean_of, sd_of

COLORS = {"policy_weights": "#1f77b4", "policy_gradients": "#6baed6", "policy_optimizer_state": "#c6dbef",
          "reference_weights": "#2ca02c", "critic_weights": "#d62728", "critic_gradients": "#fc8d59",
          "critic_optimizer_state": "#fdd0a2", "reward_model_weights": "#9467bd", "rollout_batch": "#7f7f7f"}
OTHER_COLORS = ("#bcbd22", "#17becf", "#8c564b", "#e377c2")  # roles without a colour of their own
PHASE_COLORS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#b0b0b0")  # in the order of PHASE_LABELS


def plot(runs: dict[str, dict], path: Path) -> None:
    """Four panels: memory by role (stacked, MiB), time by phase (stacked medians, s), held-out accuracy against
    step and against wall time. Figures over seeds are drawn at their mean, with ± sd as error bars and bands."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names, rs = list(runs), list(runs.values())
    x = list(range(len(names)))
    fig, (mem, tim, by_step, by_wall) = plt.subplots(1, 4, figsize=(21, 5.6), constrained_layout=True)

    def stack(ax, series, colors, unit, fmt=fmt_mib, totals=None):
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
    stack(tim, {label: [max(0.0, mean_of(r["time_median_s"][p]) or 0.0) for r in rs]
                for p, label in PHASE_LABELS.items()},
          PHASE_COLORS, "seconds per step (median)", lambda t: f"{t:.3g} s",
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
