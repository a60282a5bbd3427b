"""What `posttrain compare` will run: the recipes, the overrides every run gets, and the budget they share.

`plan` reads `RECIPE ... key=value ...`, loads every recipe with the overrides (so that a bad key fails before any run
starts), and adds what a fair comparison needs unless the user set it: one `seed`, one step budget (the smallest
`train.steps`), one set of held-out problems (the smallest `eval.num_problems`) and an evaluation every `eval_every`
steps. Each choice, and each difference between the recipes' model, data, rollout or reward settings that it leaves
alone, becomes a note for the report.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from posttrain import config
from posttrain.core.errors import ConfigError, UserError
from posttrain.core.outputs import check_output_dir

OWN_KEYS = ("output_dir", "overwrite", "steps", "eval_every", "seeds")
ALIGNED = ("model.", "warmup.", "data.", "rollout.", "rewards.", "reward_model.", "eval.max_new_tokens")


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
    out = check_output_dir(settings.get("output_dir", "runs/compare"), example="runs/compare")
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
