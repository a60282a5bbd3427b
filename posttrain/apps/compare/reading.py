"""What the runs recorded, as the numbers compare reports: each run's from its directory (summary.json,
metrics.jsonl, config.yaml), with what `posttrain.apps.estimate` predicts for its model-state bytes beside the bytes
measured, and all of them together as `Results`, the data of compare.json."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from posttrain.apps.compare.planning import Plan
from posttrain.apps.spread import over_seeds
from posttrain.core.errors import UserError

PHASES = {"rollout": "time/rollout", "reward": "time/reward", "scoring": "time/score", "update": "time/update"}


@dataclass
class Results:
    """What a comparison found: its plan and the numbers (`numbers`) of every run, by recipe."""

    plan: Plan
    seed_runs: dict[str, list[dict]]  # recipe -> the numbers of each of its runs, one per seed (one run: a list of one)

    @property
    def runs(self) -> dict[str, dict]:
        """Each recipe's numbers: its run's own, or over seeds a tree where each figure that differs is a Spread."""
        return {name: over_seeds(each) for name, each in self.seed_runs.items()}

    def as_json(self) -> dict:
        """compare.json: the settings, `runs` and, with several seeds, each seed's numbers (`seed_runs`)."""
        p = self.plan
        settings = {"recipes": p.recipes, "steps": p.steps, "eval_every": p.eval_every, "overrides": p.overrides,
                    "notes": p.notes, "seeds": p.seed_list or None}
        return {"settings": settings, "runs": self.runs, **({"seed_runs": self.seed_runs} if p.seed_list else {})}


def read(plan: Plan) -> Results:
    """The numbers of every run of `plan`, from the directories the runs wrote."""
    return Results(plan, {name: [load_run(out) for out, _ in plan.runs(name)] for name in plan.recipes})


def load_run(run_dir: str | Path) -> dict:
    """`numbers()` of a finished run directory."""
    import yaml

    run_dir = Path(run_dir)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return numbers(json.loads((run_dir / "summary.json").read_text()), metrics,
                   yaml.safe_load((run_dir / "config.yaml").read_text()))


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
