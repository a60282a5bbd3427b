"""Fingerprints of short runs: every recipe, and GRPO and PPO with each adaptive feature on, 3 steps each.

A fingerprint is the SHA-256 of the trained `model.safetensors` and every logged metric except times, rates and the
thread count. A change that should not alter what a run computes (a refactor) must leave every fingerprint as it was:

    python bench/fingerprint.py --write before.json      # on the commit before the change
    python bench/fingerprint.py --compare before.json    # after it: exits 1 and names each case that differs

Metrics a change adds are not differences; a metric that changed value or went missing is.
Runs are in fp32 with one thread, on a tiny model given a short SFT (the tests' warm model), so they repeat exactly.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from anywhere: the repository's posttrain, not an installed one

FIXTURES = ROOT / "tests" / "fixtures" / "gsm8k"
COMMON = ["train.steps=3", "train.batch_size=4", "train.micro_batch_size=5", "eval.num_problems=4",
          "rollout.max_new_tokens=8", "data.difficulty=1", "data.train_size=150", "data.test_size=20",
          "train.precision=fp32", "train.threads=1"]
GROUP = ["algorithm.group_size=4"]
FEW = ["data.train_size=6"]  # prompts come back within 3 steps: pass rates and the elite pool have a history
RECIPES = {"rft_math": ["algorithm.num_prompts=16"], "dpo_math": ["algorithm.num_prompts=16"],
           "ppo_math": ["algorithm.samples_per_prompt=2"],
           "sft_gsm8k": [f"data.path={FIXTURES / 'train_head.jsonl'}", "eval.k=2",
                         f"data.test_path={FIXTURES / 'test_head.jsonl'}"],
           **{r: GROUP for r in ("grpo_math", "grpo_ps_math", "gspo_math", "drgrpo_math", "dapo_math", "rloo_math",
                                 "reinforce_pp_math")}}
FEATURES = {  # name: (recipe, overrides)
    "grpo_mu2": ("grpo_math", [*GROUP, "algorithm.mu=2"]),
    "grpo_dynamic": ("grpo_math", [*GROUP, "rollout.dynamic_sampling=true", "rollout.max_sampling_rounds=3"]),
    "grpo_elite": ("grpo_math", [*GROUP, "rollout.elite_pool=4", "rollout.elite_is_cap=1.0", *FEW]),
    "grpo_temperature": ("grpo_math", [*GROUP, "rollout.adaptive_temperature=true"]),
    "grpo_group_size": ("grpo_math", [*GROUP, "rollout.adaptive_group_size=true", "rollout.min_group_size=2",
                                      "rollout.max_group_size=6", *FEW]),
    "grpo_curriculum_rate": ("grpo_math", [*GROUP, "data.curriculum=pass_rate", *FEW]),
    "grpo_curriculum_field": ("grpo_math", [*GROUP, "data.curriculum=field", "data.difficulty_field=level",
                                            "data.path={levels}", "data.test_path={held_out}"]),
    "grpo_beta_cosine": ("grpo_math", [*GROUP, "train.beta_schedule=cosine", "train.beta_values=[0.1,0.01]"]),
    "grpo_overlong": ("grpo_math", [*GROUP, "rewards.overlong_buffer=6"]),
    "grpo_tis": ("grpo_math", [*GROUP, "rollout.tis_cap=2.0"]),
    "grpo_all": ("grpo_math", [*GROUP, "rollout.dynamic_sampling=true", "rollout.elite_pool=4",
                               "rollout.adaptive_temperature=true", "data.curriculum=pass_rate",
                               "rewards.overlong_buffer=4", "train.beta_schedule=cosine",
                               "train.beta_values=[0.1,0.01]", *FEW]),
    "grpo_early_stop": ("grpo_math", [*GROUP, "eval.every=1", "eval.stop_on=accuracy", "eval.patience=1"]),
    "ppo_mu1": ("ppo_math", ["algorithm.samples_per_prompt=2", "algorithm.ppo_epochs=1",
                           "algorithm.num_minibatches=1"]),
    "ppo_beta_cosine": ("ppo_math", ["algorithm.samples_per_prompt=2", "train.beta_schedule=cosine",
                                     "train.beta_values=[0.1,0.01]"]),
    "online_rft_dynamic": ("online_rft_math", ["algorithm.samples_per_prompt=4", "rollout.dynamic_sampling=true"]),
    # how a run is assembled: rollout workers at k = 0 (one worker samples from the trainer's generator) and k = 1,
    # the reference on the workers, packed micro-batches under a token budget, episodes in an environment
    "grpo_separate_k0": ("grpo_math", [*GROUP, "rollout.placement=separate", "rollout.workers=1"]),
    "grpo_separate_k1": ("grpo_math", [*GROUP, "rollout.placement=separate", "rollout.workers=1",
                                       "rollout.max_staleness=1"]),
    "grpo_reference_on_workers": ("grpo_math", [*GROUP, "rollout.placement=separate", "rollout.workers=1",
                                                "rollout.reference_on=workers"]),
    "grpo_packed": ("grpo_math", [*GROUP, "train.packing=true", "train.micro_batch_tokens=96"]),
    "grpo_calculator": ("grpo_math", [*GROUP, "env.name=calculator", "env.max_turns=2"]),
}
VOLATILE = ("time/", "clock/", "tokens_per_s", "wall_seconds", "threads")  # times, rates and the thread count


def warm_model(root: Path) -> Path:
    """The tests' warm model: a random two-layer Llama given 120 SFT steps on a±b."""
    from posttrain import config
    from posttrain.models.embedded import build_model_dir
    from posttrain.train import run

    init = build_model_dir(root / "init", hidden=64, layers=2, heads=2)
    cfg, resolved = config.load("sft_math", [f"model.path={init}", f"output_dir={root / 'warm'}", "data.difficulty=1",
                                             "data.train_size=150", "data.test_size=20", "train.steps=120",
                                             "train.lr=3e-3", "eval.num_problems=0", "train.precision=fp32",
                                             "train.threads=1"])
    run(cfg, resolved, quiet=True)
    return root / "warm" / "model"


def fingerprint(recipe: str, overrides: list[str], model: Path, out: Path) -> dict:
    from posttrain import config
    from posttrain.train import run

    levels = out.parent / "levels.jsonl"  # data files with a difficulty field, for the field curriculum: training
    held_out = out.parent / "levels_test.jsonl"  # rows and held-out ones that share no question
    if not levels.exists():
        for path, bs in ((levels, range(4)), (held_out, range(4, 6))):
            path.write_text("".join(json.dumps({"question": f"{a}+{b}", "answer": str(a + b), "level": a // 3}) + "\n"
                                    for a in range(10) for b in bs))
    overrides = [o.format(levels=levels, held_out=held_out) for o in overrides]
    cfg, resolved = config.load(recipe, [f"model.path={model}", f"output_dir={out}", *COMMON, *overrides])
    run(cfg, resolved, quiet=True)
    metrics = [{k: v for k, v in json.loads(line).items() if not k.startswith(VOLATILE)}
               for line in (out / "metrics.jsonl").read_text().splitlines()]
    digest = hashlib.sha256((out / "model" / "model.safetensors").read_bytes()).hexdigest()
    summary = json.loads((out / "summary.json").read_text())
    return {"model_sha256": digest, "metrics": metrics, "eval_after": summary.get("eval_after"),
            "early_stop": summary.get("early_stop")}


def same(before: dict | None, now: dict) -> bool:
    """Whether a case computes what it did: the same model bytes, evaluation and early stop, and every metric it
    logged then with the same value now (metrics added since are not a difference)."""
    if before is None or len(before["metrics"]) != len(now["metrics"]):
        return False
    keys = ("model_sha256", "eval_after", "early_stop")
    return all(before[k] == now[k] for k in keys) and all(
        all(k in new and new[k] == v for k, v in old.items() if not k.startswith(VOLATILE))
        for old, new in zip(before["metrics"], now["metrics"]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--write", type=Path, help="write the fingerprints to this JSON file")
    p.add_argument("--compare", type=Path, help="compare with fingerprints written before; exit 1 on a difference")
    p.add_argument("--only", nargs="*", help="only these cases")
    args = p.parse_args(argv)
    cases = {**{r: (r, o) for r, o in RECIPES.items()}, **FEATURES}
    if args.only:
        cases = {k: v for k, v in cases.items() if k in args.only}
    results, t0 = {}, time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        model = warm_model(Path(tmp))
        for name, (recipe, overrides) in cases.items():
            results[name] = fingerprint(recipe, overrides, model, Path(tmp) / name)
            print(f"{name:24s} {results[name]['model_sha256'][:16]}", flush=True)
    print(f"{len(results)} runs in {time.perf_counter() - t0:.0f}s")
    if args.write:
        args.write.write_text(json.dumps(results, indent=1, sort_keys=True))
    if args.compare:
        before = json.loads(args.compare.read_text())
        differ = [k for k in results if not same(before.get(k), results[k])]
        for k in differ:
            old = before.get(k) or {}
            what = "model bytes" if old.get("model_sha256") != results[k]["model_sha256"] else "metrics"
            print(f"DIFFERS: {k} ({what})")
        print(f"{len(results) - len(differ)} of {len(results)} fingerprints identical")
        return 1 if differ else 0
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
